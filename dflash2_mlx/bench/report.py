"""The bench's report: `bench.json`, `bench.md` (one table per prompt set and temperature)
and, with matplotlib installed (`pip install dflash2-mlx[bench]`), `speedup.png`,
`acceptance.png` and, for long-context sets, `context.png`."""

from __future__ import annotations

import json
from pathlib import Path

from .. import log
from ..files import atomic_path, atomic_write
from .results import parts_of

_log = log.get(__name__)


def markdown(results: dict) -> str:
    def fmt(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    setup = results.get("setup", {})
    lines = ([f"KV cache: {setup['kv_bits']}-bit, group size {setup['kv_group_size']} (mlx-lm's "
              "QuantizedKVCache from token 0, for every system)", ""]
             if setup.get("kv_bits") else [])
    for key, part in parts_of(results):
        base = part.get("baseline", "mlx-lm")
        lines += [f"**{key}**, {part.get('prompt_tokens', 0):.0f} prompt tokens on average"
                  + (" (greedy outputs identical across all systems)"
                     if part.get("greedy_identical") else ""), "",
                  f"| system | decode tok/s | speedup over {base} | vs reference | tau | "
                  "tau drafter | tau lookup | cycles drafter / lookup / plain | mean width | "
                  "prefill s | peak MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in part["systems"].items():
            vs = f"{r['vs_reference']:.2f}x" if "vs_reference" in r else "-"
            lines.append(f"| {name} | {r['decode_tps']:.1f} | {r['speedup']:.2f}x | {vs} | "
                         f"{r['tau']:.2f} | {fmt(r['tau_drafter'])} | {fmt(r['tau_lookup'])} | "
                         f"{r['cycles_drafter']} / {r['cycles_lookup']} / {r['plain_steps']} | "
                         f"{r['mean_width']:.1f} | {r['prefill_s']:.2f} | {r['peak_mb']:.0f} |")
        lines += ["", "decode tok/s: all tokens after the first over all decode seconds; "
                  "speedup and vs reference: median over prompts of the per-prompt ratio; tau: "
                  "accepted drafts + 1 per drafting cycle, pooled over prompts.", ""]
        lines += calibration_lines(part)
    return "\n".join(lines)


def calibration_lines(part: dict) -> list[str]:
    """How well each system's predicted acceptance foretold its verified drafts: ECE and AUC
    of the predicted prefix acceptance (DeepSpec's evaluator's figures), all positions and per
    position; the drafted rows the planner cut unverified."""
    def fmt(x):
        return "-" if x is None else f"{x:.3f}"

    rows = []
    for name, r in part["systems"].items():
        for source in ("drafter", "lookup"):
            c = r.get(f"calibration_{source}")
            if not c or not c["n"]:
                continue
            per = " ".join(f"{k}:{fmt(f['ece'])}/{fmt(f['auc'])}"
                           for k, f in c["positions"].items())
            rows.append(f"| {name} | {source} | {c['n']} | {fmt(c['ece'])} | {fmt(c['auc'])} | "
                        f"{fmt(c['mean_predicted'])} / {fmt(c['mean_observed'])} | "
                        f"{r.get('cut_rows', 0)} | {per} |")
    if not rows:
        return []
    return (["| system | source | verified positions | ECE | AUC | predicted / observed | "
             "rows cut | per position k: ECE/AUC |", "|---|---|---|---|---|---|---|---|"]
            + rows + ["", "ECE, AUC: of the predicted P(drafts 1..k accepted) against whether "
                      "they were, over every verified position k (10 equal bins).", ""])


def plot(results: dict, out: Path) -> list[Path]:
    """speedup.png (each system's speedup, one panel per prompt set and temperature) and
    acceptance.png (per-position acceptance of each source: the widest fixed hybrid system's
    drafter and lookup cycles, and the drafter alone); needs matplotlib (optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = parts_of(results)
    written = []
    fig, axes = plt.subplots(len(parts), 1, figsize=(8, 2.6 * len(parts)), squeeze=False)
    for ax, (key, part) in zip(axes[:, 0], parts):
        names = list(part["systems"])
        ax.bar(range(len(names)), [part["systems"][n]["speedup"] for n in names],
               color=["gray" if n == "mlx-lm" else "tab:orange" if n.startswith("reference")
                      else "tab:green" if n.startswith("hybrid") else "tab:blue"
                      for n in names])
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_xticks(range(len(names)), names, fontsize=7, rotation=20)
        ax.set_ylabel("speedup")
        ax.set_title(key, fontsize=9)
    fig.tight_layout()
    written.append(out / "speedup.png")
    with atomic_path(written[-1]) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)

    def widest(part, prefix):
        fixed = [n for n in part["systems"] if n.startswith(prefix) and not n.endswith("auto")]
        return max(fixed, key=lambda n: int(n.split("=")[-1]), default=None)

    fig, axes = plt.subplots(len(parts), 1, figsize=(6, 2.6 * len(parts)), squeeze=False)
    for ax, (key, part) in zip(axes[:, 0], parts):
        for name, field_, style in ((widest(part, "hybrid"), "position_acceptance_lookup", "o-"),
                                    (widest(part, "hybrid"), "position_acceptance_drafter", "s-"),
                                    (widest(part, "dflash2-mlx"), "position_acceptance_drafter",
                                     "^--")):
            pos = part["systems"][name][field_] if name else []
            if any(p is not None for p in pos):
                ax.plot(range(1, len(pos) + 1), [float("nan") if p is None else p for p in pos],
                        style, label=f"{name}: {field_.rsplit('_', 1)[-1]}")
        ax.set_ylim(0, 1)
        ax.set_ylabel("P(k | < k)")
        ax.set_title(key, fontsize=9)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("draft position k")
    fig.tight_layout()
    written.append(out / "acceptance.png")
    with atomic_path(written[-1]) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    long = [(k, v) for k, v in parts if k.startswith("long-")]
    if long:
        written.append(_plot_context(plt, long, out / "context.png"))
    return written


def _plot_context(plt, parts, path: Path) -> Path:
    """Speedup over plain decoding against prompt tokens: one panel per kind of long-context
    set (long-<kind>-<size> T=<t>), one line per system, the same colour in every panel."""
    lines: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for key, part in parts:
        kind = key.split(" ", 1)[0].rsplit("-", 1)[0] + " " + key.split(" ", 1)[1]
        for name, row in part["systems"].items():
            if name != part.get("baseline"):
                lines.setdefault(kind, {}).setdefault(name, []).append(
                    (part["prompt_tokens"], row["speedup"]))
    names = sorted({n for by_name in lines.values() for n in by_name})
    colour = {n: f"C{i % 10}" for i, n in enumerate(names)}
    fig, axes = plt.subplots(1, len(lines), figsize=(3.2 * len(lines) + 1.8, 3.4),
                             sharey=True, squeeze=False)
    for ax, (kind, by_name) in zip(axes[0], sorted(lines.items())):
        for name, pts in sorted(by_name.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colour[name],
                    label=name)
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_title(kind, fontsize=9)
        ax.set_xlabel("prompt tokens")
    axes[0, 0].set_ylabel("speedup over plain decoding")
    handles = [plt.Line2D([], [], color=colour[n], marker="o", label=n) for n in names]
    fig.legend(handles=handles, loc="center right", fontsize=7)
    fig.tight_layout(rect=(0, 0, 1 - 1.8 / (3.2 * len(lines) + 1.8), 1))
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return path


def write(results: dict, out: Path, plots: bool = True) -> None:
    """bench.json and bench.md, then (with `plots` and matplotlib) the plots."""
    with atomic_write(out / "bench.json") as f:
        f.write(json.dumps(results, indent=1) + "\n")
    with atomic_write(out / "bench.md") as f:
        f.write(markdown(results))
    if not plots:
        return
    try:
        paths = plot(results, out)
        _log.info("wrote " + ", ".join(str(p) for p in [out / "bench.json", *paths]))
    except ImportError:
        _log.info(f"wrote {out / 'bench.json'}; plots need matplotlib "
                  "(pip install 'dflash2-mlx[bench]')")
