"""The prefix cache's disk tier, the file: one `state.DecodeState` in one safetensors file
named `<sha256 of its token ids, 32 hex>.safetensors` (`entry_name`). Its `__metadata__` holds
"dflash2", a JSON body (format, package and MLX versions, the identity of target and drafter,
the token ids, the layout of `disk_state.encode_state`, the tensor table), and
"dflash2_sha256" over that body and the tensor bytes. `write_file` writes one atomically;
`read_header` and `read_state` check every part of one (`disk_state.Rejected` otherwise).
Format and rules: docs/server.md."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .. import __version__
from .disk_state import DTYPES, Rejected, decode_state, expect, host
from ..model.drafter import Drafter
from ..decode.state import DecodeState
from ..files import atomic_path
from ..model.target import TargetAdapter
from ..model.vision import KEY_BASE

FORMAT = 1
NAME = re.compile(r"^[0-9a-f]{32}\.safetensors$")
PART = re.compile(r"^\.[0-9a-f]{32}\.(\d+)\.part\.safetensors$")      # files.atomic_path's
MAX_HEADER = 256 * 2**20
SAMPLES = 16              # values sampled from each weight tensor for the identity


def entry_name(tokens) -> str:
    """The file name of the state over `tokens`."""
    ids = np.asarray(tokens, dtype=np.uint32)
    return hashlib.sha256(ids.tobytes()).hexdigest()[:32] + ".safetensors"


def identity(target: TargetAdapter, drafter: Drafter | None) -> dict:
    """Who may read a file: a fingerprint of the target and of the drafter (class, config,
    every weight's name, shape and dtype, and 16 values sampled from each, so a fine-tune or a
    re-quantization differs), their float dtypes, the device and the target's KV cache
    setting ([bits, group size], None: float; a file of another setting is never read). Cheap: one gather per tensor,
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
            h.update(host(pick).tobytes())
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
                                       None if vocab is None else host(vocab.ids).tobytes())
    ident["dtype"] = "+".join(sorted(dtypes))
    ident["device"] = str(mx.default_device())
    kv = getattr(target, "kv", None)
    ident["kv"] = None if kv is None else [kv.bits, kv.group_size]    # None: float
    return ident


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
    foreign file (another format, package or MLX version, model, drafter, dtype, device, KV
    cache setting)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        expect(len(raw) == 8, "truncated (no header)")
        n = int.from_bytes(raw, "little")
        expect(n <= MAX_HEADER and 8 + n <= size, "truncated or not a safetensors file")
        try:
            header = json.loads(f.read(n))
            extra = header.pop("__metadata__")
            body, digest = extra["dflash2"], extra["dflash2_sha256"]
            meta = json.loads(body)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise Rejected(f"not a prompt-cache file ({type(e).__name__}: {e})") from None
    expect(isinstance(meta, dict) and meta.get("format") == FORMAT,
            f"format {meta.get('format') if isinstance(meta, dict) else '?'} (this version "
            f"reads {FORMAT})")
    for key, ours in (("package", __version__), ("mlx", mx.__version__)):
        expect(meta.get(key) == ours, f"written by {key} {meta.get(key)} (this is {ours})")
    theirs = meta.get("identity") or {}
    for key in ("dtype", "device", "kv", "target", "drafter"):
        expect(theirs.get(key) == ident[key], f"written for another {key} "
                f"({theirs.get(key)}; this server: {ident[key]})")
    tokens = meta.get("tokens")
    try:
        ids = np.asarray(tokens if isinstance(tokens, list) else [])
    except (ValueError, OverflowError):
        ids = np.asarray([])
    expect(ids.ndim == 1 and len(ids) and ids.dtype.kind == "i" and ids.min() >= 0 and
            ids.max() < 2**32 and bool(np.all((ids < vocab_size) | (ids >= KEY_BASE))),
            "bad token ids")        # (an image's rows hold key ids: `model.vision.Media`)
    expect(path.name == entry_name(tokens), "its name does not match its token ids")
    layout = meta.get("layout")
    expect(isinstance(layout, dict) and isinstance(layout.get("exact_only"), bool),
            "no cache layout")
    table, end = [], 0
    try:
        for name, dtype, shape in meta["tensors"]:
            entry = header[name]
            width = np.dtype(DTYPES[dtype][1]).itemsize
            expect(isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape),
                    f"tensor {name} has shape {shape}")
            count = int(np.prod(shape, dtype=np.int64))
            expect(entry["dtype"] == dtype and entry["shape"] == shape and
                    entry["data_offsets"] == [end, end + count * width],
                    f"tensor {name} does not match the table")
            table.append((name, dtype, shape, end, end + count * width))
            end += count * width
    except (ValueError, KeyError, TypeError) as e:
        raise Rejected(f"bad tensor table ({type(e).__name__}: {e})") from None
    expect(len(table) == len(header), "tensors outside the table")
    expect(size == 8 + n + end, f"truncated or padded: {size} bytes, {8 + n + end} expected")
    return Header(meta, body, digest, table, 8 + n, size)


def read_state(path: Path, ident: dict, target: TargetAdapter,
               drafter: Drafter | None) -> DecodeState:
    """The state in a file, checked whole (header, sizes, checksum, layout): `Rejected`
    otherwise."""
    head = read_header(path, ident, target.vocab_size)
    with open(path, "rb") as f:
        f.seek(head.data_start)
        data = f.read()
    expect(len(data) == head.size - head.data_start, "truncated while reading")
    digest = hashlib.sha256(head.body.encode())
    digest.update(data)
    expect(digest.hexdigest() == head.digest, "checksum mismatch (corrupt)")
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

