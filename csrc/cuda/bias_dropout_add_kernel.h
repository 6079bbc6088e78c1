// Launchers for the bias + dropout + residual-add CUDA kernels. Plain CUDA types only (no torch
// headers), so the .cu compiles with nvcc alone. All tensors are contiguous: x, residual, out,
// grad and grad_x are [rows, cols]; bias and grad_bias are [cols], and bias may be null (no
// bias). The keep mask of element i (flat index) is megapp::dropout_keep4's Philox draw for
// counter index offset + i under seed (megapp/philox.h); p == 0 draws nothing. Each launcher
// returns the launch error status.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace megapp::cuda {

// out = residual + mask · (x + bias) / (1 − p).
cudaError_t bias_dropout_add_fwd(const float* x, const float* bias, const float* residual,
                                 float* out, int64_t rows, int64_t cols, double p, uint64_t seed,
                                 uint64_t offset, cudaStream_t stream);
cudaError_t bias_dropout_add_fwd(const __nv_bfloat16* x, const __nv_bfloat16* bias,
                                 const __nv_bfloat16* residual, __nv_bfloat16* out, int64_t rows,
                                 int64_t cols, double p, uint64_t seed, uint64_t offset,
                                 cudaStream_t stream);
cudaError_t bias_dropout_add_fwd(const __half* x, const __half* bias, const __half* residual,
                                 __half* out, int64_t rows, int64_t cols, double p, uint64_t seed,
                                 uint64_t offset, cudaStream_t stream);

// Number of floats of scratch memory bias_dropout_add_bwd needs for the grad_bias partial sums
// (a function of the shape only).
int64_t bias_dropout_add_bwd_workspace_numel(int64_t rows, int64_t cols);

// grad_x = mask · grad / (1 − p). When grad_bias is non-null, grad_bias = Σ_rows grad_x summed in
// float in an order fixed by the shape (deterministic), using workspace of
// bias_dropout_add_bwd_workspace_numel(rows, cols) floats; both may be null otherwise.
cudaError_t bias_dropout_add_bwd(const float* grad, float* grad_x, float* grad_bias,
                                 float* workspace, int64_t rows, int64_t cols, double p,
                                 uint64_t seed, uint64_t offset, cudaStream_t stream);
cudaError_t bias_dropout_add_bwd(const __nv_bfloat16* grad, __nv_bfloat16* grad_x,
                                 __nv_bfloat16* grad_bias, float* workspace, int64_t rows,
                                 int64_t cols, double p, uint64_t seed, uint64_t offset,
                                 cudaStream_t stream);
cudaError_t bias_dropout_add_bwd(const __half* grad, __half* grad_x, __half* grad_bias,
                                 float* workspace, int64_t rows, int64_t cols, double p,
                                 uint64_t seed, uint64_t offset, cudaStream_t stream);

}  // namespace megapp::cuda
