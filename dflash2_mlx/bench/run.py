"""The bench's measuring: the systems it compares (plain mlx-lm, ours per block size with and
without lookup, the reference) and `run_bench`, which runs them alternating, prompt by prompt,
part by part ("<set> T=<t>")."""

from __future__ import annotations

import tempfile
import time
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from .. import log
from ..policy.adaptive import DRAFTER
from ..decode.stats import Cycle
from ..decode.state import DecodeState, prefill
from .results import Run, add_ratios, kept_parts, summarize

_log = log.get(__name__)


def _plain(pipe, ids, temperature, max_tokens, seed, stop_ids,
           state: DecodeState | None = None) -> Run:
    """mlx-lm's own decoding of the same target (`generate_step`), at the pipeline's KV
    setting: with `kv_bits`, `QuantizedKVCache` on the full-attention layers from token 0.
    With `state` (`prefilled`), from a copy of its caches: mlx-lm reads the last prompt token."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    kv = pipe.kv
    if state is None:
        cache = [QuantizedKVCache(kv.group_size, kv.bits) if kv and type(c) is KVCache else c
                 for c in make_prompt_cache(pipe.target)]
    else:
        cache, ids = state.copy().cache, ids[len(state.tokens):]
    mx.random.seed(seed)
    tokens, tic, first = [], time.perf_counter(), None
    for token, _ in generate_step(mx.array(ids), pipe.target, max_tokens=max_tokens,
                                  sampler=make_sampler(temp=temperature), prompt_cache=cache):
        if first is None:
            first = time.perf_counter()
        tokens.append(token)
        if token in stop_ids:
            break
    end = time.perf_counter()
    return Run(tokens, first - tic, end - first, mx.get_peak_memory() / 2**20)


def _ours(pipe, ids, temperature, max_tokens, seed, block_size, lookup,
          state: DecodeState | None = None) -> Run:
    """One generation; from a copy of `state` (a prefilled prompt) when given."""
    g = pipe.generate(ids, max_tokens=max_tokens, temperature=temperature, seed=seed,
                      block_size=block_size, lookup=lookup,
                      state=None if state is None else state.copy())
    s = g.stats
    return Run(g.tokens, s.prefill_s, s.decode_s, mx.get_peak_memory() / 2**20, s.steps)


def prefilled(pipe, ids) -> tuple[DecodeState, float]:
    """The state after prefilling all but the prompt's last token, and the seconds it took:
    every system of a long context set, mlx-lm's loop too, starts from a copy and reads that
    token itself (the state is the same whoever prefills it, so this is fair, and an 8k
    prefill takes minutes here)."""
    state = DecodeState.new(pipe.adapter, pipe.drafter)
    tic = time.perf_counter()
    prefill(pipe.adapter, state, ids[:-1], pipe.prefill_step_size,
            pipe.drafter.context_window if pipe.drafter is not None else None)
    mx.eval([c.state for c in state.cache], state.pending)
    return state, time.perf_counter() - tic


class Reference:
    """`dflash.model_mlx.stream_generate` on its own copy of the target (it wraps the target's
    layers in place) and the same drafter checkpoint."""

    def __init__(self, model: str, draft: str):
        import dflash.model_mlx as ref

        from ..loading.checkpoint import load_target

        self.ref = ref
        self.target, self.tokenizer, _ = load_target(model, mx.float32)
        # load_draft only takes hub ids: let it read the local folder, for this call only
        original = ref.snapshot_download
        ref.snapshot_download = lambda path, **_: path
        try:
            self.draft = ref.load_draft(str(draft))
        finally:
            ref.snapshot_download = original
        self.draft.update(_to_float32(self.draft.parameters()))

    def __call__(self, ids, temperature, max_tokens, seed, block_size) -> Run:
        mx.random.seed(seed)
        tokens, steps, tic, first = [], [], time.perf_counter(), None
        for resp in self.ref.stream_generate(self.target, self.draft, self.tokenizer, ids,
                                             block_size=block_size, max_tokens=max_tokens,
                                             temperature=temperature):
            if first is None:
                first = time.perf_counter()
            elif resp.tokens:
                steps.append(Cycle(DRAFTER, block_size, len(resp.tokens) - 1))
            tokens += resp.tokens
        end = time.perf_counter()
        return Run(tokens, first - tic, end - first, mx.get_peak_memory() / 2**20, steps)


def _to_float32(params):
    from mlx.utils import tree_map

    return tree_map(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating)
                    else x, params)


def _load(model: str, draft: str, reference: bool, kv: dict):
    """The pipeline, the drafter the systems run (a BF16 copy of a quantized one when the
    reference runs too: it reads BF16 checkpoints only), that copy's folder (kept while the
    bench runs) and the reference (None without it). kv: `load`'s kv_bits and kv_group_size."""
    import dflash2_mlx

    from ..loading.checkpoint import resolve, save_drafter, stored_quantization

    pipe = dflash2_mlx.load(model, draft, **kv)
    tmp = None
    if reference and stored_quantization(resolve(draft, "draft model")):
        # the reference reads BF16 checkpoints only: both systems run one BF16 copy
        tmp = tempfile.TemporaryDirectory(prefix="dflash2-bench-")
        from mlx_lm.utils import dequantize_model

        save_drafter(dequantize_model(pipe.drafter), tmp.name, mx.bfloat16)
        _log.info(f"{draft} is stored quantized: both systems use its BF16 copy {tmp.name}")
        draft = tmp.name
        pipe = dflash2_mlx.load(model, draft, **kv)
    ref = None
    if reference:
        try:
            ref = Reference(model, draft)
        except ImportError:
            _log.info("reference implementation (PyPI dflash==0.1.0) not importable: skipped")
    return pipe, tmp, ref


def _drafter_block(pipe) -> int:
    """The drafter's widest block; 0 without a drafter (`--draft none`: lookup only)."""
    return pipe.drafter.args.max_width if pipe.drafter is not None else 0


def _systems(pipe, ref, block_sizes, lookup: bool, max_tokens: int) -> dict[str, Callable]:
    """The systems of a short set, each called with (ids, temperature, seed): mlx-lm, and per
    block size ours alone (up to the drafter's block), the hybrid, the reference."""
    stop_ids = set(pipe.tokenizer.eos_token_ids)
    block = _drafter_block(pipe)
    systems: dict[str, Callable] = {
        "mlx-lm": lambda ids, t, s: _plain(pipe, ids, t, max_tokens, s, stop_ids)}
    for b in block_sizes:
        if block and (b == "auto" or b <= block):
            systems[f"dflash2-mlx b={b}"] = (
                lambda ids, t, s, b=b: _ours(pipe, ids, t, max_tokens, s, b, False))
        if lookup:
            systems[f"hybrid b={b}"] = (
                lambda ids, t, s, b=b: _ours(pipe, ids, t, max_tokens, s, b, True))
        if ref is not None and b != "auto" and b <= block:
            systems[f"reference b={b}"] = (
                lambda ids, t, s, b=b: ref(ids, t, max_tokens, s, b))
    return systems


def _long_systems(pipe, block_sizes, lookup: bool, max_tokens: int) -> dict[str, Callable]:
    """The systems of a long set, each called with (ids, temperature, seed, prefilled state):
    mlx-lm's loop, and ours alone and the hybrid per block size."""
    block = _drafter_block(pipe)
    stop_ids = set(pipe.tokenizer.eos_token_ids)
    systems: dict[str, Callable] = {"mlx-lm": (
        lambda ids, t, s, state: _plain(pipe, ids, t, max_tokens, s, stop_ids, state))}
    for b in block_sizes:
        for hybrid in ((False, True) if lookup else (False,)):
            if hybrid or block and (b == "auto" or b <= block):
                systems[f"{'hybrid' if hybrid else 'dflash2-mlx'} b={b}"] = (
                    lambda ids, t, s, state, b=b, h=hybrid:
                    _ours(pipe, ids, t, max_tokens, s, b, h, state))
    return systems


def _rounds(chosen: dict[str, Callable], runs: dict[str, list[Run]], baseline: str, args,
            repeats: int, prompt: int, greedy: bool) -> list[str]:
    """`repeats` rounds of every system on one prompt, the order rotated each round; greedy,
    the systems whose output differs from the baseline's ("prompt <i>: <system>")."""
    names, mismatches = list(chosen), []
    for k in range(repeats):
        for name in names[k % len(names):] + names[: k % len(names)]:
            mx.clear_cache()
            mx.reset_peak_memory()
            runs[name].append(chosen[name](*args))
        if greedy:
            outs = {name: r[-1].tokens for name, r in runs.items()}
            base = outs[baseline]
            mismatches += [f"prompt {prompt}: {n}" for n, o in outs.items() if o != base]
    return mismatches


def _part(pipe, chosen: dict[str, Callable], baseline: str, encoded: list, label: str,
          temperature: float, seed: int, repeats: int, long: bool) -> dict:
    """One prompt set at one temperature: every system on every prompt (long sets from a copy
    of the prompt's prefilled state) -> the part's results."""
    runs: dict[str, list[Run]] = {name: [] for name in chosen}
    mismatches, prefill_s = [], []
    for i, ids in enumerate(log.progress(encoded, label, unit="prompt")):
        args = (ids, temperature, seed + i)
        if long:
            state, seconds = prefilled(pipe, ids)
            prefill_s.append(seconds)
            args += (state,)
        mismatches += _rounds(chosen, runs, baseline, args, repeats, i, temperature == 0)
    table = add_ratios({name: summarize(r) for name, r in runs.items()}, baseline)
    part = {"systems": table, "baseline": baseline,
            "prompt_tokens": float(np.mean([len(x) for x in encoded]))}
    if long:
        for row in table.values():
            row["prefill_s"] = float(np.mean(prefill_s))     # the one shared prefill
    if temperature == 0:
        part["greedy_identical"] = not mismatches
        part["mismatches"] = mismatches
    return part


def run_bench(model: str, draft: str, prompt_sets: dict[str, Sequence[str]], *,
              block_sizes: Sequence[int | str] = (2, 4, 8, "auto"),
              temperatures: Sequence[float] = (0.0, 1.0), max_tokens: int = 128,
              lookup: bool = True, reference: bool = True, seed: int = 0,
              repeats: int = 1, kv_bits: int | None = None, kv_group_size: int | None = None,
              earlier: dict | None = None,
              checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Run every system on every prompt of each set, alternating; return JSON-ready results
    keyed "<set> T=<t>". Systems: mlx-lm; per block size b, "dflash2-mlx b=<b>" (the drafter
    alone, b up to its block size), "hybrid b=<b>" (drafter and lookup, with `lookup`) and
    "reference b=<b>". Progress: one bar per set and temperature (`log.progress`).

    repeats: rounds of every system per prompt, the order rotated each round; round k of
    one system is paired with round k of the baseline (`results.add_ratios`), so a figure is
    a median over prompts x rounds of ratios measured minutes apart at most.

    kv_bits, kv_group_size: the target's KV cache quantized (`load`'s), for mlx-lm too (its
    `QuantizedKVCache` from token 0); the reference, whose cache is float, is left out then.

    Sets named "long-..." (`prompt_sets.LONG_SIZES`) prefill each prompt once (`prefilled`)
    and run every system from a copy of that state, mlx-lm's loop the baseline as in every
    set; the reference would prefill again (minutes at 8k) and is left out there.

    earlier: the results of an unfinished run (`results.unfinished`); with the same setup its
    parts are kept as measured and only the rest run (the policy starts fresh: what it learned
    in the kept parts is gone). checkpoint: called with the results after every part, so an
    interrupted run can resume; `setup["complete"]` is False until the last part is in."""
    if kv_bits is not None and reference:
        _log.info("--kv-bits: the reference keeps a float KV cache: left out")
        reference = False
    pipe, tmp, ref = _load(model, draft, reference,
                           {"kv_bits": kv_bits, "kv_group_size": kv_group_size})
    if "auto" in block_sizes:       # measure costs before timing anything
        pipe.width_policy()
    systems = _systems(pipe, ref, block_sizes, lookup, max_tokens)
    long_systems = _long_systems(pipe, block_sizes, lookup, max_tokens)
    results: dict = {"setup": {"model": model, "draft": draft, "bf16_copy": tmp is not None,
                               "prompts": {k: len(v) for k, v in prompt_sets.items()},
                               "max_tokens": max_tokens, "block_sizes": list(block_sizes),
                               "temperatures": list(temperatures), "seed": seed,
                               "lookup": lookup, "drafter_block_size":
                               pipe.drafter and pipe.drafter.args.block_size,
                               "repeats": repeats,
                               "reference": reference, "complete": False}}
    if pipe.kv is not None:         # (absent in float: unfinished runs of before still resume)
        results["setup"].update(kv_bits=pipe.kv.bits, kv_group_size=pipe.kv.group_size)
    kept = kept_parts(earlier, results["setup"])
    for set_name, prompts in prompt_sets.items():
        encoded = [pipe.encode(p) for p in prompts]
        long = set_name.startswith("long-")
        chosen = long_systems if long else systems
        for temperature in temperatures:
            key = f"{set_name} T={temperature:g}"
            if key in kept:
                results[key] = kept[key]
                continue
            results[key] = _part(pipe, chosen, "mlx-lm", encoded, key, temperature, seed,
                                 repeats, long)
            if checkpoint is not None:
                checkpoint(results)
    results["setup"]["complete"] = True
    return results
