// CUDA kernels for bias + dropout + residual add. No torch headers: raw pointers, shapes and a
// stream in, cudaError_t out. The keep mask comes from megapp/philox.h, shared with the CPU
// kernels, so both draw the same mask bit for bit; the arithmetic is the CPU kernel's too (float,
// multiplications with __fmul_rn so nvcc cannot contract them into FMAs), so float results match
// the CPU kernel exactly.
//
// Each thread moves N = 16 bytes / sizeof(T) consecutive elements (4 floats or 8 bf16/half, a
// whole number of Philox blocks): as one vector when cols is a multiple of N and every pointer is
// 16-byte aligned, element by element otherwise.
#include "bias_dropout_add_kernel.h"

#include <algorithm>
#include <type_traits>

#include "megapp/cuda_bias_grad.cuh"
#include "megapp/cuda_common.cuh"
#include "megapp/philox.h"

namespace megapp::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxForwardBlocks = 1 << 16;  // grid-stride loop covers the rest
using bias_grad::num_chunks;

// Keep bits of counter indices n0 .. n0 + N − 1 (bit j: element n0 + j).
template <int N>
__device__ __forceinline__ uint32_t keep_bits(uint64_t seed, uint64_t n0, uint64_t threshold) {
  static_assert(N % 4 == 0 && N <= 32, "N must be a multiple of the Philox block size");
  uint32_t bits = 0;
#pragma unroll
  for (int q = 0; q < N / 4; ++q) bits |= dropout_keep4(seed, n0 + 4 * q, threshold) << (4 * q);
  return bits;
}

// z kept and scaled, or dropped; the same float operations as the CPU kernel.
template <bool kDropout>
__device__ __forceinline__ float apply_mask(float z, uint32_t keep, int j, float scale) {
  if constexpr (!kDropout) return z;
  return (keep >> j) & 1u ? __fmul_rn(z, scale) : 0.f;
}

// Thread g handles the N elements at flat indices [N·g, N·g + N) (grid-stride loop).
template <typename T, int N, bool kVec, bool kHasBias, bool kDropout>
__global__ void bias_dropout_add_fwd_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                            const T* __restrict__ residual, T* __restrict__ out,
                                            int64_t numel, int64_t cols, uint64_t seed,
                                            uint64_t offset, uint64_t threshold, float scale) {
  const int64_t groups = (numel + N - 1) / N;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += stride) {
    const int64_t i0 = g * N;
    const uint32_t keep = kDropout ? keep_bits<N>(seed, offset + i0, threshold) : 0u;
    if constexpr (kVec) {  // cols % N == 0: the N elements lie in one row
      const Pack<T, N> xv = load_pack<T, N>(x + i0);
      const Pack<T, N> rv = load_pack<T, N>(residual + i0);
      Pack<T, N> bv;
      if constexpr (kHasBias) bv = load_pack<T, N>(bias + i0 % cols);
      Pack<T, N> ov;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        float z = to_acc(xv.v[j]);
        if constexpr (kHasBias) z += to_acc(bv.v[j]);
        ov.v[j] = from_acc<T>(to_acc(rv.v[j]) + apply_mask<kDropout>(z, keep, j, scale));
      }
      store_pack<T, N>(out + i0, ov);
    } else {
      int64_t c = i0 % cols;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const int64_t i = i0 + j;
        if (i >= numel) break;
        float z = to_acc(x[i]);
        if constexpr (kHasBias) z += to_acc(bias[c]);
        out[i] = from_acc<T>(to_acc(residual[i]) + apply_mask<kDropout>(z, keep, j, scale));
        if (++c == cols) c = 0;
      }
    }
  }
}

// Thread (column group blockIdx.x·blockDim.x + threadIdx.x, chunk blockIdx.y) writes grad_x for
// N consecutive columns over the chunk's rows and, with a workspace, the float sums of those
// values into workspace[chunk, ·]. Adjacent threads touch adjacent vectors of one row.
template <typename T, int N, bool kVec, bool kDropout>
__global__ void bias_dropout_add_bwd_kernel(const T* __restrict__ grad, T* __restrict__ grad_x,
                                            float* __restrict__ workspace, int64_t rows,
                                            int64_t cols, int64_t rows_per_chunk, uint64_t seed,
                                            uint64_t offset, uint64_t threshold, float scale) {
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * N;
  if (c0 >= cols) return;
  const int64_t chunk = blockIdx.y;
  const int64_t row_begin = chunk * rows_per_chunk;
  const int64_t row_end = row_begin + rows_per_chunk < rows ? row_begin + rows_per_chunk : rows;
  const int width = cols - c0 < N ? static_cast<int>(cols - c0) : N;  // N unless at the edge
  float acc[N];
#pragma unroll
  for (int j = 0; j < N; ++j) acc[j] = 0.f;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int64_t i0 = r * cols + c0;
    const uint32_t keep = kDropout ? keep_bits<N>(seed, offset + i0, threshold) : 0u;
    if constexpr (kVec) {
      const Pack<T, N> gv = load_pack<T, N>(grad + i0);
      Pack<T, N> ov;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float g = apply_mask<kDropout>(to_acc(gv.v[j]), keep, j, scale);
        ov.v[j] = from_acc<T>(g);
        acc[j] += g;
      }
      store_pack<T, N>(grad_x + i0, ov);
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) {
        if (j >= width) break;
        const float g = apply_mask<kDropout>(to_acc(grad[i0 + j]), keep, j, scale);
        grad_x[i0 + j] = from_acc<T>(g);
        acc[j] += g;
      }
    }
  }
  if (workspace == nullptr) return;
  float* ws = workspace + chunk * cols + c0;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    if (j < width) ws[j] = acc[j];
  }
}

// Calls fn(std::bool_constant<b>{}), turning a runtime flag into a template argument.
template <typename Fn>
void with_flag(bool b, Fn&& fn) {
  if (b) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

template <typename T>
cudaError_t launch_fwd(const T* x, const T* bias, const T* residual, T* out, int64_t rows,
                       int64_t cols, double p, uint64_t seed, uint64_t offset,
                       cudaStream_t stream) {
  const int64_t numel = rows * cols;
  if (numel == 0) return cudaSuccess;
  constexpr int N = 16 / sizeof(T);
  const uint64_t threshold = dropout_keep_threshold(p);
  const float scale = static_cast<float>(dropout_scale(p));
  const bool vec = cols % N == 0 && is_aligned(x, 16) && is_aligned(bias, 16) &&
                   is_aligned(residual, 16) && is_aligned(out, 16);
  const unsigned blocks =
      static_cast<unsigned>(std::min(ceil_div(ceil_div(numel, N), kThreads), kMaxForwardBlocks));
  with_flag(vec, [&](auto vec_tag) {
    with_flag(bias != nullptr, [&](auto bias_tag) {
      with_flag(p > 0.0, [&](auto dropout_tag) {
        bias_dropout_add_fwd_kernel<T, N, decltype(vec_tag)::value, decltype(bias_tag)::value,
                                    decltype(dropout_tag)::value>
            <<<blocks, kThreads, 0, stream>>>(x, bias, residual, out, numel, cols, seed, offset,
                                              threshold, scale);
      });
    });
  });
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(const T* grad, T* grad_x, T* grad_bias, float* workspace, int64_t rows,
                       int64_t cols, double p, uint64_t seed, uint64_t offset,
                       cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  constexpr int N = 16 / sizeof(T);
  const uint64_t threshold = dropout_keep_threshold(p);
  const float scale = static_cast<float>(dropout_scale(p));
  if (grad_bias == nullptr) workspace = nullptr;
  const int64_t chunks = num_chunks(rows, cols);
  const int64_t rows_per_chunk = std::max<int64_t>(1, ceil_div(rows, chunks));
  const int64_t groups = ceil_div(cols, N);
  // Narrow rows: fewer threads per block instead of idle ones (a multiple of the warp size).
  const int threads = static_cast<int>(std::min<int64_t>(kThreads, ceil_div(groups, 32) * 32));
  const dim3 grid(static_cast<unsigned>(ceil_div(groups, threads)), static_cast<unsigned>(chunks));
  const bool vec = cols % N == 0 && is_aligned(grad, 16) && is_aligned(grad_x, 16);
  with_flag(vec, [&](auto vec_tag) {
    with_flag(p > 0.0, [&](auto dropout_tag) {
      bias_dropout_add_bwd_kernel<T, N, decltype(vec_tag)::value, decltype(dropout_tag)::value>
          <<<grid, threads, 0, stream>>>(grad, grad_x, workspace, rows, cols, rows_per_chunk,
                                         seed, offset, threshold, scale);
    });
  });
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || grad_bias == nullptr) return err;
  return bias_grad::sum_chunks(workspace, grad_bias, chunks, cols, stream);
}

}  // namespace

int64_t bias_dropout_add_bwd_workspace_numel(int64_t rows, int64_t cols) {
  return num_chunks(rows, cols) * cols;
}

cudaError_t bias_dropout_add_fwd(const float* x, const float* bias, const float* residual,
                                 float* out, int64_t rows, int64_t cols, double p, uint64_t seed,
                                 uint64_t offset, cudaStream_t stream) {
  return launch_fwd(x, bias, residual, out, rows, cols, p, seed, offset, stream);
}
cudaError_t bias_dropout_add_fwd(const __nv_bfloat16* x, const __nv_bfloat16* bias,
                                 const __nv_bfloat16* residual, __nv_bfloat16* out, int64_t rows,
                                 int64_t cols, double p, uint64_t seed, uint64_t offset,
                                 cudaStream_t stream) {
  return launch_fwd(x, bias, residual, out, rows, cols, p, seed, offset, stream);
}
cudaError_t bias_dropout_add_fwd(const __half* x, const __half* bias, const __half* residual,
                                 __half* out, int64_t rows, int64_t cols, double p, uint64_t seed,
                                 uint64_t offset, cudaStream_t stream) {
  return launch_fwd(x, bias, residual, out, rows, cols, p, seed, offset, stream);
}

cudaError_t bias_dropout_add_bwd(const float* grad, float* grad_x, float* grad_bias,
                                 float* workspace, int64_t rows, int64_t cols, double p,
                                 uint64_t seed, uint64_t offset, cudaStream_t stream) {
  return launch_bwd(grad, grad_x, grad_bias, workspace, rows, cols, p, seed, offset, stream);
}
cudaError_t bias_dropout_add_bwd(const __nv_bfloat16* grad, __nv_bfloat16* grad_x,
                                 __nv_bfloat16* grad_bias, float* workspace, int64_t rows,
                                 int64_t cols, double p, uint64_t seed, uint64_t offset,
                                 cudaStream_t stream) {
  return launch_bwd(grad, grad_x, grad_bias, workspace, rows, cols, p, seed, offset, stream);
}
cudaError_t bias_dropout_add_bwd(const __half* grad, __half* grad_x, __half* grad_bias,
                                 float* workspace, int64_t rows, int64_t cols, double p,
                                 uint64_t seed, uint64_t offset, cudaStream_t stream) {
  return launch_bwd(grad, grad_x, grad_bias, workspace, rows, cols, p, seed, offset, stream);
}

}  // namespace megapp::cuda
