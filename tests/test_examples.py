"""Every program in examples/ runs, so none rots: each `examples/*.py` found is run as a user
would run it. An example says how in its module docstring, on lines of its own:

    test-args: --model {llama} --draft {dflash2} --max-tokens 8
    test-stdin: first line\\nsecond line\\n
    test-server: --model {llama} --draft {dflash2}
    test-stdout: words its output must contain

{llama} and {dflash2} are the tiny fixture target and drafter (other fixtures: {qwen3},
{dflash}, and {tools}, a target that always calls get_weather(city="Paris")); an example
without a `test-args:` line runs with no arguments (the embedded default pair). `test-server:`
starts `dflash2-mlx serve` with those flags on a free loopback port first, and `{base_url}` in
`test-args:` is its address.
"""

import ast
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


def invocation(path: Path) -> tuple[str | None, ...]:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    found = {}
    for line in doc.splitlines():
        key, _, value = line.strip().partition(":")
        if key in ("test-args", "test-stdin", "test-server", "test-stdout") and value:
            found[key] = value.strip()
    return (found.get("test-args"), found.get("test-stdin"), found.get("test-server"),
            found.get("test-stdout"))


@contextlib.contextmanager
def served(flags: list[str], env: dict):
    """`dflash2-mlx serve FLAGS --port 0` until the block ends; yields its /v1 base URL."""
    proc = subprocess.Popen([sys.executable, "-m", "dflash2_mlx.cli", "serve", *flags,
                             "--port", "0"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env=env)
    try:
        deadline, url = time.monotonic() + 180, None
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            found = re.search(r"serving \S+ on (http://\S+)", line)
            url = found and found.group(1)
        assert url, "the server never said where it listens"
        yield url.rstrip("/") + "/v1"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"embed_api.py", "chat.py", "omlx_settings.py"} <= names, names


@pytest.mark.parametrize("path", [
    pytest.param(p, id=p.name, marks=[pytest.mark.server] if invocation(p)[2] else [])
    for p in EXAMPLES])
def test_example_runs(path, llama_dir, qwen3_dir, dflash2_dir, dflash_dir, tools_dir):
    args, stdin, server, expected = invocation(path)
    fixtures = {"llama": llama_dir, "qwen3": qwen3_dir, "dflash2": dflash2_dir,
                "dflash": dflash_dir, "tools": tools_dir}
    text = stdin.encode().decode("unicode_escape") if stdin else ""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with (served([f.format(**fixtures) for f in server.split()], env) if server
          else contextlib.nullcontext(None)) as base_url:
        argv = [a.format(**fixtures, base_url=base_url) for a in (args or "").split()]
        proc = subprocess.run([sys.executable, str(path), *argv], input=text,
                              capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stdout.strip(), (proc.stdout, proc.stderr)
    assert expected is None or expected in proc.stdout, (expected, proc.stdout)


def test_chat_keeps_the_conversation(llama_dir, dflash2_dir):
    """The second turn's prompt holds the first turn and its answer; /reset forgets them."""
    sys.path.insert(0, str(EXAMPLES[0].parent))
    try:
        import chat
    finally:
        sys.path.pop(0)
    import dflash2_mlx

    pipe = dflash2_mlx.load(str(llama_dir), str(dflash2_dir))
    one = [{"role": "user", "content": "Hello!"}]
    two = one + [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "2+2?"}]
    first, second = chat.render(pipe, one), chat.render(pipe, two)
    assert len(second) > len(first)
    assert pipe.tokenizer.decode(second).count("Hello!") == 1
    assert "Hi." in pipe.tokenizer.decode(second)
