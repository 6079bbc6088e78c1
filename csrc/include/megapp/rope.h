// Rotary position embedding, non-interleaved ("rotate_half") layout: one definition of the
// per-pair math for the CPU and CUDA kernels (the PyTorch reference mirrors the same order).
//
// The first rot_dim channels of a head are split into halves x1 = x[:r/2], x2 = x[r/2:r]; channel
// j of each half has its own angle θ (θ1_j = freqs[j], θ2_j = freqs[j + r/2], equal in the usual
// layout). With rotate_half(x) = [−x2, x1]:
//
//   y = x·cos θ + rotate_half(x)·sin θ:   y1 = x1·cos θ1 − x2·sin θ1,  y2 = x2·cos θ2 + x1·sin θ2
//
// The map is linear in x, so its backward is the transpose, dx = dy·cos θ − rotate_half(dy·sin θ):
//
//   dx1 = dy1·cos θ1 + dy2·sin θ2,  dx2 = dy2·cos θ2 − dy1·sin θ1
//
// (for θ1 = θ2 a rotation by −θ). T is the accumulation type: float for float/bf16/half, double
// for double; the CPU kernels also instantiate the pair functions on at::vec::Vectorized of it.
#pragma once

#include <math.h>

#include "megapp/common.h"

namespace megapp {

MEGAPP_HOST_DEVICE MEGAPP_INLINE void rope_sincos(float a, float* s, float* c) {
#if defined(__CUDA_ARCH__)
  sincosf(a, s, c);
#else
  *s = sinf(a);
  *c = cosf(a);
#endif
}
MEGAPP_HOST_DEVICE MEGAPP_INLINE void rope_sincos(double a, double* s, double* c) {
#if defined(__CUDA_ARCH__)
  sincos(a, s, c);
#else
  *s = sin(a);
  *c = cos(a);
#endif
}

// Forward on one channel pair (j, j + r/2); c1, s1 = cos, sin θ1 and c2, s2 = cos, sin θ2.
template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE void rope_fwd_pair(T x1, T x2, T c1, T s1, T c2, T s2, T* y1,
                                                    T* y2) {
  *y1 = x1 * c1 - x2 * s1;
  *y2 = x2 * c2 + x1 * s2;
}

// Backward (transpose of the forward) on one channel pair.
template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE void rope_bwd_pair(T g1, T g2, T c1, T s1, T c2, T s2, T* dx1,
                                                    T* dx2) {
  *dx1 = g1 * c1 + g2 * s2;
  *dx2 = g2 * c2 - g1 * s1;
}

}  // namespace megapp
