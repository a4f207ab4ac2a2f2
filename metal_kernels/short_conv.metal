// One side of the two-tap dynamic short convolution of DFlash 2, optionally fused with the
// residual add of the "after" side. Built by metal_kernels/metal.py (`short_conv_metal`).
//
// File convention (both kernels): the text above the `kernel body` marker line is passed to
// mx.fast.metal_kernel as `header`, the text below it as `source`. MLX generates the signature
// around the body: every input as `const device|constant <dtype>* name`, `name_shape` /
// `name_strides` for the inputs whose names the body mentions, the outputs, then the
// [[attributes]] the body mentions.
//
//   inputs    y [B, L, H], dyn [B, L, K, H/G], base [K, H], residual [B, L, H] (a [1] dummy
//             when HAS_RESIDUAL == 0); any dtypes, any strides (ensure_row_contiguous=False:
//             the drafter's taps are strided slices, read in place instead of copied)
//   output    out [B, L, H], contiguous, dtype T
//   template  T (output dtype), HAS_RESIDUAL (int 0 | 1)
//   grid      (H, L, B) threads, threadgroup (min(H, 256), 1, 1)
//
// One thread per (b, t, c): neighbouring threads take neighbouring channels, so the loads of y,
// base and residual and the store of out are coalesced; the dynamic tap of a group of G channels
// is one broadcast load. With K = 2 taps a thread does 2 multiply-adds, so the kernel is bound by
// memory traffic (one read of y per tap row, one write), which this layout keeps minimal.
//
//   out[b, t, c] = sum_{k <= t} (base[k, c] + dyn[b, t, k, c / G]) * y[b, t - k, c]  (+ residual)
//
// accumulated in float32 whatever the storage dtypes, rounded to T once.

// ---- kernel body ----
const uint c = thread_position_in_grid.x;
const uint t = thread_position_in_grid.y;
const uint b = thread_position_in_grid.z;
const uint H = y_shape[2];
if (c >= H) {
  return;
}
const uint taps = base_shape[0];
const uint group = c / (H / dyn_shape[3]);
const int64_t dyn_row = b * dyn_strides[0] + t * dyn_strides[1] + group * dyn_strides[3];
const int64_t y_col = b * y_strides[0] + c * y_strides[2];
float acc = 0.0f;
for (uint k = 0; k < taps && k <= t; ++k) {
  const float coef = float(base[k * base_strides[0] + c * base_strides[1]]) +
                     float(dyn[dyn_row + k * dyn_strides[2]]);
  acc += coef * float(y[y_col + (t - k) * y_strides[1]]);
}
if (HAS_RESIDUAL) {
  acc += float(residual[b * residual_strides[0] + t * residual_strides[1] +
                        c * residual_strides[2]]);
}
out[(b * y_shape[1] + t) * H + c] = static_cast<T>(acc);
