// CUDA kernels for bias + GeLU (tanh approximation). No torch headers: raw pointers, shapes and a
// stream in, cudaError_t out. Math is in float via megapp/gelu.h, shared with the CPU kernels.
//
// Both passes run on a 2-D grid: x over groups of N adjacent columns, y over rows, so a thread
// loads its bias once and computes no index by division. Loads and stores are 16-byte vectors
// (4 floats or 8 bf16/half) when cols is a multiple of the vector width and every pointer is
// 16-byte aligned, element-wise otherwise.
#include "bias_gelu_kernel.h"

#include <algorithm>

#include "megapp/cuda_bias_grad.cuh"
#include "megapp/cuda_common.cuh"
#include "megapp/gelu.h"

namespace megapp::cuda {
namespace {

constexpr int kThreads = 256;
// Forward blocks wanted: about four waves of 256-thread blocks on an H100 or H200.
constexpr int64_t kTargetBlocks = 4096;
constexpr int64_t kMaxRowBlocks = 65535;  // gridDim.y limit
using bias_grad::num_chunks;

// Thread (column group blockIdx.x·blockDim.x + threadIdx.x) writes N outputs of every
// gridDim.y-th row from blockIdx.y.
template <typename T, int N>
__global__ void bias_gelu_fwd_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                     T* __restrict__ y, int64_t rows, int64_t cols) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * N;
  if (c >= cols) return;
  const Pack<T, N> b = load_pack<T, N>(bias + c);
  float bf[N];
#pragma unroll
  for (int j = 0; j < N; ++j) bf[j] = to_acc(b.v[j]);
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const Pack<T, N> in = load_pack<T, N>(x + r * cols + c);
    Pack<T, N> out;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      out.v[j] = from_acc<T>(gelu_tanh_fwd<float>(to_acc(in.v[j]) + bf[j]));
    }
    store_pack<T, N>(y + r * cols + c, out);
  }
}

// Thread (column group, chunk blockIdx.y) writes grad_input for N columns over the chunk's rows
// and the float sums of those values into workspace[chunk, ·]. Adjacent threads touch adjacent
// vectors of one row.
template <typename T, int N>
__global__ void bias_gelu_bwd_kernel(const T* __restrict__ grad, const T* __restrict__ x,
                                     const T* __restrict__ bias, T* __restrict__ grad_input,
                                     float* __restrict__ workspace, int64_t rows, int64_t cols,
                                     int64_t rows_per_chunk) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * N;
  if (c >= cols) return;
  const int64_t chunk = blockIdx.y;
  const int64_t row_begin = chunk * rows_per_chunk;
  const int64_t row_end = row_begin + rows_per_chunk < rows ? row_begin + rows_per_chunk : rows;
  const Pack<T, N> b = load_pack<T, N>(bias + c);
  float bf[N], acc[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    bf[j] = to_acc(b.v[j]);
    acc[j] = 0.f;
  }
  for (int64_t r = row_begin; r < row_end; ++r) {
    const Pack<T, N> dy = load_pack<T, N>(grad + r * cols + c);
    const Pack<T, N> in = load_pack<T, N>(x + r * cols + c);
    Pack<T, N> out;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float g = to_acc(dy.v[j]) * gelu_tanh_grad<float>(to_acc(in.v[j]) + bf[j]);
      out.v[j] = from_acc<T>(g);
      acc[j] += g;
    }
    store_pack<T, N>(grad_input + r * cols + c, out);
  }
  float* ws = workspace + chunk * cols;
#pragma unroll
  for (int j = 0; j < N; ++j) ws[c + j] = acc[j];
}

// Threads per block for `groups` column groups: a whole number of warps, at most kThreads, so
// narrow rows do not launch idle threads.
int threads_for(int64_t groups) {
  return static_cast<int>(std::min<int64_t>(kThreads, ceil_div(groups, 32) * 32));
}

template <typename T, int N>
cudaError_t launch_fwd_vec(const T* x, const T* bias, T* y, int64_t rows, int64_t cols,
                           cudaStream_t stream) {
  const int64_t groups = cols / N;
  const int threads = threads_for(groups);
  const int64_t col_blocks = ceil_div(groups, threads);
  const int64_t row_blocks =
      std::clamp<int64_t>(ceil_div(kTargetBlocks, col_blocks), 1, std::min(rows, kMaxRowBlocks));
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(row_blocks));
  bias_gelu_fwd_kernel<T, N><<<grid, threads, 0, stream>>>(x, bias, y, rows, cols);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_fwd(const T* x, const T* bias, T* y, int64_t rows, int64_t cols,
                       cudaStream_t stream) {
  if (rows * cols == 0) return cudaSuccess;
  constexpr int kVec = 16 / sizeof(T);
  if (cols % kVec == 0 && is_aligned(x, 16) && is_aligned(bias, 16) && is_aligned(y, 16)) {
    return launch_fwd_vec<T, kVec>(x, bias, y, rows, cols, stream);
  }
  return launch_fwd_vec<T, 1>(x, bias, y, rows, cols, stream);
}

template <typename T, int N>
cudaError_t launch_bwd_vec(const T* grad, const T* x, const T* bias, T* grad_input,
                           float* workspace, int64_t rows, int64_t cols, int64_t chunks,
                           cudaStream_t stream) {
  const int64_t groups = cols / N;
  const int64_t rows_per_chunk = std::max<int64_t>(1, ceil_div(rows, chunks));
  const int threads = threads_for(groups);
  const dim3 grid(static_cast<unsigned>(ceil_div(groups, threads)), static_cast<unsigned>(chunks));
  bias_gelu_bwd_kernel<T, N><<<grid, threads, 0, stream>>>(grad, x, bias, grad_input, workspace,
                                                          rows, cols, rows_per_chunk);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(const T* grad, const T* x, const T* bias, T* grad_input, T* grad_bias,
                       float* workspace, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  const int64_t chunks = num_chunks(rows, cols);
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = cols % kVec == 0 && is_aligned(grad, 16) && is_aligned(x, 16) &&
                   is_aligned(bias, 16) && is_aligned(grad_input, 16);
  // With no rows the kernel still writes each chunk's zero sums.
  const cudaError_t err =
      vec ? launch_bwd_vec<T, kVec>(grad, x, bias, grad_input, workspace, rows, cols, chunks,
                                    stream)
          : launch_bwd_vec<T, 1>(grad, x, bias, grad_input, workspace, rows, cols, chunks, stream);
  if (err != cudaSuccess) return err;
  return bias_grad::sum_chunks(workspace, grad_bias, chunks, cols, stream);
}

}  // namespace

int64_t bias_gelu_bwd_workspace_numel(int64_t rows, int64_t cols) {
  return num_chunks(rows, cols) * cols;
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
