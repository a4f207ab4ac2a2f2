"""The tests' fixtures: the random-weight checkpoints of `dflash2_mlx.testing` (shared with the
benchmarks), re-exported under the names the test files import; and, for the tests only, a
target that always calls a tool (`write_tool_target`) and `Server`, a `dflash2-mlx serve`
subprocess on loopback (conftest.py's `server` fixture runs one with the limits below).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx

from dflash2_mlx.testing import (CHAT_TEMPLATE, HIDDEN, SMOLLM2_DRAFTER, TARGET_LAYERS, VOCAB,
                                 drafter_args, random_drafter, smollm2_drafter_args,
                                 target_config, write_drafter, write_target)

__all__ = ["CHAT_TEMPLATE", "HIDDEN", "SMOLLM2_DRAFTER", "TARGET_LAYERS", "VOCAB", "drafter_args",
           "random_drafter", "smollm2_drafter_args", "target_config", "write_drafter",
           "write_target", "write_tool_target", "Server", "TOOL_CALL", "TOOL_TEMPLATE", "KEY",
           "CAP", "CONTEXT", "BODY", "BLOCK"]


# --------------------------------------------------------------------------- tools and servers

TOOL_CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}Call one as <tool_call>{...}</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message.tool_calls %}{% for tool_call in message.tool_calls %}"
    "{% set tool_call = tool_call.function %}<tool_call>{\"name\":\"{{ tool_call.name }}\","
    "\"arguments\":{{ tool_call.arguments | tojson }}}</tool_call>{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tool_target(folder: Path) -> Path:
    """A llama whose greedy answer to any chat prompt is `<tool_call>TOOL_CALL</tool_call>`
    then <|im_end|>: every layer adds nothing (o_proj, down_proj zero), so the next token
    depends on the current one only, and the head maps a chain of tokens one to the next."""
    from tokenizers import Tokenizer

    write_target(folder, "llama", seed=5)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens(["<tool_call>", "</tool_call>", TOOL_CALL])
    tok.save(str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))

    ids = [tok.token_to_id(t) for t in ("<tool_call>", TOOL_CALL, "</tool_call>",
                                         "<|im_end|>")]
    newline = tok.encode("<|im_start|>assistant\n").ids[-1]   # every chat prompt ends so
    # (test_server checks these premises through mlx-lm's tokenizer loader)
    chain = list(zip([newline] + ids[:-1], ids))
    w = dict(mx.load(str(folder / "model.safetensors")))
    for k in w:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = mx.zeros_like(w[k])
    embed, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    dims = len(chain)
    head = head * (mx.arange(head.shape[1]) >= dims)        # no other token reads dims 0..3
    for d, (src, dst) in enumerate(chain):
        one = (mx.arange(embed.shape[1]) == d).astype(embed.dtype)
        embed[src] = one * 4.0
        head[dst] = one * 10.0
    w["model.embed_tokens.weight"], w["lm_head.weight"] = embed, head
    mx.save_safetensors(str(folder / "model.safetensors"), w)
    return folder


KEY = "test-key-123"
CAP = 96                 # --max-tokens
CONTEXT = 512            # --context-length
BODY = 64 * 1024         # --max-body-bytes
BLOCK = 8                # a fixed width: "auto" would time cycles, so seeded runs could differ


class Server:
    """A `dflash2-mlx serve` subprocess; `url` once it printed its address."""

    def __init__(self, *args):
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dflash2_mlx.cli", "serve", "--port", "0", "--block-size",
             str(BLOCK), *map(str, args)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.log: list[str] = []
        deadline = time.time() + 120
        self.url = None
        while self.url is None:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("the server exited before it was ready:\n" + "".join(self.log))
            self.log.append(line)
            if m := re.search(r"serving \S+ on (http://\S+)", line):
                self.url = m.group(1)
            if time.time() > deadline:
                raise RuntimeError("the server did not get ready:\n" + "".join(self.log))
        self._drain = threading.Thread(target=lambda: self.log.extend(self.proc.stderr),
                                       daemon=True)
        self._drain.start()

    def stop(self, sig=signal.SIGTERM, timeout=30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        self._drain.join(5)
        return rc

    def health(self) -> dict:
        import httpx

        return httpx.get(self.url + "/health", timeout=10).json()
