"""A client that leaves during a long prefill: how soon is the server free again?

Starts `dflash2-mlx serve` (embedded default unless --model; --context-length 32768
--allow-context-beyond-model), sends one streamed chat request whose prompt is --tokens long
(a source file of the package, repeated), closes the connection --leave seconds later (while
the prompt is still prefilling), and polls /health until the server is idle: prints the
seconds from the close to `busy: false` and to `batch.running: 0`, and the step seconds the
server logged. With --retry, then sends the same request again and prints how many prompt
tokens came from the prefix cache (the prefill done before the leave is kept for a retry).

    python benchmarks/prefill_leave.py --tokens 6000 --leave 20 [--retry]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--leave", type=float, default=20.0)
    ap.add_argument("--retry", action="store_true")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "dflash2_mlx.cli", "serve", "--port", "0", "--context-length",
           "32768", "--allow-context-beyond-model", "--max-tokens", "8"]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--draft", args.draft] if args.draft else []
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    while not (m := re.search(r"serving (\S+) on (http://\S+)", server.stderr.readline())):
        if server.poll() is not None:
            raise SystemExit("the server did not start")
    model, url = m.groups()
    try:
        source = (ROOT / "dflash2_mlx" / "batch.py").read_text()
        count = httpx.post(f"{url}/v1/messages/count_tokens", json={
            "model": model, "messages": [{"role": "user", "content": source}]}).json()
        text = source * max(1, round(args.tokens / count["input_tokens"]))
        body = {"model": model, "max_tokens": 8, "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": text}]}
        with httpx.Client(timeout=None) as http:
            with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                time.sleep(args.leave)
                print(f"prompt: ~{len(text) // 4} tokens; left after {args.leave:g} s, "
                      f"health then: {json.dumps(http.get(url + '/health').json()['batch'])}")
            left = time.perf_counter()
        idle = running = None
        while idle is None or running is None:
            h = httpx.get(url + "/health").json()
            now = time.perf_counter() - left
            running = now if running is None and h["batch"]["running"] == 0 else running
            idle = now if idle is None and not h["busy"] else idle
            time.sleep(0.05)
        print(f"free again: busy false after {idle:.2f} s, batch.running 0 after {running:.2f} s")
        if not args.retry:
            return
        tic = time.perf_counter()
        again = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False},
                           timeout=None).json()
        usage = again["usage"]
        print(f"the retry: {usage['prompt_tokens']} prompt tokens, "
              f"{usage['prompt_tokens_details']['cached_tokens']} from the cache, "
              f"{time.perf_counter() - tic:.1f} s")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
