"""More target families: hybrid GatedDeltaNet targets (qwen3_5, qwen3_next) with exact rollback,
sliding-window attention targets (gemma3_text, llama with sliding layers) and Gemma's embedding
scale. Tiny random models built from mlx-lm's own classes."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import _get_classes

from types import SimpleNamespace

from dflash2_mlx.policy.adaptive import AdaptiveWidth, DRAFTER, FixedWidth, LOOKUP
from dflash2_mlx.policy.calibration import measure_costs
from dflash2_mlx.model.drafter import Drafter
from dflash2_mlx.decode.lookup import LookupConfig
from dflash2_mlx.decode.stats import GenerationStats
from dflash2_mlx.decode.engine import stream_tokens
from dflash2_mlx.policy.planner import Planner
from dflash2_mlx.model.sampling import Sampling
from dflash2_mlx.model.target import TargetAdapter
from fixtures import drafter_args, random_drafter
from test_exactness import OracleDrafter

V, H = 384, 64
COMMON = dict(hidden_size=H, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=V,
              max_position_embeddings=4096, tie_word_embeddings=False)
LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2)
GEMMA4 = dict(COMMON, global_head_dim=16, vocab_size_per_layer_input=V, sliding_window=6,
              layer_types=["sliding_attention", "full_attention"] * 2,
              final_logit_softcapping=30.0)
LFM2 = dict(vocab_size=V, hidden_size=H, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, norm_eps=1e-5, conv_bias=False,
            conv_L_cache=3, rope_theta=1e4, layer_types=["conv", "full_attention"] * 2)
CONFIGS = {
    "qwen3_5": dict(model_type="qwen3_5", **COMMON, **LINEAR,
                    rope_parameters={"type": "default", "rope_theta": 1e4,
                                     "partial_rotary_factor": 0.5}),
    "qwen3_next": dict(model_type="qwen3_next", **COMMON, **LINEAR, num_experts=0,
                       num_experts_per_tok=0, decoder_sparse_step=1,
                       shared_expert_intermediate_size=0, mlp_only_layers=[],
                       moe_intermediate_size=0, rope_theta=1e4, partial_rotary_factor=0.5),
    "gemma3_text": dict(model_type="gemma3_text", **COMMON, query_pre_attn_scalar=16,
                        sliding_window=6, sliding_window_pattern=2, rope_local_base_freq=1e4),
    "llama-sliding": dict(model_type="llama", **COMMON,
                          layer_types=["sliding_attention", "full_attention"] * 2,
                          sliding_window=6),
    # the targets of the published DSpark drafters (docs/cli.md's table and its left-out list)
    "qwen3_5_moe": dict(model_type="qwen3_5_moe", **COMMON, **LINEAR, num_experts=4,
                        num_experts_per_tok=2, decoder_sparse_step=1,
                        shared_expert_intermediate_size=64, moe_intermediate_size=32,
                        norm_topk_prob=True,
                        rope_parameters={"type": "default", "rope_theta": 1e4,
                                         "partial_rotary_factor": 0.5}),
    # Gemma 4: sliding and full layers, the last two reusing the first two's keys and values,
    # per-layer inputs, a soft-capped head; and the 26B's MoE block with values = keys
    "gemma4_text": dict(model_type="gemma4_text", **GEMMA4, num_kv_shared_layers=2,
                        hidden_size_per_layer_input=16),
    "gemma4_text-moe": dict(model_type="gemma4_text", **GEMMA4, num_kv_shared_layers=0,
                            hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4,
                            top_k_experts=2, moe_intermediate_size=32, attention_k_eq_v=True,
                            num_global_key_value_heads=1),
    # the multimodal wrapper the published Gemma 4 checkpoints load as (its text model here)
    "gemma4": dict(model_type="gemma4", vocab_size=V, text_config=dict(
        model_type="gemma4_text", **GEMMA4, num_kv_shared_layers=0,
        hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32, attention_k_eq_v=True, num_global_key_value_heads=1)),
    # LFM2: short-convolution layers (their state rolled back like a recurrent one) and attention
    "lfm2": dict(model_type="lfm2", **LFM2, block_dim=H, block_ff_dim=128, block_multiple_of=16,
                 block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True),
    "lfm2_moe": dict(model_type="lfm2_moe", **LFM2, intermediate_size=128,
                     moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                     norm_topk_prob=True, use_expert_bias=True, num_dense_layers=1),
    # MiniCPM: scaled embedding, residuals and logits
    "minicpm": dict(COMMON, model_type="minicpm", dim_model_base=16, scale_depth=1.4,
                    scale_emb=12.0, rope_theta=1e4),
    # Nanbeige: the layer stack run twice, each pass with its own caches
    "nanbeige": dict(model_type="nanbeige", **COMMON, rope_theta=1e4, num_loops=2),
    # Nemotron-H: Mamba-2 (M), attention (*), MoE (E) and MLP (-) blocks; only M and * have a
    # cache, so cache j is not layer j's (the last Mamba block's state is cache 2 of layer 4)
    "nemotron_h": dict(model_type="nemotron_h", vocab_size=V, hidden_size=H,
                       intermediate_size=128, max_position_embeddings=4096,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       attention_bias=False, mamba_num_heads=8, mamba_head_dim=16,
                       mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=2,
                       mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False,
                       use_conv_bias=True, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32, n_group=1, n_routed_experts=4,
                       n_shared_experts=1, topk_group=1, num_experts_per_tok=2,
                       norm_topk_prob=True, routed_scaling_factor=1.0,
                       time_step_limit=(0.0, float("inf")),
                       hybrid_override_pattern=["M", "E", "*", "-", "M"]),
}
# The embedding's scale in the fixture: one whose greedy output varies (tied heads repeat a
# token at 4)
EMBED_SCALE = {"gemma3_text": 1, "gemma4_text": 8, "gemma4_text-moe": 1, "gemma4": 1, "lfm2": 0.1,
               "lfm2_moe": 0.1, "minicpm": 1, "nanbeige": 1}
PROMPTS = [[5, 17, 99, 3, 250, 7, 42, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 200] * 2]


@pytest.fixture(scope="module", params=list(CONFIGS))
def target(request):
    cfg = CONFIGS[request.param]
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(7)
    model = model_class(args_class.from_dict(cfg))
    # Larger embeddings and untied head: the random model's greedy output varies.
    embed = TargetAdapter(model).embed_tokens
    embed.weight = embed.weight * EMBED_SCALE.get(request.param, 4)
    mx.eval(model.parameters())
    return request.param, model


def mlx_lm_greedy(model, ids, n):
    return [t for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


def test_rollback_equals_fresh_run_on_kept_rows(target):
    """After a verify of w rows keeping a+1, every layer's cache equals that of a run that only
    ever saw the kept rows (recurrent state and conv state included)."""
    name, model = target
    adapter = TargetAdapter(model, (1, 3))
    ids = mx.array([PROMPTS[1]])
    block = mx.array([[9, 80, 81, 82, 83, 84]])
    for kept in (1, 3, 6):
        cache, fresh = adapter.make_cache(), adapter.make_cache()
        adapter.forward(ids, cache)
        adapter.forward(ids, fresh)
        snap = adapter.snapshot(cache)
        adapter.forward(block, cache)
        snap.rollback(kept, block.shape[1])
        adapter.forward(block[:, :kept], fresh)
        for c, f in zip(cache, fresh):
            if hasattr(c, "cache"):                   # recurrent: conv state and ssm state
                for x, y in zip(c.cache, f.cache):
                    assert mx.allclose(x, y, atol=1e-5), (name, kept)
            else:
                assert c.offset == f.offset, (name, kept)
        # and the next forward gives the same logits from both
        nxt = mx.array([[7, 8, 9]])
        assert mx.allclose(adapter.forward(nxt, cache)[0], adapter.forward(nxt, fresh)[0],
                           atol=1e-4), (name, kept)
    if name.startswith(("qwen3", "lfm2", "nemotron_h")):
        assert adapter.recurrent, "hybrid target without recurrent layers?"
    # which layer each cache belongs to: the replay of a recurrent cache runs its own layer
    owners = {"gemma4_text": (0, 1), "nanbeige": (0, 1, 2, 3) * 2, "nemotron_h": (0, 2, 4)}
    assert adapter.owners == owners.get(name, tuple(range(4))), name


@pytest.mark.parametrize("b", [2, 5, 8])
def test_greedy_equals_mlx_lm_with_partial_acceptance(target, b):
    name, model = target
    adapter = TargetAdapter(model, (1, 3))
    for seed, ids in enumerate(PROMPTS):
        ref = mlx_lm_greedy(model, ids, 40)
        assert len(set(ref)) > 3, f"{name}: fixture target too degenerate"
        oracle = OracleDrafter(len(ids), ref, V, seed=seed + b)
        stats = GenerationStats()
        out = [t for s in stream_tokens(adapter, oracle, ids, max_tokens=40,
                                        sampling=Sampling(), planner=Planner(),
                                        policy=FixedWidth(b), stop_ids=set(),
                                        stats=stats) for t in s]
        assert out == ref, (name, b)
        assert max(stats.accepted) == b - 1 and min(stats.accepted) < b - 1


@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
def test_real_drafter_greedy_equals_mlx_lm(target, kind):
    """A DFlash 2 and a DSpark drafter (its own embedding and head, Markov and confidence
    heads, drafts from the anchor's slot: widest verify 8), alone and with lookup."""
    name, model = target
    args = drafter_args(block_size=7 if kind == "dspark" else 8, layer_ids=(1, 3),
                        dspark=kind == "dspark")
    drafter = random_drafter(args, seed=3)
    adapter = TargetAdapter(model, drafter.args.target_layer_ids)
    ids = PROMPTS[1]
    ref = mlx_lm_greedy(model, ids, 30)
    for lookup in (None, LookupConfig()):
        out = [t for s in stream_tokens(adapter, drafter, ids, max_tokens=30,
                                        sampling=Sampling(), planner=Planner(),
                                        policy=FixedWidth(8), stop_ids=set(), lookup=lookup)
               for t in s]
        assert out == ref, (name, kind, lookup)


@pytest.mark.parametrize("with_drafter", [True, False])
def test_auto_and_lookup_equal_mlx_lm(target, with_drafter):
    """`auto` and lookup drafting on every family: the cost calibration (which once asked for a
    rollback without a snapshot and crashed on hybrid targets), then the adaptive policy and a
    fixed width of 16 (twice the drafter's block size) with lookup on; lookup alone too."""
    name, model = target
    drafter = Drafter(drafter_args(block_size=8, layer_ids=(1, 3))) if with_drafter else None
    adapter = TargetAdapter(model, drafter.args.target_layer_ids if drafter else ())
    cost = measure_costs(SimpleNamespace(adapter=adapter, drafter=drafter), 16, context=16,
                         reps=1)
    assert len(cost.verify_table) == 16 and len(cost.draft_table) == (8 if drafter else 1)
    widths = {LOOKUP: 16, **({DRAFTER: 8} if drafter else {})}
    prompts = PROMPTS + [PROMPTS[0] + mlx_lm_greedy(model, PROMPTS[0], 20) + PROMPTS[0]]
    lookup_cycles = 0
    for ids in prompts:
        ref = mlx_lm_greedy(model, ids, 40)
        for policy in (AdaptiveWidth(cost, widths), FixedWidth(16)):
            stats = GenerationStats()
            out = [t for s in stream_tokens(adapter, drafter, ids, max_tokens=40,
                                            sampling=Sampling(), planner=Planner(), policy=policy,
                                            stop_ids=set(), lookup=LookupConfig(),
                                            stats=stats) for t in s]
            assert out == ref, (name, type(policy).__name__, ids)
            lookup_cycles += len(stats.drafting(LOOKUP))
    assert lookup_cycles > 0, f"{name}: the lookup never drafted"


def test_gemma_block_embedding_uses_the_targets_scale():
    cfg = CONFIGS["gemma3_text"]
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    adapter = TargetAdapter(model)
    ids = mx.array([[3, 4, 5]])
    raw = model.model.embed_tokens(ids)
    scale = mx.array(H**0.5, mx.bfloat16).astype(raw.dtype)   # what gemma3_text multiplies by
    assert mx.array_equal(adapter.embed(ids), raw * scale)
    llama = _get_classes(CONFIGS["llama-sliding"])
    plain = TargetAdapter(llama[0](llama[1].from_dict(CONFIGS["llama-sliding"])))
    assert mx.array_equal(plain.embed(ids), plain.embed_tokens(ids))


def test_sequences_batched_equal_mlx_lm_alone(target):
    """Four sequences of different lengths joining the engine at different steps (prompts
    in chunks), drafting at widths 3, 5 and 8 with partial acceptance and lookup beside: each
    equals mlx-lm's greedy output alone. A family whose caches cannot hold a batch says why at
    load and decodes one sequence at a time, still exact."""
    from fixtures import Oracles, run
    from dflash2_mlx.decode.engine import Engine, Request

    name, model = target
    adapter = TargetAdapter(model, (1, 3))
    oracles = Oracles(V)
    arrivals, refs, truths = {}, {}, {}
    specs = [(FixedWidth(3), False), (FixedWidth(8), True), (FixedWidth(5), False),
             (FixedWidth(8), False)]
    for k, (policy, lookup) in enumerate(specs):
        prompt = (PROMPTS[k % 2] * 2)[:6 + 5 * k]
        refs[k] = (mlx_lm_greedy(model, prompt, 24), "length")
        truths[k] = (len(prompt), mlx_lm_greedy(model, prompt, 40))
        arrivals.setdefault([0, 0, 2, 3][k], []).append(
            (k, Request(prompt, 24, policy=policy, lookup=lookup)))
    engine = Engine(adapter, oracles, planner=Planner(), prefill_step_size=8)
    out = run(engine, arrivals, budget=10, before_add=lambda k: oracles.expect(*truths[k]))
    for k, ref in refs.items():
        assert out[k] == ref, (name, k)
    steps = [c for s in engine.stats.values() for c in s.steps]
    assert any(c.source == "drafter" and 0 < c.accepted < c.width - 1 for c in steps), name
    widest = max(n for n, _, _ in engine.history)
    assert (widest == 1) == bool(adapter.batch_refusal()), (name, widest, adapter.batch_refusal())


def head_dim_32(name: str) -> dict:
    """CONFIGS[name] with head_dim 32 (a quantization group): set where the family reads it
    (not hidden_size / heads), else from half the heads."""
    cfg = CONFIGS[name]
    if "text_config" in cfg:
        return {**cfg, "text_config": {**cfg["text_config"], "head_dim": 32,
                                       "global_head_dim": 32}}
    if name in ("lfm2", "lfm2_moe", "minicpm"):
        return {**cfg, "num_attention_heads": 2}
    return {**cfg, "head_dim": 32, **({"global_head_dim": 32} if "global_head_dim" in cfg
                                      else {})}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kv_bits_where_the_family_takes_a_quantized_cache(name):
    """`--kv-bits` on every family: exact where mlx-lm's forward runs on its quantized cache;
    refused at load, naming kv_bits, where it does not (Gemma 4's KV-shared layers)."""
    from dflash2_mlx.model.views import KVQuant
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    cfg = head_dim_32(name)
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(7)
    model = model_class(args_class.from_dict(cfg))
    embed = TargetAdapter(model).embed_tokens
    embed.weight = embed.weight * EMBED_SCALE.get(name, 4)
    kv = KVQuant(8, 32)
    if cfg.get("num_kv_shared_layers"):
        with pytest.raises(ValueError, match="kv_bits 8: mlx-lm's 'gemma4_text' model does not"):
            TargetAdapter(model, (1, 3), kv=kv)
        return
    adapter = TargetAdapter(model, (1, 3), kv=kv)
    quantized = [QuantizedKVCache(32, 8) if type(c).__name__ == "KVCache" else c
                 for c in make_prompt_cache(model)]
    ids = PROMPTS[1]
    ref = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=24,
                                       prompt_cache=quantized)]
    assert len(set(ref)) > 2, name
    out = [t for s in stream_tokens(adapter, OracleDrafter(len(ids), ref, V, seed=1), ids,
                                    max_tokens=24, sampling=Sampling(), planner=Planner(),
                                    policy=FixedWidth(5), stop_ids=set()) for t in s]
    assert out == ref, name


def test_a_looped_stack_is_tapped_at_its_unrolled_steps():
    """Nanbeige runs its layers twice: a drafter's layer id u counts unrolled steps (loop *
    layers + layer), and its feature is the hidden state entering step u + 1, as Nanbeige's
    reference (and mlx-dspark) capture it: mid-loop a layer's output, at a loop's end the
    state after that loop's final norm. The last step has none: ids reach 2 * 4 - 2."""
    from mlx_lm.models.base import create_attention_mask

    cfg = CONFIGS["nanbeige"]
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(7)
    model = model_class(args_class.from_dict(cfg))
    taps = (1, 3, 4, 6)
    adapter = TargetAdapter(model, taps)
    assert adapter.loops == 2 and adapter.tappable == 7
    ids = mx.array([PROMPTS[0]])
    cache = adapter.make_cache()
    logits, feats = adapter.forward(ids, cache)
    # the reference loop, written out
    inner, ref_cache = model.model, adapter.make_cache()
    h = inner.embed_tokens(ids)
    mask = create_attention_mask(h, ref_cache[0])
    entering = []
    for loop in range(2):
        for j, layer in enumerate(inner.layers):
            entering.append(h)
            h = layer(h, mask, ref_cache[loop * 4 + j])
        h = inner.norm(h)
    expected = mx.concatenate([entering[u + 1] for u in taps], axis=-1)
    assert mx.array_equal(feats, expected)
    assert mx.array_equal(logits, model(ids))
    # twice more: the per-forward step count starts again each time
    for block in ([[9, 80, 81]], [[5]]):
        _, feats = adapter.forward(mx.array(block), cache)
        assert feats.shape == (1, len(block[0]), 4 * H)
    with pytest.raises(Exception, match="target_layer_ids"):
        drafter_args(layer_ids=(1, 7)).check_against_target(H, V, adapter.tappable)
    # a DSpark drafter tapping the second pass decodes exactly
    drafter = random_drafter(drafter_args(block_size=7, layer_ids=(2, 6), dspark=True), seed=3)
    adapter = TargetAdapter(model, (2, 6))
    ref = mlx_lm_greedy(model, PROMPTS[1], 24)
    out = [t for s in stream_tokens(adapter, drafter, PROMPTS[1], max_tokens=24,
                                    sampling=Sampling(), planner=Planner(),
                                    policy=FixedWidth(8), stop_ids=set()) for t in s]
    assert out == ref
