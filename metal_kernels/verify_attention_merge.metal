// Pass 2 of the multi-row verify attention: merges the per-split partials of
// verify_attention.metal into the output, the attention sink (if any) included. Built by
// metal_kernels/metal.py (`verify_attention_metal`). File convention: see short_conv.metal.
//
//   inputs    o_part [B, Hq, T, S, D] float32, ml_part [B, Hq, T, S, 2] float32, sinks [Hq] (a
//             [1] dummy without sinks), params int32 [N, T, window, has_sinks, split, ragged]
//   output    out [B, Hq, T, D], dtype O
//   template  O (output dtype)
//   grid      (D, B * Hq * T, 1) threads, threadgroup (min(D, 256), 1, 1)
//
// A row merges only the splits its keys lie in, first to last, whatever T is: the order of
// pass 1 carries through (row-invariance, docs/kernels.md). A ragged row merges every split
// up to its slot's (those holding no key it sees add exact zeros).
//
//   M = max(sink, m_s ...);  out = sum_s e^(m_s - M) o_s / (e^(sink - M) + sum_s e^(m_s - M) l_s)

// ---- kernel body ----
const int d = int(thread_position_in_grid.x);
const int row = int(thread_position_in_grid.y);  // (b * Hq + h) * T + t
const int D = o_part_shape[4];
const int S = o_part_shape[3];
const int N = params[0], Tq = params[1], window = params[2], has_sinks = params[3];
const int split = params[4], ragged = params[5];
const int h = (row / Tq) % o_part_shape[1];
const int pos = N - Tq + row % Tq;
const int first = window > 0 && !ragged ? metal::max(0, pos - window + 1) : 0;
const int s_lo = first / split, s_hi = pos / split;
const float sink = has_sinks ? float(sinks[h]) : -INFINITY;
float M = sink;
for (int s = s_lo; s <= s_hi; ++s) {
  M = metal::max(M, ml_part[(int64_t(row) * S + s) * 2]);
}
float total = has_sinks ? metal::exp(sink - M) : 0.0f;
float acc = 0.0f;
for (int s = s_lo; s <= s_hi; ++s) {
  const int64_t part = int64_t(row) * S + s;
  const float w = metal::exp(ml_part[part * 2] - M);
  total += w * ml_part[part * 2 + 1];
  acc += w * o_part[part * D + d];
}
out[int64_t(row) * D + d] = static_cast<O>(acc / total);
