"""The per-machine calibration of the cost model: timing the forwards (`measure_costs`), and
the cache of calibrations (`load_or_measure_costs`, `store_correction`, ...).

The long contexts are made cheaply: the target's caches are filled with random keys and values
(attention's cost does not depend on them), the drafter's with random features.
"""

from __future__ import annotations

import copy
import hashlib
import json
import platform
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from .. import log
from ..files import atomic_write
from ..model.sampling import Sampling
from .costs import BASE_CONTEXT, SPREAD, CostModel, monotone

_log = log.get(__name__)

# the slopes' forwards: attention's cost is linear in the keys, so one long context and three
# widths (those <= the widest) pin both slopes
LONG_CONTEXTS = (2048,)
SLOPE_WIDTHS = (1, 4, 16)
CHAIN_STEPS = 16         # plain steps per timed chain (its unhidden first build amortised)
SLOPE_TRIES = 3          # long-context timings taken again while they fit no slope at all
CALIBRATION_BUDGET = 40.0    # seconds of rounds a calibration may spend trying to settle
MAX_ROUNDS = 12
CALIBRATION_VERSION = "7"    # bump when measure_costs changes: older entries are timed again


def cache_file() -> Path:
    """`$DFLASH2_CACHE/calibration.json` (default cache: `~/.cache/dflash2-mlx`)."""
    from ..loading.assets import resolve_cache_dir

    return resolve_cache_dir() / "calibration.json"


def calibration_key(pipeline) -> str:
    """The entry of this machine, MLX backend and BLAS, model pair and how it was loaded."""
    d = pipeline.describe() if hasattr(pipeline, "describe") else {}
    drafter = pipeline.drafter
    vocab = drafter.draft_vocab if drafter is not None else None
    from ..loading import blas

    parts = [platform.machine(), platform.processor(),
             str(mx.default_device()), mx.__version__, blas.active().name,
             repr(sorted((k, str(v)) for k, v in d.items() if k != "block_size")),
             str(pipeline.adapter.num_layers), str(pipeline.adapter.hidden_size),
             str(drafter.args if drafter is not None else None),
             str(None if vocab is None else vocab.ids.size)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def calibration_meta(pipeline, seconds: float) -> dict:
    """What `doctor` shows of an entry and `stale` checks: when and how long, the package,
    calibration and BLAS it was made with, and the pair as `load` was given it."""
    from .. import __version__
    from ..loading import blas

    d = pipeline.describe() if hasattr(pipeline, "describe") else {}
    return {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(seconds, 1), "version": __version__,
            "calibration": CALIBRATION_VERSION, "blas": blas.active().name,
            "backend": d.get("backend") or str(mx.default_device()), "model": d.get("model"),
            "draft": d.get("draft")}


def stale(entry) -> str | None:
    """Why a stored entry is timed again though well formed (None: it is not): made by
    another calibration or package version, or with another BLAS."""
    from .. import __version__
    from ..loading import blas

    meta = entry.get("meta") if isinstance(entry, dict) else None
    if not isinstance(meta, dict) or meta.get("calibration") != CALIBRATION_VERSION:
        return "made by an older calibration"
    if meta.get("version") != __version__:
        return f"made by dflash2-mlx {meta.get('version')}"
    if meta.get("blas") != blas.active().name:
        return f"made with BLAS {meta.get('blas')}"
    return None


def _read_table(path: Path) -> dict:
    try:
        table = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return table if isinstance(table, dict) else {}


def load_or_measure_costs(pipeline, max_width: int, fresh: bool = False) -> CostModel:
    """Costs from the per-machine cache (`calibration_key`), measured on first use; verify
    costs up to `max_width` rows (or the drafter's block size). fresh: measure anyway.
    An entry not `settled` or `stale` is timed again at each load; the better of the two (the
    narrower spread) serves and is stored. Writers re-read and replace the file atomically."""
    path, key = cache_file(), calibration_key(pipeline)
    block = pipeline.drafter.args.max_width if pipeline.drafter is not None else 1
    entry = _read_table(path).get(key)
    cost = CostModel.from_dict(entry, block, max(max_width, block))
    why = stale(entry) if cost is not None else None
    if cost is not None and cost.settled and why is None and not fresh:
        return cost
    tic = time.perf_counter()
    if cost is None or why is not None or fresh or cost.spread > SPREAD:
        _log.info("measuring draft and verify cost per block width and context length ("
                  + (f"the stored calibration was {why}" if why and cost is not None else
                     "asked for" if fresh else "its rounds disagreed last time: a busy "
                     "machine?" if cost is not None else "once per machine, model pair and "
                     "settings") + ") ...")
        new = measure_costs(pipeline, max_width)
        if cost is not None and why is None and not fresh and cost.spread < new.spread:
            _log.info(f"calibration: rounds {100 * new.spread:.0f}% apart; the stored one "
                      f"({100 * cost.spread:.0f}%) serves")
            return cost                                   # it agreed better: kept as stored
    else:
        _log.info("timing the cost of a long context again (the last calibration could not) ...")
        new = measure_slopes(pipeline, cost)
        new = replace(new, spread=max(new.spread, cost.spread))
    seconds = time.perf_counter() - tic
    _log.info(f"calibration: {seconds:.0f} s, rounds within {100 * new.spread:.0f}%"
              + ("" if new.settled else f" (over {100 * SPREAD:.0f}%, or no context slope: "
                 "used for this run, timed again at the next load)"))
    _store(path, key, new, calibration_meta(pipeline, seconds))
    return new


def store_correction(key: str, cost: CostModel) -> None:
    """Replace the stored prices of entry `key` with `cost` (`AdaptiveWidth.corrected`),
    its record kept, the correction noted."""
    path = cache_file()
    meta = dict((_read_table(path).get(key) or {}).get("meta") or {})
    if not meta:
        return                                  # removed meanwhile: the next load times it
    meta["corrected"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    _log.info("the timed cycles showed the calibration's prices wrong: corrected in "
              f"{path}")
    _store(path, key, cost, meta)


def _store(path: Path, key: str, cost: CostModel, meta: dict) -> None:
    table = _read_table(path)                       # others may have written meanwhile
    kernels = (table.get(key) or {}).get("kernels") if isinstance(table.get(key), dict) else None
    table[key] = {**cost.to_dict(), "meta": meta}
    if kernels is not None:                         # the verify kernels' probe, kept
        table[key]["kernels"] = kernels
    _write_table(path, table)


def stored_kernel_record(key: str):
    """The verify kernels' probe record of entry `key` (`model.kernel_probe`), or None."""
    entry = _read_table(cache_file()).get(key)
    return entry.get("kernels") if isinstance(entry, dict) else None


def store_kernel_record(key: str, record: dict) -> None:
    """Store the probe's record with entry `key` (made if absent: the costs follow)."""
    path = cache_file()
    table = _read_table(path)
    entry = table.get(key) if isinstance(table.get(key), dict) else {}
    table[key] = {**entry, "kernels": record}
    _write_table(path, table)


def _write_table(path: Path, table: dict) -> None:
    with atomic_write(path) as f:
        json.dump(table, f, indent=1)


def stored_calibrations() -> dict:
    """The entries of `cache_file()`, by key (`doctor`, `calibrate`)."""
    return {k: v for k, v in _read_table(cache_file()).items() if isinstance(v, dict)}


def forget_calibrations(keys) -> None:
    """Remove these entries (their pairs are timed again at their next load)."""
    path = cache_file()
    table = _read_table(path)
    if any(k in table for k in keys):
        for k in keys:
            table.pop(k, None)
        _write_table(path, table)


def fit_slope(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """Least squares of extra = dn * (per_row * w + per_forward) over (w, dn, extra) points
    (extra: seconds over the same width at base; dn: context over base) -> both slopes, >= 0."""
    sxx = sxy = syy = sx = sy = 0.0
    for w, dn, extra in points:
        x, y = dn * w, float(dn)
        sxx, sxy, syy = sxx + x * x, sxy + x * y, syy + y * y
        sx, sy = sx + x * extra, sy + y * extra
    det = sxx * syy - sxy * sxy
    if not points or det <= 1e-12 * max(sxx * syy, 1e-300):
        per_row = sx / sxx if sxx else 0.0                   # one width only: all per row
        return max(per_row, 0.0), 0.0
    per_row, per_forward = (sx * syy - sy * sxy) / det, (sy * sxx - sx * sxy) / det
    if per_forward < 0:
        return max(sx / sxx, 0.0), 0.0
    if per_row < 0:
        return 0.0, max(sy / syy, 0.0)
    return per_row, per_forward


def grow_cache(cache: list, n: int) -> bool:
    """Append n random keys and values to every attention cache of a target, in chunks ->
    False where a layer's cache is not a key/value store, plain or quantized (recurrent, a
    sliding window): its context cost is then left to the timed cycles."""
    stores = [c for c in cache if _kv_shape(c) is not None]
    if len(stores) != len(cache):
        return False
    for start in range(0, n, 1024):
        rows = min(1024, n - start)
        for c in stores:
            b, heads, dim, vdim, dtype = _kv_shape(c)
            c.update_and_fetch(mx.random.normal((b, heads, rows, dim)).astype(dtype),
                               mx.random.normal((b, heads, rows, vdim)).astype(dtype))
        mx.eval([c.state for c in stores])
    return True


def _kv_shape(c) -> tuple | None:
    """(batch, heads, key dim, value dim, dtype) of a filled key/value cache (a quantized one's
    dims unpacked from its codes), None for any other cache."""
    if isinstance(c, QuantizedKVCache) and c.keys is not None:
        (k, scales, _), (v, _, _) = c.keys, c.values
        per_word = 32 // c.bits
        return (*k.shape[:2], k.shape[-1] * per_word, v.shape[-1] * per_word, scales.dtype)
    keys = getattr(c, "keys", None)
    if (isinstance(keys, mx.array) and keys.ndim == 4 and hasattr(c, "update_and_fetch")
            and not hasattr(c, "max_size")):
        return (*keys.shape[:2], keys.shape[-1], c.values.shape[-1], keys.dtype)
    return None


def measure_costs(pipeline, max_width: int, context: int = BASE_CONTEXT,
                  long: tuple[int, ...] = LONG_CONTEXTS, reps: int = 3,
                  budget: float = CALIBRATION_BUDGET) -> CostModel:
    """Time a chain of plain steps, the drafter (widths up to its block size) and the verify
    (every width up to `max_width`) after a `context`-token prompt, all in each round, then
    the context slopes (`measure_slopes`). Each is priced at its fastest round (other work only
    adds time), the tables fitted nondecreasing; the spread is the wider of the two."""
    tic = time.perf_counter()
    target, drafter = pipeline.adapter, pipeline.drafter
    ids = _context_ids(target, context)
    cache = target.make_cache()
    _, feats = target.forward(ids, cache)
    mx.eval(feats, [c.state for c in cache])
    anchor = ids[:, -1:]
    block = drafter.args.max_width if drafter is not None else 1
    dcache = drafter.make_cache() if drafter is not None else None
    if drafter is not None:
        drafter.propose(target, anchor, feats, dcache, 2, Sampling(), mx.random.key(0))
    widths = list(range(1, max(max_width, block) + 1))
    jobs = {("plain", 1): lambda: _time_chain(target, cache, anchor)}
    for w in widths:
        jobs.update(_width_jobs(target, drafter, cache, dcache, anchor, feats, w, block,
                                copy_cache=True))
    best, spread = _rounds(jobs, reps, budget / 2, "calibration")
    draft = [0.0] + monotone([best[("draft", w)] for w in range(2, block + 1)])
    verify = monotone([best[("verify", w)] for w in widths])
    # never dearer than the synchronous step (a chain only hides work)
    plain = min(best[("plain", 1)], verify[0])
    cost = CostModel(tuple(draft), tuple(verify), context, plain_step=plain, spread=spread)
    cost = measure_slopes(pipeline, cost, long, reps, budget - (time.perf_counter() - tic))
    return replace(cost, spread=max(cost.spread, spread))


def measure_slopes(pipeline, cost: CostModel, long: tuple[int, ...] = LONG_CONTEXTS,
                   reps: int = 3, budget: float = CALIBRATION_BUDGET / 2) -> CostModel:
    """`cost` with its context slopes timed (`SLOPE_WIDTHS` at each `long` context against
    its base), up to `SLOPE_TRIES` times while they fit no slope: then `fitted` is False and
    the next load times them again. Its spread: the rounds'."""
    target, context = pipeline.adapter, cost.base
    block = pipeline.drafter.args.max_width if pipeline.drafter is not None else 1
    ids = _context_ids(target, context)
    widths = [w for w in SLOPE_WIDTHS if w <= cost.max_width]
    deadline = time.perf_counter() + max(budget, 0.0)
    for attempt in range(SLOPE_TRIES):
        left = deadline - time.perf_counter()
        v_slope, d_slope, measured, spread = _measure_slopes(
            pipeline, widths, context, long, ids, block, max(reps - 1, 1),
            left / (SLOPE_TRIES - attempt))
        if not measured:
            return replace(cost, verify_slope=v_slope, draft_slope=d_slope, fitted=True)
        if sum(v_slope) > 0:
            return replace(cost, verify_slope=v_slope, draft_slope=d_slope, fitted=True,
                           spread=spread)
        again = attempt + 1 < SLOPE_TRIES
        log.get(__name__).warning(
            "calibration: the long-context forwards timed no slower than the short ones (a "
            "busy machine?); " + ("timing them again" if again else
                                  "their cost is left to the timed cycles, and timed again "
                                  "next time"))
    return replace(cost, verify_slope=v_slope, draft_slope=d_slope, fitted=False,
                   spread=spread)


def _rounds(jobs: dict, reps: int, budget: float, desc: str) -> tuple[dict, float]:
    """Run every job (returning the seconds it timed) once per round, after a warm-up round,
    until at least `reps` rounds agree within `SPREAD` or `budget` seconds have passed (2 to
    `MAX_ROUNDS` rounds) -> ({job: its fastest round}, the rounds' spread)."""
    times: dict = {k: [] for k in jobs}
    for job in jobs.values():                          # warm-up: first-use compilation
        job()
    deadline = time.perf_counter() + budget
    bar = log.progress(None, desc, total=max(reps, 2), unit="round")
    spread = float("inf")
    try:
        for r in range(MAX_ROUNDS):
            for k, job in jobs.items():
                times[k].append(job())
            bar.total = max(bar.total, r + 1)
            bar.update(1)
            if r + 1 >= 2:
                spread = round_spread(times)
                bar.set_postfix_str(f"spread {100 * spread:.0f}%", refresh=False)
            if r + 1 >= 2 and (time.perf_counter() > deadline
                               or r + 1 >= reps and spread <= SPREAD):
                break
    finally:
        bar.close()
    return {k: min(v) for k, v in times.items()}, spread


def round_spread(times: dict) -> float:
    """How far the rounds disagree: the median over jobs of its second-fastest round over its
    fastest, less 1 (one more round confirms the fastest; one job's stall does not decide)."""
    gaps = sorted(sorted(v)[1] / sorted(v)[0] - 1.0 for v in times.values()
                  if len(v) >= 2 and min(v) > 0)
    return gaps[len(gaps) // 2] if gaps else 0.0


def _width_jobs(target, drafter, cache, dcache, anchor, feats, width: int, block: int,
                copy_cache: bool) -> dict:
    """{("draft", width): the drafter's pass (widths 2 .. block), ("verify", width)}: callables
    timing one forward from `cache`, a deep copy of it (copy_cache: a sliding window rotates
    beyond rollback) or rolled back after (a long context is too big to copy)."""
    greedy = Sampling()

    def draft():
        t0 = time.perf_counter()
        p = drafter.propose(target, anchor, feats[:, :0], dcache, width, greedy,
                            mx.random.key(0))
        mx.eval(p.tokens)
        return time.perf_counter() - t0

    def verify():
        run = copy.deepcopy(cache) if copy_cache else cache
        snapshot = None if copy_cache else target.snapshot(run)
        t0 = time.perf_counter()
        mx.eval(target.forward(mx.repeat(anchor, width, axis=1), run))
        seconds = time.perf_counter() - t0
        if snapshot is not None:
            snapshot.rollback(0, width)
        return seconds

    jobs = {("draft", width): draft} if drafter is not None and 1 < width <= block else {}
    return {**jobs, ("verify", width): verify}


def _context_ids(target, context: int) -> mx.array:
    """The calibration's prompt [1, context]: fixed ids spread over the vocabulary."""
    return mx.array([[(17 * i) % target.vocab_size for i in range(context)]], dtype=mx.uint32)


def _time_chain(target, cache, anchor, steps: int = CHAIN_STEPS) -> float:
    """Seconds per plain step of a greedy chain of `steps` launched ahead from a copy of
    `cache`, as `engine._plain_step` runs them (its first graph build unhidden)."""
    run = copy.deepcopy(cache)
    mx.eval([c.state for c in run])
    t0 = time.perf_counter()
    y = mx.argmax(target.forward(anchor, run)[0][:, -1], axis=-1)
    mx.async_eval(y)
    for _ in range(steps - 1):
        nxt = mx.argmax(target.forward(y.reshape(1, 1).astype(mx.uint32), run)[0][:, -1],
                        axis=-1)
        mx.async_eval(nxt)
        y.item()
        y = nxt
    y.item()
    return (time.perf_counter() - t0) / steps


def _measure_slopes(pipeline, widths, context, long, ids, block, reps, budget):
    """(verify_slope, draft_slope, measured, spread) from `widths` timed at each long context
    against `context`; zeros and measured False where the caches cannot be grown
    (`grow_cache`; a pipeline-sharded target's other ranks neither) or no `long` is asked."""
    target, drafter = pipeline.adapter, pipeline.drafter
    if not long or getattr(pipeline, "stage", None) is not None:
        return (0.0, 0.0), (0.0, 0.0), False, 0.0
    jobs = {}
    for n in (context, *long):
        cache = target.make_cache()
        _, feats = target.forward(ids, cache)
        if not grow_cache(cache, n - context):
            log.get(__name__).info("the target's cache is not a plain key/value store: its "
                                   "context cost is learnt from timed cycles only")
            return (0.0, 0.0), (0.0, 0.0), False, 0.0
        dcache = drafter.make_cache() if drafter is not None else None
        if drafter is not None:              # its context: n rows of (random) target features
            ctx = mx.concatenate([feats, mx.random.normal(
                (1, n - context, feats.shape[-1])).astype(feats.dtype)], axis=1)
            mx.eval(drafter.propose(target, ids[:, -1:], ctx, dcache, 2, Sampling(),
                                    mx.random.key(0)).tokens)
        for w in widths:
            jobs.update({(n, *k): job for k, job in _width_jobs(
                target, drafter, cache, dcache, ids[:, -1:], feats, w, block,
                copy_cache=False).items()})
    best, spread = _rounds(jobs, reps, budget, "calibration at long context")
    v_points = [(w, n - context, best[(n, "verify", w)] - best[(context, "verify", w)])
                for n in long for w in widths]
    d_points = [(w, n - context, best[(n, "draft", w)] - best[(context, "draft", w)])
                for n in long for w in widths if (n, "draft", w) in best]
    del jobs
    mx.clear_cache()
    return fit_slope(v_points), fit_slope(d_points), True, spread
