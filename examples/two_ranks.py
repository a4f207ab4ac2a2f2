"""Speculative decoding over a target split across two ranks (or two Macs).

    mlx.launch --backend ring -n 2 --python .venv/bin/python examples/two_ranks.py
    mlx.launch --hostfile hosts.json --backend ring --python .venv/bin/python \
        examples/two_ranks.py --model mlx-community/Qwen3-32B-4bit --draft z-lab/...

Every rank runs this script. Each loads only its own layers; rank 0 also holds the embedding,
the head and the drafter, generates and prints; the others serve their layers until rank 0
closes the pipeline (`pipe.stage.close()`, also run at exit). Run without mlx.launch, it is
one process holding the whole target.

    test-args: --model {llama} --draft {dflash2} --max-tokens 8 --block-size 4
"""

import argparse

import dflash2_mlx
from dflash2_mlx.distributed import follow_unless_leader, init_group

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="target (default: the embedded SmolLM2-135M-Instruct)")
parser.add_argument("--draft", help="DFlash 2 drafter (default: the embedded one)")
parser.add_argument("--split", help="layers per rank, e.g. 20,12 (default: even)")
parser.add_argument("--block-size", default=None, help="1..B or auto (default: auto; its "
                    "one-off cost calibration runs through the pipeline)")
parser.add_argument("--max-tokens", type=int, default=64)
parser.add_argument("--prompt", default="Write a Python function that checks whether a "
                    "number is prime.")
args = parser.parse_args()

group = init_group(timeout=60)          # bounded: a rank that never connects is an error
pipe = dflash2_mlx.load(args.model, args.draft, pipeline=group, pipeline_split=args.split)
if not follow_unless_leader(pipe):      # ranks > 0 return from it when rank 0 closes
    b = args.block_size
    gen = pipe.generate(args.prompt, max_tokens=args.max_tokens,
                        block_size=int(b) if b and b.isdigit() else b)
    print(gen.text)
    stage = pipe.stage                  # None: one process, not launched
    where = (f"rank 0 of {stage.size}: layers {stage.layers}, weights per rank "
             f"{stage.weight_mib} MiB" if stage else "one process")
    print(f"{where}, tau {gen.stats.tau:.2f}, {gen.stats.decode_tps:.1f} tok/s")
    if stage:
        stage.close()
