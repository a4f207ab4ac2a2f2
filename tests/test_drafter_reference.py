"""The drafter's own outputs against an independent numpy transcription of the DFlash forward
pass (context features -> fc -> hidden_norm; per layer: attention whose keys and values are
the context rows followed by the block rows, RMS-normed q/k with RoPE, then a SwiGLU MLP, each
wrapped in DFlash 2's two-sided dynamic convolution when the drafter has one; final norm; the
target's head). Every exactness test passes with a drafter that proposes garbage,
since the target checks everything: this one fails when the drafter computes the wrong thing.
"""

import numpy as np
import pytest

import mlx.core as mx

from dflash2_mlx.model.target import TargetAdapter
from fixtures import drafter_args, random_drafter


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, positions, theta):
    """x [heads, S, d], non-interleaved halves (mlx-lm's default, `traditional=False`)."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions[:, None] * inv[None]                       # [S, d/2]
    cos, sin = np.cos(ang), np.sin(ang)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def conv_side(y, dyn, base):
    """One side of DFlash 2's dynamic short convolution along the rows: out_t = sum_tap
    (base[tap] + dyn[t, tap] spread over its channel group) * y_{t - tap}; rows < 0 read 0.
    y [L, H], dyn [L, K, groups], base [K, H]."""
    L, H = y.shape
    out = np.zeros_like(y)
    for tap in range(base.shape[0]):
        coef = base[tap][None] + np.repeat(dyn[:, tap], H // dyn.shape[-1], axis=-1)
        out[tap:] += coef[tap:] * y[: L - tap]
    return out


def reference_hidden(params, args, block, feats):
    """block [L, H] embedded block rows, feats [S, F] -> final-normed hidden [L, H]."""
    P = {k: np.array(v, dtype=np.float64) for k, v in params.items()}
    eps, nh, nkv, d = args.rms_norm_eps, args.num_attention_heads, args.num_key_value_heads, \
        args.head_dim
    S, L = feats.shape[0], block.shape[0]
    ctx = rms(feats @ P["fc.weight"].T, P["hidden_norm.weight"], eps)
    x = block
    for i in range(args.num_hidden_layers):
        p = lambda name: P[f"layers.{i}.{name}"]                     # noqa: E731

        def kv(rows, start):
            k = (rows @ p("self_attn.k_proj.weight").T).reshape(len(rows), nkv, d)
            k = rms(k, p("self_attn.k_norm.weight"), eps).transpose(1, 0, 2)
            v = (rows @ p("self_attn.v_proj.weight").T).reshape(len(rows), nkv, d)
            return rope(k, np.arange(start, start + len(rows)), args.rope_theta), \
                v.transpose(1, 0, 2)

        def attention(h):
            kc, vc = kv(ctx, 0)
            kb, vb = kv(h, S)
            k, v = np.concatenate([kc, kb], 1), np.concatenate([vc, vb], 1)
            k, v = np.repeat(k, nh // nkv, 0), np.repeat(v, nh // nkv, 0)
            q = (h @ p("self_attn.q_proj.weight").T).reshape(L, nh, d)
            q = rope(rms(q, p("self_attn.q_norm.weight"), eps).transpose(1, 0, 2),
                     np.arange(S, S + L), args.rope_theta)
            s = q @ k.transpose(0, 2, 1) / np.sqrt(d)                 # no mask: all see all
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            att = (w @ v).transpose(1, 0, 2).reshape(L, nh * d)
            return att @ p("self_attn.o_proj.weight").T

        def mlp(h):
            g, u = h @ p("mlp.gate_proj.weight").T, h @ p("mlp.up_proj.weight").T
            return (g / (1 + np.exp(-g)) * u) @ p("mlp.down_proj.weight").T

        for norm, sublayer, conv in (("input_layernorm", attention, "attention_conv"),
                                     ("post_attention_layernorm", mlp, "mlp_conv")):
            u = rms(x, p(f"{norm}.weight"), eps)
            if not args.has_conv:
                x = x + sublayer(u)
                continue
            # DFlash 2: x + conv_after(sublayer(conv_before(u))), both taps from u
            base = p(f"{conv}.base_kernel")                             # [2, K, H]
            dyn = (u @ p(f"{conv}.kernel_projection.weight").T).reshape(
                L, 2, base.shape[1], -1)
            x = x + conv_side(sublayer(conv_side(u, dyn[:, 0], base[0])), dyn[:, 1], base[1])
    return rms(x, P["norm.weight"], eps)


@pytest.fixture(scope="module")
def target(llama_dir):
    import dflash2_mlx

    pipe = dflash2_mlx.load(str(llama_dir))
    return TargetAdapter(pipe.target, (0, 2))


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
@pytest.mark.parametrize("context", [1, 5])
def test_drafter_logits_equal_the_numpy_reference(target, context, dflash2):
    from mlx.utils import tree_flatten

    args = drafter_args(dflash2=dflash2, block_size=8)
    drafter = random_drafter(args, seed=7)
    rng = np.random.default_rng(context)
    feats = rng.normal(size=(context, 2 * args.hidden_size)).astype(np.float32)
    block_ids = mx.array([[5] + [args.mask_token_id] * 7])
    x = target.embed(block_ids)
    h = drafter(x, mx.array(feats)[None], drafter.make_cache())
    logits = np.array(drafter.logits(h, target.head)[0], dtype=np.float64)

    params = dict(tree_flatten(drafter.parameters()))
    want_h = reference_hidden(params, args, np.array(x[0], dtype=np.float64),
                              feats.astype(np.float64))
    np.testing.assert_allclose(np.array(h[0]), want_h, rtol=1e-4, atol=1e-4)
    head = np.array(target.head(mx.eye(args.hidden_size)), dtype=np.float64)   # [H, V]
    np.testing.assert_allclose(logits, want_h @ head, rtol=1e-4, atol=1e-3)


def test_the_reference_catches_a_broken_drafter(target):
    """The same comparison fails when one weight of the drafter is off (so it can fail)."""
    from mlx.utils import tree_flatten

    args = drafter_args(dflash2=True, block_size=8)
    drafter = random_drafter(args, seed=7)
    feats = np.random.default_rng(0).normal(size=(3, 2 * args.hidden_size)).astype(np.float32)
    x = target.embed(mx.array([[5] + [args.mask_token_id] * 7]))
    params = dict(tree_flatten(drafter.parameters()))
    want = reference_hidden(params, args, np.array(x[0], np.float64), feats.astype(np.float64))
    conv = drafter.layers[1].mlp_conv          # one side of one convolution, a little off
    conv.base_kernel = conv.base_kernel + mx.array(np.eye(2, 1)[:, :, None] * 0.05, mx.float32)
    got = np.array(drafter(x, mx.array(feats)[None], drafter.make_cache())[0])
    assert not np.allclose(got, want, rtol=1e-4, atol=1e-4)
