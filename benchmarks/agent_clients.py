"""Real agent clients against a real `dflash2-mlx serve` on loopback: Claude Code (`claude -p`),
Codex (`codex exec`), opencode (`opencode run`), aider (`aider --message`), `llm` and an OpenAI
Agents SDK agent, each as a user sets it up (base URL, key, model and, where the client needs
one, a provider; nothing else), in a scratch home of its own.

Installs nothing: a client that is not on PATH (or under --prefix/node_modules/.bin, or in
--py-prefix/bin for the Python ones) is skipped with a line saying how to install it, e.g.

    npm install --prefix /work/agents @anthropic-ai/claude-code @openai/codex opencode-ai
    python -m venv /work/agents/py && /work/agents/py/bin/pip install aider-chat llm openai-agents

Three scenarios per client:
    turn   "say hello" on the embedded default (or --model / --draft): one plain turn, then the
           same command again, a second session, whose prompt should come from the prefix
           cache (`cache_read_input_tokens`)
    tools  the same ask on a tiny tool-calling target (`dflash2_mlx.testing.write_tool_target`,
           one layer and head, so its long prompts prefill in seconds) that calls the client's
           own tool (Claude Code `Bash`, Codex `exec_command`, opencode `bash`, `llm` and the
           Agents SDK a `get_weather` function) and, after the tool's result, answers "Done.":
           a tool round trip (aider has no tools)
    image  Claude Code, Codex and opencode with a 32x32 PNG in their working dir, sent the way
           each sends one: Claude Code `Read`s it (the tool target's call), Codex gets
           `--image`, opencode `-f`; the tool target has no vision, so the request that
           carries the image gets a 400, and the proxy keeps it all the same

Between client and server runs a recording proxy: every request (method, path, headers, body),
its status, time to first byte and total time, and the usage the response reports. Writes
--out/agent_clients.json and agent_clients.md (per run: exit code, wall time, and per request
its prompt tokens, those read from the cache, time to first byte, total). --save-fixtures DIR
writes the requests of the `tools` runs as tests/agent_requests/ holds them (the in-process
replay tests read those), and of each `image` run the agent's request with the image as
<client>-image-1.json.

    python benchmarks/agent_clients.py --prefix /work/agents --out agent-clients
    python benchmarks/agent_clients.py --prefix /work/agents --clients claude,codex,opencode \
        --scenarios image --save-fixtures tests/agent_requests

Time on this project's 2-core CPU machine: Claude Code's first prompt is ~20k tokens of the
embedded model's tokenizer (its system prompt and 24 tools), Codex's ~10k, opencode's ~8k;
the server runs with --context-length 32768 --allow-context-beyond-model (the embedded model
has 8k positions). Several minutes in all.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASK = "say hello"
CONTEXT = 32768           # the server's --context-length for the embedded model (8k positions)
REPLY = "Done."
IMAGE = "image.png"       # the `image` runs: a PNG in the working dir, and their ask
IMAGE_ASK = f"describe the image {IMAGE}"
IMAGE_PARTS = ("image", "image_url", "input_image")   # Anthropic, chat, Responses part types
CALLS = {   # the tool each client runs, as its own tools name it
    "claude": {"name": "Bash", "arguments": {"command": "echo hi", "description": "say hi"}},
    "codex": {"name": "exec_command", "arguments": {"cmd": "echo hi"}},
    "opencode": {"name": "bash", "arguments": {"command": "echo hi"}},
    "llm": {"name": "get_weather", "arguments": {"city": "Paris"}},
    "agents-sdk": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
INSTALL = {"claude": "npm install @anthropic-ai/claude-code", "codex": "npm install @openai/codex",
           "opencode": "npm install opencode-ai", "aider": "pip install aider-chat",
           "llm": "pip install llm", "agents-sdk": "pip install openai-agents"}
WEATHER = (
    'def get_weather(city: str) -> str:\n    "The weather in a city."\n'
    '    return f"Sunny in {city}"\n')
AGENT = f"""import sys
from openai import AsyncOpenAI
from agents import (Agent, Runner, function_tool, set_default_openai_client,
                    set_tracing_disabled)
{WEATHER}
set_tracing_disabled(True)
set_default_openai_client(AsyncOpenAI(base_url=sys.argv[1], api_key="none"),
                          use_for_tracing=False)
agent = Agent(name="Assistant", instructions="You are a helpful assistant.",
              model=sys.argv[2], tools=[function_tool(get_weather)])
print(Runner.run_sync(agent, sys.argv[3]).final_output)
"""
FIXTURE_HEADERS = ("anthropic-beta", "anthropic-version", "user-agent", "x-app", "originator",
                   "accept", "x-codex-beta-features")


# --------------------------------------------------------------------------- the proxy

class Recorder:
    """A loopback proxy to `upstream` that records each exchange."""

    def __init__(self, upstream: str):
        self.upstream = upstream.split("//", 1)[1]
        self.exchanges: list[dict] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                recorder.forward(self)

            def do_GET(self):
                recorder.forward(self)

            def do_POST(self):
                recorder.forward(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def forward(self, h: BaseHTTPRequestHandler) -> None:
        raw = h.rfile.read(int(h.headers.get("content-length") or 0))
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("host",)}
        tic = time.perf_counter()
        conn = http.client.HTTPConnection(self.upstream, timeout=3600)
        conn.request(h.command, h.path, body=raw or None, headers=headers)
        r = conn.getresponse()
        h.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                h.send_header(k, v)
        h.send_header("Connection", "close")
        h.end_headers()
        body, first = bytearray(), None
        while chunk := r.read1(65536) if h.command != "HEAD" else b"":
            first = first or time.perf_counter() - tic
            body += chunk
            h.wfile.write(chunk)
            h.wfile.flush()
        try:
            request = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            request = raw.decode(errors="replace")
        self.exchanges.append({
            "method": h.command, "path": h.path, "headers": headers, "body": request,
            "status": r.status, "first_byte_s": first, "total_s": time.perf_counter() - tic,
            "response_headers": {k: v for k, v in r.getheaders() if k.startswith("x-dflash2")},
            "usage": usage_of(bytes(body)), "error": error_of(r.status, bytes(body))})

    def close(self) -> None:
        self.server.shutdown()


def usage_of(body: bytes) -> dict | None:
    """(prompt tokens, cached tokens, output tokens) from a response or its SSE events."""
    text = body.decode(errors="replace")
    found = None
    for line in text.splitlines() if "data:" in text else [text]:
        data = line[5:].strip() if line.startswith("data:") else line
        try:
            obj = json.loads(data)
        except (json.JSONDecodeError, ValueError):
            continue
        u = (obj.get("usage") or (obj.get("message") or {}).get("usage")
             or (obj.get("response") or {}).get("usage")) if isinstance(obj, dict) else None
        if not u:
            continue
        if "cache_read_input_tokens" in u:                         # Anthropic
            found = {"prompt": u.get("input_tokens", 0) + u["cache_read_input_tokens"],
                     "cached": u["cache_read_input_tokens"], "output": u.get("output_tokens")}
        elif "input_tokens" in u:                                  # Responses
            found = {"prompt": u["input_tokens"],
                     "cached": (u.get("input_tokens_details") or {}).get("cached_tokens", 0),
                     "output": u.get("output_tokens")}
        elif "prompt_tokens" in u:                                 # chat completions
            found = {"prompt": u["prompt_tokens"],
                     "cached": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                     "output": u.get("completion_tokens")}
    return found


def error_of(status: int, body: bytes) -> str | None:
    text = body.decode(errors="replace")
    if status >= 400:
        return text[:300]
    m = re.search(r"event: (error|response\.failed)\ndata: (.*)", text)
    return m.group(2)[:300] if m else None


# --------------------------------------------------------------------------- servers

def start_server(args, model: str | None, draft: str | None, log: Path,
                 context: int) -> tuple:
    cmd = [sys.executable, "-m", "dflash2_mlx.cli", "serve", "--port", "0",
           "--context-length", str(context), "--allow-context-beyond-model",
           "--max-tokens", str(args.max_tokens)]
    cmd += ["--model", model] if model else []
    cmd += ["--draft", draft] if draft else []
    out = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 900
    while True:
        line = proc.stderr.readline()
        out.write(line)
        out.flush()
        if not line or time.time() > deadline:
            raise RuntimeError(f"the server did not start; see {log}")
        if m := re.search(r"serving (\S+) on (http://\S+)", line):
            break
    threading.Thread(target=lambda: [out.write(x) or out.flush() for x in proc.stderr],
                     daemon=True).start()
    return proc, m.group(1), m.group(2)


def tool_target(folder: Path, client: str, call: dict) -> tuple[str, str]:
    from dflash2_mlx.testing import drafter_args, write_drafter, write_tool_target

    call = json.dumps(call, separators=(",", ":"))
    target = write_tool_target(folder / client, call, reply=REPLY, num_hidden_layers=1,
                               num_attention_heads=1, num_key_value_heads=1,
                               max_position_embeddings=131072)
    draft = write_drafter(folder / "draft", drafter_args(layer_ids=(0,), num_target_layers=1))
    return str(target), str(draft)


# --------------------------------------------------------------------------- clients

def write_png(path: Path) -> None:
    """32x32 pixels of seeded noise: the same bytes every run."""
    import random

    from PIL import Image

    Image.frombytes("RGB", (32, 32), random.Random(0).randbytes(32 * 32 * 3)).save(path)


def client_command(client: str, exe: str, url: str, model: str, home: Path,
                   image: bool = False) -> tuple:
    """(argv, env, cwd) of one run, as a user would set the client up; `image`: the PNG in the
    working dir, attached the client's way (Claude Code reads it with its tool)."""
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb"}
    if image:
        write_png(work / IMAGE)
    ask = IMAGE_ASK if image else ASK
    if client == "claude":
        env.update(ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="none", ANTHROPIC_MODEL=model)
        return [exe, "-p", ask, "--allowedTools", "Read" if image else "Bash"], env, work
    if client == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(exist_ok=True)
        (codex_home / "config.toml").write_text(
            f'model = "{model}"\nmodel_provider = "dflash2"\n\n[model_providers.dflash2]\n'
            f'name = "dflash2-mlx"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
            'env_key = "DFLASH2_API_KEY"\n')
        env.update(CODEX_HOME=str(codex_home), DFLASH2_API_KEY="none")
        attach = ["--image", str(work / IMAGE)] if image else []   # last: it takes 1+ values
        return [exe, "exec", "--skip-git-repo-check", "-s", "workspace-write", ask,
                *attach], env, work
    # opencode turns an image into an "ERROR: Cannot read" text for a model not said to take
    # images: with one, the model says so, as a user sets up a vision model
    vision = {"modalities": {"input": ["text", "image"], "output": ["text"]}} if image else {}
    (work / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"dflash2": {"npm": "@ai-sdk/openai-compatible", "name": "dflash2-mlx",
                                 "options": {"baseURL": f"{url}/v1", "apiKey": "none"},
                                 "models": {model: {"name": model, **vision}}}},
        "model": f"dflash2/{model}"}, indent=1))
    if client == "opencode":
        return [exe, "run", ask, *(["-f", str(work / IMAGE)] if image else [])], env, work
    if client == "aider":
        (work / ".aider.model.metadata.json").write_text(json.dumps({f"openai/{model}": {
            "max_input_tokens": CONTEXT, "max_output_tokens": 4096, "max_tokens": 4096,
            "input_cost_per_token": 0, "output_cost_per_token": 0,
            "litellm_provider": "openai", "mode": "chat"}}))
        env.update(OPENAI_API_BASE=f"{url}/v1", OPENAI_API_KEY="none")
        return [exe, "--model", f"openai/{model}", "--message", ASK, "--yes-always", "--no-git",
                "--no-check-update", "--no-analytics", "--no-show-release-notes"], env, work
    if client == "llm":
        (home / "llm").mkdir(exist_ok=True)
        (home / "llm" / "extra-openai-models.yaml").write_text(
            f"- model_id: {model}\n  model_name: {model}\n  api_base: {url}/v1\n"
            "  supports_tools: true\n")
        env.update(LLM_USER_PATH=str(home / "llm"))
        return [exe, "-m", model, "--functions", WEATHER, "--td", ASK], env, work
    return [exe, "-c", AGENT, f"{url}/v1", model, ASK], env, work           # Agents SDK


def run_client(client, exe, url, model, home, timeout, image=False) -> dict:
    argv, env, cwd = client_command(client, exe, url, model, home, image)
    tic = time.perf_counter()
    try:
        p = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                           timeout=timeout)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", e.stdout or "", e.stderr or ""
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x
                    for x in (out, err))
    return {"rc": rc, "wall_s": round(time.perf_counter() - tic, 1),
            "stdout": out[-2000:], "stderr": err[-2000:]}


def find(client: str, prefix: str | None, py_prefix: str | None) -> str | None:
    """The client's executable (the Agents SDK: a Python that imports `agents`)."""
    path = os.environ["PATH"]
    if prefix:
        path = f"{Path(prefix) / 'node_modules' / '.bin'}{os.pathsep}{path}"
    if py_prefix:
        path = f"{Path(py_prefix) / 'bin'}{os.pathsep}{path}"
    if client != "agents-sdk":
        return shutil.which(client, path=path)
    python = shutil.which("python", path=path) or sys.executable
    found = subprocess.run([python, "-c", "import agents"], capture_output=True).returncode
    return python if found == 0 else None


def version(client: str, exe: str) -> str:
    if client == "agents-sdk":
        code = "import importlib.metadata as m; print(m.version('openai-agents'))"
        return subprocess.run([exe, "-c", code], capture_output=True, text=True).stdout.strip()
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    found = re.search(r"\d+\.\d+\S*", out.stdout or out.stderr)  # "2.1.197 (Claude Code)"
    return found.group(0) if out.returncode == 0 and found else "?"


# --------------------------------------------------------------------------- the runs

def home_of(out: Path, client: str, name: str) -> Path:
    return (out / "homes" / f"{client}-{name}").resolve()


def scenario(args, client, exe, name, model, draft, out: Path) -> list[dict]:
    """One server, the client's run(s) through the proxy; Claude Code twice (two sessions)."""
    context = args.context_length if name == "turn" else 4 * args.context_length
    proc, model_id, url = start_server(args, model, draft, out / f"{client}-{name}.serve.log",
                                       context)
    runs = []
    try:
        sessions = 2 if name == "turn" else 1
        home = home_of(out, client, name)               # one project, two sessions in it
        shutil.rmtree(home, ignore_errors=True)
        for session in range(1, sessions + 1):
            proxy = Recorder(url)
            result = run_client(client, exe, proxy.url, model_id, home, args.timeout,
                                image=name == "image")
            proxy.close()
            runs.append({"client": client, "scenario": name, "session": session,
                         "model": model_id, **result, "requests": proxy.exchanges})
            print(f"{client} {name} session {session}: rc {result['rc']}, "
                  f"{result['wall_s']} s, {len(proxy.exchanges)} requests", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(home, ignore_errors=True)
    return runs


def markdown(runs: list[dict]) -> str:
    lines = ["| client | scenario | session | rc | wall s | request | status | prompt tokens | "
             "from cache | first byte s | total s | error |", "|" + "---|" * 12]
    for r in runs:
        for i, x in enumerate(r["requests"], 1):
            u = x["usage"] or {}
            lines.append(
                f"| {r['client']} | {r['scenario']} | {r['session']} | {r['rc']} | "
                f"{r['wall_s']} | {i}. {x['method']} {x['path']} | {x['status']} | "
                f"{u.get('prompt', '')} | {u.get('cached', '')} | "
                f"{'' if x['first_byte_s'] is None else round(x['first_byte_s'], 2)} | "
                f"{round(x['total_s'], 2)} | {(x['error'] or '')[:60]} |")
    return "\n".join(lines) + "\n"


def has_image(body) -> bool:
    """Whether a request body holds an image part (a content part of an IMAGE_PARTS type)."""
    if isinstance(body, dict):
        return body.get("type") in IMAGE_PARTS or any(map(has_image, body.values()))
    return isinstance(body, list) and any(map(has_image, body))


def save_fixtures(runs: list[dict], folder: Path, versions: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    names = {"claude": "claude-code", "codex": "codex", "opencode": "opencode"}
    for r in runs:
        if r["scenario"] not in ("tools", "image") or r["session"] != 1:
            continue
        posts = [x for x in r["requests"] if x["method"] == "POST"]
        stem = names[r["client"]]
        if r["scenario"] == "image":   # the agent's request with the image (and its tools:
            # not opencode's title request, which carries the image too)
            posts = [x for x in posts if has_image(x["body"]) and x["body"].get("tools")][:1]
            stem = f"{stem}-image"
        for i, x in enumerate(posts, 1):
            headers = {k.lower(): v for k, v in x["headers"].items()
                       if k.lower() in FIXTURE_HEADERS}
            record = {"client": f"{names[r['client']]} {versions.get(r['client'], '')}".strip(),
                      "method": "POST", "path": x["path"], "headers": headers, "body": x["body"]}
            (folder / f"{stem}-{i}.json").write_text(
                json.dumps(record, indent=1, ensure_ascii=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="claude,codex,opencode,aider,llm,agents-sdk")
    ap.add_argument("--scenarios", default="turn,tools")
    ap.add_argument("--prefix", help="an npm prefix holding the clients (node_modules/.bin)")
    ap.add_argument("--py-prefix", help="a virtual environment holding aider, llm, agents")
    ap.add_argument("--model", help="the target of the `turn` runs (default: embedded)")
    ap.add_argument("--draft")
    ap.add_argument("--context-length", type=int, default=CONTEXT,
                    help="the `turn` server's (the `tools` server: 4x, for the byte-level "
                    "tokenizer of the tiny target)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=Path("agent-clients"))
    ap.add_argument("--save-fixtures", type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs, versions = [], {}
    fixtures = Path(tempfile.mkdtemp(prefix="agent-targets-"))
    for client in args.clients.split(","):
        exe = find(client, args.prefix, args.py_prefix)
        if exe is None:
            print(f"{client}: not installed, skipped ({INSTALL[client]})", file=sys.stderr)
            continue
        versions[client] = version(client, exe)
        for name in args.scenarios.split(","):
            if (name == "tools" and client not in CALLS
                    or name == "image" and client not in ("claude", "codex", "opencode")):
                continue
            call = CALLS.get(client)
            if name == "image" and client == "claude":      # Claude Code `Read`s the PNG
                path = home_of(args.out, client, name) / "work" / IMAGE
                call = {"name": "Read", "arguments": {"file_path": str(path)}}
            model, draft = ((args.model, args.draft) if name == "turn"
                            else tool_target(fixtures / name, client, call))
            runs += scenario(args, client, exe, name, model, draft, args.out)
            (args.out / "agent_clients.json").write_text(json.dumps(
                {"versions": versions, "runs": runs}, indent=1))
    (args.out / "agent_clients.md").write_text(
        "Clients: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + "\n\n"
        + markdown(runs))
    print(markdown(runs))
    if args.save_fixtures:
        save_fixtures(runs, args.save_fixtures, versions)


if __name__ == "__main__":
    main()
