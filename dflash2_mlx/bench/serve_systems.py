"""The systems of the server load test (`dflash2_mlx.bench.serve_load`): which `serve` flags
each runs with, the mlx-lm export of the same target, and their server processes (started,
waited for, stopped). httpx, MLX and mlx-lm are imported where they are used."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

# the dflash2-mlx systems: `serve` flags after --model (the drafter is added where "draft")
SERVE_ARGS = {"ours": ["draft"], "one-at-a-time": ["draft", "--max-batch", "1"],
              "spec-off": ["--block-size", "1", "--no-lookup"],
              "no-cache": ["draft", "--prompt-cache-size", "0"], "no-drafter": [],
              "no-lookup": ["draft", "--no-lookup"], "plain": ["--no-lookup"],
              "ours-before": ["draft"]}
SYSTEMS = (*SERVE_ARGS, "mlx-lm")
QUEUE_SIZE = 64
MLX_LM_CONCURRENCY = ["--decode-concurrency", "32", "--prompt-concurrency", "8"]
# `python -m mlx_lm server ...` with the BLAS dflash2-mlx runs on: chosen before MLX loads
MLX_LM_SERVER = ("import dflash2_mlx; dflash2_mlx.use_fast_blas(); "
                 "from mlx_lm import server; server.main()")


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
