"""Atomic file writes: a temporary name in the target's folder, then a rename, so a reader
never sees a half-written file and a failure leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w", fsync: bool = False) -> Iterator[IO]:
    """`with atomic_write(path) as f: ...` writes `path` whole or not at all.

    mode: "w" (text) or "wb"; fsync: flush to disk before the rename (large downloads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())       # mkstemp makes 0600; a plain open would not
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """`with atomic_path(path) as tmp: writer(tmp)` for writers that take a path (np.save,
    mx.save_safetensors, a folder built in place): `tmp` is renamed to `path` on success.
    `tmp` keeps `path`'s suffix, since some writers add one when it is missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.part{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise
