"""The installed `dflash2-mlx` command, run as a real subprocess on the tiny fixtures.

Each run starts a fresh Python (~0.3 s for flag errors, ~2 s when MLX loads models); the error
cases run concurrently.
"""

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import dflash2_mlx

EXE = shutil.which("dflash2-mlx", path=str(Path(sys.executable).parent)) or \
    shutil.which("dflash2-mlx")
PROMPT = "def add(a, b):"


def run(*args, stdin=None, env=None, check_rc=None):
    if EXE is None:
        pytest.fail("the dflash2-mlx command is not installed (pip install -e .)")
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    proc = subprocess.run([EXE, *map(str, args)], input=stdin, capture_output=True, text=True,
                          env=full_env, timeout=300)
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stderr
    return proc


def run_many(cases):
    with ThreadPoolExecutor(max_workers=3) as pool:
        return list(pool.map(lambda c: run(*c[0], **c[1]), cases))


def lines(text):
    return [line for line in text.splitlines() if line.strip()]


def write_settings(folder: Path, entries: dict) -> Path:
    path = folder / "model_settings.json"
    path.write_text(json.dumps({"version": 1, "models": entries}))
    return path


def test_generate_streams_the_api_output_with_stats(llama_dir, dflash2_dir, tmp_path):
    stats_path = tmp_path / "stats.json"
    common = ["generate", "--model", llama_dir, "--draft", dflash2_dir, "--max-tokens", 24]
    by_flag, by_stdin = run_many([
        ((*common, "--prompt", PROMPT, "--stats-json", stats_path), {}),
        ((*common, "--prompt", "-", "--block-size", 5), {"stdin": PROMPT}),
    ])
    want = dflash2_mlx.load(str(llama_dir), str(dflash2_dir)).generate(PROMPT, max_tokens=24)
    for proc in (by_flag, by_stdin):
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == want.text + "\n"          # greedy: identical text, either path
        summary = lines(proc.stderr)[-1]
        assert summary.startswith("dflash2-mlx: 24 tokens,") and "tok/s decode" in summary
        assert "tau" in summary and "prefill" in summary
    assert "block size auto" in lines(by_flag.stderr)[-1]      # the default
    assert "block size 5" in lines(by_stdin.stderr)[-1]
    assert "loading drafter" in by_flag.stderr and "Traceback" not in by_flag.stderr
    stats = json.loads(stats_path.read_text())
    assert stats["generated_tokens"] == 24 and stats["block_size"] == "auto"
    assert stats["settings"]["block_size"] == "auto" and stats["settings"]["lookup"] is True
    # auto's choices follow the timings, so only the bookkeeping is checked
    assert stats["cycles"] == len(stats["widths"]) == len(stats["sources"])
    assert stats["steps"] == stats["cycles"] + stats["plain_steps"]
    assert stats["cycles"] == stats["cycles_drafter"] + stats["cycles_lookup"]
    assert stats["finish_reason"] == "length"
    s = stats["settings"]
    assert (s["model"], s["draft"], s["dtype"], s["draft_dtype"], s["draft_bits"],
            s["kernels"], s["backend"]) == (str(llama_dir), str(dflash2_dir), "float32",
                                            "float32", 16, "ops", "cpu")


def test_omlx_settings_applied_and_flags_override(llama_dir, dflash2_dir, tmp_path):
    write_settings(tmp_path, {
        "tiny": {"dflash_enabled": True, "dflash_draft_model": str(dflash2_dir),
                 "dflash_block_size": 4, "dflash_draft_quant_enabled": True,
                 "dflash_draft_quant_weight_bits": 8, "dflash_draft_quant_group_size": 32,
                 "dflash_verify_mode": "dflash", "mtp_enabled": False, "unknown_key": 1},
        str(llama_dir): {"dflash_enabled": False},
    })
    from_file, overridden, disabled = (tmp_path / f"{n}.json" for n in "abc")
    common = ["generate", "--model", llama_dir, "--prompt", PROMPT, "--max-tokens", 12]
    a, b, c = run_many([
        ((*common, "--omlx-settings", tmp_path / "model_settings.json", "--model-id", "tiny",
          "--stats-json", from_file), {}),
        # no PATH: oMLX's default location, here through $OMLX_BASE_PATH
        ((*common, "--model-id", "tiny", "--block-size", 2, "--draft-bits", 16,
          "--stats-json", overridden, "--omlx-settings"), {"env": {"OMLX_BASE_PATH": tmp_path}}),
        # the entry of --model (the default model id) turns DFlash off
        ((*common, "--omlx-settings", tmp_path, "--stats-json", disabled), {}),
    ])
    for proc in (a, b, c):
        assert proc.returncode == 0, proc.stderr
    s = json.loads(from_file.read_text())
    assert s["block_size"] == 4 and s["cycles"] > 0
    assert (s["settings"]["draft_bits"], s["settings"]["draft_group_size"],
            s["settings"]["model_id"]) == (8, 32, "tiny")
    assert s["settings"]["draft_quantized_layers"] > 0
    assert "8-bit, group size 32" in a.stderr and "block size 4" in lines(a.stderr)[-1]
    s = json.loads(overridden.read_text())
    assert s["block_size"] == 2 and s["settings"]["draft_bits"] == 16
    assert s["settings"]["block_size"] == 2        # the width used, not the pipeline default
    assert s["settings"]["omlx_settings"] == str(tmp_path / "model_settings.json")
    s = json.loads(disabled.read_text())
    assert s["cycles_drafter"] == 0 and s["settings"]["draft"] is None
    assert "dflash_enabled is false: no drafter" in c.stderr
    assert c.stdout == a.stdout                           # greedy: same text without drafting


BAD_FLAGS = [  # (arguments, words the one error line must contain)
    (["--draft-bits", "3"], ["--draft-bits", "'3'", "4, 8, 16"]),
    (["--draft-group-size", "48"], ["--draft-group-size", "32, 64, 128"]),
    (["--dtype", "float8"], ["--dtype", "float32, float16, bfloat16"]),
    (["--kernels", "cuda"], ["--kernels", "'cuda'", "auto, stock, metal"]),
    (["--temp", "-1"], ["--temp"]),
    (["--top-p", "0"], ["--top-p", "(0, 1]"]),
    (["--top-k", "-2"], ["--top-k"]),
    (["--max-tokens", "0"], ["--max-tokens"]),
    (["--max-tokens", "many"], ["--max-tokens"]),
    (["--block-size", "0"], ["--block-size"]),
    (["--seed", "x"], ["--seed"]),
    (["--seed", "-1"], ["--seed", "-1", "0..2**64-1"]),
    (["--seed", str(2**70)], ["--seed", "0..2**64-1"]),
    (["--temp", "inf"], ["--temp", "finite"]),
    (["--temp", "nan"], ["--temp", "finite"]),
    (["--prompt", ""], ["--prompt", "non-empty"]),
    (["--block-size", "two"], ["--block-size", "'two'"]),
    (["--no-such-flag"], ["--no-such-flag"]),
    (["--model-id", "x"], ["--model-id", "--omlx-settings"]),
]


# the other commands' bounded flags: each checked by its `settings` validator (typer's min /
# max used to check them apart, in other words)
OTHER_BAD_FLAGS = [
    (["serve", "--port", "70000"], ["--port", "70000", "0..65535"]),
    (["serve", "--queue-size", "0"], ["--queue-size", "integer >= 1"]),
    (["serve", "--memory-budget", "150%"], ["--memory-budget", "percentage"]),
    (["serve", "--context-length", "1"], ["--context-length", "integer >= 2"]),
    (["serve", "--max-body-bytes", "10"], ["--max-body-bytes", ">= 1024"]),
    (["serve", "--prompt-cache-size", "-1"], ["--prompt-cache-size", ">= 0"]),
    (["serve", "--shutdown-timeout", "-1"], ["--shutdown-timeout", "seconds >= 0"]),
    (["serve", "--max-tokens", "0"], ["--max-tokens", "integer >= 1"]),
    (["generate", "--pipeline-timeout", "0.5"], ["--pipeline-timeout", "seconds >= 1"]),
    (["bench", "--prompts", "200"], ["--prompts", "1..164"]),
    (["bench", "--max-tokens", "0"], ["--max-tokens", "integer >= 1"]),
]


def test_bad_flags_one_line_nonzero():
    cases = [(["generate", *args], words) for args, words in BAD_FLAGS] + OTHER_BAD_FLAGS
    procs = run_many([(tuple(args), {}) for args, _ in cases] + [(("no-such-command",), {})])
    for (args, words), proc in zip(cases + [(None, ["no-such-command"])], procs,
                                   strict=True):
        err = lines(proc.stderr)
        assert proc.returncode != 0 and len(err) == 1, (args, proc.stderr)
        assert err[0].startswith("dflash2-mlx") and "error" in err[0], err
        assert all(w in err[0] for w in words), (words, err[0])
        assert proc.stdout == ""


def test_input_errors_name_the_flag_before_loading(tmp_path):
    """Non-UTF-8 bytes (argv and stdin) reached the tokenizer as a TypeError; an unwritable
    --stats-json failed after the whole generation; no arguments printed an empty error."""
    bad_argv = subprocess.run([EXE, "generate", "--prompt", b"caf\xe9"], capture_output=True,
                              text=True, timeout=300)
    bad_stdin = subprocess.run([EXE, "generate", "--prompt", "-"], input=b"caf\xe9 au lait",
                               capture_output=True, timeout=300)
    unwritable = run("generate", "--stats-json", tmp_path / "no" / "such" / "stats.json")
    folder = run("generate", "--stats-json", tmp_path)
    for proc, words in ((bad_argv, ["--prompt", "UTF-8"]),
                        (bad_stdin, ["--prompt -", "UTF-8", "0xe9"]),
                        (unwritable, ["--stats-json", "no such folder"]),
                        (folder, ["--stats-json", "is a folder"])):
        err = proc.stderr if isinstance(proc.stderr, str) else proc.stderr.decode()
        assert proc.returncode != 0 and len(lines(err)) == 1, err
        assert all(w in err for w in words) and "loading" not in err, (words, err)
    bare = run()
    assert bare.returncode == 0 and "generate" in bare.stdout and "doctor" in bare.stdout
    assert bare.stderr.strip() == ""


@pytest.mark.slow  # 8 s: 19 CLI processes
def test_bad_settings_and_values_one_line_nonzero(llama_dir, dflash2_dir, tmp_path):
    entries = {
        "not-bool": {"dflash_enabled": "yes"},
        "bits": {"dflash_enabled": True, "dflash_draft_quant_weight_bits": 3},
        "two-bit": {"dflash_enabled": True, "dflash_draft_quant_bits": 2},
        "group": {"dflash_enabled": True, "dflash_draft_quant_group_size": 48},
        "act": {"dflash_enabled": True, "dflash_draft_quant_activation_bits": 8},
        "block": {"dflash_enabled": True, "dflash_block_size": "four"},
        "mode": {"dflash_enabled": True, "dflash_verify_mode": "beam"},
        "ddtree": {"dflash_enabled": True, "dflash_verify_mode": "ddtree",
                   "dflash_draft_model": str(dflash2_dir)},
        "max-ctx": {"dflash_enabled": True, "dflash_max_ctx": 0},
        "no-draft": {"dflash_enabled": True},
        "too-wide": {"dflash_enabled": True, "dflash_block_size": 17,
                     "dflash_draft_model": str(dflash2_dir)},
    }
    path = write_settings(tmp_path, entries)
    (tmp_path / "broken.json").write_text("{oops")
    expect = {  # model id -> words of the error line
        "not-bool": ["dflash_enabled", '"yes"', "true or false"],
        "bits": ["dflash_draft_quant_weight_bits", "3", "4 or 8"],
        "two-bit": ["dflash_draft_quant_bits", "2-bit", "not supported"],
        "group": ["dflash_draft_quant_group_size", "48", "32 or 64 or 128"],
        "act": ["dflash_draft_quant_activation_bits", "16 or 32"],
        "block": ["dflash_block_size", '"four"', "integer >= 1"],
        "mode": ["dflash_verify_mode", '"beam"', '"ddtree"'],
        "ddtree": ["dflash_verify_mode", "ddtree", "not supported"],
        "max-ctx": ["dflash_max_ctx", "integer >= 1"],
        "no-draft": ["dflash_draft_model", "not set", "--draft"],
        "too-wide": ["dflash_block_size = 17", "drafter's block size 16"],
        "missing-id": ["no entry for model 'missing-id'", "entries:"],
    }
    base = ["generate", "--model", llama_dir, "--max-tokens", 4]
    cases = [((*base, "--omlx-settings", path, "--model-id", mid), {}) for mid in expect]
    others = [  # (arguments, stdin, words)
        (["--omlx-settings", tmp_path / "broken.json"], None, ["broken.json", "malformed JSON"]),
        (["--omlx-settings", tmp_path / "none.json"], None, ["none.json", "no such oMLX"]),
        (["--draft", tmp_path / "nowhere"], None, ["draft model", "nowhere", "no such"]),
        (["--draft", llama_dir], None, ["config.json", "block_size"]),
        (["--draft", dflash2_dir, "--block-size", 17], None, ["--block-size 17", "1..16"]),
        (["--prompt", "-"], "", ["--prompt -", "empty"]),
    ]
    cases += [((*base, *args), {"stdin": stdin}) for args, stdin, _ in others]
    cases += [(("generate", "--model", tmp_path / "no-model"), {})]
    # a context beyond the target's 4096 positions is refused, with the reason and the flag
    cases += [(("serve", "--model", llama_dir, "--draft", dflash2_dir, "--port", 0,
                "--context-length", 8192), {})]
    procs = run_many(cases)
    words = [*expect.values(), *(w for *_, w in others), ["target model", "no-model", "no such"],
             ["--context-length 8192", "4096 positions", "--allow-context-beyond-model"]]
    for (args, _), want, proc in zip(cases, words, procs, strict=True):
        err = [line for line in lines(proc.stderr) if "error" in line]
        assert proc.returncode == 1 and len(err) == 1, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr
        if "--omlx-settings" in map(str, args) and "/" not in want[0]:
            assert str(path.parent) in err[0] or "json" in err[0], err[0]
        assert all(w in err[0] for w in want), (want, err[0])


def test_verbose_shows_the_traceback_and_the_settings(llama_dir, tmp_path):
    (tmp_path / "broken.json").write_text("{oops")
    proc = run("generate", "--model", llama_dir, "--omlx-settings", tmp_path / "broken.json",
               "--verbose")
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "OmlxSettingsError" in \
        proc.stderr


def test_doctor_and_help():
    doctor, help_ = run_many([(("doctor",), {}), (("--help",), {})])
    assert doctor.returncode == 0, doctor.stderr
    for word in ("mlx ", "backend", "kernels", "precision", "cache", "omlx settings"):
        assert word in doctor.stdout, doctor.stdout
    if sys.platform.startswith("linux"):
        from dflash2_mlx.loading import blas

        want = "mkl" if blas.find_mkl() else "openblas" if blas.find_openblas() else "bundled"
        assert f"blas          {want} (" in doctor.stdout, doctor.stdout
    assert help_.returncode == 0 and "generate" in help_.stdout and "doctor" in help_.stdout


def test_without_an_embedded_default(monkeypatch, capsys):
    from dflash2_mlx import cli

    monkeypatch.setitem(sys.modules, "dflash2_mlx.loading.defaults", None)      # import fails
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompt", "hi"])
    assert e.value.code == 1
    assert "no embedded default model is installed" in capsys.readouterr().err


@pytest.mark.slow  # 35 s: the SmolLM2 pair through the CLI
def test_embedded_default_pair(tmp_path):
    """The README's first command: no --model, no --draft (skipped until a drafter ships)."""
    try:
        from dflash2_mlx.loading.defaults import drafter_path

        drafter = drafter_path()
    except (ImportError, OSError) as e:
        pytest.skip(f"no embedded default drafter: {e}")
    stats = tmp_path / "stats.json"
    proc = run("generate", "--prompt", "Write a Python function that adds two numbers.",
               "--max-tokens", 8, "--stats-json", stats, check_rc=0)
    settings = json.loads(stats.read_text())["settings"]
    assert Path(settings["draft"]) == Path(drafter) and settings["model"].endswith(".gguf")
    assert proc.stdout.strip() and "tau" in lines(proc.stderr)[-1]


def test_train_is_registered_lazily(monkeypatch, capsys):
    """`dflash2-mlx train ...` hands its arguments to `dflash2_mlx.train.command.train_command`
    (owned by the training package) when it exists; a clear error when it does not."""
    import types

    import typer

    from dflash2_mlx import cli

    def train_command(steps: int = typer.Option(1, "--steps", min=1, help="Steps to run")):
        print(f"training for {steps} steps")

    fake = types.ModuleType("dflash2_mlx.train.command")
    fake.train_command = train_command
    monkeypatch.setitem(sys.modules, "dflash2_mlx.train.command", fake)
    for argv, code, out, err in ((["train", "--steps", "3"], 0, "training for 3 steps", ""),
                                 (["train", "--help"], 0, "--steps", ""),
                                 (["train", "--steps", "0"], 2, "", "--steps")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        captured = capsys.readouterr()
        assert e.value.code == code and out in captured.out and err in captured.err
        assert len(lines(captured.err)) == (1 if err else 0)
    monkeypatch.setitem(sys.modules, "dflash2_mlx.train.command", None)   # import fails
    with pytest.raises(SystemExit) as e:
        cli.main(["train"])
    assert e.value.code == 1 and "`train` is not available" in capsys.readouterr().err


def test_main_restores_the_warning_hook(capsys):
    """The CLI installed a global warnings.showwarning hook and never put the old one back."""
    import warnings

    from dflash2_mlx import cli

    before = warnings.showwarning
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert warnings.showwarning is before


def test_calibrate_redoes_each_stored_pair_and_doctor_shows_them(llama_dir, dflash2_dir,
                                                                 tmp_path):
    """`calibrate --model --draft` times one pair, `calibrate` every stored pair again (an
    entry it cannot load again is removed: the next load times it); `doctor` lists each with
    when, how long, its spread and whether the next load uses it; progress goes to stderr
    as plain lines (not a terminal)."""
    env = {"DFLASH2_CACHE": str(tmp_path / "cache")}
    none = run("doctor", env=env, check_rc=0)
    assert "calibration   none stored" in none.stdout, none.stdout
    one = run("calibrate", "--model", llama_dir, "--draft", dflash2_dir, env=env, check_rc=0)
    assert "calibration 1 of 1" in one.stderr and "rounds within" in one.stderr, one.stderr
    assert "\r" not in one.stderr and one.stdout == ""
    path = tmp_path / "cache" / "calibration.json"
    table = json.loads(path.read_text())
    (key, entry), = table.items()
    assert entry["meta"]["model"] == str(llama_dir) and entry["meta"]["seconds"] >= 0
    table["old-format-entry"] = {"draft": [0.0], "verify": [0.1]}
    path.write_text(json.dumps(table))
    again = run("calibrate", env=env, check_rc=0)
    assert "calibration 1 of 1" in again.stderr, again.stderr
    table = json.loads(path.read_text())
    assert list(table) == [key] and table[key]["meta"]["when"] >= entry["meta"]["when"]
    doctor = run("doctor", env=env, check_rc=0)
    row = next(line for line in doctor.stdout.splitlines() if line.startswith("calibration"))
    assert f"{llama_dir.name} + {dflash2_dir.name}" in row and key in row, row
    assert "rounds within" in row and ("settled" in row or "timed again" in row), row
