// Launchers for the rotary position embedding CUDA kernels. Plain CUDA types only (no torch
// headers), so the .cu compiles with nvcc alone. src/out are contiguous [seq, bh, d] (bh = batch ·
// heads); freqs is contiguous [seq, rot_dim] float32 angles in the non-interleaved layout of
// megapp/rope.h (rot_dim even, <= d). Each launcher returns the launch error status.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace megapp::cuda {

// y = x·cos(freqs) + rotate_half(x)·sin(freqs) on the first rot_dim channels; the rest copied.
cudaError_t rope_fwd(const float* x, const float* freqs, float* y, int64_t seq, int64_t bh,
                     int64_t d, int64_t rot_dim, cudaStream_t stream);
cudaError_t rope_fwd(const __nv_bfloat16* x, const float* freqs, __nv_bfloat16* y, int64_t seq,
                     int64_t bh, int64_t d, int64_t rot_dim, cudaStream_t stream);
cudaError_t rope_fwd(const __half* x, const float* freqs, __half* y, int64_t seq, int64_t bh,
                     int64_t d, int64_t rot_dim, cudaStream_t stream);

// grad_x = grad·cos(freqs) − rotate_half(grad·sin(freqs)) (the transpose); the rest copied.
cudaError_t rope_bwd(const float* grad, const float* freqs, float* grad_x, int64_t seq,
                     int64_t bh, int64_t d, int64_t rot_dim, cudaStream_t stream);
cudaError_t rope_bwd(const __nv_bfloat16* grad, const float* freqs, __nv_bfloat16* grad_x,
                     int64_t seq, int64_t bh, int64_t d, int64_t rot_dim, cudaStream_t stream);
cudaError_t rope_bwd(const __half* grad, const float* freqs, __half* grad_x, int64_t seq,
                     int64_t bh, int64_t d, int64_t rot_dim, cudaStream_t stream);

}  // namespace megapp::cuda
