// The small-M quantized matmul of a verify: y = x @ dequantize(w).T for x of 1-16 rows against
// MLX's affine-quantized weights, each weight group read once for all rows. Built by
// metal_kernels/metal.py (`small_m_qmm_metal`). File convention: see short_conv.metal.
//
//   inputs    x [M, K] (M <= 16), w [N, K * BITS / 32] uint32, scales and biases [N, K / group]
//             (mx.quantize's layout: value j of a word in bits [j * BITS, (j + 1) * BITS),
//             w = scale * q + bias per group); row-contiguous
//   output    y [M, N], dtype T
//   template  T (output dtype), BITS (4 | 8), SIMDS (SIMD groups per threadgroup)
//   grid      (32 * SIMDS, ceil(N / (4 * SIMDS)), 1), threadgroup (32 * SIMDS, 1, 1)
//
// A SIMD group owns 4 output features; lane l takes 8 consecutive values of each 256-wide
// block of K (k0 = block + 8 l, inside one group since groups are multiples of 8), unpacks the
// 4 weight rows there once and applies them to every row of x:
//   acc[m][r] += scale * sum_j x[m, k0 + j] q_j + bias * sum_j x[m, k0 + j]
// then one simd_sum per (m, r). Row m's arithmetic is the same whatever M is (M is a runtime
// bound, one instantiation serves 1..16 rows), so the kernel is row-invariant.

// ---- kernel body ----
constexpr int VPT = 8;                       // K values per lane per block
constexpr int BK = 32 * VPT;
constexpr int NR = 4;                        // output features per SIMD group
constexpr int MAXM = 16;
constexpr int PER_WORD = 32 / BITS;
constexpr uint MASK = (1u << BITS) - 1u;
const uint lane = thread_index_in_simdgroup;
const int M = x_shape[0], K = x_shape[1];
const int N = w_shape[0], words = w_shape[1], groups = scales_shape[1];
const int group_size = K / groups;
const int n0 =
    (int(threadgroup_position_in_grid.y) * SIMDS + int(simdgroup_index_in_threadgroup)) * NR;

float acc[MAXM][NR];
for (int mi = 0; mi < MAXM; ++mi) {
  for (int r = 0; r < NR; ++r) {
    acc[mi][r] = 0.0f;
  }
}
for (int kb = 0; kb < K; kb += BK) {
  const int k0 = kb + int(lane) * VPT;
  if (k0 < K) {
    float wq[NR][VPT], sc[NR], bi[NR];
    for (int r = 0; r < NR; ++r) {
      const int n = metal::min(n0 + r, N - 1);  // rows past N compute a copy, never stored
      const int gi = n * groups + k0 / group_size;
      sc[r] = float(scales[gi]);
      bi[r] = float(biases[gi]);
      for (int wi = 0; wi < VPT / PER_WORD; ++wi) {
        const uint word = w[int64_t(n) * words + k0 / PER_WORD + wi];
        for (int j = 0; j < PER_WORD; ++j) {
          wq[r][wi * PER_WORD + j] = float((word >> (j * BITS)) & MASK);
        }
      }
    }
    for (int mi = 0; mi < MAXM; ++mi) {
      if (mi < M) {
        float xv[VPT];
        float xsum = 0.0f;
        for (int j = 0; j < VPT; ++j) {
          xv[j] = float(x[int64_t(mi) * K + k0 + j]);
          xsum += xv[j];
        }
        for (int r = 0; r < NR; ++r) {
          float dot = 0.0f;
          for (int j = 0; j < VPT; ++j) {
            dot += xv[j] * wq[r][j];
          }
          acc[mi][r] += sc[r] * dot + bi[r] * xsum;
        }
      }
    }
  }
}
for (int mi = 0; mi < MAXM; ++mi) {
  if (mi < M) {
    for (int r = 0; r < NR; ++r) {
      const float total = simd_sum(acc[mi][r]);
      if (lane == 0 && n0 + r < N) {
        y[int64_t(mi) * N + n0 + r] = static_cast<T>(total);
      }
    }
  }
}
