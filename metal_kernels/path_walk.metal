// The candidate path walk of the DFlash 2 selector over a precomputed pair lattice. Built by
// metal_kernels/metal.py (`path_walk_metal`), which computes the lattice with
// `kernels.pair_lattice` (one batched matmul) and launches this kernel once for all batch rows.
// File convention: see short_conv.metal.
//
//   inputs    cand [B, L, K] (uint32 or int32), first [B, K] = S_0(anchor, .),
//             lattice [B, L-1, K, K] = S_t(cand_{t-1}[a], cand_t[c]) (a [1, 1, 1, 1] dummy when
//             L == 1), temperature (scalar float32), uniforms [B, L] float32 (a [1] dummy when
//             greedy); any dtypes, any strides
//   outputs   ids [B, L] int32, q [B, L, K] float32 (a [1] dummy when greedy)
//   template  K (candidates), J = ceil(K / 32) (candidates per lane), CHUNK (lattice rows staged
//             at a time, CHUNK * K * K floats of threadgroup memory), SAMPLE (int 0 | 1)
//   grid      (32, B, 1) threads, threadgroup (32, 1, 1): one SIMD group per batch row
//
// Lane l owns candidates [l * J, l * J + J). Every step reads one row of K scores (selected by
// the previous choice) and reduces across lanes with simd_max / simd_min / simd_sum /
// simd_prefix_exclusive_sum; all 32 lanes run the same control flow, lanes without a candidate
// hold -inf, so no reduction ever runs under divergence. The walk is sequential, so its latency
// matters more than its arithmetic: the lattice rows are first staged into threadgroup memory
// with independent coalesced loads, and the dependent read of each step then hits threadgroup
// memory instead of device memory.
//
// Greedy: the first maximum, like mx.argmax. Sampling: q = softmax(S / T) in float32 and the
// inverse CDF of the uniform, index = #{i : cdf_i <= u} clamped to K - 1 (P(index = i) = q_i),
// exactly the contract of kernels.path_walk_ops.

// Greedy pick among the candidates of all lanes: the first maximum.
template <int J>
inline int dflash2_first_argmax(thread const float* s, uint lane, int K) {
  float best = -INFINITY;
  int index = K;  // K: this lane holds no candidate
  for (int j = 0; j < J; ++j) {
    const int c = int(lane) * J + j;
    if (c < K && (index == K || s[j] > best)) {
      best = s[j];
      index = c;
    }
  }
  const float top = simd_max(best);
  return simd_min(best == top ? index : K);
}

// Sampling pick: turns the scores s into q in place (0 outside the candidates), returns the
// index drawn by the inverse CDF of u.
template <int J>
inline int dflash2_sample(thread float* s, uint lane, int K, float temperature, float u) {
  float top = -INFINITY;
  for (int j = 0; j < J; ++j) {
    if (int(lane) * J + j < K) {
      s[j] = s[j] / temperature;
      top = metal::max(top, s[j]);
    }
  }
  top = simd_max(top);
  float lane_total = 0.0f;
  for (int j = 0; j < J; ++j) {
    s[j] = int(lane) * J + j < K ? metal::exp(s[j] - top) : 0.0f;
    lane_total += s[j];
  }
  const float total = simd_sum(lane_total);
  float lane_q = 0.0f;
  for (int j = 0; j < J; ++j) {
    s[j] = s[j] / total;
    lane_q += s[j];
  }
  float cdf = simd_prefix_exclusive_sum(lane_q);
  int below = 0;
  for (int j = 0; j < J; ++j) {
    if (int(lane) * J + j < K) {
      cdf += s[j];
      below += cdf <= u ? 1 : 0;
    }
  }
  return metal::min(simd_sum(below), K - 1);
}

// ---- kernel body ----
const uint b = threadgroup_position_in_grid.y;
const uint lane = thread_index_in_simdgroup;
const int L = cand_shape[1];
threadgroup float tile[CHUNK * K * K];
float s[J];
int index = 0;  // the previous row's choice (row 0's predecessor is the anchor)
for (int t = 0; t < L; ++t) {
  const int row = (t - 1) % CHUNK;
  if (t > 0 && row == 0) {
    // Stage lattice rows t-1 .. t-2+CHUNK (independent of the choices).
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int n = metal::min(CHUNK, L - t) * K * K;
    for (int i = int(lane); i < n; i += 32) {
      const int r = i / (K * K);
      const int a = (i / K) % K;
      const int c = i % K;
      tile[i] = float(lattice[b * lattice_strides[0] + (t - 1 + r) * lattice_strides[1] +
                              a * lattice_strides[2] + c * lattice_strides[3]]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (int j = 0; j < J; ++j) {
    const int c = int(lane) * J + j;
    s[j] = c >= K   ? -INFINITY
           : t == 0 ? float(first[b * first_strides[0] + c * first_strides[1]])
                    : tile[(row * K + index) * K + c];
  }
  if (SAMPLE) {
    index = dflash2_sample<J>(s, lane, K, temperature,
                              uniforms[b * uniforms_strides[0] + t * uniforms_strides[1]]);
    for (int j = 0; j < J; ++j) {
      const int c = int(lane) * J + j;
      if (c < K) {
        q[(int64_t(b) * L + t) * K + c] = s[j];
      }
    }
  } else {
    index = dflash2_first_argmax<J>(s, lane, K);
  }
  if (lane == 0) {
    ids[int64_t(b) * L + t] =
        int(cand[b * cand_strides[0] + t * cand_strides[1] + index * cand_strides[2]]);
  }
}
