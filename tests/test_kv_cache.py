"""The target's quantized KV cache (`kv_bits`, `kv_group_size`): greedy output equal to mlx-lm's
`generate_step` with `QuantizedKVCache(group_size, bits)` from token 0 on the full-attention
layers (every source and width; dense, sliding-window and hybrid GatedDeltaNet targets), seeded
sampling alone and batched, the sampling distribution, batched rows that move the quantized
triples without requantizing them, the prefix cache in RAM and on disk, bytes per token against
the formula, and bad settings refused."""

from __future__ import annotations

import functools
import json
import random
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from mlx_lm.utils import _get_classes

import dflash2_mlx
from dflash2_mlx import settings
from dflash2_mlx.model.row_caches import RaggedKVCache, RaggedQuantizedKVCache, SoloRows
from dflash2_mlx.cache.prompt import PromptCache
from dflash2_mlx.decode.engine import Engine, Request, stream_tokens
from dflash2_mlx.policy.planner import Planner
from dflash2_mlx.decode.row_check import check_rows
from dflash2_mlx.decode.lookup import LookupConfig
from dflash2_mlx.model.sampling import Sampling
from dflash2_mlx.decode.state import DecodeState, cache_nbytes, prefill
from dflash2_mlx.loading.omlx import OmlxSettingsError, parse_entry
from dflash2_mlx.model.drafter import Drafter
from dflash2_mlx.model.target import KVQuant, TargetAdapter
from dflash2_mlx.model.views import kv_bytes_per_token
from dflash2_mlx.policy.adaptive import DRAFTER, LOOKUP, AdaptiveWidth, FixedWidth
from dflash2_mlx.policy.calibration import grow_cache, measure_costs
from fixtures import (Oracles, assert_seeded_batch_equals_alone, drafter_args, random_drafter,
                      random_prompt, run, write_target)
from test_cli import run as cli
from test_disk_cache import Model, files
from test_exactness import OracleDrafter
from test_families import COMMON, CONFIGS, PROMPTS

pytestmark = pytest.mark.rows

KV = KVQuant(4, 64)           # 4-bit: the oracle's output differs from float on every family
HEAD_DIM = 64                 # divisible by every group size the tests use
V = COMMON["vocab_size"]
N = 40                        # tokens per greedy run


@functools.lru_cache(maxsize=None)
def quant_model(name: str):
    """A tiny random target of test_families' configs with head_dim 64 (plain llama: dense)."""
    cfg = {**(CONFIGS.get(name) or dict(model_type="llama", **COMMON)), "head_dim": HEAD_DIM}
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(7)
    model = model_class(args_class.from_dict(cfg))
    embed = TargetAdapter(model).embed_tokens
    embed.weight = embed.weight * 4              # a random model whose greedy output varies
    mx.eval(model.parameters())
    return model


def oracle_cache(model, kv: KVQuant | None) -> list:
    """mlx-lm's cache for `model`, with `QuantizedKVCache` on its full-attention layers."""
    return [QuantizedKVCache(kv.group_size, kv.bits) if kv and type(c) is KVCache else c
            for c in make_prompt_cache(model)]


def oracle(model, ids, n, kv: KVQuant | None = KV) -> list[int]:
    """mlx-lm's greedy continuation with the quantized cache from token 0."""
    return [t for t, _ in generate_step(mx.array(ids), model, max_tokens=n,
                                        prompt_cache=oracle_cache(model, kv))]


def tokens(adapter, drafter, ids, n, policy, lookup=False, **kw) -> list[int]:
    return [t for s in stream_tokens(adapter, drafter, ids, max_tokens=n, sampling=Sampling(),
                                     planner=Planner(), policy=policy, stop_ids=set(),
                                     lookup=LookupConfig() if lookup else None, **kw) for t in s]


# --------------------------------------------------------------------------- greedy exactness

@pytest.mark.parametrize("name", [pytest.param("llama", marks=pytest.mark.slow),  # 10 s
                                  pytest.param("llama-sliding", marks=pytest.mark.slow),  # 8 s
                                  "qwen3_5"])
def test_greedy_equals_the_quantized_oracle(name):
    """Plain decoding, forced partial acceptances at widths 4, 8 and 16, a real drafter, lookup
    alone and `auto` (costs calibrated on the quantized caches) all equal mlx-lm with
    QuantizedKVCache from token 0; the sliding-window and recurrent layers keep their caches."""
    model = quant_model(name)
    adapter = TargetAdapter(model, (1, 3), kv=KV)
    kinds = {type(c).__name__ for c in adapter.make_cache()}
    assert "QuantizedKVCache" in kinds and "KVCache" not in kinds
    assert kinds - {"QuantizedKVCache"} == {"llama": set(), "llama-sliding":
                                           {"RollbackRotatingKVCache"},
                                           "qwen3_5": {"ArraysCache"}}[name]
    drafter = Drafter(drafter_args(block_size=8, layer_ids=(1, 3)))
    assert all(type(c).__name__ != "QuantizedKVCache" for c in drafter.make_cache())
    cost = measure_costs(SimpleNamespace(adapter=adapter, drafter=drafter), 16, context=16,
                         reps=1)
    prompts = PROMPTS + [PROMPTS[0] + oracle(model, PROMPTS[0], 12) + PROMPTS[0]]
    differs = False
    for seed, ids in enumerate(prompts):
        ref = oracle(model, ids, N)
        differs |= ref != oracle(model, ids, N, kv=None)
        runs = {"plain": tokens(adapter, None, ids, N, FixedWidth(1)),
                "drafter": tokens(adapter, drafter, ids, N, FixedWidth(8)),
                "lookup": tokens(adapter, None, ids, N, FixedWidth(16), lookup=True),
                "auto": tokens(adapter, drafter, ids, N,
                               AdaptiveWidth(cost, {DRAFTER: 8, LOOKUP: 16}), lookup=True)}
        for b in (4, 8, 16):
            runs[f"width {b}"] = tokens(adapter, OracleDrafter(len(ids), ref, V, seed=seed + b),
                                        ids, N, FixedWidth(b))
        for what, out in runs.items():
            assert out == ref, (name, what, seed)
    assert differs, f"{name}: 4-bit output never differs from float: nothing was tested"


@pytest.fixture(scope="module")
def kv_pipe(fixture_dir, dflash2_dir):
    """The API on a dense target of head_dim 64, 8-bit KV cache in groups of 32."""
    folder = write_target(fixture_dir / "llama-hd64", "llama", seed=0, head_dim=HEAD_DIM)
    return dflash2_mlx.load(str(folder), str(dflash2_dir), kv_bits=8, kv_group_size=32)


class RowExact:
    """A pipeline's target whose every forward runs one token of one sequence at a time: a
    verify's rows are plain steps, and a batch (`batch_rows`: `LoopRows`) is its sequences
    stepped each in its own caches. Its multi-row results are its single-row ones bit for bit
    by construction, whatever the machine's BLAS does with several rows."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):         # `batch_why` lands on the real target
        if name == "inner":
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def forward(self, tokens, cache):
        rows = cache.rows if isinstance(cache, LoopCache) else [cache]
        out = [self.inner.forward(tokens[b : b + 1, t : t + 1], c)
               for b, c in enumerate(rows) for t in range(tokens.shape[1])]
        T = tokens.shape[1]
        logits = mx.concatenate([mx.concatenate([lg for lg, _ in out[b * T:(b + 1) * T]], 1)
                                 for b in range(len(rows))])
        feats = (None if out[0][1] is None else mx.concatenate(
            [mx.concatenate([f for _, f in out[b * T:(b + 1) * T]], 1) for b in range(len(rows))]))
        return logits, feats

    def batch_refusal(self):
        return self.inner.batch_why

    def batch_rows(self):
        return LoopRows()

    def snapshot(self, cache):
        return None if isinstance(cache, LoopCache) else self.inner.snapshot(cache)


class LoopCache(list):
    """`LoopRows.cache`: each row's own caches (attention layers: they roll back by trimming)."""

    @property
    def rows(self):
        return list(self)


class LoopRows:
    """A batch as the engine's row set (`model.row_caches.RaggedRows`' protocol) whose rows stay
    single sequences' caches, stepped one at a time by `RowExact.forward`."""

    def __init__(self):
        self.cache = LoopCache()

    def join(self, states):
        for s in states:
            self.cache.append(s.cache)
            s.cache = None

    def slots(self):
        return max(c.offset for row in self.cache for c in row)

    def kept(self, keep, total, snapshot=None):
        for row, k in zip(self.cache, keep):
            for c in row:
                c.trim(total - k)

    def release(self, row, state):
        state.cache = self.cache[row]

    def release_bytes(self, row):
        return 0

    def filter(self, stay):
        self.cache = LoopCache(self.cache[i] for i in stay)


class RowVariant(RowExact):
    """`RowExact`, but its forwards over several rows (`axis` 1: a verify's; 0: a batch's)
    differ from single steps in the last bits, as float32 BLAS may on a CPU."""

    def __init__(self, inner, axis: int):
        super().__init__(inner)
        object.__setattr__(self, "axis", axis)

    def forward(self, tokens, cache):
        logits, feats = super().forward(tokens, cache)
        return (logits + 1e-5 if tokens.shape[self.axis] > 1 else logits), feats


class StepByStep:
    """mlx-lm's view of a `RowExact` target: the model called one token at a time (the oracle
    for a pipeline on `RowExact`: its prefill too runs a token at a time)."""

    def __init__(self, model):
        self.model, self.layers = model, model.layers

    def __call__(self, inputs, cache=None, **kw):
        return mx.concatenate([self.model(inputs[:, t : t + 1], cache=cache, **kw)
                               for t in range(inputs.shape[1])], axis=1)


def followed(pipe, prompts, refs, max_tokens):
    """The decision `check_rows` made is said and followed, and greedy output is the oracle's
    whichever it was: decoding plain where a verify's rows are not plain steps, one sequence at
    a time where a batch's are not."""
    d = pipe.describe()
    g = pipe.generate(prompts[0], max_tokens=max_tokens, block_size=8, lookup=True)
    assert g.tokens == refs[0]
    if pipe.plain_why is not None:
        assert d["plain"] == pipe.plain_why and "a forward of 8 rows gave logits" in pipe.plain_why
        assert {c.source for c in g.stats.steps} == {"plain"}
    else:
        assert "plain" not in d
    engine = pipe.engine(4)
    assert isinstance(engine.caches, SoloRows) == (engine.solo_why is not None)
    if engine.solo_why is not None:
        assert "2 sequences stepped as a batch gave logits" in engine.solo_why
    gens = pipe.generate_batch(prompts, max_tokens=max_tokens, block_size=8)
    assert [g.tokens for g in gens] == refs


@pytest.mark.parametrize("axis", [1, 0])
def test_rows_that_differ_from_plain_steps_turn_speculation_or_batching_off(
        axis, fixture_dir, dflash2_dir):
    """With a quantized cache, the row check's two answers, each on a target whose behaviour is
    known by construction (not by the BLAS): on `RowExact` (every row a plain step) it lets the
    pipeline speculate and batch; with a verify's (axis 1) or a batch's (axis 0) rows moved by
    1e-5, it finds them at load and the pipeline decodes plain, or one sequence at a time, and
    says why. Greedy output is the oracle's every time."""
    folder = write_target(fixture_dir / "llama-hd64", "llama", seed=0, head_dim=HEAD_DIM)
    pipe = dflash2_mlx.load(str(folder), str(dflash2_dir), kv_bits=8, kv_group_size=32)
    real = pipe.adapter
    prompts = [pipe.encode("def add(a, b):"), pipe.encode("Hello! How can I help?")]
    refs = [oracle(StepByStep(pipe.target), ids, 12, kv=KVQuant(8, 32)) for ids in prompts]

    pipe.adapter = RowExact(real)
    pipe.check_rows()
    assert pipe.plain_why is None and pipe.engine(4).solo_why is None
    g = pipe.generate(prompts[0], max_tokens=12, block_size=8, lookup=True)
    assert g.tokens == refs[0] and {c.source for c in g.stats.steps} - {"plain"}   # speculated
    engine = pipe.engine(4)
    gens = pipe.generate_batch(prompts, max_tokens=12, block_size=8)
    assert [g.tokens for g in gens] == refs and isinstance(engine.caches, LoopRows)

    pipe.adapter = RowVariant(real, axis)
    pipe.check_rows()
    if axis == 1:
        assert "8-bit, group size 32: a forward of 8 rows gave logits up to" in pipe.plain_why
        assert pipe.engine(4).solo_why is None
    else:
        assert pipe.plain_why is None
        assert "2 sequences stepped as a batch" in pipe.engine(4).solo_why
    followed(pipe, prompts, refs, 12)


def test_a_quantized_target_speculates_exactly_where_its_rows_allow():
    """Quantized weights and a quantized cache: whatever the row check finds on this backend
    (MLX's CPU quantized kernels give a row the same bits alone or among others, a Mac's GPU
    kernels may not), speculative greedy output is the oracle's, and where a verify's rows were
    found to differ the target decodes plain (the decision `Pipeline.check_rows` follows)."""
    model = quant_model("llama")
    nn.quantize(model, group_size=32, bits=4)
    adapter = TargetAdapter(model, (1, 3), kv=KV)
    found = check_rows(adapter)
    width = 16 if found.verify is None else 1            # the pipeline's rule
    for seed, ids in enumerate(PROMPTS):
        ref = oracle(model, ids, N)
        assert tokens(adapter, None, ids, N, FixedWidth(width), lookup=True) == ref
        drafter = OracleDrafter(len(ids), ref, V, seed=5 + seed)
        assert tokens(adapter, drafter, ids, N, FixedWidth(min(width, 8))) == ref


def test_calibration_prices_the_context_of_a_quantized_cache():
    """The calibration grows quantized caches too (random keys, quantized as they are written)
    and fits a context slope from them: `auto` prices a long-context verify at the KV setting
    that runs, instead of leaving it to the timed cycles."""
    adapter = TargetAdapter(quant_model("llama"), (1, 3), kv=KV)
    cache = adapter.make_cache()
    adapter.forward(mx.array([[1, 2, 3]]), cache)
    assert grow_cache(cache, 300) and {c.offset for c in cache} == {303}
    codes, scales, _ = cache[0].keys
    assert codes.shape[2] >= 303 and codes.dtype == mx.uint32 and scales.dtype == mx.float32
    drafter = Drafter(drafter_args(block_size=8, layer_ids=(1, 3)))
    cost = measure_costs(SimpleNamespace(adapter=adapter, drafter=drafter), 16, context=32,
                         long=(8192,), reps=3)
    assert cost.verify_slope[0] > 0 or cost.verify_slope[1] > 0
    assert cost.verify(16, 2048) > cost.verify(16, 32)


def test_the_api_generates_and_batches_like_the_oracle(kv_pipe):
    pipe = kv_pipe
    d = pipe.describe()
    assert (d["kv_bits"], d["kv_group_size"]) == (8, 32)
    kv = KVQuant(8, 32)
    prompts = ["def add(a, b):", "Hello! How can I help you today?"]
    refs = [oracle(pipe.target, pipe.encode(p), 24, kv) for p in prompts]
    for b in (1, 4, 16, "auto"):
        assert pipe.generate(prompts[0], max_tokens=24, block_size=b).tokens == refs[0], b
    # batched where the load-time row check found a batch's rows bitwise plain steps, one at a
    # time where not (this float32 target's BLAS decides; both branches: the test above)
    followed(pipe, [pipe.encode(p) for p in prompts], refs, 24)


# --------------------------------------------------------------------------- batching

def test_batched_rows_move_the_quantized_triples_exactly():
    """Rows joined from single caches, a step written to all of them, per-row commits (the
    rejected rows become holes), compaction, rows leaving and one released again: every
    row's packed values, scales and biases stay bit for bit those its own single-sequence
    QuantizedKVCache holds after the same rows; nothing is dequantized and requantized."""
    mx.random.seed(1)
    H, D = 2, HEAD_DIM
    kv = lambda b, t: (mx.random.normal((b, H, t, D)), mx.random.normal((b, H, t, D)))  # noqa
    solo = [QuantizedKVCache(KV.group_size, KV.bits) for _ in range(3)]
    for c, n in zip(solo, (5, 9, 3)):
        c.update_and_fetch(*kv(1, n))
    rows = RaggedKVCache.from_single(solo[0])
    assert isinstance(rows, RaggedQuantizedKVCache) and (rows.bits, rows.group_size) == KV
    rows.extend(*map(RaggedKVCache.from_single, solo[1:]))
    for keep in ([4, 1, 0], [2, 4, 3]):
        keys, values = kv(3, 4)
        rows.update_and_fetch(keys, values)
        rows.commit(keep)
        for b, (c, k) in enumerate(zip(solo, keep)):
            if k:
                c.update_and_fetch(keys[b : b + 1, :, :k], values[b : b + 1, :, :k])
    assert not rows.is_trimmable()
    with pytest.raises(NotImplementedError):
        rows.trim(1)                    # no stub: rows go back by commit only
    rows.compact()
    rows.filter([2, 0])                 # row 1 leaves, the others change places

    def same(a: QuantizedKVCache, b: QuantizedKVCache):
        assert a.offset == b.offset and (a.bits, a.group_size) == (b.bits, b.group_size)
        for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)):
            assert x.dtype == y.dtype
            assert mx.array_equal(x[..., : a.offset, :], y[..., : b.offset, :]).item()

    same(rows.to_single(0), solo[2])
    same(rows.to_single(1), solo[0])
    rows.extend(RaggedKVCache.from_single(rows.to_single(0)))     # a row joins again
    same(rows.to_single(2), solo[2])
    with pytest.raises(ValueError, match="cannot join"):
        rows.extend(RaggedKVCache.from_single(KVCache()))


def test_sixteen_sequences_joining_and_leaving_equal_their_oracles():
    """On the hybrid target (quantized rows beside recurrent ones): 16 sequences of different
    lengths, plain, forced partial acceptances at widths 4-16 and lookup, joining at random
    steps with chunked prefills; each equals its own quantized oracle."""
    model = quant_model("qwen3_5")
    adapter = TargetAdapter(model, (1, 3), kv=KV)
    rng = random.Random(3)
    oracles = Oracles(V)
    engine = Engine(adapter, oracles, planner=Planner(), prefill_step_size=8)
    assert engine.solo_why is None
    arrivals, refs, truths = {}, {}, {}
    for k in range(16):
        prompt = random_prompt(rng, V, k, longest=30, repeat=6)
        max_tokens = rng.choice([1, 2] + list(range(10, 28)))
        truth = oracle(model, prompt, max_tokens + 16)
        truths[k], refs[k] = (len(prompt), truth), (truth[:max_tokens], "length")
        arrivals.setdefault(rng.randrange(10), []).append(
            (k, Request(prompt, max_tokens, policy=FixedWidth([1, 4, 8, 16][k % 4]),
                        lookup=k % 5 == 2)))
    out = run(engine, arrivals, budget=12, before_add=lambda k: oracles.expect(*truths[k]))
    for k, ref in refs.items():
        assert out[k] == ref, f"sequence {k}"
    assert engine.caches.cache is None and max(n for n, _, _ in engine.history) >= 6


def test_seeded_sampling_equal_alone_and_batched():
    model = quant_model("qwen3_5")
    drafter = random_drafter(drafter_args(block_size=8, layer_ids=(1, 3)), seed=3)
    adapter = TargetAdapter(model, (1, 3), kv=KV)
    engine = assert_seeded_batch_equals_alone(adapter, drafter, 12)
    assert engine.solo_why is None


@pytest.mark.slow  # 15-44 s: 2,000 runs
def test_sampling_follows_the_quantized_target():
    """Speculative sampling on a quantized cache follows the target's own distribution with
    that cache (three tokens' joint, chi-square), as test_sampling checks in float."""
    from mlx_lm.models import llama
    from test_sampling import (V as SV, chi2, chi2_threshold, exact_joint,
                               speculative_counts)

    mx.random.seed(11)
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2,
                           intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=32, rms_norm_eps=1e-5, vocab_size=SV,
                           tie_word_embeddings=False)
    model = llama.Model(args)
    model.lm_head.weight = model.lm_head.weight * 3
    mx.eval(model.parameters())
    kv = KVQuant(4, 32)
    sampling = Sampling(1.0)
    counts, accepted = speculative_counts(model, "oracle", sampling, 2000, kv=kv)
    expected = exact_joint(model, sampling, cache=lambda: oracle_cache(model, kv))
    assert expected != exact_joint(model, sampling)      # quantized: another distribution
    stat, df = chi2(counts, expected, 2000)
    assert stat < chi2_threshold(df), f"chi2={stat:.1f} df={df}"
    assert 0 in accepted and 2 in accepted


# --------------------------------------------------------------------------- the prefix cache

def _model(name: str, kv: KVQuant | None = KV) -> Model:
    drafter = random_drafter(drafter_args(block_size=8, layer_ids=(1, 3)), seed=3)
    mx.eval(drafter.parameters())
    return Model(TargetAdapter(quant_model(name), (1, 3), kv=kv), drafter)


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_prefix_cache_resumes_from_ram_and_disk_like_an_uninterrupted_run(name, tmp_path):
    m = _model(name)
    prompt = PROMPTS[1][:14]
    answer, state = m.turn(prompt)
    nxt = prompt + answer + [9, 8, 30]
    want = m.gen(nxt)
    assert want == oracle(quant_model(name), nxt, 10)
    cache = PromptCache(2, disk=m.disk(tmp_path))
    cache.insert(state)
    hit, n = cache.fetch(nxt)                               # from RAM
    assert n == len(prompt) + len(answer) - 1 and cache.stats.disk_hits == 0
    assert any(type(c) is QuantizedKVCache and c.offset == n for c in hit.cache)
    assert m.gen(nxt, hit) == want
    cache.close()
    (name_on_disk,) = files(tmp_path)
    arrays = mx.load(str(tmp_path / name_on_disk))
    assert arrays["t1.keys.0"].dtype == mx.uint32 and arrays["t1.keys.0"].shape[2] == \
        len(state.tokens)                                   # packed, rows in use only

    restarted = PromptCache(2, disk=m.disk(tmp_path))       # a new process: from disk
    hit, n = restarted.fetch(nxt)
    assert restarted.stats.disk_hits == 1 and n == len(prompt) + len(answer) - 1
    assert m.gen(nxt, hit) == want
    if name == "llama":                                     # trimmed inside the prefix
        branch = prompt[:6] + [1, 2, 3]
        short, k = restarted.fetch(branch)
        assert k == 6 and m.gen(branch, short) == m.gen(branch)
    restarted.close()


def test_a_file_of_another_kv_setting_is_never_read(tmp_path):
    m = _model("llama")
    _, state = m.turn(PROMPTS[0])
    disk = m.disk(tmp_path)
    assert disk.identity["kv"] == [KV.bits, KV.group_size]
    disk.put(state)
    disk.close()
    for kv in (KVQuant(8, 64), KVQuant(4, 32), None):
        other = _model("llama", kv)
        foreign = other.disk(tmp_path)
        assert len(foreign) == 0 and files(tmp_path) == []   # rejected, deleted, never read
        assert foreign.stats.reasons == {"written for another kv": 1}
        foreign.close()
        disk = m.disk(tmp_path)                              # written again for the next one
        disk.put(state)
        disk.close()


# --------------------------------------------------------------------------- bytes

def test_bytes_per_token_follow_the_formula_and_the_prefix_cache_holds_more_tokens():
    """Per token and layer: 2 * n_kv * head_dim * 4 bytes in float32; quantized,
    2 * n_kv * (head_dim * bits / 32 * 4 + 2 * head_dim / group * 4) (packed uint32 values,
    float32 scales and biases): measured on the caches (512 rows: buffers, which grow 256 rows
    at a time, exactly full). In the same bytes, the prefix cache holds >= 1.8x (8-bit) and
    >= 3.4x (4-bit) the tokens of float32."""
    model = quant_model("llama")
    n_kv, layers, n = COMMON["num_key_value_heads"], COMMON["num_hidden_layers"], 512
    ids = [(7 * i) % (V - 31) + 30 for i in range(n)]     # none below 30: see tokens_held
    per_token = {}
    for kv in (None, KVQuant(8, 64), KVQuant(8, 32), KVQuant(4, 64), KVQuant(4, 32)):
        adapter = TargetAdapter(model, kv=kv)
        state = DecodeState.new(adapter, None)
        prefill(adapter, state, ids, 128, None)
        measured = sum(cache_nbytes(c) for c in state.cache) / (n * layers)
        want = 2 * n_kv * (HEAD_DIM * 4 if kv is None else
                           HEAD_DIM * kv.bits // 32 * 4 + 2 * HEAD_DIM // kv.group_size * 4)
        assert measured == want == kv_bytes_per_token(n_kv, HEAD_DIM, kv) == \
            state.nbytes / (n * layers), kv
        per_token[kv] = measured

    def tokens_held(kv) -> int:
        """Tokens the prefix cache keeps in the bytes of four float32 states of 256 tokens."""
        adapter = TargetAdapter(model, kv=kv)
        cache = PromptCache(1000, max_bytes=int(4 * 256 * per_token[None] * layers))
        state = DecodeState.new(adapter, None)
        prefill(adapter, state, ids[:256], 256, None)
        for k in range(24):                    # distinct prompts: none extends another
            twin = state.copy()
            twin.tokens[0] = k
            cache.insert(twin)
        assert cache.nbytes <= cache.max_bytes
        return sum(len(s.tokens) for s, _, _ in cache._entries.values())

    float_tokens = tokens_held(None)
    assert float_tokens == 4 * 256
    assert tokens_held(KVQuant(8, 64)) >= 1.8 * float_tokens
    assert tokens_held(KVQuant(4, 64)) >= 3.4 * float_tokens


# --------------------------------------------------------------------------- settings

def test_bad_settings_are_refused_before_anything_loads(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(settings.SettingError, match=r"kv_bits: 3 is not one of 4, 8"):
        dflash2_mlx.load(missing, kv_bits=3)
    with pytest.raises(settings.SettingError, match=r"kv_group_size: 48 is not one of 32, 64, 128"):
        dflash2_mlx.load(missing, kv_bits=8, kv_group_size=48)
    assert settings.kv_bits("8") == 8 and settings.kv_bits(None) is None
    assert settings.kv_group_size(None) == 64
    with pytest.raises(OmlxSettingsError, match="dflash_kv_bits = 3"):
        parse_entry({"dflash_kv_bits": 3}, "m")
    assert parse_entry({"dflash_kv_bits": 4, "dflash_kv_group_size": 32}, "m").kv_bits == 4
    for args, flag in ((["generate", "--kv-bits", 3], "--kv-bits"),
                       (["serve", "--kv-group-size", 48], "--kv-group-size")):
        proc = cli(*args, "--model", missing)
        assert proc.returncode == 2 and f"Invalid value for '{flag}'" in proc.stderr
        assert "one of" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(ValueError, match="kv_group_size 128 does not fit head_dim 64"):
        TargetAdapter(quant_model("llama"), kv=KVQuant(8, 128))
    cfg = dict(model_type="llama", **COMMON)          # head_dim 16: no group size fits
    model_class, args_class = _get_classes(cfg)
    with pytest.raises(ValueError, match="kv_group_size 32 does not fit head_dim 16.*float"):
        TargetAdapter(model_class(args_class.from_dict(cfg)), kv=KVQuant(8, 32))


def test_the_cli_generates_with_a_quantized_cache(kv_pipe, fixture_dir, dflash2_dir, tmp_path):
    stats = tmp_path / "stats.json"
    proc = cli("generate", "--model", fixture_dir / "llama-hd64", "--draft", dflash2_dir,
               "--prompt", "def add(a, b):", "--max-tokens", 16, "--kv-bits", 8,
               "--kv-group-size", 32, "--block-size", 4, "--stats-json", stats)
    assert proc.returncode == 0, proc.stderr
    want = kv_pipe.generate("def add(a, b):", max_tokens=16, block_size=4)
    assert proc.stdout == want.text + "\n"
    s = json.loads(stats.read_text())["settings"]
    assert (s["kv_bits"], s["kv_group_size"]) == (8, 32)
