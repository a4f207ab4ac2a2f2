"""The lookup at long context, by exact replay: the target's greedy outputs on the long-context
prompt sets (generated once, cached in --outputs), then the lookup-or-plain policy replayed on
them for each matching rule, priced by the calibrated cost model at the prompt's context.

Rules: the longest recurring suffix from `min_n` tokens (2 or 3), a minimum that grows with the
context (`LookupConfig.grow_from`: one more per doubling from 2k or from 1k tokens), the same
kept on the source being copied while it agrees (`LookupConfig.sticky`, the default), and the
most recent occurrence of any suffix long enough (the shortest one's: every
occurrence of a longer suffix is one of the shorter). The policy is `AdaptiveWidth` with the
lookup alone, its estimates learnt from its cycles and from `LookupShadow` as in the engine, its
plain
steps run in launch chains as the engine runs them (`AdaptiveWidth.launch_next`; a step that
starts a chain pays `CostModel.relaunch`). Per set and rule: the lookup's cycles, tau, and the
estimated speedup over plain decoding at that context (plain: one unbroken chain).

    python benchmarks/lookup_context.py --sizes 2k --max-tokens 96 --outputs /tmp/lk.json
    python benchmarks/lookup_context.py --sizes 2k,4k,8k --copy
    python benchmarks/lookup_context.py --outputs /tmp/lk.json --costs /tmp/cost.json \
        --shared --repeats 3 --rules default

`--shared` keeps one policy for the whole run, every set and repeat in turn, as a pipeline
does for its requests (what one request learnt, the next starts from); `--order` names the
sets replayed and their order (the bench runs a set's rounds in a row, set after set);
`--costs` keeps the calibration in a file, so that runs of two versions of the policy price
alike.

`--copy` replays, in place of the model's outputs, the answer a model that copies would give
to each long-edit prompt: its function, renamed, in a code block (no generation: only the
tokenizer runs; the embedded 135M target does not copy at these lengths).
"""

from __future__ import annotations

import argparse
import json
import os

import dflash2_mlx
from dflash2_mlx.policy.adaptive import AdaptiveWidth, LOOKUP, PLAIN, LookupShadow
from dflash2_mlx.policy.calibration import load_or_measure_costs
from dflash2_mlx.policy.costs import CostModel
from dflash2_mlx.policy.calibration import measure_costs
from dflash2_mlx.decode.sequence import PlainStepTimer
from dflash2_mlx.decode.lookup import LookupConfig, LookupIndex
from dflash2_mlx.bench.prompt_sets import LONG_SIZES, PROMPT_SETS, _last_function, long_edit_prompts


class RecentIndex(LookupIndex):
    """The most recent occurrence of a recurring suffix of min_n..max_n tokens (reported with
    the longest n that recurs there, for the policy's per-length estimates)."""

    def match(self):
        found = super().match()
        if found is None:
            return None
        n, shortest = found[0], self.config.shortest(len(self.tokens))
        return n, self.last[shortest][tuple(self.tokens[-shortest:])]


def _copy_answer(pipe, prompt: str) -> tuple[list[int], list[int]]:
    """(prompt ids, the ids of its last function renamed as the edit asks, in a code block)."""
    code = prompt.split("```python\n", 1)[1].rsplit("```", 1)[0]
    name = _last_function(code)
    lines = code.splitlines()
    start = max(i for i, line in enumerate(lines) if line.lstrip().startswith(f"def {name}("))
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip()
                and len(lines[i]) - len(lines[i].lstrip()) <= indent), len(lines))
    body = "\n".join(lines[start:end]).rstrip().replace(name, f"{name}_checked")
    answer = f"```python\n{body}\n```\nThe function is renamed to `{name}_checked`."
    return pipe.encode(prompt), pipe.tokenizer.encode(answer, add_special_tokens=False)


def replay(prompt, output, index, policy, cost):
    """The lookup-or-plain policy over `output` -> (tokens, seconds, cycles, accepted). Plain
    steps run in launch chains as in the engine (`engine.stream_tokens`): a plain step
    launches the next one when the policy says so (`launch_next`), a launched step is plain
    whatever the policy chooses, and a step not launched pays the graph build a chain hides
    (`CostModel.relaunch`)."""
    policy = policy.for_sequence()          # a request of its own (shared estimates)
    shadow = LookupShadow(policy, LOOKUP)
    n, seconds, cycles, accepted, launched = 1, 0.0, 0, 0, False
    clock = PlainStepTimer()
    while n < len(output):
        context = len(prompt) + n
        room = len(output) - n + 1
        found = index.propose(min(16, room) - 1) if room > 1 else None
        match, guess = found or (0, None)
        available = {LOOKUP: min(16, room)} if guess else {}
        choice = policy.choose(available, match, context, launched)
        source, w = (PLAIN, 1) if launched else choice
        a = 0
        if source == LOOKUP:
            while a < w - 1 and guess[a] == output[n + a]:
                a += 1
            cycles, accepted = cycles + 1, accepted + a
        else:
            shadow.offer(guess, match, context)
        new = output[n : n + a + 1]
        took = cost.cycle(w, source if w > 1 else PLAIN, context)
        timed = took
        if source == PLAIN:
            if not launched:                        # a chain starts: its build unhidden
                took += cost.relaunch
            was, launched = launched, room > 1 and policy.launch_next(choice, available, match,
                                                                       context + 1)
            timed = clock.plain(took, was, launched)       # the engine's view of the chain
            timed = timed if clock.long(launched) else None
        else:
            launched = False
        policy.update(source, w, a, timed, match, context)
        seconds += took
        index.extend(new)
        shadow.follow(source, w, a, guess, match, context)              # as the engine
        shadow.commit(new)
        n += len(new)
    return len(output) - 1, seconds, cycles, accepted


def replay_fixed(prompt, output, index, width, cost) -> float:
    """A fixed-width lookup over `output` (`width` rows wherever the lookup proposes, plain
    elsewhere, launching no next step: any may draft) -> seconds, as the cost model prices
    them."""
    n, seconds = 1, 0.0
    while n < len(output):
        context, room = len(prompt) + n, len(output) - n + 1
        found = index.propose(min(16, room) - 1) if room > 1 else None
        w, a = (min(width, room), 0) if found else (1, 0)
        while found and a < w - 1 and found[1][a] == output[n + a]:
            a += 1
        seconds += cost.cycle(w, LOOKUP if w > 1 else PLAIN, context)
        if w == 1 and width > 1:            # it launches no next step: built unhidden
            seconds += cost.relaunch
        index.extend(output[n : n + a + 1])
        n += a + 1
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2k")
    ap.add_argument("--kinds", default="edit,log,agent",
                    help="long-context sets per size: edit, log, agent, quote")
    ap.add_argument("--prompts", type=int, default=1, help="per set")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--outputs", default=None, help="cache of the greedy outputs (JSON)")
    ap.add_argument("--copy", action="store_true", help="replay copying answers (see above)")
    ap.add_argument("--fresh", action="store_true",
                    help="calibrate now (the cached one may have been timed under load)")
    ap.add_argument("--costs", default=None,
                    help="the cost model's JSON: read if it exists, else calibrated and written")
    ap.add_argument("--shared", action="store_true", help="one policy for the whole run")
    ap.add_argument("--repeats", type=int, default=1, help="replays of each set")
    ap.add_argument("--rules", default="all", choices=("all", "default"))
    ap.add_argument("--fixed", default="",
                    help="also replay fixed lookup widths per rule, e.g. 8,16 (hindsight)")
    ap.add_argument("--order", default="",
                    help="replay only these sets, in this order (names as printed)")
    a = ap.parse_args()
    pipe = dflash2_mlx.load()
    if a.costs and os.path.exists(a.costs):
        cost = CostModel.from_dict(json.load(open(a.costs)), pipe.drafter.args.block_size,
                                   pipe.max_width(True))
        if cost is None:
            raise ValueError(f"{a.costs}: not a cost model of this pair (CostModel.to_dict)")
    else:
        cost = (measure_costs if a.fresh else load_or_measure_costs)(pipe, pipe.max_width(True))
        if a.costs:
            with open(a.costs, "w") as f:
                json.dump(cost.to_dict(), f)
    print(f"verify ms at w = 1, 4, 16 at 2k tokens: "
          f"{', '.join(f'{1e3 * cost.verify(w, 2048):.0f}' for w in (1, 4, 16))}")
    runs = json.load(open(a.outputs)) if a.outputs and os.path.exists(a.outputs) else {}
    copies = {f"copy-edit-{size}": [_copy_answer(pipe, p) for p in
                                    long_edit_prompts(a.prompts, LONG_SIZES[size])]
              for size in (a.sizes.split(",") if a.copy else ())}
    runs = {**copies, **runs}             # (--shared: the copying answers first)
    for size in () if a.copy else a.sizes.split(","):
        for kind in a.kinds.split(","):
            name = f"long-{kind}-{size}"
            if name in runs:
                continue
            runs[name] = []
            for p in PROMPT_SETS[name](a.prompts):
                ids = pipe.encode(p)
                out = pipe.generate(ids, max_tokens=a.max_tokens, block_size=1,
                                    lookup=False).tokens
                runs[name].append((ids, out))
            print(f"{name}: {len(runs[name])} greedy outputs", flush=True)
            if a.outputs:
                with open(a.outputs, "w") as f:
                    json.dump(runs, f)
    if a.order:
        missing = [name for name in a.order.split(",") if name not in runs]
        if missing:
            raise SystemExit(f"--order: no outputs for {', '.join(missing)} (have: "
                             f"{', '.join(runs)}; --sizes and --kinds generate them)")
        runs = {name: runs[name] for name in a.order.split(",")}
    rules = {"longest, min_n 2": (LookupIndex, LookupConfig(2, 8, 16, None, False)),
             "longest, min_n 3": (LookupIndex, LookupConfig(3, 8, 16, None, False)),
             "longest, +1 per doubling from 2k": (LookupIndex,
                                                  LookupConfig(2, 8, 16, 2048, False)),
             "longest, +1 per doubling from 1k": (LookupIndex, LookupConfig(sticky=False)),
             "sticky, +1 per doubling from 1k (default)": (LookupIndex, LookupConfig()),
             "most recent, min_n 2": (RecentIndex, LookupConfig(2, 8, 16, None, False)),
             "most recent, +1 per doubling from 1k": (RecentIndex,
                                                      LookupConfig(sticky=False))}
    if a.rules == "default":
        rules = {rule: rules[rule] for rule in rules if rule.endswith("(default)")}
    shared = {rule: AdaptiveWidth(cost, {LOOKUP: 16}) for rule in rules}
    fixed = [int(w) for w in a.fixed.split(",") if w]
    print("| set | context | rule | lookup cycles | tau | est. speedup | per round |"
          + "".join(f" fixed {w} |" for w in fixed))
    print("|---|---|---|---|---|---|---|" + "---|" * len(fixed))
    for name, pairs in runs.items():
        for rule in rules:
            cycles = acc = 0
            at_width = dict.fromkeys(fixed, 0.0)
            rounds = [[0.0, 0.0] for _ in range(a.repeats)]    # plain, replayed seconds
            kind, config = rules[rule]
            for r in range(a.repeats):
                for ids, out in pairs:
                    index = kind(config)
                    index.extend(ids + out[:1])
                    policy = shared[rule] if a.shared else AdaptiveWidth(cost, {LOOKUP: 16})
                    _, s, c, k = replay(ids, out, index, policy, cost)
                    cycles, acc = cycles + c, acc + k
                    rounds[r][0] += sum(cost.cycle(1, PLAIN, len(ids) + j)
                                        for j in range(1, len(out)))
                    rounds[r][1] += s
                    if r:
                        continue
                    for w in fixed:
                        at_width[w] += replay_fixed(ids, out, kind(config, ids + out[:1]), w,
                                                    cost)
            ctx = sum(len(ids) for ids, _ in pairs) // len(pairs)
            tau = (acc + cycles) / cycles if cycles else 1.0
            plain, seconds = (sum(col) for col in zip(*rounds))
            once = rounds[0][0]                 # fixed widths: one round (they learn nothing)
            print(f"| {name} | {ctx} | {rule} | {cycles} | {tau:.2f} | "
                  f"{plain / seconds:.2f}x | {', '.join(f'{p / s:.2f}' for p, s in rounds)} |"
                  + "".join(f" {once / at_width[w]:.2f}x |" for w in fixed), flush=True)


if __name__ == "__main__":
    main()
