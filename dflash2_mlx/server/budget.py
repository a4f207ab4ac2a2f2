"""`MemoryBudget`: the memory the server's scheduler keeps to (`serve --memory-budget`).

The budget is for every MLX array of the process: the weights, the running sequences' caches,
the prefix cache's RAM tier and a prefill step's attention scores. A sequence is counted at
the length it may reach (its prompt plus its max_tokens), laid out as the engine holds it
(`model.memory.Footprint`). docs/server.md, "Memory".
"""

from __future__ import annotations

from dataclasses import asdict, is_dataclass

from .. import log as logs
from ..model import memory
from ..pipeline import Pipeline

log = logs.get(__name__)
JOIN_LAYERS = 3         # a join's copies beside the batch, in layers of the new batch


class MemoryBudget:
    """The server's budget over `pipe`. setting: `--memory-budget` (None: the device's memory
    less a margin; bytes; "70%" of the device's memory). device: the device's memory in
    bytes (None: what MLX reports, `memory.device_memory`). batched: the engine batches
    (a ragged batch pads rows to the longest)."""

    def __init__(self, pipe: Pipeline, setting=None, *, batched: bool = True,
                 device: int | None = None):
        self.device, self.source = memory.device_memory() if device is None else \
            (device, "given")
        self.setting = setting
        self.limit = memory.budget_bytes(setting, self.device)
        self.weights = memory.weights_bytes(pipe.target) + (
            memory.weights_bytes(pipe.drafter) if pipe.drafter is not None else 0) + \
            derived_weights(pipe) + (pipe.vision.weights_bytes
                                     if getattr(pipe, "vision", None) is not None else 0)
        kv = getattr(pipe, "kv", None)           # the target's quantized KV cache, if any
        self.kv_bits = getattr(kv, "bits", None)
        self.kv_group_size = getattr(kv, "group_size", None) or memory.KV_GROUP_SIZE
        self.itemsize = memory.activation_itemsize(pipe.target)
        config = model_config(pipe.target)
        text = memory.text_config(config)
        self.n_heads = int(text["num_attention_heads"])
        self.n_kv_heads = int(text.get("num_key_value_heads") or self.n_heads)
        self.head_dim = int(text.get("head_dim") or text["hidden_size"] // self.n_heads)
        self.layers = int(text.get("num_hidden_layers") or 1)
        self.target = memory.kv_cost(config, self.kv_bits, self.kv_group_size, self.itemsize)
        drafter = None if pipe.drafter is None else memory.drafter_cost(
            pipe.drafter.args, memory.activation_itemsize(pipe.drafter))
        self.footprint = memory.Footprint(self.target, drafter, batched)
        if self.limit <= self.weights:
            raise ValueError(f"--memory-budget {memory.gib(self.limit)} leaves nothing for the "
                             f"caches: the weights take {memory.gib(self.weights)}; give more "
                             f"(the device has {memory.gib(self.device)})")
        self.failures = 0                  # allocation failures survived

    @property
    def room(self) -> int:
        """The bytes for caches: the budget less the weights."""
        return self.limit - self.weights

    def need(self, lengths: list[int]) -> int:
        """The bytes of sequences that may reach these lengths, running together."""
        return self.footprint.bytes(lengths)

    def join_bytes(self, lengths: list[int]) -> int:
        """What a sequence joining a batch of these lengths (the joiner's included) holds
        for a moment beyond them: `RaggedRows.join` copies a layer at a time, the new
        buffer beside the old one, the joiner's and their padded copies (JOIN_LAYERS
        layers' worth of the new batch)."""
        if not lengths or not self.footprint.batched:
            return 0
        batch = len(lengths) * self.target.bytes(memory.buffer_slots(max(lengths)))
        return JOIN_LAYERS * batch // max(1, self.layers)

    def most_tokens(self) -> int:
        """The longest sequence (prompt + completion) that fits alone."""
        return self.footprint.most_tokens(self.room)

    def prefill_tokens(self, free: int, context: int) -> int:
        """Prompt tokens one forward may take beside `free` bytes of the budget, at a context
        of `context` tokens (`memory.prefill_tokens`; a quantized cache's attention may hold
        a float copy of the keys and values too)."""
        dequantized = 0 if self.kv_bits is None else \
            memory.kv_bytes_per_token(self.n_kv_heads, self.head_dim, None,
                                      itemsize=self.itemsize)
        return memory.prefill_tokens(free, context, self.n_heads, dequantized=dequantized)

    def too_long(self, tokens: int, images: int = 0) -> str:
        """Why a sequence of `tokens` (whose images hold `images` bytes while the tower runs)
        never fits, with the numbers and the flags that help."""
        fit = self.most_tokens()
        if images and self.need([tokens]) <= self.room:
            return (f"its images need {memory.gib(images)} while the vision tower runs, beside "
                    f"{memory.gib(self.need([tokens]))} of KV cache for its {tokens} tokens; "
                    f"the memory budget of {memory.gib(self.limit)} leaves "
                    f"{memory.gib(self.room)} beside the weights. Send fewer or smaller "
                    f"images, or raise --memory-budget above {memory.gib(self.limit)}")
        kib = self.target.per_token / 1024
        kv = "float" if self.kv_bits is None else f"{self.kv_bits}-bit"
        hints = [] if self.kv_bits == 4 else [
            f"--kv-bits {8 if self.kv_bits is None else 4} (more tokens a byte)"]
        hints += [f"--memory-budget above {memory.gib(self.limit)}",
                  f"--context-length {fit} (clients then keep their prompts within it)"]
        return (f"{tokens} tokens need {memory.gib(self.need([tokens]))} of KV cache "
                f"({kib:.1f} KiB a token, {kv}); the memory budget of "
                f"{memory.gib(self.limit)} holds {memory.gib(self.weights)} of weights and at "
                f"most {fit} tokens beside them. Server options that help: {', '.join(hints)}")

    def describe(self) -> dict:
        """The budget's figures for /health. sequence_bytes: one sequence's caches at 4k and
        8k tokens, all of them counted (target, drafter, pending features)."""
        return {"budget": self.limit, "setting": self.setting, "device": self.device,
                "device_source": self.source, "weights": self.weights,
                "kv_bits": self.kv_bits, "kv_bytes_per_token": self.target.per_token,
                "sequence_bytes": {n: self.need([n]) for n in (4096, 8192)},
                "most_tokens": self.most_tokens(), "failures": self.failures}


def derived_weights(pipe: Pipeline) -> int:
    """Arrays made from the weights at their first use, counted with them: the target's head
    restricted to the drafter's draft vocabulary (`head_rows`; 42 MiB for the embedded pair
    in float32)."""
    vocab = getattr(pipe.drafter, "draft_vocab", None)
    head = getattr(pipe.adapter, "head_module", None)
    if vocab is None or head is None:
        return 0
    module = head()
    parts = [getattr(module, k, None) for k in ("weight", "scales", "biases")]
    rows = module.weight.shape[0]
    return sum(a.nbytes for a in parts if a is not None) * vocab.ids.size // rows


def model_config(model) -> dict:
    """The config fields of an mlx-lm model (its `args`), as config.json names them."""
    args = getattr(model, "args", None)
    if args is None:
        raise ValueError(f"{type(model).__name__} has no `args`: its cache cannot be sized "
                         "for a memory budget")
    return asdict(args) if is_dataclass(args) else dict(vars(args))


def engine_bytes(engine) -> int:
    """The bytes the engine's caches hold now: the batch's buffers (as allocated), and each
    sequence's own caches, drafter context and pending features."""
    seqs = list(engine.rows) + list(engine.queue)
    caches = list(engine.caches.cache or []) if not engine.solo else []
    for seq in seqs:
        s = seq.state
        caches += list(s.cache or []) + list(s.dcache or [])
    return sum(_cache_bytes(c) for c in caches) + sum(
        p.nbytes for seq in seqs for p in seq.state.pending)


def _cache_bytes(c) -> int:
    """A cache's buffers as allocated (keys and values; a quantized cache's are tuples of
    codes, scales and biases), else the arrays of its state (a recurrent layer's)."""
    held = [c.keys, c.values] if hasattr(c, "keys") and hasattr(c, "values") else c.state
    return sum(a.nbytes for a in _flat(held))


def _flat(state):
    for s in state if isinstance(state, (list, tuple)) else (state,):
        if isinstance(s, (list, tuple)):
            yield from _flat(s)
        elif s is not None and hasattr(s, "nbytes"):
            yield s
