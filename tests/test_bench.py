"""The side-by-side benchmark: structure of its results and the greedy identity check."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from dflash2_mlx.bench.report import markdown, write
from dflash2_mlx.bench.results import Run, add_ratios, summarize, unfinished
from dflash2_mlx.bench.run import _plain, prefilled, run_bench
from dflash2_mlx.decode.stats import Cycle
from fixtures import drafter_args, write_drafter


@pytest.mark.slow  # 12 s: 4 widths x 2 temperatures x 3 prompts
def test_run_bench_on_tiny_fixtures(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    drafter = write_drafter(tmp_path / "b4", drafter_args(dflash2=True, block_size=4), seed=2)
    sets = {"code": ["def add(a, b):", "def add(a, b):\n    return a + b\ndef add(a, b):"],
            "chat": ["Hello there"]}
    results = run_bench(str(llama_dir), str(drafter), sets, block_sizes=(2, 4, 8, "auto"),
                        temperatures=(0.0, 1.0), max_tokens=16, reference=False)
    greedy = results["code T=0"]
    assert greedy["greedy_identical"] and greedy["mismatches"] == []
    names = set(greedy["systems"])
    # 8 is beyond the drafter's block size 4: the hybrid only (its lookup cycles reach it)
    assert names == {"mlx-lm", "dflash2-mlx b=2", "dflash2-mlx b=4", "dflash2-mlx b=auto",
                     "hybrid b=2", "hybrid b=4", "hybrid b=8", "hybrid b=auto"}
    assert max(greedy["systems"]["hybrid b=8"]["position_acceptance_lookup"] and [8]) == 8
    for name, row in greedy["systems"].items():
        assert row["decode_tps"] > 0 and row["requests"] == 2 and row["peak_mb"] > 0
    assert greedy["systems"]["mlx-lm"]["speedup"] == 1.0
    alone, hybrid = greedy["systems"]["dflash2-mlx b=4"], greedy["systems"]["hybrid b=4"]
    assert len(alone["position_acceptance"]) == 3 and alone["cycles_lookup"] == 0
    assert alone["tau_lookup"] is None and hybrid["cycles_lookup"] > 0
    assert {"code T=1", "chat T=0", "chat T=1"} <= set(results)
    assert "greedy_identical" not in results["code T=1"]
    table = markdown(results)
    assert "| hybrid b=4 |" in table and "greedy outputs identical" in table
    assert "**chat T=0**" in table
    json.dumps(results)


def test_summary_pools_positions():
    runs = [Run([1, 2, 3, 4], 0.1, 1.0, 5.0, [Cycle("drafter", 4, 2), Cycle("drafter", 4, 0)]),
            Run([1, 2], 0.3, 1.0, 7.0, [Cycle("drafter", 4, 1), Cycle("lookup", 6, 5),
                                         Cycle("plain", 1, 0), Cycle("lookup", 8, 1)])]
    s = summarize(runs)
    assert s["decode_tps"] == 2.0               # (3 + 1) tokens after the first / 2 s
    assert s["position_acceptance_drafter"] == [2 / 3, 1 / 2, 0.0]
    assert s["position_acceptance_lookup"] == [1.0, 0.5, 1.0, 1.0, 1.0, None, None]  # 6, 7 untried
    assert s["tau_drafter"] == 2.0 and s["tau_lookup"] == 4.0
    assert abs(s["tau"] - (3 + 1 + 2 + 6 + 2) / 5) < 1e-9 and s["peak_mb"] == 7.0
    assert s["plain_steps"] == 1 and abs(s["mean_width"] - 27 / 6) < 1e-9


def test_cli_bench_rejects_bad_lists(tmp_path):
    exe = Path(sys.executable).parent / "dflash2-mlx"
    for flag, value, text in (("--block-sizes", "2,x", "--block-sizes"),
                              ("--temperatures", "0,hot", "--temperatures"),
                              ("--temperatures", "0,inf", "--temperatures")):
        r = subprocess.run([str(exe), "bench", "--model", "m", "--draft", "d", flag, value],
                           capture_output=True, text=True)
        assert r.returncode != 0 and text in r.stderr and "Traceback" not in r.stderr


def test_ratios_are_paired_per_prompt():
    """Prompt 2 stalled for plain decoding: paired medians are not swung by it."""
    table = add_ratios({"mlx-lm": {"per_prompt_tps": [10.0, 1.0, 10.0]},
                        "dflash2-mlx b=2": {"per_prompt_tps": [20.0, 20.0, 22.0]},
                        "reference b=2": {"per_prompt_tps": [10.0, 10.0, 10.0]},
                        "dflash2-mlx b=auto": {"per_prompt_tps": [15.0, 15.0, 15.0]}})
    assert table["dflash2-mlx b=2"]["speedup"] == 2.2
    assert table["dflash2-mlx b=2"]["vs_reference"] == 2.0
    assert table["reference b=2"]["speedup"] == 1.0 and "vs_reference" not in table["reference b=2"]
    assert "vs_reference" not in table["dflash2-mlx b=auto"]


def test_the_reference_loader_is_patched_only_while_loading(monkeypatch, llama_dir, dflash_dir):
    """The bench replaced the reference package's snapshot_download for good."""
    import types

    from dflash2_mlx.bench import run

    seen = []
    fake = types.ModuleType("dflash.model_mlx")
    fake.snapshot_download = original = lambda *a, **k: "hub"
    fake.load_draft = lambda path: (seen.append(fake.snapshot_download(path)), _Draft())[1]
    monkeypatch.setitem(sys.modules, "dflash", types.ModuleType("dflash"))
    monkeypatch.setitem(sys.modules, "dflash.model_mlx", fake)
    run.Reference(str(llama_dir), str(dflash_dir))
    assert seen == [str(dflash_dir)] and fake.snapshot_download is original


class _Draft:
    def parameters(self):
        return {}

    def update(self, _params):
        pass


def test_long_context_sets_prefill_once_and_compare_with_mlx_lm(llama_dir, tmp_path,
                                                                 monkeypatch):
    """A "long-" set: every system, mlx-lm's loop the baseline, from a copy of one prefilled
    state; greedy outputs identical to it, and to mlx-lm decoding the prompt from scratch."""
    from mlx_lm.generate import generate_step

    import dflash2_mlx

    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    drafter = write_drafter(tmp_path / "b4", drafter_args(dflash2=True, block_size=4), seed=2)
    text = "def add(a, b):\n    return a + b\n" * 12
    prompt = text + "def add("
    results = run_bench(str(llama_dir), str(drafter), {"long-edit-test": [prompt]},
                        block_sizes=(4, "auto"), temperatures=(0.0,), max_tokens=12,
                        reference=False, repeats=2)
    part = results["long-edit-test T=0"]
    assert results["setup"]["repeats"] == 2
    assert {row["requests"] for row in part["systems"].values()} == {2}    # two rounds each
    assert part["baseline"] == "mlx-lm" and part["greedy_identical"]
    assert set(part["systems"]) == {"mlx-lm", "dflash2-mlx b=4", "dflash2-mlx b=auto",
                                    "hybrid b=4", "hybrid b=auto"}
    assert part["systems"]["mlx-lm"]["speedup"] == 1.0
    assert part["prompt_tokens"] > 100
    assert "speedup over mlx-lm" in markdown(results)
    # the baseline from the shared state is mlx-lm's greedy decoding of the whole prompt
    pipe = dflash2_mlx.load(str(llama_dir), str(drafter))
    ids = pipe.encode(prompt)
    state, _ = prefilled(pipe, ids)
    stop = set(pipe.tokenizer.eos_token_ids)
    alone = []
    for token, _ in generate_step(mx.array(ids), pipe.target, max_tokens=12,
                                  sampler=lambda x: mx.argmax(x, axis=-1)):
        alone.append(token)
        if token in stop:
            break
    assert _plain(pipe, ids, 0.0, 12, 0, stop, state).tokens == alone
    assert len(state.tokens) == len(ids) - 1            # the copy was used, not the state


def test_an_interrupted_bench_resumes_keeping_the_parts_it_measured(llama_dir, tmp_path,
                                                                    monkeypatch):
    """bench.json after every part, marked unfinished; run again with the same settings, the
    kept parts are not measured again; other settings, or a finished run, are measured anew."""
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    drafter = write_drafter(tmp_path / "b4", drafter_args(dflash2=True, block_size=4), seed=2)
    sets, out = {"code": ["def add(a, b):"], "chat": ["Hello there"]}, tmp_path / "out"
    kw = dict(block_sizes=(2,), temperatures=(0.0,), reference=False)

    class Interrupted(Exception):
        pass

    def stop_after_one(results):
        write(results, out, plots=False)
        raise Interrupted

    with pytest.raises(Interrupted):
        run_bench(str(llama_dir), str(drafter), sets, max_tokens=8, checkpoint=stop_after_one,
                  **kw)
    earlier = unfinished(out)
    assert [k for k in earlier if k != "setup"] == ["code T=0"]
    assert earlier["setup"]["complete"] is False
    assert "**code T=0**" in (out / "bench.md").read_text()

    measured = []
    results = run_bench(str(llama_dir), str(drafter), sets, max_tokens=8, earlier=earlier,
                        checkpoint=lambda r: measured.append(list(r)[1:]), **kw)
    assert measured == [["code T=0", "chat T=0"]]         # one part measured: the chat one
    assert results["code T=0"] == earlier["code T=0"] and results["setup"]["complete"]
    write(results, out, plots=False)
    assert unfinished(out) is None                         # finished: a rerun measures anew

    measured.clear()
    other = run_bench(str(llama_dir), str(drafter), sets, max_tokens=6, earlier=earlier,
                      checkpoint=lambda r: measured.append(list(r)[1:]), **kw)
    assert len(measured) == 2 and other["setup"]["max_tokens"] == 6

    (out / "bench.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"out/bench.json: not the bench.json of a bench run"):
        unfinished(out)


def test_long_prompt_sets_reach_their_sizes():
    from dflash2_mlx.bench.prompt_sets import PROMPT_SETS

    for kind in ("edit", "log", "agent", "quote"):
        short, long = PROMPT_SETS[f"long-{kind}-2k"](1)[0], PROMPT_SETS[f"long-{kind}-8k"](1)[0]
        assert 3000 < len(short) < len(long) / 3, kind
    assert PROMPT_SETS["long-log-4k"](2) == PROMPT_SETS["long-log-4k"](2)     # deterministic
