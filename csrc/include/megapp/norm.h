// LayerNorm / RMSNorm math over the last dim, shared by the CPU and CUDA kernels so both compute
// the same formulas in the same order. Per row of h values, with x̂ the normalized value:
//
//   LayerNorm: mean = Σx/h,  rstd = 1/√(Σ(x − mean)²/h + eps),  x̂ = (x − mean)·rstd
//   RMSNorm:                 rstd = 1/√(Σx²/h + eps),           x̂ = x·rstd
//   y = x̂·w + b                              (b = 0 for RMSNorm or a LayerNorm without bias)
//
// Backward, with g = ∂L/∂y and wg = w·g (the means are over the row):
//
//   LayerNorm: ∂L/∂x = rstd·(wg − mean(wg) − x̂·mean(wg·x̂))
//   RMSNorm:   ∂L/∂x = rstd·(wg − x̂·mean(wg·x̂))
//   ∂L/∂w = Σ_rows g·x̂,  ∂L/∂b = Σ_rows g
//
// The memory-efficient backward gets y instead of x and recovers x̂ = (y − b)/w; that needs every
// w ≠ 0, and a zero weight gives NaN (not a silently wrong gradient).
//
// T is the accumulation type: float for float/bf16/half inputs, double for double; the CPU
// kernels also instantiate the elementwise ones on at::vec::Vectorized of it.
#pragma once

#include <math.h>

#include "megapp/common.h"

namespace megapp {

// 1/√(mean_square + eps). A correctly rounded sqrt and a true division (not rsqrt) so the CPU
// and the GPU get the same bits from the same mean_square.
template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T norm_rstd(T mean_square, T eps) {
  return T(1) / Elementwise<T>::sqrt(mean_square + eps);
}

template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T layer_norm_xhat(T x, T mean, T rstd) {
  return (x - mean) * rstd;
}

template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T rms_norm_xhat(T x, T rstd) {
  return x * rstd;
}

template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T norm_affine(T xhat, T w, T b) {
  return xhat * w + b;
}

// x̂ recovered from the output of the affine map; NaN where w == 0 (x̂ is lost there).
template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T norm_xhat_from_output(T y, T w, T b) {
  return Elementwise<T>::where_nonzero(w, (y - b) / w, T(NAN));
}

template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T layer_norm_grad_input(T wg, T xhat, T rstd, T mean_wg,
                                                         T mean_wg_xhat) {
  return rstd * (wg - mean_wg - xhat * mean_wg_xhat);
}

template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T rms_norm_grad_input(T wg, T xhat, T rstd, T mean_wg_xhat) {
  return rstd * (wg - xhat * mean_wg_xhat);
}

}  // namespace megapp
