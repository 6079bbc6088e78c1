// GeLU, tanh approximation, and its derivative: one definition for the CPU and CUDA kernels so
// both compute the same formula in the same order.
//
//   gelu(z)  = 0.5·z·(1 + tanh(u)),  u = √(2/π)·(z + 0.044715·z³)
//   gelu'(z) = 0.5·(1 + tanh(u)) + 0.5·z·(1 − tanh²(u))·√(2/π)·(1 + 3·0.044715·z²)
//
// T is the accumulation type: float for float/bf16/half inputs, double for double.
#pragma once

#include <math.h>

#include "megapp/common.h"

namespace megapp {

MEGAPP_HOST_DEVICE MEGAPP_INLINE float tanh_acc(float v) { return tanhf(v); }
MEGAPP_HOST_DEVICE MEGAPP_INLINE double tanh_acc(double v) { return tanh(v); }

template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T gelu_tanh_fwd(T z) {
  const T k_beta = T(0.7978845608028654);  // √(2/π)
  const T k_kappa = T(0.044715);
  const T z_cube = z * z * z;
  const T u = k_beta * (z + k_kappa * z_cube);
  return T(0.5) * z * (T(1) + tanh_acc(u));
}

template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T gelu_tanh_grad(T z) {
  const T k_beta = T(0.7978845608028654);
  const T k_kappa = T(0.044715);
  const T z_sq = z * z;
  const T z_cube = z_sq * z;
  const T t = tanh_acc(k_beta * (z + k_kappa * z_cube));
  const T d_left = T(0.5) * (T(1) + t);
  const T d_right = T(0.5) * z * (T(1) - t * t) * k_beta * (T(1) + T(3) * k_kappa * z_sq);
  return d_left + d_right;
}

}  // namespace megapp
