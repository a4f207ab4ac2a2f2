"""The Python API: a `Pipeline` (made by `dflash2_mlx.load`, `pair`) generates or
streams one prompt or a batch; what its engine, requests and width policies are made of."""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import log, settings as check
from .decode.engine import Engine, Request
from .decode.lookup import LookupConfig
from .decode import row_check
from .model.sampling import Sampling
from .decode.state import DecodeState, common_prefix
from .decode.stats import DRAFTER, LOOKUP, GenerationStats
from .loading.weights import quantization
from .model.drafter import Drafter
from .model.target import Target, TargetAdapter
from .model.views import KVQuant
from .model.vision import ImageLimits, Media, Vision, open_images
from .policy.acceptance import MatchModel, SurenessModel
from .policy.adaptive import AdaptiveWidth
from .policy.calibration import calibration_key, load_or_measure_costs, store_correction
from .policy.kernel_choice import verify_kernels
from .policy.planner import Planner

_log = log.get(__name__)

EXAMPLE_VLM = "mlx-community/Qwen2.5-VL-7B-Instruct-4bit"    # named where images are refused


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


class Pipeline:
    """A target (an mlx-lm model, usable with mlx-lm's own functions), its tokenizer, and a
    drafter (None: plain decoding).

    block_size: the default runtime block width (None: "auto"). lookup: draft from the context
    too by default (`lookup.LookupIndex`). max_ctx: prompts of at least this many tokens run
    plain decoding. kv_bits (4 | 8 | None: float), kv_group_size (32 | 64 | 128): the
    target's full-attention KV cache quantized from the first token (the drafter's stays
    float). info: how it was loaded, for `describe()`.
    """

    def __init__(self, target: nn.Module, tokenizer, drafter: Drafter | None = None, *,
                 prefill_step_size: int = 2048, block_size: int | str | None = None,
                 lookup: bool = True, max_ctx: int | None = None, kv_bits: int | None = None,
                 kv_group_size: int | None = None, info: dict | None = None,
                 vision: Vision | None = None):
        self.target = target
        self.vision = vision                 # the image side of a vision-language target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.prefill_step_size = prefill_step_size
        self.default_block_size = block_size
        self.lookup = check.lookup(lookup)
        self.lookup_config = LookupConfig()
        self.max_ctx = max_ctx
        self.info = dict(info or {})
        self._policy: AdaptiveWidth | None = None
        # what the drafter's drafts say of their acceptance, learnt across generations
        self.acceptance = SurenessModel(16)
        self.matches = MatchModel(16)            # how lookup drafts fare, by match length
        self.kernel_setting = "auto"         # settings.kernels, for the target's verify kernels
        self.verify_kernels = None           # kernel_probe.KernelRecord; None: stock
        self.kernel_calls = None             # kernel_view.VerifyKernels; None: Metal's
        self._kernels_chosen = False         # choose_kernels ran
        self.stage = None                    # distributed.Stage of a pipeline-sharded target
        self.plain_why: str | None = None    # why it decodes plain, speculation not exact
        bits, group = check.kv_bits(kv_bits), check.kv_group_size(kv_group_size)
        self.kv = KVQuant(bits, group) if bits is not None else None
        # what generates: this process's model, or the stage's target of a pipeline
        self.adapter: Target = TargetAdapter(
            target, drafter.args.target_layer_ids if drafter else (), kv=self.kv,
            images=(vision.image_rows()
                    if vision is not None and vision.refusal is None else None))

    # ---- prompts
    def encode(self, prompt: str | Sequence[int], chat_template: bool | None = None,
               system: str | None = None) -> list[int]:
        """A list of ids is used as is; a string gets the chat template when the tokenizer has
        one (unless chat_template=False), exactly as `mlx_lm generate` renders it."""
        prompt = check.prompt(prompt)
        if not isinstance(prompt, str):
            ids = prompt
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
        with _quiet_length_warning():       # `stream` says it in its own words
            if not use_template:
                return tok.encode(prompt)
            messages = ([{"role": "system", "content": system}] if system else [])
            messages.append({"role": "user", "content": prompt})
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return tok.encode(text, add_special_tokens=False)

    def image_refusal(self) -> str | None:
        """Why this pipeline takes no images, or None."""
        if self.vision is None:
            return (f"the target ({self.info.get('target', 'this model')}) is a text-only "
                    f"model and takes no images; load a vision-language model ({EXAMPLE_VLM}, "
                    "say) to send images")
        if self.vision.refusal is not None:
            return f"images on {self.vision.family} targets are not served: {self.vision.refusal}"
        if self.stage is not None:
            return "images are not served by a pipeline-sharded target; load it on one machine"
        return None

    def encode_images(self, messages: list[dict], images: Sequence,
                      limits: ImageLimits = ImageLimits(), **template) -> tuple[list[int], Media]:
        """Chat `messages` whose contents may hold `{"type": "image"}` parts (one per image,
        in order), and the `images` (file paths, encoded bytes or PIL images) -> (the prompt's
        ids with each image's rows as key ids, its `Media`). ImageError for an image over
        `limits` or unreadable; ValueError where this target takes no images."""
        why = self.image_refusal()
        if why is not None:
            raise ValueError(why)
        opened = open_images(images, limits)
        placeholders = sum(1 for m in messages if isinstance(m.get("content"), list)
                           for part in m["content"] if part.get("type") == "image")
        if placeholders != len(opened):
            raise ValueError(f"the messages have {placeholders} image part(s) for "
                             f"{len(opened)} image(s)")
        with _quiet_length_warning():
            text = self.tokenizer.apply_chat_template(self.vision.escaped(messages),
                                                      tokenize=False,
                                                      add_generation_prompt=True, **template)
        media = self.vision.media(text, opened)
        return media.keys, media

    def _prompt(self, prompt, images, chat_template, system) -> tuple[list[int], Media | None]:
        """`encode`, or with images the user turn [images..., text] (`encode_images`)."""
        if not images:
            return self.encode(prompt, chat_template, system), None
        if not isinstance(check.prompt(prompt), str) or chat_template is False:
            raise ValueError("images go with a text prompt rendered by the chat template "
                             "(not token ids, not chat_template=False)")
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": content}]
        return self.encode_images(messages, images)

    @property
    def context_length(self) -> int | None:
        """The most positions the target was made for (its config's max_position_embeddings,
        else the tokenizer's model_max_length), None when neither says."""
        args = getattr(self.target, "args", None)
        n = getattr(args, "max_position_embeddings", None)
        if n is None and isinstance(getattr(args, "text_config", None), dict):   # VLM wrappers
            n = args.text_config.get("max_position_embeddings")
        if not n:
            n = getattr(self.tokenizer, "model_max_length", None)
        return int(n) if isinstance(n, (int, float)) and 0 < n < 1e12 else None

    def _announce_prompt(self, n: int, cached: int = 0) -> None:
        """A note when the prompt does not fit the model's context, a line before a long
        prefill (minutes on a CPU for thousands of tokens); `cached`: the prompt tokens a
        given state already holds (not prefilled again)."""
        ctx = self.context_length
        if ctx is not None and n > ctx:
            log.notice(f"the prompt has {n} tokens, more than the model's context of {ctx} "
                    "positions: what the model produces past that point is unreliable")
        todo = n - cached
        if todo > self.prefill_step_size:
            _log.info(f"prefill of {todo} prompt tokens in "
                      f"{-(-todo // self.prefill_step_size)} chunks of "
                      f"{self.prefill_step_size} ...")

    def max_width(self, lookup: bool) -> int:
        """The widest block any source can draft: the drafter's block size, the lookup's."""
        return max(self.drafter.args.max_width if self.drafter is not None else 1,
                   self.lookup_config.max_width if lookup else 1)

    def block_size(self, block_size: int | str | None, lookup: bool | None = None) -> int | str:
        """The runtime block width: rows verified per cycle, 1 <= b <= the widest block a
        source drafts (the drafter drafts at most its own block size), or "auto": source and
        width chosen each cycle by `adaptive.AdaptiveWidth` (the default)."""
        lookup = self.lookup if lookup is None else check.lookup(lookup)
        limit = self.max_width(lookup)
        if limit == 1:
            if check.block_size(block_size) not in (None, 1, "auto") or \
                    block_size is None and self.default_block_size not in (None, 1, "auto"):
                raise ValueError(f"block_size={block_size or self.default_block_size} needs a "
                                 "drafter or lookup; this pipeline has neither (plain "
                                 "decoding, block size 1)")
            return 1
        b = block_size if block_size is not None else self.default_block_size or "auto"
        what = ("the drafter's block size" if self.drafter is not None and not lookup else
                "the widest lookup block" if self.drafter is None else
                "the widest block of the drafter or the lookup")
        return check.block_size(b, limit=limit, what=what)

    def width_policy(self) -> AdaptiveWidth:
        """The adaptive policy of this pipeline: its acceptance estimates (per source) carry
        over from one generation to the next; its costs are measured once per machine and
        model pair (`calibration.calibration_key`)."""
        if self._policy is None:
            widths = {LOOKUP: self.lookup_config.max_width}
            if self.drafter is not None:
                widths[DRAFTER] = self.drafter.args.max_width
            self.choose_kernels()     # first: the calibration times the kernels that will run
            cost = load_or_measure_costs(self, self.max_width(True))
            self._policy = AdaptiveWidth(cost, widths,
                                         store=functools.partial(store_correction,
                                                                 calibration_key(self)))
        return self._policy

    def choose_kernels(self) -> None:
        """The target's verify kernels, once per pipeline (at load, and before a calibration
        for pipelines built by hand): the probe's record (`verify_kernels`: stock off a Mac or
        with `--kernels stock`; stored with the calibration) routed into the forward, for
        every block size alike."""
        if not self._kernels_chosen:
            self._kernels_chosen = True
            self.verify_kernels = verify_kernels(self, self.kernel_setting,
                                                 calibration_key(self))
            self.route_kernels()

    def route_kernels(self) -> None:
        """The one place the target's forward takes the verify kernels `verify_kernels` chose
        (None: stock, the model's own modules), through `kernel_calls` (None: the Metal ones
        where Metal runs; tests inject others). A pipeline stage's target keeps stock."""
        if self.stage is None:
            self.adapter.use_kernels(self.verify_kernels, self.kernel_calls)

    def check_rows(self) -> None:
        """With a quantized KV cache: speculation off (`plain_why`) where a verify's rows are
        not bitwise plain steps, batching off where a batch's are not (`row_check`); a
        pipeline-sharded target is not checked and decodes plain. Logged once."""
        if self.kv is None:
            return
        if self.stage is not None:
            verify, batch = "a pipeline-sharded target's forward is not checked", None
        else:
            self.adapter.batch_why = None            # checked afresh, not refused by a past check
            verify, batch = row_check.check_rows(self.adapter)
            self.adapter.batch_why = batch and f"KV cache {self.kv}: {batch}"
        self.plain_why = verify and f"KV cache {self.kv}: {verify}"
        for why, what in ((self.plain_why, "speculative decoding is off"),
                          (batch and self.adapter.batch_why, "sequences decode one at a time")):
            if why:
                log.notice(f"{why}; a key could then round to another code than plain "
                           f"decoding's, so {what} (exact; docs/kernels.md, Row-invariance)")

    def describe(self) -> dict:
        """The effective settings: sources, block size, weight dtypes and quantization as
        loaded, kernel path, the target's KV cache (for reports such as the CLI's
        `--stats-json`)."""
        d = self.drafter
        quant = quantization(d) if d is not None else None
        return {**self.info, "block_size": self.block_size(None), "lookup": self.lookup,
                "drafter_block_size": d.args.block_size if d is not None else None,
                "max_ctx": self.max_ctx, "dtype": _float_dtypes(self.target),
                "target_quantized": quantization(self.target) is not None,
                "draft_dtype": _float_dtypes(d) if d is not None else None,
                "draft_bits": (quant or {}).get("bits", 16) if d is not None else None,
                "draft_group_size": (quant or {}).get("group_size"),
                "draft_quantized_layers": (quant or {}).get("layers", 0),
                "kernels": d.kernels if d is not None else None,
                "kv_bits": self.kv.bits if self.kv else None,
                "kv_group_size": self.kv.group_size if self.kv else None,
                **({"plain": self.plain_why} if self.plain_why else {})}

    # ---- generation
    def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 256,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               seed: int | None = None, block_size: int | str | None = None,
               lookup: bool | None = None, chat_template: bool | None = None,
               system: str | None = None, stop_tokens: Sequence[int] = (),
               state: DecodeState | None = None, images: Sequence = ()) -> Iterator[Chunk]:
        """Yield chunks as tokens are accepted; the last chunk carries `finish_reason`.

        lookup: draft from the context too (None: the pipeline's default). state: caches of an
        earlier generation to reuse for the prompt's common prefix (`state.DecodeState`; it
        is advanced in place, so pass a copy of one you keep). images: file paths, encoded
        bytes or PIL images, shown before the prompt's text in its user turn (a
        vision-language target: `image_refusal` says why another takes none)."""
        sampling = Sampling(temperature, top_p, top_k)
        lookup = self.lookup if lookup is None else check.lookup(lookup)
        b = self.block_size(block_size, lookup)
        max_tokens, seed = check.max_tokens(max_tokens), check.seed(seed)
        ids, media = self._prompt(prompt, images, chat_template, system)
        self._announce_prompt(len(ids), 0 if state is None else
                              common_prefix(state.tokens, ids[:-1]))
        if self.max_ctx is not None and len(ids) >= self.max_ctx and b != 1:
            log.notice(f"the prompt has {len(ids)} tokens, at or beyond max_ctx={self.max_ctx}: "
                    "plain target decoding")
            b = 1
        stop_ids = self.stop_ids(stop_tokens)
        text = SequenceText(self.tokenizer, stop_ids)
        bar = _PrefillBar()
        engine = self.engine(max_batch=1)
        request = self.request(engine, ids, max_tokens, sampling, b, lookup=lookup,
                               stop_ids=stop_ids, seed=seed, state=state,
                               keep_state=state is not None, progress=bar, media=media)
        try:
            for ev in engine.run(request):
                bar.close()                  # the prefill is done once a token is out
                yield Chunk(text(ev.tokens, ev.finish), ev.tokens, request.stats.copy(),
                            ev.finish)
        finally:
            bar.close()

    def generate(self, prompt: str | Sequence[int], **options) -> Generation:
        """Run to the end; options as for `stream`."""
        text, tokens, finish, stats = [], [], "length", None
        for chunk in self.stream(prompt, **options):
            text.append(chunk.text)
            tokens.extend(chunk.tokens)
            stats = chunk.stats
            finish = chunk.finish_reason or finish
        return Generation("".join(text), tokens, stats, finish)

    # ---- batches
    def stream_batch(self, prompts: Sequence[str | Sequence[int]], *,
                     max_tokens: int | Sequence[int] = 256, temperature: float = 0.0,
                     top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                     block_size: int | str | None = None, lookup: bool | None = None,
                     chat_template: bool | None = None, system: str | None = None,
                     stop_tokens: Sequence[int] = (), max_batch: int | None = None,
                     prefill_budget: int | None = None,
                     images: Sequence[Sequence] | None = None) -> Iterator[tuple[int, Chunk]]:
        """Generate every prompt at once on the batch engine (`engine.Engine`: one target
        forward per step over all running prompts, each speculating on its own) and yield
        (index into prompts, Chunk) as tokens commit; each prompt's last chunk carries its
        `finish_reason`. Options as for `stream`, for every prompt; max_tokens may be one per
        prompt (as mlx-lm's `batch_generate`); seed: prompt i uses seed + i. max_batch: the
        most prompts decoding at once; prefill_budget: prompt tokens prefilled per step (None:
        a prompt's whole prefill in the step it joins). A target whose caches the batch cannot
        hold (`model.row_caches.batch_refusal`) decodes its prompts one at a time. images:
        one list per prompt (empty: none), as `stream`'s."""
        sampling = Sampling(temperature, top_p, top_k)
        lookup = self.lookup if lookup is None else check.lookup(lookup)
        b = self.block_size(block_size, lookup)
        limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        if len(limits) != len(prompts):
            raise ValueError(f"max_tokens: {len(limits)} values for {len(prompts)} prompts")
        images = list(images) if images is not None else [()] * len(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"images: {len(images)} lists for {len(prompts)} prompts")
        seed = check.seed(seed)
        stop_ids = self.stop_ids(stop_tokens)
        engine = self.engine(max_batch)
        index, texts = {}, {}
        for i, prompt in enumerate(prompts):
            ids, media = self._prompt(prompt, images[i], chat_template, system)
            rid = engine.add(self.request(engine, ids, check.max_tokens(limits[i]), sampling, b,
                                          lookup=lookup, stop_ids=stop_ids,
                                          seed=None if seed is None else seed + i, media=media))
            index[rid], texts[rid] = i, SequenceText(self.tokenizer, stop_ids)
        while engine.running or engine.waiting:
            for ev in engine.step(prefill_budget):
                yield index[ev.id], Chunk(texts[ev.id](ev.tokens, ev.finish), ev.tokens,
                                          engine.stats[ev.id].copy(), ev.finish)

    # ---- what stream, stream_batch and the server's scheduler share
    def stop_ids(self, stop_tokens: Sequence[int] = ()) -> frozenset:
        """The ids that end a generation: the tokenizer's end tokens and `stop_tokens`."""
        return frozenset(self.tokenizer.eos_token_ids) | {int(t) for t in stop_tokens}

    def engine(self, max_batch: int | None = None) -> Engine:
        """An `Engine` on this pipeline's target and drafter, decoding up to `max_batch`
        sequences at once (one at a time where the target cannot batch:
        `Engine.solo_reason`)."""
        return Engine(self.adapter, self.drafter, planner=Planner(self.acceptance, self.matches),
                      lookup=self.lookup_config,
                      max_batch=max_batch, prefill_step_size=self.prefill_step_size)

    def request(self, engine: Engine, ids: list[int], max_tokens: int, sampling: Sampling,
                b: int | str, *, lookup: bool, stop_ids: frozenset, seed: int | None,
                state: DecodeState | None = None, keep_state: bool = False,
                progress=None, checkpoint: int | None = None,
                media: Media | None = None) -> Request:
        """One prompt (ids) for `engine`, with its width policy for the checked block size `b`
        (`block_size`; a prompt at or past max_ctx runs plain). state, keep_state, progress,
        checkpoint, media: as `engine.Request`'s (the prefix cache, a long prefill's
        progress, the prompt's images)."""
        wide = b if self.plain_why is None and (
            self.max_ctx is None or len(ids) < self.max_ctx) else 1
        policy = engine.planner.policy(wide, self.width_policy() if wide == "auto" else None,
                                       alone=engine.solo)
        return Request(ids, max_tokens, sampling, policy, stop_ids, lookup and wide != 1, seed,
                       state, keep_state, progress, GenerationStats(block_size=wide),
                       checkpoint, media)

    def generate_batch(self, prompts: Sequence[str | Sequence[int]],
                       **options) -> list[Generation]:
        """One `Generation` per prompt, in order; options as for `stream_batch`."""
        parts: list[list[Chunk]] = [[] for _ in prompts]
        for i, chunk in self.stream_batch(prompts, **options):
            parts[i].append(chunk)
        return [Generation("".join(c.text for c in chunks), [t for c in chunks for t in c.tokens],
                           chunks[-1].stats, chunks[-1].finish_reason or "length")
                for chunks in parts]


class SequenceText:
    """One sequence's text as its tokens commit: `text(tokens, finish)` -> the new segment
    (end tokens are not text; a finish flushes what the detokenizer holds back)."""

    def __init__(self, tokenizer, stop_ids: frozenset):
        self.detok, self.stop_ids = tokenizer.detokenizer, stop_ids
        self.detok.reset()

    def __call__(self, tokens: list[int], finish: str | None = None) -> str:
        for t in tokens:
            if t not in self.stop_ids:
                self.detok.add_token(t)
        if finish:
            self.detok.finalize()
        return self.detok.last_segment


class _PrefillBar:
    """The engine's prefill callback `(done, total)`, drawn as one `log.progress` bar (opened
    by the first chunk: a prompt of one chunk shows none)."""

    def __init__(self):
        self.bar, self.done = None, 0

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = log.progress(None, "prefill", total=total, unit="tok")
        self.bar.update(done - self.done)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _float_dtypes(model: nn.Module) -> str:
    """'float32', or e.g. 'bfloat16+float32' when float parameters are mixed."""
    names = {str(v.dtype).rsplit(".", 1)[-1] for _, v in tree_flatten(model.parameters())
             if mx.issubdtype(v.dtype, mx.floating)}
    return "+".join(sorted(names))


@contextlib.contextmanager
def _quiet_length_warning():
    """transformers logs "Token indices sequence length is longer than ..." from encode."""
    logger = logging.getLogger("transformers.tokenization_utils_base")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
