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

    python -m dflash2_mlx.bench.memory_load --out memory-load [--address-limit]

(= --clients 8 --prompt-tokens 2000 --max-tokens 64 --fit 3.5). The prompts are slices of
the package's own source files, a different one per client, with a question. Everything
listens on 127.0.0.1; nothing is downloaded. Writes --out/memory_load.json.

With --address-limit, the same load also runs on servers held from outside (RLIMIT_AS set on
the running server after a warm-up: its address space then plus the bytes the budget gives the
caches): today's (`--before DIR`, or this one with no --memory-budget) and this one with the
budget; reported as above, with whether the server survived and its last log lines.
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


def start(extra: list[str], tree: Path | None = None) -> ServerProcess:
    """Our server on the embedded default pair; `tree`: another checkout's package (its own
    `serve`, for "today" in the contrast)."""
    import os
    import sys

    import httpx

    from ..loading.defaults import default_pair

    target, drafter = default_pair()
    cmd = [sys.executable, "-m", "dflash2_mlx.cli", "serve", "--model", str(target), "--draft",
           str(drafter), "--port", "0", "--queue-size", str(QUEUE_SIZE), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if tree is not None:                   # `python -m` imports the package from its cwd
        env["PYTHONPATH"] = str(tree)
    server = ServerProcess("ours", cmd, None, env, tree)
    server.model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    return server


def hold(server: ServerProcess, extra: int) -> int:
    """Hold a running server to its address space now plus `extra` bytes from outside
    (RLIMIT_AS, as `ulimit -v` would); the limit set."""
    import resource

    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    size = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmSize"))) * 1024
    resource.prlimit(server.proc.pid, resource.RLIMIT_AS, (size + extra, size + extra))
    return size + extra


def budget_for(figures: dict, tokens: int, fit: float) -> int:
    """The budget that holds `fit` sequences of `tokens` (rounded up to the caches' step):
    one sequence's bytes from its 4k and 8k figures (they grow linearly)."""
    at = {int(k): v for k, v in figures["sequence_bytes"].items()}
    per_token = (at[8192] - at[4096]) / 4096
    n = -(-tokens // STEP) * STEP
    one = at[4096] + per_token * (n - 4096)
    return int(figures["weights"] + fit * one)


def load(server: ServerProcess, convs: list, max_tokens: int) -> dict:
    """Every conversation at once; what came back, the most sequences /health saw running and
    waiting for memory, the wall time and /health's memory figures after."""
    seen = {"running": 0, "waiting_for_memory": 0}
    done = threading.Event()

    def watch():
        while not done.is_set():
            h = _try(lambda: health(server))
            if isinstance(h, dict):         # (today's server has no "memory" figures)
                seen["running"] = max(seen["running"], h["batch"]["running"])
                seen["waiting_for_memory"] = max(seen["waiting_for_memory"], (
                    h.get("memory") or {}).get("waiting_for_memory", 0))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    tic = time.perf_counter()
    with ThreadPoolExecutor(len(convs)) as pool:
        replies = list(pool.map(
            lambda c: _try(lambda: request(server.url, server.model, c, max_tokens)), convs))
    wall = time.perf_counter() - tic
    done.set()
    watcher.join()
    final = _try(lambda: health(server).get("memory"))
    return {"replies": replies, "seen": seen, "wall_s": wall,
            "memory": final if isinstance(final, dict) else None}


def summary(run: dict, alone: list[dict], budget: int | None) -> dict:
    together = run["replies"]
    same = [isinstance(t, dict) and t["text"] == s["text"] for t, s in zip(together, alone)]
    m = run["memory"] or {}
    return {"completed": sum(isinstance(t, dict) for t in together),
            "identical_to_alone": sum(same),
            "errors": [t for t in together if not isinstance(t, dict)],
            "most_running": run["seen"]["running"],
            "most_waiting_for_memory": run["seen"]["waiting_for_memory"],
            "peak_active": m.get("peak"),
            "peak_under_budget": None if budget is None or "peak" not in m else m["peak"] <= budget,
            "allocation_failures": m.get("failures"), "wall_s": round(run["wall_s"], 1)}


def sizes(convs: list, max_tokens: int, fit: float) -> tuple[dict, int]:
    """/health's memory figures of a server with the default budget, and the budget that
    holds `fit` of the longest request."""
    probe = start([])
    try:
        figures = health(probe)["memory"]
        r = request(probe.url, probe.model, convs[0], 1)
        longest = int(r["prompt_tokens"] * max(len(c[0]["content"]) for c in convs)
                      / len(convs[0][0]["content"])) + 16
    finally:
        probe.stop()
    budget = budget_for(figures, longest + max_tokens, fit)
    print(f"weights {figures['weights'] / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB "
          f"(~{fit} requests of {longest} + {max_tokens} tokens)")
    return figures, budget


def held_load(label: str, extra: list[str], tree, convs, a, alone, budget, room) -> dict:
    """The same load on a server held from outside to its idle address space plus `room`
    bytes (what the budget gives the caches); whether the server is still alive after."""
    server = start(extra, tree)
    try:
        request(server.url, server.model, convs[0], 1)       # warm: buffers and kernels
        limit = hold(server, room)
        run = load(server, convs, a.max_tokens)
        alive = server.proc.poll() is None
    finally:
        code = server.stop()
    out = {"run": label, "address_limit": limit, **summary(run, alone, budget),
           "alive_after": alive, "exit_code": code, "log_tail": server.log[-3:]}
    _print(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--fit", type=float, default=3.5,
                    help="requests the budget holds at once (prompt + max tokens each)")
    ap.add_argument("--address-limit", action="store_true",
                    help="also run the load under an address-space limit: today's server "
                         "(--before, or this one with no budget) and this one with the budget")
    ap.add_argument("--before", type=Path, default=None,
                    help="a checkout whose `serve` is today's, for --address-limit")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    convs = prompts(a.clients, a.prompt_tokens)
    figures, budget = sizes(convs, a.max_tokens, a.fit)

    server = start(["--memory-budget", str(budget)])
    try:
        alone = [request(server.url, server.model, c, a.max_tokens) for c in convs]
        run = load(server, convs, a.max_tokens)
    finally:
        code = server.stop()
    result = {"budget": budget, "weights": figures["weights"], "clients": a.clients,
              "prompt_tokens": [s["prompt_tokens"] for s in alone],
              **summary(run, alone, budget), "exit_code": code}
    _print(result)
    if a.address_limit:
        room = budget - figures["weights"]
        result["held"] = [
            held_load("today (no budget)", [], a.before, convs, a, alone, None, room),
            held_load("with --memory-budget", ["--memory-budget", str(budget)], None, convs,
                      a, alone, budget, room)]
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "memory_load.json").write_text(json.dumps(result, indent=2))


def _print(result: dict) -> None:
    for k, v in result.items():
        print(f"{k:<26}{v}")
    print()


def _try(call):
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - a failed request is a result to report
        return f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    main()
