// CUDA kernels for bias + GeLU (tanh approximation). No torch headers: raw pointers, shapes and a
// stream in, cudaError_t out. Math is in float via megapp/gelu.h, shared with the CPU kernels.
#include "bias_gelu_kernel.h"

#include <algorithm>

#include "megapp/cuda_common.cuh"
#include "megapp/gelu.h"

namespace megapp::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxForwardBlocks = 1 << 16;  // grid-stride loop covers the rest
constexpr int64_t kRowsPerChunk = 32;           // backward: rows per grad_bias partial sum
constexpr int64_t kMaxChunks = 65535;           // gridDim.y limit

int64_t num_chunks(int64_t rows) {
  return std::clamp<int64_t>(ceil_div(rows, kRowsPerChunk), 1, kMaxChunks);
}

template <typename T>
__global__ void bias_gelu_fwd_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                     T* __restrict__ y, int64_t numel, int64_t cols) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    const float z = to_acc(x[i]) + to_acc(bias[i % cols]);
    y[i] = from_acc<T>(gelu_tanh_fwd<float>(z));
  }
}

// Thread (column c, chunk blockIdx.y) writes grad_input for its rows of column c and the float
// partial sum of those values into workspace[chunk, c]. Adjacent threads touch adjacent columns,
// so every row access is coalesced.
template <typename T>
__global__ void bias_gelu_bwd_kernel(const T* __restrict__ grad, const T* __restrict__ x,
                                     const T* __restrict__ bias, T* __restrict__ grad_input,
                                     float* __restrict__ workspace, int64_t rows, int64_t cols,
                                     int64_t rows_per_chunk) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int64_t chunk = blockIdx.y;
  const int64_t row_end = (chunk + 1) * rows_per_chunk < rows ? (chunk + 1) * rows_per_chunk : rows;
  const float b = to_acc(bias[c]);
  float acc = 0.f;
  for (int64_t r = chunk * rows_per_chunk; r < row_end; ++r) {
    const int64_t i = r * cols + c;
    const float g = to_acc(grad[i]) * gelu_tanh_grad<float>(to_acc(x[i]) + b);
    grad_input[i] = from_acc<T>(g);
    acc += g;
  }
  workspace[chunk * cols + c] = acc;
}

// grad_bias[c] = Σ_chunk workspace[chunk, c], in ascending chunk order (deterministic).
template <typename T>
__global__ void sum_chunks_kernel(const float* __restrict__ workspace, T* __restrict__ grad_bias,
                                  int64_t chunks, int64_t cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float acc = 0.f;
  for (int64_t k = 0; k < chunks; ++k) acc += workspace[k * cols + c];
  grad_bias[c] = from_acc<T>(acc);
}

template <typename T>
cudaError_t launch_fwd(const T* x, const T* bias, T* y, int64_t rows, int64_t cols,
                       cudaStream_t stream) {
  const int64_t numel = rows * cols;
  if (numel == 0) return cudaSuccess;
  const int64_t blocks = std::min(ceil_div(numel, kThreads), kMaxForwardBlocks);
  bias_gelu_fwd_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, bias, y,
                                                                                  numel, cols);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(const T* grad, const T* x, const T* bias, T* grad_input, T* grad_bias,
                       float* workspace, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  const int64_t chunks = num_chunks(rows);
  const int64_t rows_per_chunk = std::max<int64_t>(1, ceil_div(rows, chunks));
  const unsigned col_blocks = static_cast<unsigned>(ceil_div(cols, kThreads));
  const dim3 grid(col_blocks, static_cast<unsigned>(chunks));
  bias_gelu_bwd_kernel<T><<<grid, kThreads, 0, stream>>>(grad, x, bias, grad_input, workspace,
                                                         rows, cols, rows_per_chunk);
  sum_chunks_kernel<T><<<col_blocks, kThreads, 0, stream>>>(workspace, grad_bias, chunks, cols);
  return cudaGetLastError();
}

}  // namespace

int64_t bias_gelu_bwd_workspace_numel(int64_t rows, int64_t cols) {
  return num_chunks(rows) * cols;
}

cudaError_t bias_gelu_fwd(const float* x, const float* bias, float* y, int64_t rows, int64_t cols,
                          cudaStream_t stream) {
  return launch_fwd(x, bias, y, rows, cols, stream);
}
cudaError_t bias_gelu_fwd(const __nv_bfloat16* x, const __nv_bfloat16* bias, __nv_bfloat16* y,
                          int64_t rows, int64_t cols, cudaStream_t stream) {
  return launch_fwd(x, bias, y, rows, cols, stream);
}
cudaError_t bias_gelu_fwd(const __half* x, const __half* bias, __half* y, int64_t rows,
                          int64_t cols, cudaStream_t stream) {
  return launch_fwd(x, bias, y, rows, cols, stream);
}

cudaError_t bias_gelu_bwd(const float* grad, const float* x, const float* bias, float* grad_input,
                          float* grad_bias, float* workspace, int64_t rows, int64_t cols,
                          cudaStream_t stream) {
  return launch_bwd(grad, x, bias, grad_input, grad_bias, workspace, rows, cols, stream);
}
cudaError_t bias_gelu_bwd(const __nv_bfloat16* grad, const __nv_bfloat16* x,
                          const __nv_bfloat16* bias, __nv_bfloat16* grad_input,
                          __nv_bfloat16* grad_bias, float* workspace, int64_t rows, int64_t cols,
                          cudaStream_t stream) {
  return launch_bwd(grad, x, bias, grad_input, grad_bias, workspace, rows, cols, stream);
}
cudaError_t bias_gelu_bwd(const __half* grad, const __half* x, const __half* bias,
                          __half* grad_input, __half* grad_bias, float* workspace, int64_t rows,
                          int64_t cols, cudaStream_t stream) {
  return launch_bwd(grad, x, bias, grad_input, grad_bias, workspace, rows, cols, stream);
}

}  // namespace megapp::cuda
