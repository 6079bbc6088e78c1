// SwiGLU and its derivatives: one definition for the CPU and CUDA kernels so both compute the
// same formula in the same order (the PyTorch reference mirrors it).
//
//   σ(g)     = 1 / (1 + exp(−g))
//   y        = silu(g)·u = (g·σ(g))·u
//   ∂y/∂g    = u·σ(g)·(1 + g·(1 − σ(g)))
//   ∂y/∂u    = silu(g)
//
// g is the gate (first half of the last dim, plus its bias), u the up projection (second half).
// T is the accumulation type: float for float/bf16/half inputs, double for double; the CPU
// kernels also instantiate these on at::vec::Vectorized of it.
#pragma once

#include <math.h>

#include "megapp/common.h"

namespace megapp {

template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T swiglu_sigmoid(T g) {
  // exp(−g) overflows to inf for g ≪ 0, giving σ = 0 (no NaN); exact 1 for g ≫ 0.
  return T(1) / (T(1) + Elementwise<T>::exp(-g));
}

template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T swiglu_fwd(T g, T u) {
  const T s = swiglu_sigmoid(g);
  return (g * s) * u;
}

// (dg, du) for upstream gradient dy.
template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE void swiglu_bwd(T g, T u, T dy, T& dg, T& du) {
  const T s = swiglu_sigmoid(g);
  const T silu = g * s;
  const T dsilu = s * (T(1) + g * (T(1) - s));
  dg = (dy * u) * dsilu;
  du = dy * silu;
}

}  // namespace megapp
