"""Sampling exactness: speculative sampling follows the target's own sampling distribution."""

from contextlib import closing
from types import SimpleNamespace
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.sample_utils import make_sampler

import dflash2_mlx.decode.engine as engine
import dflash2_mlx.decode.state as state_mod
from dflash2_mlx.model.drafter import Drafter, DraftVocab, Proposal
from dflash2_mlx.policy.adaptive import FixedWidth
from dflash2_mlx.decode.engine import stream_tokens
from dflash2_mlx.policy.planner import Planner
from dflash2_mlx.decode.stats import GenerationStats
from dflash2_mlx.decode.lookup import LookupConfig
from dflash2_mlx.model.sampling import Sampling, rejection_accept
from dflash2_mlx.model.target import TargetAdapter
from fixtures import drafter_args, random_drafter

V = 16          # tiny vocabulary so the joint of three tokens has few cells
PROMPT = [3, 7, 1, 12]


def chi2_threshold(df: int, alpha: float = 1e-3) -> float:
    """Upper alpha quantile of chi-square(df), Wilson-Hilferty approximation."""
    z = {1e-3: 3.090, 1e-2: 2.326}[alpha]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: dict, expected_p: dict, n: int) -> tuple[float, int]:
    """Pearson statistic with cells of expected count < 5 pooled into one."""
    stat, rest_obs, rest_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in expected_p.items():
        e, o = n * p, counts.get(cell, 0)
        if e < 5:
            rest_obs, rest_exp = rest_obs + o, rest_exp + e
        else:
            stat, cells = stat + (o - e) ** 2 / e, cells + 1
    assert set(counts) <= set(expected_p), "sampled a sequence of probability zero"
    if rest_exp > 0:
        stat, cells = stat + (rest_obs - rest_exp) ** 2 / rest_exp, cells + 1
    return stat, cells - 1


@pytest.fixture(scope="module")
def tiny():
    mx.random.seed(11)
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2,
                           intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=V, tie_word_embeddings=False)
    model = llama.Model(args)
    model.lm_head.weight = model.lm_head.weight * 3      # moderately peaked distributions
    mx.eval(model.parameters())
    common = dict(hidden_size=32, vocab_size=V, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, intermediate_size=64, mask_token_id=V - 1, layer_ids=(0, 1),
                  block_size=4)
    d2 = Drafter(drafter_args(dflash2=True, conv_group_size=8, selector_rank=8,
                              selector_top_k=8, **common))
    d1 = Drafter(drafter_args(dflash2=False, **common))
    d2v = Drafter(drafter_args(dflash2=True, conv_group_size=8, selector_rank=8,
                               selector_top_k=8, **common))
    d2v.update(d2.parameters())
    d2v.draft_vocab = DraftVocab(list(range(0, V, 2)) + [1, 3])   # ids outside never drafted
    d2v.draft_vocab.ids = mx.sort(d2v.draft_vocab.ids)
    ds = random_drafter(drafter_args(dspark=True, markov_rank=8, **{**common, "block_size": 3}),
                        seed=12)                     # its widest verify: 3 drafts + 1
    mx.eval(d1.parameters(), d2.parameters(), ds.parameters())
    return model, {"dflash": d1, "dflash2": d2, "dflash2-vocab": d2v, "dspark": ds}


def exact_joint(model, sampling: Sampling, prompt=PROMPT, cache=None) -> dict:
    """P(t1, t2, t3) of target-only sampling, by enumeration. cache: makes the model's cache
    (a quantized KV cache: test_kv_cache.py)."""
    seqs = mx.array([prompt + [a, b] for a in range(V) for b in range(V)])
    logits = model(seqs, cache=None if cache is None else cache())
    probs = np.array(sampling.probs(logits[:, -3:]))              # [V*V, 3, V]
    p1 = probs[0, 0]
    p2 = probs[::V, 1]                                            # row a*V: prefix (a, *)
    p3 = probs[:, 2].reshape(V, V, V)
    return {(a, b, c): p1[a] * p2[a, b] * p3[a, b, c]
            for a in range(V) for b in range(V) for c in range(V) if p1[a] * p2[a, b] * p3[a, b, c] > 0}


class NoisyOracle:
    """A drafter double at the engine boundary whose q is close to the target's p:
    q = 0.5 * p(. | prefix) + 0.5 * uniform, so every acceptance path occurs often. It rebuilds
    the committed prefix from its own drafts and the number of feature rows it is handed.
    `memo` (prefix -> (q, log q), shared by the oracles of one run of many sequences): the model is
    deterministic, so each prefix's forward runs once."""

    context_window = None
    args = SimpleNamespace(block_size=16, max_width=16)

    def __init__(self, model, sampling, memo: dict | None = None):
        self.model, self.sampling = model, sampling
        self.memo = {} if memo is None else memo
        self.seq, self.last = list(PROMPT), []

    def make_cache(self):
        self.seq, self.last = list(PROMPT), []
        return []

    def skip_context(self, cache, n):
        pass

    def propose(self, target, anchor, feats, cache, width, sampling, key):
        if self.last:                       # feats has a+1 rows: a drafts accepted, then anchor
            self.seq += self.last[: feats.shape[1] - 1]
        self.seq.append(anchor.item())
        tokens, qs = [], []
        for k in mx.random.split(key, width - 1):
            q, log_q = self.q(self.seq + tokens)
            tokens.append(mx.random.categorical(log_q, key=k).item())
            qs.append(q)
        self.last = tokens
        return Proposal(mx.array([tokens], dtype=mx.uint32), mx.stack(qs)[None])

    def propose_batch(self, target, drafts):
        return [self.propose(target, *d) for d in drafts]

    def q(self, seq: list[int]) -> tuple[mx.array, mx.array]:
        """(q, log q) [V] after `seq`."""
        if tuple(seq) not in self.memo:
            p = self.sampling.probs(self.model(mx.array([seq]))[0, -1])
            q = 0.5 * p + 0.5 / V
            self.memo[tuple(seq)] = (q, mx.log(q))
            mx.eval(self.memo[tuple(seq)])
        return self.memo[tuple(seq)]


def speculative_counts(model, drafter, sampling, n, block_size=3, prompt=PROMPT, lookup=None,
                       sources=None, kv=None, planner=Planner):
    """Counts of the first three tokens over n seeded runs, and the accepted counts of the
    drafting cycles that made them (of `sources`, when a list is given to collect them). A run
    stops once it has three tokens: the cycles after them cannot change them. The prompt but
    its last token is prefilled once, in the chunk a fresh run's prefill makes of it (the same
    rows, so the same numbers); each run starts from a copy and prefills the last token alone,
    as a fresh run would. kv: the target's KV cache quantized (`model.views.KVQuant`);
    planner: makes each run's planner."""
    layers = () if drafter is None else (0,) if drafter == "oracle" else \
        drafter.args.target_layer_ids
    adapter = TargetAdapter(model, layers, kv=kv)
    drafter = NoisyOracle(model, sampling) if drafter == "oracle" else drafter
    step_size = 2048                                     # stream_tokens' prefill chunk
    # (the doubles keep no context cache to trim: their prefix holds no features, and the
    # oracle reads none before its first drafts)
    prefix = state_mod.DecodeState.new(adapter, drafter if isinstance(drafter, Drafter) else None)
    state_mod.prefill(adapter, prefix, prompt, step_size, None)
    assert prefix.trim(len(prompt) - 1)
    mx.eval([c.state for c in prefix.cache], prefix.pending)
    counts, accepted = {}, []
    for seed in range(n):
        stats = GenerationStats()
        toks = []
        state = prefix.copy()
        # the drafter has read none of the prefix: a fresh drafter cache (the oracle double
        # resets the sequence it follows there)
        state.dcache = drafter.make_cache() if drafter is not None else None
        with closing(stream_tokens(adapter, drafter, prompt, max_tokens=4, sampling=sampling,
                                   planner=planner(),
                                   policy=FixedWidth(block_size), stop_ids=set(), seed=seed,
                                   stats=stats, lookup=lookup, prefill_step_size=step_size,
                                   state=state)) as steps:
            for step in steps:
                toks += step
                if len(toks) >= 3:
                    break
        toks = toks[:3]
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
        accepted += stats.accepted
        if sources is not None:
            sources += [c.source for c in stats.drafting()]
    return counts, accepted


# The oracle double (dense q near p) exercises every acceptance path under each filter; the
# real random drafters check the q they report: DFlash's filtered softmax, DFlash 2's selector
# distribution over its top-K candidates (sparse q), also mapped from a draft vocabulary.
CASES = [("oracle", Sampling(1.0)), ("oracle", Sampling(0.8, top_k=5)),
         ("oracle", Sampling(1.0, top_p=0.8)), ("oracle", Sampling(1.2, top_p=0.9, top_k=6)),
         ("dflash2", Sampling(1.0)), ("dflash", Sampling(1.0)),
         ("dflash2-vocab", Sampling(1.0)), ("dspark", Sampling(1.0))]
N = 2000


@pytest.mark.slow  # 31-100 s a case: 2,000 runs
@pytest.mark.parametrize("kind,sampling", CASES, ids=[f"{k}-{s}" for k, s in CASES])
def test_joint_distribution_matches_target(tiny, kind, sampling):
    """Chi-square at alpha=1e-3 on the joint of the first three tokens (a cycle of width 3
    produces tokens 2 and 3: two drafts plus the bonus). See test_chi2_has_power for the power
    of the same test at the same N against a subtly wrong sampler."""
    model, drafters = tiny
    expected = exact_joint(model, sampling)
    counts, accepted = speculative_counts(model, drafters.get(kind, kind), sampling, N)
    assert {0, 1} <= set(accepted), "both acceptance and rejection must occur"
    if kind == "oracle":
        assert 2 in set(accepted), "no fully accepted block"
    stat, df = chi2(counts, expected, N)
    assert stat < chi2_threshold(df), f"chi2={stat:.1f} df={df}"


# A prompt with repeats, and lookup suffixes of one token: most cycles find a match, so the
# point-mass q of lookup tokens meets every acceptance path.
LOOKUP_PROMPT = [3, 7, 1, 12, 3, 7, 5, 1, 12, 9, 3]


@pytest.mark.slow  # 25-60 s a case: 2,000 runs
@pytest.mark.parametrize("kind", ["dflash2", None], ids=["with-drafter", "lookup-alone"])
def test_joint_distribution_with_lookup(tiny, kind):
    model, drafters = tiny
    sampling = Sampling(1.0)
    expected = exact_joint(model, sampling, LOOKUP_PROMPT)
    sources = []
    counts, accepted = speculative_counts(model, drafters.get(kind), sampling, N,
                                          prompt=LOOKUP_PROMPT, lookup=LookupConfig(1, 4),
                                          sources=sources)
    looked = [a for a, s in zip(accepted, sources) if s == "lookup"]
    assert {0, 1, 2} <= set(looked), "lookup cycles must see rejection, partial and full"
    if kind is not None:
        assert "drafter" in sources, "the drafter must draft where the lookup finds nothing"
    stat, df = chi2(counts, expected, N)
    assert stat < chi2_threshold(df), f"chi2={stat:.1f} df={df}"


@pytest.mark.slow  # 16 s: 2,000 runs
def test_chi2_has_power_with_lookup(tiny, monkeypatch):
    """Lookup tokens are a point mass, not draws from the target: an engine that accepted them
    as if they were (q = p, so always accepted) is caught at the same N.

    Measured when written (N=2000): correct chi2 59 (df 58, threshold 97), trusting 971. A
    subtler bug, the bonus after a rejection drawn from p instead of p without the rejected
    token, gives 94: below this N's power (its effect is P(reject) x p(token))."""
    def trusting(drafts, p, q, key):
        return rejection_accept(drafts, p, p[:-1], key)

    monkeypatch.setattr(engine, "rejection_accept", trusting)
    model, _ = tiny
    sampling = Sampling(1.0)
    expected = exact_joint(model, sampling, LOOKUP_PROMPT)
    counts, _ = speculative_counts(model, None, sampling, N, prompt=LOOKUP_PROMPT,
                                   lookup=LookupConfig(1, 4))
    stat, df = chi2(counts, expected, N)
    assert stat > chi2_threshold(df), f"broken sampler not detected: chi2={stat:.1f} df={df}"


@pytest.mark.slow  # 30 s: 2,000 runs
def test_chi2_has_power(tiny, monkeypatch):
    """The same test at the same N rejects a sampler whose only bug is drawing the
    replacement token from p instead of norm(max(p - q, 0)) after a rejection.

    Measured when this test was written (N=2000, alpha=1e-3): T=1 correct chi2 30 (df 44,
    threshold 79) vs broken 125; top-p 0.8 correct 14 (df 15, threshold 38) vs broken 80."""
    def broken(drafts, p, q, key):
        a, _ = rejection_accept(drafts, p, q, key)
        return a, mx.random.categorical(mx.log(p[a]), key=mx.random.split(key)[1])

    monkeypatch.setattr(engine, "rejection_accept", broken)
    model, drafters = tiny
    sampling = Sampling(1.0)
    expected = exact_joint(model, sampling)
    counts, _ = speculative_counts(model, "oracle", sampling, N)
    stat, df = chi2(counts, expected, N)
    assert stat > chi2_threshold(df), f"broken sampler not detected: chi2={stat:.1f} df={df}"


def test_target_probs_match_mlx_lm_sampler():
    """Our p is the distribution mlx-lm's own sampler draws from (top-p, top-k, temperature)."""
    mx.random.seed(0)
    logits = mx.random.normal((1, 12)) * 2
    for s in (Sampling(1.0), Sampling(0.7, top_k=4), Sampling(1.3, top_p=0.85),
              Sampling(0.9, top_p=0.9, top_k=5)):
        sampler = make_sampler(temp=s.temperature, top_p=s.top_p, top_k=s.top_k)
        n = 40000
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        draws = np.array(sampler(mx.broadcast_to(logprobs, (n, 12))))
        freq = np.bincount(draws, minlength=12) / n
        p = np.array(s.probs(logits))[0]
        assert np.all(freq[p == 0] == 0)
        assert np.abs(freq - p).max() < 4 * math.sqrt(0.25 / n) + 1e-3, (s, freq, p)


def test_rejection_step_against_formula():
    """One draft: acceptance rate min(1, p(d)/q(d)); replacement ~ norm(max(p - q, 0));
    all accepted -> bonus from the last row."""
    p = mx.array([[0.5, 0.2, 0.3, 0.0], [0.1, 0.1, 0.1, 0.7]])
    q = mx.array([[0.2, 0.6, 0.1, 0.1]])
    n = 3000
    outcomes = {}
    for d in range(4):       # the n steps in one vmapped call: per key, the same draws as n calls
        keys = mx.stack([mx.random.key(i * 4 + d) for i in range(n)])
        a, bonus = mx.vmap(lambda k: rejection_accept(mx.array([d]), p, q, k))(keys)
        outcomes[d] = list(zip(a.tolist(), bonus.tolist()))
    residual = np.maximum(np.array(p[0]) - np.array(q[0]), 0)
    residual /= residual.sum()
    for d in range(4):
        acc = np.mean([a for a, _ in outcomes[d]])
        rate = min(1.0, p[0, d].item() / q[0, d].item())
        assert abs(acc - rate) < 4 * math.sqrt(rate * (1 - rate) / n) + 1e-9, (d, acc, rate)
        rejected = [b for a, b in outcomes[d] if a == 0]
        if rejected:
            freq = np.bincount(rejected, minlength=4) / len(rejected)
            assert np.all(freq[residual == 0] == 0)
            assert np.abs(freq - residual).max() < 4 * math.sqrt(0.25 / len(rejected))
        accepted_bonus = [b for a, b in outcomes[d] if a == 1]
        if accepted_bonus:
            freq = np.bincount(accepted_bonus, minlength=4) / len(accepted_bonus)
            assert np.abs(freq - np.array(p[1])).max() < 4 * math.sqrt(0.25 / len(accepted_bonus))
    # The overall output token follows p exactly: P(out=x) = min(q, p)(x) + (1 - sum min) r(x).
    total = np.zeros(4)
    for d in range(4):
        weight = q[0, d].item() / n
        for a, b in outcomes[d]:
            total[d if a == 1 else b] += weight
    assert np.abs(total - np.array(p[0])).max() < 0.02


def test_sampling_is_reproducible_with_seed(tiny):
    model, drafters = tiny
    adapter = TargetAdapter(model, drafters["dflash2"].args.target_layer_ids)
    run = lambda seed: [t for s in stream_tokens(adapter, drafters["dflash2"], PROMPT,
                                                 max_tokens=20, sampling=Sampling(1.0),
                                                 planner=Planner(),
                                                 policy=FixedWidth(4), stop_ids=set(), seed=seed)
                        for t in s]
    assert run(5) == run(5)
    assert any(run(5) != run(s) for s in (6, 7, 8))


class PerSequenceOracles:
    """One `NoisyOracle` per sequence behind the batch engine's one drafter: a sequence's
    drafter cache (made when it is added) holds its own oracle."""

    context_window = None
    args = SimpleNamespace(block_size=16, max_width=16)

    def __init__(self, model, sampling):
        self.model, self.sampling, self.memo = model, sampling, {}

    def make_cache(self):
        oracle = NoisyOracle(self.model, self.sampling, self.memo)
        return [oracle, *oracle.make_cache()]

    def skip_context(self, cache, n):
        pass

    def propose(self, target, anchor, feats, cache, width, sampling, key):
        return cache[0].propose(target, anchor, feats, cache[1:], width, sampling, key)

    def propose_batch(self, target, drafts):
        return [self.propose(target, *d) for d in drafts]


@pytest.mark.slow  # 33-110 s a case: 2,000 runs
@pytest.mark.parametrize("kind", ["oracle", "dflash2"])
def test_joint_distribution_batched_unseeded(tiny, kind):
    """Unseeded sampling in the batch engine follows the target's distribution: N sequences
    of PROMPT drafting width-3 blocks, no seed, batched 12 at a time with other sequences
    beside them (plain, wider drafter blocks, lookup on another prompt) that join and leave
    at other steps (the per-step prefill budget staggers the joins). Chi-square at alpha=1e-3 on
    the joint of the first three tokens, as for the single-sequence engine."""
    from dflash2_mlx.decode.engine import Engine, Request

    model, drafters = tiny
    sampling = Sampling(1.0)
    if kind == "oracle":
        adapter, drafter = TargetAdapter(model, (0,)), PerSequenceOracles(model, sampling)
    else:
        drafter = drafters[kind]
        adapter = TargetAdapter(model, drafter.args.target_layer_ids)
    engine = Engine(adapter, drafter, planner=Planner(), lookup=LookupConfig(1, 4), max_batch=12)
    measured, others = set(), [(FixedWidth(1), False, 6), (FixedWidth(4), False, 9),
                               (FixedWidth(3), True, 5)]
    for k in range(N):
        measured.add(engine.add(Request(PROMPT, 4, sampling, policy=FixedWidth(3))))
        if k % 4 == 0:                                     # a sequence of another kind
            policy, lookup, n = others[(k // 4) % len(others)]
            engine.add(Request(LOOKUP_PROMPT, n, sampling, policy=policy, lookup=lookup))
    out, accepted, beside = {}, [], 0
    while engine.running or engine.waiting:
        beside = max(beside, engine.running)
        for ev in engine.step(prefill_budget=30):
            out.setdefault(ev.id, []).extend(ev.tokens)
    for rid in measured:
        accepted += [c.accepted for c in engine.stats[rid].steps if c.source != "plain"]
    assert beside >= 8 and max(n for n, _, _ in engine.history) >= 8
    assert {0, 1} <= set(accepted), "both acceptance and rejection must occur"
    counts = {}
    for rid in measured:
        toks = tuple(out[rid][:3])
        counts[toks] = counts.get(toks, 0) + 1
    stat, df = chi2(counts, exact_joint(model, sampling), N)
    assert stat < chi2_threshold(df), f"chi2={stat:.1f} df={df}"
