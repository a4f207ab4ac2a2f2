"""Offline tau against training compute (anchor blocks seen), one line per recipe, from the
JSON files `benchmarks/trend.py` writes (matplotlib needed).

    python benchmarks/trend_plot.py --out docs/bench/trend/trend.png \\
        "old recipe=docs/bench/trend/old_recipe.json" \\
        "new recipe=runs/trend_ft_new.json@403732"

Each argument is LABEL=FILE, optionally @BLOCKS: the blocks the run's starting weights had
already seen (a run continued from a drafter folder counts its blocks from 0). The x axis is
logarithmic, so the gain per doubling of compute is the slope; it is printed per line (from
the first point to the mean of the last two).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def series(arg: str) -> tuple[str, np.ndarray, np.ndarray]:
    label, _, rest = arg.partition("=")
    path, _, offset = rest.partition("@")
    points = json.loads(Path(path).read_text())["points"]
    x = np.array([p["blocks"] for p in points], float) + float(offset or 0)
    y = np.array([p["tau_selector"] if p.get("tau_selector") is not None else p["tau_argmax"]
                  for p in points], float)
    return label, x, y


def per_doubling(x: np.ndarray, y: np.ndarray) -> float:
    """Tau gained per doubling of blocks from the first point to the mean of the last two (a
    continued run's first snapshots dip under its warm restart, so no fit through them)."""
    if len(x) < 3:
        return float("nan")
    return float((y[-2:].mean() - y[0]) / np.log2(x[-2:].mean() / x[0]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("series", nargs="+", help="LABEL=FILE[@BLOCKS]")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--title", default="offline greedy tau (selector), 8 HumanEval answers, b = 8")
    a = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arg in a.series:
        label, x, y = series(arg)
        slope = per_doubling(x, y)
        print(f"{label}: {len(x)} points, blocks {x.min():.0f}-{x.max():.0f}, tau "
              f"{y.min():.3f}-{y.max():.3f}, {slope:+.3f} tau per doubling")
        ax.plot(x, y, "o-", ms=3, label=f"{label} ({slope:+.2f} per doubling)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("anchor blocks trained on (training compute)")
    ax.set_ylabel("tau")
    ax.set_title(a.title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
