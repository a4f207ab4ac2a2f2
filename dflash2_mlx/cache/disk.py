"""The prefix cache's second tier, on disk: `state.DecodeState`s as safetensors files in one
folder, found again by token prefix once they left RAM, or after a restart.

A file is `<sha256 of its token ids, 32 hex>.safetensors`; its `__metadata__` holds "dflash2",
a JSON body (format, package and MLX versions, the identity of target and drafter, the token
ids, how to rebuild each cache, the tensor table), and "dflash2_sha256" over that body and the
tensor bytes. A file is used only when every part of it checks out; any other file with such a
name is deleted. Writes are atomic (a temporary name, then a rename) and done by a writer
thread fed through a bounded queue: the caller's thread only takes evaluated views of the
arrays (no copy), and a full queue drops the write rather than wait. LRU by bytes, in file
modification order, so the order survives restarts. Format and rules: docs/server.md.

The file itself: `disk_file`; the state as tensors: `disk_state`.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import __version__
from .disk_file import (FORMAT, NAME, PART, Header, entry_name, identity, read_header, read_state,
                        write_file)
from .disk_state import SAFETENSORS_DTYPE, Rejected, Unserializable, encode_state, host
from ..model.drafter import Drafter
from ..decode.state import DecodeState
from ..log import get
from ..settings import PROMPT_CACHE_DISK_BYTES
from ..model.target import TargetAdapter

log = get(__name__)

QUEUE = 4                 # states waiting for the writer; more are dropped


@dataclass
class DiskEntry:
    name: str
    tokens: np.ndarray          # uint32 [n]
    nbytes: int
    exact_only: bool            # recurrent layers: serves prompts it is an exact prefix of


@dataclass
class DiskStats:
    writes: int = 0             # files written
    written_bytes: int = 0
    dropped: int = 0            # writes given up because the writer's queue was full
    errors: int = 0             # writes or reads that failed (disk full, permissions)
    loads: int = 0              # states read back
    rejected: int = 0           # files deleted as corrupt, truncated or foreign
    evicted: int = 0            # files deleted by the byte bound or a longer state
    reasons: Counter = field(default_factory=Counter)


def prepare_folder(folder) -> Path:
    """The folder, created if needed; ValueError when it cannot be written."""
    folder = Path(folder).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"prompt cache folder {folder} (--prompt-cache-dir): cannot create "
                         f"it ({e.strerror})") from None
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"prompt cache folder {folder} (--prompt-cache-dir): not a writable "
                         "folder")
    return folder


class DiskCache:
    """States on disk under `folder`, at most `max_bytes` of files, least recently used out.

    The caller's thread (the scheduler's worker) calls `entries`, `load` and `put`; the
    writer thread writes and deletes files. The index is shared under a lock; file I/O happens
    outside it. Other files in the folder (any name but `<32 hex>.safetensors`) are left alone.
    """

    def __init__(self, folder, max_bytes: int = PROMPT_CACHE_DISK_BYTES, *,
                 target: TargetAdapter, drafter: Drafter | None, queue_size: int = QUEUE):
        if not isinstance(target, TargetAdapter):
            raise ValueError("the prompt cache's disk tier needs the whole target in this "
                             "process (not a pipeline-sharded one: serve without --pipeline)")
        if max_bytes < 1:
            raise ValueError(f"prompt cache disk bound must be >= 1 byte, got {max_bytes}")
        self.folder, self.max_bytes = prepare_folder(folder), max_bytes
        self.target, self.drafter = target, drafter
        self.identity = identity(target, drafter)
        self.stats = DiskStats()
        self._index: OrderedDict[str, DiskEntry] = OrderedDict()
        self._queued: set[str] = set()
        self._lock = threading.Lock()
        self._last_mtime = 0
        self._unserializable: set[str] = set()
        self._scan()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._closed = False
        self._thread = threading.Thread(target=self._writer, name="dflash2-disk-cache",
                                        daemon=True)
        self._thread.start()

    # ---- the index
    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, name: str) -> bool:
        return name in self._index

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._index.values())

    def describe(self) -> dict:
        """Figures for /health."""
        s = self.stats
        return {"dir": str(self.folder), "entries": len(self), "bytes": self.nbytes,
                "max_bytes": self.max_bytes, "writes": s.writes, "written_bytes": s.written_bytes,
                "dropped": s.dropped, "errors": s.errors, "loads": s.loads,
                "rejected": s.rejected, "evicted": s.evicted}

    def _scan(self) -> None:
        """Rebuild the index from the folder: headers only, checked; the rest deleted."""
        found = []
        for path in self.folder.iterdir():
            part = PART.match(path.name)
            if part and not _alive(int(part.group(1))):
                path.unlink(missing_ok=True)         # a write cut short by a crash
            if not NAME.match(path.name):
                continue
            try:
                head = read_header(path, self.identity, self.target.vocab_size)
                found.append((path.stat().st_mtime_ns, path.name, self._entry(path.name, head)))
            except Rejected as e:
                self._reject(path, str(e), quiet=True)
            except OSError as e:
                log.warning("prompt cache: cannot read %s: %s", path, e)
        for mtime, _, entry in sorted(found, key=lambda f: f[:2]):
            self._index[entry.name] = entry
            self._last_mtime = max(self._last_mtime, mtime)
        doomed = self._over_bound()
        for path in doomed:
            path.unlink(missing_ok=True)
        if self.stats.rejected:
            log.info("prompt cache: deleted %d files of %s: %s", self.stats.rejected,
                     self.folder, ", ".join(f"{n} {why}" for why, n in
                                             self.stats.reasons.most_common()))
        log.info("prompt cache: %d entries (%.1f MiB) on disk in %s", len(self),
                 self.nbytes / 2**20, self.folder)

    @staticmethod
    def _entry(name: str, head: Header) -> DiskEntry:
        return DiskEntry(name, np.asarray(head.meta["tokens"], dtype=np.uint32), head.size,
                         bool(head.meta["layout"]["exact_only"]))

    def _reject(self, path: Path, why: str, quiet: bool = False) -> None:
        with self._lock:
            self._index.pop(path.name, None)
            self.stats.rejected += 1
            self.stats.reasons[why.split(" (")[0].split(":")[0]] += 1
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("prompt cache: cannot delete %s: %s", path, e)
        (log.debug if quiet else log.warning)("prompt cache: deleted %s: %s", path, why)

    def _over_bound(self) -> list[Path]:
        """Drop least recently used entries past the byte bound -> their files."""
        doomed = []
        with self._lock:
            total = sum(e.nbytes for e in self._index.values())
            while total > self.max_bytes and self._index:
                _, old = self._index.popitem(last=False)
                total -= old.nbytes
                self.stats.evicted += 1
                doomed.append(self.folder / old.name)
        return doomed

    def _touch(self, name: str) -> None:
        """Most recently used, in the index and in the file's mtime (for the next start)."""
        with self._lock:
            if name not in self._index:
                return
            self._index.move_to_end(name)
            self._last_mtime = stamp = max(time.time_ns(), self._last_mtime + 1000)
        try:
            os.utime(self.folder / name, ns=(stamp, stamp))
        except OSError:
            pass

    # ---- reading
    def entries(self) -> list[DiskEntry]:
        """The entries now on disk, least recently used first."""
        with self._lock:
            return list(self._index.values())

    def load(self, entry: DiskEntry) -> DecodeState | None:
        """The entry's state, or None (and the file deleted) when it does not check out."""
        path = self.folder / entry.name
        tic = time.perf_counter()
        try:
            state = read_state(path, self.identity, self.target, self.drafter)
        except FileNotFoundError:
            with self._lock:
                self._index.pop(entry.name, None)
            return None
        except Rejected as e:
            self._reject(path, str(e))
            return None
        except OSError as e:
            self.stats.errors += 1
            log.warning("prompt cache: cannot read %s: %s", path, e)
            return None
        self.stats.loads += 1
        self._touch(entry.name)
        log.debug("prompt cache: read %d tokens (%.1f MiB) from %s in %.3f s",
                  len(state.tokens), entry.nbytes / 2**20, path, time.perf_counter() - tic)
        return state

    # ---- writing
    def put(self, state: DecodeState) -> bool:
        """Queue `state` for writing; never blocks (a full queue drops it: False). The state
        may be used and changed afterwards: the writer gets views of its current arrays."""
        if self._closed or not state.tokens:
            return False
        name = entry_name(state.tokens)
        with self._lock:
            known, queued = name in self._index, name in self._queued
        if known:
            self._touch(name)
        if known or queued:
            return True
        try:
            layout, arrays = encode_state(state)
        except Unserializable as e:
            if str(e) not in self._unserializable:
                self._unserializable.add(str(e))
                log.warning("prompt cache: states with %s are not written to disk", e)
            return False
        size = sum(a.nbytes for _, a in arrays)
        if size > self.max_bytes:
            log.debug("prompt cache: a state of %d bytes exceeds the disk bound %d: not "
                      "written", size, self.max_bytes)
            return False
        meta = {"format": FORMAT, "package": __version__, "mlx": mx.__version__,
                "identity": self.identity, "tokens": list(state.tokens), "layout": layout,
                "tensors": [[n, SAFETENSORS_DTYPE[a.dtype], list(a.shape)] for n, a in arrays]}
        tensors = [(n, SAFETENSORS_DTYPE[a.dtype], host(a)) for n, a in arrays]
        with self._lock:
            self._queued.add(name)
        try:
            self._queue.put_nowait((name, meta, tensors))
        except queue.Full:
            with self._lock:
                self._queued.discard(name)
            self.stats.dropped += 1
            log.debug("prompt cache: the disk writer is behind: a state of %d tokens is not "
                      "written", len(state.tokens))
            return False
        return True

    def _writer(self) -> None:
        while (job := self._queue.get()) is not None:
            name = job[0]
            try:
                self._write(*job)
            except OSError as e:
                self.stats.errors += 1
                log.warning("prompt cache: cannot write %s: %s", self.folder / name, e)
            except Exception:  # noqa: BLE001 - the writer outlives one bad write; logged whole
                self.stats.errors += 1
                log.exception("prompt cache: writing %s failed", self.folder / name)
            finally:
                with self._lock:
                    self._queued.discard(name)
                del job
                self._queue.task_done()
        self._queue.task_done()

    def write_file(self, path: Path, meta: dict, tensors) -> int:
        """On the writer thread: the file itself (a separate step, so a test can slow it)."""
        return write_file(path, meta, tensors)

    def _write(self, name: str, meta: dict, tensors) -> None:
        size = self.write_file(self.folder / name, meta, tensors)
        tokens = np.asarray(meta["tokens"], dtype=np.uint32)
        entry = DiskEntry(name, tokens, size, meta["layout"]["exact_only"])
        doomed = []
        with self._lock:
            self.stats.writes += 1
            self.stats.written_bytes += size
            if not entry.exact_only:
                # a state that extends another serves its prompts too (it can be trimmed)
                for old in [e for e in self._index.values() if len(e.tokens) <= len(tokens)
                            and np.array_equal(e.tokens, tokens[: len(e.tokens)])]:
                    del self._index[old.name]
                    self.stats.evicted += 1
                    doomed.append(self.folder / old.name)
            self._index[name] = entry
        self._touch(name)
        for path in doomed + self._over_bound():
            path.unlink(missing_ok=True)
        log.debug("prompt cache: wrote %d tokens (%.1f MiB) to %s", len(tokens), size / 2**20,
                  self.folder / name)

    def flush(self) -> None:
        """Wait until every queued state is written."""
        self._queue.join()

    def close(self, timeout: float = 120.0) -> None:
        """Write what is queued, then stop the writer (waits at most `timeout` seconds)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("prompt cache: the disk writer did not finish within %.0f s", timeout)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
