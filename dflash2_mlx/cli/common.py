"""What the commands share: the app, one-line errors, flag checks, reading the prompt, the
embedded default pair, loading as `generate` and `serve` both do, the flags they share and the
launched group of `--pipeline`."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import typer

from .. import log
from .. import settings as check

PROG = log.PROG
_log = log.get(__name__)
# typer >= 0.26 vendors click; the base class of its usage errors is found the same way in both.
CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")

app = typer.Typer(name=PROG, add_completion=False, no_args_is_help=True,
                  pretty_exceptions_enable=False,
                  help="Exact speculative decoding with DFlash / DFlash 2 drafters on MLX.")


@contextlib.contextmanager
def errors(verbose: bool):
    """One line per error and a non-zero exit; the traceback only with --verbose."""
    try:
        yield
    except (typer.Exit, CLICK_ERROR):
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


def flag(validator):
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


def prompt_flag(value: str) -> str:
    return value if value == "-" else flag(check.text)(value)


def writable(path: Path, flag: str) -> None:
    """Fail before the generation, not after it, when a report file cannot be written."""
    folder = path.parent
    why = ("it is a folder" if path.is_dir() else
           f"no such folder {folder}" if not folder.is_dir() else
           f"the folder {folder} is not writable" if not os.access(folder, os.W_OK) else
           "the file is not writable" if path.exists() and not os.access(path, os.W_OK)
           else None)
    if why:
        raise ValueError(f"{flag} {path}: cannot be written ({why})")


def read_stdin() -> str:
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


def default_pair() -> tuple[str, str]:
    """The embedded default (target, drafter), from `dflash2_mlx.loading.defaults`."""
    try:
        from ..loading.defaults import default_pair as embedded_pair
    except ImportError as e:
        if e.name and not e.name.startswith("dflash2_mlx.loading.defaults"):
            raise
        raise ValueError("no --model given and no embedded default model is installed in this "
                         "version; pass --model (and --draft)") from e
    target, drafter = embedded_pair()
    return str(target), str(drafter)


def summary(stats) -> str:
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


def load_pipeline(model, draft, omlx_settings, model_id, block_size, lookup, **options):
    """Load as `generate` and `serve` both do: the embedded default without --model, the oMLX
    entry when asked, flags over the file; check --block-size against the drafter. A follower
    rank of a pipeline-sharded target serves rank 0 until it is done, then gets None."""
    if model_id is not None and omlx_settings is None:
        raise ValueError("--model-id names an entry of the oMLX settings: add "
                         "--omlx-settings [PATH]")
    settings = None
    default_draft = None
    if model is None:
        model, default_draft = default_pair()
    if omlx_settings is not None:
        from ..loading.omlx import load_omlx_settings

        settings = load_omlx_settings(omlx_settings or None, model_id=model_id or model)
        if default_draft and settings.draft_model is None:
            settings = dataclasses.replace(settings, draft_model=default_draft)
        settings.check(draft)        # fail before loading anything
    elif draft is None:
        draft = default_draft

    from ..pair import load

    tic = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):       # stdout carries the generated text only
        pipe = load(model, draft, settings=settings, lookup=lookup, **options)
    if pipe.stage is not None:
        from ..distributed import follow_unless_leader

        if follow_unless_leader(pipe):       # rank 0 writes text, summary and stats
            return None
    try:
        pipe.block_size(block_size, lookup)
    except ValueError as e:
        raise ValueError(f"--block-size {block_size}: {e}") from e
    if pipe.drafter is None and settings is None:
        _log.warning(f"no drafter ({pipe.info.get('draft_why')}): "
                     + ("lookup drafting from the context only" if lookup else
                        "plain target decoding"))
    _log.info(f"ready in {time.perf_counter() - tic:.1f} s")
    return pipe


# Flags that `generate` and `serve` share (one definition each; typer reads them per command)
MODEL = typer.Option(None, "--model", help="Target: mlx-lm model folder, hub id or .gguf file "
                     "(default: the embedded default)")
DRAFT = typer.Option(None, "--draft", "--draft-model", help="DFlash / DFlash 2 drafter folder "
                     "or hub id; 'none' for none (default: the oMLX setting, else the embedded "
                     "default's, else the published drafter found for --model)")
BLOCK_SIZE = typer.Option(
    None, "--block-size", callback=flag(check.block_size), metavar="{1..B,auto}",
    help="Rows verified per cycle, 1..the widest block of the drafter (B) or the lookup (16), "
    "or 'auto' to choose source and width each cycle (default: the oMLX setting, else auto)")
LOOKUP = typer.Option(True, "--lookup/--no-lookup",
                      help="Also draft by lookup in the context (default: on)")
DRAFT_BITS = typer.Option(None, "--draft-bits", callback=flag(check.draft_bits),
                          metavar="{4,8,16}", help="Drafter weight bits; 16 = unquantized "
                          "(default: 4 on Metal, 16 on CPU)")
DRAFT_GROUP_SIZE = typer.Option(None, "--draft-group-size", metavar="{32,64,128}",
                                callback=flag(check.draft_group_size),
                                help="Quantization group size (default: 64)")
KV_BITS = typer.Option(None, "--kv-bits", callback=flag(check.kv_bits), metavar="{4,8}",
                       help="Quantize the target's full-attention KV cache to 4 or 8 bits "
                       "from the first token (default: float)")
KV_GROUP_SIZE = typer.Option(None, "--kv-group-size", metavar="{32,64,128}",
                             callback=flag(check.kv_group_size),
                             help="Group size of the quantized KV cache, a divisor of the "
                             "head dim (default: 64)")
KERNELS = typer.Option(
    None, "--kernels", callback=flag(check.kernels), metavar="{auto,stock,metal}",
    help="auto: custom kernels where they run (the drafter's on Metal, the target's verify "
    "kernels where this Mac's probe chose them); stock: MLX's own everywhere; metal: every "
    "custom kernel (default: $DFLASH2_KERNELS, else auto)")
DTYPE = typer.Option(None, "--dtype", callback=flag(check.dtype),
                     metavar="{float32,float16,bfloat16}",
                     help="Float weight dtype (default: float32 on CPU, as stored on Metal)")
OMLX_SETTINGS = typer.Option(
    None, "--omlx-settings", metavar="[PATH]", help="Read oMLX's model_settings.json (PATH, or "
    "$OMLX_BASE_PATH/~/.omlx when no PATH is given); flags override it")
MODEL_ID = typer.Option(None, "--model-id", help="Entry in the oMLX settings (default: --model)")
PIPELINE_SPLIT = typer.Option(None, "--pipeline-split", metavar="N,N,...",
                              help="Layers per rank (default: even)")
PIPELINE_TIMEOUT = typer.Option(60.0, "--pipeline-timeout",
                                callback=flag(check.pipeline_timeout),
                                help="Seconds a rank may wait for another")



def pipeline_group(pipeline: bool, split: str | None, timeout: float, grace: float = 2.0):
    """--pipeline: the launched group (bounded wait for the other ranks; `grace`: seconds to
    stop after SIGTERM); ranks > 0 print only their own errors, tagged with the rank."""
    if not pipeline:
        if split is not None:
            raise ValueError("--pipeline-split needs --pipeline")
        return None
    from ..distributed import init_group

    group = init_group(timeout, grace=grace)
    if group.size() == 1:
        _log.warning("--pipeline: one rank (not started by mlx.launch): the whole target runs "
                     "here")
    if group.rank() > 0:
        log.setup(rank=group.rank())
        warnings.simplefilter("ignore")      # rank 0 reports notices once
    return group


def run_app(typer_app: typer.Typer, args: list[str], prog: str) -> int:
    command = typer.main.get_command(typer_app)
    try:
        code = command.main(args=args, prog_name=prog, standalone_mode=False)
    except CLICK_ERROR as e:
        where = e.ctx.command_path if getattr(e, "ctx", None) else prog
        print(f"{where}: error: {e.format_message()} (see {where} --help)", file=sys.stderr)
        return e.exit_code
    except typer.Abort:
        return 130
    return code if isinstance(code, int) else 0

