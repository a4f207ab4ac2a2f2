"""The drafter's forward over many blocks of one sequence at once (training and evaluation).

Inference drafts one block after the context (`Drafter.__call__` with its context cache).
Training packs A blocks of each of N sequences: the context features of a sequence go through
`fc` + `hidden_norm` and each layer's k/v projections ONCE, and every block row attends to
[the context rows before its anchor ; its own block's rows] (see `masks.py`). The layers'
weights and the convolution code are the drafter's own, so a packed row equals the row the
inference path computes for the same anchor (tested).

Shapes: N sequences, S context rows, A blocks per sequence, B block rows, H hidden,
F = len(target_layer_ids) * H.
"""

from __future__ import annotations

import mlx.core as mx

from ..model.drafter import DecoderLayer, Drafter
from . import host_exp

NEG = -1e9


def rope_tables(positions: mx.array, dims: int, base: float) -> tuple[mx.array, mx.array]:
    """positions [...] -> cos, sin [..., dims/2] of RoPE (non-traditional, `nn.RoPE` layout)."""
    freqs = base ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    angles = positions.astype(mx.float32)[..., None] * freqs
    return mx.cos(angles), mx.sin(angles)


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x [..., d] with cos/sin broadcastable to [..., d/2]: rotate the two halves."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def packed_attention(attn, x: mx.array, ctx: mx.array, anchors: mx.array, ctx_visible: mx.array,
                     block_visible: mx.array, base: float) -> mx.array:
    """One drafter attention over packed blocks.

    attn: the drafter layer's `Attention`; x [N, A, B, H] normed block rows; ctx [N, S, H]
    context rows (after fc + hidden_norm); anchors [N, A] positions; ctx_visible [N, A*B, S]
    and block_visible [B, B] bool -> [N, A, B, H].
    """
    N, A, B, H = x.shape
    S = ctx.shape[1]
    nh, nkv = attn.n_heads, attn.n_kv_heads
    rep = nh // nkv
    q = attn.q_norm(attn.q_proj(x).reshape(N, A, B, nh, -1))
    kb = attn.k_norm(attn.k_proj(x).reshape(N, A, B, nkv, -1))
    vb = attn.v_proj(x).reshape(N, A, B, nkv, -1)
    kc = attn.k_norm(attn.k_proj(ctx).reshape(N, S, nkv, -1))
    vc = attn.v_proj(ctx).reshape(N, S, nkv, -1)
    d = q.shape[-1]
    pos = anchors[:, :, None] + mx.arange(B)                              # [N, A, B]
    cos, sin = rope_tables(pos, d, base)
    q = apply_rope(q, cos[:, :, :, None], sin[:, :, :, None])
    kb = apply_rope(kb, cos[:, :, :, None], sin[:, :, :, None])
    cos_c, sin_c = rope_tables(mx.arange(S), d, base)
    kc = apply_rope(kc, cos_c[:, None], sin_c[:, None])

    # q -> [N, nkv, rep, A, B, d]; keys/values -> [N, nkv, 1, ...]
    q = q.reshape(N, A, B, nkv, rep, d).transpose(0, 3, 4, 1, 2, 5) * attn.scale
    kb = kb.transpose(0, 3, 1, 2, 4)[:, :, None]                          # [N, nkv, 1, A, B, d]
    vb = vb.transpose(0, 3, 1, 2, 4)[:, :, None]
    kc = kc.transpose(0, 2, 1, 3)[:, :, None]                             # [N, nkv, 1, S, d]
    vc = vc.transpose(0, 2, 1, 3)[:, :, None]

    s_ctx = (q.reshape(N, nkv, rep, A * B, d) @ kc.swapaxes(-1, -2))     # [N, nkv, rep, AB, S]
    s_ctx = mx.where(ctx_visible[:, None, None], s_ctx, NEG).reshape(N, nkv, rep, A, B, S)
    s_blk = q @ kb.swapaxes(-1, -2)                                       # [N, nkv, rep, A, B, B]
    s_blk = mx.where(block_visible, s_blk, NEG)
    p = host_exp.softmax(mx.concatenate([s_ctx, s_blk], axis=-1))
    p_ctx, p_blk = p[..., :S], p[..., S:]
    out = (p_ctx.reshape(N, nkv, rep, A * B, S) @ vc).reshape(N, nkv, rep, A, B, d)
    out = out + p_blk @ vb
    out = out.transpose(0, 3, 4, 1, 2, 5).reshape(N, A, B, nh * d)
    return attn.o_proj(out)


def packed_hidden(drafter: Drafter, x: mx.array, feats: mx.array, anchors: mx.array,
                  ctx_visible: dict, block_visible: mx.array) -> mx.array:
    """x [N, A, B, H] embedded blocks, feats [N, S, F] target features, anchors [N, A],
    ctx_visible {window (None for full attention): bool [N, A*B, S]}, block_visible [B, B]
    -> final-normed hidden states [N, A, B, H]."""
    args = drafter.args
    if args.rope_scaling:
        raise NotImplementedError("training with rope_scaling is not supported; use plain RoPE")
    N, A, B, H = x.shape
    ctx = drafter.hidden_norm(drafter.fc(feats))
    h = x.reshape(N * A, B, H)
    for layer in drafter.layers:
        attn = layer.self_attn
        visible = ctx_visible[attn.window]

        def sublayer(y, attn=attn, visible=visible):
            out = packed_attention(attn, y.reshape(N, A, B, H), ctx, anchors, visible,
                                   block_visible, args.rope_theta)
            return out.reshape(N * A, B, H)

        def mlp(y, m=layer.mlp):            # the drafter's MLP, its SiLU through host_exp
            return m.down_proj(host_exp.swiglu(m.gate_proj(y), m.up_proj(y))[0])

        if layer.has_conv:
            h = DecoderLayer._conv_sublayer(h, layer.input_layernorm, layer.attention_conv,
                                            sublayer)
            h = DecoderLayer._conv_sublayer(h, layer.post_attention_layernorm, layer.mlp_conv,
                                            mlp)
        else:
            h = h + sublayer(layer.input_layernorm(h))
            h = h + mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h).reshape(N, A, B, H)
