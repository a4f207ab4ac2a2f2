"""The target's forward through the verify kernels (`model.kernel_view`), run on this machine with
the very `.metal` sources compiled as C++ by the harness (tests/metal_harness.py): logits equal
stock's within float32 rounding at 1 and 8 rows, greedy speculative decoding equals plain
decoding through the same kernels token for token, a stock record leaves today's view (no
wrapper), and an attention class the view does not know stays stock."""

from __future__ import annotations

import json
import logging
import shutil

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

import dflash2_mlx
from dflash2_mlx.model import kernel_view as kv
from dflash2_mlx.model.kernels import metal
from dflash2_mlx.model.target import TargetAdapter
from dflash2_mlx.model.views import KVQuant
from dflash2_mlx.pipeline import Pipeline
from dflash2_mlx.model.kernel_probe import Decision, KernelRecord, TOLERANCE, shape_classes
from fixtures import write_target

import metal_harness as mh

pytestmark = [pytest.mark.metal, pytest.mark.rows]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    if mh.gxx() is None:
        pytest.skip("g++ is needed to run the Metal sources on the CPU")
    return tmp_path_factory.mktemp("kernel_view")


class Counted:
    """`VerifyKernels` running the harness-compiled kernels, counting calls by rows (and,
    in `ragged`, the (batch rows, rows) of the calls over ragged rows)."""

    def __init__(self, workdir):
        self.workdir, self.calls, self.ragged = workdir, [], []

    def count(self, what, q, positions):
        self.calls.append((what, q.shape[2]))
        if positions is not None:
            self.ragged.append((q.shape[0], q.shape[2]))

    def attention(self, q, k, v, scale, positions=None):
        self.count("attention", q, positions)
        first = metal.attention_launch(q, k, v, scale, positions=positions)
        o_part, ml_part = mh.cpu_kernel("verify_attention", self.workdir)(**first)
        merge = metal.merge_launch(first, o_part, ml_part)
        return mh.cpu_kernel("verify_attention_merge", self.workdir)(**merge)[0]

    def qmm(self, x, w, scales, biases, group_size, bits):
        self.calls.append(("qmm", x.size // x.shape[-1]))
        launch = metal.qmm_launch(x, w, scales, biases, group_size, bits)
        y = mh.cpu_kernel("small_m_qmm", self.workdir)(**launch)[0]
        return y.reshape(*x.shape[:-1], w.shape[0])

    def quantized_attention(self, q, k, v, scale, group_size, bits, positions=None):
        self.count("qattention", q, positions)
        first = metal.quant_attention_launch(q, k, v, scale, group_size, bits,
                                             positions=positions)
        o_part, ml_part = mh.cpu_kernel("verify_attention_quant", self.workdir)(**first)
        merge = metal.merge_launch(first, o_part, ml_part)
        return mh.cpu_kernel("verify_attention_merge", self.workdir)(**merge)[0]

    def kernels(self) -> kv.VerifyKernels:
        return kv.VerifyKernels(self.attention, self.qmm, self.quantized_attention)


def quantized_target(folder, family: str, bits: int = 4):
    """A tiny random target of head dim 32 (the kernel's smallest), quantized at `bits` and
    saved as mlx-lm does; loaded back with its tokenizer."""
    write_target(folder, family, seed=5, head_dim=32)
    model, _ = mlx_lm.load(str(folder))
    nn.quantize(model, group_size=64, bits=bits)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization"] = {"group_size": 64, "bits": bits}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def quantized_pipe(folder, draft=None, kernels=None, kv_bits=None) -> Pipeline:
    """A pipeline on the quantized target as stored (`load` dequantizes it off a Mac), with the
    drafter and kernel setting `load` gives (kv_bits: its KV cache quantized, group 32)."""
    base = dflash2_mlx.load(str(folder), str(draft) if draft else None, kernels=kernels)
    pipe = Pipeline(mlx_lm.load(str(folder))[0], base.tokenizer, base.drafter, kv_bits=kv_bits,
                    kv_group_size=32 if kv_bits else None)
    pipe.kernel_setting = base.kernel_setting
    return pipe


@pytest.fixture(scope="module")
def qwen3_q4(tmp_path_factory):
    return quantized_target(tmp_path_factory.mktemp("qwen3_q4"), "qwen3")


@pytest.fixture(scope="module")
def llama_q8(tmp_path_factory):
    return quantized_target(tmp_path_factory.mktemp("llama_q8"), "llama", bits=8)


def record(model, custom: bool = True, kv_quant=None) -> KernelRecord:
    """Every shape class of `model` custom (or every one stock), as `--kernels metal` does."""
    return KernelRecord("test", mx.__version__, "test", {
        s.key: Decision(s.key, custom, "forced", 0.0) for s in shape_classes(model, kv_quant)})


IDS = mx.array([[7, 21, 33, 4, 90, 17, 250, 3, 61, 8, 44, 19, 300, 2, 77, 51, 6, 140, 9, 12,
                 5, 80, 111, 42, 13, 99, 27, 64, 200]])


def logits_by_width(adapter):
    """Logits of a 20-row prefill (past the kernels' 16 rows: stock), then a 1-row step, then
    an 8-row verify."""
    cache = adapter.make_cache()
    out = [adapter.forward(IDS[:, :20], cache)[0]]
    out.append(adapter.forward(IDS[:, 20:21], cache)[0])
    out.append(adapter.forward(IDS[:, 21:29], cache)[0])
    return out


@pytest.mark.parametrize("folder", ["qwen3_q4", "llama_q8"])
def test_view_logits_equal_stock_at_1_and_8_rows(workdir, folder, request):
    model, _ = mlx_lm.load(str(request.getfixturevalue(folder)))
    adapter = TargetAdapter(model, (0, 2))
    stock = logits_by_width(adapter)
    counted = Counted(workdir)
    adapter.use_kernels(record(model), counted.kernels())
    routed = kv.routed_modules(adapter.range.target.model)
    assert "lm_head" in routed and "model.layers.0.self_attn" in routed
    custom = logits_by_width(adapter)
    # the step and the verify went through both kernels, the 20-row prefill through neither
    assert {n for what, n in counted.calls if what == "attention"} == {1, 8}
    assert {n for what, n in counted.calls if what == "qmm"} == {1, 8}
    assert len(counted.calls) == 2 * (4 * (1 + 7) + 1)     # per forward: layers x 8, head
    for s, c in zip(stock, custom):
        scale = float(mx.abs(s).max())
        np.testing.assert_allclose(np.array(c), np.array(s), rtol=0,
                                   atol=TOLERANCE["float32"] * scale)
    assert kv.routed_modules(model) == []                        # the user's model untouched


def test_a_quantized_kv_cache_reads_through_the_quantized_kernel(workdir, llama_q8):
    """With --kv-bits 8 the full-attention class is the quantized one: the step and the verify
    read mlx-lm's QuantizedKVCache through the quantized verify attention, within float32
    rounding of stock over the same cache."""
    model, _ = mlx_lm.load(str(llama_q8))
    quant = KVQuant(8, 32)
    adapter = TargetAdapter(model, (0, 2), kv=quant)
    stock = logits_by_width(adapter)
    counted = Counted(workdir)
    adapter.use_kernels(record(model, kv_quant=quant), counted.kernels())
    custom = logits_by_width(adapter)
    assert {n for what, n in counted.calls if what == "qattention"} == {1, 8}
    assert not [1 for what, _ in counted.calls if what == "attention"]
    for s, c in zip(stock, custom):
        np.testing.assert_allclose(np.array(c), np.array(s), rtol=0,
                                   atol=TOLERANCE["float32"] * float(mx.abs(s).max()))
    # the float class's record does not route a quantized cache's attention
    counted.calls.clear()
    adapter.use_kernels(record(model), counted.kernels())
    logits_by_width(adapter)
    assert not [1 for what, _ in counted.calls if "attention" in what]


def test_wrong_wiring_is_caught(workdir, qwen3_q4):
    """The comparison above catches an attention that ignores the causal mask."""
    model, _ = mlx_lm.load(str(qwen3_q4))
    adapter = TargetAdapter(model)
    stock = logits_by_width(adapter)
    counted = Counted(workdir)
    full = lambda q, k, v, scale: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    adapter.use_kernels(record(model), kv.VerifyKernels(full, counted.qmm))
    custom = logits_by_width(adapter)
    assert float(mx.abs(custom[2] - stock[2]).max()) > 1e-2 * float(mx.abs(stock[2]).max())


def test_greedy_speculative_equals_plain_through_the_kernels(workdir, qwen3_q4, dflash2_dir):
    pipe = quantized_pipe(qwen3_q4, dflash2_dir)
    counted = Counted(workdir)
    pipe.verify_kernels, pipe.kernel_calls = record(pipe.target), counted.kernels()
    pipe.route_kernels()
    prompt = "def add(a, b):"
    plain = pipe.generate(prompt, max_tokens=10, block_size=1).tokens
    assert {n for what, n in counted.calls if what == "attention"} == {1}   # prompt: > 16
    counted.calls.clear()
    wide = pipe.generate(prompt, max_tokens=10, block_size=4).tokens
    assert wide == plain and len(plain) == 10
    widths = {n for what, n in counted.calls if what == "attention"}
    assert 1 in widths and any(n > 1 for n in widths)   # plain steps and verifies both ran
    assert widths <= {n for what, n in counted.calls if what == "qmm"}


def test_key_positions_give_the_ragged_caches_mask():
    """`key_positions` read from a ragged cache's public state is the mask its `make_mask`
    builds (through `ops.verify_mask`): rows joined at different lengths (left padding), then
    verifies keeping different counts (holes inside the rows)."""
    from mlx_lm.models.cache import KVCache

    from dflash2_mlx.model.row_caches import RaggedKVCache
    from dflash2_mlx.model.kernels.ops import verify_mask

    rows = []
    for n in (3, 9, 5):
        single = KVCache()
        single.update_and_fetch(mx.zeros((1, 1, n, 32)), mx.zeros((1, 1, n, 32)))
        rows.append(single)
    cache = RaggedKVCache.merge(rows)
    for T, keep in ((4, [1, 4, 2]), (3, [3, 0, 1]), (2, [2, 1, 0])):
        mask = cache.make_mask(T)
        cache.update_and_fetch(mx.zeros((3, 1, T, 32)), mx.zeros((3, 1, T, 32)))
        positions = kv.key_positions(cache, T)
        assert positions.shape == (3, cache.size())
        assert mx.array_equal(verify_mask(T, cache.size(), positions=positions), mask).item()
        cache.commit(keep)
    assert (np.array(kv.key_positions(cache, 1)) < 0).any()          # holes were there


@pytest.mark.parametrize("kv_bits", [None, 8], ids=["float KV", "8-bit KV"])
def test_batch_engine_equals_each_sequence_alone_through_the_kernels(workdir, qwen3_q4,
                                                                     dflash2_dir, kv_bits):
    """The batch engine (ragged caches: rows of different lengths, holes from rejected drafts)
    through the custom view gives each sequence the tokens it gets alone at block size 1
    through the same view, and its attention ran on the kernel over several batch rows (the
    quantized one over `RaggedQuantizedKVCache` with an 8-bit KV cache)."""
    pipe = quantized_pipe(qwen3_q4, dflash2_dir, kv_bits=kv_bits)
    counted = Counted(workdir)
    pipe.verify_kernels = record(pipe.target, kv_quant=pipe.kv)
    pipe.kernel_calls = counted.kernels()
    pipe.route_kernels()
    prompts = ["def add(a, b):", "Hello! How can I help you today?", "for i in range(10):"]
    limits = [8, 6, 7]
    gens = pipe.generate_batch(prompts, max_tokens=limits, block_size=4, max_batch=3)
    assert any(b > 1 for b, _ in counted.ragged), counted.ragged
    assert any(t > 1 for _, t in counted.ragged)                     # verifies among them
    kinds = {what for what, _ in counted.calls if "attention" in what}
    assert kinds == {"qattention" if kv_bits else "attention"}
    for prompt, n, gen in zip(prompts, limits, gens):
        counted.ragged.clear()
        alone = pipe.generate(prompt, max_tokens=n, block_size=1)
        assert gen.tokens == alone.tokens and len(alone.tokens) == n, prompt
        assert not counted.ragged                               # alone: a plain KVCache


class Timed(Exception):
    """Raised where the calibration would time the costs."""


def test_width_policy_routes_the_target_before_the_calibration(qwen3_q4, monkeypatch):
    """The probe's record reaches the forward through `Pipeline.route_kernels`, before the
    costs are timed (so they time the kernels that run)."""
    import dflash2_mlx.pipeline as pl

    pipe = quantized_pipe(qwen3_q4)
    pipe.kernel_calls = kv.ops_kernels()
    monkeypatch.setattr(pl, "verify_kernels", lambda p, setting, key: record(p.target))
    seen = []

    def costs(p, width):
        seen.append(kv.routed_modules(p.adapter.range.target.model))
        raise Timed

    monkeypatch.setattr(pl, "load_or_measure_costs", costs)
    with pytest.raises(Timed):
        pipe.width_policy()
    assert "lm_head" in seen[0] and "model.layers.3.self_attn" in seen[0]


@pytest.mark.parametrize("how", ["no record", "stock record", "kernels=stock"])
def test_stock_leaves_todays_view(qwen3_q4, how, monkeypatch):
    """Stock: the forward runs the model's own layer objects (no wrapper anywhere), the view
    built at load, whether the record is None, every class stock, or `--kernels stock`."""
    import dflash2_mlx.pipeline as pl

    pipe = quantized_pipe(qwen3_q4, kernels="stock" if how == "kernels=stock" else None)
    adapter, model = pipe.adapter, pipe.target
    before = adapter._view
    pipe.kernel_calls = kv.ops_kernels()
    if how == "kernels=stock":         # the real probe entry: "stock" forces None
        def costs(p, width):
            raise Timed

        monkeypatch.setattr(pl, "load_or_measure_costs", costs)
        with pytest.raises(Timed):
            pipe.width_policy()
        assert pipe.verify_kernels is None
    else:
        pipe.verify_kernels = None if how == "no record" else record(model, custom=False)
        pipe.route_kernels()
    assert adapter._view is before and adapter.range.target is adapter
    assert adapter._view.model.layers == model.model.layers         # the same objects
    assert all(a is b for a, b in zip(adapter._view.model.layers, model.model.layers))
    assert kv.routed_modules(adapter._view) == []
    assert kv.kernel_model(model, record(model, custom=False), kv.ops_kernels()) is model
    # and back to stock after a custom view
    adapter.use_kernels(record(model), kv.ops_kernels())
    assert kv.routed_modules(adapter.range.target.model)
    adapter.use_kernels(None)
    assert adapter.range.target is adapter and all(
        a is b for a, b in zip(adapter._view.model.layers, model.model.layers))


class OtherAttention(llama.Attention):
    """An attention class the view does not know (a family's own variant)."""


def test_an_unrecognised_attention_stays_stock(workdir, caplog, monkeypatch):
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=2, rms_norm_eps=1e-5,
                           vocab_size=384, num_key_value_heads=1)
    mx.random.seed(3)
    model = llama.Model(args)
    model.model.layers[1].self_attn = OtherAttention(args)
    nn.quantize(model, group_size=64, bits=4)
    monkeypatch.setattr(kv, "_said", set())
    counted = Counted(workdir)
    with caplog.at_level(logging.INFO):
        view = kv.kernel_model(model, record(model), counted.kernels())
        kv.kernel_model(model, record(model), counted.kernels())
    routed = kv.routed_modules(view)
    assert "model.layers.0.self_attn" in routed
    assert "model.layers.1.self_attn" not in routed                 # stock attention ...
    assert "model.layers.1.self_attn.q_proj" in routed              # ... its projections custom
    said = [r.message for r in caplog.records if "OtherAttention" in r.message]
    assert len(said) == 1 and "stays stock" in said[0]
    assert type(view.model.layers[1].self_attn) is OtherAttention
    cache_s, cache_c = make_prompt_cache(model), make_prompt_cache(model)
    s, c = model(IDS[:, :5], cache=cache_s), view(IDS[:, :5], cache=cache_c)
    assert ("attention", 5) in counted.calls and len(
        [1 for what, _ in counted.calls if what == "attention"]) == 1
    np.testing.assert_allclose(np.array(c), np.array(s), rtol=0,
                               atol=TOLERANCE["float32"] * float(mx.abs(s).max()))
