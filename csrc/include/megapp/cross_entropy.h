// Vocabulary-parallel cross entropy: the per-element math of the CPU and CUDA kernels (the
// PyTorch reference in megapp/tensor_parallel/cross_entropy.py follows the same order of operations).
//
// A rank holds a shard z[0, w) of a row of logits; its first `real` ids are real vocabulary ids,
// the rest padding (never read by the sums, gradient 0). With m the row max over every shard
// (all-reduced by the caller), t the target's index in the shard (if it is there), K the real
// vocabulary size and ε the smoothing weight (0 without label smoothing):
//
//   forward, one pass:  Σ_{k<real} exp(z_k − m),   z_t − m,   Σ_{k<real} (z_k − m)
//   backward:           grad_k = ((p_k − hit_k) − ε/K)·g,   p_k = exp((z_k − m) − log Z),
//                       hit_k = 1 − ε at k = t, else 0
//
// log Z = log Σ_k exp(z_k − m) over the whole vocabulary and g the loss gradient of the row.
// A hit of 0 and ε/K = 0 subtract exactly 0, so one formula serves every id.
//
// T is the accumulation type: float for float/bf16/half logits, double for double; the CPU
// kernels also instantiate these on at::vec::Vectorized of it.
#pragma once

#include <stdint.h>

#include "megapp/common.h"

namespace megapp {

// z − m: a logit shifted by the row max (≤ 0 for real ids), the term of the smoothing sum.
template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T cross_entropy_shifted(T z, T m) {
  return z - m;
}

// exp(z − m): a real id's term of Z; the max subtraction keeps it in (0, 1].
template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T cross_entropy_exp(T z, T m) {
  return Elementwise<T>::exp(cross_entropy_shifted<T>(z, m));
}

// p = exp((z − m) − log Z), the softmax probability of a real id, without a division.
template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T cross_entropy_prob(T z, T m, T log_z) {
  return Elementwise<T>::exp(cross_entropy_shifted<T>(z, m) - log_z);
}

// ∂loss/∂z·g of a real id from its probability p: hit is 1 − ε at the target and 0 elsewhere,
// eps_over_k is ε/K (0 without label smoothing).
template <typename T>
MEGAPP_HOST_DEVICE MEGAPP_INLINE T cross_entropy_grad(T p, T hit, T eps_over_k, T g) {
  return ((p - hit) - eps_over_k) * g;
}

// Index of the target in a shard of ids [start, start + real) of real ids, or −1 when the
// target is elsewhere (another rank's shard).
MEGAPP_HOST_DEVICE MEGAPP_INLINE int64_t cross_entropy_local_target(int64_t target, int64_t start,
                                                                    int64_t real) {
  const int64_t local = target - start;
  return (local >= 0 && local < real) ? local : -1;
}

}  // namespace megapp
