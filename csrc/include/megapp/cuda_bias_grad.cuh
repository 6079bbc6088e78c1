// grad_bias of the bias + elementwise kernels (bias + dropout + add, bias + SwiGLU), in two
// deterministic passes. Each thread of an op's backward kernel sums its columns over one chunk
// of rows into a float workspace [chunks, cols]; sum_chunks then adds each column's chunks in a
// fixed order. The chunk count is a function of the shape alone (not of the vector width or the
// pointers' alignment), so grad_bias's bits depend on the shape alone. No torch headers; include
// it only from .cu files.
#pragma once

#include <algorithm>
#include <cstdint>

#include "megapp/cuda_common.cuh"

namespace megapp::cuda::bias_grad {

constexpr int64_t kMaxChunks = 65535;  // gridDim.y limit
// Each thread sums a chunk of at least kMinRowsPerChunk rows of its columns; chunks are added
// until about kTargetThreads threads run (enough to fill an H100/H200).
constexpr int64_t kMinRowsPerChunk = 16;
constexpr int64_t kTargetThreads = 1 << 17;
constexpr int64_t kNominalVec = 8;  // chunking assumes this width whatever the actual one
// Final reduction: a block of kSumCols columns × kSumSplit chunk strides.
constexpr int kSumCols = 32;
constexpr int kSumSplit = 8;

// Row chunks of a backward whose threads each cover kNominalVec of `cols` columns.
inline int64_t num_chunks(int64_t rows, int64_t cols) {
  const int64_t threads_per_chunk = std::max<int64_t>(1, ceil_div(cols, kNominalVec));
  const int64_t wanted = ceil_div(kTargetThreads, threads_per_chunk);
  return std::clamp<int64_t>(std::min(wanted, ceil_div(rows, kMinRowsPerChunk)), 1, kMaxChunks);
}

// grad_bias[c] = Σ_chunk workspace[chunk, c]: thread row y sums chunks y, y + kSumSplit, ... in
// order, then row 0 adds the kSumSplit partial sums in order (deterministic).
template <typename T>
__global__ void sum_chunks_kernel(const float* __restrict__ workspace, T* __restrict__ grad_bias,
                                  int64_t chunks, int64_t cols) {
  __shared__ float partial[kSumSplit][kSumCols + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kSumCols + threadIdx.x;
  float acc = 0.f;
  if (c < cols) {
    for (int64_t k = threadIdx.y; k < chunks; k += kSumSplit) acc += workspace[k * cols + c];
  }
  partial[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  float total = 0.f;
#pragma unroll
  for (int s = 0; s < kSumSplit; ++s) total += partial[s][threadIdx.x];
  grad_bias[c] = from_acc<T>(total);
}

// The second pass over a workspace of `chunks` rows and `cols` columns.
template <typename T>
cudaError_t sum_chunks(const float* workspace, T* grad_bias, int64_t chunks, int64_t cols,
                       cudaStream_t stream) {
  const dim3 block(kSumCols, kSumSplit);
  sum_chunks_kernel<T><<<static_cast<unsigned>(ceil_div(cols, kSumCols)), block, 0, stream>>>(
      workspace, grad_bias, chunks, cols);
  return cudaGetLastError();
}

}  // namespace megapp::cuda::bias_grad
