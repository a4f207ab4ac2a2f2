"""`ServerConfig`: the limits and identity of one server."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .. import settings as check
from ..model.vision import ImageLimits


@dataclass(frozen=True)
class ServerConfig:
    """Limits and identity of one server. `model_id` is the only model name a request may use.
    Each limit is checked by its `settings` validator (SettingError names it)."""

    model_id: str
    max_tokens: int = 4096              # most tokens one request may ask for
    context_length: int = 8192          # prompt + completion tokens
    max_body_bytes: int = 64 * 2**20    # images come as base64 (agents resend them every turn)
    queue_size: int = 16                # requests waiting for a free row, besides the running ones
    api_key: str | None = None
    block_size: int | str | None = None     # None: the pipeline's default
    prompt_cache_size: int = 8              # entries in RAM; 0: none (and no disk: no cache)
    prompt_cache_bytes: int = 2 * 2**30
    prompt_cache_dir: str | None = None     # the prefix cache's disk tier (None: RAM only)
    prompt_cache_disk_bytes: int = check.PROMPT_CACHE_DISK_BYTES
    ping_interval: float = 15.0         # seconds of silence before an SSE stream sends `: ping`
    read_timeout: float = 30.0          # seconds a client may take to send headers or a body part
    max_batch: int = check.MAX_BATCH    # sequences decoding at once; 1: one at a time
    prefill_chunk: int = check.PREFILL_CHUNK    # prompt tokens per step beside running streams
    # the most memory MLX may take, weights included: bytes, "70%" of the device's, or None
    # (the device's less a margin); docs/server.md, "Memory"
    memory_budget: int | str | None = None
    # Claude Code's first system block (x-anthropic-billing-header: ...) differs every session;
    # left in, it would end the prefix cache's match after ~25 tokens
    keep_billing_header: bool = False
    # passed to every chat template render, as mlx-lm's --chat-template-args (e.g.
    # {"enable_thinking": false}); a request's own switches go over them
    chat_template_args: dict = field(default_factory=dict)
    # images in requests (a vision-language target): each a 413 naming it past its limit
    max_images: int = check.MAX_IMAGES
    max_image_bytes: int = check.MAX_IMAGE_BYTES
    max_image_pixels: int = check.MAX_IMAGE_PIXELS
    fetch_images: bool = False          # fetch http(s) image URLs (off: a 400 asks for base64)

    def __post_init__(self):
        for name in ("max_tokens", "context_length", "max_body_bytes", "queue_size",
                     "block_size", "prompt_cache_size", "prompt_cache_bytes", "ping_interval",
                     "read_timeout", "max_batch", "prefill_chunk", "memory_budget",
                     "max_images", "max_image_bytes", "max_image_pixels"):
            object.__setattr__(self, name, getattr(check, name)(getattr(self, name), name))
        object.__setattr__(self, "chat_template_args", check.chat_template_args(
            self.chat_template_args, "chat_template_args"))
        object.__setattr__(self, "prompt_cache_disk_bytes", check.byte_size(
            self.prompt_cache_disk_bytes, "prompt_cache_disk_bytes"))


    @property
    def image_limits(self) -> ImageLimits:
        return ImageLimits(self.max_images, self.max_image_bytes, self.max_image_pixels)


def model_id_for(model: str) -> str:
    """The name clients use: a hub id as given, a local folder or file by its name (a request
    never names a path)."""
    p = Path(model)
    if p.exists():
        return p.stem if p.is_file() else p.name
    return model
