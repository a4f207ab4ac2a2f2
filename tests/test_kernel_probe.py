"""The verify kernels' probe (`model.kernel_probe`, `policy.kernel_choice`): its rule on fake
timings, its record stored with the calibration, the stock path off Metal, and what `doctor`
shows."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import pytest

from dflash2_mlx.model import kernel_probe as kp
from dflash2_mlx.policy import calibration, kernel_choice
from dflash2_mlx.model.kernel_probe import Decision, KernelRecord, Timing, decide

WIDTHS = (1, 2, 4, 8, 16)


def timings(stock=1e-3, ratio=0.5, error=1e-6, **at):
    """One Timing per width: custom = ratio x stock, except the widths given in `at` as
    (ratio, error)."""
    out = []
    for w in WIDTHS:
        r, e = at.get(f"w{w}", (ratio, error))
        out.append(Timing(w, stock * w, stock * w * r, e))
    return out


def test_faster_within_tolerance_is_chosen():
    d = decide("qmm", timings(ratio=0.6), tolerance=1e-3)
    assert d.custom and "1.67x" in d.reason


@pytest.mark.parametrize("ratio", [1.3, 1.0, 0.99])   # slower, equal, within the timing margin
def test_a_kernel_not_faster_is_never_chosen(ratio):
    d = decide("qmm", timings(ratio=ratio), tolerance=1e-3)
    assert not d.custom and d.reason.startswith("not faster at widths 1, 2, 4, 8, 16")


def test_slower_at_one_width_is_not_chosen():
    """Plain steps (width 1) run the same choice: a kernel that loses there stays stock."""
    d = decide("attention", timings(ratio=0.4, w1=(1.1, 1e-6)), tolerance=1e-3)
    assert not d.custom and d.reason == "not faster at width 1"


@pytest.mark.parametrize("error", [2e-3, float("nan"), float("inf")])
def test_out_of_tolerance_is_never_chosen_however_fast(error):
    d = decide("attention", timings(ratio=0.2, w8=(0.2, error)), tolerance=1e-3)
    assert not d.custom and d.reason.startswith("outside tolerance at width 8")


def test_nothing_probed_is_stock():
    assert not decide("qmm", [], 1e-3).custom


def record():
    return KernelRecord("Apple M3 Max", "0.32.4", "Qwen3-8B-4bit", {
        "qmm 64x128 4-bit g32 bfloat16": decide("qmm 64x128 4-bit g32 bfloat16",
                                                 timings(ratio=0.6), 3e-2),
        "attention Hq4 Hkv2 D64 bfloat16": decide("attention Hq4 Hkv2 D64 bfloat16",
                                                   timings(ratio=1.2), 3e-2)})


def test_record_round_trip_and_staleness():
    rec = record()
    back = KernelRecord.from_dict(rec.to_dict())
    assert back == rec and back.stale("Apple M3 Max", "0.32.4", "Qwen3-8B-4bit") is None
    assert "chip Apple M3 Max" in back.stale("Apple M4 Pro", "0.32.4", "Qwen3-8B-4bit")
    assert "MLX 0.32.4" in back.stale("Apple M3 Max", "0.33.0", "Qwen3-8B-4bit")
    assert "model" in back.stale("Apple M3 Max", "0.32.4", "Llama")
    assert KernelRecord.from_dict({"chip": "x"}) is None


def test_record_is_stored_with_the_calibration(tmp_path, monkeypatch):
    """The probe's record sits in the calibration entry and survives the costs being stored
    again (a re-calibration keeps it)."""
    monkeypatch.setattr(calibration, "cache_file", lambda: tmp_path / "calibration.json")
    calibration.store_kernel_record("k1", record().to_dict())
    cost = calibration.CostModel((0.0, 1.0), (1.0, 2.0))
    calibration._store(tmp_path / "calibration.json", "k1", cost, {"when": "now"})
    entry = calibration.stored_calibrations()["k1"]
    assert entry["verify"] == [1.0, 2.0]
    assert KernelRecord.from_dict(calibration.stored_kernel_record("k1")) == record()
    assert calibration.stored_kernel_record("other") is None


def test_doctor_rows_and_probe_table_show_each_decision_with_its_timings():
    rows = kp.decision_rows(record().to_dict())
    assert len(rows) == 2 and all(r.startswith("Apple M3 Max, MLX 0.32.4, Qwen3-8B-4bit: ")
                                  for r in rows)
    assert "qmm 64x128 4-bit g32 bfloat16: custom (faster" in rows[0]
    assert "w16 16000/9600 us" in rows[0] and "attention Hq4 Hkv2 D64 bfloat16: stock" in rows[1]
    table = kp.probe_table(record().decisions)
    assert table.count("\n") == 2 + 2 * len(WIDTHS) - 1 and "| 1.67x |" in table


def test_a_custom_kernel_that_fails_is_stock(monkeypatch):
    """A Metal compile error on the user's Mac must not stop the run: stock, reason kept."""
    def fail():
        raise RuntimeError("Metal compile error: line 3")
    monkeypatch.setattr(kp, "_pair", lambda shape, w, n: (lambda: mx.zeros(1), fail))
    d = kp.probe_shape(kp.ShapeClass("qmm", (8, 64, 4, 32), "float16"), widths=(1,), reps=1)
    assert not d.custom and d.reason == ("custom kernel failed: RuntimeError: Metal compile "
                                         "error: line 3")


def test_shape_classes_of_a_quantized_llama():
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=96, num_key_value_heads=2)
    model = llama.Model(args)
    nn.quantize(model, group_size=32, bits=4)
    keys = sorted(s.key for s in kp.shape_classes(model))
    assert "attention Hq4 Hkv2 D16 float32" in keys
    assert {"qmm 64x64 4-bit g32 float32", "qmm 32x64 4-bit g32 float32",
            "qmm 128x64 4-bit g32 float32", "qmm 64x128 4-bit g32 float32"} <= set(keys)
    assert len(keys) == len(set(keys))                      # each class once, for both layers


def test_shape_classes_with_a_quantized_kv_cache():
    """With kv_bits, the full-attention modules are the quantized-cache class (bits and group
    size in the key); a sliding-window one keeps its float cache, as views.model_cache does."""
    from dflash2_mlx.model.views import KVQuant

    class Attention(nn.Module):
        def __init__(self, window=None):
            super().__init__()
            self.n_heads, self.n_kv_heads, self.sliding_window = 4, 2, window
            self.o_proj = nn.Linear(256, 64)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Attention(), Attention(window=128)]

    keys = sorted(s.key for s in kp.shape_classes(Model(), KVQuant(8, 32)))
    assert keys == ["attention Hq4 Hkv2 D64 kv8-bit g32 float32",
                    "attention Hq4 Hkv2 D64 window128 float32"]
    assert sorted(s.key for s in kp.shape_classes(Model())) == [
        "attention Hq4 Hkv2 D64 float32", "attention Hq4 Hkv2 D64 window128 float32"]
    stock, _ = kp._pair(kp.ShapeClass("qattention", (4, 2, 64, 8, 32), "float32"), 3, 40)
    assert stock().shape == (1, 4, 3, 64)       # mlx-lm's quantized attention, the probe's stock


@pytest.mark.skipif(kp.machine_chip() and mx.metal.is_available(), reason="Metal here")
def test_off_metal_the_stock_path_runs_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(kernel_choice, "_said_stock", False)
    with caplog.at_level(logging.INFO):
        assert kernel_choice.verify_kernels(object(), "auto") is None
        assert kernel_choice.verify_kernels(object(), "auto") is None
    said = [r.getMessage() for r in caplog.records if "verify kernels" in r.getMessage()]
    assert said == ["verify kernels: stock (no Metal GPU here; the custom ones run on Apple "
                    "silicon where its probe chose them)"]


def test_kernels_stock_forces_stock(monkeypatch):
    monkeypatch.setattr(kernel_choice, "_said_stock", True)
    monkeypatch.setattr("dflash2_mlx.model.kernels.metal_usable", lambda: True)
    assert kernel_choice.verify_kernels(object(), "stock") is None     # no probe, no model needed


def test_mac_simulation_picks_the_best_width_and_custom_never_loses():
    """dflash2_mlx.bench.kernel_simulation: the policy's pick is the width of most expected
    speedup, and the cheaper custom verify curve is never slower at any width."""
    from dflash2_mlx.bench import kernel_simulation as sim

    assert abs(sim.expected_tokens(sim.alphas_for(5.97), 16) - 5.97) < 1e-6
    for tau in sim.TAUS:
        stock = sim.simulate(sim.CURVES["stock"], tau, 0.15)
        custom = sim.simulate(sim.CURVES["custom"], tau, 0.15)
        for run in (stock, custom):
            assert run["speedup"][run["pick"]] == max(run["speedup"].values())
        assert all(custom["speedup"][w] >= stock["speedup"][w] for w in stock["speedup"])
    assert "**3.22x**" in sim.table(0.15)      # the figure docs/kernels.md quotes
