// Launchers for the bias-SwiGLU CUDA kernels. Plain CUDA types only (no torch headers), so the
// .cu compiles with nvcc alone. All tensors are contiguous: x and grad_input are [rows, 2f]
// laid out as [gate | up]; y and grad are [rows, f]; bias and grad_bias are [2f], and bias may be
// null (no bias). Each launcher returns the launch error status.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace megapp::cuda {

// y = silu(gate + bias_gate) · (up + bias_up).
cudaError_t bias_swiglu_fwd(const float* x, const float* bias, float* y, int64_t rows, int64_t f,
                            cudaStream_t stream);
cudaError_t bias_swiglu_fwd(const __nv_bfloat16* x, const __nv_bfloat16* bias, __nv_bfloat16* y,
                            int64_t rows, int64_t f, cudaStream_t stream);
cudaError_t bias_swiglu_fwd(const __half* x, const __half* bias, __half* y, int64_t rows,
                            int64_t f, cudaStream_t stream);

// Number of floats of scratch memory bias_swiglu_bwd needs for the grad_bias partial sums
// (a function of the shape only).
int64_t bias_swiglu_bwd_workspace_numel(int64_t rows, int64_t f);

// grad_input = [grad · u · silu'(g) | grad · silu(g)]. When grad_bias is non-null (bias given),
// grad_bias = Σ_rows grad_input summed in float in an order fixed by the shape (deterministic),
// using workspace of bias_swiglu_bwd_workspace_numel(rows, f) floats; both may be null otherwise.
cudaError_t bias_swiglu_bwd(const float* grad, const float* x, const float* bias,
                            float* grad_input, float* grad_bias, float* workspace, int64_t rows,
                            int64_t f, cudaStream_t stream);
cudaError_t bias_swiglu_bwd(const __nv_bfloat16* grad, const __nv_bfloat16* x,
                            const __nv_bfloat16* bias, __nv_bfloat16* grad_input,
                            __nv_bfloat16* grad_bias, float* workspace, int64_t rows, int64_t f,
                            cudaStream_t stream);
cudaError_t bias_swiglu_bwd(const __half* grad, const __half* x, const __half* bias,
                            __half* grad_input, __half* grad_bias, float* workspace, int64_t rows,
                            int64_t f, cudaStream_t stream);

}  // namespace megapp::cuda
