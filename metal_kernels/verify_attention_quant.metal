// Pass 1 of the multi-row verify attention over mlx-lm's quantized KV cache (QuantizedKVCache):
// verify_attention.metal with its K/V staging replaced by a dequantizing one. Built by
// metal_kernels/metal.py (`verify_attention_quant_metal`), whose kernel source is this body
// followed by verify_attention.metal's; pass 2 is verify_attention_merge.metal as for the float
// cache. File convention: see short_conv.metal.
//
//   inputs    q [B, Hq, T, D]; keys as mx.quantize leaves them for [B, Hkv, N, D]: k
//             [B, Hkv, N, D * BITS / 32] uint32 (value j of a word in bits [j * BITS,
//             (j + 1) * BITS)), k_scales and k_biases [B, Hkv, N, D / group] (x = scale * q +
//             bias); values likewise (v, v_scales, v_biases, same group size); any strides
//             (the cache's [..., :offset, :] views are read in place); kpos, sinks (a [1]
//             dummy: mlx-lm's quantized attention has none), params and scale as in
//             verify_attention (kpos: the ragged rows' slot positions)
//   outputs   o_part, ml_part as in verify_attention.metal
//   template  T, D, SIMDS, RPS as in verify_attention.metal; BITS (4 | 8)
//   grid      as in verify_attention.metal
//
// Staging: one thread per packed word of the chunk (DC / PER_WORD words a key): it reads the
// word, its group's scale and bias once and writes the PER_WORD dequantized floats into
// kv_tile; every row then reads the tile as in the float kernel, so each K/V tile is read and
// dequantized once for all rows. A word never straddles groups (groups are multiples of 32
// values, words 4 or 8). The dequantized value of a key is the same whichever rows share the
// tile, so verify_attention.metal's row-invariance argument holds unchanged.

// ---- kernel body ----
constexpr int PER_WORD = 32 / BITS;            // values per uint32 word
constexpr uint QMASK = (1u << BITS) - 1u;
const int group_size = D / k_scales_shape[3];

#define STAGE_QUANT(w, w_strides, sc, sc_strides, bi, bi_strides, kt, c)                    \
  for (int e = int(tid); e < BN * (DC / PER_WORD); e += THREADS) {                          \
    const int i = e / (DC / PER_WORD), key = (kt) + i;                                      \
    const int d0 = (c) * DC + (e % (DC / PER_WORD)) * PER_WORD;                             \
    const int gi = d0 / group_size;                                                         \
    uint word = 0u;                                                                         \
    float qscale = 0.0f, qbias = 0.0f;                                                      \
    if (key < N) {                                                                          \
      word = w[b * w_strides[0] + g * w_strides[1] + key * w_strides[2] +                   \
               (d0 / PER_WORD) * w_strides[3]];                                             \
      qscale = float(sc[b * sc_strides[0] + g * sc_strides[1] + key * sc_strides[2] +       \
                        gi * sc_strides[3]]);                                               \
      qbias = float(bi[b * bi_strides[0] + g * bi_strides[1] + key * bi_strides[2] +        \
                       gi * bi_strides[3]]);                                                \
    }                                                                                       \
    for (int j = 0; j < PER_WORD; ++j) {                                                    \
      kv_tile[i][d0 - (c) * DC + j] = qscale * float((word >> (j * BITS)) & QMASK) + qbias; \
    }                                                                                       \
  }
#define STAGE_K(kt, c) \
  STAGE_QUANT(k, k_strides, k_scales, k_scales_strides, k_biases, k_biases_strides, kt, c)
#define STAGE_V(kt, c) \
  STAGE_QUANT(v, v_strides, v_scales, v_scales_strides, v_biases, v_biases_strides, kt, c)
