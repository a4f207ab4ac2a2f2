"""Every program in examples/ runs, so none rots: each `examples/*.py` found is run as a user
would run it. An example says how in its module docstring, on lines of its own:

    test-args: --model {llama} --draft {dflash2} --max-tokens 8
    test-stdin: first line\\nsecond line\\n

{llama} and {dflash2} are the tiny fixture target and drafter (other fixtures: {qwen3},
{dflash}); an example without a `test-args:` line runs with no arguments (the embedded
default pair).
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


def invocation(path: Path) -> tuple[str | None, str | None]:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    found = {}
    for line in doc.splitlines():
        key, _, value = line.strip().partition(":")
        if key in ("test-args", "test-stdin") and value:
            found[key] = value.strip()
    return found.get("test-args"), found.get("test-stdin")


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"embed_api.py", "chat.py", "omlx_settings.py"} <= names, names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path, llama_dir, qwen3_dir, dflash2_dir, dflash_dir):
    args, stdin = invocation(path)
    fixtures = {"llama": llama_dir, "qwen3": qwen3_dir, "dflash2": dflash2_dir,
                "dflash": dflash_dir}
    argv = [a.format(**fixtures) for a in (args or "").split()]
    text = stdin.encode().decode("unicode_escape") if stdin else ""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(path), *argv], input=text, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stdout.strip(), (proc.stdout, proc.stderr)


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
