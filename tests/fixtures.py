"""Tiny random-weight checkpoints in the real formats, written by the tests themselves.

- targets: mlx-lm model folders (config.json, model.safetensors, tokenizer.json + config),
  with a small byte-level BPE tokenizer trained here;
- drafters: DFlash / DFlash 2 folders in the published layout (BF16 safetensors,
  `dflash_config`, bare selector codebook tensors);
- a target that always calls a tool (`write_tool_target`), and `Server`, a `dflash2-mlx serve`
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
from mlx.utils import tree_flatten

from dflash2_mlx.config import DFLASH, DFLASH2, DrafterArgs
from dflash2_mlx.drafter import Drafter
from dflash2_mlx.loading import save_drafter

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i * i)\n",
    "Hello! How can I help you today? I am a small assistant.",
    "import math\nprint(math.sqrt(2))\n",
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n",
] * 4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 384
HIDDEN = 64
TARGET_LAYERS = 4


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": 4096}))


def target_config(family: str, **overrides) -> dict:
    cfg = {"model_type": family, "hidden_size": HIDDEN, "num_hidden_layers": TARGET_LAYERS,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "max_position_embeddings": 4096,
           "rope_theta": 10000.0, "tie_word_embeddings": False,
           "eos_token_id": 2}
    if family in ("qwen3", "qwen2"):
        cfg["head_dim"] = 16
    cfg.update(overrides)
    return cfg


def write_target(folder: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """An mlx-lm model folder with random weights (scaled up so greedy output varies)."""
    from mlx_lm.utils import _get_classes

    folder.mkdir(parents=True, exist_ok=True)
    cfg = target_config(family, **overrides)
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(cfg))
    # Untied head and larger embeddings: a random model whose greedy output varies (a tied
    # random model mostly repeats its input token).
    params = dict(tree_flatten(model.parameters()))
    params = {k: (v * 4 if "embed_tokens" in k else v) for k, v in params.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), params)
    (folder / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(folder)
    return folder


def drafter_args(*, dflash2: bool = True, block_size: int = 16, layer_ids=(0, 2),
                 layers: int = 2, **overrides) -> DrafterArgs:
    base = dict(hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=VOCAB,
                block_size=block_size, target_layer_ids=tuple(layer_ids), mask_token_id=VOCAB - 1,
                rms_norm_eps=1e-6, rope_theta=1e6, layer_types=("full_attention",) * layers,
                num_target_layers=TARGET_LAYERS, architecture=DFLASH2 if dflash2 else DFLASH)
    if dflash2:
        base.update(conv_kernel_size=2, conv_group_size=16, selector_rank=32, selector_top_k=16)
    base.update(overrides)
    return DrafterArgs(**base)


def random_drafter(args: DrafterArgs, seed: int = 0) -> Drafter:
    mx.random.seed(seed)
    drafter = Drafter(args)
    if args.has_conv:   # non-trivial convolution: identity plus noise
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                base = mx.random.normal(conv.base_kernel.shape) * 0.3
                conv.base_kernel = base + mx.array([1.0, 0.0])[None, :, None]
                conv.kernel_projection.weight = conv.kernel_projection.weight * 3
    return drafter


def write_drafter(folder: Path, args: DrafterArgs | None = None, seed: int = 0,
                  dtype=mx.bfloat16) -> Path:
    """A drafter folder in the published layout (BF16 by default)."""
    return save_drafter(random_drafter(args or drafter_args(), seed), folder, dtype)


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
    assert "tool_call.name" in TOOL_TEMPLATE and CHAT_TEMPLATE   # mlx-lm infers json_tools

    ids = [tok.token_to_id(t) for t in ("<tool_call>", TOOL_CALL, "</tool_call>",
                                         "<|im_end|>")]
    newline = tok.encode("<|im_start|>assistant\n").ids[-1]   # every chat prompt ends so
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
