// Pass 1 of the multi-row verify attention: T query rows of every query head sharing a KV head
// against the KV cache, each K/V tile read once for all those rows. Built by
// metal_kernels/metal.py (`verify_attention_metal`); pass 2 (verify_attention_merge.metal)
// merges the per-split partials. File convention: see short_conv.metal.
//
//   inputs    q [B, Hq, T, D], k and v [B, Hkv, N, D] (any dtype, any strides: the cache's
//             [..., :offset, :] views are read in place), kpos int32 [B, N] (ragged rows: the
//             position of each key slot, -1 a hole; a [1] dummy otherwise), sinks [Hq] (a [1]
//             dummy without sinks), params int32 [N, T, window (0: none), has_sinks, split,
//             ragged], scale (float32)
//   outputs   o_part [B, Hq, T, S, D] float32 (unnormalised), ml_part [B, Hq, T, S, 2] float32
//             (running max and sum of the split), S = ceil(N / split)
//   template  T (dtype of q), D (head dim, a multiple of 32, <= 256), SIMDS (SIMD groups per
//             threadgroup), RPS (rows per SIMD group)
//   grid      (32 * SIMDS, ceil(G * T / (SIMDS * RPS)), B * Hkv * S) threads,
//             threadgroup (32 * SIMDS, 1, 1)
//
// Rows: the G * T pairs (query head of the group, block row) of one KV head, SIMDS * RPS per
// threadgroup, row rr of the threadgroup on SIMD group rr % SIMDS. Query row t sits at position
// N - T + t and sees keys [max(0, pos - window + 1), pos] (causal inside the verified block).
// Ragged rows (the batch engine's caches, ragged = 1): query row t of batch row b sits in slot
// N - T + t, at position P = kpos[b, N - T + t], and sees the slots up to its own whose
// position p is a key's (p >= 0: not a hole) with p <= P (and P - p < window): left padding,
// rejected drafts and other holes anywhere in the row are masked key by key.
// Keys: split s covers [s * split, (s + 1) * split); it walks tiles of 32 keys (one per lane for
// the scores), staged into threadgroup memory DC dimensions at a time, K then V.
//
// Row-invariance (docs/kernels.md): splits and tiles sit at absolute key positions, and a row
// only touches the tiles and keys of its own range, in the same order whatever T, G, N or the
// rows beside it are. So row r computes the same bits alone (T = 1 over the first pos + 1 keys)
// as among 16 rows; plain decoding through this kernel equals a verify bit for bit. Ragged rows
// walk the same tiles (every tile up to their slot) whatever the holes, and a tile with no key
// a row sees leaves it as it was (alpha 1, weights 0), so the argument holds per batch row.

// ---- kernel body ----
// Staging: chunk c (DC dimensions) of keys [kt, kt + BN) into kv_tile as float, 0 past N, read
// in place through the strides. verify_attention_quant.metal defines STAGE_K and STAGE_V before
// this body to dequantize instead; the rest of the kernel is the same.
#ifndef STAGE_K
#define STAGE_DENSE(x, x_strides, kt, c)                                                    \
  for (int e = int(tid); e < BN * DC; e += THREADS) {                                       \
    const int key = (kt) + e / DC;                                                          \
    kv_tile[e / DC][e % DC] =                                                               \
        key < N ? float(x[b * x_strides[0] + g * x_strides[1] + key * x_strides[2] +         \
                          ((c) * DC + e % DC) * x_strides[3]])                              \
                : 0.0f;                                                                     \
  }
#define STAGE_K(kt, c) STAGE_DENSE(k, k_strides, kt, c)
#define STAGE_V(kt, c) STAGE_DENSE(v, v_strides, kt, c)
#endif
constexpr int BN = 32;                         // keys per tile: one per lane
constexpr int DC = D % 64 == 0 ? 64 : 32;      // dimensions staged per chunk
constexpr int DPL = DC / 32;                   // of them, per lane
constexpr int ROWS = SIMDS * RPS;
constexpr int THREADS = 32 * SIMDS;
threadgroup float q_tile[ROWS][D];             // scaled query rows
threadgroup float kv_tile[BN][DC + 1];         // +1: lanes reading one key each hit distinct banks
threadgroup float p_tile[SIMDS][RPS][BN];      // each row's weights of the current tile

const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint tid = thread_index_in_threadgroup;
const int N = params[0], Tq = params[1], window = params[2], split = params[4];
const bool ragged = params[5] != 0;
const int Hkv = k_shape[1];
const int G = q_shape[1] / Hkv;
const int rows = G * Tq;
const int S = (N + split - 1) / split;
const int s = int(threadgroup_position_in_grid.z) % S;
const int g = (int(threadgroup_position_in_grid.z) / S) % Hkv;
const int b = int(threadgroup_position_in_grid.z) / (S * Hkv);
const int row0 = int(threadgroup_position_in_grid.y) * ROWS;
const int s0 = s * split;
const int s1 = metal::min(N, s0 + split);

for (int e = int(tid); e < ROWS * D; e += THREADS) {
  const int rr = e / D, d = e % D, row = row0 + rr;
  float x = 0.0f;
  if (row < rows) {
    const int h = g * G + row / Tq, t = row % Tq;
    x = float(q[b * q_strides[0] + h * q_strides[1] + t * q_strides[2] + d * q_strides[3]]) *
        scale;
  }
  q_tile[rr][d] = x;
}

// Each row's key range within this split, [lo, hi); empty for padding rows.
int lo[RPS], hi[RPS], qpos[RPS];
float m[RPS], l[RPS], alpha[RPS], score[RPS], o[RPS][D / 32];
for (int j = 0; j < RPS; ++j) {
  const int row = row0 + j * SIMDS + int(sg);
  const int pos = N - Tq + row % Tq;
  const int first = window > 0 && !ragged ? metal::max(0, pos - window + 1) : 0;
  lo[j] = metal::max(first, s0);
  hi[j] = row < rows ? metal::min(pos + 1, s1) : lo[j];
  qpos[j] = ragged && row < rows ? kpos[int64_t(b) * N + pos] : 0;
  m[j] = -INFINITY;
  l[j] = 0.0f;
  for (int u = 0; u < D / 32; ++u) {
    o[j][u] = 0.0f;
  }
}
// Tiles before every row's window are skipped by the whole threadgroup (the first row's
// window starts earliest; ragged rows: none skipped).
const int tg_first = window > 0 && !ragged ? metal::max(0, N - Tq - window + 1) : 0;
const int kt_start = metal::max(s0, tg_first - tg_first % BN);

for (int kt = kt_start; kt < s1; kt += BN) {
  bool active[RPS];
  for (int j = 0; j < RPS; ++j) {
    active[j] = lo[j] < hi[j] && kt < hi[j] && kt + BN > lo[j];
    score[j] = 0.0f;
  }
  // Scores: lane = key kt + lane, dot products over D in chunk order.
  for (int c = 0; c < D / DC; ++c) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    STAGE_K(kt, c);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int j = 0; j < RPS; ++j) {
      if (active[j]) {
        const int rr = j * SIMDS + int(sg);
        float acc = score[j];
        for (int d = 0; d < DC; ++d) {
          acc += q_tile[rr][c * DC + d] * kv_tile[lane][d];
        }
        score[j] = acc;
      }
    }
  }
  // Online softmax: one max and one sum across the lanes of the tile per row. A ragged row
  // may see no key of a tile (all holes): m stays -inf and alpha 1 (not exp(-inf + inf)).
  const int key = kt + int(lane);
  const int kp = ragged && key < N ? kpos[int64_t(b) * N + key] : -1;
  for (int j = 0; j < RPS; ++j) {
    if (active[j]) {
      const bool seen = key >= lo[j] && key < hi[j] &&
                        (!ragged || (kp >= 0 && kp <= qpos[j] &&
                                     (window <= 0 || qpos[j] - kp < window)));
      const float sc = seen ? score[j] : -INFINITY;
      const float m_new = metal::max(m[j], simd_max(sc));
      const float p = seen ? metal::exp(sc - m_new) : 0.0f;
      alpha[j] = m_new == -INFINITY ? 1.0f : metal::exp(m[j] - m_new);
      l[j] = l[j] * alpha[j] + simd_sum(p);
      m[j] = m_new;
      p_tile[sg][j][lane] = p;
    }
  }
  // Values: lane owns dimensions c * DC + u * 32 + lane; only the row's own keys are added.
  for (int c = 0; c < D / DC; ++c) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    STAGE_V(kt, c);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int j = 0; j < RPS; ++j) {
      if (active[j]) {
        const int i0 = metal::max(lo[j] - kt, 0), i1 = metal::min(hi[j] - kt, BN);
        for (int u = 0; u < DPL; ++u) {
          float acc = o[j][c * DPL + u] * alpha[j];
          for (int i = i0; i < i1; ++i) {
            acc += p_tile[sg][j][i] * kv_tile[i][u * 32 + int(lane)];
          }
          o[j][c * DPL + u] = acc;
        }
      }
    }
  }
}

for (int j = 0; j < RPS; ++j) {
  const int row = row0 + j * SIMDS + int(sg);
  if (row < rows) {
    const int h = g * G + row / Tq, t = row % Tq;
    const int64_t part = ((int64_t(b) * q_shape[1] + h) * Tq + t) * S + s;
    for (int c = 0; c < D / DC; ++c) {
      for (int u = 0; u < DPL; ++u) {
        o_part[part * D + c * DC + u * 32 + int(lane)] = o[j][c * DPL + u];
      }
    }
    if (lane == 0) {
      ml_part[part * 2] = m[j];
      ml_part[part * 2 + 1] = l[j];
    }
  }
}
