"""Run `mx.fast.metal_kernel` sources on the CPU: a stand-in for `mx.fast.metal_kernel`.

`metal_kernel(...)` takes the same arguments as MLX's and returns a callable taking the same
keyword arguments (inputs, template, grid, threadgroup, output_shapes, output_dtypes). It writes
the translation unit MLX would hand to the Metal compiler (the header, then the signature MLX
generates around the body, mirrored from `write_signature` / `metal_kernel` in MLX's
mlx/backend/metal/custom_kernel.cpp, then the body and the explicit template instantiation),
prepends `metal_compat.h` (Metal types, address spaces, barriers, SIMD-group functions over
cooperative fibers), appends a launcher, compiles it with g++ into a shared library (cached per
source text) and runs every thread of the grid on the CPU.

Inputs may be mx.arrays or numpy arrays; a numpy view with arbitrary strides stands for an MLX
array passed in place (its element strides become `name_strides`), and `BF16(bits)` marks uint16
numpy storage as bfloat16. Outputs come back as mx.arrays, pre-filled with 0xFF bytes so that
an element the kernel forgets to write shows up as NaN / -1.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

COMPAT_HEADER = Path(__file__).with_name("metal_compat.h")
MAX_CONSTANT_ARRAY_SIZE = 8  # MLX passes smaller inputs in the `constant` address space

# name -> type, in MLX's order; an attribute is passed when the body mentions its name.
METAL_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]

TYPE_STRINGS = {
    mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.bool_: "bool",
    mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
}
NUMPY_DTYPES = {
    mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16, mx.bool_: np.bool_,
    mx.int8: np.int8, mx.int16: np.int16, mx.int32: np.int32, mx.int64: np.int64,
    mx.uint8: np.uint8, mx.uint16: np.uint16, mx.uint32: np.uint32, mx.uint64: np.uint64,
}


def gxx() -> str | None:
    return shutil.which("g++")


@dataclass
class BF16:
    """uint16 numpy storage of bfloat16 values (any strides)."""

    bits: np.ndarray


def _host(x) -> tuple[np.ndarray, mx.Dtype]:
    """An input as (numpy storage, MLX dtype)."""
    if isinstance(x, BF16):
        return x.bits, mx.bfloat16
    if isinstance(x, mx.array):
        if x.dtype == mx.bfloat16:
            return np.array(x.view(mx.uint16)), mx.bfloat16
        return np.array(x), x.dtype
    x = np.asarray(x)
    dtype = {np.dtype(v): k for k, v in NUMPY_DTYPES.items() if k != mx.bfloat16}[x.dtype]
    return x, dtype


# ------------------------------------------------------------------ MLX's generated source

def _template_parts(template) -> tuple[str, str]:
    """(declaration "template <...>", definition "<...>") of MLX's template arguments."""
    kinds, values = [], []
    for name, arg in template:
        if isinstance(arg, mx.Dtype):
            kinds.append(f"typename {name}")
            values.append(TYPE_STRINGS[arg])
        elif isinstance(arg, bool):
            kinds.append(f"bool {name}")
            values.append(str(int(arg)))
        else:
            kinds.append(f"int {name}")
            values.append(str(int(arg)))
    return f"template <{', '.join(kinds)}>\n", f"<{', '.join(values)}>"


def kernel_name(name: str, template, inputs, output_dtypes) -> str:
    """MLX's name of one instantiation: template hash, input dtypes (s: scalar, c: constant)."""
    out = "custom_kernel_" + name
    if template:
        _, definition = _template_parts(template)
        out += "_" + re.sub(r"<|>|(, )", "_", definition)[:-1]
    for arr, dtype in inputs:
        out += "_" + TYPE_STRINGS[dtype]
        out += "s" if arr.ndim == 0 else ("c" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "")
    for dtype in output_dtypes:
        out += "_" + TYPE_STRINGS[dtype]
    return out


@dataclass(frozen=True)
class Param:
    kind: str   # input | scalar | shape | strides | ndim | output | attribute
    ctype: str  # C type of the value the launcher passes
    name: str


def write_signature(func_name, header, source, input_names, inputs, output_names,
                    output_dtypes, template, attributes, shape_infos, atomic_outputs=False):
    """Mirror of MLX's write_signature: the kernel source plus the parameter list in order."""
    text, params = header, []
    if template:
        text += _template_parts(template)[0]
    text += f"[[kernel]] void {func_name}(\n"
    index = 0
    for name, (arr, dtype), (has_shape, has_strides, has_ndim) in zip(input_names, inputs,
                                                                    shape_infos):
        location = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if arr.ndim == 0 else "*"
        text += f"  const {location} {TYPE_STRINGS[dtype]}{ref} {name} [[buffer({index})]],\n"
        params.append(Param("scalar" if arr.ndim == 0 else "input", TYPE_STRINGS[dtype], name))
        index += 1
        if arr.ndim > 0:
            if has_shape:
                text += f"  const constant int* {name}_shape [[buffer({index})]],\n"
                params.append(Param("shape", "int", name))
                index += 1
            if has_strides:
                text += f"  const constant int64_t* {name}_strides [[buffer({index})]],\n"
                params.append(Param("strides", "int64_t", name))
                index += 1
            if has_ndim:
                text += f"  const constant int& {name}_ndim [[buffer({index})]],\n"
                params.append(Param("ndim", "int", name))
                index += 1
    for name, dtype in zip(output_names, output_dtypes):
        type_string = TYPE_STRINGS[dtype]
        if atomic_outputs:
            type_string = f"atomic<{type_string}>"
        text += f"  device {type_string}* {name} [[buffer({index})]]"
        params.append(Param("output", TYPE_STRINGS[dtype], name))
        last = not (index < len(inputs) + len(output_names) - 1 or attributes)
        text += ") {\n" if last else ",\n"
        index += 1
    for i, (attr, attr_type) in enumerate(attributes):
        text += f"  {attr_type} {attr} [[{attr}]]"
        text += ") {\n" if i == len(attributes) - 1 else ",\n"
        params.append(Param("attribute", attr_type, attr))
    text += source + "\n}\n"
    return text, params


def generated_source(name, input_names, output_names, source, header, inputs, output_dtypes,
                     template):
    """What MLX compiles for one call, with its kernel name and parameter list."""
    shape_infos = [(f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source)
                   for n in input_names]
    attributes = [(a, t) for a, t in METAL_ATTRIBUTES if a in source]
    func = kernel_name(name, template, inputs, output_dtypes)
    text, params = write_signature(func, header, source, input_names, inputs, output_names,
                                   output_dtypes, template, attributes, shape_infos)
    if template:
        definition = func + _template_parts(template)[1]
        text += (f'\ntemplate [[host_name("{func}")]] [[kernel]] decltype({definition}) '
                 f"{definition};\n")
    else:
        definition = func
    return text, definition, params


# ------------------------------------------------------------------ compile and run

def _launcher(call: str, params: list[Param]) -> str:
    args = []
    for i, p in enumerate(params):
        if p.kind in ("input", "shape", "strides"):
            args.append(f"static_cast<const {p.ctype}*>(p[{i}])")
        elif p.kind in ("scalar", "ndim"):
            args.append(f"*static_cast<const {p.ctype}*>(p[{i}])")
        elif p.kind == "output":
            args.append(f"static_cast<{p.ctype}*>(p[{i}])")
        else:
            args.append(f"at.{p.name}")
    return (
        "\nstatic void dflash2_thread(const mtlc::Coords& at, void* closure) {\n"
        "  void** p = static_cast<void**>(closure);\n"
        f"  {call}(\n      " + ",\n      ".join(args) + ");\n}\n"
        'extern "C" const char* dflash2_run(void** p, const int64_t* grid, const int64_t* tg) {\n'
        "  return mtlc::launch(grid, tg, dflash2_thread, p);\n}\n")


class CompileError(RuntimeError):
    pass


class LaunchError(RuntimeError):
    pass


def compile_source(text: str, workdir: Path) -> ctypes.CDLL:
    """g++ the translation unit into a shared library, cached by its text."""
    digest = hashlib.sha1(text.encode()).hexdigest()[:16]
    lib = workdir / f"k_{digest}.so"
    if not lib.exists():
        src = workdir / f"k_{digest}.cpp"
        src.write_text(text)
        cmd = [gxx() or "g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-Wno-attributes",
               "-o", str(lib), str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise CompileError(f"g++ failed on {src}:\n{done.stderr[-6000:]}")
    handle = ctypes.CDLL(str(lib))
    handle.dflash2_run.restype = ctypes.c_char_p
    handle.dflash2_run.argtypes = [ctypes.POINTER(ctypes.c_void_p),
                                   ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
    return handle


def _fresh_output(shape, dtype, init_value):
    """MLX leaves outputs uninitialised unless init_value is given: 0xFF bytes stand for that."""
    np_dtype = np.dtype(NUMPY_DTYPES[dtype])
    if init_value is not None:
        value = np.array(init_value, np.float32).astype(np.dtype(np_dtype))
        return np.full(shape, value, np_dtype) if dtype != mx.bfloat16 else np.array(
            mx.full(shape, init_value, mx.bfloat16).view(mx.uint16))
    size = int(np.prod(shape)) * np_dtype.itemsize
    return np.full(size, 0xFF, np.uint8).view(np_dtype).reshape(shape)


def metal_kernel(name, input_names, output_names, source, header="",
                 ensure_row_contiguous=True, atomic_outputs=False, *, workdir: Path):
    """Same arguments as `mx.fast.metal_kernel` (plus where to cache the libraries)."""
    if atomic_outputs:
        raise NotImplementedError("atomic outputs are not emulated")
    workdir = Path(workdir)

    def call(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template=(),
             init_value=None, verbose=False, stream=None):
        host = [_host(x) for x in inputs]
        if ensure_row_contiguous:
            host = [(np.ascontiguousarray(a), d) for a, d in host]
        text, definition, params = generated_source(
            name, input_names, output_names, source, header, host, output_dtypes, template)
        if verbose:
            print(text)
        unit = f'#include "{COMPAT_HEADER}"\n{text}{_launcher(definition, params)}'
        lib = compile_source(unit, workdir)

        keep, pointers = [], []   # buffers in parameter order, alive until the launch ends
        outputs = [_fresh_output(tuple(s), d, init_value)
                   for s, d in zip(output_shapes, output_dtypes)]
        by_name = dict(zip(input_names, host))
        out_by_name = dict(zip(output_names, outputs))
        for p in params:
            if p.kind in ("input", "scalar"):
                buf = by_name[p.name][0]
            elif p.kind == "shape":
                buf = np.array(by_name[p.name][0].shape, np.int32)
            elif p.kind == "strides":
                arr = by_name[p.name][0]
                buf = np.array([s // arr.itemsize for s in arr.strides], np.int64)
            elif p.kind == "ndim":
                buf = np.array(by_name[p.name][0].ndim, np.int32)
            elif p.kind == "output":
                buf = out_by_name[p.name]
            else:
                continue
            keep.append(buf)
            pointers.append(buf.ctypes.data)
        argv = (ctypes.c_void_p * max(1, len(pointers)))(*pointers)
        grid_v = (ctypes.c_int64 * 3)(*grid)
        tg_v = (ctypes.c_int64 * 3)(*threadgroup)
        error = lib.dflash2_run(argv, grid_v, tg_v)
        if error:
            raise LaunchError(f"{name}: {error.decode()}")
        results = []
        for out, dtype in zip(outputs, output_dtypes):
            arr = mx.array(out)
            results.append(arr.view(mx.bfloat16) if dtype == mx.bfloat16 else arr)
        return results

    return call


def cpu_kernel(name: str, workdir, edit=None):
    """The harness stand-in for `metal.<name>_kernel()`; `edit(spec)` may alter the sources."""
    from dflash2_mlx.model.kernels import metal

    spec = metal.kernel_spec(name)
    if edit is not None:
        spec = edit(dict(spec))
    return metal_kernel(**spec, workdir=workdir)


# ------------------------------------------------------------------ shared by the kernel tests

ULP = {mx.float32: 2.0 ** -23, mx.float16: 2.0 ** -10, mx.bfloat16: 2.0 ** -7}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Where the harness caches its g++ builds (one per source text); skips without g++."""
    if gxx() is None:
        pytest.skip("g++ is needed to run the Metal sources on the CPU")
    return tmp_path_factory.mktemp("harness")


def mutate(part: str, old: str, new: str):
    """An `edit` for `cpu_kernel`: `old`, found exactly once in the spec's `part`, made `new`."""
    def edit(spec):
        assert spec[part].count(old) == 1, f"{old!r} is not once in the {part}"
        spec[part] = spec[part].replace(old, new)
        return spec
    return edit


def f32(x) -> np.ndarray:
    return np.array(mx.array(x).astype(mx.float32))


def _head(cache, n: int):
    """The first n positions of a cache [B, H, N, ...], or of each quantized part of one."""
    return tuple(a[:, :, :n] for a in cache) if isinstance(cache, tuple) else cache[:, :, :n]


def ragged_positions(B: int, N: int, T: int, seed: int, pads=(0, 5, 40)) -> mx.array:
    """[B, N] int32 key positions of ragged rows as the batch engine's caches lay them out
    (model/row_caches.py): batch row b starts with pads[b % len(pads)] holes (-1: a shorter row
    joined, rows that left), then its positions in order with about one slot in five a hole (a
    rejected draft), then the T slots of the block being verified."""
    rng = np.random.default_rng(seed)
    out = np.full((B, N), -1, np.int64)
    for b in range(B):
        pad = min(pads[b % len(pads)], N - T)
        kept = rng.random(N - T - pad) >= 0.2
        n = int(kept.sum())
        out[b, pad:N - T][kept] = np.arange(n)
        out[b, N - T:] = n + np.arange(T)
    return mx.array(out.astype(np.int32))


def assert_rows_invariant(run, q, k, v, *args, positions=None):
    """Row t of a T-row verify, `run(q, k, v, *args)`, equals bit for bit the same row run
    alone (T = 1) over the cache as plain decoding sees it (the first N - T + t + 1 slots).
    k and v: arrays [B, Hkv, N, D] or tuples of quantized parts; positions: ragged rows' key
    positions [B, N] (passed to `run` as `positions=`, cut to the same slots), or None."""
    T, N = q.shape[2], (k[0] if isinstance(k, tuple) else k).shape[2]
    bits_of = lambda y: np.array(y.view(mx.uint32 if q.dtype == mx.float32 else mx.uint16))
    rows = lambda n: {} if positions is None else {"positions": positions[:, :n]}
    among = bits_of(run(q, k, v, *args, **rows(N)))
    for t in range(T):
        n = N - T + t + 1
        alone = bits_of(run(q[:, :, t:t + 1], _head(k, n), _head(v, n), *args, **rows(n)))
        differ = np.argwhere(alone[:, :, 0] != among[:, :, t])
        assert not len(differ), f"row {t} differs alone at [b, h, d] = {differ[:4].tolist()}"
