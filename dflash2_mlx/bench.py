"""Side-by-side benchmark: plain mlx-lm decoding, dflash2-mlx at each block size, and the z-lab
reference implementation (`dflash.model_mlx`) when it is importable.

One run, the same machine, the systems alternating prompt by prompt (so drift in machine load
hits them alike). On HumanEval prompts, greedy and T=1. Per system: decode tokens/s, speedup
over plain decoding, tau, per-position acceptance, prefill time, peak memory; greedy outputs
must be identical across all systems. Writes `bench.json` and, with matplotlib installed
(`pip install dflash2-mlx[bench]`), `speedup.png` and `acceptance.png`.
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


@dataclass
class Run:
    """One system on one prompt."""

    tokens: list[int]
    prefill_s: float
    decode_s: float
    peak_mb: float
    accepted: list[int] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)


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


def _ours(pipe, ids, temperature, max_tokens, seed, block_size) -> Run:
    g = pipe.generate(ids, max_tokens=max_tokens, temperature=temperature, seed=seed,
                      block_size=block_size)
    s = g.stats
    return Run(g.tokens, s.prefill_s, s.decode_s, mx.get_peak_memory() / 2**20,
               list(s.accepted), list(s.widths))


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
        tokens, accepted, tic, first = [], [], time.perf_counter(), None
        for resp in self.ref.stream_generate(self.target, self.draft, self.tokenizer, ids,
                                             block_size=block_size, max_tokens=max_tokens,
                                             temperature=temperature):
            if first is None:
                first = time.perf_counter()
            elif resp.tokens:
                accepted.append(len(resp.tokens) - 1)
            tokens += resp.tokens
        end = time.perf_counter()
        return Run(tokens, first - tic, end - first, mx.get_peak_memory() / 2**20, accepted,
                   [block_size] * len(accepted))


def _to_float32(params):
    from mlx.utils import tree_map

    return tree_map(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating)
                    else x, params)


def _tps(run: Run) -> float:
    return max(len(run.tokens) - 1, 0) / run.decode_s if run.decode_s else 0.0


def summarize(runs: list[Run]) -> dict:
    """Decode tok/s over all runs (tokens after the first / decode seconds), tau per request
    then averaged, pooled per-position acceptance."""
    decode_tokens = sum(max(len(r.tokens) - 1, 0) for r in runs)
    decode_s = sum(r.decode_s for r in runs)
    taus = [np.mean([a + 1 for a in r.accepted]) for r in runs if r.accepted]
    width = max((max(r.widths) for r in runs if r.widths), default=1)
    pos = []
    for k in range(1, width):
        tried = sum(1 for r in runs for a, w in zip(r.accepted, r.widths) if w > k and a >= k - 1)
        ok = sum(1 for r in runs for a in r.accepted if a >= k)
        pos.append(ok / tried if tried else None)
    widths = [w for r in runs for w in r.widths]
    return {"decode_tps": decode_tokens / decode_s if decode_s else 0.0,
            "per_prompt_tps": [_tps(r) for r in runs],
            "tau": float(np.mean(taus)) if taus else 1.0,
            "mean_width": float(np.mean(widths)) if widths else 1.0,
            "position_acceptance": pos,
            "prefill_s": float(np.mean([r.prefill_s for r in runs])),
            "peak_mb": float(max(r.peak_mb for r in runs)),
            "tokens": sum(len(r.tokens) for r in runs), "requests": len(runs)}


def _paired(a: list[float], b: list[float]) -> float:
    """Median over prompts of a_i / b_i: each prompt's runs follow each other, so load that
    comes and goes mostly cancels, and one stalled run cannot swing the figure."""
    return float(np.median([x / y for x, y in zip(a, b) if y > 0] or [0.0]))


def add_ratios(table: dict) -> dict:
    """`speedup` over mlx-lm for every system, and `vs_reference` for each of ours with a
    reference run at the same block size; both paired per prompt (`_paired`)."""
    plain = table["mlx-lm"]["per_prompt_tps"]
    for name, row in table.items():
        row["speedup"] = _paired(row["per_prompt_tps"], plain)
        ref = table.get(name.replace("dflash2-mlx", "reference"))
        if name.startswith("dflash2-mlx") and ref is not None:
            row["vs_reference"] = _paired(row["per_prompt_tps"], ref["per_prompt_tps"])
    return table


def run_bench(model: str, draft: str, prompts: Sequence[str], *,
              block_sizes: Sequence[int | str] = (2, 4, 8, "auto"),
              temperatures: Sequence[float] = (0.0, 1.0), max_tokens: int = 128,
              reference: bool = True, seed: int = 0,
              progress: Callable[[str], object] = print) -> dict:
    """Run every system on every prompt, alternating; return the JSON-ready results."""
    import dflash2_mlx

    from .loading import resolve, save_drafter, stored_quantization

    pipe = dflash2_mlx.load(model, draft, progress=progress)
    source, tmp = draft, None
    if reference and stored_quantization(resolve(draft, "draft model")):
        # the reference reads BF16 checkpoints only: both systems run one BF16 copy
        tmp = tempfile.TemporaryDirectory(prefix="dflash2-bench-")
        from mlx_lm.utils import dequantize_model

        save_drafter(dequantize_model(pipe.drafter), tmp.name, mx.bfloat16)
        progress(f"{draft} is stored quantized: both systems use its BF16 copy {tmp.name}")
        draft = tmp.name
        pipe = dflash2_mlx.load(model, draft, progress=progress)
    ref = None
    if reference:
        try:
            ref = Reference(model, draft)
        except ImportError:
            progress("reference implementation (PyPI dflash==0.1.0) not importable: skipped")
    stop_ids = set(pipe.tokenizer.eos_token_ids)
    if "auto" in block_sizes:       # measure costs before timing anything
        pipe.width_policy()
    systems: dict[str, Callable] = {
        "mlx-lm": lambda ids, t, s: _plain(pipe, ids, t, max_tokens, s, stop_ids)}
    for b in block_sizes:
        systems[f"dflash2-mlx b={b}"] = (
            lambda ids, t, s, b=b: _ours(pipe, ids, t, max_tokens, s, b))
        if ref is not None and b != "auto":
            systems[f"reference b={b}"] = (
                lambda ids, t, s, b=b: ref(ids, t, max_tokens, s, b))
    results: dict = {"setup": {"model": model, "draft": source, "bf16_copy": tmp is not None,
                               "prompts": len(prompts),
                               "max_tokens": max_tokens, "block_sizes": list(block_sizes),
                               "temperatures": list(temperatures), "seed": seed,
                               "drafter_block_size": pipe.drafter.args.block_size}}
    encoded = [pipe.encode(p) for p in prompts]
    for temperature in temperatures:
        runs: dict[str, list[Run]] = {name: [] for name in systems}
        mismatches = []
        for i, ids in enumerate(encoded):
            for name, run in systems.items():
                mx.clear_cache()
                mx.reset_peak_memory()
                runs[name].append(run(ids, temperature, seed + i))
            if temperature == 0:
                outs = {name: r[-1].tokens for name, r in runs.items()}
                base = outs["mlx-lm"]
                mismatches += [f"prompt {i}: {name}" for name, o in outs.items() if o != base]
            progress(f"T={temperature:g}: prompt {i + 1}/{len(encoded)} done")
        table = add_ratios({name: summarize(r) for name, r in runs.items()})
        key = f"T={temperature:g}"
        results[key] = {"systems": table}
        if temperature == 0:
            results[key]["greedy_identical"] = not mismatches
            results[key]["mismatches"] = mismatches
    return results


def markdown(results: dict) -> str:
    lines = []
    for key, part in results.items():
        if not key.startswith("T="):
            continue
        lines += [f"**{key}**" + (" (greedy outputs identical across all systems)"
                                  if part.get("greedy_identical") else ""), "",
                  "| system | decode tok/s | speedup over mlx-lm | vs reference | tau | mean width | "
                  "prefill s | peak MiB |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, r in part["systems"].items():
            vs = f"{r['vs_reference']:.2f}x" if "vs_reference" in r else "-"
            lines.append(f"| {name} | {r['decode_tps']:.1f} | {r['speedup']:.2f}x | {vs} | "
                         f"{r['tau']:.2f} | {r['mean_width']:.1f} | {r['prefill_s']:.2f} | "
                         f"{r['peak_mb']:.0f} |")
        lines += ["", "decode tok/s: all tokens after the first over all decode seconds; "
                  "speedup and vs reference: median over prompts of the per-prompt ratio."]
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, out: Path) -> list[Path]:
    """speedup.png (speedup against block size) and acceptance.png (per-position acceptance);
    needs matplotlib (optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, part in results.items():
        if not key.startswith("T="):
            continue
        for prefix, style in (("dflash2-mlx", "o-"), ("reference", "s--")):
            pts = sorted((int(n.split("=")[-1]), r["speedup"])
                         for n, r in part["systems"].items()
                         if n.startswith(prefix) and not n.endswith("auto"))
            if pts:
                ax.plot(*zip(*pts), style, label=f"{prefix} {key}")
        auto = part["systems"].get("dflash2-mlx b=auto")
        if auto:
            ax.axhline(auto["speedup"], linestyle=":", color="gray")
            ax.annotate(f"auto {key}", xy=(0.01, auto["speedup"]), fontsize=8,
                        xycoords=("axes fraction", "data"))
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xlabel("block size")
    ax.set_ylabel("decode speedup over mlx-lm")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "speedup.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, part in results.items():
        if not key.startswith("T="):
            continue
        best = max((n for n in part["systems"] if n.startswith("dflash2-mlx b=")
                    and not n.endswith("auto")), key=lambda n: int(n.split("=")[-1]),
                   default=None)
        if best:
            pos = part["systems"][best]["position_acceptance"]
            ax.plot(range(1, len(pos) + 1), pos, "o-", label=f"{best} {key}")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(draft k accepted | drafts < k accepted)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "acceptance.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written


def write(results: dict, out: Path, progress: Callable[[str], object] = print) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "bench.md").write_text(markdown(results))
    try:
        paths = plot(results, out)
        progress("wrote " + ", ".join(str(p) for p in [out / "bench.json", *paths]))
    except ImportError:
        progress(f"wrote {out / 'bench.json'}; plots need matplotlib "
                 "(pip install 'dflash2-mlx[bench]')")
