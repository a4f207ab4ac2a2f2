"""Memory-budget load test of `dflash2-mlx serve` (issue 49): --clients concurrent chat
requests of about --prompt-tokens tokens each on the embedded default pair, under a
`--memory-budget` that holds about --fit of them at once.

1. A server with the default budget says what one sequence costs (/health "memory":
   the weights, and `sequence_bytes` at 4k and 8k tokens); it stops.
2. A server with `--memory-budget` = weights + --fit x one request's bytes (its prompt plus
   --max-tokens, as the scheduler counts it) answers each request alone, one after another,
   then all of them at once.
3. Reported: every request completed, each concurrent text equals its text alone, the most
   sequences seen running and waiting for memory (/health, sampled every 0.1 s), and MLX's
   peak active memory since the server began serving (/health "peak") against the budget.

    python -m dflash2_mlx.bench.memory_load --out memory-load

(= --clients 8 --prompt-tokens 2000 --max-tokens 64 --fit 3.5). The prompts are slices of
the package's own source files, a different one per client, with a question. Everything
listens on 127.0.0.1; nothing is downloaded. Writes --out/memory_load.json.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .serve_load import PACKAGE, request
from .serve_systems import QUEUE_SIZE, ServerProcess

STEP = 256                  # the caches grow in steps of 256 tokens (cache.memory.STEP)
CHARS_PER_TOKEN = 3.2       # SmolLM2's tokenizer on this package's Python source


def prompts(clients: int, tokens: int) -> list[list[dict]]:
    """One conversation per client: ~`tokens` tokens of source, a different slice each."""
    text = "\n".join(p.read_text() for p in sorted(PACKAGE.rglob("*.py")))
    size = int(tokens * CHARS_PER_TOKEN)
    out = []
    for i in range(clients):
        start = (i * len(text) // clients) % max(1, len(text) - size)
        out.append([{"role": "user", "content": "Summarize what this code does:\n\n"
                     + text[start:start + size]}])
    return out


def health(server: ServerProcess) -> dict:
    import httpx

    return httpx.get(server.url + "/health", timeout=10).json()


def start(extra: list[str]) -> ServerProcess:
    import os
    import sys

    from ..loading.defaults import default_pair

    target, drafter = default_pair()
    cmd = [sys.executable, "-m", "dflash2_mlx.cli", "serve", "--model", str(target), "--draft",
           str(drafter), "--port", "0", "--queue-size", str(QUEUE_SIZE), *extra]
    server = ServerProcess("ours", cmd, None, {**os.environ, "HF_HUB_OFFLINE": "1"})
    import httpx

    server.model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    return server


def budget_for(figures: dict, tokens: int, fit: float) -> int:
    """The budget that holds `fit` sequences of `tokens` (rounded up to the caches' step):
    one sequence's bytes from its 4k and 8k figures (they grow linearly)."""
    at = {int(k): v for k, v in figures["sequence_bytes"].items()}
    per_token = (at[8192] - at[4096]) / 4096
    n = -(-tokens // STEP) * STEP
    one = at[4096] + per_token * (n - 4096)
    return int(figures["weights"] + fit * one)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--fit", type=float, default=3.5,
                    help="requests the budget holds at once (prompt + max tokens each)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    convs = prompts(a.clients, a.prompt_tokens)

    probe = start([])
    try:
        figures = health(probe)["memory"]
        r = request(probe.url, probe.model, convs[0], 1)
        longest = int(r["prompt_tokens"] * max(len(c[0]["content"]) for c in convs)
                      / len(convs[0][0]["content"])) + 16
    finally:
        probe.stop()
    budget = budget_for(figures, longest + a.max_tokens, a.fit)
    print(f"weights {figures['weights'] / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB "
          f"(~{a.fit} requests of {longest} + {a.max_tokens} tokens)")

    server = start(["--memory-budget", str(budget)])
    seen = {"running": 0, "waiting_for_memory": 0}
    try:
        alone = [request(server.url, server.model, c, a.max_tokens) for c in convs]
        done = threading.Event()

        def watch():
            while not done.is_set():
                h = health(server)
                seen["running"] = max(seen["running"], h["batch"]["running"])
                seen["waiting_for_memory"] = max(seen["waiting_for_memory"],
                                                 h["memory"]["waiting_for_memory"])
                time.sleep(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        tic = time.perf_counter()
        with ThreadPoolExecutor(a.clients) as pool:
            together = list(pool.map(
                lambda c: _try(lambda: request(server.url, server.model, c, a.max_tokens)),
                convs))
        wall = time.perf_counter() - tic
        done.set()
        watcher.join()
        final = health(server)["memory"]
    finally:
        code = server.stop()
    ok = [isinstance(t, dict) for t in together]
    same = [isinstance(t, dict) and t["text"] == s["text"] for t, s in zip(together, alone)]
    result = {"budget": budget, "weights": figures["weights"], "clients": a.clients,
              "prompt_tokens": [s["prompt_tokens"] for s in alone],
              "completed": sum(ok), "identical_to_alone": sum(same),
              "errors": [t for t in together if not isinstance(t, dict)],
              "most_running": seen["running"],
              "most_waiting_for_memory": seen["waiting_for_memory"],
              "peak_active": final["peak"], "peak_under_budget": final["peak"] <= budget,
              "allocation_failures": final["failures"], "wall_s": wall, "exit_code": code}
    for k, v in result.items():
        print(f"{k:<26}{v}")
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "memory_load.json").write_text(json.dumps(result, indent=2))


def _try(call):
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - a failed request is a result to report
        return f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    main()
