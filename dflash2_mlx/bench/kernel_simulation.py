"""What the width policy would choose on a Mac with and without the custom verify kernels: a
simulation, not a measurement (docs/kernels.md has its table).

    python -m dflash2_mlx.bench.kernel_simulation            # the Markdown table of the docs
    python -m dflash2_mlx.bench.kernel_simulation --draft 0.25

Verify costs, in decode steps (a width-1 forward = 1), shaped like mlx-dspark's published curve
on Qwen3.8-27B at 4 bits (issue 51): stock 1.65 at widths 5-8 and 3.2 rising to 4.1 at 9-16;
with its custom kernels 1.4 and 2.4. Widths 2-4 are not published: a straight line from 1 to
the 5-8 level. The drafter's pass costs `--draft` decode steps at every width (a block is one
forward). Acceptance: conditional alpha_k falling by 0.01 per position, its level set so that
a 16-row cycle accepts tau tokens (the DFlash 2 paper: 5.97 on Qwen3.5-4B; 4.27 for its
DFlash-style baseline on Qwen3-4B GSM8K).

The policy itself (`policy.AdaptiveWidth`) picks the width, from a `CostModel` of these costs
and acceptance counts set to the alphas; the expected speedup is its tokens per second over
plain decoding's.
"""

from __future__ import annotations

import argparse

from dflash2_mlx.decode.stats import DRAFTER, PLAIN
from dflash2_mlx.policy.adaptive import AdaptiveWidth
from dflash2_mlx.policy.costs import CostModel

BLOCK = 16
TAUS = (5.97, 4.27)
EVIDENCE = 1e6           # tries per position: the counts outweigh the policy's prior


def verify_curve(mid: float, wide_from: float, wide_to: float) -> list[float]:
    """Verify cost per width 1..16 in decode steps: 1 at width 1, a line to `mid` at 5,
    `mid` through 8, then `wide_from` at 9 rising linearly to `wide_to` at 16."""
    out = []
    for w in range(1, BLOCK + 1):
        if w <= 4:
            out.append(1 + (mid - 1) * (w - 1) / 4)
        elif w <= 8:
            out.append(mid)
        else:
            out.append(wide_from + (wide_to - wide_from) * (w - 9) / (BLOCK - 9))
    return out


CURVES = {"stock": verify_curve(1.65, 3.2, 4.1), "custom": verify_curve(1.4, 2.4, 2.4)}


def expected_tokens(alphas: list[float], width: int) -> float:
    """E(w) = 1 + sum_{k<w} prod_{j<=k} alpha_j."""
    tokens, p = 1.0, 1.0
    for a in alphas[:width - 1]:
        p *= a
        tokens += p
    return tokens


def alphas_for(tau: float, fall: float = 0.01) -> list[float]:
    """alpha_k = a - fall * (k - 1), with a found so that E(16) = tau."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        alphas = [max(a - fall * k, 0.0) for k in range(BLOCK - 1)]
        lo, hi = (a, hi) if expected_tokens(alphas, BLOCK) < tau else (lo, a)
    return [max(lo - fall * k, 0.0) for k in range(BLOCK - 1)]


def policy_for(curve: list[float], alphas: list[float], draft: float) -> AdaptiveWidth:
    cost = CostModel((0.0,) + (draft,) * (BLOCK - 1), tuple(curve), plain_step=curve[0])
    policy = AdaptiveWidth(cost, {DRAFTER: BLOCK})
    counts = policy.counts_for(DRAFTER)
    counts.hits = [a * EVIDENCE for a in alphas]
    counts.tries = [EVIDENCE] * len(alphas)
    return policy


def simulate(curve: list[float], tau: float, draft: float) -> dict:
    """The policy's pick and the expected speedup over plain decoding at each width."""
    alphas = alphas_for(tau)
    policy = policy_for(curve, alphas, draft)
    rates = policy._rates({DRAFTER: BLOCK}, 0, None)
    plain = rates[(PLAIN, 1)]
    source, width = policy.choose({DRAFTER: BLOCK})
    return {"pick": width if source == DRAFTER else 1,
            "speedup": {w: rates[(DRAFTER, w)] / plain for w in range(2, BLOCK + 1)},
            "tokens": {w: expected_tokens(alphas, w) for w in range(2, BLOCK + 1)}}


def table(draft: float) -> str:
    runs = {(tau, name): simulate(curve, tau, draft) for tau in TAUS for name, curve in
            CURVES.items()}
    head = "| width | verify stock / custom |" + "".join(
        f" tau {tau}: E(w) | stock | custom |" for tau in TAUS)
    lines = [head, "|" + "---:|" * (2 + 3 * len(TAUS))]
    for w in range(2, BLOCK + 1):
        row = f"| {w} | {CURVES['stock'][w - 1]:.2f} / {CURVES['custom'][w - 1]:.2f} |"
        for tau in TAUS:
            row += f" {runs[(tau, 'stock')]['tokens'][w]:.2f} |"
            for name in CURVES:
                r = runs[(tau, name)]
                mark = "**" if r["pick"] == w else ""
                row += f" {mark}{r['speedup'][w]:.2f}x{mark} |"
        lines.append(row)
    picks = "; ".join(
        f"tau {tau}: stock picks {runs[(tau, 'stock')]['pick']} "
        f"({runs[(tau, 'stock')]['speedup'][runs[(tau, 'stock')]['pick']]:.2f}x), custom picks "
        f"{runs[(tau, 'custom')]['pick']} "
        f"({runs[(tau, 'custom')]['speedup'][runs[(tau, 'custom')]['pick']]:.2f}x)"
        for tau in TAUS)
    return "\n".join(lines) + f"\n\nPolicy's picks (bold), drafter pass {draft} steps: {picks}."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", type=float, default=0.15,
                    help="the drafter's pass, in decode steps (default 0.15)")
    print(table(ap.parse_args().draft))


if __name__ == "__main__":
    main()
