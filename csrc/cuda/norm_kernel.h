// Launchers for the LayerNorm / RMSNorm CUDA kernels (normalization over the last dim). Plain
// CUDA types only (no torch headers), so the .cu compiles with nvcc alone.
//
// All tensors are contiguous: x, y, grad, saved, grad_input are [rows, cols]; weight, bias,
// grad_weight, grad_bias are [cols]; mean and rstd are float [rows]. T is the activation type
// (float, __nv_bfloat16, __half) and W the parameter type: T itself, or float for bf16/half
// activations. Instantiated for (T, W) = (float, float), (__nv_bfloat16, __nv_bfloat16),
// (__nv_bfloat16, float), (__half, __half), (__half, float). Math is in float with the formulas
// of megapp/norm.h. Each launcher returns the launch error status.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace megapp::cuda {

// y = (x − mean)·rstd·weight + bias per row; writes mean and rstd. bias may be null (no bias).
template <typename T, typename W>
cudaError_t layer_norm_fwd(const T* x, const W* weight, const W* bias, T* y, float* mean,
                           float* rstd, int64_t rows, int64_t cols, float eps,
                           cudaStream_t stream);

// y = x·rstd·weight per row; writes rstd.
template <typename T, typename W>
cudaError_t rms_norm_fwd(const T* x, const W* weight, T* y, float* rstd, int64_t rows,
                         int64_t cols, float eps, cudaStream_t stream);

// Number of floats of scratch memory the backward launchers need for the per-chunk partial sums
// of grad_weight and grad_bias.
int64_t norm_bwd_workspace_numel(int64_t rows, int64_t cols);

// grad_input, grad_weight = Σ_rows grad·x̂ and grad_bias = Σ_rows grad (summed in float over fixed
// row chunks, then the chunks in a fixed order: deterministic). `saved` is x with mean and rstd,
// or with memory_efficient the output y (mean unused; x̂ = (y − bias)/weight, NaN where
// weight == 0). bias may be null; grad_bias is always written. workspace holds
// norm_bwd_workspace_numel(rows, cols) floats.
template <typename T, typename W>
cudaError_t layer_norm_bwd(const T* grad, const T* saved, const float* mean, const float* rstd,
                           const W* weight, const W* bias, T* grad_input, W* grad_weight,
                           W* grad_bias, float* workspace, int64_t rows, int64_t cols,
                           bool memory_efficient, cudaStream_t stream);

// grad_input and grad_weight = Σ_rows grad·x̂ (deterministic, as layer_norm_bwd). `saved` is x,
// or with memory_efficient the output y (x̂ = y/weight, NaN where weight == 0).
template <typename T, typename W>
cudaError_t rms_norm_bwd(const T* grad, const T* saved, const float* rstd, const W* weight,
                         T* grad_input, W* grad_weight, float* workspace, int64_t rows,
                         int64_t cols, bool memory_efficient, cudaStream_t stream);

}  // namespace megapp::cuda
