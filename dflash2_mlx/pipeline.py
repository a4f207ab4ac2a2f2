"""The Python API: `load()` a target and a drafter, then `generate()` or `stream()`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import mlx.nn as nn

from . import runtime
from .drafter import Drafter
from .engine import GenerationStats, generate_tokens
from .kernels import resolve_kernel_path
from .loading import load_drafter, load_target
from .sampling import Sampling
from .target import TargetAdapter


@dataclass
class Chunk:
    """Text and token ids committed by one step (prefill or one draft-verify cycle)."""

    text: str
    tokens: list[int]
    stats: GenerationStats
    finish_reason: str | None = None     # "stop" | "length" on the last chunk


@dataclass
class Generation:
    text: str
    tokens: list[int]
    stats: GenerationStats
    finish_reason: str = "length"
    prompt_tokens: list[int] = field(default_factory=list)


class Pipeline:
    """A target (an mlx-lm model, usable with mlx-lm's own functions), its tokenizer, and a
    drafter (None: plain decoding)."""

    def __init__(self, target: nn.Module, tokenizer, drafter: Drafter | None = None, *,
                 prefill_step_size: int = 2048):
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.prefill_step_size = prefill_step_size
        self.adapter = TargetAdapter(target, drafter.args.target_layer_ids if drafter else ())

    # ---- prompts
    def encode(self, prompt: str | Sequence[int], chat_template: bool | None = None,
               system: str | None = None) -> list[int]:
        """A list of ids is used as is; a string gets the chat template when the tokenizer has
        one (unless chat_template=False), exactly as `mlx_lm generate` renders it."""
        if not isinstance(prompt, str):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.adapter.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                                 f"0..{self.adapter.vocab_size - 1}")
            return ids
        tok = self.tokenizer
        use_template = chat_template is not False and bool(getattr(tok, "has_chat_template",
                                                                   tok.chat_template))
        if chat_template is True and not use_template:
            raise ValueError("chat_template=True but the tokenizer has no chat template")
        if not use_template:
            return tok.encode(prompt)
        messages = ([{"role": "system", "content": system}] if system else [])
        messages.append({"role": "user", "content": prompt})
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    def block_size(self, block_size: int | None) -> int:
        """The runtime block width: 1 <= b <= the drafter's block size (default: the drafter's)."""
        if self.drafter is None:
            if block_size not in (None, 1):
                raise ValueError(f"block_size={block_size} needs a drafter; this pipeline has "
                                 "none (plain decoding, block size 1)")
            return 1
        limit = self.drafter.args.block_size
        b = limit if block_size is None else block_size
        if not isinstance(b, int) or not 1 <= b <= limit:
            raise ValueError(f"block_size must be an integer in 1..{limit} (the drafter's "
                             f"block size), got {block_size!r}")
        return b

    # ---- generation
    def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 256,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               seed: int | None = None, block_size: int | None = None,
               chat_template: bool | None = None, system: str | None = None,
               stop_tokens: Sequence[int] = ()) -> Iterator[Chunk]:
        """Yield chunks as tokens are accepted; the last chunk carries `finish_reason`."""
        sampling = Sampling(temperature, top_p, top_k)
        b = self.block_size(block_size)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        ids = self.encode(prompt, chat_template, system)
        stop_ids = set(self.tokenizer.eos_token_ids) | {int(t) for t in stop_tokens}
        stats = GenerationStats()
        detok = self.tokenizer.detokenizer
        detok.reset()
        steps = generate_tokens(self.adapter, self.drafter, ids, max_tokens=max_tokens,
                                sampling=sampling, block_size=b, stop_ids=stop_ids, seed=seed,
                                prefill_step_size=self.prefill_step_size, stats=stats)
        count = 0
        for new in steps:
            count += len(new)
            for t in new:
                if t not in stop_ids:
                    detok.add_token(t)
            finish = ("stop" if new[-1] in stop_ids else "length" if count >= max_tokens
                      else None)
            if finish:
                detok.finalize()
            yield Chunk(detok.last_segment, new, stats, finish)

    def generate(self, prompt: str | Sequence[int], **options) -> Generation:
        """Run to the end; options as for `stream`."""
        text, tokens, finish, stats = [], [], "length", None
        for chunk in self.stream(prompt, **options):
            text.append(chunk.text)
            tokens.extend(chunk.tokens)
            stats = chunk.stats
            finish = chunk.finish_reason or finish
        return Generation("".join(text), tokens, stats, finish)


def load(model: str, draft: str | None = None, *, draft_bits: int | None = None,
         draft_group_size: int = 64, dtype=None, kernels: str | None = None) -> Pipeline:
    """Load a target (mlx-lm folder, hub id or .gguf file) and a DFlash / DFlash 2 drafter.

    dtype: weight dtype ("float32", "bfloat16", ...); default float32 on CPU (quantized targets
    dequantized, since fp32 runs through BLAS) and the checkpoint's own on Metal.
    draft_bits: None (unquantized), 4 or 8. kernels: "metal", "ops" or None (auto).
    """
    dtype = runtime.parse_dtype(dtype)
    on_metal = runtime.on_metal()
    if dtype is None and not on_metal:
        dtype = runtime.default_dtype()
    target, tokenizer, _ = load_target(model, dtype, keep_quantized=on_metal)
    drafter = None
    if draft is not None:
        adapter = TargetAdapter(target)
        drafter = load_drafter(draft, hidden_size=adapter.hidden_size,
                               vocab_size=adapter.vocab_size, num_layers=adapter.num_layers,
                               dtype=dtype, bits=draft_bits, group_size=draft_group_size)
        drafter.kernels = resolve_kernel_path(kernels)
    return Pipeline(target, tokenizer, drafter)
