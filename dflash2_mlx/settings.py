"""One validator per user setting, shared by the CLI, the Python API, the server and the oMLX
settings file: nothing else checks a setting's range.

Each validator takes the value and the name to blame (a flag such as `--seed`, an argument such
as `seed`, a settings key) and returns the value normalised, or raises `SettingError` naming
it, the value and what is allowed. The CLI turns `problem` into click's "Invalid value for
'--flag'" line (`cli.common.flag`), the server into a 400 naming the field (`server.schemas._setting`); the
API and the settings file raise the error as is. A new setting is one function here.

This module must not import mlx (the CLI validates flags before anything heavy loads).
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Sequence

DTYPES = ("float32", "float16", "bfloat16")
DRAFT_BITS = (4, 8, 16)             # 16 = unquantized
DRAFT_GROUP_SIZES = (32, 64, 128)
KV_BITS = (4, 8)                    # the target's quantized KV cache; None = float
KV_GROUP_SIZES = (32, 64, 128)
KV_GROUP_SIZE = 64                  # the default group size of a quantized KV cache
KERNELS = ("auto", "stock", "metal")   # "ops": the older name of "stock"
SEED_MAX = 2**64 - 1                # mx.random.key takes an unsigned 64-bit seed
PROMPT_CACHE_DISK_BYTES = 8 * 2**30     # the disk tier's bound when only its folder is given
HUMANEVAL_PROBLEMS = 164            # the most prompts per set `dflash2-mlx bench` can draw
MAX_BATCH = 16          # sequences the server decodes at once (docs/server.md: by the load benchmark)
PREFILL_CHUNK = 128     # prompt tokens the server prefills per step beside running streams
MAX_IMAGES = 20                 # images per request (Claude Code resends a session's screenshots)
MAX_IMAGE_BYTES = 20 * 2**20    # an encoded image
MAX_IMAGE_PIXELS = 40_000_000   # a decoded image (an 8K screenshot is 33 million)


class SettingError(ValueError):
    """A setting with a value that is not allowed. str(): '<name>: <problem>'."""

    def __init__(self, name: str, value, expected: str):
        self.name, self.value, self.expected = name, value, expected
        self.problem = f"{value!r} is not {expected}"
        super().__init__(f"{name}: {self.problem}")


_BYTES = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]i?B?|B)?\s*$", re.I)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _integer(value, name: str, low: int, high: int | None = None, expected: str | None = None):
    """An integer in low..high (no upper bound: high None); bools are not integers."""
    if not _is_int(value) or value < low or (high is not None and value > high):
        raise SettingError(name, value, expected or (
            f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"))
    return value


def _seconds(value, name: str, low: float, above: bool = False) -> float:
    """A finite number of seconds >= low (> low when `above`)."""
    expected = f"a finite number of seconds {'>' if above else '>='} {low:g}"
    s = _number(value, name, expected)
    if not math.isfinite(s) or s < low or above and s == low:
        raise SettingError(name, value, expected)
    return s


def _number(value, name: str, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise SettingError(name, value, expected) from None
        else:
            raise SettingError(name, value, expected)
    return float(value)


def block_size(value, name: str = "block_size", limit: int | None = None,
               what: str = "the drafter's block size"):
    """None (the default width), "auto" (chosen each cycle), or an integer 1..limit (`what`
    the limit is: the widest block of the drafter or the lookup). Strings of digits are
    accepted (flags)."""
    expected = (f"an integer in 1..{limit} ({what}) or \"auto\"" if limit
                else "an integer >= 1 or \"auto\"")
    if value is None or value == "auto":
        return value
    given = value                       # the error quotes what the user wrote
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not _is_int(value) or value < 1 or (limit is not None and value > limit):
        raise SettingError(name, given, expected)
    return value


def lookup(value, name: str = "lookup") -> bool:
    """True or False: draft by lookup in the context too."""
    if not isinstance(value, bool):
        raise SettingError(name, value, "True or False")
    return value


def temperature(value, name: str = "temperature") -> float:
    """A finite number >= 0; 0 is greedy."""
    t = _number(value, name, "a finite number >= 0 (0 = greedy)")
    if not math.isfinite(t) or t < 0:
        raise SettingError(name, value, "a finite number >= 0 (0 = greedy)")
    return t


def top_p(value, name: str = "top_p") -> float:
    p = _number(value, name, "a number in (0, 1]")
    if not 0 < p <= 1:                   # NaN fails here too
        raise SettingError(name, value, "a number in (0, 1]")
    return p


def top_k(value, name: str = "top_k") -> int:
    return _integer(value, name, 0, expected="an integer >= 0 (0 = all tokens)")


def max_tokens(value, name: str = "max_tokens") -> int:
    return _integer(value, name, 1)


def seed(value, name: str = "seed") -> int | None:
    """None (a fresh random seed) or an integer 0..2**64-1."""
    if value is None:
        return None
    return _integer(value, name, 0, SEED_MAX, "an integer in 0..2**64-1")


# ---- the server's limits (`dflash2-mlx serve`, `server.ServerConfig`)

def port(value, name: str = "port") -> int:
    """0..65535; 0: any free port."""
    return _integer(value, name, 0, 65535, "an integer in 0..65535 (0 = any free port)")


def context_length(value, name: str = "context_length") -> int:
    """Prompt + completion tokens: at least one of each."""
    return _integer(value, name, 2)


def max_body_bytes(value, name: str = "max_body_bytes") -> int:
    return _integer(value, name, 1024)


def queue_size(value, name: str = "queue_size") -> int:
    """Requests that may wait besides the running one (0 would make the queue unbounded)."""
    return _integer(value, name, 1)


def prompt_cache_size(value, name: str = "prompt_cache_size") -> int:
    """Prefix-cache entries; 0 turns the cache off."""
    return _integer(value, name, 0, expected="an integer >= 0 (0 = no prefix cache)")


def prompt_cache_bytes(value, name: str = "prompt_cache_bytes") -> int:
    return _integer(value, name, 0)


def shutdown_timeout(value, name: str = "shutdown_timeout") -> float:
    return _seconds(value, name, 0.0)


def ping_interval(value, name: str = "ping_interval") -> float:
    """Seconds of silence before an SSE stream sends a keep-alive `: ping`."""
    return _seconds(value, name, 0.0, above=True)


def read_timeout(value, name: str = "read_timeout") -> float:
    """Seconds a client may take to send a request's head or the next part of its body."""
    return _seconds(value, name, 0.0, above=True)


def max_batch(value, name: str = "max_batch") -> int:
    """Sequences the server decodes at once (one target forward per step); 1: one request at
    a time."""
    return _integer(value, name, 1, expected="an integer >= 1 (1 = one request at a time)")


def prefill_chunk(value, name: str = "prefill_chunk") -> int:
    """Prompt tokens prefilled per step while other sequences decode."""
    return _integer(value, name, 1)


def max_images(value, name: str = "max_images") -> int:
    """Images one request may carry."""
    return _integer(value, name, 1)


def max_image_bytes(value, name: str = "max_image_bytes") -> int:
    """The largest encoded image one request may carry, as `byte_size` takes it."""
    return byte_size(value, name)


def max_image_pixels(value, name: str = "max_image_pixels") -> int:
    """The most pixels (width x height) an image may decode to (a small file can decode to
    a huge bitmap)."""
    return _integer(value, name, 1)


def pipeline_timeout(value, name: str = "pipeline_timeout") -> float:
    """Seconds a rank of a pipeline waits for another."""
    return _seconds(value, name, 1.0)


def prompts_per_set(value, name: str = "prompts") -> int:
    """Prompts per set of `dflash2-mlx bench` (HumanEval's are spread over its 164)."""
    return _integer(value, name, 1, HUMANEVAL_PROBLEMS)


def repeats(value, name: str = "repeats") -> int:
    """Rounds of every system per prompt in `dflash2-mlx bench` (1-20)."""
    return _integer(value, name, 1, 20)


def _int_choice(value, name: str, allowed: tuple, expected: str) -> int | None:
    """None, or one of `allowed` (strings of digits accepted: flags); the error quotes what
    the user wrote."""
    if value is None:
        return None
    given = value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not _is_int(value) or value not in allowed:
        raise SettingError(name, given, expected)
    return value


def draft_bits(value, name: str = "draft_bits") -> int | None:
    return _int_choice(value, name, DRAFT_BITS, "one of 4, 8, 16 (16 = unquantized)")


def draft_group_size(value, name: str = "draft_group_size") -> int | None:
    return _int_choice(value, name, DRAFT_GROUP_SIZES, "one of 32, 64, 128")


def kv_bits(value, name: str = "kv_bits") -> int | None:
    """None (the target's KV cache in float) or 4 | 8: its full-attention layers' keys and
    values quantized from the first token."""
    return _int_choice(value, name, KV_BITS, "one of 4, 8 (or none: a float KV cache)")


def kv_group_size(value, name: str = "kv_group_size") -> int:
    """The quantized KV cache's group size along head_dim: 32 | 64 | 128 (None: 64)."""
    size = _int_choice(value, name, KV_GROUP_SIZES, "one of 32, 64, 128")
    return KV_GROUP_SIZE if size is None else size


def kernels(value, name: str = "kernels") -> str | None:
    """None (auto), "auto", "stock" or "metal" -> the choice ("ops", the older name of "stock",
    reads as "stock"). auto: the drafter's Metal kernels where Metal runs, the target's verify
    kernels where the probe on this machine chose them; stock: MLX's own kernels everywhere;
    metal: every custom kernel, the probe skipped (benchmarks, tests on a Mac)."""
    if value is None:
        return None
    choice = {"ops": "stock"}.get(value, value) if isinstance(value, str) else value
    if choice not in KERNELS:
        raise SettingError(name, value, "one of auto, stock, metal")
    return choice


def dtype(value, name: str = "dtype") -> str | None:
    """'float32' | 'fp32' | mx.float32 | ... -> 'float32' (None stays None)."""
    if value is None:
        return None
    short = str(value).rsplit(".", 1)[-1]          # mx.float32 prints as "mlx.core.float32"
    short = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(short, short)
    if short not in DTYPES:
        raise SettingError(name, value, f"one of {', '.join(DTYPES)}")
    return short


def byte_size(value, name: str = "bytes") -> int:
    """A size in bytes >= 1: an integer, or a string of a number and an optional binary unit
    ("4096", "512MiB", "1.5G": K, M, G, T, with or without "iB" or "B", are powers of 1024)."""
    expected = "a size in bytes >= 1 (e.g. 8589934592, 8GiB, 512M)"
    size = value
    if isinstance(value, str):
        m = _BYTES.match(value)
        size = float(m.group(1)) * 1024 ** "BKMGT".index((m.group(2) or "B")[0].upper()) \
            if m else None
        size = int(size) if size is not None and size >= 1 else None
    if not _is_int(size) or size < 1:
        raise SettingError(name, value, expected)
    return int(size)


def memory_budget(value, name: str = "memory_budget") -> int | str | None:
    """The most memory the server's MLX arrays may take, weights included: None (the
    default: the device's memory as MLX reports it, less a margin), a size in bytes as
    `byte_size` takes it ("24GiB", "12G", 25769803776), or a percentage of the device's
    memory ("70%", 0 < p <= 100) -> None, the bytes, or the percentage normalised ("70%")."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().endswith("%"):
        expected = "a percentage of the device's memory in (0, 100] (e.g. 70%)"
        try:
            share = float(value.strip()[:-1])
        except ValueError:
            raise SettingError(name, value, expected) from None
        if not 0 < share <= 100:
            raise SettingError(name, value, expected)
        return f"{share:g}%"
    try:
        return byte_size(value, name)
    except SettingError:
        raise SettingError(name, value, "a size in bytes (e.g. 24GiB, 12G, 25769803776) or a "
                           "percentage of the device's memory (e.g. 70%)") from None


# apply_chat_template's own arguments: the server sets them, template arguments may not
TEMPLATE_OWN_ARGS = ("conversation", "messages", "tools", "tokenize", "add_generation_prompt",
                     "return_dict", "chat_template", "continue_final_message")


def chat_template_args(value, name: str = "chat_template_args") -> dict:
    """Arguments for the chat template: a JSON object, as a dict or as its text (mlx-lm's
    `--chat-template-args '{"enable_thinking": false}'`), without apply_chat_template's own."""
    expected = ('a JSON object of template arguments (not ' + ", ".join(TEMPLATE_OWN_ARGS) +
                '), e.g. \'{"enable_thinking": false}\'')
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise SettingError(name, value, expected) from None
    if not isinstance(value, dict) or set(value) & set(TEMPLATE_OWN_ARGS):
        raise SettingError(name, value, expected)
    return dict(value)


def text(value: str, name: str = "prompt") -> str:
    """A non-empty string that is valid Unicode (bytes that were not UTF-8 arrive from argv as
    lone surrogates, and the tokenizer fails on them)."""
    if not isinstance(value, str):
        raise SettingError(name, value, "a string")
    if not value:
        raise SettingError(name, value, "a non-empty string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SettingError(name, value[max(0, e.start - 10): e.end + 10],
                           "valid UTF-8 text") from None
    return value


def prompt(value, name: str = "prompt"):
    """A string (non-empty, valid text) or a non-empty sequence of integer token ids."""
    if isinstance(value, str):
        return text(value, name)
    if isinstance(value, (bytes, bytearray)) or not isinstance(value, Sequence) and \
            not hasattr(value, "tolist"):
        raise SettingError(name, value, "a string or a sequence of token ids")
    ids = value.tolist() if hasattr(value, "tolist") else list(value)
    if not ids or not all(_is_int(t) for t in ids):
        raise SettingError(name, value, "a string or a non-empty sequence of integer token ids")
    return [int(t) for t in ids]


__all__ = ["SettingError", "block_size", "lookup", "temperature", "top_p", "top_k", "max_tokens",
           "seed", "port", "context_length", "max_body_bytes", "queue_size", "prompt_cache_size",
           "prompt_cache_bytes", "shutdown_timeout", "ping_interval", "read_timeout",
           "max_batch", "prefill_chunk", "max_images", "max_image_bytes", "max_image_pixels",
           "pipeline_timeout", "prompts_per_set", "repeats",
           "draft_bits", "draft_group_size", "kv_bits", "kv_group_size", "kernels", "dtype",
           "byte_size", "memory_budget", "text", "prompt", "DTYPES", "DRAFT_BITS",
           "DRAFT_GROUP_SIZES", "KV_BITS", "KV_GROUP_SIZES", "KV_GROUP_SIZE", "KERNELS", "SEED_MAX",
           "PROMPT_CACHE_DISK_BYTES",
           "MAX_BATCH", "PREFILL_CHUNK", "MAX_IMAGES", "MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS"]
