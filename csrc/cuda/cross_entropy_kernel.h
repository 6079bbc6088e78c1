// Launchers for the vocabulary-parallel cross entropy CUDA kernels. Plain CUDA types only (no
// torch headers), so the .cu compiles with nvcc alone.
//
// logits and grad are contiguous [rows, cols]: one rank's shard of the padded vocabulary, ids
// [start, start + cols), of which the first `real` are real ids and the rest padding. target
// holds int64 global ids [rows]; row_max, log_z, grad_loss are float [rows]; sums is float
// [rows, n_sums]. T is float, __nv_bfloat16 or __half; math is in float with the formulas of
// megapp/cross_entropy.h. Each launcher returns the launch error status.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace megapp::cuda {

// row_max[r] = max_{k<real} z[r, k] (−∞ when real == 0; NaN if a real logit is NaN).
template <typename T>
cudaError_t cross_entropy_fwd_max(const T* logits, float* row_max, int64_t rows, int64_t cols,
                                  int64_t real, cudaStream_t stream);

// One pass over each row with m = row_max[r] (the max over every shard): sums[r, 0] =
// Σ_{k<real} exp(z − m), sums[r, 1] = z_t − m (0 when the target is not one of this shard's real
// ids) and, when n_sums == 3, sums[r, 2] = Σ_{k<real} (z − m). Sums in a fixed block tree.
template <typename T>
cudaError_t cross_entropy_fwd_sums(const T* logits, const int64_t* target, const float* row_max,
                                   float* sums, int64_t n_sums, int64_t rows, int64_t cols,
                                   int64_t start, int64_t real, cudaStream_t stream);

// grad[r, k] = ((exp((z − m) − log_z) − one_minus_eps·[k = t]) − eps_over_k)·grad_loss[r] for
// k < real, 0 for padding ids.
template <typename T>
cudaError_t cross_entropy_bwd(const float* grad_loss, const T* logits, const int64_t* target,
                              const float* row_max, const float* log_z, T* grad,
                              float one_minus_eps, float eps_over_k, int64_t rows, int64_t cols,
                              int64_t start, int64_t real, cudaStream_t stream);

}  // namespace megapp::cuda
