"""The DFlash / DFlash 2 / DSpark block drafter: context-injected attention over the target's
hidden states; DFlash 2 adds a dynamic short convolution and a candidate selector; DSpark a
Markov head (a low-rank bigram bias on each position's logits, from the token before it) and a
confidence head (whether each position's draft will be accepted).

A DFlash drafter has no embedding or output head of its own: it embeds the block with the
target's `embed_tokens` and scores with the target's head; a DSpark drafter may ship either.
Context features of the target go through `fc` + `hidden_norm` and are injected as extra
keys/values in every layer; they are cached (context rows only) and grow by the accepted rows
of each cycle.

One pass drafts for n sequences at once (`Drafter.propose_batch`), each with its own context
cache, width, sampling and key; `propose` is that pass for one (layout: docs/batching.md).

Shapes: B batch, n sequences of a pass, L block rows, S new context rows, H hidden,
F = len(target_layer_ids) * H.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.rope_utils import initialize_rope

from .config import DrafterArgs
from .dspark_heads import ConfidenceHead, MarkovHead
from .kernels import KernelPath, short_conv
from .sampling import Sampling
from .selector import CandidateSelector
from .target import Target


class ContextCache:
    """Keys/values of the context rows of one drafter layer, in temporal order.

    Pre-allocated in steps (like mlx-lm's KVCache) so a cycle appends without copying the whole
    context. With a `window`, rows a block can no longer see are dropped, keeping memory bounded.
    `offset` is the absolute position after the last context row; `start` that of the first kept.
    """

    step = 256

    def __init__(self, window: int | None = None):
        self.window = window
        self.keys = self.values = None
        self.start = self.offset = 0

    @property
    def size(self) -> int:
        return self.offset - self.start

    def _ensure(self, keys: mx.array, values: mx.array, extra: int) -> None:
        need = self.size + extra
        if self.keys is not None and need <= self.keys.shape[2]:
            return
        if self.window is not None and self.keys is not None and self.size > self.window:
            drop = self.size - (self.window - 1)   # older rows are invisible to every query
            self.keys = self.keys[..., drop : self.size, :]
            self.values = self.values[..., drop : self.size, :]
            self.start += drop
            need = self.size + extra
        B, n_kv, _, d = keys.shape
        cap = ((need + self.step - 1) // self.step) * self.step
        new_k = mx.zeros((B, n_kv, cap, d), keys.dtype)
        new_v = mx.zeros((B, n_kv, cap, values.shape[3]), values.dtype)
        if self.keys is not None and self.size:
            new_k[..., : self.size, :] = self.keys[..., : self.size, :]
            new_v[..., : self.size, :] = self.values[..., : self.size, :]
        self.keys, self.values = new_k, new_v

    def append(self, keys: mx.array, values: mx.array) -> None:
        """keys/values [B, n_kv, S, D] at positions offset..offset+S-1."""
        S = keys.shape[2]
        self._ensure(keys, values, S)
        self.keys[..., self.size : self.size + S, :] = keys
        self.values[..., self.size : self.size + S, :] = values
        self.offset += S

    def with_block(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Context keys followed by the block's (written after the context, not kept)."""
        L = keys.shape[2]
        self._ensure(keys, values, L)
        self.keys[..., self.size : self.size + L, :] = keys
        self.values[..., self.size : self.size + L, :] = values
        return self.keys[..., : self.size + L, :], self.values[..., : self.size + L, :]

    @property
    def state(self):
        return self.keys, self.values


@dataclass
class Context:
    """The new context rows of a pass's sequences after `fc` + `hidden_norm`, concatenated:
    rows [1, S_1 + ... + S_n, H] (None when no sequence has any); sequence b's are
    rows[:, spans[b][0] : spans[b][1]]."""

    rows: mx.array | None
    spans: list[tuple[int, int]]


class Attention(nn.Module):
    def __init__(self, args: DrafterArgs, sliding: bool):
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.gemma, self.k_eq_v = args.backbone == "gemma4", args.k_eq_v
        self.scale = 1.0 if self.gemma else d**-0.5
        self.window = args.sliding_window if sliding else None
        self.causal = args.is_causal
        bias = args.attention_bias
        self.gated = args.gated_q            # q_proj emits [q | gate] per head
        self.q_proj = nn.Linear(h, self.n_heads * d * (2 if self.gated else 1), bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * d, bias=bias)
        if not self.k_eq_v:
            self.v_proj = nn.Linear(h, self.n_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.q_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        if args.attention_sinks:        # a learned logit per head: attention mass sent nowhere
            self.attention_sink_bias = mx.zeros((self.n_heads,))
        self.rope = initialize_rope(args.rope_dims or d, args.rope_theta, args.rope_traditional,
                                    args.rope_scaling, args.max_position_embeddings)

    def _kv(self, x: mx.array):
        """x [B, S, H] -> keys [B, n_kv, S, D] (normed, not yet roped), values."""
        B, S, _ = x.shape
        raw = self.k_proj(x).reshape(B, S, self.n_kv_heads, -1)
        k = self.k_norm(raw).transpose(0, 2, 1, 3)
        v = raw if self.k_eq_v else self.v_proj(x).reshape(B, S, self.n_kv_heads, -1)
        if self.gemma:                                  # Gemma's unscaled v norm
            v = mx.fast.rms_norm(v, None, self.q_norm.eps)
        return k, v.transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, ctx: Context, caches: list[ContextCache],
                 lengths: list[int]) -> mx.array:
        """x [n, L, H] block rows of n sequences (sequence b's first lengths[b], then
        padding), ctx their new context rows, caches[b] sequence b's -> [n, L, H].

        Projections run once for all; attention per sequence, against its own cache, with
        only its own block rows as keys (padding rows are queries whose output is discarded,
        never keys: the block attention is bidirectional)."""
        n, L, _ = x.shape
        if ctx.rows is not None:
            k, v = self._kv(ctx.rows)
            for c, (a, b) in zip(caches, ctx.spans):
                if b > a:
                    c.append(self.rope(k[..., a:b, :], offset=c.offset), v[..., a:b, :])
        q = self.q_proj(x).reshape(n, L, self.n_heads, -1)
        if self.gated:
            q, gate = mx.split(q, 2, axis=-1)                # the gate is not normed
        q = self.q_norm(q).transpose(0, 2, 1, 3)
        k, v = self._kv(x)
        sinks = getattr(self, "attention_sink_bias", None)
        outs = []
        for i, (c, l) in enumerate(zip(caches, lengths)):
            pos = c.offset                  # block row 0 (the anchor) sits right after the context
            keys, values = c.with_block(self.rope(k[i : i + 1, :, :l], offset=pos),
                                        v[i : i + 1, :, :l])
            outs.append(mx.fast.scaled_dot_product_attention(
                self.rope(q[i : i + 1], offset=pos), keys, values, scale=self.scale,
                mask=self._mask(c, L, l), sinks=sinks))
        out = outs[0] if n == 1 else mx.concatenate(outs)
        out = out.transpose(0, 2, 1, 3).reshape(n, L, -1)
        if self.gated:
            out = out * mx.sigmoid(gate.reshape(n, L, -1))
        return self.o_proj(out)

    def _mask(self, cache: ContextCache, L: int, block: int) -> mx.array | None:
        """[L queries, context + `block` keys]: what each block row sees."""
        if self.window is None and not self.causal:
            return None                     # every block row sees everything
        q_pos = cache.offset + mx.arange(L)[:, None]
        k_pos = mx.concatenate([mx.arange(cache.start, cache.offset),
                                cache.offset + mx.arange(block)])[None]
        is_ctx = k_pos < cache.offset
        visible = mx.ones((L, k_pos.shape[1]), dtype=mx.bool_)
        if self.window is not None:
            visible = visible & (~is_ctx | (q_pos - k_pos < self.window))
        if self.causal:
            visible = visible & (is_ctx | (k_pos <= q_pos))
        return visible


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, gelu: bool = False):
        super().__init__()
        self.gelu = gelu                               # Gemma's tanh-GELU gate, else SwiGLU
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x):
        if self.gelu:
            return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DynamicConv(nn.Module):
    """Two-tap grouped dynamic convolution around one sublayer (`GroupedDynamicCausalConv`).

    Both sides take their dynamic taps from the normed sublayer input u:
    dyn = kernel_projection(u) -> [B, L, 2 sides, K taps, H/G groups].
    """

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.groups = kernel_size, hidden // group_size
        self.path: KernelPath = "ops"        # set for the whole drafter by `Drafter.kernels`
        self.base_kernel = mx.zeros((2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)

    def taps(self, u: mx.array) -> mx.array:
        B, L, _ = u.shape
        return self.kernel_projection(u).reshape(B, L, 2, self.kernel_size, self.groups)


class DecoderLayer(nn.Module):
    def __init__(self, args: DrafterArgs, index: int):
        super().__init__()
        h = args.hidden_size
        self.self_attn = Attention(args, args.layer_types[index] == "sliding_attention")
        self.gemma = args.backbone == "gemma4"
        self.mlp = MLP(h, args.intermediate_size, gelu=self.gemma)
        self.input_layernorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        if self.gemma:                     # sandwich norms around both sublayers, scaled
            self.pre_feedforward_layernorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
            self.post_feedforward_layernorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
            self.layer_scalar = mx.ones((1,))
        if args.has_conv:
            self.attention_conv = DynamicConv(h, args.conv_kernel_size, args.conv_group_size)
            self.mlp_conv = DynamicConv(h, args.conv_kernel_size, args.conv_group_size)
        self.has_conv = args.has_conv

    def __call__(self, x, ctx: Context, caches: list[ContextCache], lengths: list[int]):
        attn = lambda y: self.self_attn(y, ctx, caches, lengths)
        if self.gemma:
            x = x + self.post_attention_layernorm(attn(self.input_layernorm(x)))
            x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
            return x * self.layer_scalar
        if not self.has_conv:
            x = x + attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))
        x = self._conv_sublayer(x, self.input_layernorm, self.attention_conv, attn)
        return self._conv_sublayer(x, self.post_attention_layernorm, self.mlp_conv, self.mlp)

    @staticmethod
    def _conv_sublayer(x, norm, conv: DynamicConv, sublayer):
        """x + conv_1(sublayer(conv_0(norm(x)))), both sides' taps computed from norm(x)."""
        u = norm(x)
        dyn = conv.taps(u)
        y = short_conv(u, dyn[:, :, 0], conv.base_kernel[0], path=conv.path)
        return short_conv(sublayer(y), dyn[:, :, 1], conv.base_kernel[1], residual=x,
                          path=conv.path)


@dataclass
class Proposal:
    """One drafted block: tokens [B, L-1]; for sampling, the distribution each was drawn from,
    either dense `q` [B, L-1, V] or sparse `q` [B, L-1, K] over `q_ids` [B, L-1, K];
    `confidence` [B, L-1]: a confidence head's probability that each position is accepted
    given the ones before it (None: the drafter has no such head); `sureness` [B, L-1, 2]: how
    sure the block's own distribution at each position is (`sureness`), what an acceptance
    predictor reads where there is no head."""

    tokens: mx.array
    q: mx.array | None = None
    q_ids: mx.array | None = None
    confidence: mx.array | None = None
    sureness: mx.array | None = None

    def first(self, n: int) -> "Proposal":
        """The first n drafts only (a verify cut short: `Engine._cut`)."""
        cut = lambda a: None if a is None else a[:, :n]
        return Proposal(cut(self.tokens), cut(self.q), cut(self.q_ids), cut(self.confidence),
                        cut(self.sureness))

    def dense_q(self, vocab: int) -> mx.array:
        """q as [B, L-1, V], zero outside the candidates."""
        if self.q_ids is None:
            return self.q
        zeros = mx.zeros((*self.q.shape[:-1], vocab), mx.float32)
        return mx.put_along_axis(zeros, self.q_ids, self.q, axis=-1)


class DraftVocab:
    """A drafter's own output vocabulary: the token ids its head scores (sorted, uint32).

    Not part of the published format: an optional `draft_vocab.json` beside the weights, for
    drafters trained with their softmax restricted to the ids their data needs. Proposing only
    from it keeps inference consistent with training and makes the head len(ids)/V as costly.
    """

    def __init__(self, ids):
        self.ids = mx.array(ids, dtype=mx.uint32)


class Draft(NamedTuple):
    """One sequence's block to draft in a pass: after `anchor` [1, 1], given `feats`
    [1, S, F] (the target features of its rows committed since its last pass, or None), its
    context `cache`, `width`, `sampling` and random `key`."""

    anchor: mx.array
    feats: mx.array | None
    cache: list[ContextCache]
    width: int
    sampling: Sampling
    key: mx.array


class Drafter(nn.Module):
    """A DFlash (selector/conv absent), DFlash 2 or DSpark drafter."""

    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.args = args
        H, V = args.hidden_size, args.vocab_size
        out = args.draft_vocab_size or V        # a reduced draft vocabulary: its head's rows
        if args.own_embed:
            self.embed_tokens = nn.Embedding(V, H)
        self.fc = nn.Linear(len(args.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        if args.own_head:
            self.lm_head = nn.Linear(H, out, bias=False)
        if args.markov_rank:
            self.markov_head = MarkovHead(V, args.markov_rank, out)
        if args.confidence_head:
            self.confidence_head = ConfidenceHead(
                H + (args.markov_rank if args.confidence_with_markov else 0))
        if args.has_selector:
            self.candidate_selector = CandidateSelector(args)
        self._kernel_path: KernelPath = "ops"
        self.draft_vocab: DraftVocab | None = None

    @property
    def kernels(self) -> KernelPath:
        """The kernel path ("metal" | "ops") of every convolution and of the selector walk."""
        return self._kernel_path

    @kernels.setter
    def kernels(self, path: KernelPath) -> None:
        self._kernel_path = path
        for module in self._kernel_users():     # held where it is used: nothing threads it
            module.path = path

    def _kernel_users(self) -> list[nn.Module]:
        return [m for _, m in self.named_modules()
                if isinstance(m, (DynamicConv, CandidateSelector))]

    def make_cache(self) -> list[ContextCache]:
        return [ContextCache(l.self_attn.window) for l in self.layers]

    @property
    def has_confidence(self) -> bool:
        """Whether its proposals carry `confidence` (a DSpark confidence head)."""
        return self.args.confidence_head

    @property
    def context_window(self) -> int | None:
        """How many trailing context rows a block can see at most (None: all of them)."""
        return self.args.sliding_window - 1 if self.args.sliding_only else None

    @staticmethod
    def skip_context(cache: list[ContextCache], n: int) -> None:
        """Start the context at position n (features of rows < n were never computed)."""
        for c in cache:
            c.start = c.offset = c.offset + n

    def __call__(self, x: mx.array, feats: mx.array | None, cache: list[ContextCache]):
        """One sequence: x [1, L, H] embedded block, feats [1, S, F] new target features (or
        None) -> final-normed hidden states [1, L, H]."""
        return self.blocks(x, [feats], [cache], [x.shape[1]])

    def blocks(self, x: mx.array, feats: list[mx.array | None],
               caches: list[list[ContextCache]], lengths: list[int]) -> mx.array:
        """n sequences' blocks in one pass: x [n, L, H], sequence b's block in its first
        lengths[b] rows (the rest padding), feats[b] [1, S_b, F] or None, caches[b] its
        context cache -> final-normed hidden states [n, L, H] (padding rows: garbage)."""
        spans, start = [], 0
        for f in feats:
            end = start + (0 if f is None else f.shape[1])
            spans.append((start, end))
            start = end
        new = [f for f in feats if f is not None and f.shape[1]]
        rows = None if not new else self.hidden_norm(self.fc(
            new[0] if len(new) == 1 else mx.concatenate(new, axis=1)))
        ctx = Context(rows, spans)
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, [c[i] for c in caches], lengths)
        return self.norm(x)

    def logits(self, h: mx.array, head) -> mx.array:
        """Apply the target's head, then the output multiplier and the soft cap."""
        logits = head(h)
        if self.args.output_multiplier != 1.0:
            logits = logits * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def propose(self, target: Target, anchor: mx.array, feats: mx.array | None,
                cache: list[ContextCache], width: int, sampling: Sampling,
                key: mx.array) -> Proposal:
        """Draft width-1 tokens after `anchor` [1, 1] in one pass (`propose_batch` of one).

        `target` supplies `embed` and `head` (the drafter has neither); feats [1, S, F] are the
        target features of the rows committed since the last call.
        """
        return self.propose_batch(target, [Draft(anchor, feats, cache, width, sampling,
                                                 key)])[0]

    def propose_batch(self, target: Target, drafts: list[Draft]) -> list[Proposal]:
        """Every sequence's block in one pass -> a Proposal per draft, each the one it gets
        alone: its own context, width, sampling and key (layout: docs/batching.md).

        DFlash blocks are [n, L = max width] rows, right-padded with mask tokens; rows and
        positions after a sequence's own never reach its earlier ones (causal conv and walk,
        padding invisible to attention). A DSpark block is always its full `block_size` rows
        (it was trained on whole blocks), its drafts read from slot `logits_start` on."""
        h, logits = self.block_logits(target, drafts)
        anchors = _anchors(drafts)
        vocab = self._vocab()
        args = self.args
        if args.has_selector:
            out = self._walk(h, logits, anchors[:, 0], drafts, vocab)
        elif args.markov_rank:
            out = self._markov(h, logits, anchors[:, 0], drafts, vocab)
        else:
            out = [self._draw(logits[i : i + 1, : d.width - 1], d, vocab,
                              self._confidence(h[i : i + 1, : d.width - 1]))
                   for i, d in enumerate(drafts)]
        sure = sureness(logits)
        for i, (p, d) in enumerate(zip(out, drafts)):
            p.sureness = sure[i : i + 1, : d.width - 1]
        return out

    def block_logits(self, target: Target, drafts: list[Draft]) -> tuple[mx.array, mx.array]:
        """The pass itself: every sequence's block rows from slot `logits_start` on, h
        [n, w-1, H] (w the widest draft), and their logits [n, w-1, V'] (the head, output
        multiplier and soft cap; no Markov bias)."""
        args = self.args
        n, width = len(drafts), max(d.width for d in drafts)
        L = args.block_size if args.is_dspark else width
        lengths = [L if args.is_dspark else d.width for d in drafts]
        anchors = _anchors(drafts)
        mask = mx.full((n, L - 1), args.mask_token_id, dtype=anchors.dtype)
        block = mx.concatenate([anchors, mask], axis=1)
        x = self.embed_tokens(block) if args.own_embed else target.embed(block)
        if args.own_embed and args.backbone == "gemma4":
            x = x * args.hidden_size**0.5
        if args.input_embedding_scale != 1.0:
            x = x * args.input_embedding_scale
        start = args.logits_start
        h = self.blocks(x, [d.feats for d in drafts], [d.cache for d in drafts],
                        lengths)[:, start : start + width - 1]              # [n, w-1, H]
        vocab = self._vocab()
        head = (self.lm_head if args.own_head else
                target.head if vocab is None else target.head_rows(vocab))
        return h, self.logits(h, head)                                 # [n, w-1, V']

    def _vocab(self) -> mx.array | None:
        """The target ids of the head's rows where it scores a draft vocabulary only
        (`DraftVocab`: a trained `draft_vocab.json`, or a DSpark head's `d2t`)."""
        return None if self.draft_vocab is None else self.draft_vocab.ids

    def _markov(self, h, logits, anchors, drafts: list[Draft], vocab) -> list[Proposal]:
        """Drafts position by position: each position's logits get the Markov head's bias
        from the token before it (the anchor, then the token just drafted), and that token is
        drawn from them; greedy rows in one argmax per position, sampled ones each from its
        own distribution with its own key (split per position, the same alone or batched).
        The corrected distributions are the q rejection sampling reads. `vocab` maps the
        columns of a draft vocabulary to target ids, before a token is fed back."""
        to_ids = (lambda i: i) if vocab is None else (lambda i: vocab[i])
        P = logits.shape[1]
        keys = [None if d.sampling.greedy else mx.random.split(d.key, d.width - 1)
                for d in drafts]
        prev, tokens, qs = anchors, [], []                   # prev [n]: target ids
        for i in range(P):
            step = logits[:, i] + self.markov_head(prev)                 # [n, V']
            picked, q = [], []
            for b, d in enumerate(drafts):
                if d.sampling.greedy or i >= d.width - 1:
                    picked.append(None)
                    q.append(None)
                    continue
                q.append(d.sampling.probs(step[b : b + 1]))              # [1, V']
                picked.append(mx.random.categorical(mx.log(q[-1]), key=keys[b][i]))
            greedy = mx.argmax(step, axis=-1)
            if all(p is None for p in picked):
                column = greedy
            else:
                column = mx.concatenate([greedy[b : b + 1] if p is None else
                                         p.astype(greedy.dtype) for b, p in enumerate(picked)])
            nxt = to_ids(column)
            tokens.append(nxt)
            qs.append(q)
            prev = nxt
        tokens = mx.stack(tokens, axis=1)                                # [n, P]
        before = mx.concatenate([anchors[:, None].astype(tokens.dtype), tokens[:, :-1]], axis=1)
        confidence = self._confidence(h, before)
        out = []
        for b, d in enumerate(drafts):
            w = d.width - 1
            q = None if d.sampling.greedy else mx.stack([qs[i][b][0] for i in range(w)])[None]
            q_ids = None if q is None or vocab is None else mx.broadcast_to(vocab, q.shape)
            out.append(Proposal(tokens[b : b + 1, :w], q, q_ids,
                                None if confidence is None else confidence[b : b + 1, :w]))
        return out

    def _confidence(self, h: mx.array, before: mx.array | None = None) -> mx.array | None:
        """The confidence head on rows h [n, P, H], `before` [n, P] the token before each
        (read where the head takes the Markov embedding) -> [n, P], or None without a head."""
        if not self.args.confidence_head:
            return None
        if self.args.confidence_with_markov:
            h = mx.concatenate([h, self.markov_head.markov_w1(before).astype(h.dtype)], axis=-1)
        return self.confidence_head(h)

    def _walk(self, h, logits, anchors, drafts: list[Draft], vocab) -> list[Proposal]:
        """The selector walk of every sequence: one walk per temperature among them (the
        walk takes one), each over the rows of its sequences."""
        inputs = self.candidate_selector.walk_inputs(h, logits, anchors, vocab)
        groups: dict[float, list[int]] = {}
        for i, d in enumerate(drafts):
            groups.setdefault(d.sampling.temperature, []).append(i)
        out: list[Proposal | None] = [None] * len(drafts)
        for temperature, index in groups.items():
            part = inputs if len(index) == len(drafts) else inputs.rows(mx.array(index))
            uniforms = None if temperature == 0 else \
                _uniforms([drafts[i] for i in index], h.shape[1])
            ids, cand, q = part.walk(temperature, uniforms)
            for j, i in enumerate(index):
                w = drafts[i].width - 1
                out[i] = Proposal(ids[j : j + 1, :w], None if q is None else q[j : j + 1, :w],
                                  None if q is None else cand[j : j + 1, :w])
        confidence = self._confidence(h)
        if confidence is not None:
            for i, d in enumerate(drafts):
                out[i].confidence = confidence[i : i + 1, : d.width - 1]
        return out

    @staticmethod
    def _draw(logits: mx.array, d: Draft, vocab: mx.array | None,
              confidence: mx.array | None = None) -> Proposal:
        """One sequence's drafts from its logits [1, w-1, V'] (no selector, no Markov head)."""
        to_ids = (lambda i: i) if vocab is None else (lambda i: vocab[i])
        if d.sampling.greedy:
            return Proposal(to_ids(mx.argmax(logits, axis=-1)), confidence=confidence)
        q = d.sampling.probs(logits)
        q_ids = None if vocab is None else mx.broadcast_to(vocab, q.shape)
        return Proposal(to_ids(mx.random.categorical(mx.log(q), key=d.key)), q, q_ids,
                        confidence)


def sureness(logits: mx.array) -> mx.array:
    """[n, P, V'] block logits (before any Markov bias or path walk) -> [n, P, 2]: each
    position's top log-probability and its margin over the second. Read before any token is
    drawn, so a verify width chosen from them keeps rejection sampling exact (docs/decisions.md:
    "Widths chosen after drafting")."""
    logits = logits.astype(mx.float32)
    top2 = mx.topk(logits, 2, axis=-1)                                   # [n, P, 2]
    first, second = mx.max(top2, axis=-1), mx.min(top2, axis=-1)
    lse = mx.logsumexp(logits, axis=-1)
    return mx.stack([first - lse, first - second], axis=-1)


def _anchors(drafts: list[Draft]) -> mx.array:
    """The pass's anchors [n, 1]."""
    return drafts[0].anchor if len(drafts) == 1 else mx.concatenate([d.anchor for d in drafts])


def _uniforms(drafts: list[Draft], L: int) -> mx.array:
    """[m, L] walk uniforms: each sequence's from its own key with its own shape [1, w-1]
    (as alone), right-padded."""
    rows = []
    for d in drafts:
        u = mx.random.uniform(shape=(1, d.width - 1), key=d.key)
        rows.append(u if d.width - 1 == L else mx.pad(u, [(0, 0), (0, L - d.width + 1)]))
    return rows[0] if len(rows) == 1 else mx.concatenate(rows)
