"""Load test of `dflash2-mlx serve` against `mlx_lm.server`, on loopback, same target.

Concurrent clients replay multi-turn, agent-style conversations (a long system prompt with a
tool list and a source file, then several user turns; each answer goes back into the history),
streaming over raw SSE so both servers are timed the same way. Per system: time to first token
(p50 / p95, first turns and later turns apart), decode tok/s seen by the client, end-to-end
seconds per request, prompt tokens served from the prefix cache. Greedy texts are compared
across systems turn by turn. A single-client pass compares the server's decode speed with
`Pipeline.generate` in this process on the same request (both without a prefix cache).

    python benchmarks/serve_load.py --clients 2 --turns 3 --max-tokens 32 --out docs/bench/serve

All servers run at once and the turns are interleaved across them, so a shared machine's load
swings hit every system alike. Systems (--systems, comma-separated): ours (prefix cache,
drafter, lookup, block size auto), no-cache, no-drafter, no-lookup, plain (no drafter, no
lookup), mlx-lm (`python -m mlx_lm server` on the same weights, exported once as an mlx-lm
folder). Everything listens on 127.0.0.1; counts and time are bounded (--time-limit for all
the conversations).
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
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TOOLS = """Tools you can call:
- read_file(path): the text of a file of the repository
- run_tests(pattern): runs pytest on the tests matching the pattern, returns the report
- edit_file(path, old, new): replaces `old` by `new` in the file
Answer briefly; quote code exactly."""
SOURCES = ["dflash2_mlx/lookup.py", "dflash2_mlx/sampling.py", "dflash2_mlx/prompt_cache.py",
           "dflash2_mlx/kernels/__init__.py"]
TURNS = ["What does the first function of this file do? Answer in two sentences.",
         "Write a pytest test for it.",
         "Now make the test shorter.",
         "Which other function of the file would you test next, and why?"]


def conversations(clients: int, chars: int) -> list[list[dict]]:
    """One system prompt per client: the tool list and the head of one source file."""
    out = []
    for i in range(clients):
        src = SOURCES[i % len(SOURCES)]
        text = (ROOT / src).read_text()[:chars]
        out.append([{"role": "system", "content": f"You are a coding agent.\n{TOOLS}\n\n"
                     f"The file {src}:\n```python\n{text}\n```"}])
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def openblas_env() -> dict:
    """mlx_lm.server gets the same BLAS as dflash2-mlx (which preloads OpenBLAS itself)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    lib = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
    if sys.platform.startswith("linux") and Path(lib).exists():
        env["LD_PRELOAD"] = lib
    return env


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


class ServerProcess:
    def __init__(self, name: str, cmd: list[str], url: str | None, env: dict):
        self.name = name
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.url, self.log = url, []
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


def start(system: str, model_dir: Path) -> ServerProcess:
    py = sys.executable
    if system == "mlx-lm":
        port = free_port()
        return ServerProcess(system, [py, "-m", "mlx_lm", "server", "--model", str(model_dir),
                                      "--port", str(port), "--temp", "0",
                                      "--log-level", "WARNING"],
                             f"http://127.0.0.1:{port}", openblas_env())
    from dflash2_mlx.defaults import default_pair

    target, drafter = default_pair()
    args = {"ours": ["--draft", drafter], "no-cache": ["--draft", drafter,
                                                       "--prompt-cache-size", "0"],
            "no-drafter": [], "no-lookup": ["--draft", drafter, "--no-lookup"],
            "plain": ["--no-lookup"]}[system]
    cmd = [py, "-m", "dflash2_mlx.cli", "serve", "--model", str(target), "--port", "0",
           *map(str, args)]
    return ServerProcess(system, cmd, None, {**os.environ, "HF_HUB_OFFLINE": "1"})


def request(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion, timed on the client: first content token, last token."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    tic = time.perf_counter()
    first = last = None
    text, usage = [], {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
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


def turn(server, histories: list[list[dict]], t: int, max_tokens: int) -> list[dict]:
    """Turn t of every conversation on one server, the clients at once; each answer goes back
    into its history."""
    def client(i):
        histories[i].append({"role": "user", "content": TURNS[t % len(TURNS)]})
        r = request(server.url, server.model, histories[i], max_tokens)
        histories[i].append({"role": "assistant", "content": r["text"]})
        return {**r, "client": i, "turn": t}

    with ThreadPoolExecutor(len(histories)) as pool:
        return list(pool.map(client, range(len(histories))))


def pct(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarize(rows: list[dict]) -> dict:
    if not rows:
        return {"requests": 0}
    first = [r["ttft"] for r in rows if r["turn"] == 0]
    later = [r["ttft"] for r in rows if r["turn"] > 0]
    prompt = sum(r["prompt_tokens"] for r in rows)
    return {"requests": len(rows), "ttft_p50": pct([r["ttft"] for r in rows], 0.5),
            "ttft_p95": pct([r["ttft"] for r in rows], 0.95),
            "ttft_first_turn_p50": pct(first, 0.5), "ttft_later_turns_p50": pct(later, 0.5),
            "decode_tps_p50": pct([r["decode_tps"] for r in rows], 0.5),
            "e2e_mean": statistics.mean(r["e2e"] for r in rows) if rows else None,
            "tokens_per_s": (sum(r["completion_tokens"] for r in rows)
                             / max(1e-9, sum(r["e2e"] for r in rows))),
            "cache_hit_rate": sum(r["cached_tokens"] for r in rows) / prompt if prompt else 0.0,
            "mean_prompt_tokens": prompt / len(rows) if rows else 0}


def single_client(server: ServerProcess, conv: list[dict], max_tokens: int, reps: int) -> dict:
    """Decode tok/s of one request through the server (client-timed) and in this process with
    `Pipeline.generate` (same target, drafter and settings), interleaved."""
    import dflash2_mlx

    pipe = dflash2_mlx.load(*map(str, __import__("dflash2_mlx.defaults",
                                                 fromlist=["x"]).default_pair()))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--system-chars", type=int, default=3000,
                    help="characters of source in each system prompt (~1k tokens at 3000)")
    ap.add_argument("--systems", default="ours,no-cache,plain,mlx-lm")
    ap.add_argument("--single-reps", type=int, default=2,
                    help="single-client server vs Pipeline.generate repetitions (0: skip)")
    ap.add_argument("--time-limit", type=float, default=300,
                    help="seconds for all the conversations; no new turn starts after it")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if not 1 <= a.clients <= 8 or not 1 <= a.turns <= len(TURNS) or a.max_tokens > 512:
        ap.error(f"bounded run: 1..8 clients, 1..{len(TURNS)} turns, max tokens <= 512")

    import dflash2_mlx  # noqa: F401  (OpenBLAS first)
    from dflash2_mlx.assets import resolve_cache_dir

    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    model_dir = export_target(resolve_cache_dir() / "serve-bench" / "smollm2-mlx-lm")
    # All servers up at once (idle ones cost memory only) and the turns interleaved across
    # them, so that a shared machine's load swings hit every system alike.
    servers, results, rows = {}, {}, {s: [] for s in systems}
    try:
        for system in systems:
            print(f"starting {system}", file=sys.stderr, flush=True)
            server = servers[system] = start(system, model_dir)
            server.model = (str(model_dir) if system == "mlx-lm" else
                            httpx.get(server.url + "/v1/models").json()["data"][0]["id"])
            # one-off costs (first forward passes, compilation) are not what is measured
            request(server.url, server.model, [{"role": "user", "content": "Say hi."}], 4)
            if system == "no-cache" and a.single_reps:
                # no prefix cache on either side: the server and Pipeline.generate do the same
                results["single-client"] = single_client(server,
                                                         conversations(1, a.system_chars)[0],
                                                         a.max_tokens, a.single_reps)
                print(json.dumps(results["single-client"]), file=sys.stderr, flush=True)
        results["load_average_before"] = os.getloadavg()
        histories = {s: conversations(a.clients, a.system_chars) for s in systems}
        deadline = time.time() + a.time_limit
        for t in range(a.turns):
            if time.time() > deadline:
                print(f"time limit: stopped before turn {t}", file=sys.stderr)
                break
            order = systems[t % len(systems):] + systems[: t % len(systems)]
            for system in order:
                rows[system] += turn(servers[system], histories[system], t, a.max_tokens)
                print(f"turn {t} {system}: " + json.dumps(summarize(rows[system][-a.clients:])),
                      file=sys.stderr, flush=True)
    finally:
        codes = {s: server.stop() for s, server in servers.items()}
    for system in systems:
        results[system] = {**summarize(rows[system]), "exit_code": codes.get(system),
                           "rows": [{k: v for k, v in r.items() if k != "text"}
                                    for r in rows[system]]}
    texts = {s: {(r["client"], r["turn"]): r["text"] for r in rows[s]} for s in systems}
    base = texts.get("ours") or next(iter(texts.values()), {})
    results["identical_greedy_text"] = {s: t == base for s, t in texts.items()}
    results["load_average_after"] = os.getloadavg()
    results["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    print(markdown(results))
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "serve_load.json").write_text(json.dumps(results, indent=2) + "\n")
        (a.out / "serve_load.md").write_text(markdown(results) + "\n")


def markdown(results: dict) -> str:
    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    lines = ["| system | requests | TTFT p50 s | TTFT p95 s | TTFT turn 1 s | TTFT later s | "
             "decode tok/s p50 | e2e s / request | prefix-cache hit | greedy text = ours |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    same = results.get("identical_greedy_text", {})
    for name, r in results.items():
        if not isinstance(r, dict) or not r.get("requests"):
            continue
        lines.append(f"| {name} | {r['requests']} | {f(r['ttft_p50'])} | {f(r['ttft_p95'])} | "
                     f"{f(r['ttft_first_turn_p50'])} | {f(r['ttft_later_turns_p50'])} | "
                     f"{f(r['decode_tps_p50'], '{:.1f}')} | {f(r['e2e_mean'])} | "
                     f"{r['cache_hit_rate']:.0%} | {'yes' if same.get(name) else 'no'} |")
    if "load_average_before" in results:
        lines.append("")
        lines.append("Load average (1 min) before / after the conversations: "
                     f"{results['load_average_before'][0]:.1f} / "
                     f"{results['load_average_after'][0]:.1f} (2 cores).")
    if "single-client" in results:
        s = results["single-client"]
        lines.append("")
        lines.append(f"Single client, same request, no prefix cache: server "
                     f"{s['server_decode_tps']:.1f} tok/s decode (client-timed; "
                     f"{s['server_engine_decode_tps']:.1f} timed by its engine), "
                     f"Pipeline.generate {s['pipeline_decode_tps']:.1f} tok/s in the benchmark "
                     f"process: {s['ratio']:.3f}x (medians of {len(s['runs']['server'])}, "
                     "interleaved).")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
