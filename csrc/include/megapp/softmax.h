// Scaled masked softmax along the last dim of attention scores [b, heads, sq, sk]: one
// definition of the per-element math for the CPU and CUDA kernels (the PyTorch reference
// mirrors the same order of operations).
//
//   z_j  = scale·x_j, or −∞ where masked (padding mask, or j > i + (sk − sq) when causal)
//   y_j  = exp(z_j − max_k z_k) · (1 / Σ_k exp(z_k − max_k z_k));  y ≡ 0 on a fully masked row
//   dx_j = scale·y_j·(dy_j − Σ_k dy_k·y_k)
//
// T is the accumulation type: float for float/bf16/half inputs, double for double; the CPU
// kernels also instantiate these on at::vec::Vectorized of it.
#pragma once

#include <math.h>
#include <stdint.h>

#include "megapp/common.h"

namespace megapp {

// exp of a logit shifted by the row max: in (0, 1], and exactly 0 for a masked (−∞) one.
template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T softmax_exp(T v) {
  return Elementwise<T>::exp(v);
}

// Number of keys query row q attends to under the causal mask: keys j <= q + (sk − sq), so the
// last query sees every key (queries are the trailing sq of the sk positions).
MEGAPP_HOST_DEVICE MEGAPP_INLINE int64_t causal_key_limit(int64_t q, int64_t sq, int64_t sk) {
  const int64_t limit = q + (sk - sq) + 1;
  return limit < 0 ? 0 : (limit > sk ? sk : limit);
}

// The logit of one score: scale·x, or −∞ where masked (so exp gives exactly 0).
template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T softmax_logit(T x, T scale, bool masked) {
  return masked ? T(-INFINITY) : scale * x;
}

// The same with the mask as a value: nonzero where masked (one flag per lane for vectors).
template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T softmax_logit_where(T x, T scale, T masked) {
  return Elementwise<T>::where_nonzero(masked, T(-INFINITY), scale * x);
}

// dx = scale·y·(dy − Σ dy·y); dot is the row's Σ dy·y.
template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T softmax_grad(T y, T dy, T dot, T scale) {
  return scale * y * (dy - dot);
}

}  // namespace megapp
