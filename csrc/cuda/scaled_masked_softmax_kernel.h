// Launchers for the scaled masked softmax CUDA kernels. Plain CUDA types only (no torch headers),
// so the .cu compiles with nvcc alone. Scores, outputs and gradients are contiguous
// [batch, heads, sq, sk], viewed as batch·heads·sq rows of sk. Each launcher returns the launch
// error status (cudaErrorInvalidConfiguration for a grid too large for one launch).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace megapp::cuda {

// A bool padding mask broadcast to [batch, heads, sq, sk] (True = masked out): element
// (b, h, q, k) is data[b·stride_b + h·stride_h + q·stride_q + k·stride_k], strides in elements
// (0 on broadcast dims). data == nullptr means no padding mask.
struct SoftmaxMask {
  const bool* data;
  int64_t stride_b, stride_h, stride_q, stride_k;
};

// y = softmax(scale·x + mask) over each row, in float; causal also masks keys j > q + (sk − sq)
// (needs sk >= sq). Fully masked rows give zeros.
cudaError_t scaled_masked_softmax_fwd(const float* x, SoftmaxMask mask, float* y, int64_t batch,
                                      int64_t heads, int64_t sq, int64_t sk, float scale,
                                      bool causal, cudaStream_t stream);
cudaError_t scaled_masked_softmax_fwd(const __nv_bfloat16* x, SoftmaxMask mask, __nv_bfloat16* y,
                                      int64_t batch, int64_t heads, int64_t sq, int64_t sk,
                                      float scale, bool causal, cudaStream_t stream);
cudaError_t scaled_masked_softmax_fwd(const __half* x, SoftmaxMask mask, __half* y, int64_t batch,
                                      int64_t heads, int64_t sq, int64_t sk, float scale,
                                      bool causal, cudaStream_t stream);

// grad_x = scale·y·(grad − Σ_row grad·y), row sums in float in a fixed order (deterministic).
cudaError_t scaled_masked_softmax_bwd(const float* grad, const float* y, float* grad_x,
                                      int64_t rows, int64_t sk, float scale, cudaStream_t stream);
cudaError_t scaled_masked_softmax_bwd(const __nv_bfloat16* grad, const __nv_bfloat16* y,
                                      __nv_bfloat16* grad_x, int64_t rows, int64_t sk, float scale,
                                      cudaStream_t stream);
cudaError_t scaled_masked_softmax_bwd(const __half* grad, const __half* y, __half* grad_x,
                                      int64_t rows, int64_t sk, float scale, cudaStream_t stream);

}  // namespace megapp::cuda
