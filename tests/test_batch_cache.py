"""The batch caches (`model.row_caches`): ragged rows against single-sequence caches, through
trims, holes, compactions, rows leaving and joining; and which caches are refused. The engine on
them: test_engine.py; hybrid GatedDeltaNet targets: test_batch_hybrid.py."""

import random
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ChunkedKVCache, QuantizedKVCache, RotatingKVCache

from dflash2_mlx.model.row_caches import SPARE_ROWS, batch_cache, batch_refusal
from dflash2_mlx.decode.engine import _fill
from fixtures import tiny
from test_families import CONFIGS

pytestmark = pytest.mark.rows


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
        if batch[0].size() < before:
            compacted += 1        # with room left: the next forward writes in place
            assert all(c.keys.shape[2] >= c.size() + 6 for c in batch)
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


def test_rows_leaving_move_in_place_and_stay_exact(adapter):
    """A leaver's place is filled from the end (`batch._fill`): only that row is copied, the
    buffer keeps its rows past the batch until it grows (then drops them), and every row's
    logits stay its single cache's through leaves, a join and the growth."""
    rng = random.Random(4)
    alone = [adapter.make_cache() for _ in range(5)]
    for n, cache in zip((6, 13, 2, 9, 4), alone):
        adapter.forward(mx.array([[rng.randrange(300) for _ in range(n)]]), cache)
    batch = batch_cache(alone[0])
    for b, *rows in zip(batch, *(batch_cache(c) for c in alone[1:4])):
        b.extend(*rows)
    rows = alone[:4]

    def step(T=1):
        x = mx.array([[rng.randrange(300) for _ in range(T)] for _ in rows])
        logits, _ = adapter.forward(x, batch)
        for c in batch:
            c.commit([T] * len(rows))
        for i, cache in enumerate(rows):
            ref, _ = adapter.forward(x[i : i + 1], cache)
            np.testing.assert_allclose(np.array(logits[i]), np.array(ref[0]), atol=1e-4,
                                       rtol=1e-4, err_msg=f"row {i}")

    step()
    order = _fill(4, [1])                  # row 1 leaves, row 3 takes its place
    assert order == [0, 3, 2]
    for c in batch:
        c.filter(order)
    rows = [rows[i] for i in order]
    assert all(c.keys.shape[0] == 4 and c.batch == 3 for c in batch)    # nothing gathered
    step()
    for b, r in zip(batch, batch_cache(alone[4])):
        b.extend(r)                        # a joiner after a leave
    rows.append(alone[4])
    step(2)
    for c in batch:
        c.filter(_fill(4, [0]))
    rows = [rows[i] for i in _fill(4, [0])]
    step()
    size = batch[0].keys.shape[2]
    step(size - batch[0].size() + 1)       # past the buffer: it grows, without spare rows
    assert all(c.keys.shape[0] == c.batch == 3 for c in batch)
    step()


def test_spare_rows_stay_bounded_as_rows_leave(adapter):
    """Rows leaving one by one keep at most a quarter of the batch (at least 1) as spare rows
    in the buffer; past that, the rows kept are gathered into a buffer of their own."""
    rng = random.Random(5)
    alone = [adapter.make_cache() for _ in range(9)]
    for cache in alone:
        adapter.forward(mx.array([[rng.randrange(300) for _ in range(rng.randint(2, 9))]]),
                        cache)
    batch = batch_cache(alone[0])
    for b, *rows in zip(batch, *(batch_cache(c) for c in alone[1:])):
        b.extend(*rows)
    gathered = in_place = 0
    while batch[0].batch > 1:
        before = batch[0].keys.shape[0]
        for c in batch:
            c.filter(_fill(c.batch, [rng.randrange(c.batch)]))
        n = batch[0].batch
        assert all(c.keys.shape[0] - n <= max(1, n // SPARE_ROWS) for c in batch)
        gathered += batch[0].keys.shape[0] < before
        in_place += batch[0].keys.shape[0] == before
    assert gathered >= 2 and in_place >= 2          # both paths ran


def test_rows_joining_at_once_equal_rows_joining_one_by_one(adapter):
    """`extend(*rows)` (the engine's joiners of one step) builds the batch that joining them
    one by one builds, in one copy with room left: the next forward writes in place."""
    rng = random.Random(3)
    alone = [adapter.make_cache() for _ in range(4)]
    for n, cache in zip((6, 13, 2, 9), alone):
        adapter.forward(mx.array([[rng.randrange(300) for _ in range(n)]]), cache)
    one_by_one, at_once = batch_cache(alone[0]), batch_cache(alone[0])
    for cache in alone[1:]:
        for b, r in zip(one_by_one, batch_cache(cache)):
            b.extend(r)
    for b, *rows in zip(at_once, *(batch_cache(c) for c in alone[1:])):
        b.extend(*rows)
    for a, b in zip(one_by_one, at_once):
        np.testing.assert_array_equal(a.pos, b.pos)
        np.testing.assert_array_equal(a.lengths, b.lengths)
        assert a.size() == b.size() == 13
        np.testing.assert_array_equal(np.array(a.keys[..., : a.size(), :]),
                                      np.array(b.keys[..., : b.size(), :]))
    buffers = [c.keys.shape[2] for c in at_once]
    assert all(n >= 13 + 4 for n in buffers)
    x = mx.array([[rng.randrange(300) for _ in range(4)] for _ in alone])
    logits, _ = adapter.forward(x, at_once)
    assert [c.keys.shape[2] for c in at_once] == buffers      # no second copy to grow
    for i, cache in enumerate(alone):
        ref, _ = adapter.forward(x[i : i + 1], cache)
        np.testing.assert_allclose(np.array(logits[i]), np.array(ref[0]), atol=1e-4, rtol=1e-4)


def test_commit_checks_its_counts(adapter):
    batch = batch_cache(adapter.make_cache())
    with pytest.raises(ValueError, match="commit"):
        batch[0].commit([1])             # nothing was forwarded
    with pytest.raises(NotImplementedError):
        batch[0].trim(1)


def test_caches_the_batch_cannot_hold_are_refused():
    """Hybrid GatedDeltaNet targets and quantized caches are batched (test_batch_hybrid.py,
    test_kv_cache.py); a sliding window with sink rows or a chunked cache is not."""
    assert batch_refusal(tiny("qwen3_5").make_cache()) is None
    assert batch_refusal([QuantizedKVCache(64, 4)]) is None
    for cache, name in ((RotatingKVCache(8, keep=4), "RotatingKVCache"),
                        (ChunkedKVCache(8), "ChunkedKVCache")):
        assert re.search(f"{name}.*one at a time", batch_refusal([cache]))
