"""Time to first token of a conversation's next turn once it left RAM: read from the prefix
cache's disk tier, against recomputing the whole prompt, at several context sizes, with the
embedded SmolLM2 pair (`dflash2_mlx.load()`).

    python benchmarks/disk_cache_ttft.py --contexts 1024,4096,8192 --reps 3 \
        --out disk-cache

Per context size: turn 1 is a chat prompt of about that many tokens (a system prompt made of
the package's own source, then a question); after it, its `DecodeState` is written to a fresh
disk tier and the writer is flushed (timed: "write s", off any request's path in the server).
Turn 2 (turn 1, its answer, a new question) is then timed, the systems interleaved rep by rep:

  recompute  no cache: the whole prompt is prefilled;
  disk       an empty RAM tier over a new `DiskCache` on the same folder, as after a restart
             or an eviction: the fetch (read, checksum, checks, trim) and the prefill of the
             new tokens;
  ram        the same state from the RAM tier, for reference.

TTFT runs from the fetch to the first token the pipeline yields. The file is read through the
OS page cache (warm: it was just written); a cold read adds the disk's read time for the file
size shown. Every system's greedy tokens are checked equal to recompute's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import dflash2_mlx
from dflash2_mlx.cache.disk import DiskCache
from dflash2_mlx.decode.state import DecodeState
from dflash2_mlx.cache.prompt import PromptCache

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["decode/engine.py", "model/drafter.py", "model/target.py", "policy/adaptive.py",
           "server/scheduler.py", "pipeline.py"]
QUESTIONS = ["Which function of this code runs the draft-verify loop? Answer briefly.",
             "And which one rolls the target's cache back?"]


def source_text() -> str:
    return "\n\n".join((ROOT / "dflash2_mlx" / name).read_text() for name in SOURCES)


def render(pipe, messages: list[dict]) -> list[int]:
    tok = pipe.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def first_turn(pipe, context: int) -> list[dict]:
    """Messages of about `context` tokens: the system prompt cut to fit."""
    text = source_text()
    chars = min(len(text), 4 * context)         # ~3 characters a token: refined below
    for _ in range(4):
        msgs = [{"role": "system", "content": f"You read code.\n```python\n{text[:chars]}\n```"},
                {"role": "user", "content": QUESTIONS[0]}]
        n = len(render(pipe, msgs))
        if abs(n - context) <= max(8, context // 100):
            break
        chars = int(chars * context / n)
        if chars > len(text):
            raise SystemExit(f"--contexts {context}: the package source gives only {n} tokens")
    return msgs


def ttft(pipe, prompt: list[int], fetch, max_tokens: int, block_size) -> tuple[float, float,
                                                                             list[int]]:
    """(seconds to the first yielded token, of which in `fetch()`, tokens): the clock starts
    before `fetch` finds the state (None: no cache)."""
    tic = time.perf_counter()
    state = fetch()
    fetched = time.perf_counter() - tic
    first, tokens = None, []
    for chunk in pipe.stream(prompt, max_tokens=max_tokens, block_size=block_size, state=state):
        if first is None:
            first = time.perf_counter() - tic
        tokens.extend(chunk.tokens)
    return first, fetched, tokens


def measure(pipe, context: int, reps: int, max_tokens: int, block_size, work: Path) -> dict:
    msgs = first_turn(pipe, context)
    prompt1 = render(pipe, msgs)
    state = DecodeState.new(pipe.adapter, pipe.drafter)
    answer = pipe.generate(prompt1, max_tokens=max_tokens, block_size=block_size, state=state)
    msgs += [{"role": "assistant", "content": answer.text},
             {"role": "user", "content": QUESTIONS[1]}]
    prompt2 = render(pipe, msgs)
    folder = work / f"ctx{context}"
    tier = lambda: DiskCache(folder, 2**40, target=pipe.adapter, drafter=pipe.drafter)
    disk = tier()
    tic = time.perf_counter()
    disk.put(state)
    disk.flush()
    write_s, file_bytes = time.perf_counter() - tic, disk.nbytes
    disk.close()
    ram = PromptCache(1)
    ram.insert(state)

    runs: dict[str, list[float]] = {"recompute": [], "disk": [], "ram": [], "index": [],
                                    "fetch": []}
    same = True
    for _ in range(reps):
        t, _, want = ttft(pipe, prompt2, lambda: None, max_tokens, block_size)
        runs["recompute"].append(t)
        tic = time.perf_counter()
        cache = PromptCache(0, disk=tier())          # what a restarted server starts with
        runs["index"].append(time.perf_counter() - tic)
        t, fetched, got = ttft(pipe, prompt2, lambda: cache.fetch(prompt2)[0], max_tokens,
                            block_size)
        assert cache.stats.disk_hits == 1, "the disk tier missed"
        cache.close()
        runs["disk"].append(t)
        runs["fetch"].append(fetched)
        same &= got == want
        t, _, got = ttft(pipe, prompt2, lambda: ram.fetch(prompt2)[0], max_tokens, block_size)
        runs["ram"].append(t)
        same &= got == want
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"context": context, "prompt1_tokens": len(prompt1), "prompt2_tokens": len(prompt2),
            "cached_tokens": len(state.tokens), "file_mib": file_bytes / 2**20,
            "write_s": write_s, "ttft_recompute_s": med["recompute"], "ttft_disk_s": med["disk"],
            "ttft_ram_s": med["ram"], "disk_fetch_s": med["fetch"], "index_s": med["index"],
            "disk_over_recompute": med["disk"] / med["recompute"], "greedy_equal": same,
            "runs": runs}


def markdown(rows: list[dict]) -> str:
    lines = ["| context tokens | turn 2 prompt | from cache | file MiB | write s | index s | "
             "TTFT recompute s | TTFT disk s | of which fetch s | disk / recompute | "
             "TTFT RAM s | greedy equal |", "|---" * 12 + "|"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['prompt2_tokens']} | {r['cached_tokens']} | "
                     f"{r['file_mib']:.1f} | {r['write_s']:.2f} | {r['index_s']:.3f} | "
                     f"{r['ttft_recompute_s']:.2f} | {r['ttft_disk_s']:.3f} | "
                     f"{r['disk_fetch_s']:.3f} | {r['disk_over_recompute']:.3f} | "
                     f"{r['ttft_ram_s']:.3f} | {'yes' if r['greedy_equal'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096,8192",
                    help="approximate turn-1 prompt sizes in tokens, comma-separated")
    ap.add_argument("--reps", type=int, default=3, help="timed turn-2 runs per system")
    ap.add_argument("--max-tokens", type=int, default=8, help="answer length of each turn")
    ap.add_argument("--block-size", default=None,
                    help="as for generate (default: the drafter's block size; 'auto' "
                    "calibrates first)")
    ap.add_argument("--dir", type=Path, default=None,
                    help="folder for the disk tier (default: a temporary one)")
    ap.add_argument("--out", type=Path, default=None, help="write disk_cache_ttft.json here")
    args = ap.parse_args(argv)
    pipe = dflash2_mlx.load()
    block = args.block_size or (pipe.drafter.args.block_size if pipe.drafter else 1)
    block = int(block) if str(block).isdigit() else block
    with tempfile.TemporaryDirectory(prefix="dflash2-disk-ttft-") as tmp:
        work = args.dir or Path(tmp)
        rows = []
        for context in (int(c) for c in args.contexts.split(",")):
            rows.append(measure(pipe, context, args.reps, args.max_tokens, block, work))
            print(markdown(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(markdown(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "disk_cache_ttft.json").write_text(json.dumps(
            {"argv": sys.argv[1:], "rows": rows, **pipe.describe()}, indent=1, default=str))
    return 0 if all(r["greedy_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
