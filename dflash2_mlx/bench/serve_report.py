"""The report of the server load test (`dflash2_mlx.bench.serve_load`): a wave's figures
from its request rows, the greedy texts compared across systems, the markdown tables, the plot
and the files under --out. matplotlib is imported where it is used."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REFERENCES = ("one-at-a-time", "mlx-lm")      # greedy texts are compared with these


def pct(values: list[float | None], q: float) -> float | None:
    """The q-quantile (0..1) of the values that are not None, interpolated linearly between
    the closest ranks (numpy's default); None if there are none."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def weighted(rows: list[dict], value: str, weight: str) -> float | None:
    """Mean of server figure `value` over the requests, weighted by figure `weight`."""
    pairs = [(s.get(value), s.get(weight) or 0) for s in (r.get("server") or {} for r in rows)]
    total = sum(w for v, w in pairs if v is not None)
    return sum(v * w for v, w in pairs if v is not None) / total if total else None


def figures(rows: list[dict], wall: float) -> dict:
    """A wave's figures from its request rows and its wall time in seconds."""
    tokens = sum(r["completion_tokens"] for r in rows)
    prompt = sum(r["prompt_tokens"] for r in rows)
    served = [r["server"] for r in rows if r.get("server")]

    def total(key):
        return sum(s.get(key) or 0 for s in served) if served else None

    return {"requests": len(rows), "completion_tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall if wall > 0 else None,
            "latency_p50": pct([r["e2e"] for r in rows], 0.5),
            "latency_p95": pct([r["e2e"] for r in rows], 0.95),
            "ttft_p50": pct([r["ttft"] for r in rows], 0.5),
            "ttft_p95": pct([r["ttft"] for r in rows], 0.95),
            "ttft_first_turn_p50": pct([r["ttft"] for r in rows if r["turn"] == 0], 0.5),
            "ttft_later_turns_p50": pct([r["ttft"] for r in rows if r["turn"] > 0], 0.5),
            "decode_tps_p50": pct([r["decode_tps"] for r in rows], 0.5),
            "cache_hit_rate": sum(r["cached_tokens"] for r in rows) / prompt if prompt else 0.0,
            "mean_prompt_tokens": prompt / len(rows) if rows else 0,
            "tau": weighted(rows, "tau", "cycles"),
            "tau_drafter": weighted(rows, "tau_drafter", "cycles_drafter"),
            "tau_lookup": weighted(rows, "tau_lookup", "cycles_lookup"),
            "cycles_drafter": total("cycles_drafter"), "cycles_lookup": total("cycles_lookup"),
            "plain_steps": total("plain_steps")}


def compare_texts(waves: dict) -> None:
    """Adds to each wave of waves[kind/clients][system] `same_as[ref]`: True / False whether
    every request's greedy text equals the same request's (client, turn) on system ref in the
    same (kind, clients), None where ref did not run it; and `differing[ref]`, the (client,
    turn) keys that differ."""
    for by_system in waves.values():
        texts = {s: {(r["client"], r["turn"]): r["text"] for r in w["rows"]}
                 for s, w in by_system.items()}
        for system, w in by_system.items():
            w["same_as"], w["differing"] = {}, {}
            for ref in REFERENCES:
                if ref not in texts:
                    w["same_as"][ref] = None
                    continue
                keys = sorted(set(texts[ref]) | set(texts[system]))
                diff = [k for k in keys if texts[ref].get(k) != texts[system].get(k)]
                w["same_as"][ref], w["differing"][ref] = not diff, diff


def rows_of(results: dict):
    """(kind, clients, system, wave figures) of every wave, in run order."""
    for key, by_system in results["waves"].items():
        kind, clients = key.split("/")
        for system, w in by_system.items():
            yield kind, int(clients), system, w


def markdown(results: dict) -> str:
    """The summary (ours against mlx-lm, as the issue's table) and the table of every wave."""
    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    def ratio(a, b):
        return f"{a / b:.2f}x" if a is not None and b else "-"

    def same(v):
        return {True: "yes", False: "**no**", None: "-"}[v]

    waves = results["waves"]
    lines = ["| kind | clients | ours tok/s | mlx-lm tok/s | ours / mlx-lm | ours p95 latency s |"
             " mlx-lm p95 latency s | one-at-a-time tok/s | spec-off tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, by_system in waves.items():
        kind, clients = key.split("/")
        ours, mlx = by_system.get("ours", {}), by_system.get("mlx-lm", {})
        lines.append(f"| {kind} | {clients} | {f(ours.get('tok_s'), '{:.1f}')} | "
                     f"{f(mlx.get('tok_s'), '{:.1f}')} | "
                     f"{ratio(ours.get('tok_s'), mlx.get('tok_s'))} | "
                     f"{f(ours.get('latency_p95'))} | {f(mlx.get('latency_p95'))} | "
                     f"{f(by_system.get('one-at-a-time', {}).get('tok_s'), '{:.1f}')} | "
                     f"{f(by_system.get('spec-off', {}).get('tok_s'), '{:.1f}')} |")
    lines += ["", "| kind | clients | system | tok/s | / mlx-lm | latency p50 / p95 s | "
              "TTFT p50 / p95 s | peak RSS MB | mean batch | tau | cycles drafter / lookup / "
              "plain | prefix-cache hit | = one-at-a-time | = mlx-lm |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for kind, clients, system, w in rows_of(results):
        mlx = waves[f"{kind}/{clients}"].get("mlx-lm", {})
        cycles = ("-" if w["cycles_drafter"] is None else
                  f"{w['cycles_drafter']} / {w['cycles_lookup']} / {w['plain_steps']}")
        lines.append(
            f"| {kind} | {clients} | {system} | {f(w['tok_s'], '{:.1f}')} | "
            f"{ratio(w['tok_s'], mlx.get('tok_s'))} | {f(w['latency_p50'])} / "
            f"{f(w['latency_p95'])} | {f(w['ttft_p50'])} / {f(w['ttft_p95'])} | "
            f"{f(w['peak_rss_mb'], '{:.0f}')} | {f(w['mean_batch'])} | {f(w['tau'])} | "
            f"{cycles} | {w['cache_hit_rate']:.0%} | "
            f"{same(w.get('same_as', {}).get('one-at-a-time'))} | "
            f"{same(w.get('same_as', {}).get('mlx-lm'))} |")
    if "error" in results:
        lines += ["", f"Stopped early by a failed request: {results['error']}"]
    if "load_average_before" in results:
        lines += ["", "Load average (1 min) before / after the waves: "
                  f"{results['load_average_before'][0]:.1f} / "
                  f"{results['load_average_after'][0]:.1f} ({os.cpu_count()} cores)."]
    if "single-client" in results:
        s = results["single-client"]
        lines += ["", f"Single client, same request, no prefix cache: server "
                  f"{s['server_decode_tps']:.1f} tok/s decode (client-timed; "
                  f"{s['server_engine_decode_tps']:.1f} timed by its engine), "
                  f"Pipeline.generate {s['pipeline_decode_tps']:.1f} tok/s in the benchmark "
                  f"process: {s['ratio']:.3f}x (medians of {len(s['runs']['server'])}, "
                  "interleaved)."]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """tok/s against clients, one panel per kind, one line per system, as a PNG at path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(k for k, *_ in rows_of(results)))
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.5 * len(kinds), 3.6), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        lines: dict[str, list] = {}
        for k, clients, system, w in rows_of(results):
            if k == kind and w["tok_s"] is not None:
                lines.setdefault(system, []).append((clients, w["tok_s"]))
        for system, points in lines.items():
            points.sort()
            ax.plot(*zip(*points), marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({c for p in lines.values() for c, _ in p}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_title(kind)
        ax.set_xlabel("concurrent clients")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("aggregate tok/s")
    axes[0][-1].legend(fontsize="small")
    fig.suptitle(f"serve under load, {results['settings']['max_tokens']} new tokens, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)



def write(results: dict, table: str, out: Path) -> None:
    """serve_load.json, serve_load.md (the table) and, with matplotlib, serve_load.png in out."""
    from ..files import atomic_path, atomic_write

    out.mkdir(parents=True, exist_ok=True)
    with atomic_write(out / "serve_load.json") as f:
        f.write(json.dumps(results, indent=2) + "\n")
    with atomic_write(out / "serve_load.md") as f:
        f.write(table + "\n")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("no plot: matplotlib is missing (pip install 'dflash2-mlx[bench]')",
              file=sys.stderr)
    else:
        with atomic_path(out / "serve_load.png") as tmp:
            plot(results, tmp)
