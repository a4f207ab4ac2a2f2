"""Side-by-side benchmark behind `dflash2-mlx bench`: plain mlx-lm decoding, dflash2-mlx at
each block size with the drafter alone and with lookup drafting beside it ("hybrid"), and the
z-lab reference implementation (`dflash.model_mlx`) when it is importable.

One run, the same machine, the systems alternating prompt by prompt (so drift in machine load
hits them alike). On the prompt sets of `prompt_sets` (HumanEval, the copy-heavy agent set,
chat, long contexts), greedy and T=1. Per system: decode tokens/s, speedup over plain decoding,
tau (all drafting cycles and per source), per-position acceptance per source, prefill time,
peak memory; greedy outputs must be identical across all systems.

- `run`: the systems and the measuring loop (`run_bench`);
- `results`: one run's record (`Run`), the per-system summary and ratios, resuming;
- `report`: `bench.json`, `bench.md` and, with matplotlib installed
  (`pip install dflash2-mlx[bench]`), `speedup.png` and `acceptance.png` (`write`);
- `prompt_sets`: the prompt sets (`PROMPT_SETS`).
"""
