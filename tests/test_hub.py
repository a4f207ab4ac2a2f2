"""The Hugging Face Hub path, end to end: `load("org/name")` and the CLI download a target and
its drafter by id from a local stand-in for the Hub (`hub_server.HubServer`, through
`HF_ENDPOINT`) into a temporary `HF_HOME`, never the user's cache; then the cache serves them
offline; a download cut off halfway is resumed; a wrong id, a gated repository and a Hub that
does not answer each end in one line naming the id and the fix.

huggingface_hub reads its settings (endpoint, cache, offline, timeouts) once, at import: every
run here is a fresh process with its own environment.
"""

import json
import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest

import dflash2_mlx
from hub_server import HubServer
from test_cli import EXE, PROMPT, lines

TARGET, DRAFTER, GATED = "org/tiny", "org/tiny-DFlash", "org/tiny-gated"
HUB_VARS = ("HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN",
            "HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT", "TRANSFORMERS_OFFLINE")


def hub_env(hub: HubServer | None, home: Path, **extra) -> dict:
    """The environment of a run against `hub` with its own cache `home` (the user's Hub
    settings removed)."""
    env = {k: v for k, v in os.environ.items() if k not in HUB_VARS}
    env["HF_HOME"] = str(home)
    if hub is not None:
        env["HF_ENDPOINT"] = hub.url
    return {**env, **extra}


def cli(*args, env):
    return subprocess.run([EXE, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=300)


def cli_many(cases):
    """(args, env) pairs run at once."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda case: cli(*case[0], env=case[1]), cases))


def python(code: str, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def hub(llama_dir, dflash2_dir):
    with HubServer({TARGET: llama_dir, DRAFTER: dflash2_dir, GATED: llama_dir},
                   gated={GATED}) as server:
        yield server


@pytest.fixture(scope="module")
def local_text(llama_dir, dflash2_dir):
    """The greedy text of the pair loaded from its folders: what the Hub copies must give."""
    return dflash2_mlx.load(str(llama_dir), str(dflash2_dir)).generate(
        PROMPT, max_tokens=8).text


def test_load_downloads_target_and_drafter_by_id(hub, tmp_path, local_text):
    code = ("import json, dflash2_mlx\n"
            f"pipe = dflash2_mlx.load({TARGET!r}, {DRAFTER!r})\n"
            f"print(json.dumps(pipe.generate({PROMPT!r}, max_tokens=8, block_size=4).text))")
    proc = python(code, hub_env(hub, tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == local_text
    snapshots = {p.parent.parent.name for p in (tmp_path / "hf" / "hub").glob("*/snapshots/*")}
    assert snapshots == {"models--org--tiny", "models--org--tiny-DFlash"}


def _on_a_terminal(args, env) -> tuple[int, str]:
    """Run the CLI with stderr on a pseudo-terminal: (exit status, what the terminal showed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    proc = subprocess.Popen([EXE, *map(str, args)], stdout=subprocess.DEVNULL, stderr=slave,
                            env=env)
    os.close(slave)
    shown = []

    def read():
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:          # the terminal closed with the process
                break
            if not data:
                break
            shown.append(data)

    reader = threading.Thread(target=read)
    reader.start()
    code = proc.wait(timeout=300)
    reader.join(timeout=10)
    os.close(master)
    return code, b"".join(shown).decode(errors="replace")


@pytest.mark.slow  # 10 s
def test_cli_downloads_with_progress_on_a_terminal_only_then_runs_offline(
        llama_dir, dflash2_dir, tmp_path, local_text):
    """Two downloads at once, one with stderr on a terminal, one piped; then the piped one's
    cache serves a run with the Hub gone and HF_HUB_OFFLINE=1."""
    args = ["generate", "--model", TARGET, "--draft", DRAFTER, "--prompt", PROMPT,
            "--max-tokens", 8, "--block-size", 4]   # a fixed width: no calibration
    with HubServer({TARGET: llama_dir, DRAFTER: dflash2_dir}) as hub:
        result = {}
        tty = threading.Thread(target=lambda: result.update(
            tty=_on_a_terminal(args, hub_env(hub, tmp_path / "tty"))))
        tty.start()
        piped = cli(*args, env=hub_env(hub, tmp_path / "hf"))
        tty.join()
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == local_text + "\n"
    assert f"fetching target model {TARGET}" in piped.stderr
    assert f"fetching draft model {DRAFTER}" in piped.stderr
    assert "\r" not in piped.stderr and "Fetching" not in piped.stderr   # no bars in a pipe
    code, shown = result["tty"]
    assert code == 0, shown
    assert "Fetching" in shown and "\r" in shown                        # bars on a terminal

    offline = cli(*args, env=hub_env(None, tmp_path / "hf", HF_HUB_OFFLINE="1"))
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == local_text + "\n"
    assert "fetching" not in offline.stderr and "note" not in offline.stderr


def test_an_interrupted_download_is_resumed(tmp_path):
    """The connection drops halfway through a file (past huggingface_hub's 10 MB read chunk,
    so part of it was written): the download goes on from there with a Range request."""
    repo = tmp_path / "repo"
    repo.mkdir()
    weights = {"w": mx.arange(6 << 20, dtype=mx.float32)}          # 24 MB
    mx.save_safetensors(str(repo / "model.safetensors"), weights)
    (repo / "config.json").write_text("{}")
    code = ("from dflash2_mlx.loading.hub import snapshot\n"
            "print(snapshot('org/big', 'draft model'))")
    with HubServer({"org/big": repo}) as hub:
        hub.drop_once.add("model.safetensors")
        proc = python(code, hub_env(hub, tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    got = Path(proc.stdout.strip()) / "model.safetensors"
    assert got.read_bytes() == (repo / "model.safetensors").read_bytes()
    first, again = hub.fetched("model.safetensors")
    assert first is None and again.startswith("bytes=") and int(again[6:].rstrip("-")) > 0


@pytest.mark.slow  # 13 s
def test_hub_errors_are_one_line_naming_the_id_and_the_fix(hub, llama_dir, tmp_path):
    """A wrong id (404), a gated repository (401) and a Hub that does not answer: one error
    line each, no traceback; --verbose adds it."""
    args = ["generate", "--prompt", PROMPT, "--max-tokens", 2, "--block-size", 4]
    with HubServer({TARGET: llama_dir}) as stalled:
        stalled.silent = True
        quick = dict(HF_HUB_ETAG_TIMEOUT="1", HF_HUB_DOWNLOAD_TIMEOUT="1")
        missing, gated, silent, verbose = cli_many([
            ((*args, "--model", "org/no-such-model"), hub_env(hub, tmp_path / "a")),
            ((*args, "--model", GATED), hub_env(hub, tmp_path / "b")),
            ((*args, "--model", TARGET), hub_env(stalled, tmp_path / "c", **quick)),
            ((*args, "--model", "org/no-such-model", "--verbose"), hub_env(hub, tmp_path / "d")),
        ])
    wanted = {
        missing: ["target model 'org/no-such-model'", "no such repository", "check the id"],
        gated: [f"target model '{GATED}' is a gated repository", "HF_TOKEN", "hf auth login",
                "huggingface-cli login"],
        silent: [f"target model '{TARGET}'", "could not be reached", "no answer in time",
                 "HF_HUB_ETAG_TIMEOUT"],
    }
    for proc, parts in wanted.items():
        assert proc.returncode == 1, proc.stderr
        errors = [line for line in lines(proc.stderr) if "error:" in line]
        assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert errors[0] == lines(proc.stderr)[-1], proc.stderr          # the last word
        assert errors[0].startswith("dflash2-mlx: error: "), proc.stderr
        assert all(part in errors[0] for part in parts), errors[0]
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr
    assert "RepositoryNotFoundError" in verbose.stderr



def test_doctor_model_reads_only_config_json_from_the_hub(tmp_path):
    """`doctor --model ID` answers from the target's config.json alone: the weights stay on
    the Hub. A Qwen3-8B-shaped config under an mlx-community name finds DeepSeek's DSpark
    drafter (preferred over z-lab's DFlash one) and says its kind."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": 4096, "vocab_size": 151936,
        "num_hidden_layers": 36, "quantization": {"group_size": 64, "bits": 4}}))
    (repo / "model.safetensors").write_bytes(b"\0" * 4096)
    with HubServer({"mlx-community/Qwen3-8B-4bit": repo}) as hub:
        proc = cli("doctor", "--model", "mlx-community/Qwen3-8B-4bit",
                   env=hub_env(hub, tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    rows = {line[:14].strip(): line[14:] for line in proc.stdout.splitlines()}
    assert rows["shape"] == "qwen3, hidden size 4096, vocabulary 151936, 36 layers"
    assert rows["drafter"].startswith("deepseek-ai/dspark_qwen3_8b_block7 (block size 7): "
                                      "DSpark, published for Qwen/Qwen3-8B")
    assert "github.com/deepseek-ai/DeepSpec" in rows["drafter card"]
    files = {path.rsplit("/", 1)[1] for _, path, _ in hub.requests if "/resolve/" in path}
    assert files == {"config.json"}, hub.requests
