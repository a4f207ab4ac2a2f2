"""The pure helpers of the server load test (`dflash2_mlx.bench.serve_load`, its
`serve_report` and `serve_systems`): quantiles, a wave's figures, the text comparison, the
table, the system check, the agent prompts' source files. No server runs here."""

import subprocess
import sys
from pathlib import Path

import pytest

from dflash2_mlx.bench import serve_load, serve_report, serve_systems

ROOT = Path(__file__).resolve().parents[1]


def row(client, turn, text="a", tokens=10, e2e=1.0, ttft=0.1, server=None):
    return {"client": client, "turn": turn, "text": text, "completion_tokens": tokens,
            "prompt_tokens": 20, "cached_tokens": 5, "e2e": e2e, "ttft": ttft,
            "decode_tps": 9.0, "server": server}


def test_pct_linear_skips_none():
    assert serve_report.pct([], 0.5) is None
    assert serve_report.pct([None, None], 0.5) is None
    assert serve_report.pct([3.0], 0.95) == 3.0
    values = [float(v) for v in range(20, 0, -1)]    # 20..1, any order
    assert serve_report.pct(values, 0.5) == pytest.approx(10.5)
    assert serve_report.pct(values, 0.95) == pytest.approx(19.05)     # 1 + 0.95 * 19
    assert serve_report.pct([5.0, None, 1.0], 1.0) == 5.0
    assert serve_report.pct([5.0, None, 1.0], 0.0) == 1.0


def test_figures_aggregate_and_weighted_tau():
    stats = [{"tau": 3.0, "cycles": 2, "cycles_drafter": 2, "cycles_lookup": 0,
              "plain_steps": 1, "tau_drafter": 3.0, "tau_lookup": None},
             {"tau": 1.5, "cycles": 6, "cycles_drafter": 0, "cycles_lookup": 6,
              "plain_steps": 4, "tau_drafter": None, "tau_lookup": 1.5}]
    rows = [row(0, 0, e2e=1.0, server=stats[0]), row(1, 0, tokens=30, e2e=3.0,
                                                     server=stats[1])]
    f = serve_report.figures(rows, wall=4.0)
    assert f["tok_s"] == pytest.approx(40 / 4.0)     # all tokens over the wave's wall time
    assert f["latency_p50"] == pytest.approx(2.0) and f["latency_p95"] == pytest.approx(2.9)
    assert f["tau"] == pytest.approx((3.0 * 2 + 1.5 * 6) / 8)
    assert f["tau_drafter"] == 3.0 and f["tau_lookup"] == 1.5
    assert (f["cycles_drafter"], f["cycles_lookup"], f["plain_steps"]) == (2, 6, 5)
    assert f["cache_hit_rate"] == pytest.approx(10 / 40)
    plain = serve_report.figures([row(0, 0)], wall=1.0)     # mlx-lm: no dflash2 figures
    assert plain["tau"] is None and plain["cycles_drafter"] is None


def test_compare_texts_per_request():
    waves = {"chat/2": {
        "ours": {"rows": [row(0, 0, "x"), row(1, 0, "y")]},
        "one-at-a-time": {"rows": [row(0, 0, "x"), row(1, 0, "y")]},
        "mlx-lm": {"rows": [row(0, 0, "x"), row(1, 0, "z")]}}}
    serve_report.compare_texts(waves)
    ours = waves["chat/2"]["ours"]
    assert ours["same_as"] == {"one-at-a-time": True, "mlx-lm": False}
    assert ours["differing"]["mlx-lm"] == [(1, 0)]
    only = {"chat/1": {"ours": {"rows": [row(0, 0)]}}}
    serve_report.compare_texts(only)
    assert only["chat/1"]["ours"]["same_as"] == {"one-at-a-time": None, "mlx-lm": None}


def test_markdown_ratio_and_mismatch():
    def wave(tok_s, text):
        rows = [row(0, 0, text)]
        return {**serve_report.figures(rows, 1.0), "tok_s": tok_s, "peak_rss_mb": 100.0,
                "mean_batch": None, "rows": rows}

    results = {"waves": {"code/4": {"ours": wave(60.0, "a"), "one-at-a-time": wave(30.0, "a"),
                                    "mlx-lm": wave(50.0, "b")}}}
    serve_report.compare_texts(results["waves"])
    table = serve_report.markdown(results)
    assert "| code | 4 | 60.0 | 50.0 | 1.20x |" in table
    assert "| code | 4 | ours | 60.0 | 1.20x |" in table
    ours_line = next(l for l in table.splitlines() if l.startswith("| code | 4 | ours |"))
    assert ours_line.endswith("| yes | **no** |")


def test_batch_sample_reads_health():
    health = {"batch": {"mode": "batch", "running": 3, "last_step": {"rows": 7}}}
    assert serve_load.batch_sample(health) == {"mode": "batch", "running": 3, "rows": 7}
    assert serve_load.batch_sample({"busy": True}) is None


def test_check_systems_names_the_flag():
    serve_systems.check_systems(["ours", "spec-off", "mlx-lm"], {"--block-size", "--no-lookup"})
    with pytest.raises(ValueError, match="--max-batch"):
        serve_systems.check_systems(["one-at-a-time"], {"--block-size"})
    with pytest.raises(ValueError, match="unknown system 'fast'"):
        serve_systems.check_systems(["fast"], set())


def test_plans_same_seats():
    prompts = {"chat": [f"p{i}" for i in range(8)]}
    p = serve_load.plans("chat", 2, requests=2, turns=3, chars=100, prompts=prompts)
    assert [q.turns for q in p] == [["p0", "p1"], ["p2", "p3"]]
    assert not p[0].keep_history
    agent = serve_load.plans("agent", 3, requests=2, turns=2, chars=100, prompts=prompts)
    assert len(agent) == 3 and agent[0].keep_history and len(agent[0].turns) == 2
    assert agent[0].base[0]["role"] == "system"


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    waves = {f"{kind}/{c}": {s: {**serve_report.figures([row(0, 0)], 1.0 / c), "rows": []}
                             for s in ("ours", "mlx-lm")}
             for kind in ("code", "agent") for c in (1, 2, 4)}
    path = tmp_path / "serve_load.png"
    serve_report.plot({"waves": waves, "settings": {"max_tokens": 96}}, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_agent_prompts_source_files_exist():
    for name in serve_load.SOURCES:
        assert serve_load.source_file(name).is_file(), name


def test_importing_it_stays_light():
    """The package module imports httpx, MLX and mlx-lm only where it uses them."""
    code = ("import sys, dflash2_mlx.bench.serve_load; "
            "print(sorted(m for m in ('httpx', 'mlx_lm', 'openai') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"
