"""Choose the lookup's n-gram lengths by replay: the target's greedy outputs (generated once,
exactly), then lookup decoding replayed on them for each (min_n, max_n), at several widths.

Per setting: the share of cycles where some suffix recurs, the lookup's tau on those, and the
tokens per target forward of lookup decoding with a plain step where nothing recurs; with the
calibrated verify cost per width, the estimated speedup over plain decoding. No timing noise:
the replay is exact for greedy decoding.

    python benchmarks/lookup_ngrams.py --prompts 8 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json

import dflash2_mlx
from dflash2_mlx.policy.calibration import load_or_measure_costs
from dflash2_mlx.decode.lookup import LookupConfig, LookupIndex
from dflash2_mlx.bench.prompt_sets import agent_prompts, humaneval_prompts


def replay(prompt: list[int], output: list[int], config: LookupConfig, width: int):
    """Lookup-or-plain decoding of `output` -> [(matched, accepted)] per cycle."""
    index = LookupIndex(config, prompt + output[:1])
    n, cycles = 1, []
    while n < len(output):
        found = index.propose(min(width, len(output) - n + 1) - 1)
        guess = found[1] if found else None      # propose gives (suffix length, tokens)
        a = 0
        if guess:
            while a < len(guess) and guess[a] == output[n + a]:
                a += 1
        new = output[n : n + a + 1]
        cycles.append((guess is not None, a, len(guess) + 1 if guess else 1))
        index.extend(new)
        n += len(new)
    return cycles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="per prompt set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None, help="write the table here")
    a = ap.parse_args()
    pipe = dflash2_mlx.load()
    cost = load_or_measure_costs(pipe, pipe.max_width(True))
    sets = {"humaneval": humaneval_prompts(a.prompts), "agent": agent_prompts(a.prompts)}
    runs = {}
    for name, prompts in sets.items():
        runs[name] = []
        for p in prompts:
            ids = pipe.encode(p)
            runs[name].append((ids, pipe.generate(ids, max_tokens=a.max_tokens).tokens))
        print(f"{name}: {len(prompts)} greedy outputs", flush=True)
    rows = []
    for min_n in (1, 2, 3, 4):
        for max_n in (4, 8, 16):
            if max_n < min_n:
                continue
            for width in (8, 16):
                row = {"min_n": min_n, "max_n": max_n, "width": width}
                for name, pairs in runs.items():
                    cycles = [c for ids, out in pairs
                              for c in replay(ids, out, LookupConfig(min_n, max_n, 16), width)]
                    hits = [acc for matched, acc, _ in cycles if matched]
                    tokens = sum(acc + 1 for _, acc, _ in cycles)
                    seconds = sum(cost.cycle(w, "lookup") for _, _, w in cycles)
                    row[name] = {"match_share": len(hits) / len(cycles),
                                 "tau_lookup": sum(h + 1 for h in hits) / max(len(hits), 1),
                                 "tokens_per_forward": tokens / len(cycles),
                                 "speedup_est": tokens / seconds * cost.cycle(1, "plain")}
                rows.append(row)
                print(f"min_n {min_n} max_n {max_n:2d} width {width:2d}  " + "  ".join(
                    f"{n}: match {r['match_share']:.2f} tau {r['tau_lookup']:.2f} "
                    f"tok/fwd {r['tokens_per_forward']:.2f} est {r['speedup_est']:.2f}x"
                    for n, r in ((k, row[k]) for k in runs)), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
