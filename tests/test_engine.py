"""The batch engine (`decode.engine.Engine`): every sequence of a batch generating exactly what
it generates alone, whatever runs beside it (joining, leaving, cancelled, launched ahead, seeded
sampling, one drafter pass per step, batch-aware policies), and `Pipeline.generate_batch`. The
batch caches themselves: test_batch_cache.py; the batch-aware policy alone: test_policy_batch.py.
"""

import copy
import random

import pytest

import dflash2_mlx
from dflash2_mlx.decode.engine import CANCELLED, Engine, Request, stream_tokens
from dflash2_mlx.policy.planner import Planner
from dflash2_mlx.decode.lookup import LookupConfig
from dflash2_mlx.model.sampling import Sampling
from dflash2_mlx.decode.stats import DRAFTER
from dflash2_mlx.policy.adaptive import AdaptiveWidth, FixedWidth
from dflash2_mlx.policy.batch import BatchAwareWidth
from dflash2_mlx.policy.costs import Correction, CostModel
from fixtures import (Oracles, assert_burst_returns_to_idle, assert_seeded_batch_equals_alone,
                      random_prompt, run, tiny)
from test_exactness import mlx_lm_greedy

pytestmark = pytest.mark.rows


@pytest.fixture(scope="module")
def pipe(llama_dir, dflash2_dir):
    return dflash2_mlx.load(str(llama_dir), str(dflash2_dir))


def _kinds(pipe):
    """(policy, lookup) of each kind of sequence: plain, drafter at several widths, lookup
    alone, and the pipeline's adaptive policy (one copy per sequence)."""
    return [(FixedWidth(1), False), (FixedWidth(4), False), (FixedWidth(16), True),
            (FixedWidth(7), False), (copy.deepcopy(pipe.width_policy()), True)]


def test_sixteen_sequences_joining_and_leaving_are_exact(pipe):
    """16 sequences of different prompt lengths and max_tokens, plain / drafter / lookup /
    adaptive, joining at random steps with a small prefill budget (prompts in chunks): each
    equals mlx-lm's greedy output alone, token for token."""
    rng = random.Random(3)
    vocab = pipe.adapter.vocab_size
    oracles = Oracles(vocab)
    engine = Engine(pipe.adapter, oracles, planner=Planner(), prefill_step_size=8)
    arrivals, refs, truths = {}, {}, {}
    kinds = _kinds(pipe)
    for k in range(16):
        prompt = random_prompt(rng, vocab, k, longest=40, repeat=8)
        max_tokens = rng.choice([1, 2] + list(range(20, 60)))
        ref = mlx_lm_greedy(pipe.target, prompt, max_tokens)
        stop = ()
        if k % 4 == 1 and len(ref) > 5:      # a token it emits ends it early
            stop = frozenset([ref[len(ref) // 2]])
            ref = ref[: ref.index(ref[len(ref) // 2]) + 1]
        policy, lookup = kinds[k % len(kinds)]
        if k >= len(kinds):
            policy = copy.deepcopy(policy)
        truths[k] = (len(prompt), mlx_lm_greedy(pipe.target, prompt, max_tokens + 16))
        arrivals.setdefault(rng.randrange(12), []).append(
            (k, Request(prompt, max_tokens, policy=policy, lookup=lookup, stop_ids=stop)))
        refs[k] = (ref, "stop" if stop else "length")
    out = run(engine, arrivals, budget=12, before_add=lambda k: oracles.expect(*truths[k]))
    for k, ref in refs.items():
        assert out[k] == ref, f"sequence {k}"
    assert engine.caches.cache is None and not engine.rows
    # what the test reached: full batches, drafts accepted from both sources, ragged steps
    assert max(n for n, _, _ in engine.history) >= 6
    steps = [c for s in engine.stats.values() for c in s.steps]
    assert any(c.source == "drafter" and c.accepted for c in steps)
    assert any(c.source == "lookup" and c.accepted for c in steps)
    assert any(r > n for n, r, _ in engine.history), "no step verified drafts"
    assert sum(s.prompt_tokens > 12 for s in engine.stats.values()) >= 4   # chunked prefills


class Unbatchable:
    """The pipeline's target, wrapped: its caches refuse a batch's ragged rows."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def batch_refusal(self):
        return "a test target that refuses ragged rows"


def test_a_target_that_cannot_batch_decodes_its_sequences_one_at_a_time(pipe):
    """The engine says once why it cannot batch a target (`solo_why`) and then runs its
    sequences one after another in their own caches, each exactly mlx-lm's greedy output."""
    rng = random.Random(11)
    vocab = pipe.adapter.vocab_size
    engine = Engine(Unbatchable(pipe.adapter), pipe.drafter, planner=Planner(), max_batch=8)
    assert engine.solo and engine.max_batch == 1 and "refuses" in engine.solo_why
    arrivals, refs = {0: []}, {}
    for k, (policy, lookup) in enumerate(_kinds(pipe)):
        prompt = [rng.randrange(vocab - 1) for _ in range(rng.randint(3, 30))]
        refs[k] = (mlx_lm_greedy(pipe.target, prompt, 24), "length")
        arrivals[0].append((k, Request(prompt, 24, policy=policy, lookup=lookup)))
    assert run(engine, arrivals) == refs
    assert {n for n, _, _ in engine.history} == {1}
    assert any(r > n for n, r, _ in engine.history), "no step verified drafts"
    assert engine.caches.cache is None and not engine.rows


def test_cancelled_sequence_leaves_others_exact(pipe):
    rng = random.Random(5)
    vocab = pipe.adapter.vocab_size
    engine = Engine(pipe.adapter, pipe.drafter, planner=Planner())
    prompts = [[rng.randrange(vocab - 1) for _ in range(n)] for n in (5, 17, 9, 30)]
    arrivals = {0: [(k, Request(p, 30, policy=FixedWidth(4 + k), lookup=k % 2 == 1))
                    for k, p in enumerate(prompts)]}
    out = run(engine, arrivals, cancel_at={4: [1]})
    assert out[1][1] == CANCELLED and 0 < len(out[1][0]) < 30
    for k in (0, 2, 3):
        assert out[k] == (mlx_lm_greedy(pipe.target, prompts[k], 30), "length"), k


@pytest.mark.parametrize("family", ["llama-sliding", "gemma3_text"])
def test_sliding_window_families_are_exact(family):
    """Windows of 6 positions, prompts and outputs far longer: plain and lookup rows."""
    target = tiny(family)
    rng = random.Random(11)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (3, 14, 8, 25, 6)]
    prompts[1] = (prompts[1][:4] * 6)[:14]
    arrivals = {k: [(k, Request(p, 40, policy=FixedWidth(1 + 3 * (k % 3)), lookup=k % 3 > 0))]
                for k, p in enumerate(prompts)}
    out = run(Engine(target, None, planner=Planner()), arrivals, budget=9)
    for k, p in enumerate(prompts):
        assert out[k] == (mlx_lm_greedy(target.model, p, 40), "length"), k


def test_seeded_sampling_equals_alone(pipe):
    """The same seed draws the same tokens alone and batched beside others (per-sequence
    keys, the same key schedule as alone: plain runs, drafter and lookup cycles)."""
    assert_seeded_batch_equals_alone(pipe.adapter, pipe.drafter, 32)


def test_memory_returns_to_idle_after_a_burst(pipe):
    assert_burst_returns_to_idle(pipe.adapter, pipe.drafter, 40, 24)


def test_state_kept_on_leaving_restarts_exactly(pipe):
    """A finished sequence's DecodeState (its row out of the batch) starts a longer prompt
    that extends it, in another batch: exact, and its prefix is not prefilled again."""
    rng = random.Random(12)
    vocab = pipe.adapter.vocab_size
    prompt = [rng.randrange(vocab - 1) for _ in range(20)]
    engine = Engine(pipe.adapter, pipe.drafter, planner=Planner())
    others = [Request([rng.randrange(vocab - 1) for _ in range(9)], 12, policy=FixedWidth(3))
              for _ in range(2)]
    out = run(engine, {0: [(0, Request(prompt, 10, policy=FixedWidth(4), keep_state=True)),
                           (1, others[0])], 2: [(2, others[1])]})
    state = engine.pop_state(0)
    assert state is not None and state.tokens == prompt + out[0][0][:-1]
    follow = prompt + out[0][0] + [5, 6, 7]
    cached = len(state.tokens)          # the state is advanced in place from here
    engine = Engine(pipe.adapter, pipe.drafter, planner=Planner())
    out2 = run(engine, {0: [(0, Request(follow, 20, policy=FixedWidth(5), state=state)),
                            (1, others[0])]})
    assert out2[0] == (mlx_lm_greedy(pipe.target, follow, 20), "length")
    assert engine.stats[0].cached_tokens == cached


def test_a_state_without_room_is_not_copied_and_the_tokens_are_the_same(pipe):
    """`room_for_state` is asked, before a leaving row is copied out of the batch, with the
    bytes the copy takes (the kept state's target caches, to the byte); refused, the
    sequence keeps no state and its tokens are unchanged (the server's memory budget)."""
    rng = random.Random(13)
    vocab = pipe.adapter.vocab_size
    prompts = [[rng.randrange(vocab - 1) for _ in range(n)] for n in (20, 11)]
    asked = []

    def room(nbytes: int) -> bool:
        asked.append(nbytes)
        return len(asked) == 1              # the first leaver's copy fits, the second's not

    engine = Engine(pipe.adapter, pipe.drafter, planner=Planner())
    engine.room_for_state = room
    out = run(engine, {0: [(0, Request(prompts[0], 10, policy=FixedWidth(4), keep_state=True)),
                           (1, Request(prompts[1], 16, policy=FixedWidth(3), keep_state=True))]})
    assert out[0] == (mlx_lm_greedy(pipe.target, prompts[0], 10), "length")
    assert out[1] == (mlx_lm_greedy(pipe.target, prompts[1], 16), "length")
    kept = engine.pop_state(0)
    assert len(asked) == 2 and kept is not None and engine.pop_state(1) is None
    assert asked[0] == sum(a.nbytes for c in kept.cache for a in (c.keys, c.values)) > 0


@pytest.mark.parametrize("block_size", ["auto", 4, 1])
def test_generate_batch_equals_generate(pipe, block_size):
    prompts = ["def add(a, b):", "Hello! How can I help you today?", "for i in range(10):",
               "class Stack:\n    def push(self, x):"]
    limits = [30, 12, 25, 1]
    gens = pipe.generate_batch(prompts, max_tokens=limits, block_size=block_size,
                               max_batch=3, prefill_budget=16)
    for prompt, n, gen in zip(prompts, limits, gens):
        alone = pipe.generate(prompt, max_tokens=n, block_size=block_size)
        assert (gen.tokens, gen.text, gen.finish_reason) == \
            (alone.tokens, alone.text, alone.finish_reason), prompt
        assert gen.stats.generated_tokens == len(gen.tokens)
    seen = {i for i, _ in pipe.stream_batch(prompts[:2], max_tokens=5)}
    assert seen == {0, 1}
    with pytest.raises(ValueError, match="max_tokens"):
        pipe.generate_batch(prompts, max_tokens=[3])


def test_batch_aware_policies_stay_exact(pipe):
    rng = random.Random(13)
    vocab = pipe.adapter.vocab_size
    shared = Correction(decay=0.9)
    prompts = [[rng.randrange(vocab - 1) for _ in range(4 + 5 * k)] for k in range(6)]
    arrivals = {}
    for k, p in enumerate(prompts):                  # two join at each of the first steps
        policy = BatchAwareWidth(copy.deepcopy(pipe.width_policy()), shared)
        arrivals.setdefault(k // 2, []).append((k, Request(p, 30, policy=policy, lookup=True)))
    out = run(Engine(pipe.adapter, pipe.drafter, planner=Planner()), arrivals)
    for k, p in enumerate(prompts):
        assert out[k] == (mlx_lm_greedy(pipe.target, p, 30), "length"), k


def test_a_batch_better_plain_than_its_drafting_stays_plain_in_one_chain(pipe):
    """Each policy chooses expecting the others to do what their outlooks said; the step as a
    whole is checked against every sequence decoding plainly, by the same prices. Policies
    that want 2-row drafter cycles worth 1.02 tokens (3.06 tokens for a 6-row step priced
    0.11 s, against 3 plain tokens at 0.08 s) run plain instead, their next steps launched
    ahead; two steps in four they want cycles worth 1.95 tokens, which run when not launched. Greedy outputs
    are mlx-lm's, and every sequence's drafter context still covers each of its tokens once
    (the features of a drafter plan run plain go back to its state)."""
    class Wants(BatchAwareWidth):
        calls = 0

        def choose(self, available=None, match_n=0, context=None, launched=False):
            Wants.calls += 1
            self.last = (1.95 if Wants.calls % 12 < 6 else 1.02, 0.001)
            return DRAFTER, 2

    cost = CostModel((0.0,) + (0.001,) * 15, tuple(0.05 + 0.01 * w for w in range(1, 17)))
    shared = Correction(decay=0.9, trust=1e9)       # the model's prices, never corrected
    rng = random.Random(31)
    vocab = pipe.adapter.vocab_size
    prompts = [[rng.randrange(vocab - 1) for _ in range(5 + 4 * k)] for k in range(3)]
    engine = Engine(pipe.adapter, pipe.drafter, planner=Planner())
    arrivals = {0: [(k, Request(p, 24, policy=Wants(AdaptiveWidth(cost, {DRAFTER: 8}, cut=False),
                                                     shared),
                                keep_state=True)) for k, p in enumerate(prompts)]}
    out = run(engine, arrivals)
    for k, p in enumerate(prompts):
        assert out[k] == (mlx_lm_greedy(pipe.target, p, 24), "length"), k
    drafted = sum(len(st.drafting(DRAFTER)) for st in engine.stats.values())
    assert engine.vetoed >= 5 and engine.launches >= 5 and drafted >= 6
    for rid in range(3):
        state = engine.pop_state(rid)
        rows = sum(f.shape[1] for f in state.pending)
        assert state.dcache[0].offset + rows == len(state.tokens), rid


def test_batch_aware_policies_decoding_plainly_launch_ahead_exactly(pipe):
    """Batch-aware policies whose drafter does not pay (the random drafter accepts nothing)
    decode plainly after their first cycles: those steps are launched ahead as alone
    (`BatchAwareWidth.next_plain`), probes and lookup runs still happen between them, and
    every sequence is exact."""
    rng = random.Random(23)
    vocab = pipe.adapter.vocab_size
    shared, base = Correction(decay=0.9), copy.deepcopy(pipe.width_policy())
    prompts = [[rng.randrange(vocab - 1) for _ in range(4 + 5 * k)] for k in range(5)]
    arrivals = {}
    for k, p in enumerate(prompts):
        policy = BatchAwareWidth(base.for_sequence(), shared)
        arrivals.setdefault(k // 2, []).append((k, Request(p, 40, policy=policy, lookup=True)))
    engine = Engine(pipe.adapter, pipe.drafter, planner=Planner())
    out = run(engine, arrivals)
    assert engine.launches >= 5
    for k, p in enumerate(prompts):
        assert out[k] == (mlx_lm_greedy(pipe.target, p, 40), "length"), k


class CountingDrafter:
    """The pipeline's drafter, wrapped: records the sequences of each batched pass."""

    def __init__(self, drafter):
        self.inner, self.passes = drafter, []
        self.args, self.context_window = drafter.args, drafter.context_window

    def make_cache(self):
        return self.inner.make_cache()

    def skip_context(self, cache, n):
        self.inner.skip_context(cache, n)

    def propose_batch(self, target, drafts):
        self.passes.append(len(drafts))
        return self.inner.propose_batch(target, drafts)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.9, top_p=0.95)])
def test_one_drafter_pass_per_step_is_exact(pipe, sampling):
    """Six sequences drafting with the random DFlash 2 drafter at different widths (and one
    plain, one with lookup) join at different steps: each step runs at most one drafter pass,
    several sequences share passes, and every sequence generates what it does alone (greedy:
    mlx-lm's output; seeded sampling: the same sample)."""
    rng = random.Random(14)
    vocab = pipe.adapter.vocab_size
    specs = [(FixedWidth(4), False), (FixedWidth(16), False), (FixedWidth(2), False),
             (FixedWidth(1), False), (FixedWidth(7), True), (FixedWidth(9), False)]
    drafter = CountingDrafter(pipe.drafter)
    engine = Engine(pipe.adapter, drafter, planner=Planner())
    arrivals, refs = {}, {}
    for k, (policy, lookup) in enumerate(specs):
        prompt = [rng.randrange(vocab - 1) for _ in range(3 + 6 * k)]
        refs[k] = [t for new in stream_tokens(
            pipe.adapter, pipe.drafter, prompt, max_tokens=24, sampling=sampling,
            planner=Planner(),
            policy=policy, stop_ids=set(), lookup=LookupConfig() if lookup else None,
            seed=200 + k) for t in new]
        arrivals.setdefault(k // 2, []).append(
            (k, Request(prompt, 24, sampling, policy=policy, lookup=lookup, seed=200 + k)))
    out = run(engine, arrivals)
    for k, ref in refs.items():
        assert out[k] == (ref, "length"), k
    assert len(drafter.passes) <= len(engine.history)
    assert max(drafter.passes) >= 4, drafter.passes


def test_plain_batch_launched_ahead_is_exact(pipe):
    """An all-plain batch launches its next step before reading one (as mlx-lm does): stops,
    max_tokens of 1 and 2, a cancel, joiners arriving while a step is in flight and a kept
    state all stay as alone, and no token computed ahead is emitted."""
    rng = random.Random(21)
    vocab = pipe.adapter.vocab_size
    engine = Engine(pipe.adapter, pipe.drafter, planner=Planner())
    arrivals, refs, prompts = {}, {}, {}
    for k, (n, max_tokens, at) in enumerate([(7, 30, 0), (19, 24, 0), (4, 2, 0), (12, 30, 0),
                                             (25, 1, 3), (9, 20, 5), (15, 26, 5), (6, 30, 9)]):
        prompts[k] = prompt = [rng.randrange(vocab - 1) for _ in range(n)]
        ref = mlx_lm_greedy(pipe.target, prompt, max_tokens)
        stop = frozenset()
        if k in (1, 5):                        # stopped early by a token it emits
            stop = frozenset([ref[len(ref) // 2]])
            ref = ref[: ref.index(ref[len(ref) // 2]) + 1]
        refs[k] = (ref, "stop" if stop else "length")
        arrivals.setdefault(at, []).append(
            (k, Request(prompt, max_tokens, policy=FixedWidth(1), stop_ids=stop,
                        keep_state=k == 1)))
    in_flight = []                           # a launched step pending as each one arrives
    out = run(engine, arrivals, cancel_at={7: [3]},
              before_add=lambda k: in_flight.append(engine._ahead is not None))
    assert engine.launches >= 10 and sum(in_flight) >= 2
    assert out[3][1] == CANCELLED and 0 < len(out[3][0]) < 30
    assert out[3][0] == refs[3][0][: len(out[3][0])]
    for k, ref in refs.items():
        if k != 3:
            assert out[k] == ref, k
    assert engine.caches.cache is None and engine._ahead is None
    # the kept state holds a launched row too (as alone): its cache matches its tokens, and
    # it restarts exactly
    state = engine.pop_state(1)
    assert state.tokens in (prompts[1] + out[1][0], prompts[1] + out[1][0][:-1])
    assert all(c.offset == len(state.tokens) for c in state.cache)
    follow = state.tokens + [5, 6, 7]
    engine = Engine(pipe.adapter, pipe.drafter, planner=Planner())
    again = run(engine, {0: [(0, Request(follow, 12, policy=FixedWidth(1), state=state))]})
    assert again[0] == (mlx_lm_greedy(pipe.target, follow, 12), "length")


def test_a_sequence_ending_by_length_keeps_the_others_launch_chain(pipe):
    """A plain sequence that ends by max_tokens runs one launched row more (discarded), so the
    others' chain of launched steps goes on through its end; outputs and its kept state stay
    as alone."""
    rng = random.Random(23)
    vocab = pipe.adapter.vocab_size
    prompts = [[rng.randrange(vocab - 1) for _ in range(n)] for n in (8, 14, 5)]
    engine = Engine(pipe.adapter, pipe.drafter, planner=Planner())
    ids = [engine.add(Request(p, m, policy=FixedWidth(1), keep_state=k == 0))
           for k, (p, m) in enumerate(zip(prompts, (6, 16, 11)))]
    out = {rid: [] for rid in ids}
    chained = []                           # per step: was a launched step pending after it
    while engine.running or engine.waiting:
        events = engine.step()
        for ev in events:
            out[ev.id].extend(ev.tokens)
        chained.append((engine._ahead is not None, [ev.id for ev in events if ev.finish]))
    for rid, p, m in zip(ids, prompts, (6, 16, 11)):
        assert out[rid] == mlx_lm_greedy(pipe.target, p, m), rid
    ends = [i for i, (_, gone) in enumerate(chained) if gone and i < len(chained) - 1]
    assert len(ends) == 2 and all(chained[i][0] for i in ends)   # launched across both ends
    state = engine.pop_state(ids[0])
    assert state.tokens == prompts[0] + out[ids[0]]        # its launched row is in its cache
    assert all(c.offset == len(state.tokens) for c in state.cache)
    follow = state.tokens + [5, 6, 7]
    engine = Engine(pipe.adapter, pipe.drafter, planner=Planner())
    again = run(engine, {0: [(0, Request(follow, 12, policy=FixedWidth(1), state=state))]})
    assert again[0] == (mlx_lm_greedy(pipe.target, follow, 12), "length")


def test_a_first_token_is_handed_out_before_the_step_decodes(pipe):
    """`step(started=...)` hands each starting sequence's first token out as soon as it is
    sampled (before the join and the decode step: the server's time to first token), in
    place of returning it; what every sequence writes stays as alone. A prompt that ends at
    its first token (max_tokens 1) comes back with the step's events, finished."""
    rng = random.Random(29)
    vocab = pipe.adapter.vocab_size
    prompts = [[rng.randrange(vocab - 1) for _ in range(n)] for n in (9, 6, 12)]
    limits = (7, 1, 10)
    engine = Engine(pipe.adapter, pipe.drafter, planner=Planner())
    ids = [engine.add(Request(p, m, policy=FixedWidth(1))) for p, m in zip(prompts, limits)]
    out, handed = {rid: [] for rid in ids}, set()

    def started(ev):
        assert ev.finish is None and len(ev.tokens) == 1 and out[ev.id] == []
        assert all(seq.id != ev.id for seq in engine.rows)   # before it joins and decodes
        handed.add(ev.id)
        out[ev.id].extend(ev.tokens)

    while engine.running or engine.waiting:
        for ev in engine.step(started=started):
            assert ev.id != ids[1] or ev.finish == "length"
            out[ev.id].extend(ev.tokens)
    assert handed == {ids[0], ids[2]}
    for rid, p, m in zip(ids, prompts, limits):
        assert out[rid] == mlx_lm_greedy(pipe.target, p, m), rid


def test_plain_batch_launched_ahead_samples_as_alone(pipe):
    """Seeded sampled plain sequences launched ahead in a batch draw what they draw alone
    (the launched step's key is the one alone launches with)."""
    rng = random.Random(22)
    vocab = pipe.adapter.vocab_size
    sampling = Sampling(temperature=0.9, top_p=0.95)
    arrivals, refs = {}, {}
    for k in range(4):                      # the last one greedy, beside the sampled ones
        prompt = [rng.randrange(vocab - 1) for _ in range(5 + 6 * k)]
        s = sampling if k < 3 else Sampling()
        refs[k] = [t for new in stream_tokens(
            pipe.adapter, pipe.drafter, prompt, max_tokens=20, sampling=s,
            planner=Planner(), policy=FixedWidth(1), stop_ids=set(), seed=200 + k) for t in new]
        arrivals.setdefault(2 * (k % 2), []).append(
            (k, Request(prompt, 20, s, FixedWidth(1), seed=200 + k)))
    engine = Engine(pipe.adapter, pipe.drafter, planner=Planner())
    out = run(engine, arrivals)
    assert engine.launches >= 10
    for k, ref in refs.items():
        assert out[k] == (ref, "length"), k
    assert refs[3] == mlx_lm_greedy(pipe.target, prompt, 20)
