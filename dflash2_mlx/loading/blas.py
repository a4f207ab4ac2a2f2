"""The BLAS that MLX's float32 matmuls run on, on Linux: Intel MKL (PyPI wheel `mkl`), the
system's OpenBLAS, or the slow reference BLAS bundled in MLX's CPU wheel (~5 GFLOP/s).

`DFLASH2_BLAS=mkl|openblas|none|auto` chooses (auto: MKL, else OpenBLAS, else none; MKL ran
the decode step's small-M matmuls 2-3x faster than OpenBLAS on the project's x86-64 machine).
Importing the package changes nothing: `use_fast_blas()` (once per process; `load()` and the CLI
call it) or `select()` (any choice, any time) makes MLX use the chosen library by one of two
routes:

- MLX not imported yet: load the library with RTLD_GLOBAL; libmlx's `cblas_*` references then
  resolve there when MLX loads (this also covers its LAPACK calls).
- MLX already imported: Python loaded libmlx with RTLD_NOW, so its `cblas_*` calls are already
  bound. libmlx is not linked `-z now`, so its PLT slots (`.got.plt`) sit outside the read-only
  RELRO range; `select()` points the `cblas_sgemm` / `dgemm` / `cgemm` slots at the chosen
  library. Each slot is checked (writable, currently pointing into a loaded library) before it
  is written; if anything does not match, nothing is written and `select()` says why.

`active()` reports what MLX's `cblas_sgemm` slot points into right now, so `doctor` shows the
BLAS actually in effect, not the one asked for.

This module must not import mlx.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

ENV = "DFLASH2_BLAS"
LEGACY_OFF_ENV = "DFLASH2_NO_OPENBLAS"      # older switch: "1" means DFLASH2_BLAS=none
CHOICES = ("auto", "mkl", "openblas", "none")
GEMMS = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")
MKL_HINT = "pip install mkl"
OPENBLAS_HINT = "sudo apt-get install -y libopenblas0-pthread"
_ARCH = f"{platform.machine()}-linux-gnu"
# Debian/Ubuntu keep the library under openblas-<flavour>/ and point libopenblas.so.0 at it
# through update-alternatives; Fedora and Arch use the plain names.
OPENBLAS_CANDIDATES = (
    f"/usr/lib/{_ARCH}/libopenblas.so.0",
    f"/usr/lib/{_ARCH}/openblas-pthread/libopenblas.so.0",
    f"/usr/lib/{_ARCH}/openblas-openmp/libopenblas.so.0",
    f"/usr/lib/{_ARCH}/openblas-serial/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


@dataclass(frozen=True)
class Status:
    """What `select()` did: `name` is the BLAS now in effect ("mkl" | "openblas" | "bundled"
    | "unknown"), `how` how it got there, `path` the library file, `note` a line for users
    when the wish could not be met (None when all is well)."""

    name: str
    how: str
    path: str | None = None
    note: str | None = None


def requested() -> str:
    """The choice from the environment: `DFLASH2_BLAS`, else "auto"."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return "none" if os.environ.get(LEGACY_OFF_ENV) == "1" else "auto"
    if value not in CHOICES:
        raise ValueError(f"${ENV}={os.environ[ENV]!r} is not one of {', '.join(CHOICES)}")
    return value


def find_mkl() -> str | None:
    """`libmkl_rt` of the installed `mkl` wheel (it lands in <prefix>/lib, not site-packages)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        files = distribution("mkl").files or []
        dist = distribution("mkl")
    except PackageNotFoundError:
        files, dist = [], None
    for f in files:
        if f.name.startswith("libmkl_rt.so"):
            path = Path(dist.locate_file(f)).resolve()
            if path.is_file():
                return str(path)
    for prefix in (sys.prefix, sys.base_prefix):
        for name in ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so"):
            if (Path(prefix) / "lib" / name).is_file():
                return str(Path(prefix) / "lib" / name)
    return None


def find_openblas() -> str | None:
    """Path of a system OpenBLAS shared library, or None."""
    for path in OPENBLAS_CANDIDATES:
        if Path(path).exists():
            return path
    return None


def find(name: str) -> str | None:
    return {"mkl": find_mkl, "openblas": find_openblas}[name]()


# --------------------------------------------------------------------------- process maps

def _maps() -> list[tuple[int, int, str, int, str]]:
    """(start, end, perms, offset, path) of this process's file mappings."""
    out = []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        out.append((lo, hi, parts[1], int(parts[2], 16), parts[5]))
    return out


def _mapping_of(address: int, maps=None):
    for lo, hi, perms, _, path in maps or _maps():
        if lo <= address < hi:
            return perms, path
    return None, None


def kind_of(path: str | None) -> str:
    """'mkl' | 'openblas' | 'bundled' (MLX's own copy) | 'unknown', from a library's file name."""
    name = Path(path or "").name
    if "mkl" in name:
        return "mkl"
    if "openblas" in name:
        return "openblas"
    if name.startswith("libblas") and "mlx" in str(path):
        return "bundled"
    return "unknown"


# --------------------------------------------------------------------------- libmlx's PLT

def _libmlx(maps) -> tuple[str, int] | None:
    """(path, load base) of libmlx.so in this process, or None when MLX is not loaded."""
    for lo, _, _, offset, path in maps:
        if path.endswith("/libmlx.so") and offset == 0:
            return path, lo
    return None


def plt_slots(path: str, names=GEMMS) -> dict[str, int]:
    """{symbol: offset of its relocated slot from the load base} for `names`, read from the
    ELF file's dynamic relocations (JUMP_SLOT and GLOB_DAT, x86-64 / aarch64 little-endian)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
        shoff, = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum, _ = struct.unpack_from("<HHH", head, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]

        def data(index):
            s = sections[index]
            f.seek(s[4])
            return f.read(s[5])

        slots = {}
        for sec in sections:
            if sec[1] != 4:                     # SHT_RELA
                continue
            symtab = sections[sec[6]]
            if symtab[1] != 11:                 # relocations against .dynsym only
                continue
            syms, strs = data(sec[6]), data(symtab[6])
            f.seek(sec[4])
            rela = f.read(sec[5])
            for i in range(0, len(rela) - 23, 24):
                r_offset, r_info, _ = struct.unpack_from("<QQq", rela, i)
                if (r_info & 0xFFFFFFFF) not in (6, 7, 1025, 1026):   # GLOB_DAT / JUMP_SLOT
                    continue
                st_name, = struct.unpack_from("<I", syms, (r_info >> 32) * 24)
                name = strs[st_name:strs.index(b"\0", st_name)].decode()
                if name in names:
                    slots[name] = r_offset
        return slots


def _bound(maps) -> tuple[str | None, dict[str, int]]:
    """(library that libmlx's cblas_sgemm slot points into, {symbol: slot address})."""
    found = _libmlx(maps)
    if found is None:
        return None, {}
    path, base = found
    slots = {name: base + off for name, off in plt_slots(path).items()}
    if "cblas_sgemm" not in slots:
        return None, slots
    target = ctypes.c_void_p.from_address(slots["cblas_sgemm"]).value or 0
    _, lib = _mapping_of(target, maps)
    return lib, slots


def active() -> Status:
    """The BLAS MLX's float32 matmuls call right now (MLX must be imported)."""
    maps = _maps()
    lib, _ = _bound(maps)
    if lib is None:
        return Status("unknown", "libmlx not found in this process")
    return Status(kind_of(lib), "bound", lib)


def _rebind(lib: ctypes.CDLL, maps) -> str | None:
    """Point libmlx's gemm slots at `lib`'s functions; None when done, else why not."""
    try:
        current, slots = _bound(maps)
    except (OSError, ValueError, struct.error) as e:
        return f"could not read libmlx's relocations ({e})"
    if current is None or "cblas_sgemm" not in slots:
        return "libmlx's cblas_sgemm slot was not found"
    new = {}
    for name, slot in slots.items():
        perms, _ = _mapping_of(slot, maps)
        old = ctypes.c_void_p.from_address(slot).value or 0
        if perms is None or "w" not in perms or _mapping_of(old, maps)[1] is None:
            return f"libmlx's {name} slot is not a writable, bound PLT slot"
        new[slot] = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    for slot, address in new.items():
        ctypes.c_void_p.from_address(slot).value = address   # one aligned 8-byte store each
    return None


def select(choice: str | None = None) -> Status:
    """Make MLX use the chosen BLAS (default: `requested()`); see the module docstring.

    Never raises for a missing library: the returned Status carries a `note` saying what is
    in effect instead and how to install the one asked for. A no-op off Linux (MLX uses
    Accelerate on macOS).
    """
    if not sys.platform.startswith("linux"):
        return Status("system", "not Linux")
    if choice is None:
        try:
            choice = requested()
        except ValueError as e:       # a bad environment variable: say so, never fail
            status = select("auto")
            return Status(status.name, status.how, status.path, f"{e}; using auto")
    if choice not in CHOICES:
        raise ValueError(f"BLAS must be one of {', '.join(CHOICES)}; got {choice!r}")
    imported = "mlx.core" in sys.modules
    if choice == "none":
        return active() if imported else Status("bundled", f"${ENV}=none")
    names = ("mkl", "openblas") if choice == "auto" else (choice,)
    path = name = None
    for name in names:
        path = find(name)
        if path:
            break
    if path is None:
        hint = {"mkl": MKL_HINT, "openblas": OPENBLAS_HINT}
        wanted = " or ".join(f"{n} ({hint[n]})" for n in names)
        status = active() if imported else Status("bundled", "nothing to load")
        return Status(status.name, status.how, status.path,
                      f"no fast BLAS found, float32 matmuls run 20-40x slower; install {wanted}")
    if imported:
        status = active()
        if status.name == name:
            return status
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        return Status("bundled", "load failed", path, f"{path} could not be loaded: {e}")
    if not imported:
        return Status(name, "loaded before MLX", path)
    why = _rebind(lib, _maps())
    if why:
        status = active()
        return Status(status.name, status.how, status.path,
                      f"MLX was imported before the BLAS was chosen and {why}: it keeps "
                      f"{status.name} BLAS; call dflash2_mlx.use_fast_blas() before importing mlx")
    return Status(name, "rebound after MLX was imported", path)


_CHOSEN: Status | None = None


def use_fast_blas() -> Status:
    """Put the BLAS `$DFLASH2_BLAS` asks for (default: the fastest found) in effect for MLX's
    float32 matmuls; best called before `mlx` is imported. Idempotent: the first call chooses,
    later ones return its Status (`note` says when the wish could not be met)."""
    global _CHOSEN
    if _CHOSEN is None:
        _CHOSEN = select()
    return _CHOSEN


__all__ = ["use_fast_blas", "select", "active", "requested", "find_mkl", "find_openblas",
           "Status", "ENV", "CHOICES"]
