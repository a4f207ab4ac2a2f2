"""DSpark drafters (DeepSpec's packaging): the config and tensors read as published, and the
drafts our `Drafter` makes equal an independent implementation's, mlx-dspark 0.20.3 (a test
dependency, `scripts/setup.sh` installs it without its own dependencies): draft logits,
Markov-corrected logits, greedy tokens, the sampled draft distribution q and the confidence
head's outputs, over several blocks and contexts, with the drafter's own embedding and head
and with the target's. Then the engine: greedy output equal to mlx-lm's with a DSpark drafter,
with lookup beside it and batched; seeded sampling the same alone and batched (the chi-square
test of the sampled distribution is tests/test_sampling.py's `dspark` case)."""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.rope_utils import initialize_rope

import dflash2_mlx
from dflash2_mlx.loading.checkpoint import load_drafter
from dflash2_mlx.model.config import CheckpointError, DrafterArgs
from dflash2_mlx.model.drafter import Draft
from dflash2_mlx.model.sampling import Sampling
from dflash2_mlx.model.target import TargetAdapter
from fixtures import (HIDDEN, TARGET_LAYERS, VOCAB, assert_seeded_batch_equals_alone,
                      drafter_args, write_drafter)
from test_exactness import mlx_lm_greedy

pytestmark = pytest.mark.rows


def oracle_module():
    """mlx-dspark, or a skip saying why. It imports mlx-vlm for one RoPE helper that mlx-lm
    has too; where mlx-vlm is not installed that helper is lent from mlx-lm."""
    if "mlx_vlm" not in sys.modules:
        try:
            import mlx_vlm  # noqa: F401
        except ImportError:
            stub = types.ModuleType("mlx_vlm.models.rope_utils")
            stub.initialize_rope = initialize_rope
            sys.modules["mlx_vlm"] = types.ModuleType("mlx_vlm")
            sys.modules["mlx_vlm.models"] = types.ModuleType("mlx_vlm.models")
            sys.modules["mlx_vlm.models.rope_utils"] = stub
    return pytest.importorskip("mlx_dspark.load", reason="mlx-dspark (the DSpark oracle) is not "
                               "installed: pip install --no-deps mlx-dspark==0.20.3")


OWN = dict(own_embed=True, own_head=True)
CASES = {   # name: (the drafter's shape, its packaging)
    "own-heads": (dict(OWN, logits_start=0, markov_rank=16), "DeepSpec"),
    "target-heads": (dict(own_embed=False, own_head=False, logits_start=0, markov_rank=16),
                     "DeepSpec"),
    "slot-1": (dict(OWN, logits_start=1, markov_rank=16), "DeepSpec"),
    "no-markov": (dict(OWN, logits_start=0, markov_rank=0, confidence_with_markov=False),
                  "DeepSpec"),
    # NVIDIA's DFlash-lineage head: a causal block, a sliding window that bites (12 < the
    # 17 context rows), a sink logit per head, the target's head, predictions from slot 1
    "lineage": (dict(own_embed=True, own_head=False, logits_start=1, markov_rank=16,
                     is_causal=True, sliding_window=12, attention_sinks=True,
                     layer_types=("sliding_attention",) * 2), "DeepSpec"),
    # speculators: a reduced draft vocabulary (d2t) and the first slot from its proposal
    "speculators": (dict(OWN, logits_start=1, markov_rank=16, draft_vocab_size=200),
                    "speculators"),
    "speculators-swa": (dict(OWN, logits_start=0, markov_rank=16, is_causal=True,
                             sliding_window=12, layer_types=("sliding_attention",) * 2),
                        "speculators"),
    "specforge": (dict(OWN, logits_start=0, markov_rank=16), "SpecForge"),
    "liquidai": (dict(OWN, logits_start=0, markov_rank=16, rope_traditional=True), "LiquidAI"),
    # a qwen3_5-flavoured backbone: gated q_proj, norms stored as offsets from one, half the
    # head's dimensions roped
    "qwen3_5": (dict(OWN, logits_start=0, markov_rank=16, gated_q=True, norm_offset=True,
                     rope_dims=8), "DeepSpec"),
    # Gemma 4's layer: values are the normed keys over one KV head, sandwich norms scaled per
    # layer, a GELU MLP, a proportional rope over a quarter of each head, logits capped at 30
    "gemma4": (dict(OWN, logits_start=0, markov_rank=16, backbone="gemma4", k_eq_v=True,
                    head_dim=32, num_key_value_heads=1, final_logit_softcapping=30.0,
                    rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25}),
               "DeepSpec"),
}


@pytest.fixture(scope="module")
def target(llama_dir):
    from mlx_lm.utils import load

    return TargetAdapter(load(str(llama_dir))[0], (0, 2))


def write(tmp_path, case: str, seed: int = 3):
    shape, packaging = CASES[case]
    args = drafter_args(dspark=True, block_size=7, **shape)
    folder = write_drafter(tmp_path / case, args, seed=seed, dtype=mx.float32,
                           packaging=packaging)
    if case == "slot-1":              # DeepSpec says it with `sample_from_anchor: false`
        cfg = json.loads((folder / "config.json").read_text())
        del cfg["logits_start"]
        cfg["sample_from_anchor"] = False
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def ours(folder, target: TargetAdapter):
    return load_drafter(folder, hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=TARGET_LAYERS)


def theirs(folder, target: TargetAdapter):
    load = oracle_module()
    drafter, _ = load.load_drafter(str(folder), quantize=False)
    drafter.bind_embed(target.embed)
    drafter.bind_lm_head(target.head)
    return drafter


@pytest.mark.parametrize("case", list(CASES))
def test_drafts_equal_mlx_dspark(case, tmp_path, target):
    """Three blocks, each after new context rows (a prompt of 9 rows, then 3 and 5 accepted
    rows): the draft logits, the Markov-corrected logits, the greedy drafts, the sampled
    draft's q (teacher-forced: their q given our tokens) and the confidences equal
    mlx-dspark's within float32 rounding."""
    folder = write(tmp_path, case)
    mine, ref = ours(folder, target), theirs(folder, target)
    args, shape = mine.args, CASES[case][0]
    assert {k: getattr(args, k) for k in shape} == shape    # read back as written
    rng = np.random.default_rng(5)
    F = len(args.target_layer_ids) * HIDDEN
    cache, ctx, offset = mine.make_cache(), ref.make_ctx_cache(), 0
    sample_cache = mine.make_cache()
    width = args.max_width
    for rows, anchor in ((9, 17), (3, 201), (5, 64)):
        feats = mx.array(rng.standard_normal((1, rows, F)).astype(np.float32))
        ref.update_context(feats, ctx_offset=offset, ctx_caches=ctx)
        offset += rows
        a = mx.array([[anchor]], dtype=mx.uint32)
        # ours: the block's rows, logits, greedy drafts and confidences
        drafts = [Draft(a, feats, cache, width, Sampling(), mx.random.key(0))]
        greedy = mine.propose_batch(target, drafts)[0]            # reads the new rows
        h, logits = mine.block_logits(target, [drafts[0]._replace(feats=None)])
        # theirs
        block = ref.embed(mx.array([[anchor] + [args.mask_token_id] * (args.block_size - 1)]))
        hh = ref.head_slice(ref.backbone(block, offset, ctx), args.max_drafts)
        base = ref.compute_logits(hh)[0]
        close = lambda x, y: np.testing.assert_allclose(np.array(x), np.array(y),  # noqa
                                                        rtol=2e-4, atol=2e-4)
        close(logits[0], base)
        tokens = ref.sample_block(base, first_prev_token=anchor).astype(mx.uint32)
        assert greedy.tokens[0].tolist() == tokens.tolist()
        prev = mx.concatenate([mx.array([anchor]), tokens[:-1]])
        if args.markov_rank:
            corrected = base + ref.markov_head.step_bias(prev)
            close(logits[0] + mine.markov_head(prev), corrected)
        if args.draft_vocab_size:
            assert set(greedy.tokens[0].tolist()) <= set(mine.draft_vocab.ids.tolist())
        close(greedy.confidence[0], mx.sigmoid(ref.confidence_logits(hh[0], prev)))
        # sampled at T = 1.0 (no truncation: both truncate the same way only then)
        sampled = mine.propose(target, a, feats, sample_cache, width, Sampling(1.0),
                               mx.random.key(anchor))
        drawn = sampled.tokens[0]
        before = mx.concatenate([mx.array([anchor]), drawn[:-1].astype(mx.int32)])
        step = base + (ref.markov_head.step_bias(before) if args.markov_rank else 0)
        close(sampled.dense_q(VOCAB)[0], ref.widen_to_target(mx.softmax(step, axis=-1)))
        close(sampled.confidence[0], mx.sigmoid(ref.confidence_logits(hh[0], before)))


def test_a_markov_head_changes_the_drafts(tmp_path, target):
    """The fixture's Markov bias is large enough to matter: drafts without it differ (so the
    oracle test above would see a drafter that ignored it)."""
    mine = ours(write(tmp_path, "own-heads"), target)
    feats = mx.random.normal((1, 6, len(mine.args.target_layer_ids) * HIDDEN))
    drafts = [Draft(mx.array([[5]], dtype=mx.uint32), feats, mine.make_cache(),
                    mine.args.max_width, Sampling(), mx.random.key(0))]
    _, logits = mine.block_logits(target, drafts)
    assert mine.propose_batch(target, drafts)[0].tokens[0].tolist() != \
        mx.argmax(logits[0], axis=-1).tolist()


def test_config_defaults_translations_and_refusals(tmp_path):
    """DeepSpec's defaults where a key is absent; the speculators layout's first slot from its
    proposal width; what cannot be read is refused, naming the file and the key."""
    cfg = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": 64,
           "vocab_size": 100, "num_hidden_layers": 1, "intermediate_size": 128,
           "num_attention_heads": 8, "block_size": 7, "mask_token_id": 99,
           "target_layer_ids": [0, 2]}
    a = DrafterArgs.from_dict(cfg)
    assert (a.is_dspark, a.logits_start, a.markov_rank, a.confidence_head,
            a.confidence_with_markov, a.num_key_value_heads, a.max_width, a.is_causal) == \
        (True, 0, 256, True, True, 8, 8, False)
    b = DrafterArgs.from_dict({**cfg, "sample_from_anchor": False, "markov_rank": 0,
                               "rope_is_neox_style": False, "attention_bias": True,
                               "draft_vocab_size": 100})
    assert (b.logits_start, b.markov_rank, b.confidence_with_markov, b.rope_traditional,
            b.attention_bias, b.max_width, b.draft_vocab_size) == (1, 0, False, True, True, 7,
                                                                    None)
    spec = {"speculators_model_type": "dspark", "block_size": 8, "mask_token_id": 99,
            "aux_hidden_state_layer_ids": [1, 3],
            "transformer_layer_config": {k: cfg[k] for k in (
                "hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads")},
            "speculators_config": {"proposal_methods": [{"speculative_tokens": 8}]}}
    c = DrafterArgs.from_dict(spec)
    assert (c.logits_start, c.target_layer_ids, c.num_key_value_heads, c.max_width) == \
        (0, (1, 3), 8, 9)
    spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 7
    assert DrafterArgs.from_dict(spec).logits_start == 1
    for bad, match in (({**spec, "speculators_model_type": "eagle3"}, "algorithm 'eagle3'"),
                       ({k: v for k, v in spec.items() if k != "aux_hidden_state_layer_ids"},
                        "missing key 'aux_hidden_state_layer_ids'"),
                       ({**cfg, "logits_start": 7}, "'logits_start' must be a block slot 0..6"),
                       ({**cfg, "draft_vocab_size": 120}, "'draft_vocab_size' must be below")):
        with pytest.raises(CheckpointError, match=f"x/config.json: .*{match}"):
            DrafterArgs.from_dict(bad, source="x/config.json")


def test_heads_a_checkpoint_does_not_ship_are_not_expected(tmp_path, target):
    """DeepSeek's DFlash drafters (`dflash_*_block7`) are DSpark models trained without the
    heads: a config that does not say so (DeepSpec's defaults turn both on) still loads, from
    what the tensors hold, and drafts without them."""
    args = drafter_args(dspark=True, block_size=7, markov_rank=0, confidence_head=False,
                        confidence_with_markov=False)
    folder = write_drafter(tmp_path / "d", args, dtype=mx.float32)
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("markov_rank", "enable_confidence_head", "confidence_head_with_markov"):
        cfg.pop(key)
    (folder / "config.json").write_text(json.dumps(cfg))
    d = ours(folder, target)
    assert (d.args.markov_rank, d.has_confidence) == (0, False)
    draft = Draft(mx.array([[5]], dtype=mx.uint32), mx.random.normal((1, 4, 2 * HIDDEN)),
                  d.make_cache(), 8, Sampling(), mx.random.key(0))
    p = d.propose_batch(target, [draft])[0]
    assert p.tokens.shape == (1, 7) and p.confidence is None


def test_a_reduced_vocabulary_needs_its_table(tmp_path, target):
    """`draft_vocab_size` without `d2t` in the weights, or a table that maps outside the
    vocabulary: refused at load, naming the folder."""
    folder = write(tmp_path, "speculators")
    weights = mx.load(str(folder / "model.safetensors"))
    d2t = weights.pop("d2t")
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(CheckpointError, match="weights hold no 'd2t' table"):
        ours(folder, target)
    mx.save_safetensors(str(folder / "model.safetensors"), {**weights, "d2t": d2t + 400})
    with pytest.raises(CheckpointError, match=f"{folder}: 'd2t' must map 200 draft ids"):
        ours(folder, target)


@pytest.fixture(scope="module")
def dspark_dir(tmp_path_factory):
    return write_drafter(tmp_path_factory.mktemp("dspark") / "d",
                         drafter_args(dspark=True, block_size=7), seed=4)


@pytest.fixture(scope="module")
def dspark_pipe(llama_dir, dspark_dir):
    return dflash2_mlx.load(str(llama_dir), str(dspark_dir))


def test_greedy_equals_mlx_lm_with_a_dspark_drafter(dspark_pipe):
    """Fixed widths up to the widest (8: 7 drafts from slot 0), `auto`, lookup beside the
    drafter, and a batch: each equals mlx-lm's greedy output; the drafts came from the drafter
    and carried confidences."""
    pipe = dspark_pipe
    assert pipe.drafter.has_confidence and pipe.drafter.args.max_width == 8
    prompts = ["def add(a, b):", "Once upon a time", "1, 2, 3, 4, 1, 2, 3,"]
    stop = pipe.tokenizer.eos_token_ids
    refs = [mlx_lm_greedy(pipe.target, pipe.encode(p), 24, stop) for p in prompts]
    for b in (2, 5, 8, "auto"):
        for lookup in (False, True):
            g = pipe.generate(prompts[0], max_tokens=24, block_size=b, lookup=lookup)
            assert g.tokens == refs[0], (b, lookup)
    g = pipe.generate(prompts[2], max_tokens=24, block_size=8)
    assert g.tokens == refs[2] and "drafter" in {c.source for c in g.stats.steps}
    gens = pipe.generate_batch(prompts, max_tokens=24, block_size=8)
    assert [g.tokens for g in gens] == refs


def test_seeded_sampling_is_the_same_alone_and_batched(dspark_pipe):
    """Each sequence's Markov draws use its own key, split per position: batched, a sequence
    samples what it samples alone."""
    engine = assert_seeded_batch_equals_alone(dspark_pipe.adapter, dspark_pipe.drafter, 16)
    assert engine.solo_why is None


def test_quantized_dspark_weights_load_and_stay_exact(llama_dir, tmp_path):
    """4-bit drafter weights (the confidence head kept in float: one output row), stored and
    read back; greedy output still mlx-lm's."""
    folder = write_drafter(tmp_path / "d", drafter_args(dspark=True, block_size=7,
                                                        markov_rank=64), seed=4)
    pipe = dflash2_mlx.load(str(llama_dir), str(folder), draft_bits=4)
    assert type(pipe.drafter.confidence_head.proj).__name__ == "Linear"
    assert type(pipe.drafter.markov_head.markov_w2).__name__ == "QuantizedLinear"
    ids = pipe.encode("def add(a, b):")
    assert pipe.generate(ids, max_tokens=16, block_size=8).tokens == \
        mlx_lm_greedy(pipe.target, ids, 16, pipe.tokenizer.eos_token_ids)


def test_a_drafter_without_a_confidence_head_says_so(tmp_path, target):
    folder = write_drafter(tmp_path / "d", drafter_args(dflash2=False), seed=1)
    d = ours(folder, target)
    assert not d.has_confidence
    drafts = [Draft(mx.array([[5]], dtype=mx.uint32), None, d.make_cache(), 4, Sampling(),
                    mx.random.key(0))]
    d.skip_context(drafts[0].cache, 3)
    assert d.propose_batch(SimpleNamespace(embed=target.embed, head=target.head),
                           drafts)[0].confidence is None


def test_a_dspark_drafter_with_the_prefix_cache_kv_bits_and_omlx_settings(dspark_pipe,
                                                                          dspark_dir,
                                                                          fixture_dir):
    """What a DFlash 2 drafter does, a DSpark one does: a prefix-cache hit (the drafter's
    context state copied and trimmed with the target's) generates what a fresh run does,
    greedy and seeded; an 8-bit KV cache and oMLX settings naming it keep greedy output
    mlx-lm's."""
    from dflash2_mlx import OmlxSettings
    from dflash2_mlx.cache.prompt import PromptCache
    from dflash2_mlx.decode.state import DecodeState
    from dflash2_mlx.testing import write_target

    pipe = dspark_pipe
    a = pipe.encode("def add(a, b):")
    state = DecodeState.new(pipe.adapter, pipe.drafter)
    first = pipe.generate(a, max_tokens=12, block_size=8, state=state)
    cache = PromptCache(max_entries=2)
    cache.insert(state)
    follow = a + first.tokens + pipe.encode("for i in range(3):")
    got, common = cache.fetch(follow)
    assert common == len(state.tokens) and got.dcache is not None
    for options in ({}, {"temperature": 1.0, "seed": 3}):
        want = pipe.generate(follow, max_tokens=12, block_size=8, **options)
        hit = pipe.generate(follow, max_tokens=12, block_size=8, state=got.copy(), **options)
        assert hit.tokens == want.tokens and hit.stats.cached_tokens == common
    target = write_target(fixture_dir / "llama-hd64-dspark", "llama", seed=0, head_dim=64)
    kv = dflash2_mlx.load(str(target), str(dspark_dir), kv_bits=8, kv_group_size=32)
    settings = OmlxSettings(model_id="m", source="f.json", enabled=True,
                            draft_model=str(dspark_dir), block_size=8)
    omlx = dflash2_mlx.load(str(target), settings=settings)
    assert omlx.drafter.args.is_dspark and omlx.describe()["block_size"] == 8
    ids = kv.encode("Once upon a time")
    ref = mlx_lm_greedy(kv.target, ids, 20, kv.tokenizer.eos_token_ids)
    # (mlx-lm's greedy output on its own 8-bit cache is the reference for the quantized run)
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
    quantized = [QuantizedKVCache(32, 8) if type(c) is KVCache else c
                 for c in make_prompt_cache(kv.target)]
    stop = set(kv.tokenizer.eos_token_ids)
    ref_q = []
    for t, _ in generate_step(mx.array(ids), kv.target, max_tokens=20, prompt_cache=quantized):
        ref_q.append(t)
        if t in stop:
            break
    g = kv.generate(ids, max_tokens=20, block_size=8)
    assert g.tokens == ref_q
    # (speculates where the load-time row check allows it on this backend)
    assert kv.plain_why is not None or "drafter" in {c.source for c in g.stats.steps}
    assert omlx.generate(ids, max_tokens=20).tokens == ref
