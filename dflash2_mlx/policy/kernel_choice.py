"""Which verify kernels a pipeline runs: the probe's record (`model.kernel_probe`) stored with
the calibration and reused while it matches the chip, MLX version and model."""

from __future__ import annotations

from .. import log
from ..model.kernel_probe import Decision, KernelRecord, machine_chip, probe, shape_classes

_log = log.get(__name__)

_said_stock = False


def verify_kernels(pipeline, setting: str | None, key: str | None = None) -> KernelRecord | None:
    """The verify kernels a pipeline runs: None (stock everywhere) or the probe's record.

    setting: `settings.kernels` ("stock" forces stock). Off Metal, stock, said once per process;
    on Metal the record stored under calibration `key` serves while it matches the chip, MLX
    version and model, else the target's shape classes are probed and the record stored."""
    global _said_stock
    import mlx.core as mx

    from ..model.kernels import metal_usable

    if setting == "stock" or not metal_usable():
        if not _said_stock:
            _said_stock = True
            _log.info("verify kernels: stock (" + ("--kernels stock" if setting == "stock" else
                      "no Metal GPU here; the custom ones run on Apple silicon where its probe "
                      "chose them") + ")")
        return None
    from . import calibration

    target = getattr(pipeline.adapter, "model", None)  # a pipeline stage's ranks: none here
    shapes = shape_classes(target, getattr(pipeline, "kv", None)) if target is not None else []
    if setting == "metal":                         # forced: every class custom, unprobed
        return KernelRecord(machine_chip(), mx.__version__, "?", {
            s.key: Decision(s.key, True, "forced (kernels=metal)", 0.0) for s in shapes})
    model = str((pipeline.info or {}).get("model")) if hasattr(pipeline, "info") else "?"
    chip, version = machine_chip(), mx.__version__
    if key is not None:
        stored = KernelRecord.from_dict(calibration.stored_kernel_record(key))
        if stored is not None and stored.stale(chip, version, model) is None:
            return stored
    record = KernelRecord(chip, version, model, probe(shapes))
    if key is not None:
        calibration.store_kernel_record(key, record.to_dict())
    return record
