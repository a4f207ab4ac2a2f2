"""Which BLAS MLX's float32 matmuls run on (Linux): chosen by $DFLASH2_BLAS, put in effect by
`dflash2_mlx.use_fast_blas()` (and `load()`) whether or not MLX was imported first, never by
`import dflash2_mlx`; shown by `doctor`; and the set-up script's BLAS step.

Each case runs in a fresh Python, since a process binds its BLAS once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash2_mlx.loading import blas

ROOT = Path(__file__).resolve().parents[1]
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux matter")

PROBE = """
import json, sys, time
if sys.argv[1] == "mlx-first":
    import mlx.core as mx
import dflash2_mlx
from dflash2_mlx.loading import blas
chosen = dflash2_mlx.use_fast_blas()
import mlx.core as mx, numpy as np
a = np.random.default_rng(0).normal(size=(256, 256)).astype(np.float32)
out = np.array(mx.array(a) @ mx.array(a))
print(json.dumps({"active": blas.active().name, "selected": chosen.name, "note": chosen.note,
                  "error": float(np.abs(out - a @ a).max() / np.abs(a @ a).max())}))
"""

# `import dflash2_mlx` alone, then the public call, then load() in a process that never made it
UNTOUCHED = """
import json, sys
import dflash2_mlx
lazy = "mlx.core" not in sys.modules
import mlx.core as mx
from dflash2_mlx.loading import blas
fast = {blas.find_mkl(), blas.find_openblas()} - {None}
loaded = sorted({path for *_, path in blas._maps() if path in fast})
before = {"active": blas.active().name, "loaded": loaded, "lazy": lazy}
if sys.argv[1] == "call":
    chosen = dflash2_mlx.use_fast_blas()
    again = dflash2_mlx.use_fast_blas()
    after = {"chosen": chosen.name, "same": again is chosen}
else:
    dflash2_mlx.load(sys.argv[2])
    after = {}
print(json.dumps({"before": before, "after": {**after, "active": blas.active().name}}))
"""


def probe(order: str, choice: str | None, script: str = PROBE, *args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (blas.ENV, blas.LEGACY_OFF_ENV)}
    if choice is not None:
        env[blas.ENV] = choice
    proc = subprocess.run([sys.executable, "-c", script, order, *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fastest() -> str:
    return "mkl" if blas.find_mkl() else "openblas" if blas.find_openblas() else "bundled"


@linux
@pytest.mark.parametrize("order", ["package-first", "mlx-first"])
@pytest.mark.parametrize("choice", ["mkl", "openblas", "none"])
def test_the_chosen_blas_is_the_one_mlx_calls(order, choice):
    """MLX imported before dflash2_mlx used to keep its slow bundled BLAS silently."""
    if choice != "none" and blas.find(choice) is None:
        pytest.skip(f"{choice} is not installed here")
    got = probe(order, choice)
    want = "bundled" if choice == "none" else choice
    assert got["active"] == want and got["selected"] == want and got["note"] is None, got
    assert got["error"] < 1e-5, got          # and the matmul it computes is right


@linux
def test_auto_prefers_mkl_then_openblas():
    assert probe("mlx-first", None)["active"] == fastest()


@linux
def test_importing_the_package_leaves_the_blas_alone():
    """`import dflash2_mlx` re-pointed libmlx's gemm slots; now only the public call (or
    `load()`) does, once per process."""
    got = probe("call", None, UNTOUCHED)
    assert got["before"] == {"active": "bundled", "loaded": [], "lazy": True}, got
    assert got["after"] == {"chosen": fastest(), "same": True, "active": fastest()}, got


@linux
def test_load_selects_the_blas(llama_dir):
    got = probe("load", None, UNTOUCHED, llama_dir)
    assert got["before"]["active"] == "bundled" and got["after"]["active"] == fastest(), got


@linux
def test_a_missing_or_unknown_choice_is_a_note_not_a_crash(monkeypatch):
    monkeypatch.setattr(blas, "find_mkl", lambda: None)
    monkeypatch.setattr(blas, "find_openblas", lambda: None)
    status = blas.select("auto")
    assert status.note and blas.MKL_HINT in status.note and blas.OPENBLAS_HINT in status.note
    monkeypatch.setenv(blas.ENV, "atlas")
    with pytest.raises(ValueError, match="DFLASH2_BLAS='atlas' is not one of"):
        blas.requested()
    assert "DFLASH2_BLAS='atlas'" in blas.select().note


@linux
def test_libmlx_gemm_slots_are_found():
    import mlx.core  # noqa: F401  (loads libmlx)

    found = blas._libmlx(blas._maps())
    assert found is not None
    slots = blas.plt_slots(found[0])
    assert "cblas_sgemm" in slots and all(off > 0 for off in slots.values())
    assert blas.active().name in ("mkl", "openblas", "bundled")


@linux
def test_debian_openblas_paths_are_looked_at():
    """Debian keeps the library under openblas-pthread/ behind an alternatives link."""
    arch = f"{os.uname().machine}-linux-gnu"
    assert f"/usr/lib/{arch}/openblas-pthread/libopenblas.so.0" in blas.OPENBLAS_CANDIDATES
    assert f"/usr/lib/{arch}/libopenblas.so.0" in blas.OPENBLAS_CANDIDATES


@linux
@pytest.mark.parametrize("choice", ["auto", "openblas"])
def test_setup_script_needs_no_apt_get_when_a_blas_is_there(tmp_path, choice):
    """The README's one-liner ran `apt-get update` on every run, failing offline or without
    root although OpenBLAS was installed."""
    if choice == "openblas" and blas.find_openblas() is None:
        pytest.skip("no OpenBLAS installed here")
    if choice == "auto" and os.uname().machine != "x86_64" and blas.find_openblas() is None:
        pytest.skip("no BLAS present: setup would rightly install one")
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in ("apt-get", "sudo"):
        (fake / tool).write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {tmp_path}/calls\nexit 1\n")
        (fake / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", blas.ENV: choice}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--blas-only"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "calls").exists(), (tmp_path / "calls").read_text()
    assert "setup: BLAS:" in proc.stdout
