// GeLU, tanh approximation, and its derivative: one definition for the CPU and CUDA kernels so
// both compute the same formula in the same order.
//
//   gelu(z)  = 0.5·z·(1 + tanh(u)) = z·σ(2u),  u = √(2/π)·(z + 0.044715·z³),  σ = logistic
//   gelu'(z) = σ(2u) + 2·z·σ(2u)·(1 − σ(2u))·√(2/π)·(1 + 3·0.044715·z²)
//
// The σ form avoids the cancellation of 1 + tanh(u) for negative z and needs only exp, which
// libm computes several times faster than tanh. T is the accumulation type: float for
// float/bf16/half inputs, double for double; the CPU kernels also instantiate these on
// at::vec::Vectorized of it (one lane per element, the same operations in the same order).
#pragma once

#include <math.h>

#include "megapp/common.h"

namespace megapp {

// σ(2u) for the GeLU's inner argument u; exp overflowing to inf gives the right limit 0.
template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T gelu_sigma(T z) {
  const T k_beta = T(0.7978845608028654);  // √(2/π)
  const T k_kappa = T(0.044715);
  const T u = k_beta * (z + k_kappa * (z * z * z));
  return T(1) / (T(1) + Elementwise<T>::exp(T(-2) * u));
}

template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T gelu_tanh_fwd(T z) {
  return z * gelu_sigma(z);
}

template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T gelu_tanh_grad(T z) {
  const T k_beta = T(0.7978845608028654);
  const T k_kappa = T(0.044715);
  const T sigma = gelu_sigma(z);
  return sigma + T(2) * z * sigma * (T(1) - sigma) * k_beta * (T(1) + T(3) * k_kappa * (z * z));
}

}  // namespace megapp
