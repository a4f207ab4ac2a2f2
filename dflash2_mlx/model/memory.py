"""What the caches cost in bytes and what the device holds: the server's memory budget.

- `kv_cost(config, kv_bits, kv_group_size, itemsize)`: one sequence's cache bytes as a function
  of its length, from a model's config.json fields alone: full-attention layers grow with every
  token (in float, or quantized along head_dim as mlx-lm's `QuantizedKVCache` stores them),
  sliding-window layers up to their window, recurrent (GatedDeltaNet) layers a fixed state.
- `device_memory()`: the memory MLX reports for the device (Metal: the recommended working
  set), else the machine's RAM; `budget_bytes` turns `--memory-budget` into bytes.
- `Footprint`: the bytes of a set of running sequences as the engine lays them out (a ragged
  batch pads every row to the longest), which the scheduler admits against.
- `prefill_tokens`: the prompt tokens one forward may take so that its attention scores fit.
- `fit_lines`: `doctor --model`'s "will it fit" answer.
docs/server.md, "Memory".
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from .. import settings as check
from ..settings import KV_GROUP_SIZE

STEP = 256                   # mlx-lm's caches grow in steps of 256 tokens
# a batch buffer's holes (rejected drafts) are squeezed out once they are COMPACT_MIN slots
# and 1/COMPACT_SHARE of the buffer (`model.row_caches.RaggedKVCache`)
COMPACT_MIN, COMPACT_SHARE = 64, 16
MARGIN = 0.10                # of the device's memory, kept out of the default budget
MIN_MARGIN = 512 * 2**20     # bytes
FULL, SLIDING, RECURRENT, NONE = "full_attention", "sliding_attention", "recurrent", "none"
_RECURRENT_TYPES = ("linear_attention", "mamba", "recurrent", "ssm", "conv")


# ---------------------------------------------------------------- bytes per token, from config

def text_config(config: dict) -> dict:
    """The language model's fields: a VLM wrapper's `text_config` over the top level, with
    the defaults of mlx-lm's ModelArgs that change a cache's size where config.json may leave
    them out (Gemma 4's full-attention head_dim and its layers that share another's cache)."""
    inner = config.get("text_config")
    c = {**config, **inner} if isinstance(inner, dict) else dict(config)
    if str(c.get("model_type", "")).startswith("gemma4"):
        c = {"global_head_dim": 512, "num_kv_shared_layers": 20, **c}
    return c


def layer_kinds(config: dict) -> list[str]:
    """Each layer's cache kind (FULL, SLIDING, RECURRENT or NONE), in the order of mlx-lm's
    cache list, as its `make_cache` decides it: `hybrid_override_pattern` (nemotron_h: Mamba-2
    blocks recurrent, attention full, MoE and MLP blocks none), `layer_types` (llama, mistral,
    gpt-oss, qwen3.5, lfm2's short convolutions recurrent, ...), else gemma3's
    `sliding_window_pattern`, else qwen3-next's `full_attention_interval` (the others
    GatedDeltaNet), else every layer full attention. Gemma 4's last `num_kv_shared_layers`
    reuse earlier layers' caches (none); Nanbeige runs its stack `num_loops` times, each pass
    with caches of its own."""
    c = text_config(config)
    types, pattern = c.get("layer_types"), c.get("hybrid_override_pattern")
    if pattern:
        return [RECURRENT if b == "M" else FULL if b == "*" else NONE for b in pattern]
    n = _int(c, "num_hidden_layers")
    if types:
        if len(types) != n:
            raise ValueError(f"config.json: layer_types has {len(types)} entries for "
                             f"num_hidden_layers {n}")
        kinds = [SLIDING if "sliding" in t or "chunked" in t
                 else RECURRENT if any(r in t for r in _RECURRENT_TYPES) else FULL
                 for t in types]
    elif c.get("sliding_window_pattern") and c.get("sliding_window"):
        p = int(c["sliding_window_pattern"])
        kinds = [FULL if i % p == p - 1 else SLIDING for i in range(n)]
    elif c.get("full_attention_interval") and c.get("linear_num_value_heads"):
        k = int(c["full_attention_interval"])
        kinds = [FULL if (i + 1) % k == 0 else RECURRENT for i in range(n)]
    else:
        kinds = [FULL] * n
    shared = int(c.get("num_kv_shared_layers") or 0)
    if 0 < shared < len(kinds):
        kinds = kinds[:-shared] + [NONE] * shared
    return kinds * int(c.get("num_loops") or 1)


def kv_bytes_per_token(n_kv_heads: int, head_dim: int, kv_bits: int | None = None,
                       kv_group_size: int = KV_GROUP_SIZE,
                       itemsize: int = 2) -> int:
    """One attention layer's keys and values for one token: in float (`itemsize` bytes a
    value), or quantized to `kv_bits` along head_dim with a scale and a bias (in float) per
    group of `kv_group_size` values."""
    if kv_bits is None:
        return 2 * n_kv_heads * head_dim * itemsize
    return 2 * n_kv_heads * (head_dim * kv_bits // 8
                             + 2 * math.ceil(head_dim / kv_group_size) * itemsize)


@dataclass(frozen=True)
class KVCost:
    """One sequence's cache bytes as a function of its length: `terms` (bytes per token, the
    window past which they stop growing or None) and `fixed` bytes whatever the length."""

    terms: tuple[tuple[int, int | None], ...] = ()
    fixed: int = 0

    def bytes(self, tokens: int) -> int:
        return self.fixed + sum(b * (tokens if w is None else min(tokens, w))
                                for b, w in self.terms)

    @property
    def per_token(self) -> int:
        """Bytes of a token that every layer keeps (the growing part past every window)."""
        return sum(b for b, w in self.terms if w is None)

    def tokens_within(self, nbytes: int) -> int:
        """The most tokens whose bytes are at most `nbytes` (a large number where they stop
        growing below it)."""
        if self.bytes(0) > nbytes:
            return 0
        lo, hi = 0, 1
        while self.bytes(hi) <= nbytes:
            if hi > 2**40:
                return hi
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.bytes(mid) <= nbytes else (lo, mid)
        return lo

    def __add__(self, other: "KVCost") -> "KVCost":
        return KVCost(self.terms + other.terms, self.fixed + other.fixed)


def kv_cost(config: dict, kv_bits: int | None = None,
            kv_group_size: int = KV_GROUP_SIZE, itemsize: int = 2) -> KVCost:
    """A target's cache cost from its config.json fields: full-attention layers at
    `kv_bytes_per_token` (quantized when `kv_bits`), sliding-window layers in float up to
    `sliding_window` tokens, recurrent layers their conv and recurrent states (float32)."""
    c = text_config(config)
    kinds = layer_kinds(c)
    heads = _int(c, "num_attention_heads")
    n_kv = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or _int(c, "hidden_size") // heads)
    full_kv, full_dim = n_kv, head_dim
    if c.get("global_head_dim"):                # Gemma 4's full-attention layers
        full_dim = int(c["global_head_dim"])
        if c.get("attention_k_eq_v") and c.get("num_global_key_value_heads"):
            full_kv = int(c["num_global_key_value_heads"])
    full = kinds.count(FULL) * kv_bytes_per_token(full_kv, full_dim, kv_bits, kv_group_size,
                                                  itemsize)
    sliding = kinds.count(SLIDING) * kv_bytes_per_token(n_kv, head_dim, None, itemsize=itemsize)
    terms = [(full, None)] if full else []
    if sliding:
        terms.append((sliding, int(c.get("sliding_window") or 0) or None))
    fixed = kinds.count(RECURRENT) * _recurrent_state_bytes(c, itemsize)
    return KVCost(tuple(terms), fixed)


def _recurrent_state_bytes(c: dict, itemsize: int) -> int:
    """One recurrent layer's state: LFM2's short convolution (its last L_cache-1 inputs);
    a Mamba-2 block (nemotron_h: the convolution's last kernel-1 inputs, the SSM state
    [H, Dh, Ds]); a GatedDeltaNet layer (qwen3_next / qwen3_5: the convolution's last kernel-1
    inputs in the model's dtype, the recurrent state [Hv, Dv, Dk] in float32)."""
    if c.get("conv_L_cache"):
        return (int(c["conv_L_cache"]) - 1) * _int(c, "hidden_size") * itemsize
    if c.get("mamba_num_heads"):
        h, dh = int(c["mamba_num_heads"]), int(c["mamba_head_dim"])
        ds, groups = int(c["ssm_state_size"]), int(c.get("n_groups") or 1)
        conv = (int(c.get("conv_kernel") or 4) - 1) * (h * dh + 2 * groups * ds) * itemsize
        return conv + h * dh * ds * itemsize
    hk, dk = int(c.get("linear_num_key_heads", 0)), int(c.get("linear_key_head_dim", 0))
    hv, dv = int(c.get("linear_num_value_heads", 0)), int(c.get("linear_value_head_dim", 0))
    kernel = int(c.get("linear_conv_kernel_dim", 4))
    return (kernel - 1) * (2 * hk * dk + hv * dv) * itemsize + hv * dv * dk * 4


def drafter_cost(args, itemsize: int) -> KVCost:
    """A DFlash drafter's per-sequence bytes: its context keys and values, and the target
    features it has not read yet (a prompt's, until its first pass), both up to its window."""
    window = args.sliding_window - 1 if args.sliding_only else None
    cache = args.num_hidden_layers * kv_bytes_per_token(args.num_key_value_heads,
                                                        args.head_dim, None, itemsize=itemsize)
    feats = len(args.target_layer_ids) * args.hidden_size * itemsize
    return KVCost(((cache + feats, window),))


def _int(c: dict, key: str) -> int:
    value = c.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


# ---------------------------------------------------------------- the device and the budget

def device_memory() -> tuple[int, str]:
    """(bytes, where the figure comes from): Metal's recommended working set (the memory the
    GPU should keep resident), else the device's memory size, else the machine's RAM (MLX's
    CPU backend reports none)."""
    import mlx.core as mx

    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key]), f"mx.device_info()['{key}']"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the machine's RAM"


def margin(device: int) -> int:
    """What the default budget leaves for the rest of the process and the system."""
    return max(MIN_MARGIN, int(MARGIN * device))


def budget_bytes(setting: int | str | None, device: int) -> int:
    """`--memory-budget` (`settings.memory_budget`'s value) in bytes: None -> the device's
    memory less `margin`; "70%" -> that share of the device's memory; bytes as given."""
    setting = check.memory_budget(setting)
    if setting is None:
        return device - margin(device)
    if isinstance(setting, str):
        return int(device * float(setting[:-1]) / 100)
    return setting


def weights_bytes(model) -> int:
    """The bytes of a loaded model's parameters (quantized ones as stored)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def activation_dtype(model):
    """The dtype of the model's activations (and so of its float KV cache): the float dtype
    holding most of its float parameters (float32 where it has none)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    sizes: dict = {}
    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            sizes[v.dtype] = sizes.get(v.dtype, 0) + v.size
    return max(sizes, key=sizes.get) if sizes else mx.float32


def activation_itemsize(model) -> int:
    """The bytes of one value of the model's activations (`activation_dtype`)."""
    return activation_dtype(model).size


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.0f} MiB"


# ---------------------------------------------------------------- running sequences

def buffer_slots(tokens: int) -> int:
    """The most slots a row of `tokens` tokens takes in a batch buffer: its tokens, the holes
    short of a compaction (under 1/COMPACT_SHARE of the buffer, or COMPACT_MIN slots, which
    also covers a verify's slots past the row's length) and a growth step's free slots."""
    return tokens + -(-tokens // (COMPACT_SHARE - 1)) + COMPACT_MIN + STEP


class Footprint:
    """The bytes a set of sequences holds as the engine lays it out: the target's caches in a
    ragged batch pad every row to the longest, holes and free slots counted (`batched`:
    `buffer_slots`; one at a time otherwise, in the caches' growth steps); the drafter's are
    each sequence's own, in growth steps."""

    def __init__(self, target: KVCost, drafter: KVCost | None = None, batched: bool = True):
        self.target, self.drafter, self.batched = target, drafter, batched

    def bytes(self, lengths: list[int]) -> int:
        if not lengths:
            return 0
        rounded = [-(-n // STEP) * STEP for n in lengths]
        own = sum(self.drafter.bytes(n) for n in rounded) if self.drafter is not None else 0
        if self.batched:
            return own + len(lengths) * self.target.bytes(buffer_slots(max(lengths)))
        return own + sum(self.target.bytes(n) for n in rounded)

    def most_tokens(self, nbytes: int) -> int:
        """The longest sequence that fits in `nbytes` alone."""
        lo, hi = 0, max(1, self.target.tokens_within(nbytes))
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.bytes([mid]) <= nbytes else (lo, mid)
        return lo if self.bytes([hi]) > nbytes else hi


# ---------------------------------------------------------------- a prefill step's peak

# a forward's peak above its cache, per byte of one layer's attention scores: 1.19-1.26
# measured on this CPU (chunks of 128-2,048 tokens at a 3k context; docs/decisions.md)
SCORES_PEAK = 1.5


def prefill_tokens(room: int, context: int, n_heads: int, *, itemsize: int = 4,
                   dequantized: int = 0, floor: int = 16) -> int:
    """The most prompt tokens one forward may take so that a layer's attention scores
    (tokens x context x heads, float32, times `SCORES_PEAK` for what sits beside them) and,
    for a quantized cache whose attention dequantizes, its float copy of the keys and values
    (`dequantized` bytes a token of context), stay within `room` bytes; at least `floor`."""
    per_token = context * n_heads * itemsize * SCORES_PEAK
    left = room - context * dequantized
    return max(floor, int(left // per_token)) if per_token else floor


# ---------------------------------------------------------------- allocation failures

_OOM = re.compile(r"\[(metal::)?malloc\]|Unable to allocate|Insufficient Memory|OutOfMemory|"
                  r"out of memory|Resource limit", re.I)


def out_of_memory(e: BaseException) -> bool:
    """Whether MLX (or Python) failed to allocate: MLX raises RuntimeError("[malloc] Unable
    to allocate N bytes." / "[metal::malloc] ..."), a Metal command buffer fails with
    "Insufficient Memory (...OutOfMemory)"; Python raises MemoryError."""
    return isinstance(e, MemoryError) or (isinstance(e, RuntimeError)
                                          and bool(_OOM.search(str(e))))


# ---------------------------------------------------------------- doctor --model

def estimate_weights(config: dict, itemsize: int | None = None) -> tuple[int, str]:
    """(bytes, how) of a checkpoint's weights from its config alone: the parameters of a
    decoder (embeddings, attention, MLP or experts; a VLM's vision tower: `vision_lines`) at
    its `quantization` bits, else at `itemsize` (default: its torch_dtype's)."""
    c = text_config(config)
    H, L, heads = _int(c, "hidden_size"), _int(c, "num_hidden_layers"), _int(c,
                                                                          "num_attention_heads")
    n_kv = int(c.get("num_key_value_heads") or heads)
    hd = int(c.get("head_dim") or H // heads)
    V = _int(c, "vocab_size")
    experts = int(c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts")
                  or 0)
    inter = int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 4 * H)
    mlp = 3 * H * inter * (experts or 1) + 3 * H * int(c.get("shared_expert_intermediate_size")
                                                       or 0)
    attn = H * hd * (2 * heads + 2 * n_kv)
    params = L * (attn + mlp) + V * H * (1 if c.get("tie_word_embeddings") else 2)
    quant = config.get("quantization") or config.get("quantization_config") or {}
    float_size = itemsize or {"float32": 4}.get(str(c.get("torch_dtype") or c.get("dtype")), 2)
    bits = quant.get("bits") if isinstance(quant, dict) else None
    if bits and itemsize is None:
        group = int(quant.get("group_size", 64))
        return int(params * (bits / 8 + 2 * float_size / group)), f"{bits}-bit, from config.json"
    return params * float_size, f"{8 * float_size}-bit float, from config.json"


def fit_lines(config: dict, *, device: int, source: str, itemsize: int,
              weights: tuple[int, str], budget: int | None = None,
              group_size: int = KV_GROUP_SIZE) -> list[str]:
    """`doctor --model`: bytes per token at each KV setting and the tokens of context that fit
    beside the weights in `budget` (default: the device's memory less `margin`)."""
    budget = budget_bytes(None, device) if budget is None else budget
    room = budget - weights[0]
    lines = [f"device memory   {gib(device)} ({source})",
             f"weights         {gib(weights[0])} ({weights[1]})",
             f"budget          {gib(budget)} (the device's less a {gib(margin(device))} "
             f"margin); {gib(max(0, room))} for caches"]
    for bits, name in ((None, f"float{8 * itemsize}"), (8, "8-bit"), (4, "4-bit")):
        cost = kv_cost(config, bits, group_size, itemsize)
        fits = cost.tokens_within(room) if room > 0 else 0
        kib = cost.per_token / 1024
        extra = "".join(f" + {gib(b * w)} sliding window of {w}" for b, w in cost.terms
                        if w is not None) + (f" + {gib(cost.fixed)} recurrent state"
                                             if cost.fixed else "")
        lines.append(f"kv {name:<8}     {kib:.1f} KiB/token{extra}: "
                     f"{_tokens(fits)} tokens fit{' (--kv-bits %d)' % bits if bits else ''}")
    return lines


def vision_lines(config: dict, itemsize: int, pixels: int = 1024 * 1024) -> list[str]:
    """`doctor --model` of a vision-language checkpoint: its tower's weights from its
    vision_config (per layer attention and MLP, at `itemsize`), and what one image of
    `pixels` holds while the tower runs (`vision.tower_bytes`' rule: per patch its hidden
    state through a layer x 8, plus a full attention score row per head, float32)."""
    v = config.get("vision_config")
    if not isinstance(v, dict):
        return []
    h = int(v.get("hidden_size") or v.get("embed_dim") or 1024)
    depth = int(v.get("depth") or v.get("num_hidden_layers") or 24)
    inter = int(v.get("intermediate_size") or 4 * h)
    heads = int(v.get("num_attention_heads") or v.get("num_heads") or 16)
    patch = int(v.get("patch_size") or 14)
    weights = depth * (4 * h * h + 3 * h * inter) * itemsize
    patches = pixels // (patch * patch)
    peak = 4 * (patches * h * 8 + heads * patches * patches)
    return [f"vision tower    {gib(weights)} ({depth} layers of {h}, from config.json)",
            f"an image        {gib(peak)} while the tower runs on a {int(pixels ** 0.5)}^2-pixel "
            f"image ({patches} patches); its rows then count as prompt tokens"]


def _tokens(n: int) -> str:
    return "no" if n <= 0 else f"{n:,}" if n < 2**40 else "any number of"


__all__ = ["KVCost", "Footprint", "kv_cost", "kv_bytes_per_token", "drafter_cost",
           "layer_kinds", "text_config", "device_memory", "budget_bytes", "margin",
           "weights_bytes", "activation_dtype", "activation_itemsize", "prefill_tokens", "SCORES_PEAK",
           "out_of_memory", "estimate_weights", "fit_lines", "vision_lines", "gib", "FULL", "SLIDING",
           "RECURRENT", "STEP", "KV_GROUP_SIZE", "COMPACT_MIN", "COMPACT_SHARE"]
