"""A cost calibration taken while two busy loops hold the cores, then decoding on a quiet
machine (issue 42; docs/decisions.md).

    python benchmarks/calibration_load.py [--rounds 2] [--max-tokens 96] [--cache DIR]
                                          [--quiet] [--trace]

In a fresh `$DFLASH2_CACHE` (DIR, default a temporary folder; the embedded pair's weights are
linked in), the embedded pair is loaded and its cost calibration taken while two
`python -c "while True: pass"` processes run; its spread and whether it is settled are
printed. The loops are then stopped and, in the same process (the busy prices in use, as the
process that took them would), two prompts of ~2.2k tokens (the first ~260 lines of mlx-lm's
generate.py with an edit ask and an explain ask) are decoded greedily with `auto` and with
block size 1 (plain decoding), alternated for `--rounds`: decode tok/s and their ratio,
median over the rounds. `--settle` then marks the stored busy entry settled in
calibration.json, as an entry was kept for good before issue 42, so that a later
`DFLASH2_CACHE=DIR dflash2-mlx bench ...` runs from those prices (the governor alone keeping
`auto` near plain). `--quiet` takes the calibration without the busy loops (the same prompts
from quiet prices); `--trace` prints each drafting cycle of the `auto` runs: its source, width,
drafts accepted, context, the lookup's match length and estimated alphas.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ASKS = {"edit": "Add a docstring to the first function in this file that lacks one, and reply "
                "with that function only.",
        "explain": "What does this file do?"}


def source_file(lines: int = 260) -> str:
    """The first `lines` lines of mlx-lm's generate.py, as installed."""
    origin = importlib.util.find_spec("mlx_lm.generate").origin
    return "".join(Path(origin).read_text().splitlines(keepends=True)[:lines])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--settle", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="calibrate without the busy loops")
    ap.add_argument("--trace", action="store_true", help="print the auto runs' drafting cycles")
    a = ap.parse_args()
    cache = a.cache or Path(tempfile.mkdtemp(prefix="dflash2-calibration-load-"))
    user = Path(os.environ.get("DFLASH2_CACHE", Path.home() / ".cache" / "dflash2-mlx"))
    cache.mkdir(parents=True, exist_ok=True)
    if (user / "smollm2").exists() and not (cache / "smollm2").exists():
        (cache / "smollm2").symlink_to((user / "smollm2").resolve())
    os.environ["DFLASH2_CACHE"] = str(cache)

    import dflash2_mlx
    from dflash2_mlx.policy import calibration

    pipe = dflash2_mlx.load()
    choices = trace_choices() if a.trace else []
    busy = [] if a.quiet else [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                               for _ in range(2)]
    try:
        tic = time.perf_counter()
        cost = pipe.width_policy().cost
        took = time.perf_counter() - tic
    finally:
        for p in busy:
            p.kill()
            p.wait()
    print(f"{'quiet' if a.quiet else 'busy'} calibration: {took:.0f} s, rounds within {100 * cost.spread:.0f}%, "
          f"settled {cost.settled}; plain step {1e3 * (cost.plain_step or 0):.1f} ms, verify "
          f"1 / 16 rows {1e3 * cost.verify(1):.1f} / {1e3 * cost.verify(16):.1f} ms")
    if busy:
        time.sleep(5)                               # the loops' cores cool down
    text = source_file()
    for name, ask in ASKS.items():
        prompt = f"```python\n{text}```\n\n{ask}"
        rates: dict = {"auto": [], 1: []}
        for r in range(a.rounds):
            for b in (["auto", 1] if r % 2 == 0 else [1, "auto"]):
                choices.clear()
                gen = pipe.generate(prompt, max_tokens=a.max_tokens, block_size=b)
                rates[b].append(gen.stats.decode_tps)
                if b == "auto":
                    s = gen.stats
                    print(f"  {name} auto: {s.generated_tokens} tokens, {s.decode_tps:.1f} "
                          f"tok/s, {len(s.widths)} cycles, widths {sorted(set(s.widths))}")
                    for c in choices:
                        print("    " + c)
        ratio = statistics.median(x / y for x, y in zip(rates["auto"], rates[1]))
        print(f"{name} ({len(pipe.encode(prompt))} prompt tokens): auto "
              f"{statistics.median(rates['auto']):.1f} tok/s, plain "
              f"{statistics.median(rates[1]):.1f} tok/s, auto / plain {ratio:.2f}x")
    gov = pipe.width_policy().correction.governor
    print(f"governor: {gov.trips} trips, plain reference at context sizes "
          f"{sorted(gov.referenced)}")
    if a.settle:
        path = calibration.cache_file()
        table = json.loads(path.read_text())
        for entry in table.values():
            entry["spread"], entry["fitted"] = 0.0, True
        path.write_text(json.dumps(table, indent=1))
        print(f"{path}: the busy calibration marked settled")
    print(f"DFLASH2_CACHE={cache}")


def trace_choices() -> list[str]:
    """Wraps `AdaptiveWidth.update` to describe each timed drafting cycle in the returned
    list: source, width, accepted, context, match length, the alphas and priced ratio."""
    from dflash2_mlx.policy.adaptive import PLAIN, AdaptiveWidth

    out: list[str] = []
    update = AdaptiveWidth.update

    def traced(self, source, width, accepted, seconds=None, match_n=0, context=None, first=1):
        if width > 1 and seconds is not None:
            alphas = self.alphas(source, match_n, context)[: width - 1]
            priced = self.cycle_cost(width, source, context) / self.cycle_cost(1, PLAIN, context)
            out.append(f"{source} w={width} accepted={accepted} context={context} "
                       f"match={match_n} took {1e3 * seconds:.0f} ms ({priced:.2f} plain steps "
                       f"priced) alphas {[round(x, 2) for x in alphas]}")
        update(self, source, width, accepted, seconds, match_n, context, first)

    AdaptiveWidth.update = traced
    return out


if __name__ == "__main__":
    main()
