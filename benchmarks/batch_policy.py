"""The batch-aware policy against all-plain on the same `Engine`, in process: tok/s, cycles
per source, and a per-step log of what each sequence chose and what the step cost against its
price.

    python benchmarks/batch_policy.py --kind code --clients 8,16 --max-tokens 96 \\
        [--systems plain,baseline,policy --baseline old_batch.py] [--log steps.jsonl]
        [--time-drafts] [--carry]

Embedded SmolLM2 pair, greedy. Per batch size, the systems run in turn on the same prompts:
`plain` (every sequence `FixedWidth(1)`, no lookup: `--block-size 1 --no-lookup`), `policy`
(`Pipeline.add_to_batch`'s `auto` policies, lookup on) and `baseline` (the engine and policy
of another version of batch.py, `--baseline`, with this version's estimates), each from a fresh
pipeline policy (the prior, as a server starts). kind: `code` (HumanEval prompts, ~150 tokens), `chat` (the everyday questions of
`dflash2-mlx bench`, ~40 tokens) or `agent` (the load
benchmark's agent system prompts, a tool list and ~3000 characters of a source file, and its
first turn: ~1k tokens). The log (JSON lines, one per decode step of the drafting runs): the
sequences, rows, slots, seconds, the step's price by the cost model and correction as the
policies saw it before the step, and per sequence (source, width, expected tokens, draft
seconds, drafter alphas 1-3). --time-drafts times each drafter pass alone (synchronously:
slower, for the price of a pass only). --carry: each system keeps its estimates and
correction from one batch size to the next, as a server keeps them from wave to wave (the
load benchmark's waves run on one server). Only ratios measured in one run mean anything on a
shared machine; the load average is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import dflash2_mlx
from dflash2_mlx.policy.adaptive import DRAFTER, LOOKUP, PLAIN
from dflash2_mlx.policy.costs import drafter_pass
from dflash2_mlx.decode.sampling import Sampling

ROOT = Path(__file__).resolve().parent.parent


def prompts(pipe, kind: str, n: int) -> list[list[int]]:
    if kind in ("code", "chat"):
        from dflash2_mlx.bench.prompt_sets import chat_prompts, humaneval_prompts

        return [pipe.encode(p) for p in (humaneval_prompts if kind == "code" else
                                         chat_prompts)(n)]
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_load import SOURCES, TOOLS, TURNS

    out = []
    for i in range(n):
        src = SOURCES[i % len(SOURCES)]
        text = (ROOT / src).read_text()[:3000]
        system = f"You are a coding agent.\n{TOOLS}\n\nThe file {src}:\n```python\n{text}\n```"
        out.append(pipe.encode(TURNS[0], system=system))
    return out


class TimedDrafter:
    """The pipeline's drafter with each pass evaluated and timed alone."""

    def __init__(self, drafter):
        self._d, self.seconds = drafter, []

    def __getattr__(self, name):
        return getattr(self._d, name)

    def propose(self, *args, **kwargs):
        import mlx.core as mx

        tic = time.perf_counter()
        p = self._d.propose(*args, **kwargs)
        mx.eval(p.tokens)
        self.seconds.append(time.perf_counter() - tic)
        return p


def load_baseline(path: Path):
    """Another version of dflash2_mlx/batch.py as a module of this package (its relative
    imports resolve here)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("dflash2_mlx._baseline_batch", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(pipe, ids, max_tokens: int, system: str, log, time_drafts: bool,
        baseline=None, carried: dict | None = None) -> dict:
    """carried: None, a fresh estimate and correction (as a server starts); else a dict per
    system of the pipeline's policy and the correction from this system's previous run (as a
    server that ran the previous wave)."""
    import copy

    if carried is None or system not in carried:
        pipe._policy = None                   # a fresh estimate per run, as a server starts
        shared = pipe.batch_correction()
    else:
        pipe._policy, shared = carried[system]
    policies = {}
    if system == "baseline":
        engine = baseline.Engine(pipe.adapter, pipe.drafter, lookup=pipe.lookup_config,
                                 prefill_step_size=pipe.prefill_step_size)
    else:
        engine = pipe.batch_engine()
    if time_drafts and system != "plain":
        engine.drafter = TimedDrafter(engine.drafter)
    for p in ids:
        if system == "baseline":
            policy = baseline.BatchAwareWidth(pipe.width_policy().for_sequence(), shared)
            rid = engine.add(baseline.Request(p, max_tokens, Sampling(), policy,
                                              pipe.stop_ids(), True))
        else:
            rid = pipe.add_to_batch(engine, p, max_tokens, Sampling(),
                                    "auto" if system == "policy" else 1, shared,
                                    lookup=system == "policy", stop_ids=pipe.stop_ids(),
                                    seed=None)
        policies[rid] = engine.queue[-1].policy
    tic = time.perf_counter()
    out: dict[int, list[int]] = {}
    while engine.running or engine.waiting:
        before = copy.deepcopy(shared.table)
        steps_before = {rid: len(st.steps) for rid, st in engine.stats.items()}
        done = len(engine.history)
        drafts_before = len(getattr(engine.drafter, "seconds", []))
        for ev in engine.step():
            out.setdefault(ev.id, []).extend(ev.tokens)
        if log is not None and len(engine.history) > done and system != "plain":
            n, r, s = engine.history[-1]
            decoded = [rid for rid, st in engine.stats.items()
                       if len(st.steps) > steps_before.get(rid, 0)]
            seqs, price, slots = [], None, None
            for rid in decoded:
                pol, c = policies[rid], engine.stats[rid].steps[-1]
                seqs.append([c.source, c.width, c.accepted, *(round(x, 4) for x in pol.last),
                             [round(a, 3) for a in pol.inner.alphas(DRAFTER)[:3]]])
            pol = policies[decoded[-1]]
            if hasattr(pol, "shared"):
                saved, pol.shared.table = pol.shared.table, before
                pol.shared.memo.clear()
                slots = pol.slots
                drafts = [x[4] for x in seqs if x[0] == DRAFTER]
                if system == "baseline":            # its step_cost(rows, slots)
                    price = pol.step_cost(r, slots) + sum(drafts)
                else:                               # the step's one drafter pass
                    price = pol.step_cost(n, r // n, slots, drafter_pass(drafts))
                pol.shared.table = saved
                pol.shared.memo.clear()
            entry = {"system": system, "n": n, "rows": r, "slots": slots, "seconds": round(s, 4),
                     "price": None if price is None else round(price, 4), "seqs": seqs}
            if time_drafts:
                entry["draft_s"] = [round(x, 4) for x in engine.drafter.seconds[drafts_before:]]
            log.write(json.dumps(entry) + "\n")
    wall = time.perf_counter() - tic
    if carried is not None:
        carried[system] = (pipe._policy, shared)
    stats = list(engine.stats.values())
    tokens = sum(s.generated_tokens for s in stats)
    decode = sum(s for _, _, s in engine.history)
    cycles = {src: sum(len(s.drafting(src)) for s in stats) for src in (DRAFTER, LOOKUP)}
    taus = {}
    for src in (DRAFTER, LOOKUP):
        cs = [c for s in stats for c in s.drafting(src)]
        taus[src] = round(sum(c.accepted + 1 for c in cs) / len(cs), 2) if cs else None
    plain = sum(1 for s in stats for c in s.steps if c.source == PLAIN)
    steps = len(engine.history)
    return {"system": system, "tokens": tokens, "wall_s": round(wall, 2),
            "tok_s": round(tokens / wall, 2), "decode_tok_s": round(tokens / decode, 2),
            "steps": steps, "rows_per_step": round(sum(r for _, r, _ in engine.history)
                                                   / max(steps, 1), 1),
            "cycles_drafter": cycles[DRAFTER], "tau_drafter": taus[DRAFTER],
            "cycles_lookup": cycles[LOOKUP], "tau_lookup": taus[LOOKUP], "plain": plain,
            "vetoed": getattr(engine, "vetoed", None),
            "texts": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=["code", "chat", "agent"], default="code")
    ap.add_argument("--clients", default="8,16")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--systems", default="plain,policy")
    ap.add_argument("--log", type=Path)
    ap.add_argument("--time-drafts", action="store_true")
    ap.add_argument("--carry", action="store_true",
                    help="each system keeps its estimates and correction from one batch size "
                         "to the next, as a server does from wave to wave")
    ap.add_argument("--baseline", type=Path,
                    help="another batch.py, run as the system `baseline` (its engine and "
                         "policy), e.g. `git show REV:dflash2_mlx/batch.py > old_batch.py`")
    a = ap.parse_args()
    baseline = load_baseline(a.baseline) if a.baseline else None
    pipe = dflash2_mlx.load()
    log = a.log.open("w") if a.log else None
    carried = {} if a.carry else None
    for n in [int(x) for x in a.clients.split(",")]:
        ids = prompts(pipe, a.kind, n)
        print(f"{a.kind} x {n}: mean prompt {sum(map(len, ids)) / n:.0f} tokens; load average "
              f"{os.getloadavg()}", flush=True)
        if log:
            log.write(json.dumps({"kind": a.kind, "clients": n}) + "\n")
        res = {}
        for system in a.systems.split(","):
            res[system] = run(pipe, ids, a.max_tokens, system, log, a.time_drafts, baseline,
                              carried)
            print(json.dumps({k: v for k, v in res[system].items() if k != "texts"}),
                  flush=True)
        for system, q in res.items():
            if system != "plain" and "plain" in res:
                p = res["plain"]
                print(f"{a.kind} x {n}: {system} / plain = {q['tok_s'] / p['tok_s']:.3f} "
                      f"(wall), {q['decode_tok_s'] / p['decode_tok_s']:.3f} (decode steps); "
                      f"texts {'identical' if p['texts'] == q['texts'] else 'DIFFER'}",
                      flush=True)
    if log:
        log.close()


if __name__ == "__main__":
    main()
