"""The prefix cache's disk tier, the state as tensors: `encode_state` turns an
`state.DecodeState` into a layout (how to rebuild each cache) and named arrays;
`decode_state` rebuilds it in caches the target and drafter make themselves, checking that
the layout fits them (`Rejected` otherwise). The files around them: `disk_file`."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from ..model.drafter import Drafter
from ..decode.state import DecodeState
from ..model.target import RollbackRotatingKVCache, TargetAdapter

DTYPES = {"F32": (mx.float32, "<f4"), "F16": (mx.float16, "<f2"), "BF16": (mx.bfloat16, "<u2"),
          "I32": (mx.int32, "<i4"), "U32": (mx.uint32, "<u4"), "I64": (mx.int64, "<i8"),
          "U64": (mx.uint64, "<u8"), "I16": (mx.int16, "<i2"), "U16": (mx.uint16, "<u2"),
          "I8": (mx.int8, "i1"), "U8": (mx.uint8, "u1"), "BOOL": (mx.bool_, "?")}
SAFETENSORS_DTYPE = {mx_dtype: name for name, (mx_dtype, _) in DTYPES.items()}


class Rejected(Exception):
    """A file that must not be used; str(): why."""


class Unserializable(Exception):
    """A state holding a cache this format does not describe (it is then not written)."""


def host(a: mx.array) -> np.ndarray:
    """A numpy view of an array (bfloat16 as its uint16 bits: numpy has no bfloat16)."""
    return np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


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
        elif kind is QuantizedKVCache:
            keys, values, offset, group_size, bits = c.state
            target.append({"type": "QuantizedKVCache", "offset": offset, "bits": bits,
                           "group_size": group_size})
            if keys is not None:        # packed values, scales, biases of each, rows in use
                arrays += [(f"t{i}.{name}.{j}", p[..., :offset, :])
                           for name, parts in (("keys", keys), ("values", values))
                           for j, p in enumerate(parts)]
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


def expect(ok: bool, why: str) -> None:
    if not ok:
        raise Rejected(why)


class _Tensors:
    """The arrays of a file by name, each read once at most (`take`), checked for shape."""

    def __init__(self, arrays: dict[str, mx.array]):
        self.arrays, self.used = arrays, set()

    def take(self, name: str, ndim: int | None = None) -> mx.array:
        expect(name in self.arrays, f"no tensor {name}")
        a = self.arrays[name]
        expect((ndim is None or a.ndim == ndim) and a.shape[0] == 1,
               f"{name} has shape {a.shape}")
        self.used.add(name)
        return a

    def check_all_read(self) -> None:
        unread = set(self.arrays) - self.used
        expect(not unread, f"tensors nobody reads: {sorted(unread)[:3]}")


def decode_state(layout: dict, tokens: list[int], arrays: dict[str, mx.array],
                 target: TargetAdapter, drafter: Drafter | None) -> DecodeState:
    """The state `encode_state` described, in caches made by `target` and `drafter`
    themselves; `Rejected` when the layout does not fit them or is inconsistent."""
    n = len(tokens)
    tensors = _Tensors(arrays)
    cache = target.make_cache()
    expect(len(layout["target"]) == len(cache), f"{len(layout['target'])} target caches, the "
           f"target has {len(cache)}")
    for i, (desc, c) in enumerate(zip(layout["target"], cache)):
        _fill_target_cache(i, desc, c, n, tensors)
    dcache = drafter.make_cache() if drafter is not None else None
    expect((layout["drafter"] is None) == (dcache is None), "drafter caches without a drafter, "
           "or the other way round")
    read = 0 if dcache is None else _fill_drafter_caches(layout["drafter"], dcache, tensors)
    feats = len(target.layer_ids) * target.hidden_size
    pending = [tensors.take(f"p{k}", 3) for k in range(layout["pending"])]
    expect(all(p.shape[2] == feats for p in pending), f"pending features are not {feats} wide")
    expect(read + sum(p.shape[1] for p in pending) == (n if dcache is not None else read),
           "the drafter's context and the pending features do not add up to the tokens")
    tensors.check_all_read()
    return DecodeState(cache, dcache, pending, list(tokens))


def _fill_target_cache(i: int, desc: dict, c, n: int, tensors: _Tensors) -> None:
    """Target cache `i` (over `n` tokens) as `desc` describes it."""
    expect(desc["type"] == type(c).__name__, f"cache {i} is a {desc['type']}, the target "
           f"makes a {type(c).__name__}")
    if isinstance(c, ArraysCache):
        expect(len(desc["present"]) == len(c.cache), f"cache {i}: {len(desc['present'])} "
               f"arrays, the target keeps {len(c.cache)}")
        c.state = ([tensors.take(f"t{i}.{j}") if present else None
                    for j, present in enumerate(desc["present"])], None, None)
        return
    offset = desc["offset"]
    expect(offset == n, f"cache {i} covers {offset} tokens, the file lists {n}")
    if isinstance(c, QuantizedKVCache):
        expect((desc["bits"], desc["group_size"]) == (c.bits, c.group_size),
               f"cache {i} is {desc['bits']}-bit (group size {desc['group_size']}), the target "
               f"quantizes to {c.bits} bits (group size {c.group_size})")
        keys, values = ([tensors.take(f"t{i}.{name}.{j}", 4) for j in range(3)]
                        for name in ("keys", "values"))
        expect(all(p.shape[:3] == keys[0].shape[:3] and p.shape[2] == offset
                   for p in keys + values), f"cache {i}: {offset} rows expected in "
               f"{[p.shape for p in keys + values]}")
        c.keys, c.values, c.offset = tuple(keys), tuple(values), offset
        return
    keys, values = tensors.take(f"t{i}.keys", 4), tensors.take(f"t{i}.values", 4)
    expect(keys.shape[:3] == values.shape[:3], f"cache {i}: keys {keys.shape}, values "
           f"{values.shape}")
    if isinstance(c, RollbackRotatingKVCache):
        expect((desc["keep"], desc["max_size"]) == (c.keep, c.max_size) and
               0 <= desc["idx"] <= keys.shape[2], f"cache {i}: window {desc}")
        c.state = (keys, values, offset, c.keep, c.max_size, desc["idx"])
    else:
        expect(keys.shape[2] == offset, f"cache {i}: {keys.shape[2]} rows for {offset}")
        c.state = (keys, values, offset)


def _fill_drafter_caches(descs: list[dict], dcache: list, tensors: _Tensors) -> int:
    """The drafter's caches as `descs` describe them -> the tokens of context they hold."""
    expect(len(descs) == len(dcache), "another number of drafter layers")
    read = descs[0]["offset"]
    for j, (desc, c) in enumerate(zip(descs, dcache)):
        start, offset, cap = desc["start"], desc["offset"], desc["capacity"]
        expect(desc["window"] == c.window and offset == read and 0 <= start <= offset
               and offset - start <= cap, f"drafter cache {j}: {desc}")
        c.start, c.offset = start, offset
        if cap:
            keys, values = tensors.take(f"d{j}.keys", 4), tensors.take(f"d{j}.values", 4)
            expect(keys.shape[2] == values.shape[2] == offset - start,
                   f"drafter cache {j}: {keys.shape[2]} rows for {offset - start}")
            c.keys = mx.zeros((*keys.shape[:2], cap, keys.shape[3]), keys.dtype)
            c.values = mx.zeros((*values.shape[:2], cap, values.shape[3]), values.dtype)
            c.keys[..., : c.size, :] = keys         # the capacity as it was: the same
            c.values[..., : c.size, :] = values     # reallocations as in RAM
    return read
