// Launchers for the bias-GeLU CUDA kernels. Plain CUDA types only (no torch headers), so the
// .cu compiles with nvcc alone. All tensors are contiguous: x, y, grad, grad_input are
// [rows, cols]; bias and grad_bias are [cols]. Each launcher returns the launch error status.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace megapp::cuda {

// y = gelu_tanh(x + bias).
cudaError_t bias_gelu_fwd(const float* x, const float* bias, float* y, int64_t rows, int64_t cols,
                          cudaStream_t stream);
cudaError_t bias_gelu_fwd(const __nv_bfloat16* x, const __nv_bfloat16* bias, __nv_bfloat16* y,
                          int64_t rows, int64_t cols, cudaStream_t stream);
cudaError_t bias_gelu_fwd(const __half* x, const __half* bias, __half* y, int64_t rows,
                          int64_t cols, cudaStream_t stream);

// Number of floats of scratch memory bias_gelu_bwd needs for the grad_bias partial sums.
int64_t bias_gelu_bwd_workspace_numel(int64_t rows, int64_t cols);

// grad_input = grad · gelu'(x + bias); grad_bias = Σ_rows grad_input, summed in float in a fixed
// order (deterministic). workspace holds bias_gelu_bwd_workspace_numel(rows, cols) floats.
cudaError_t bias_gelu_bwd(const float* grad, const float* x, const float* bias, float* grad_input,
                          float* grad_bias, float* workspace, int64_t rows, int64_t cols,
                          cudaStream_t stream);
cudaError_t bias_gelu_bwd(const __nv_bfloat16* grad, const __nv_bfloat16* x,
                          const __nv_bfloat16* bias, __nv_bfloat16* grad_input,
                          __nv_bfloat16* grad_bias, float* workspace, int64_t rows, int64_t cols,
                          cudaStream_t stream);
cudaError_t bias_gelu_bwd(const __half* grad, const __half* x, const __half* bias,
                          __half* grad_input, __half* grad_bias, float* workspace, int64_t rows,
                          int64_t cols, cudaStream_t stream);

}  // namespace megapp::cuda
