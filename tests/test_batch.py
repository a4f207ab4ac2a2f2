"""The batch engine: its ragged cache against single-sequence caches, and every sequence of a
batch generating exactly what it generates alone, whatever runs beside it."""

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import _get_classes

from dflash2_mlx.batch_cache import RaggedKVCache, batch_cache, check_batchable
from dflash2_mlx.target import TargetAdapter
from test_families import CONFIGS


def tiny(name: str):
    cfg = CONFIGS[name]
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(7)
    model = model_class(args_class.from_dict(cfg))
    embed = TargetAdapter(model).embed_tokens
    embed.weight = embed.weight * 4
    mx.eval(model.parameters())
    return TargetAdapter(model)


@pytest.fixture(scope="module", params=["llama", "llama-sliding"])
def adapter(request):
    if request.param == "llama":
        cfg = {k: v for k, v in CONFIGS["llama-sliding"].items()
               if k not in ("layer_types", "sliding_window")}
        CONFIGS.setdefault("llama", cfg)
    return tiny(request.param)


def single_trim(cache: list, n: int) -> None:
    for c in cache:
        assert c.trim(n) == n


def test_ragged_rows_equal_single_caches(adapter):
    """Rows of different lengths verifying blocks of different widths, each keeping its own
    count: every row's logits are its single cache's, through trims, holes and compactions,
    and each row converts back to the single cache it equals."""
    rng = random.Random(0)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (3, 11, 7)]
    alone = [adapter.make_cache() for _ in prompts]
    batch = None
    for p, cache in zip(prompts, alone):
        adapter.forward(mx.array([p]), cache)
        rows = batch_cache(cache)
        batch = rows if batch is None else [b.extend(r) or b for b, r in zip(batch, rows)]
    compacted = 0
    for step in range(60):
        widths = [rng.randint(1, 6) for _ in prompts]
        T = max(widths)
        blocks = [[rng.randrange(300) for _ in range(w)] for w in widths]
        x = mx.array([b + [0] * (T - len(b)) for b in blocks])
        logits, _ = adapter.forward(x, batch)
        for i, (block, cache) in enumerate(zip(blocks, alone)):
            ref, _ = adapter.forward(mx.array([block]), cache)
            np.testing.assert_allclose(np.array(logits[i, : len(block)]), np.array(ref[0]),
                                       atol=1e-4, rtol=1e-4, err_msg=f"step {step} row {i}")
        keep = [rng.randint(1, w) for w in widths]     # the engine keeps the anchor row
        before = batch[0].size()
        for c in batch:
            c.commit(keep)
        compacted += batch[0].size() < before
        for k, w, cache in zip(keep, widths, alone):
            if k < w:
                single_trim(cache, w - k)
    assert compacted, "no step compacted the cache: the test does not reach compaction"
    for i, cache in enumerate(alone):
        for b, c in zip(batch, cache):
            back = b.to_single(i)
            assert back.offset == c.offset
            k_ref = c.state[0][..., -back.keys.shape[2]:, :] if back.keys.shape[2] < c.offset \
                else c.state[0][..., : c.offset, :]
            if isinstance(b.window, int):
                continue        # a rotated buffer's order is its own; the logits said enough
            # the same rows (a batched projection differs from a single one in the last bits)
            np.testing.assert_allclose(np.array(back.keys), np.array(k_ref), atol=1e-5)


def test_leave_and_join_keep_rows(adapter):
    rng = random.Random(1)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (5, 9, 4, 12)]
    alone = [adapter.make_cache() for _ in prompts]
    for p, cache in zip(prompts, alone):
        adapter.forward(mx.array([p]), cache)
    batch = batch_cache(alone[0])
    for cache in alone[1:3]:
        for b, r in zip(batch, batch_cache(cache)):
            b.extend(r)
    for c in batch:
        c.filter([0, 2])                   # row 1 leaves
    for b, r in zip(batch, batch_cache(alone[3])):
        b.extend(r)                        # a longer row joins
    rows = [alone[0], alone[2], alone[3]]
    x = mx.array([[7, 8], [9, 10], [11, 12]])
    logits, _ = adapter.forward(x, batch)
    for i, cache in enumerate(rows):
        ref, _ = adapter.forward(x[i : i + 1], cache)
        np.testing.assert_allclose(np.array(logits[i]), np.array(ref[0]), atol=1e-4, rtol=1e-4)


def test_commit_checks_its_counts(adapter):
    batch = batch_cache(adapter.make_cache())
    with pytest.raises(ValueError, match="commit"):
        batch[0].commit([1])             # nothing was forwarded
    with pytest.raises(NotImplementedError):
        batch[0].trim(1)


def test_recurrent_family_is_refused():
    target = tiny("qwen3_5")
    with pytest.raises(ValueError, match="one at a time"):
        check_batchable(target.make_cache())
