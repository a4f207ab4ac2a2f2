"""Images for a vision-language target: mlx-vlm's processor and vision tower make a prompt's
image rows (`Vision.media`), our engine decodes (`Media`: what a request carries).

mlx-vlm's own model object does the image work: its processor expands each image placeholder
of the rendered chat into the family's image tokens, and its `get_input_embeddings` runs the
tower and puts the features in those rows (and, for Qwen's multimodal rope, gives the rows'
(t, h, w) positions and the shift of every row after them). Its language model shares the
target's weights (`loading.vision`); only the embedding is ever read from it.

The prefix cache tells images apart: a request's `prompt` holds, in place of each image's
placeholder tokens, key ids made from a hash of the image's pixels (`Media.keys`): two
prompts share cached rows up to their first differing image, never across one.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from .. import settings as check
from .inputs import ImageRows, Inputs, MRope

KEY_BASE = 1 << 31            # key ids: KEY_BASE | 31 bits of a hash; never a vocabulary id
IMAGE_WORDS = ("image", "video", "boi", "eoi", "img")     # a processor's image marker names


@dataclass(frozen=True)
class Family:
    """How a vision-language family's image rows reach mlx-lm's text model. mrope: Qwen's
    multimodal rope layout ("chunked" | "interleaved"; None: rows count positions);
    deepstack: the tower's DeepStack features go into the first layers' outputs (Qwen3-VL);
    gemma4: the rows mlx-vlm makes carry the embedding scale (divided out: mlx-lm applies
    it), the per-layer inputs read id 0 in image rows, and (with its config's
    use_bidirectional_attention "vision") an image's rows attend to each other both ways."""

    mrope: str | None = None
    deepstack: bool = False
    gemma4: bool = False


# the families whose image rows are checked against mlx-vlm's own generation (tests;
# qwen3_vl_moe runs qwen3_vl's image path untested: only its text MLP differs)
FAMILIES = {"qwen2_vl": Family("chunked"), "qwen2_5_vl": Family("chunked"),
            "qwen3_vl": Family("interleaved", deepstack=True),
            "qwen3_vl_moe": Family("interleaved", deepstack=True),
            "qwen3_5": Family("interleaved"), "qwen3_5_moe": Family("interleaved"),
            "gemma3": Family(), "gemma4": Family(gemma4=True), "mistral3": Family()}


class ImageError(ValueError):
    """An image that cannot be taken: `status` 400 (not an image, corrupt) or 413 (over a
    limit, which the message names)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be (`settings.max_images`, `max_image_bytes`,
    `max_image_pixels`)."""

    images: int = check.MAX_IMAGES
    image_bytes: int = check.MAX_IMAGE_BYTES
    pixels: int = check.MAX_IMAGE_PIXELS


def open_images(sources, limits: ImageLimits = ImageLimits(), name: str = "images") -> list:
    """Images (file paths, encoded bytes, or PIL images) -> RGB PIL images, each checked
    against `limits`; `ImageError` names the image (name[i]) and the limit."""
    sources = list(sources)
    if len(sources) > limits.images:
        raise ImageError(f"{name}: {len(sources)} images, more than max_images "
                         f"{limits.images}", 413)
    return [open_image(s, limits, f"{name}[{i}]") for i, s in enumerate(sources)]


def open_image(source, limits: ImageLimits = ImageLimits(), name: str = "image"):
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        image = source
    else:
        if isinstance(source, (str, Path)):
            path = Path(source)
            if not path.is_file():
                raise ImageError(f"{name}: no such file: {path}")
            data = path.read_bytes()
        elif isinstance(source, (bytes, bytearray)):
            data = bytes(source)
        else:
            raise ImageError(f"{name}: expected a file path, encoded image bytes or a PIL "
                             f"image, got {type(source).__name__}")
        if len(data) > limits.image_bytes:
            raise ImageError(f"{name}: {len(data)} bytes, more than max_image_bytes "
                             f"{limits.image_bytes}", 413)
        try:
            image = Image.open(io.BytesIO(data))
            pixels = image.size[0] * image.size[1]
            if pixels > limits.pixels:
                raise ImageError(f"{name}: {image.size[0]}x{image.size[1]} = {pixels} pixels, "
                                 f"more than max_image_pixels {limits.pixels}", 413)
            image.load()
        except ImageError:
            raise
        except Image.DecompressionBombError as e:
            raise ImageError(f"{name}: {e}; more than max_image_pixels {limits.pixels}",
                             413) from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
            raise ImageError(f"{name}: not a readable image ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else 'corrupt'})") from None
    pixels = image.size[0] * image.size[1]
    if pixels > limits.pixels:
        raise ImageError(f"{name}: {image.size[0]}x{image.size[1]} = {pixels} pixels, more "
                         f"than max_image_pixels {limits.pixels}", 413)
    return image.convert("RGB") if image.mode != "RGB" else image


def is_key(token: int) -> bool:
    return token >= KEY_BASE


def image_hash(image) -> str:
    """sha256 of an image's decoded pixels (mode, size and bytes: the same picture sent as
    PNG or JPEG-free re-encodings of one bitmap hashes the same)."""
    h = hashlib.sha256(f"{image.mode}:{image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


@dataclass
class MediaRows:
    """The rows of a prompt from `start` on, for a prefill: their real ids and, per chunk
    [s, e) of them, the target's `Inputs`."""

    media: "Media"
    start: int

    @property
    def ids(self) -> list[int]:
        return (self.media.model_ids or self.media.ids)[self.start:]

    def inputs(self, s: int, e: int) -> Inputs:
        return self.media.inputs(self.start + s, self.start + e)


@dataclass
class Media:
    """A prompt with images, as the engine takes it. ids: its real token ids (each image's
    placeholder tokens included); keys: the same with every image row replaced by a key id
    (what `Request.prompt` holds); image_rows: [L] bool; shift: the rope shift of every row
    after the prompt (0 but for multimodal rope); positions: [3, 1, L] (multimodal rope) or
    None; hashes: each image's `image_hash`; compute(ids): [1, L, H] the embeddings of these
    ids (the prompt's, or more after it) with the images in their rows; `embeds()` computes
    them once, on first use (a prefix-cache hit past every image never runs the tower)."""

    ids: list[int]
    keys: list[int]
    image_rows: np.ndarray
    shift: int
    positions: mx.array | None
    hashes: tuple[str, ...]
    compute: Callable[[list[int]], tuple]
    tower_bytes: int = 0
    row_bytes: int = 0                      # bytes of one row's embeddings (and DeepStack's)
    blocks: np.ndarray | None = None        # [L] each row's image (-1: none), two-way images
    model_ids: list[int] | None = None      # the ids the model reads, where they differ
    _embeds: tuple | None = field(default=None, repr=False)

    @property
    def transient_bytes(self) -> int:
        """What computing the rows holds for a while: the tower's activations, and the
        rows' embeddings (with DeepStack's, one more copy per early layer), float32."""
        return self.tower_bytes + self.row_bytes * len(self.ids)

    def embeds(self) -> tuple:
        """(embeddings [1, L, H], DeepStack features: [1, L, H] per early layer, or None)."""
        if self._embeds is None:
            self._embeds = self.compute(self.ids)
            mx.eval(self._embeds)
        return self._embeds

    def part(self, start: int) -> MediaRows:
        return MediaRows(self, start)

    def inputs(self, s: int, e: int) -> Inputs:
        """Rows [s, e): their embeddings (and DeepStack features, and images' blocks) where
        an image row is among them, their positions under multimodal rope."""
        positions = None if self.positions is None else self.positions[:, :, s:e]
        if not self.image_rows[s:e].any():
            return Inputs(None, positions, start=s)
        embeds, deep = self.embeds()
        blocks = (None if self.blocks is None else
                  mx.array(self.blocks[None, s:e].astype(np.int32)))
        return Inputs(embeds[:, s:e], positions, start=s, blocks=blocks,
                      deepstack=None if deep is None else tuple(d[:, s:e] for d in deep))

    def extended(self, tokens: list[int]) -> "Media":
        """The same images for the prompt followed by `tokens` (text rows after it)."""
        n = len(tokens)
        positions = self.positions
        if positions is not None and n:
            start = len(self.ids) + self.shift
            after = mx.broadcast_to(mx.arange(start, start + n, dtype=positions.dtype),
                                    (3, 1, n))
            positions = mx.concatenate([positions, after], axis=2)
        return Media(self.ids + list(tokens), self.keys + list(tokens),
                     np.concatenate([self.image_rows, np.zeros(n, bool)]), self.shift,
                     positions, self.hashes, self.compute, self.tower_bytes, self.row_bytes,
                     None if self.blocks is None else
                     np.concatenate([self.blocks, np.full(n, -1, self.blocks.dtype)]),
                     None if self.model_ids is None else self.model_ids + list(tokens))

    def release(self) -> None:
        """Drop the embeddings once the prompt is prefilled."""
        self._embeds = None


def image_keys(ids: list[int], image_rows: np.ndarray, hashes: tuple[str, ...]) -> list[int]:
    """`ids` with each image's rows replaced by a key id of the images up to and including it:
    the k-th run of image rows is image k where there are as many runs as images; otherwise
    (a family that breaks one image's rows) every image row is keyed by all the images."""
    runs = np.flatnonzero(np.diff(np.concatenate([[0], image_rows.astype(np.int8)])) == 1)
    keys = list(ids)
    owner = np.cumsum(np.diff(np.concatenate([[0], image_rows.astype(np.int8)])) == 1) - 1
    per_run = len(runs) == len(hashes)
    for i in np.flatnonzero(image_rows):
        upto = hashes[: owner[i] + 1] if per_run else hashes
        digest = hashlib.sha256("|".join(upto).encode()).digest()
        keys[i] = KEY_BASE | (int.from_bytes(digest[:4], "little") & (KEY_BASE - 1))
    return keys


class Vision:
    """A vision-language target's image side: mlx-vlm's `model` (its tower, projector and
    embedding merge) and `processor`; `family`: mlx-vlm's model_type. `embed_dtype`: the
    target's activations' dtype (the rows are cast to it)."""

    def __init__(self, model, processor, family: str, config: dict, embed_dtype=mx.float32):
        self.model, self.processor, self.family, self.config = model, processor, family, config
        self.embed_dtype = embed_dtype
        self.image_token_id = _image_token_id(model.config)
        self.how = FAMILIES.get(family)
        self.refusal = (None if self.how is not None else
                        f"its image rows have not been checked against mlx-vlm's generation "
                        f"(served: {', '.join(sorted(FAMILIES))})")
        how = self.how or Family()
        self.mrope = mrope_of(family, how.mrope, config)
        text = config.get("text_config", config)
        self.bidirectional = how.gemma4 and text.get("use_bidirectional_attention") == "vision"
        self.embed_scale = (float(model.language_model.model.embed_scale) if how.gemma4
                            else None)
        vision = config.get("vision_config", {})
        self.deepstack = len(vision.get("deepstack_visual_indexes") or ()) if how.deepstack \
            else 0

    def escaped(self, messages: list[dict]) -> list[dict]:
        """Messages whose texts cannot pass for an image placeholder: where a text holds one
        of the processor's image markers (Qwen's "<|image_pad|>", Gemma's
        "<start_of_image>", Pixtral's "[IMG]"), a zero-width space goes after its first
        character; the processor would read it as one more image (a file an agent read, a
        model's own output), and the request would fail for want of one."""
        marks = [v for k, v in vars(self.processor).items() if k.endswith("_token")
                 and isinstance(v, str) and v and any(w in k for w in IMAGE_WORDS)]

        def fix(text):
            if not isinstance(text, str):
                return text
            for m in marks:
                text = text.replace(m, m[0] + "\u200b" + m[1:])
            return text

        out = []
        for m in messages:
            m = {**m, **{k: fix(m[k]) for k in ("reasoning_content", "reasoning") if k in m}}
            c = m.get("content")
            m["content"] = fix(c) if isinstance(c, str) else c if not isinstance(c, list) \
                else [{**p, "text": fix(p.get("text"))} if p.get("type") == "text" else p
                      for p in c]
            out.append(m)
        return out

    @property
    def weights_bytes(self) -> int:
        """The tower's, projector's and what else of mlx-vlm's model is not the target's
        (its language model's arrays are the target's, or never read)."""
        from mlx.utils import tree_flatten

        return sum(v.nbytes for k, v in tree_flatten(self.model.parameters())
                   if not k.startswith("language_model."))

    def image_rows(self) -> ImageRows:
        """What the target's stack needs (`inputs.ImageRows`)."""
        text = self.config.get("text_config", self.config)
        return ImageRows(self.mrope, self.deepstack, self.bidirectional,
                         text.get("sliding_window") if self.bidirectional else None)

    def media(self, text: str, images: list) -> Media:
        """The rendered chat `text` (one placeholder per image, as the chat template writes
        them) and its PIL `images`, in order -> `Media`."""
        from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

        inputs = prepare_inputs(self.processor, images=images, prompts=text,
                                image_token_index=self.image_token_id,
                                add_special_tokens=should_add_special_tokens(
                                    self.model.config.model_type, self.processor))
        input_ids, pixels = inputs["input_ids"], inputs.get("pixel_values")
        mask = inputs.get("attention_mask")
        extra = {k: v for k, v in inputs.items()
                 if k not in ("input_ids", "pixel_values", "attention_mask")}
        ids = input_ids[0].tolist()
        rows = np.asarray(ids) == self.image_token_id
        if rows.sum() == 0:
            raise ValueError(f"the prompt has {len(images)} image(s) but the processor placed "
                             "no image token: the chat template wrote no image placeholder")
        positions, shift = None, 0
        if self.mrope is not None:
            positions, deltas = self.model.language_model.get_rope_index(
                input_ids, extra.get("image_grid_thw"), None, mask)
            shift = int(np.asarray(deltas).reshape(-1)[0])
        hashes = tuple(image_hash(im) for im in images)
        # evaluated here: the server prepares a request on its HTTP thread and the model
        # thread computes the rows, and MLX runs a lazy array only on its own thread's stream
        mx.eval([a for a in (input_ids, pixels, mask, positions, *extra.values())
                 if isinstance(a, mx.array)])

        def compute(ids: list[int]) -> tuple:
            x = mx.array([ids], dtype=input_ids.dtype)
            out = self.model.get_input_embeddings(
                x, pixels, mask=None if mask is None else mx.ones_like(x), **extra)
            embeds = out.inputs_embeds
            if self.embed_scale is not None:
                embeds = embeds / self.embed_scale
            deep = None
            if self.deepstack and out.deepstack_visual_embeds is not None:
                where = mx.array(np.flatnonzero(np.asarray(out.visual_pos_masks)[0]))
                deep = []
                for d in out.deepstack_visual_embeds:
                    dense = mx.zeros(embeds.shape, self.embed_dtype)
                    dense[0, where] = d.astype(self.embed_dtype)
                    deep.append(dense)
                deep = tuple(deep)
            return embeds.astype(self.embed_dtype), deep

        hidden = int(self.config.get("text_config", self.config).get("hidden_size", 4096))
        blocks = model_ids = None
        if self.bidirectional:
            blocks = np.cumsum(rows & ~np.concatenate([[False], rows[:-1]])) - 1
            blocks = np.where(rows, blocks, -1)
        if self.embed_scale is not None:          # Gemma 4's per-layer inputs: id 0 in images
            model_ids = np.where(rows, 0, np.asarray(ids)).tolist()
        return Media(ids, image_keys(ids, rows, hashes), rows, shift, positions, hashes,
                     compute, tower_bytes=tower_bytes(pixels, self.config),
                     row_bytes=4 * hidden * (1 + self.deepstack), blocks=blocks,
                     model_ids=model_ids)


def mrope_of(family: str, style: str | None, config: dict) -> MRope | None:
    """The family's multimodal rope layout from config.json, or None (1-D rope)."""
    if style is None:
        return None
    text = config.get("text_config", config)
    for key in ("rope_parameters", "rope_scaling"):
        section = (text.get(key) or {}).get("mrope_section") or \
            (config.get(key) or {}).get("mrope_section")
        if section:
            return MRope(tuple(int(s) for s in section), style)
    raise ValueError(f"config.json of the {family} target names no mrope_section "
                     "(text_config.rope_scaling or rope_parameters)")


def _image_token_id(config: Any) -> int:
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError("the vision-language config names no image_token_id / image_token_index")


def tower_bytes(pixels: mx.array | None, config: dict) -> int:
    """A rough peak of the tower's activations for these pixels: per patch, its hidden state
    through a layer (x 8: attention, MLP and residuals) plus one full attention score row per
    head (float32)."""
    if pixels is None:
        return 0
    vision = config.get("vision_config", {})
    hidden = int(vision.get("hidden_size", vision.get("embed_dim", 1024)))
    heads = int(vision.get("num_attention_heads", vision.get("num_heads", 16)))
    patch = int(vision.get("patch_size", 14))
    shape = pixels.shape
    # Qwen's processors flatten patches ([patches, C * t * p * p]); the others give images
    patches = shape[0] if len(shape) == 2 else int(np.prod(shape[-2:])) // (patch * patch) * \
        (shape[0] if len(shape) == 4 else 1)
    return 4 * (patches * hidden * 8 + heads * patches * patches)
