"""Side-by-side benchmark: plain mlx-lm decoding, dflash2-mlx at each block size with the
drafter alone and with lookup drafting beside it ("hybrid"), and the z-lab reference
implementation (`dflash.model_mlx`) when it is importable.

One run, the same machine, the systems alternating prompt by prompt (so drift in machine load
hits them alike). On prompt sets of `prompt_sets` (HumanEval, the copy-heavy agent set, chat),
greedy and T=1. Per system: decode tokens/s, speedup over plain decoding, tau (all drafting
cycles and per source), per-position acceptance per source, prefill time, peak memory; greedy
outputs must be identical across all systems. Writes `bench.json`, `bench.md` and, with
matplotlib installed (`pip install dflash2-mlx[bench]`), `speedup.png` and `acceptance.png`.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from . import log
from .policy.adaptive import DRAFTER, LOOKUP
from .engine import Cycle, DecodeState, GenerationStats
from .files import atomic_path, atomic_write

_log = log.get(__name__)


@dataclass
class Run:
    """One system on one prompt."""

    tokens: list[int]
    prefill_s: float
    decode_s: float
    peak_mb: float
    steps: list[Cycle] = field(default_factory=list)     # empty for plain mlx-lm


def _plain(pipe, ids, temperature, max_tokens, seed, stop_ids) -> Run:
    """mlx-lm's own decoding of the same target (`generate_step`)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    tokens, tic, first = [], time.perf_counter(), None
    for token, _ in generate_step(mx.array(ids), pipe.target, max_tokens=max_tokens,
                                  sampler=make_sampler(temp=temperature)):
        if first is None:
            first = time.perf_counter()
        tokens.append(token)
        if token in stop_ids:
            break
    end = time.perf_counter()
    return Run(tokens, first - tic, end - first, mx.get_peak_memory() / 2**20)


def _ours(pipe, ids, temperature, max_tokens, seed, block_size, lookup,
          state: DecodeState | None = None) -> Run:
    """One generation; from a copy of `state` (a prefilled prompt) when given."""
    g = pipe.generate(ids, max_tokens=max_tokens, temperature=temperature, seed=seed,
                      block_size=block_size, lookup=lookup,
                      state=None if state is None else state.copy())
    s = g.stats
    return Run(g.tokens, s.prefill_s, s.decode_s, mx.get_peak_memory() / 2**20, s.steps)


def prefilled(pipe, ids) -> tuple[DecodeState, float]:
    """The prompt's state after one prefill, and the seconds it took: every system of a long
    context set starts from a copy (greedy, the state is the same whoever prefills it, so
    this is fair, and an 8k prefill takes minutes here)."""
    state = DecodeState.new(pipe.adapter, pipe.drafter)
    tic = time.perf_counter()
    pipe.generate(ids, max_tokens=1, block_size=1, state=state)
    return state, time.perf_counter() - tic


PLAIN_NAME = "dflash2-mlx b=1"     # the baseline of the long-context sets: plain decoding


class Reference:
    """`dflash.model_mlx.stream_generate` on its own copy of the target (it wraps the target's
    layers in place) and the same drafter checkpoint."""

    def __init__(self, model: str, draft: str):
        import dflash.model_mlx as ref

        from .loading import load_target

        self.ref = ref
        self.target, self.tokenizer, _ = load_target(model, mx.float32)
        # load_draft only takes hub ids: let it read the local folder, for this call only
        original = ref.snapshot_download
        ref.snapshot_download = lambda path, **_: path
        try:
            self.draft = ref.load_draft(str(draft))
        finally:
            ref.snapshot_download = original
        self.draft.update(_to_float32(self.draft.parameters()))

    def __call__(self, ids, temperature, max_tokens, seed, block_size) -> Run:
        mx.random.seed(seed)
        tokens, steps, tic, first = [], [], time.perf_counter(), None
        for resp in self.ref.stream_generate(self.target, self.draft, self.tokenizer, ids,
                                             block_size=block_size, max_tokens=max_tokens,
                                             temperature=temperature):
            if first is None:
                first = time.perf_counter()
            elif resp.tokens:
                steps.append(Cycle(DRAFTER, block_size, len(resp.tokens) - 1))
            tokens += resp.tokens
        end = time.perf_counter()
        return Run(tokens, first - tic, end - first, mx.get_peak_memory() / 2**20, steps)


def _to_float32(params):
    from mlx.utils import tree_map

    return tree_map(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating)
                    else x, params)


def _tps(run: Run) -> float:
    return max(len(run.tokens) - 1, 0) / run.decode_s if run.decode_s else 0.0


def summarize(runs: list[Run]) -> dict:
    """Decode tok/s over all runs (tokens after the first / decode seconds); tau, mean width
    and per-position acceptance pooled over the runs' cycles, per source too."""
    decode_tokens = sum(max(len(r.tokens) - 1, 0) for r in runs)
    decode_s = sum(r.decode_s for r in runs)
    pooled = GenerationStats(steps=[c for r in runs for c in r.steps])
    return {"decode_tps": decode_tokens / decode_s if decode_s else 0.0,
            "per_prompt_tps": [_tps(r) for r in runs],
            "tau": pooled.tau, "tau_drafter": pooled.source_tau(DRAFTER),
            "tau_lookup": pooled.source_tau(LOOKUP),
            "cycles_drafter": len(pooled.drafting(DRAFTER)),
            "cycles_lookup": len(pooled.drafting(LOOKUP)),
            "plain_steps": len(pooled.steps) - pooled.cycles,
            "mean_width": pooled.mean_width,
            "position_acceptance": pooled.position_acceptance(),
            "position_acceptance_drafter": pooled.position_acceptance(DRAFTER),
            "position_acceptance_lookup": pooled.position_acceptance(LOOKUP),
            "prefill_s": float(np.mean([r.prefill_s for r in runs])),
            "peak_mb": float(max(r.peak_mb for r in runs)),
            "tokens": sum(len(r.tokens) for r in runs), "requests": len(runs)}


def _paired(a: list[float], b: list[float]) -> float:
    """Median over prompts of a_i / b_i: each prompt's runs follow each other, so load that
    comes and goes mostly cancels, and one stalled run cannot swing the figure."""
    return float(np.median([x / y for x, y in zip(a, b) if y > 0] or [0.0]))


def add_ratios(table: dict, baseline: str = "mlx-lm") -> dict:
    """`speedup` over `baseline` for every system, and `vs_reference` for each of ours with a
    reference run at the same block size; both paired per prompt (`_paired`)."""
    plain = table[baseline]["per_prompt_tps"]
    for name, row in table.items():
        row["speedup"] = _paired(row["per_prompt_tps"], plain)
        ref = table.get("reference " + name.split(" ", 1)[-1])
        if name.startswith(("dflash2-mlx", "hybrid")) and ref is not None:
            row["vs_reference"] = _paired(row["per_prompt_tps"], ref["per_prompt_tps"])
    return table


def run_bench(model: str, draft: str, prompt_sets: dict[str, Sequence[str]], *,
              block_sizes: Sequence[int | str] = (2, 4, 8, "auto"),
              temperatures: Sequence[float] = (0.0, 1.0), max_tokens: int = 128,
              lookup: bool = True, reference: bool = True, seed: int = 0,
              repeats: int = 1, earlier: dict | None = None,
              checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Run every system on every prompt of each set, alternating; return JSON-ready results
    keyed "<set> T=<t>". Systems: mlx-lm; per block size b, "dflash2-mlx b=<b>" (the drafter
    alone, b up to its block size), "hybrid b=<b>" (drafter and lookup, with `lookup`) and
    "reference b=<b>". Progress: one bar per set and temperature (`log.progress`).

    repeats: rounds of every system per prompt, the order rotated each round; round k of
    one system is paired with round k of the baseline (`_paired`), so a figure is a median
    over prompts x rounds of ratios measured minutes apart at most.

    Sets named "long-..." (`prompt_sets.LONG_SIZES`) prefill each prompt once (`prefilled`)
    and run every system of ours from a copy of that state, against plain decoding from the
    same state ("dflash2-mlx b=1", the baseline of their speedups); mlx-lm and the reference
    would prefill again (minutes at 8k) and are left out there.

    earlier: the results of an unfinished run (`unfinished`); with the same setup its parts
    are kept as measured and only the rest run (the policy starts fresh: what it learned in
    the kept parts is gone). checkpoint: called with the results after every part, so an
    interrupted run can resume; `setup["complete"]` is False until the last part is in."""
    import dflash2_mlx

    from .loading import resolve, save_drafter, stored_quantization

    pipe = dflash2_mlx.load(model, draft)
    source, tmp = draft, None
    if reference and stored_quantization(resolve(draft, "draft model")):
        # the reference reads BF16 checkpoints only: both systems run one BF16 copy
        tmp = tempfile.TemporaryDirectory(prefix="dflash2-bench-")
        from mlx_lm.utils import dequantize_model

        save_drafter(dequantize_model(pipe.drafter), tmp.name, mx.bfloat16)
        _log.info(f"{draft} is stored quantized: both systems use its BF16 copy {tmp.name}")
        draft = tmp.name
        pipe = dflash2_mlx.load(model, draft)
    ref = None
    if reference:
        try:
            ref = Reference(model, draft)
        except ImportError:
            _log.info("reference implementation (PyPI dflash==0.1.0) not importable: skipped")
    stop_ids = set(pipe.tokenizer.eos_token_ids)
    if "auto" in block_sizes:       # measure costs before timing anything
        pipe.width_policy()
    block = pipe.drafter.args.block_size
    systems: dict[str, Callable] = {
        "mlx-lm": lambda ids, t, s: _plain(pipe, ids, t, max_tokens, s, stop_ids)}
    for b in block_sizes:
        if b == "auto" or b <= block:
            systems[f"dflash2-mlx b={b}"] = (
                lambda ids, t, s, b=b: _ours(pipe, ids, t, max_tokens, s, b, False))
        if lookup:
            systems[f"hybrid b={b}"] = (
                lambda ids, t, s, b=b: _ours(pipe, ids, t, max_tokens, s, b, True))
        if ref is not None and b != "auto" and b <= block:
            systems[f"reference b={b}"] = (
                lambda ids, t, s, b=b: ref(ids, t, max_tokens, s, b))
    results: dict = {"setup": {"model": model, "draft": source, "bf16_copy": tmp is not None,
                               "prompts": {k: len(v) for k, v in prompt_sets.items()},
                               "max_tokens": max_tokens, "block_sizes": list(block_sizes),
                               "temperatures": list(temperatures), "seed": seed,
                               "lookup": lookup, "drafter_block_size": block,
                               "repeats": repeats, "reference": reference,
                               "complete": False}}
    kept = _kept_parts(earlier, results["setup"])
    long_systems: dict[str, Callable] = {PLAIN_NAME: (
        lambda ids, t, s, state: _ours(pipe, ids, t, max_tokens, s, 1, False, state))}
    for b in block_sizes:
        for hybrid in ((False, True) if lookup else (False,)):
            if b != 1 and (hybrid or b == "auto" or b <= block):
                long_systems[f"{'hybrid' if hybrid else 'dflash2-mlx'} b={b}"] = (
                    lambda ids, t, s, state, b=b, h=hybrid:
                    _ours(pipe, ids, t, max_tokens, s, b, h, state))
    for set_name, prompts in prompt_sets.items():
        encoded = [pipe.encode(p) for p in prompts]
        long = set_name.startswith("long-")
        chosen, baseline = (long_systems, PLAIN_NAME) if long else (systems, "mlx-lm")
        for temperature in temperatures:
            key = f"{set_name} T={temperature:g}"
            if key in kept:
                results[key] = kept[key]
                continue
            runs: dict[str, list[Run]] = {name: [] for name in chosen}
            mismatches, prefill_s = [], []
            for i, ids in enumerate(log.progress(encoded, f"{set_name} T={temperature:g}",
                                                 unit="prompt")):
                state = None
                if long:
                    state, seconds = prefilled(pipe, ids)
                    prefill_s.append(seconds)
                names = list(chosen)
                for k in range(repeats):
                    for name in names[k % len(names):] + names[: k % len(names)]:
                        mx.clear_cache()
                        mx.reset_peak_memory()
                        args = (ids, temperature, seed + i) + ((state,) if long else ())
                        runs[name].append(chosen[name](*args))
                    if temperature == 0:
                        outs = {name: r[-1].tokens for name, r in runs.items()}
                        base = outs[baseline]
                        mismatches += [f"prompt {i}: {n}" for n, o in outs.items()
                                       if o != base]
            table = add_ratios({name: summarize(r) for name, r in runs.items()}, baseline)
            results[key] = {"systems": table, "baseline": baseline,
                            "prompt_tokens": float(np.mean([len(x) for x in encoded]))}
            if long:
                for row in table.values():
                    row["prefill_s"] = float(np.mean(prefill_s))     # the one shared prefill
            if temperature == 0:
                results[key]["greedy_identical"] = not mismatches
                results[key]["mismatches"] = mismatches
            if checkpoint is not None:
                checkpoint(results)
    results["setup"]["complete"] = True
    return results


def unfinished(out: Path) -> dict | None:
    """The results in `out/bench.json` when that run stopped before its last part, else None
    (no file, or a finished run: those are measured again, as asked)."""
    path = out / "bench.json"
    if not path.exists():
        return None
    try:
        results = json.loads(path.read_text())
        done = results["setup"].get("complete", True)    # files from before resuming: finished
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not the bench.json of a bench run ({type(e).__name__}: "
                         f"{e}); move it away or choose another --out") from None
    return None if done else results


def _kept_parts(earlier: dict | None, setup: dict) -> dict:
    """The parts of `earlier` worth keeping: all of them when its setup is ours, else none."""
    if earlier is None:
        return {}
    theirs = {k: v for k, v in earlier["setup"].items() if k != "complete"}
    ours = {k: v for k, v in setup.items() if k != "complete"}
    parts = dict(_parts(earlier))
    if theirs != ours:
        differ = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
        _log.info(f"the unfinished run in --out had other settings ({', '.join(differ)}): "
                  f"its {len(parts)} part(s) are measured again")
        return {}
    _log.info(f"resuming an unfinished run: {len(parts)} part(s) kept as measured "
              f"({', '.join(parts) or 'none'}); delete its bench.json to start over")
    return parts


def _parts(results: dict):
    return [(k, v) for k, v in results.items() if k != "setup"]


def markdown(results: dict) -> str:
    def fmt(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    lines = []
    for key, part in _parts(results):
        base = part.get("baseline", "mlx-lm")
        lines += [f"**{key}**, {part.get('prompt_tokens', 0):.0f} prompt tokens on average"
                  + (" (greedy outputs identical across all systems)"
                     if part.get("greedy_identical") else ""), "",
                  f"| system | decode tok/s | speedup over {base} | vs reference | tau | "
                  "tau drafter | tau lookup | cycles drafter / lookup / plain | mean width | "
                  "prefill s | peak MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in part["systems"].items():
            vs = f"{r['vs_reference']:.2f}x" if "vs_reference" in r else "-"
            lines.append(f"| {name} | {r['decode_tps']:.1f} | {r['speedup']:.2f}x | {vs} | "
                         f"{r['tau']:.2f} | {fmt(r['tau_drafter'])} | {fmt(r['tau_lookup'])} | "
                         f"{r['cycles_drafter']} / {r['cycles_lookup']} / {r['plain_steps']} | "
                         f"{r['mean_width']:.1f} | {r['prefill_s']:.2f} | {r['peak_mb']:.0f} |")
        lines += ["", "decode tok/s: all tokens after the first over all decode seconds; "
                  "speedup and vs reference: median over prompts of the per-prompt ratio; tau: "
                  "accepted drafts + 1 per drafting cycle, pooled over prompts.", ""]
    return "\n".join(lines)


def plot(results: dict, out: Path) -> list[Path]:
    """speedup.png (each system's speedup, one panel per prompt set and temperature) and
    acceptance.png (per-position acceptance of each source: the widest fixed hybrid system's
    drafter and lookup cycles, and the drafter alone); needs matplotlib (optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = _parts(results)
    written = []
    fig, axes = plt.subplots(len(parts), 1, figsize=(8, 2.6 * len(parts)), squeeze=False)
    for ax, (key, part) in zip(axes[:, 0], parts):
        names = list(part["systems"])
        ax.bar(range(len(names)), [part["systems"][n]["speedup"] for n in names],
               color=["gray" if n in ("mlx-lm", PLAIN_NAME) else "tab:orange" if n.startswith("reference")
                      else "tab:green" if n.startswith("hybrid") else "tab:blue"
                      for n in names])
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_xticks(range(len(names)), names, fontsize=7, rotation=20)
        ax.set_ylabel("speedup")
        ax.set_title(key, fontsize=9)
    fig.tight_layout()
    written.append(out / "speedup.png")
    with atomic_path(written[-1]) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)

    def widest(part, prefix):
        fixed = [n for n in part["systems"] if n.startswith(prefix) and not n.endswith("auto")]
        return max(fixed, key=lambda n: int(n.split("=")[-1]), default=None)

    fig, axes = plt.subplots(len(parts), 1, figsize=(6, 2.6 * len(parts)), squeeze=False)
    for ax, (key, part) in zip(axes[:, 0], parts):
        for name, field_, style in ((widest(part, "hybrid"), "position_acceptance_lookup", "o-"),
                                    (widest(part, "hybrid"), "position_acceptance_drafter", "s-"),
                                    (widest(part, "dflash2-mlx"), "position_acceptance_drafter",
                                     "^--")):
            pos = part["systems"][name][field_] if name else []
            if any(p is not None for p in pos):
                ax.plot(range(1, len(pos) + 1), [float("nan") if p is None else p for p in pos],
                        style, label=f"{name}: {field_.rsplit('_', 1)[-1]}")
        ax.set_ylim(0, 1)
        ax.set_ylabel("P(k | < k)")
        ax.set_title(key, fontsize=9)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("draft position k")
    fig.tight_layout()
    written.append(out / "acceptance.png")
    with atomic_path(written[-1]) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    long = [(k, v) for k, v in parts if k.startswith("long-")]
    if long:
        written.append(_plot_context(plt, long, out / "context.png"))
    return written


def _plot_context(plt, parts, path: Path) -> Path:
    """Speedup over plain decoding against prompt tokens: one panel per kind of long-context
    set (long-<kind>-<size> T=<t>), one line per system, the same colour in every panel."""
    lines: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for key, part in parts:
        kind = key.split(" ", 1)[0].rsplit("-", 1)[0] + " " + key.split(" ", 1)[1]
        for name, row in part["systems"].items():
            if name != part.get("baseline"):
                lines.setdefault(kind, {}).setdefault(name, []).append(
                    (part["prompt_tokens"], row["speedup"]))
    names = sorted({n for by_name in lines.values() for n in by_name})
    colour = {n: f"C{i % 10}" for i, n in enumerate(names)}
    fig, axes = plt.subplots(1, len(lines), figsize=(3.2 * len(lines) + 1.8, 3.4),
                             sharey=True, squeeze=False)
    for ax, (kind, by_name) in zip(axes[0], sorted(lines.items())):
        for name, pts in sorted(by_name.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colour[name],
                    label=name)
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_title(kind, fontsize=9)
        ax.set_xlabel("prompt tokens")
    axes[0, 0].set_ylabel("speedup over plain decoding")
    handles = [plt.Line2D([], [], color=colour[n], marker="o", label=n) for n in names]
    fig.legend(handles=handles, loc="center right", fontsize=7)
    fig.tight_layout(rect=(0, 0, 1 - 1.8 / (3.2 * len(lines) + 1.8), 1))
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return path


def write(results: dict, out: Path, plots: bool = True) -> None:
    """bench.json and bench.md, then (with `plots` and matplotlib) the plots."""
    with atomic_write(out / "bench.json") as f:
        f.write(json.dumps(results, indent=1) + "\n")
    with atomic_write(out / "bench.md") as f:
        f.write(markdown(results))
    if not plots:
        return
    try:
        paths = plot(results, out)
        _log.info("wrote " + ", ".join(str(p) for p in [out / "bench.json", *paths]))
    except ImportError:
        _log.info(f"wrote {out / 'bench.json'}; plots need matplotlib "
                  "(pip install 'dflash2-mlx[bench]')")
