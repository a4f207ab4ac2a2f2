"""Memory-budget load test of `dflash2-mlx serve` (issue 49): --clients concurrent chat
requests of about --prompt-tokens tokens each on the embedded default pair, under a
`--memory-budget` that holds about --fit of them at once.

1. A server with the default budget says what one sequence costs (/health "memory":
   the weights, and `sequence_bytes` at 4k and 8k tokens); it stops.
2. A server with `--memory-budget` = weights + --fit x one request's bytes (its prompt plus
   --max-tokens, as the scheduler counts it) answers each request alone, one after another,
   then all of them at once.
3. Reported: every request completed, each concurrent text equals its text alone, the most
   sequences seen running and waiting for memory (/health, sampled every 0.1 s), MLX's
   peak active memory since the server began serving (/health "peak") against the budget,
   and where the load's last peaks were made (the server runs with --verbose).

    python -m dflash2_mlx.bench.memory_load --out memory-load [--hold address|resident]

(= --clients 8 --prompt-tokens 2000 --max-tokens 64 --fit 3.5). The prompts are slices of
the package's own source files, a different one per client, with a question. Everything
listens on 127.0.0.1; nothing is downloaded. Writes --out/memory_load.json.

With --hold, the same load also runs on servers held from outside after a warm-up, to what
they hold then plus the bytes the budget gives the caches: `address` sets RLIMIT_AS on the
address space (as `ulimit -v`; it counts reserved, untouched pages too: thread stacks, malloc
arenas), `resident` puts the server in a memory cgroup of that many resident bytes (as a
container's limit; root, cgroup v1 or v2, no swap counted). Each runs today's server
(`--before DIR`, or this one with no --memory-budget) and this one with the budget; reported
as above, with whether the server survived and its last log lines.
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

STEP = 256                  # the caches grow in steps of 256 tokens (model.memory.STEP)
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

    size = _status_bytes(server.proc.pid, "VmSize") + extra
    resource.prlimit(server.proc.pid, resource.RLIMIT_AS, (size, size))
    return size


def hold_resident(server: ServerProcess, extra: int) -> tuple[int, Path]:
    """Hold a running server to its resident memory now plus `extra` bytes from outside: a
    memory cgroup of its own (v2 `memory.max`, or v1 `memory.limit_in_bytes`), swap included
    where the controller counts it; -> (the limit, the group, to remove after)."""
    size = _status_bytes(server.proc.pid, "VmRSS") + extra
    root = Path("/sys/fs/cgroup")
    v2 = (root / "cgroup.controllers").exists()
    group = (root if v2 else root / "memory") / f"dflash2-hold-{server.proc.pid}"
    try:
        group.mkdir()
        limits = ("memory.max", "memory.swap.max") if v2 else (
            "memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
        (group / limits[0]).write_text(str(size))
        if (group / limits[1]).exists():
            (group / limits[1]).write_text("0" if v2 else str(size))
        (group / "cgroup.procs").write_text(str(server.proc.pid))
    except OSError as e:
        raise SystemExit(f"--hold resident: cannot make the memory cgroup {group} ({e}); it "
                         "needs root and a cgroup v1 or v2 memory controller") from e
    return size, group


def _status_bytes(pid: int, field: str) -> int:
    """A /proc/<pid>/status figure (VmSize, VmRSS) in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith(field))) * 1024


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
            "allocation_failures": m.get("failures"),
            "states_not_kept": m.get("states_not_kept"), "wall_s": round(run["wall_s"], 1)}


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


LOAD = "(the requests at once)\n"       # marks the load in a server's log


def peak_lines(log: list[str], last: int = 2) -> list[str]:
    """Where MLX's peak rose last (`serve --verbose`'s "memory: peak" lines), those of the
    load marked "(load)", of the requests alone "(alone)"."""
    start = log.index(LOAD) if LOAD in log else len(log)
    return [("(load) " if i > start else "(alone) ") + ln.split("memory: ", 1)[1].strip()
            for i, ln in enumerate(log) if "memory: peak" in ln][-last:]


def held_load(label: str, how: str, extra: list[str], tree, convs, a, alone, budget,
              room) -> dict:
    """The same load on a server held from outside (`how`: address or resident) to what it
    holds after a warm-up plus `room` bytes (what the budget gives the caches); whether the
    server is still alive after."""
    server, group = start(extra, tree), None
    try:
        request(server.url, server.model, convs[0], 1)       # warm: buffers and kernels
        if how == "address":
            limit = hold(server, room)
        else:
            limit, group = hold_resident(server, room)
        run = load(server, convs, a.max_tokens)
        alive = server.proc.poll() is None
    finally:
        code = server.stop()
        if group is not None:
            group.rmdir()
    out = {"run": f"{label}, held ({how})", f"{how}_limit": limit,
           **summary(run, alone, budget), "alive_after": alive, "exit_code": code,
           "log_tail": server.log[-3:]}
    _print(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--fit", type=float, default=3.5,
                    help="requests the budget holds at once (prompt + max tokens each)")
    ap.add_argument("--hold", action="append", choices=("address", "resident"), default=[],
                    help="also run the load held from outside (address: RLIMIT_AS; resident: "
                         "a memory cgroup, root only): today's server (--before, or this one "
                         "with no budget) and this one with the budget; may repeat")
    ap.add_argument("--before", type=Path, default=None,
                    help="a checkout whose `serve` is today's, for --hold")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    convs = prompts(a.clients, a.prompt_tokens)
    figures, budget = sizes(convs, a.max_tokens, a.fit)

    server = start(["--memory-budget", str(budget), "--verbose"])
    try:
        alone = [request(server.url, server.model, c, a.max_tokens) for c in convs]
        server.log.append(LOAD)
        run = load(server, convs, a.max_tokens)
    finally:
        code = server.stop()
    result = {"budget": budget, "weights": figures["weights"], "clients": a.clients,
              "prompt_tokens": [s["prompt_tokens"] for s in alone],
              **summary(run, alone, budget), "exit_code": code,
              "peak_made": peak_lines(server.log)}
    _print(result)
    room, result["held"] = budget - figures["weights"], []
    for how in a.hold:
        result["held"] += [
            held_load("today (no budget)", how, [], a.before, convs, a, alone, None, room),
            held_load("with --memory-budget", how, ["--memory-budget", str(budget)], None,
                      convs, a, alone, budget, room)]
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
