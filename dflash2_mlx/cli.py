"""The `dflash2-mlx` command: `generate`, `serve`, `doctor`, `calibrate`, `bench`, and `train`
when the training package is installed.

A thin layer over the Python API (`dflash2_mlx.load`, `Pipeline.stream`): parse flags, load,
stream, print. MLX and mlx-lm are imported inside the commands, so `--help`, flag errors and
oMLX settings errors answer before anything heavy loads. The package's log records print as
`dflash2-mlx: ...` lines on stderr (`log.setup`; ranks > 0 of a pipeline print only their
errors). Errors print one line (`dflash2-mlx: error: ...`) and exit non-zero; `--verbose` adds
the traceback. `main()` chooses the BLAS (`blas.use_fast_blas`) before MLX is imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import platform
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Optional

import typer

from . import __version__, blas, log, runtime
from . import settings as check
from .files import atomic_write

PROG = log.PROG
_log = log.get(__name__)
# typer >= 0.26 vendors click; the base class of its usage errors is found the same way in both.
_CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
OPTIONAL_VALUE_FLAGS = {"--omlx-settings": ""}     # flag given without a value -> this value

app = typer.Typer(name=PROG, add_completion=False, no_args_is_help=True,
                  pretty_exceptions_enable=False,
                  help="Exact speculative decoding with DFlash / DFlash 2 drafters on MLX.")


# --------------------------------------------------------------------------- helpers

def _notice_hook(previous):
    """A warnings.showwarning that logs DFlashNotice as one note line; others go to
    `previous`."""
    def show(message, category, *rest, **kw):
        if category.__name__ == "DFlashNotice":
            _log.warning(str(message))
        else:
            previous(message, category, *rest, **kw)
    return show


@contextlib.contextmanager
def _errors(verbose: bool):
    """One line per error and a non-zero exit; the traceback only with --verbose."""
    try:
        yield
    except (typer.Exit, _CLICK_ERROR):
        raise
    except KeyboardInterrupt:
        _log.info("interrupted")
        raise typer.Exit(130) from None
    except BrokenPipeError:   # e.g. `| head`: the reader left; nothing more to say
        sys.stdout = open(os.devnull, "w")  # the pipe is closed: the rest goes nowhere
        raise typer.Exit(141) from None
    except Exception as e:  # noqa: BLE001 - reported with its type and message, never hidden
        if verbose:
            traceback.print_exc()
        expected = isinstance(e, (ValueError, OSError, RuntimeError, ImportError))
        message = str(e) if expected and str(e) else f"{type(e).__name__}: {e}"
        hint = "" if expected or verbose else " (run with --verbose for the traceback)"
        _log.error(f"{message}{hint}")
        raise typer.Exit(1) from None


def _flag(validator):
    """A click callback running one of `settings`' validators (None passes): click then names
    the flag in its one-line error."""
    def callback(value):
        if value is None:
            return None
        try:
            return validator(value)
        except check.SettingError as e:
            raise typer.BadParameter(e.problem) from None
    return callback


def _prompt_flag(value: str) -> str:
    return value if value == "-" else _flag(check.text)(value)


def _writable(path: Path, flag: str) -> None:
    """Fail before the generation, not after it, when a report file cannot be written."""
    folder = path.parent
    why = ("it is a folder" if path.is_dir() else
           f"no such folder {folder}" if not folder.is_dir() else
           f"the folder {folder} is not writable" if not os.access(folder, os.W_OK) else
           "the file is not writable" if path.exists() and not os.access(path, os.W_OK)
           else None)
    if why:
        raise ValueError(f"{flag} {path}: cannot be written ({why})")


def _read_stdin() -> str:
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, str):
        text = data
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"--prompt -: standard input is not valid UTF-8 (byte "
                             f"0x{data[e.start]:02x} at offset {e.start})") from None
    if not text:
        raise ValueError("--prompt -: standard input was empty")
    return check.text(text, "--prompt -")


def _default_pair() -> tuple[str, str]:
    """The embedded default (target, drafter), from `dflash2_mlx.defaults`."""
    try:
        from .defaults import default_pair
    except ImportError as e:
        if e.name and not e.name.startswith("dflash2_mlx.defaults"):
            raise
        raise ValueError("no --model given and no embedded default model is installed in this "
                         "version; pass --model (and --draft)") from e
    target, drafter = default_pair()
    return str(target), str(drafter)


def _summary(stats) -> str:
    """One line: tokens, speed, and what each source did (plain steps included)."""
    parts = []
    for source, name in (("drafter", "drafter"), ("lookup", "lookup")):
        cycles = stats.drafting(source)
        if cycles:
            parts.append(f"{len(cycles)} {name} cycles (tau {stats.source_tau(source):.2f})")
    plain = len(stats.steps) - stats.cycles
    parts.append(f"{plain} plain steps")
    return (f"{stats.generated_tokens} tokens, {stats.decode_tps:.1f} tok/s decode, "
            f"tau {stats.tau:.2f}: {', '.join(parts)}, block size {stats.block_size} "
            f"(mean width {stats.mean_width:.1f}), prefill {stats.prefill_s:.2f} s for "
            f"{stats.prompt_tokens} prompt tokens")


def _load_pipeline(model, draft, omlx_settings, model_id, block_size, lookup, **options):
    """Load as `generate` and `serve` both do: the embedded default without --model, the oMLX
    entry when asked, flags over the file; check --block-size against the drafter. A follower
    rank of a pipeline-sharded target serves rank 0 until it is done, then gets None."""
    if model_id is not None and omlx_settings is None:
        raise ValueError("--model-id names an entry of the oMLX settings: add "
                         "--omlx-settings [PATH]")
    settings = None
    default_draft = None
    if model is None:
        model, default_draft = _default_pair()
    if omlx_settings is not None:
        from .omlx import load_omlx_settings

        settings = load_omlx_settings(omlx_settings or None, model_id=model_id or model)
        if default_draft and settings.draft_model is None:
            settings = dataclasses.replace(settings, draft_model=default_draft)
        settings.check(draft)        # fail before loading anything
    elif draft is None:
        draft = default_draft

    from .pipeline import load

    tic = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):       # stdout carries the generated text only
        pipe = load(model, draft, settings=settings, lookup=lookup, **options)
    if pipe.stage is not None:
        from .distributed import follow_unless_leader

        if follow_unless_leader(pipe):       # rank 0 writes text, summary and stats
            return None
    try:
        pipe.block_size(block_size, lookup)
    except ValueError as e:
        raise ValueError(f"--block-size {block_size}: {e}") from e
    if pipe.drafter is None and settings is None:
        _log.warning("no drafter (--draft): " + ("lookup drafting from the context only"
                                                 if lookup else "plain target decoding"))
    _log.info(f"ready in {time.perf_counter() - tic:.1f} s")
    return pipe


# Flags that `generate` and `serve` share (one definition each; typer reads them per command)
MODEL = typer.Option(None, "--model", help="Target: mlx-lm model folder, hub id or .gguf file "
                     "(default: the embedded default)")
DRAFT = typer.Option(None, "--draft", "--draft-model", help="DFlash / DFlash 2 drafter folder "
                     "or hub id (default: the oMLX setting, else the embedded default's)")
BLOCK_SIZE = typer.Option(
    None, "--block-size", callback=_flag(check.block_size), metavar="{1..B,auto}",
    help="Rows verified per cycle, 1..the widest block of the drafter (B) or the lookup (16), "
    "or 'auto' to choose source and width each cycle (default: the oMLX setting, else auto)")
LOOKUP = typer.Option(True, "--lookup/--no-lookup",
                      help="Also draft by lookup in the context (default: on)")
DRAFT_BITS = typer.Option(None, "--draft-bits", callback=_flag(check.draft_bits),
                          metavar="{4,8,16}", help="Drafter weight bits; 16 = unquantized "
                          "(default: 4 on Metal, 16 on CPU)")
DRAFT_GROUP_SIZE = typer.Option(None, "--draft-group-size", metavar="{32,64,128}",
                                callback=_flag(check.draft_group_size),
                                help="Quantization group size (default: 64)")
DTYPE = typer.Option(None, "--dtype", callback=_flag(check.dtype),
                     metavar="{float32,float16,bfloat16}",
                     help="Float weight dtype (default: float32 on CPU, as stored on Metal)")
OMLX_SETTINGS = typer.Option(
    None, "--omlx-settings", metavar="[PATH]", help="Read oMLX's model_settings.json (PATH, or "
    "$OMLX_BASE_PATH/~/.omlx when no PATH is given); flags override it")
MODEL_ID = typer.Option(None, "--model-id", help="Entry in the oMLX settings (default: --model)")
PIPELINE_SPLIT = typer.Option(None, "--pipeline-split", metavar="N,N,...",
                              help="Layers per rank (default: even)")
PIPELINE_TIMEOUT = typer.Option(60.0, "--pipeline-timeout",
                                callback=_flag(check.pipeline_timeout),
                                help="Seconds a rank may wait for another")


# --------------------------------------------------------------------------- generate

@app.command()
def generate(
    model: Optional[str] = MODEL,
    draft: Optional[str] = DRAFT,
    prompt: str = typer.Option("hello", "--prompt", "-p", callback=_prompt_flag,
                               help="Prompt text; '-' reads stdin"),
    system: Optional[str] = typer.Option(None, "--system", "--system-prompt",
                                         help="System message (with a chat template)"),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m", callback=_flag(check.max_tokens),
                                   help="Most tokens to generate"),
    temp: float = typer.Option(0.0, "--temp", callback=_flag(check.temperature),
                               help="Temperature; 0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p", callback=_flag(check.top_p),
                                help="Nucleus mass in (0, 1]"),
    top_k: int = typer.Option(0, "--top-k", callback=_flag(check.top_k),
                              help="Keep the k likeliest; 0 = all"),
    seed: Optional[int] = typer.Option(None, "--seed", callback=_flag(check.seed),
                                       help="Random seed for sampling, 0..2**64-1"),
    block_size: Optional[str] = BLOCK_SIZE,
    lookup: bool = LOOKUP,
    draft_bits: Optional[str] = DRAFT_BITS,
    draft_group_size: Optional[str] = DRAFT_GROUP_SIZE,
    dtype: Optional[str] = DTYPE,
    no_chat_template: bool = typer.Option(False, "--no-chat-template", "--ignore-chat-template",
                                          help="Use the prompt as raw text"),
    omlx_settings: Optional[str] = OMLX_SETTINGS,
    model_id: Optional[str] = MODEL_ID,
    stats_json: Optional[Path] = typer.Option(None, "--stats-json", metavar="PATH",
                                              help="Write statistics and effective settings"),
    pipeline: bool = typer.Option(False, "--pipeline", help="Split the target's layers across "
                                  "the ranks started by mlx.launch (rank 0 writes the output)"),
    pipeline_split: Optional[str] = PIPELINE_SPLIT,
    pipeline_timeout: float = PIPELINE_TIMEOUT,
    verbose: bool = typer.Option(False, "--verbose", help="Effective settings, tracebacks"),
):
    """Generate text; it streams to stdout, one summary line goes to stderr."""
    with _errors(verbose):
        if stats_json is not None:
            _writable(stats_json, "--stats-json")
        group = _pipeline_group(pipeline, pipeline_split, pipeline_timeout)
        text = _read_stdin() if prompt == "-" else prompt
        pipe = _load_pipeline(model, draft, omlx_settings, model_id, block_size, lookup,
                              draft_bits=draft_bits, draft_group_size=draft_group_size,
                              dtype=dtype, pipeline=group, pipeline_split=pipeline_split,
                              pipeline_timeout=pipeline_timeout)
        if pipe is None:                     # a follower rank: it served rank 0 and is done
            return
        if verbose:
            _log.info("settings " + json.dumps(pipe.describe()))

        chunk = None
        for chunk in pipe.stream(text, max_tokens=max_tokens, temperature=temp, top_p=top_p,
                                 top_k=top_k, seed=seed, block_size=block_size,
                                 lookup=lookup, chat_template=False if no_chat_template else None,
                                 system=system):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        _log.info(_summary(chunk.stats))
        if stats_json is not None:
            report = {**chunk.stats.to_dict(), "finish_reason": chunk.finish_reason,
                      "settings": {**pipe.describe(), "block_size": chunk.stats.block_size,
                                   "lookup": lookup}}
            with atomic_write(stats_json) as f:
                f.write(json.dumps(report, indent=2) + "\n")


def _pipeline_group(pipeline: bool, split: str | None, timeout: float, grace: float = 2.0):
    """--pipeline: the launched group (bounded wait for the other ranks; `grace`: seconds to
    stop after SIGTERM); ranks > 0 print only their own errors, tagged with the rank."""
    if not pipeline:
        if split is not None:
            raise ValueError("--pipeline-split needs --pipeline")
        return None
    from .distributed import init_group

    group = init_group(timeout, grace=grace)
    if group.size() == 1:
        _log.warning("--pipeline: one rank (not started by mlx.launch): the whole target runs "
                     "here")
    if group.rank() > 0:
        log.setup(rank=group.rank())
        warnings.simplefilter("ignore")      # rank 0 reports notices once
    return group


# --------------------------------------------------------------------------- doctor

def _folder_size(path: Path) -> str:
    if not path.exists():
        return "absent"
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return f"{total / 1e6:.0f} MB"


@app.command()
def doctor(verbose: bool = typer.Option(False, "--verbose", help="Tracebacks")):
    """MLX version and backend, the BLAS in effect, kernels, precision defaults, caches."""
    with _errors(verbose):
        from importlib.metadata import PackageNotFoundError, version

        import mlx.core as mx

        from .assets import resolve_cache_dir
        from .kernels import resolve_kernel_path
        from .omlx import default_settings_path

        def row(name, value):
            print(f"{name:<14}{value}")

        def pkg(name):
            try:
                return version(name)
            except PackageNotFoundError:
                return "not installed"

        metal = runtime.on_metal()
        row(PROG, f"{__version__} ({Path(__file__).parent})")
        row("python", f"{platform.python_version()} ({sys.executable})")
        row("platform", f"{platform.system()} {platform.machine()}")
        row("mlx", f"{mx.__version__}, backend {'Metal (GPU)' if metal else 'CPU'}"
            f"{'' if mx.metal.is_available() else ' (Metal not available)'}")
        row("mlx-lm", pkg("mlx-lm"))
        from .distributed import availability
        row("distributed", availability())
        if sys.platform.startswith("linux"):
            chosen, now = blas.use_fast_blas(), blas.active()
            row("blas", f"{now.name} ({now.path or now.how}; ${blas.ENV}="
                f"{os.environ.get(blas.ENV) or 'auto'}: {'|'.join(blas.CHOICES)})"
                + (f"; note: {chosen.note}" if chosen.note else ""))
        a = mx.random.normal((512, 512))
        for _ in range(3):            # MKL loads its CPU-specific kernels on the first calls
            mx.eval(a @ a)
        tic = time.perf_counter()
        for _ in range(5):
            mx.eval(a @ a)
        row("fp32 matmul", f"{5 * 2 * 512 ** 3 / (time.perf_counter() - tic) / 1e9:.0f} GFLOP/s "
            "(512 x 512)")
        try:
            kernels = resolve_kernel_path(None)
            kernels = {"metal": "metal (custom Metal kernels)",
                       "ops": "ops (MLX-ops twins, compiled)"}[kernels]
        except (ValueError, RuntimeError) as e:
            kernels = f"error: {e}"
        row("kernels", kernels)
        p = runtime.resolve_precision(metal=metal)
        row("precision", f"target {p.dtype or 'as stored'}"
            f"{'' if p.keep_quantized else ' (quantized layers dequantized)'}, drafter "
            f"{f'{p.draft_bits}-bit g{p.draft_group_size}' if p.draft_bits else 'unquantized'}"
            f" {p.draft_dtype or ''}".rstrip() + " (--dtype / --draft-bits override)")
        try:
            from . import defaults
            where = getattr(defaults, "drafter_path", None)
            row("default model", f"installed (drafter {where()})" if where else "installed")
        except ImportError:
            row("default model", "not installed in this version (pass --model)")
        except (OSError, ValueError) as e:
            row("default model", f"unavailable: {e}")
        cache = resolve_cache_dir()
        hf = os.environ.get("HF_HUB_CACHE") or str(
            Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub")
        omlx = default_settings_path()
        row("cache", f"{cache} ({_folder_size(cache)}; set $DFLASH2_CACHE to move it)")
        row("hub cache", f"{hf} ({_folder_size(Path(hf))})")
        row("omlx settings", f"{omlx} ({'present' if omlx.is_file() else 'absent'})")
        for line in _calibration_rows():
            row("calibration", line)


def _calibration_rows() -> list[str]:
    """One line per stored cost calibration (`calibration.cache_file()`): the pair, backend and
    BLAS it was taken with, when, how long, how far its rounds disagreed, and whether the next
    load uses it or times it again."""
    from .policy.calibration import cache_file, stale, stored_calibrations
    from .policy.costs import SPREAD

    entries = stored_calibrations()
    if not entries:
        return [f"none stored ({cache_file()}; the first `auto` run takes one)"]
    out = []
    for key, entry in entries.items():
        meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}
        spread = entry.get("spread")
        why = stale(entry)
        state = (f"timed again at the next load: {why}" if why else
                 "timed again at the next load: its rounds disagreed (a busy machine?)"
                 if isinstance(spread, (int, float)) and spread > SPREAD else
                 "timed again at the next load: no context slope fitted"
                 if entry.get("fitted") is False else "settled")
        pair = " + ".join(Path(str(p)).name for p in (meta.get("model"), meta.get("draft"))
                          if p) or "pair unknown"
        spread_text = f"{100 * spread:.0f}%" if isinstance(spread, (int, float)) else "?"
        corrected = f", prices corrected {meta['corrected']}" if meta.get("corrected") else ""
        out.append(f"{pair} ({meta.get('backend', '?')}, BLAS {meta.get('blas', '?')}, key "
                   f"{key}): taken {meta.get('when', '?')} in {meta.get('seconds', '?')} s, "
                   f"rounds within {spread_text}{corrected}; {state}")
    return out


@app.command()
def calibrate(
    model: Optional[str] = typer.Option(None, "--model", help="Target, as `generate` takes it "
                                        "(default: every stored pair)"),
    draft: Optional[str] = typer.Option(None, "--draft", "--draft-model",
                                        help="Drafter, as `generate` takes it"),
    verbose: bool = typer.Option(False, "--verbose", help="Tracebacks"),
):
    """Time the draft and verify costs that `auto` prices its choices by again: of the pair
    given, or of every stored pair (`doctor` lists them)."""
    with _errors(verbose):
        from .pipeline import load
        from .policy import calibration

        stored = calibration.stored_calibrations()
        if model is not None or draft is not None or not stored:
            pairs = [(model, draft)]
        else:
            pairs = list(dict.fromkeys(
                (m.get("model"), m.get("draft")) for m in (
                    e.get("meta") for e in stored.values()) if isinstance(m, dict)))
        done = set()
        for i, (m, d) in enumerate(pairs, 1):
            _log.info(f"calibration {i} of {len(pairs)}: {m or 'the embedded default'}"
                      + (f" with {d}" if d else ""))
            try:
                pipe = load(m, d)
            except (OSError, ValueError) as e:
                _log.warning(f"{m}: not loaded ({e}); its calibration is removed")
                continue
            calibration.load_or_measure_costs(pipe, pipe.max_width(True), fresh=True)
            done.add(calibration.calibration_key(pipe))
        if model is None and draft is None:
            # entries of other load settings (dtype, oMLX entry) or of an older format: the
            # next load with those settings times them again
            calibration.forget_calibrations([k for k in stored if k not in done])
        for line in _calibration_rows():
            _log.info(line)


@app.command()
def bench(
    model: Optional[str] = typer.Option(None, "--model", help="Target (default: the embedded "
                                        "default's)"),
    draft: Optional[str] = typer.Option(None, "--draft", "--draft-model",
                                        help="Drafter (default: the embedded default's)"),
    prompts: int = typer.Option(8, "--prompts", callback=_flag(check.prompts_per_set),
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
    max_tokens: int = typer.Option(128, "--max-tokens", "-m", callback=_flag(check.max_tokens)),
    repeats: int = typer.Option(1, "--repeats", callback=_flag(check.repeats),
                                help="Rounds of every system per prompt, the order rotated "
                                "(figures: medians of the paired ratios)"),
    reference: bool = typer.Option(True, "--reference/--no-reference",
                                   help="Include dflash.model_mlx when it is importable"),
    out: Path = typer.Option(Path("bench-results"), "--out", help="Folder for bench.json, "
                             "bench.md and the plots; an unfinished run there with the same "
                             "settings resumes"),
    verbose: bool = typer.Option(False, "--verbose", help="Tracebacks"),
):
    """Plain mlx-lm vs dflash2-mlx per block size (drafter alone and hybrid) vs the reference."""
    with _errors(verbose):
        sizes = [check.block_size(b.strip(), "--block-sizes") for b in block_sizes.split(",")
                 if b.strip()]
        temps = [check.temperature(t.strip(), "--temperatures") for t in temperatures.split(",")
                 if t.strip()]
        if not temps:
            raise ValueError("--temperatures: expected numbers >= 0, e.g. 0,1")
        if model is None:
            model, default_draft = _default_pair()
            draft = draft or default_draft
        if draft is None:
            raise ValueError("--draft: a drafter is needed to benchmark speculative decoding")
        from .bench import markdown, run_bench, unfinished, write
        from .prompt_sets import PROMPT_SETS

        names = [n.strip() for n in prompt_sets.split(",") if n.strip()]
        unknown = [n for n in names if n not in PROMPT_SETS]
        if unknown or not names:
            raise ValueError(f"--prompt-sets: {', '.join(unknown) or 'nothing'} is not one of "
                             f"{', '.join(PROMPT_SETS)}")
        earlier = unfinished(out)
        with contextlib.redirect_stdout(sys.stderr):
            chosen = {n: PROMPT_SETS[n](prompts) for n in names}
            results = run_bench(model, draft, chosen, block_sizes=sizes, temperatures=temps,
                                max_tokens=max_tokens, lookup=lookup, reference=reference,
                                repeats=repeats, earlier=earlier,
                                checkpoint=lambda r: write(r, out, plots=False))
        write(results, out)
        print(markdown(results))


# --------------------------------------------------------------------------- serve

@app.command()
def serve(
    model: Optional[str] = MODEL,
    draft: Optional[str] = DRAFT,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on"),
    port: int = typer.Option(8080, "--port", callback=_flag(check.port),
                             help="Port; 0 = any free one"),
    block_size: Optional[str] = BLOCK_SIZE,
    lookup: bool = LOOKUP,
    draft_bits: Optional[str] = DRAFT_BITS,
    draft_group_size: Optional[str] = DRAFT_GROUP_SIZE,
    dtype: Optional[str] = DTYPE,
    omlx_settings: Optional[str] = OMLX_SETTINGS,
    model_id: Optional[str] = MODEL_ID,
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="DFLASH2_API_KEY", help="Require this key (Authorization: "
        "Bearer KEY or x-api-key: KEY); also read from $DFLASH2_API_KEY"),
    max_tokens: int = typer.Option(4096, "--max-tokens", callback=_flag(check.max_tokens),
                                   help="Most tokens one request may generate"),
    context_length: Optional[int] = typer.Option(
        None, "--context-length", callback=_flag(check.context_length),
        help="Prompt + completion tokens (default: the target's max_position_embeddings)"),
    beyond_positions: bool = typer.Option(
        False, "--allow-context-beyond-model", help="Accept a --context-length above the "
        "positions the target was trained for (its output past them is unreliable)"),
    keep_billing_header: bool = typer.Option(
        False, "--keep-billing-header", help="Keep Claude Code's per-session "
        "`x-anthropic-billing-header` system block in the prompt (by default it is left out, "
        "so that a new session reuses the prefix cache)"),
    max_body_bytes: int = typer.Option(4 * 2**20, "--max-body-bytes",
                                       callback=_flag(check.max_body_bytes),
                                       help="Largest request body"),
    queue_size: int = typer.Option(16, "--queue-size", callback=_flag(check.queue_size),
                                   help="Requests that may wait for a free row; more get 429"),
    prompt_cache_size: int = typer.Option(8, "--prompt-cache-size",
                                          callback=_flag(check.prompt_cache_size),
                                          help="Prefix-cache entries in RAM; 0: none"),
    prompt_cache_bytes: int = typer.Option(2 * 2**30, "--prompt-cache-bytes",
                                           callback=_flag(check.prompt_cache_bytes),
                                           help="Most bytes the prefix cache holds"),
    prompt_cache_dir: Optional[Path] = typer.Option(
        None, "--prompt-cache-dir", metavar="DIR", help="Also keep prefix-cache entries on "
        "disk in DIR: they outlive RAM and restarts (default: RAM only)"),
    prompt_cache_disk_bytes: Optional[str] = typer.Option(
        None, "--prompt-cache-disk-bytes", metavar="N", callback=_flag(check.byte_size),
        help="Most bytes the disk tier holds, e.g. 20GiB (default: 8 GiB)"),
    shutdown_timeout: float = typer.Option(
        5.0, "--shutdown-timeout", callback=_flag(check.shutdown_timeout),
        help="Seconds in-flight requests get to finish on Ctrl-C / SIGTERM before they are "
        "cancelled"),
    max_batch: int = typer.Option(check.MAX_BATCH, "--max-batch", callback=_flag(check.max_batch),
                                  help="Requests generated at once (continuous batching); "
                                  "1: one at a time"),
    prefill_chunk: int = typer.Option(
        check.PREFILL_CHUNK, "--prefill-chunk", metavar="TOKENS",
        callback=_flag(check.prefill_chunk), help="Prompt tokens a joining request prefills "
        "per step while others decode"),
    ping_interval: float = typer.Option(
        15.0, "--ping-interval", callback=_flag(check.ping_interval),
        help="Seconds of silence before a stream sends a keep-alive ping"),
    read_timeout: float = typer.Option(
        30.0, "--read-timeout", callback=_flag(check.read_timeout),
        help="Seconds a client may take to send a request's head or the next part of its body"),
    pipeline: bool = typer.Option(False, "--pipeline", help="Split the target's layers across "
                                  "the ranks started by mlx.launch (rank 0 serves)"),
    pipeline_split: Optional[str] = PIPELINE_SPLIT,
    pipeline_timeout: float = PIPELINE_TIMEOUT,
    verbose: bool = typer.Option(False, "--verbose", help="Debug logs, tracebacks"),
):
    """Serve OpenAI- and Anthropic-compatible HTTP APIs (needs the `serve` extra)."""
    with _errors(verbose):
        group = _pipeline_group(pipeline, pipeline_split, pipeline_timeout,
                                grace=shutdown_timeout + 5.0)
        if verbose:
            log.setup(logging.DEBUG, rank=group.rank() if group is not None else 0)
        try:
            from . import server
        except ImportError as e:
            if e.name not in ("fastapi", "uvicorn", "starlette", "pydantic"):
                raise
            raise ValueError(f"serve needs the serve extra ({e.name} is missing): pip install "
                             "'dflash2-mlx[serve]'") from None
        if prompt_cache_dir is not None:     # before the model loads
            from .disk_cache import prepare_folder

            prepare_folder(prompt_cache_dir)
        elif prompt_cache_disk_bytes is not None:
            raise ValueError("--prompt-cache-disk-bytes sizes the disk tier: add "
                             "--prompt-cache-dir DIR")
        pipe = _load_pipeline(model, draft, omlx_settings, model_id, block_size, lookup,
                              draft_bits=draft_bits, draft_group_size=draft_group_size,
                              dtype=dtype, pipeline=group, pipeline_split=pipeline_split,
                              pipeline_timeout=pipeline_timeout)
        if pipe is None:                     # a rank > 0: it served rank 0 until it closed
            return
        positions = pipe.context_length
        if context_length and positions and context_length > positions and \
                not beyond_positions:
            raise ValueError(f"--context-length {context_length} is above the {positions} "
                             "positions the target was made for (max_position_embeddings): "
                             "give at most that, or add --allow-context-beyond-model")
        config = server.ServerConfig(
            model_id=server.model_id_for(pipe.info["model"]), max_tokens=max_tokens,
            context_length=context_length or positions or 4096, max_body_bytes=max_body_bytes,
            queue_size=queue_size, api_key=api_key, block_size=block_size,
            prompt_cache_size=prompt_cache_size, prompt_cache_bytes=prompt_cache_bytes,
            prompt_cache_dir=None if prompt_cache_dir is None else str(prompt_cache_dir),
            prompt_cache_disk_bytes=prompt_cache_disk_bytes or check.PROMPT_CACHE_DISK_BYTES,
            ping_interval=ping_interval, read_timeout=read_timeout, max_batch=max_batch,
            prefill_chunk=prefill_chunk, keep_billing_header=keep_billing_header)
        server.serve(pipe, config, host=host, port=port, shutdown_timeout=shutdown_timeout,
                     ready=lambda url: _log.info(f"serving {config.model_id} on {url}"))
        _log.info("stopped")


# --------------------------------------------------------------------------- train (optional)

@app.command("train", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             help="Train a drafter (when the training package is installed; see train --help).")
def train(ctx: typer.Context):
    try:
        from .train.command import train_command
    except ImportError as e:
        if e.name and not e.name.startswith("dflash2_mlx.train"):
            raise
        _log.error("`train` is not available in this version (dflash2_mlx.train is missing)")
        raise typer.Exit(1) from None
    sub = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    sub.command()(train_command)
    with _errors("--verbose" in ctx.args):
        return _run(sub, list(ctx.args), f"{PROG} train")


# --------------------------------------------------------------------------- entry point

def _optional_values(args: list[str]) -> list[str]:
    """`--omlx-settings` may come without a value (typer has no optional-value options):
    give it an explicit empty one when the next word is another flag or there is none."""
    out = []
    for i, arg in enumerate(args):
        nxt = args[i + 1] if i + 1 < len(args) else None
        if arg in OPTIONAL_VALUE_FLAGS and (nxt is None or (nxt.startswith("-") and nxt != "-")):
            arg = f"{arg}={OPTIONAL_VALUE_FLAGS[arg]}"
        out.append(arg)
    return out


def _run(typer_app: typer.Typer, args: list[str], prog: str) -> int:
    command = typer.main.get_command(typer_app)
    try:
        code = command.main(args=args, prog_name=prog, standalone_mode=False)
    except _CLICK_ERROR as e:
        where = e.ctx.command_path if getattr(e, "ctx", None) else prog
        print(f"{where}: error: {e.format_message()} (see {where} --help)", file=sys.stderr)
        return e.exit_code
    except typer.Abort:
        return 130
    return code if isinstance(code, int) else 0


def main(argv: list[str] | None = None) -> None:
    args = _optional_values(list(sys.argv[1:] if argv is None else argv))
    if not args:               # click's no_args_is_help raises an error with an empty message
        args = ["--help"]
    # before the commands import MLX: then MLX binds to the chosen library as it loads
    blas.use_fast_blas()
    # log lines and notices print as "dflash2-mlx: ..." while the command runs; a program
    # calling main() gets its own logging and warning hook back afterwards
    log.setup(logging.INFO)
    previous = warnings.showwarning
    warnings.showwarning = _notice_hook(previous)
    try:
        code = _run(app, args, PROG)
    finally:
        warnings.showwarning = previous
        log.teardown()
    sys.exit(code)


if __name__ == "__main__":
    main()
