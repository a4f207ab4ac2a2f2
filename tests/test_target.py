"""The target adapter reproduces the model's own logits and captures the right hidden states,
without altering the model object or mlx-lm's classes."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes

from dflash2_mlx.model.target import TargetAdapter
from fixtures import target_config

FAMILIES = {
    "llama": {},
    "mistral": {},                                     # mlx-lm maps it onto llama
    "qwen2": {},
    "qwen3": {},
    "llama-sliding": dict(layer_types=["sliding_attention", "full_attention"] * 2,
                          sliding_window=8),
    "llama-tied": dict(tie_word_embeddings=True),
}


def build(name):
    family = name.split("-")[0]
    cfg = target_config(family, **FAMILIES[name])
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(len(name))
    model = model_class(args_class.from_dict(cfg))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_equal_model_call_and_features_are_layer_outputs(name):
    model = build(name)
    layers = model.model.layers
    layer_list_before, layer_objs_before = id(layers), list(layers)
    call_before = type(layers[0]).__call__
    adapter = TargetAdapter(model, (0, 2, 3))
    ids = mx.array([[5, 17, 99, 3, 250, 7, 42, 11, 8, 300, 2, 64]])

    # Two steps through caches, like prefill then a verify block.
    ref_cache, cache = make_prompt_cache(model), adapter.make_cache()
    for chunk in (ids[:, :9], ids[:, 9:]):
        ref = model(chunk, cache=ref_cache)
        logits, feats = adapter.forward(chunk, cache)
        assert mx.array_equal(logits, ref), name
        assert feats.shape == (1, chunk.shape[1], 3 * adapter.hidden_size)

    # Features: the outputs of layers 0, 2 and 3, recomputed by hand without a cache.
    h, outs = model.model.embed_tokens(ids), []
    mask = "causal"
    for i, layer in enumerate(layers):
        if getattr(layer, "use_sliding", False):
            from mlx_lm.models.base import create_causal_mask
            h = layer(h, create_causal_mask(ids.shape[1], window_size=8), None)
        else:
            h = layer(h, mask, None)
        outs.append(h)
    _, feats = adapter.forward(ids, None)
    expected = mx.concatenate([outs[0], outs[2], outs[3]], axis=-1)
    assert mx.allclose(feats, expected, atol=1e-5), name

    # Nothing about the user's model or mlx-lm's classes changed.
    assert id(model.model.layers) == layer_list_before
    assert all(a is b for a, b in zip(model.model.layers, layer_objs_before))
    assert type(layers[0]).__call__ is call_before
    assert mx.array_equal(model(ids), adapter.forward(ids, None)[0])


def test_embed_and_head_are_the_targets():
    for name in ("llama", "llama-tied"):
        model = build(name)
        adapter = TargetAdapter(model, (1,))
        ids = mx.array([[1, 2, 3]])
        h = model.model(ids)
        assert mx.array_equal(adapter.head(h), model(ids))
        assert mx.array_equal(adapter.embed(ids), model.model.embed_tokens(ids))
        assert adapter.vocab_size == 384 and adapter.num_layers == 4


def test_finds_stack_or_explains():
    with pytest.raises(ValueError, match="cannot find the decoder layers"):
        import mlx.nn as nn
        TargetAdapter(nn.Linear(2, 2))


@pytest.mark.parametrize("name,cut", [("llama-sliding", 1), ("qwen3_5", 1), ("qwen3_5", 2)])
def test_layer_ranges_relayed_into_each_other_are_the_model(name, cut):
    """What two pipeline ranks run, in one process: layers [0, cut) relay their hidden state to
    a view of [cut, L) (which starts from it and stops at its end). Logits, features and
    rollbacks on both ranges equal the whole target's; mask indices are recomputed per range
    (qwen3_5: layer 0 is linear attention only, so the first range has no full-attention
    layer)."""
    from dflash2_mlx.model.views import Incoming, LayerRange, StandIn, run_to_stand_in, stop
    from test_families import CONFIGS

    cfg = CONFIGS[name]
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(3)
    model = model_class(args_class.from_dict(cfg))
    whole = TargetAdapter(model, (0, 3))
    L = whole.num_layers
    first, second = LayerRange(whole, 0, cut, (0, 3)), LayerRange(whole, cut, L, (0, 3))
    caches = first.make_cache(), second.make_cache()
    incoming = Incoming()
    tail = second.view(end=StandIn(whole.layers[L - 1], stop), embed=incoming)

    def relay(x):
        incoming.x = x
        return run_to_stand_in(tail, mx.zeros(x.shape[:2], dtype=mx.uint32),
                               list(caches[1]) + [None])

    head = first.view(end=StandIn(whole.layers[cut - 1], relay))
    ref_cache = whole.make_cache()
    ids = mx.array([[5, 17, 99, 3, 250, 7, 42, 11, 8, 300, 2, 64]])
    block, after = mx.array([[9, 80, 81, 82, 83]]), mx.array([[7, 8, 9]])
    for step, chunk in enumerate((ids, block, after)):
        if step == 1:                             # a verify of 5 rows keeping 2
            snaps = first.snapshot(caches[0]), second.snapshot(caches[1])
            ref_snap = whole.snapshot(ref_cache)
        logits = head(chunk, cache=list(caches[0]) + [None])
        ref, ref_feats = whole.forward(chunk, ref_cache)
        assert mx.array_equal(logits, ref), (name, cut, step)
        feats = {**first.outputs, **second.outputs}
        assert mx.array_equal(mx.concatenate([feats[0], feats[3]], axis=-1), ref_feats)
        if step == 1:
            for snap in snaps + (ref_snap,):
                snap.rollback(2, block.shape[1])
    assert [c.offset for c in caches[0] + caches[1] if c.is_trimmable()] == \
        [c.offset for c in ref_cache if c.is_trimmable()]


def test_the_adapter_is_a_target():
    from dflash2_mlx.model.target import Target

    assert isinstance(TargetAdapter(build("llama"), (1,)), Target)
