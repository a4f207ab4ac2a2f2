"""Tables of hybrid b=auto from /tmp/m's bench runs: decode tok/s and speedup column."""
import re, sys
from pathlib import Path
M = Path("/tmp/m")
def row(path, system="hybrid b=auto"):
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells and cells[0] == system:
            return float(cells[1]), float(cells[2].rstrip("x"))
    return None
sets = ["humaneval", "agent", "chat", "long-edit-2k", "long-log-2k", "long-agent-2k", "long-quote-2k"]
codes = ["final", "base41", "before42"]
print("| set | round | " + " | ".join(f"{c} tok/s (speedup)" for c in codes) + " | final/base41 | final/before42 |")
print("|---" * 7 + "|")
for s in sets:
    for r in (1, 2):
        vals = {}
        for c in codes:
            p = M / f"{s}-quiet-{c}-r{r}" / "bench.md"
            vals[c] = row(p) if p.exists() else None
        if not any(vals.values()):
            continue
        cells = [f"{v[0]:.1f} ({v[1]:.2f}x)" if v else "-" for v in vals.values()]
        ratio = lambda a, b: f"{vals[a][0] / vals[b][0]:.3f}" if vals[a] and vals[b] else "-"
        print(f"| {s} | {r} | " + " | ".join(cells) + f" | {ratio('final','base41')} | {ratio('final','before42')} |")
print()
print("busy calibration (final), hybrid b=auto over b=1:")
for s in sets[3:]:
    p = M / f"{s}-busy-final" / "bench.md"
    if p.exists():
        v = row(p); print(f"  {s}: {v[0]:.1f} tok/s, {v[1]:.2f}x")
