"""`dflash2-mlx bench`: the side-by-side benchmark of `dflash2_mlx.bench` on the prompt sets
asked for; bench.json, bench.md and the plots in --out, the tables on stdout."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Optional

import typer

from .. import settings as check
from .common import KV_BITS, KV_GROUP_SIZE, app, default_pair, errors, flag


@app.command()
def bench(
    model: Optional[str] = typer.Option(None, "--model", help="Target (default: the embedded "
                                        "default's)"),
    draft: Optional[str] = typer.Option(None, "--draft", "--draft-model",
                                        help="Drafter (default: the embedded default's)"),
    prompts: int = typer.Option(8, "--prompts", callback=flag(check.prompts_per_set),
                                help="Prompts per set (HumanEval: spread over the 164)"),
    prompt_sets: str = typer.Option("humaneval,agent", "--prompt-sets",
                                    help="Comma-separated: humaneval, agent (copy-heavy "
                                    "edits and log questions), chat, and long contexts: "
                                    "long-edit-, long-log-, long-agent-, long-quote- with "
                                    "2k, 4k or 8k"),
    block_sizes: str = typer.Option("2,4,8,16,auto", "--block-sizes",
                                    help="Comma-separated block sizes and/or 'auto'; "
                                    "sizes beyond the drafter's run the hybrid only"),
    lookup: bool = typer.Option(True, "--lookup/--no-lookup",
                                help="Also run each block size with lookup drafting (hybrid)"),
    temperatures: str = typer.Option("0,1", "--temperatures", help="Comma-separated"),
    max_tokens: int = typer.Option(128, "--max-tokens", "-m", callback=flag(check.max_tokens)),
    repeats: int = typer.Option(1, "--repeats", callback=flag(check.repeats),
                                help="Rounds of every system per prompt, the order rotated "
                                "(figures: medians of the paired ratios)"),
    reference: bool = typer.Option(True, "--reference/--no-reference",
                                   help="Include dflash.model_mlx when it is importable"),
    kv_bits: Optional[str] = KV_BITS,
    kv_group_size: Optional[str] = KV_GROUP_SIZE,
    out: Path = typer.Option(Path("bench-results"), "--out", help="Folder for bench.json, "
                             "bench.md and the plots; an unfinished run there with the same "
                             "settings resumes"),
    verbose: bool = typer.Option(False, "--verbose", help="Tracebacks"),
):
    """Plain mlx-lm vs dflash2-mlx per block size (drafter alone and hybrid) vs the reference."""
    with errors(verbose):
        sizes = [check.block_size(b.strip(), "--block-sizes") for b in block_sizes.split(",")
                 if b.strip()]
        temps = [check.temperature(t.strip(), "--temperatures") for t in temperatures.split(",")
                 if t.strip()]
        if not temps:
            raise ValueError("--temperatures: expected numbers >= 0, e.g. 0,1")
        if model is None:
            model, default_draft = default_pair()
            draft = draft or default_draft
        if draft is None:
            raise ValueError("--draft: a drafter is needed to benchmark speculative decoding")
        from ..bench.prompt_sets import PROMPT_SETS
        from ..bench.report import markdown, write
        from ..bench.results import unfinished
        from ..bench.run import run_bench

        names = _set_names(prompt_sets, PROMPT_SETS)
        earlier = unfinished(out)
        with contextlib.redirect_stdout(sys.stderr):
            chosen = {n: PROMPT_SETS[n](prompts) for n in names}
            results = run_bench(model, draft, chosen, block_sizes=sizes, temperatures=temps,
                                max_tokens=max_tokens, lookup=lookup, reference=reference,
                                repeats=repeats, kv_bits=kv_bits,
                                kv_group_size=kv_group_size, earlier=earlier,
                                checkpoint=lambda r: write(r, out, plots=False))
        write(results, out)
        print(markdown(results))


def _set_names(flag_value: str, known: dict) -> list[str]:
    """The names in --prompt-sets, each one of `known`."""
    names = [n.strip() for n in flag_value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"--prompt-sets: {', '.join(unknown) or 'nothing'} is not one of "
                         f"{', '.join(known)}")
    return names
