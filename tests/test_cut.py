"""Widths chosen after drafting (`policy.acceptance`, `policy.cut`, `Planner.cut`): the
acceptance model learns what sure drafts say, the calibration figures are right, the cut keeps
what pays alone and in a batch, and output stays exact: greedy equal to mlx-lm's with `auto`
cutting, and sampled output distributed as the target's when rows are cut by their drafts'
sureness (chi-square)."""

from __future__ import annotations

import itertools
import random

import mlx.core as mx
import numpy as np
import pytest

from dflash2_mlx.decode.stats import DRAFTER, LOOKUP, PLAIN, Cycle, GenerationStats
from dflash2_mlx.model.sampling import Sampling
from dflash2_mlx.policy.acceptance import (MatchModel, SurenessModel, calibration,
                                          expected_tokens, predicted)
from dflash2_mlx.policy.adaptive import AdaptiveWidth
from dflash2_mlx.policy.batch import BatchAwareWidth
from dflash2_mlx.policy.costs import Correction, CostModel
from dflash2_mlx.policy.cut import cut_alone, cut_batch
from dflash2_mlx.policy.planner import Planner
import dflash2_mlx
from test_exactness import mlx_lm_greedy
from test_sampling import N, chi2, chi2_threshold, exact_joint, speculative_counts, tiny  # noqa

# a verify costs a fixed part and a part per row; the drafter pass 10 ms
COST = CostModel((0.0,) + (0.01,) * 15, tuple(0.05 + 0.02 * w for w in range(1, 17)))


@pytest.fixture(scope="module")
def pipe(llama_dir, dflash2_dir):
    return dflash2_mlx.load(str(llama_dir), str(dflash2_dir))


def test_the_sureness_model_learns_what_sure_drafts_say():
    """Drafts accepted with probability sigmoid(3 * top log-prob + 2): after 3000 blocks the
    model ranks them (AUC > 0.75) and is calibrated (ECE < 0.05) on the next 1000."""
    rng = np.random.default_rng(0)
    model = SurenessModel(8)

    def block():
        sure = np.stack([-rng.exponential(0.8, 7), rng.exponential(2.0, 7)], axis=1)
        a = 1 / (1 + np.exp(-(3 * sure[:, 0] + 2)))
        accepted = next((k for k in range(7) if rng.random() > a[k]), 7)
        return sure, accepted

    for _ in range(3000):
        sure, accepted = block()
        model.learn(sure, 8, accepted)
    records = []
    for _ in range(1000):
        sure, accepted = block()
        prefix = np.cumprod(model.predict(sure))
        records += [(k, prefix[k - 1], k <= accepted) for k in range(1, 8)]
    c = calibration(records)
    assert c["auc"] > 0.75 and c["ece"] < 0.05, c
    assert model.seen == 3000 and 0 < model.loss < 0.7


def test_the_match_model_learns_how_long_matches_fare(llama_dir):
    """Lookup drafts whose positions are accepted with probability 0.9 after long matches and
    0.3 after short ones: after 2000 rows the model ranks a long match's prefixes above a short
    one's (AUC > 0.7) and is calibrated (ECE < 0.05) on the next 1000; untried positions copy
    the estimate before them; a fixed-width pipeline's lookup predictions come from it."""
    rng = np.random.default_rng(1)
    model = MatchModel(8)

    def row():
        match = int(rng.choice([1, 2, 12, 16]))
        a = 0.9 if match >= 12 else 0.3
        return match, next((k for k in range(7) if rng.random() > a), 7)

    for _ in range(2000):
        match, accepted = row()
        model.learn(match, 8, accepted)
    records = []
    for _ in range(1000):
        match, accepted = row()
        prefix = np.cumprod(model.predict(match, 7))
        records += [(k, prefix[k - 1], k <= accepted) for k in range(1, 8)]
    c = calibration(records)
    assert c["auc"] > 0.7 and c["ece"] < 0.05, c
    assert model.predict(12, 3)[0] > 0.8 > 0.4 > model.predict(1, 3)[0]
    fresh = MatchModel(4)
    fresh.learn(5, 2, 1)                  # one row of width 2: position 1 hit
    a = fresh.predict(5, 4)
    assert a[0] > 0.5 and a[1] == a[2] == a[3] == a[0]
    # at a fixed width (no policy estimates) the lookup's predictions are the pipeline's model
    copier = dflash2_mlx.load(str(llama_dir), "none")          # the lookup alone
    g = copier.generate("def add(a, b):", max_tokens=64, block_size=6)
    lookup = g.stats.calibration_records(LOOKUP)
    assert lookup and copier.matches.tries.sum() > 0
    assert any(abs(p - 0.5) > 1e-6 for k, p, _ in lookup if k == 1), lookup


def test_calibration_figures():
    """AUC against the pairwise count it stands for (ties half); ECE 0 where every bin's
    prediction is its frequency, |p - y| for one record."""
    rng = random.Random(3)
    records = [(1, round(rng.random(), 1), rng.random() < 0.4) for _ in range(200)]
    pos = [p for _, p, y in records if y]
    neg = [p for _, p, y in records if not y]
    pairs = sum((a > b) + 0.5 * (a == b) for a, b in itertools.product(pos, neg))
    assert calibration(records)["auc"] == pytest.approx(pairs / (len(pos) * len(neg)))
    fair = [(1, 0.25, i % 4 == 0) for i in range(40)] + [(2, 0.75, i % 4 != 0) for i in range(40)]
    c = calibration(fair)
    assert c["ece"] == pytest.approx(0.0) and c["positions"][2]["mean_observed"] == 0.75
    assert calibration([(1, 0.9, False)])["ece"] == pytest.approx(0.9)
    assert calibration([])["n"] == 0


def test_predictions_come_from_the_head_the_model_or_the_policy():
    model = SurenessModel(8)
    sure = np.array([[-0.1, 5.0], [-2.0, 0.1]])
    assert predicted(DRAFTER, 3, sure, np.array([0.9, 0.2]), model,
                     lambda: [0.5]).tolist() == [0.9, 0.2]
    assert np.allclose(predicted(DRAFTER, 3, sure, None, model, lambda: [0.5]),
                       model.predict(sure))
    assert predicted(LOOKUP, 4, None, None, model, lambda: [0.8, 0.6]).tolist() == [0.8, 0.6, 0.6]
    a = model.predict(sure)
    assert a[0] > a[1]                            # the prior trusts sure positions
    assert expected_tokens(np.array([0.5, 0.5])).tolist() == [1.0, 1.5, 1.75]


def test_cut_alone_keeps_what_pays():
    policy = AdaptiveWidth(COST, {DRAFTER: 8})
    sure_all = np.full(7, 0.97)
    assert cut_alone(policy, DRAFTER, 8, sure_all, None) == 8
    assert cut_alone(policy, DRAFTER, 8, np.full(7, 0.02), None) == 1    # plain: nothing pays
    mixed = np.array([0.95, 0.9, 0.05, 0.9, 0.9, 0.9, 0.9])
    K = cut_alone(policy, DRAFTER, 8, mixed, None)
    assert K == 3
    # what it keeps is the best rate on offer
    E = expected_tokens(mixed)
    rates = [E[0] / (policy.cycle_cost(1, PLAIN) + COST.draft(8))] + \
        [E[k - 1] / policy.cycle_cost(k, DRAFTER) for k in range(2, 9)]
    assert K == int(np.argmax(rates)) + 1


def test_cut_batch_chooses_the_steps_width_jointly():
    """A step costs what its widest row costs: one sure row and three unsure ones verify at
    the width the sum of their expected tokens pays for; a fixed row holds T at its width."""
    cheap_rows = CostModel(COST.draft_table, tuple(0.05 + 0.002 * w for w in range(1, 33)))
    batch = BatchAwareWidth(AdaptiveWidth(cheap_rows, {DRAFTER: 8}), Correction(decay=0.9))
    sure, unsure = np.full(7, 0.95), np.full(7, 0.1)
    widths = [8, 8, 8, 8]
    T = cut_batch(batch, widths, [sure, unsure, unsure, unsure], [False] * 4, None, 0.01)
    best = max(range(1, 9), key=lambda t: (expected_tokens(sure)[t - 1]
                                          + 3 * expected_tokens(unsure)[t - 1])
               / batch.step_cost(4, t, None, 0.01))
    assert T == best and 1 < T
    assert cut_batch(batch, widths, [unsure] * 4, [False] * 4, None, 0.01) == 1
    assert cut_batch(batch, [8, 5], [unsure, unsure], [False, True], None, 0.01) == 5


def test_auto_cuts_rows_and_stays_exact(pipe):
    """The random drafter is rarely right: `auto` cuts its blocks (rows drafted, not verified),
    every output still mlx-lm's, alone and batched; the predictions are in the stats."""
    prompts = ["def add(a, b):", "Once upon a time", "1, 2, 3, 4, 1, 2, 3,"]
    stop = pipe.tokenizer.eos_token_ids
    refs = [mlx_lm_greedy(pipe.target, pipe.encode(p), 24, stop) for p in prompts]
    cut, predicted_n = 0, 0
    for p, ref in zip(prompts, refs):
        g = pipe.generate(p, max_tokens=24, block_size="auto")
        assert g.tokens == ref
        cut += g.stats.cut_rows
        predicted_n += len(g.stats.calibration_records())
    gens = pipe.generate_batch(prompts, max_tokens=24, block_size="auto")
    assert [g.tokens for g in gens] == refs
    assert cut > 0 and predicted_n > 0


class ThresholdPlanner(Planner):
    """Cuts each drafter row before its first position whose top log-probability is under a
    threshold drawn at random for the row: a rule of the drafter's sureness and of chance
    alone, both independent of the drafted tokens."""

    rng = random.Random(5)

    def cut(self, drafted):
        widths = super().cut(drafted)
        out = []
        for d, w in zip(drafted, widths):
            if d is None or d.sureness is None or w < 2:
                out.append(w)
                continue
            lp = np.array(d.sureness[0, :, 0])
            c = lp.min() - 0.5 + self.rng.random() * (lp.max() - lp.min() + 1.0)
            out.append(1 + next((k for k, x in enumerate(lp) if x < c), len(lp)))
        self.planned = [p._replace(width=w, source=PLAIN if w == 1 else p.source)
                        for p, w in zip(self.planned, out)]
        return out


@pytest.mark.slow  # 40-60 s a case: 2,000 runs
@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
def test_rows_cut_by_sureness_sample_the_targets_distribution(tiny, kind):  # noqa: F811
    """Chi-square of the first three tokens when each block is cut by its sureness: cuts of
    every length happen, and the joint distribution is the target's."""
    model, drafters = tiny
    sampling = Sampling(1.0)
    stats = []

    class Recording(ThresholdPlanner):
        def cut(self, drafted):
            out = super().cut(drafted)
            stats.extend(out)
            return out

    counts, accepted = speculative_counts(model, drafters[kind], sampling, N,
                                          planner=Recording)
    assert {1, 2, 3} <= set(stats), "cuts of every length"
    assert {0, 1} <= set(accepted)
    stat, df = chi2(counts, exact_joint(model, sampling), N)
    assert stat < chi2_threshold(df), f"chi2={stat:.1f} df={df}"
