"""Whether the target's custom verify kernels (`metal.verify_attention_metal`,
`metal.verify_attention_quant_metal`, `metal.small_m_qmm_metal`) run on this machine: the
probe that times them against MLX's stock kernels per shape class, the rule that decides from
its timings (`decide`), and the record of its decisions, keyed by chip, MLX version and model
(`policy.kernel_choice` stores it with the calibration).

One decision covers a shape class at every width, plain steps (one row) and verifies (2-16
rows) alike: both then run the same row-invariant kernel, and a verify is bit for bit the plain
steps it replaces (docs/kernels.md). So the custom kernel is chosen only where it is within
tolerance of stock at every probed width and faster at every one of them.

The probe needs Metal; elsewhere every class is stock.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass, field

from .. import log

_log = log.get(__name__)

PROBE_WIDTHS = (1, 2, 4, 8, 16)
PROBE_CONTEXT = 2048      # keys the attention probe reads (the 16-32k gains show at long ones)
PROBE_REPS = 5            # timed calls per kernel and width after a warm-up; the fastest counts
MARGIN = 0.02             # custom must be this much faster at every width (timing noise)
# largest |custom - stock| over the largest |stock| a custom result may differ by: a few
# roundings of the dtype (both accumulate in float32, in different orders)
TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}
RECORD_VERSION = "1"      # bump when the probe or the rule changes: records are probed again


@dataclass(frozen=True)
class ShapeClass:
    """What one custom kernel computes in a target: attention (dims: query heads, KV heads,
    head dim, window (0: none), sinks 0 | 1), attention over a quantized KV cache
    ("qattention", dims: query heads, KV heads, head dim, KV bits, group size) or qmm (dims:
    out features, in features, bits, group size), in the dtype of its activations."""

    kind: str
    dims: tuple[int, ...]
    dtype: str

    @property
    def key(self) -> str:
        if self.kind == "attention":
            hq, hkv, d, window, sinks = self.dims
            return (f"attention Hq{hq} Hkv{hkv} D{d}" + (f" window{window}" if window else "")
                    + (" sinks" if sinks else "") + f" {self.dtype}")
        if self.kind == "qattention":
            hq, hkv, d, bits, group = self.dims
            return f"attention Hq{hq} Hkv{hkv} D{d} kv{bits}-bit g{group} {self.dtype}"
        n, k, bits, group = self.dims
        return f"qmm {n}x{k} {bits}-bit g{group} {self.dtype}"


@dataclass(frozen=True)
class Timing:
    """One width of the probe: seconds per call of each kernel, and the custom result's
    largest difference from stock over stock's largest magnitude."""

    width: int
    stock: float
    custom: float
    error: float


@dataclass(frozen=True)
class Decision:
    shape: str
    custom: bool
    reason: str
    tolerance: float
    timings: tuple[Timing, ...] = ()

    def to_dict(self) -> dict:
        return {"custom": self.custom, "reason": self.reason, "tolerance": self.tolerance,
                "timings": [asdict(t) for t in self.timings]}

    @classmethod
    def from_dict(cls, shape: str, entry: dict) -> "Decision":
        return cls(shape, bool(entry["custom"]), str(entry["reason"]),
                   float(entry["tolerance"]),
                   tuple(Timing(int(t["width"]), float(t["stock"]), float(t["custom"]),
                                float(t["error"])) for t in entry["timings"]))


def decide(shape: str, timings: list[Timing], tolerance: float,
           margin: float = MARGIN) -> Decision:
    """Custom only where every width is within `tolerance` of stock (a NaN never is) and
    faster than stock by `margin`; else stock, with the reason."""
    timings = sorted(timings, key=lambda t: t.width)
    if not timings:
        return Decision(shape, False, "not probed", tolerance)
    off = [t for t in timings if not t.error <= tolerance]
    if off:
        worst = max(off, key=lambda t: t.error if t.error == t.error else float("inf"))
        return Decision(shape, False, f"outside tolerance at width {worst.width} (error "
                        f"{worst.error:.2g} > {tolerance:.2g})", tolerance, tuple(timings))
    slow = [t.width for t in timings if not t.custom <= t.stock * (1 - margin)]
    if slow:
        return Decision(shape, False, "not faster at width" + ("s " if len(slow) > 1 else " ")
                        + ", ".join(map(str, slow)), tolerance, tuple(timings))
    gain = min(t.stock / t.custom for t in timings)
    return Decision(shape, True, f"faster at every width (at least {gain:.2f}x)", tolerance,
                    tuple(timings))


# ------------------------------------------------------------------ the record

def machine_chip() -> str:
    """The GPU's name on a Mac ("Apple M3 Max"), else the CPU architecture."""
    import mlx.core as mx

    if mx.metal.is_available():
        try:
            return str(mx.metal.device_info().get("device_name") or platform.machine())
        except (RuntimeError, AttributeError):
            pass
    return platform.machine() or "unknown"


@dataclass
class KernelRecord:
    """The probe's decisions for one target on one machine, stored with the calibration."""

    chip: str
    mlx: str
    model: str
    decisions: dict[str, Decision] = field(default_factory=dict)
    version: str = RECORD_VERSION

    def to_dict(self) -> dict:
        return {"chip": self.chip, "mlx": self.mlx, "model": self.model,
                "version": self.version,
                "decisions": {k: d.to_dict() for k, d in self.decisions.items()}}

    @classmethod
    def from_dict(cls, entry) -> "KernelRecord | None":
        """The record of a well-formed `to_dict` entry, else None (probed again)."""
        try:
            return cls(str(entry["chip"]), str(entry["mlx"]), str(entry["model"]),
                       {k: Decision.from_dict(k, d) for k, d in entry["decisions"].items()},
                       str(entry["version"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def stale(self, chip: str, mlx: str, model: str) -> str | None:
        """Why the record does not serve here (None: it does)."""
        for what, mine, now in (("probe", self.version, RECORD_VERSION), ("chip", self.chip, chip),
                                ("MLX", self.mlx, mlx), ("model", self.model, model)):
            if mine != now:
                return f"made for {what} {mine}, not {now}"
        return None

    def uses_custom(self, shape: ShapeClass) -> bool:
        d = self.decisions.get(shape.key)
        return d is not None and d.custom


def decision_rows(record: dict) -> list[str]:
    """`doctor`'s lines of a stored record: each class's decision, reason and timings."""
    rec = KernelRecord.from_dict(record)
    if rec is None:
        return ["malformed: probed again at the next load on a Mac"]
    rows = []
    for key, d in rec.decisions.items():
        times = ", ".join(f"w{t.width} {1e6 * t.stock:.0f}/{1e6 * t.custom:.0f} us"
                          for t in d.timings)
        rows.append(f"{key}: {'custom' if d.custom else 'stock'} ({d.reason})"
                    + (f"; stock/custom {times}" if times else ""))
    head = f"{rec.chip}, MLX {rec.mlx}, {rec.model}"
    return [f"{head}: {row}" for row in rows] or [f"{head}: no shape class probed"]


def probe_table(decisions: dict[str, Decision]) -> str:
    """The probe's figures as a Markdown table (`dflash2_mlx.bench.verify_kernels`): what to
    paste into an issue when reporting a Mac's figures."""
    lines = ["| shape class | width | stock us | custom us | speedup | error | decision |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for key, d in decisions.items():
        for i, t in enumerate(d.timings):
            verdict = ("custom" if d.custom else "stock") + f": {d.reason}" if i == 0 else ""
            lines.append(f"| {key if i == 0 else ''} | {t.width} | {1e6 * t.stock:.1f} | "
                         f"{1e6 * t.custom:.1f} | {t.stock / t.custom:.2f}x | {t.error:.1e} | "
                         f"{verdict} |")
        if not d.timings:
            lines.append(f"| {key} | | | | | | stock: {d.reason} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ shape classes of a target

def qmm_class(m) -> ShapeClass | None:
    """The class of a 4- or 8-bit affine `nn.QuantizedLinear` (else None)."""
    import mlx.nn as nn

    if not (isinstance(m, nn.QuantizedLinear) and m.bits in (4, 8)
            and getattr(m, "mode", "affine") == "affine"):
        return None
    n, words = m.weight.shape
    return ShapeClass("qmm", (n, words * 32 // m.bits, m.bits, m.group_size),
                      _name(m.scales.dtype))


def shape_classes(model, kv=None) -> list[ShapeClass]:
    """The target's shape classes: its 4- and 8-bit affine quantized projections and its
    attention modules (`qmm_class`, `attention_class`), each class once. With `kv`
    (views.KVQuant: bits, group_size), the full-attention modules read a quantized cache
    (those without a window or sinks, as `views.model_cache` and mlx-lm have it): qattention."""
    found: dict[str, ShapeClass] = {}
    for _, m in model.named_modules():
        for s in (qmm_class(m), attention_class(m, kv)):
            if s is not None:
                found.setdefault(s.key, s)
    return list(found.values())


def attention_class(m, kv=None) -> ShapeClass | None:
    """The attention class of module `m` (None: not an attention module): heads, head dim
    (from o_proj's input width), window, sinks, o_proj's dtype; `qattention` over a quantized
    cache (`kv`)."""
    import mlx.nn as nn

    hq, hkv = getattr(m, "n_heads", None), getattr(m, "n_kv_heads", None)
    o_proj = getattr(m, "o_proj", None)
    if not (isinstance(hq, int) and isinstance(hkv, int) and o_proj is not None):
        return None
    w = o_proj.weight
    quantized = isinstance(o_proj, nn.QuantizedLinear)
    d = (w.shape[1] * 32 // o_proj.bits if quantized else w.shape[1]) // hq
    dtype = _name(o_proj.scales.dtype if quantized else w.dtype)
    window = getattr(m, "sliding_window", None) or 0
    window = int(window) if isinstance(window, int) else 0
    sinks = int(getattr(m, "sinks", None) is not None)
    if kv is not None and not window and not sinks:
        return ShapeClass("qattention", (hq, hkv, d, kv.bits, kv.group_size), dtype)
    return ShapeClass("attention", (hq, hkv, d, window, sinks), dtype)


def _name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


# ------------------------------------------------------------------ the probe (Metal only)

def _timed(fn, reps: int) -> tuple[float, object]:
    import mlx.core as mx

    out = fn()
    mx.eval(out)                                   # warm-up: builds the kernel
    best = float("inf")
    for _ in range(reps):
        tic = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - tic)
    return best, out


def _relative_error(custom, stock) -> float:
    import mlx.core as mx

    c, s = custom.astype(mx.float32), stock.astype(mx.float32)
    scale = mx.abs(s).max().item()
    return mx.abs(c - s).max().item() / (scale or 1.0)


def _pair(shape: ShapeClass, width: int, context: int):
    """(stock, custom) callables of `shape` at `width` rows, on random inputs."""
    import mlx.core as mx

    from .kernels import metal, ops

    dtype = getattr(mx, shape.dtype)
    key = iter(mx.random.split(mx.random.key(width), 4))
    if shape.kind == "attention":
        hq, hkv, d, window, sinks = shape.dims
        q = mx.random.normal((1, hq, width, d), key=next(key)).astype(dtype)
        k = mx.random.normal((1, hkv, context, d), key=next(key)).astype(dtype)
        v = mx.random.normal((1, hkv, context, d), key=next(key)).astype(dtype)
        s = mx.random.normal((hq,), key=next(key)).astype(dtype) if sinks else None
        mx.eval(q, k, v)
        args = (q, k, v, d ** -0.5, window, s)
        return (lambda: ops.verify_attention_ops(*args),
                lambda: metal.verify_attention_metal(*args))
    if shape.kind == "qattention":
        hq, hkv, d, bits, group = shape.dims
        q = mx.random.normal((1, hq, width, d), key=next(key)).astype(dtype)
        k, v = (tuple(mx.quantize(mx.random.normal((1, hkv, context, d), key=next(key))
                                  .astype(dtype), group_size=group, bits=bits))
                for _ in range(2))
        mx.eval(q, k, v)
        args = (q, k, v, d ** -0.5, group, bits)
        return (lambda: ops.verify_attention_quant_ops(*args),
                lambda: metal.verify_attention_quant_metal(*args))
    n, k_in, bits, group = shape.dims
    w, scales, biases = mx.quantize(mx.random.normal((n, k_in), key=next(key)).astype(dtype),
                                    group_size=group, bits=bits)
    x = mx.random.normal((1, width, k_in), key=next(key)).astype(dtype)
    mx.eval(w, scales, biases, x)
    args = (x, w, scales, biases, group, bits)
    return (lambda: ops.small_m_qmm_ops(*args), lambda: metal.small_m_qmm_metal(*args))


def probe_shape(shape: ShapeClass, widths=PROBE_WIDTHS, context: int = PROBE_CONTEXT,
                reps: int = PROBE_REPS) -> Decision:
    """Time stock against custom at each width and decide; a custom kernel that fails to
    build or run is stock, with the error as its reason."""
    tolerance = TOLERANCE.get(shape.dtype, TOLERANCE["bfloat16"])
    timings = []
    try:
        for w in widths:
            stock_fn, custom_fn = _pair(shape, w, max(context, w))
            stock_s, stock = _timed(stock_fn, reps)
            custom_s, custom = _timed(custom_fn, reps)
            timings.append(Timing(w, stock_s, custom_s, _relative_error(custom, stock)))
    except Exception as e:                         # a Metal compile or launch error: stock
        return Decision(shape.key, False, f"custom kernel failed: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}", tolerance)
    return decide(shape.key, timings, tolerance)


def probe(shapes: list[ShapeClass], **kw) -> dict[str, Decision]:
    out = {}
    for s in shapes:
        _log.info(f"kernel probe: {s.key} ...")
        out[s.key] = probe_shape(s, **kw)
    return out

