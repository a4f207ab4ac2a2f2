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
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache

from . import __version__
from .drafter import Drafter
from .state import DecodeState
from .files import atomic_path
from .log import get
from .settings import PROMPT_CACHE_DISK_BYTES
from .target import RollbackRotatingKVCache, TargetAdapter

log = get(__name__)

FORMAT = 1
NAME = re.compile(r"^[0-9a-f]{32}\.safetensors$")
PART = re.compile(r"^\.[0-9a-f]{32}\.(\d+)\.part\.safetensors$")      # files.atomic_path's
MAX_HEADER = 256 * 2**20
SAMPLES = 16              # values sampled from each weight tensor for the identity
QUEUE = 4                 # states waiting for the writer; more are dropped
DTYPES = {"F32": (mx.float32, "<f4"), "F16": (mx.float16, "<f2"), "BF16": (mx.bfloat16, "<u2"),
          "I32": (mx.int32, "<i4"), "U32": (mx.uint32, "<u4"), "I64": (mx.int64, "<i8"),
          "U64": (mx.uint64, "<u8"), "I16": (mx.int16, "<i2"), "U16": (mx.uint16, "<u2"),
          "I8": (mx.int8, "i1"), "U8": (mx.uint8, "u1"), "BOOL": (mx.bool_, "?")}
SAFETENSORS_DTYPE = {mx_dtype: name for name, (mx_dtype, _) in DTYPES.items()}


class Rejected(Exception):
    """A file that must not be used; str(): why."""


class Unserializable(Exception):
    """A state holding a cache this format does not describe (it is then not written)."""


def entry_name(tokens) -> str:
    """The file name of the state over `tokens`."""
    ids = np.asarray(tokens, dtype=np.uint32)
    return hashlib.sha256(ids.tobytes()).hexdigest()[:32] + ".safetensors"


def _host(a: mx.array) -> np.ndarray:
    """A numpy view of an array (bfloat16 as its uint16 bits: numpy has no bfloat16)."""
    return np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def identity(target: TargetAdapter, drafter: Drafter | None) -> dict:
    """Who may read a file: a fingerprint of the target and of the drafter (class, config,
    every weight's name, shape and dtype, and 16 values sampled from each, so a fine-tune or a
    re-quantization differs), their float dtypes and the device. Cheap: one gather per tensor,
    no pass over the weights."""
    dtypes: set[str] = set()

    def fingerprint(module, *config) -> str:
        h = hashlib.sha256(repr(config).encode())
        params = tree_flatten(module.parameters())
        picks = [p.reshape(-1)[mx.array(np.linspace(0, max(p.size - 1, 0), min(p.size, SAMPLES))
                                        .astype(np.int64))] for _, p in params]
        mx.eval(picks)
        for (name, p), pick in zip(params, picks):
            h.update(f"{name} {p.shape} {p.dtype}\n".encode())
            h.update(_host(pick).tobytes())
            if mx.issubdtype(p.dtype, mx.floating):
                dtypes.add(str(p.dtype).rsplit(".", 1)[-1])
        return h.hexdigest()[:32]

    model = target.model
    ident = {"target": fingerprint(model, type(model).__module__, type(model).__name__,
                                   repr(getattr(model, "args", None)), target.layer_ids)}
    ident["drafter"] = None
    if drafter is not None:
        vocab = drafter.draft_vocab
        ident["drafter"] = fingerprint(drafter, repr(drafter.args),
                                       None if vocab is None else _host(vocab.ids).tobytes())
    ident["dtype"] = "+".join(sorted(dtypes))
    ident["device"] = str(mx.default_device())
    return ident


# --------------------------------------------------------------------------- state <-> tensors

def encode_state(state: DecodeState) -> tuple[dict, list[tuple[str, mx.array]]]:
    """The layout (how to rebuild each cache) and the named arrays of a state: views of its
    arrays (only the rows in use), evaluated, sharing the state's buffers. MLX never updates a
    buffer in place while another array holds it, so the views keep their values."""
    arrays: list[tuple[str, mx.array]] = []
    target = []
    for i, c in enumerate(state.cache):
        kind = type(c)
        if kind is KVCache:
            keys, values, offset = c.state
            target.append({"type": "KVCache", "offset": offset})
            if keys is not None:
                arrays += [(f"t{i}.keys", keys[..., :offset, :]),
                           (f"t{i}.values", values[..., :offset, :])]
        elif kind is RollbackRotatingKVCache:
            keys, values, offset, keep, max_size, idx = c.state
            target.append({"type": kind.__name__, "offset": offset, "keep": keep,
                           "max_size": max_size, "idx": idx})
            if keys is not None:
                arrays += [(f"t{i}.keys", keys[:]), (f"t{i}.values", values[:])]
        elif kind is ArraysCache:
            parts, left_padding, lengths = c.state
            if left_padding is not None or lengths is not None:
                raise Unserializable("a batched ArraysCache")
            target.append({"type": "ArraysCache", "present": [p is not None for p in parts]})
            arrays += [(f"t{i}.{j}", p[:]) for j, p in enumerate(parts) if p is not None]
        else:
            raise Unserializable(kind.__name__)
    drafter = None
    if state.dcache is not None:
        drafter = []
        for j, c in enumerate(state.dcache):
            keys, values = c.state
            drafter.append({"start": c.start, "offset": c.offset, "window": c.window,
                            "capacity": 0 if keys is None else keys.shape[2]})
            if keys is not None:
                arrays += [(f"d{j}.keys", keys[..., : c.size, :]),
                           (f"d{j}.values", values[..., : c.size, :])]
    arrays += [(f"p{k}", p[:]) for k, p in enumerate(state.pending)]
    for name, a in arrays:
        if a.dtype not in SAFETENSORS_DTYPE:
            raise Unserializable(f"{name} of dtype {a.dtype}")
    mx.eval([a for _, a in arrays])
    layout = {"target": target, "drafter": drafter, "pending": len(state.pending),
              "exact_only": not all(c.is_trimmable() for c in state.cache)}
    return layout, arrays


def _expect(ok: bool, why: str) -> None:
    if not ok:
        raise Rejected(why)


def decode_state(layout: dict, tokens: list[int], arrays: dict[str, mx.array],
                 target: TargetAdapter, drafter: Drafter | None) -> DecodeState:
    """The state `encode_state` described, in caches made by `target` and `drafter`
    themselves; `Rejected` when the layout does not fit them or is inconsistent."""
    n = len(tokens)
    cache = target.make_cache()
    _expect(len(layout["target"]) == len(cache), f"{len(layout['target'])} target caches, the "
            f"target has {len(cache)}")
    used = set()

    def take(name: str, ndim: int) -> mx.array:
        _expect(name in arrays, f"no tensor {name}")
        a = arrays[name]
        _expect(a.ndim == ndim and a.shape[0] == 1, f"{name} has shape {a.shape}")
        used.add(name)
        return a

    for i, (desc, c) in enumerate(zip(layout["target"], cache)):
        _expect(desc["type"] == type(c).__name__, f"cache {i} is a {desc['type']}, the target "
                f"makes a {type(c).__name__}")
        if isinstance(c, ArraysCache):
            _expect(len(desc["present"]) == len(c.cache), f"cache {i}: {len(desc['present'])} "
                    f"arrays, the target keeps {len(c.cache)}")
            c.state = ([take(f"t{i}.{j}", arrays[f"t{i}.{j}"].ndim) if present else None
                        for j, present in enumerate(desc["present"])], None, None)
            continue
        offset = desc["offset"]
        _expect(offset == n, f"cache {i} covers {offset} tokens, the file lists {n}")
        keys, values = take(f"t{i}.keys", 4), take(f"t{i}.values", 4)
        _expect(keys.shape[:3] == values.shape[:3], f"cache {i}: keys {keys.shape}, values "
                f"{values.shape}")
        if isinstance(c, RollbackRotatingKVCache):
            _expect((desc["keep"], desc["max_size"]) == (c.keep, c.max_size) and
                    0 <= desc["idx"] <= keys.shape[2], f"cache {i}: window {desc}")
            c.state = (keys, values, offset, c.keep, c.max_size, desc["idx"])
        else:
            _expect(keys.shape[2] == offset, f"cache {i}: {keys.shape[2]} rows for {offset}")
            c.state = (keys, values, offset)
    dcache = drafter.make_cache() if drafter is not None else None
    _expect((layout["drafter"] is None) == (dcache is None), "drafter caches without a drafter, "
            "or the other way round")
    read = 0
    if dcache is not None:
        _expect(len(layout["drafter"]) == len(dcache), "another number of drafter layers")
        read = layout["drafter"][0]["offset"]
        for j, (desc, c) in enumerate(zip(layout["drafter"], dcache)):
            start, offset, cap = desc["start"], desc["offset"], desc["capacity"]
            _expect(desc["window"] == c.window and offset == read and 0 <= start <= offset
                    and offset - start <= cap, f"drafter cache {j}: {desc}")
            c.start, c.offset = start, offset
            if cap:
                keys, values = take(f"d{j}.keys", 4), take(f"d{j}.values", 4)
                _expect(keys.shape[2] == values.shape[2] == offset - start,
                        f"drafter cache {j}: {keys.shape[2]} rows for {offset - start}")
                c.keys = mx.zeros((*keys.shape[:2], cap, keys.shape[3]), keys.dtype)
                c.values = mx.zeros((*values.shape[:2], cap, values.shape[3]), values.dtype)
                c.keys[..., : c.size, :] = keys         # the capacity as it was: the same
                c.values[..., : c.size, :] = values     # reallocations as in RAM
    feats = len(target.layer_ids) * target.hidden_size
    pending = [take(f"p{k}", 3) for k in range(layout["pending"])]
    _expect(all(p.shape[2] == feats for p in pending), f"pending features are not {feats} wide")
    _expect(read + sum(p.shape[1] for p in pending) == (n if dcache is not None else read),
            "the drafter's context and the pending features do not add up to the tokens")
    _expect(used == set(arrays), f"tensors nobody reads: {sorted(set(arrays) - used)[:3]}")
    return DecodeState(cache, dcache, pending, list(tokens))


# --------------------------------------------------------------------------- the file

def _blocks(x: np.ndarray):
    """The bytes of x in C order, as contiguous pieces (no copy of the whole)."""
    if x.flags.c_contiguous or x.ndim <= 1:
        if x.size:
            yield memoryview(np.ascontiguousarray(x)).cast("B")
        return
    for sub in x:
        yield from _blocks(sub)


def write_file(path: Path, meta: dict, tensors: list[tuple[str, str, np.ndarray]]) -> int:
    """Write a safetensors file (atomically) -> its size. meta: the JSON body; tensors:
    (name, safetensors dtype, array)."""
    body = json.dumps(meta, separators=(",", ":"))
    digest = hashlib.sha256(body.encode())
    header: dict = {}
    end = 0
    for name, dtype, x in tensors:
        header[name] = {"dtype": dtype, "shape": list(x.shape),
                        "data_offsets": [end, end + x.nbytes]}
        end += x.nbytes
        for block in _blocks(x):
            digest.update(block)
    header["__metadata__"] = {"dflash2": body, "dflash2_sha256": digest.hexdigest()}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(len(head).to_bytes(8, "little"))
            f.write(head)
            for _, _, x in tensors:
                for block in _blocks(x):
                    f.write(block)
    return 8 + len(head) + end


@dataclass
class Header:
    meta: dict
    body: str
    digest: str
    tensors: list[tuple[str, str, list[int], int, int]]    # name, dtype, shape, begin, end
    data_start: int
    size: int


def read_header(path: Path, ident: dict, vocab_size: int) -> Header:
    """Everything but the tensor data, checked: `Rejected` for a truncated, malformed or
    foreign file (another format, package or MLX version, model, drafter, dtype, device)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        _expect(len(raw) == 8, "truncated (no header)")
        n = int.from_bytes(raw, "little")
        _expect(n <= MAX_HEADER and 8 + n <= size, "truncated or not a safetensors file")
        try:
            header = json.loads(f.read(n))
            extra = header.pop("__metadata__")
            body, digest = extra["dflash2"], extra["dflash2_sha256"]
            meta = json.loads(body)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise Rejected(f"not a prompt-cache file ({type(e).__name__}: {e})") from None
    _expect(isinstance(meta, dict) and meta.get("format") == FORMAT,
            f"format {meta.get('format') if isinstance(meta, dict) else '?'} (this version "
            f"reads {FORMAT})")
    for key, ours in (("package", __version__), ("mlx", mx.__version__)):
        _expect(meta.get(key) == ours, f"written by {key} {meta.get(key)} (this is {ours})")
    theirs = meta.get("identity") or {}
    for key in ("dtype", "device", "target", "drafter"):
        _expect(theirs.get(key) == ident[key], f"written for another {key} "
                f"({theirs.get(key)}; this server: {ident[key]})")
    tokens = meta.get("tokens")
    try:
        ids = np.asarray(tokens if isinstance(tokens, list) else [])
    except (ValueError, OverflowError):
        ids = np.asarray([])
    _expect(ids.ndim == 1 and len(ids) and ids.dtype.kind == "i" and ids.min() >= 0 and
            ids.max() < vocab_size, "bad token ids")
    _expect(path.name == entry_name(tokens), "its name does not match its token ids")
    layout = meta.get("layout")
    _expect(isinstance(layout, dict) and isinstance(layout.get("exact_only"), bool),
            "no cache layout")
    table, end = [], 0
    try:
        for name, dtype, shape in meta["tensors"]:
            entry = header[name]
            width = np.dtype(DTYPES[dtype][1]).itemsize
            _expect(isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape),
                    f"tensor {name} has shape {shape}")
            count = int(np.prod(shape, dtype=np.int64))
            _expect(entry["dtype"] == dtype and entry["shape"] == shape and
                    entry["data_offsets"] == [end, end + count * width],
                    f"tensor {name} does not match the table")
            table.append((name, dtype, shape, end, end + count * width))
            end += count * width
    except (ValueError, KeyError, TypeError) as e:
        raise Rejected(f"bad tensor table ({type(e).__name__}: {e})") from None
    _expect(len(table) == len(header), "tensors outside the table")
    _expect(size == 8 + n + end, f"truncated or padded: {size} bytes, {8 + n + end} expected")
    return Header(meta, body, digest, table, 8 + n, size)


def read_state(path: Path, ident: dict, target: TargetAdapter,
               drafter: Drafter | None) -> DecodeState:
    """The state in a file, checked whole (header, sizes, checksum, layout): `Rejected`
    otherwise."""
    head = read_header(path, ident, target.vocab_size)
    with open(path, "rb") as f:
        f.seek(head.data_start)
        data = f.read()
    _expect(len(data) == head.size - head.data_start, "truncated while reading")
    digest = hashlib.sha256(head.body.encode())
    digest.update(data)
    _expect(digest.hexdigest() == head.digest, "checksum mismatch (corrupt)")
    try:
        arrays = {}
        for name, dtype, shape, begin, end in head.tensors:
            mx_dtype, np_dtype = DTYPES[dtype]
            x = np.frombuffer(data, dtype=np_dtype, offset=begin,
                              count=(end - begin) // np.dtype(np_dtype).itemsize).reshape(shape)
            a = mx.array(x)
            arrays[name] = a.view(mx.bfloat16) if mx_dtype == mx.bfloat16 else a
        return decode_state(head.meta["layout"], head.meta["tokens"], arrays, target, drafter)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise Rejected(f"bad layout ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------- the tier

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
        tensors = [(n, SAFETENSORS_DTYPE[a.dtype], _host(a)) for n, a in arrays]
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
