import os
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


# The markers (registered in pyproject.toml) are on the tests themselves: `pytestmark` where a
# whole module has one (test_distributed, test_server, test_responses, test_metal_kernels), else
# a decorator on the test. `slow` marks a test that took 8 s or more, with the seconds in a
# comment beside it: the lesser of two runs file by file with --durations=0 on the project's
# 2-core CPU machine while other work shared it (load 4-8, about twice what an unshared run
# takes: ~4-5 s there); where a fixture pays (test_distributed's `exactness_run`), every test
# that needs it is marked. `pytest -m "not slow"` is the quick run (it leaves out the
# statistical sampling tests: run the whole suite before a merge); `-m "not distributed and not
# server"` leaves out the tests that start servers or ranks. `rows` marks the modules that
# compare a forward of several rows with single rows: .ci/run runs them once more under another
# MKL code path, so that none leans on how one machine's BLAS rounds (each asserts the contract
# whatever the row check decides; docs/decisions.md).


@pytest.hookimpl(tryfirst=True)      # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """A test that needs the `server` fixture below starts a server: marked `server`."""
    for item in items:
        if "server" in item.fixturenames:
            item.add_marker("server")


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
