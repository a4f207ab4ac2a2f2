import os
import re
import shutil
import tempfile
from pathlib import Path

# Under pytest-xdist (`-n`), each worker's BLAS gets one thread: the workers share the cores
# (two workers with MKL's threads each, on the 2-core CI machine: 19 minutes, 10 of them system
# time; with one thread each: 15.5, and 18 in a clean-clone CI run).
if os.environ.get("PYTEST_XDIST_WORKER"):
    for var in ("MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")

import dflash2_mlx

dflash2_mlx.use_fast_blas()      # before any test imports MLX: it binds to that BLAS as it loads

import pytest

# The package cache of the test session: a temporary folder, never the user's. Set at import,
# before any test or fixture can read $DFLASH2_CACHE. The SmolLM2 target already in the user's
# cache is linked in (read only), so the tests stay offline and need not download it again.
SMOLLM2 = Path("smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
_USER_CACHE = Path(os.environ.get("DFLASH2_CACHE") or Path.home() / ".cache" / "dflash2-mlx")
TEST_CACHE = Path(tempfile.mkdtemp(prefix="dflash2-test-cache-"))
os.environ["DFLASH2_CACHE"] = str(TEST_CACHE)
if (_USER_CACHE / SMOLLM2).is_file():
    (TEST_CACHE / SMOLLM2).parent.mkdir(parents=True)
    (TEST_CACHE / SMOLLM2).symlink_to((_USER_CACHE / SMOLLM2).resolve())


# The markers (registered in pyproject.toml) are applied here, not test by test: by module, by
# the test's name, and `slow` from the measured list below. `pytest -m "not slow"` is the quick
# run (it leaves out the statistical sampling tests: run the whole suite before a merge);
# `-m "not distributed and not server"` leaves out the tests that start servers or ranks.
MODULE_MARKS = {"test_distributed": "distributed", "test_server": "server",
                "test_responses": "server", "test_metal_kernels": "metal"}
# by the test function's name: a test about Metal, one that starts `dflash2-mlx serve`
NAME_MARKS = {"metal": re.compile(r"_metal(_|$)"), "server": re.compile(r"^test_serve_|_server_")}
FIXTURE_MARKS = {"server": "server"}     # a test that needs the `server` fixture below

# `slow`: "module::name", a test function (all its cases) or a fixture (every test that needs
# it, as the first one pays for it), that took 8 s or more: the lesser of two runs file by file
# with --durations=0 on the project's 2-core CPU machine while other work shared it (load 4-8,
# about twice what an unshared run takes: ~4-5 s there; one run where a test was far past it).
# The seconds are those measurements.
SLOW = {
    "test_bench::test_run_bench_on_tiny_fixtures": "12 s: 4 widths x 2 temperatures x 3 prompts",
    "test_cli::test_embedded_default_pair": "35 s: the SmolLM2 pair through the CLI",
    "test_cli::test_bad_settings_and_values_one_line_nonzero": "8 s: 19 CLI processes",
    "test_disk_cache::test_a_second_server_process_answers_the_next_turn_from_disk":
        "11 s: two servers, one after the other",
    "test_distributed::exactness_run": "108 s: 3 targets on 2 ranks and alone",
    "test_distributed::test_three_ranks_pass_control_and_features_along_the_ring": "24 s",
    "test_distributed::test_serve_pipeline_answers_like_one_process_and_stops_on_sigterm":
        "24 s: two ranks serving HTTP",
    "test_distributed::test_a_rank_with_another_drafter_is_refused_before_loading": "20 s",
    "test_distributed::test_a_rank_killed_mid_generation_stops_rank_0_with_one_line": "16 s",
    "test_distributed::test_cli_rank_0_writes_text_summary_and_stats_json": "13 s",
    "test_sampling::test_joint_distribution_matches_target": "31-100 s a case: 2,000 runs",
    "test_sampling::test_joint_distribution_with_lookup": "25-60 s a case: 2,000 runs",
    "test_sampling::test_joint_distribution_batched_unseeded": "33-110 s a case: 2,000 runs",
    "test_sampling::test_chi2_has_power": "30 s: 2,000 runs",
    "test_sampling::test_chi2_has_power_with_lookup": "16 s: 2,000 runs",
    "test_server::test_eight_concurrent_clients_three_requests_each":
        "11 s: 24 requests and their references",
    "test_settings::test_a_prompt_beyond_the_context_is_announced":
        "10 s: a prefill past 4,096 tokens",
    "test_smollm2::test_greedy_64_tokens_equal_mlx_lm": "56 s: SmolLM2 and mlx-lm, 64 tokens",
    "test_smollm2::test_lookup_alone_on_the_gguf_target_equals_mlx_lm": "49 s",
    "test_train::test_demo_pair_greedy_equals_mlx_lm": "110 s: SmolLM2 and mlx-lm, 2 prompts",
    "test_train::test_prompts_of_an_earlier_run_are_not_drawn_again": "40 s: 80 prompts built",
    "test_train::test_training_reduces_the_loss_and_exports_an_exact_drafter":
        "8 s: 40 training steps",
}


@pytest.hookimpl(tryfirst=True)      # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__ if item.module is not None else ""
        function = getattr(item, "originalname", item.name)
        marks = {MODULE_MARKS.get(module)}
        marks |= {mark for mark, pattern in NAME_MARKS.items() if pattern.search(function)}
        marks |= {FIXTURE_MARKS.get(name) for name in item.fixturenames}
        if any(f"{module}::{n}" in SLOW for n in (function, *item.fixturenames)):
            marks.add("slow")
        for mark in sorted(marks - {None}):
            item.add_marker(mark)


@pytest.fixture(autouse=True, scope="session")
def test_cache():
    """The session's $DFLASH2_CACHE (removed at the end)."""
    assert os.environ["DFLASH2_CACHE"] == str(TEST_CACHE)
    yield TEST_CACHE
    shutil.rmtree(TEST_CACHE, ignore_errors=True)

from fixtures import (BODY, CAP, CONTEXT, KEY, Server, drafter_args, write_drafter,
                      write_target, write_tool_target)


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def llama_dir(fixture_dir):
    return write_target(fixture_dir / "llama", "llama", seed=0)


@pytest.fixture(scope="session")
def qwen3_dir(fixture_dir):
    return write_target(fixture_dir / "qwen3", "qwen3", seed=1)


@pytest.fixture(scope="session")
def dflash2_dir(fixture_dir):
    return write_drafter(fixture_dir / "dflash2", drafter_args(dflash2=True), seed=2)


@pytest.fixture(scope="session")
def dflash_dir(fixture_dir):
    return write_drafter(fixture_dir / "dflash", drafter_args(dflash2=False), seed=3)


@pytest.fixture(scope="session")
def tools_dir(fixture_dir):
    return write_tool_target(fixture_dir / "tools")


@pytest.fixture(scope="module")
def server(llama_dir, dflash2_dir):
    """`dflash2-mlx serve` on the tiny llama pair, with the key and limits of fixtures.py; one
    per test module that asks for it."""
    s = Server("--model", llama_dir, "--draft", dflash2_dir, "--api-key", KEY,
               "--max-tokens", CAP, "--context-length", CONTEXT, "--max-body-bytes", BODY,
               "--queue-size", 8)
    yield s
    assert s.stop() == 0, "".join(s.log)
    assert "Traceback" not in "".join(s.log), "".join(s.log)


@pytest.fixture(scope="module")
def oa(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
