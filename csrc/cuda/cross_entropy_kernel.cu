// CUDA kernels for the vocabulary-parallel cross entropy over one rank's shard of the logits. No
// torch headers: raw pointers, shapes and a stream in, cudaError_t out. Per-element math is
// megapp/cross_entropy.h, shared with the CPU kernels; all arithmetic is in float.
//
// One block per row (grid-stride over rows), 16-byte vector loads and stores when the row length
// and the pointers allow. The forward reads each row twice (the max, all-reduced by the caller
// in between, then the sums) and writes O(1) per row; the backward reads it once and writes the
// gradient once. Block reductions run in a fixed tree, so results are run-to-run deterministic.
#include "cross_entropy_kernel.h"

#include <math.h>

#include <algorithm>
#include <cstdint>

#include "megapp/cross_entropy.h"
#include "megapp/cuda_common.cuh"

namespace megapp::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kMaxThreads = 512;
constexpr int64_t kMaxBlocks = 1 << 16;  // grid-stride loop over the rows covers the rest
constexpr int kVecBytes = 16;

// max that propagates NaN (as torch's amax and the CPU kernel do): a NaN logit gives a NaN loss.
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

// Reduces each of v[0..N) over the block (max or sum) and returns the totals to every thread.
// blockDim.x is a multiple of the warp size; scratch holds N·kWarp floats. The order is fixed
// by blockDim.x alone.
template <bool kMax, int N>
__device__ __forceinline__ void block_reduce(float (&v)[N], float* scratch) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int num_warps = blockDim.x / kWarp;
#pragma unroll
  for (int k = 0; k < N; ++k) {
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, v[k], offset);
      v[k] = kMax ? nan_max(v[k], other) : v[k] + other;
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) scratch[k * kWarp + warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float total = scratch[k * kWarp];
    for (int w = 1; w < num_warps; ++w) {
      const float other = scratch[k * kWarp + w];
      total = kMax ? nan_max(total, other) : total + other;
    }
    v[k] = total;
  }
  __syncthreads();  // scratch is reused by the next row
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads)
    cross_entropy_max_kernel(const T* __restrict__ logits, float* __restrict__ row_max,
                             int64_t rows, int64_t cols, int64_t real) {
  using TV = Pack<T, VEC>;
  __shared__ float scratch[kWarp];
  const int64_t nvec = (real + VEC - 1) / VEC;  // the packs holding real ids
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const TV* zr = reinterpret_cast<const TV*>(logits + row * cols);
    float m[1] = {-INFINITY};
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      const TV z = zr[i];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        if (i * VEC + e < real) m[0] = nan_max(m[0], to_acc(z.v[e]));
      }
    }
    block_reduce<true>(m, scratch);
    if (threadIdx.x == 0) row_max[row] = m[0];
  }
}

template <typename T, int VEC, bool kSmoothing>
__global__ void __launch_bounds__(kMaxThreads)
    cross_entropy_sums_kernel(const T* __restrict__ logits, const int64_t* __restrict__ target,
                              const float* __restrict__ row_max, float* __restrict__ sums,
                              int64_t rows, int64_t cols, int64_t start, int64_t real) {
  using TV = Pack<T, VEC>;
  constexpr int kSums = kSmoothing ? 3 : 2;
  __shared__ float scratch[2 * kWarp];
  const int64_t nvec = (real + VEC - 1) / VEC;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* zrow = logits + row * cols;
    const TV* zr = reinterpret_cast<const TV*>(zrow);
    const float m = row_max[row];
    float acc[2] = {0.f, 0.f};  // Σ exp(z − m), Σ (z − m)
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      const TV z = zr[i];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        if (i * VEC + e < real) {
          const float a = to_acc(z.v[e]);
          acc[0] += cross_entropy_exp<float>(a, m);
          if (kSmoothing) acc[1] += cross_entropy_shifted<float>(a, m);
        }
      }
    }
    block_reduce<false>(acc, scratch);
    if (threadIdx.x == 0) {
      const int64_t local = cross_entropy_local_target(target[row], start, real);
      float* out = sums + row * kSums;
      out[0] = acc[0];
      out[1] = local >= 0 ? cross_entropy_shifted<float>(to_acc(zrow[local]), m) : 0.f;
      if (kSmoothing) out[2] = acc[1];
    }
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads)
    cross_entropy_bwd_kernel(const float* __restrict__ grad_loss, const T* __restrict__ logits,
                             const int64_t* __restrict__ target,
                             const float* __restrict__ row_max, const float* __restrict__ log_z,
                             T* __restrict__ grad, float one_minus_eps, float eps_over_k,
                             int64_t rows, int64_t cols, int64_t start, int64_t real) {
  using TV = Pack<T, VEC>;
  const int64_t nvec = cols / VEC;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const TV* zr = reinterpret_cast<const TV*>(logits + row * cols);
    TV* gr = reinterpret_cast<TV*>(grad + row * cols);
    const float m = row_max[row];
    const float lz = log_z[row];
    const float g = grad_loss[row];
    const int64_t local = cross_entropy_local_target(target[row], start, real);
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      TV out;
      if (i * VEC >= real) {  // a pack of padding ids: no read
#pragma unroll
        for (int e = 0; e < VEC; ++e) out.v[e] = from_acc<T>(0.f);
      } else {
        const TV z = zr[i];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const int64_t k = i * VEC + e;
          float d = 0.f;
          if (k < real) {
            const float p = cross_entropy_prob<float>(to_acc(z.v[e]), m, lz);
            d = cross_entropy_grad<float>(p, k == local ? one_minus_eps : 0.f, eps_over_k, g);
          }
          out.v[e] = from_acc<T>(d);
        }
      }
      gr[i] = out;
    }
  }
}

// Whether rows of cols T elements can be moved in 16-byte packs.
template <typename T>
bool can_vectorize(int64_t cols, const void* a, const void* b) {
  constexpr int64_t vec = kVecBytes / sizeof(T);
  return cols % vec == 0 && is_aligned(a, kVecBytes) && is_aligned(b, kVecBytes);
}

// Threads per row block: one pack per thread up to kMaxThreads, a whole number of warps.
int row_threads(int64_t packs) {
  return static_cast<int>(
      std::clamp<int64_t>(ceil_div(packs, kWarp) * kWarp, kWarp, kMaxThreads));
}

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(std::min(rows, kMaxBlocks)); }

}  // namespace

template <typename T>
cudaError_t cross_entropy_fwd_max(const T* logits, float* row_max, int64_t rows, int64_t cols,
                                  int64_t real, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  constexpr int kVec = kVecBytes / sizeof(T);
  if (can_vectorize<T>(cols, logits, nullptr)) {
    cross_entropy_max_kernel<T, kVec>
        <<<row_blocks(rows), row_threads(ceil_div(real, kVec)), 0, stream>>>(logits, row_max,
                                                                             rows, cols, real);
  } else {
    cross_entropy_max_kernel<T, 1>
        <<<row_blocks(rows), row_threads(real), 0, stream>>>(logits, row_max, rows, cols, real);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t cross_entropy_fwd_sums(const T* logits, const int64_t* target, const float* row_max,
                                   float* sums, int64_t n_sums, int64_t rows, int64_t cols,
                                   int64_t start, int64_t real, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (n_sums != 2 && n_sums != 3) return cudaErrorInvalidValue;
  constexpr int kVec = kVecBytes / sizeof(T);
  const bool vec = can_vectorize<T>(cols, logits, nullptr);
  const dim3 grid(row_blocks(rows));
  const dim3 block(row_threads(vec ? ceil_div(real, kVec) : real));
  auto launch = [&](auto kernel) {
    kernel<<<grid, block, 0, stream>>>(logits, target, row_max, sums, rows, cols, start, real);
  };
  if (vec) {
    n_sums == 3 ? launch(cross_entropy_sums_kernel<T, kVec, true>)
                : launch(cross_entropy_sums_kernel<T, kVec, false>);
  } else {
    n_sums == 3 ? launch(cross_entropy_sums_kernel<T, 1, true>)
                : launch(cross_entropy_sums_kernel<T, 1, false>);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t cross_entropy_bwd(const float* grad_loss, const T* logits, const int64_t* target,
                              const float* row_max, const float* log_z, T* grad,
                              float one_minus_eps, float eps_over_k, int64_t rows, int64_t cols,
                              int64_t start, int64_t real, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  constexpr int kVec = kVecBytes / sizeof(T);
  const bool vec = can_vectorize<T>(cols, logits, grad);
  const dim3 grid(row_blocks(rows));
  const dim3 block(row_threads(vec ? cols / kVec : cols));
  auto launch = [&](auto kernel) {
    kernel<<<grid, block, 0, stream>>>(grad_loss, logits, target, row_max, log_z, grad,
                                       one_minus_eps, eps_over_k, rows, cols, start, real);
  };
  vec ? launch(cross_entropy_bwd_kernel<T, kVec>) : launch(cross_entropy_bwd_kernel<T, 1>);
  return cudaGetLastError();
}

#define MEGAPP_INSTANTIATE_CROSS_ENTROPY(T)                                                      \
  template cudaError_t cross_entropy_fwd_max<T>(const T*, float*, int64_t, int64_t, int64_t,     \
                                                cudaStream_t);                                   \
  template cudaError_t cross_entropy_fwd_sums<T>(const T*, const int64_t*, const float*, float*, \
                                                 int64_t, int64_t, int64_t, int64_t, int64_t,    \
                                                 cudaStream_t);                                  \
  template cudaError_t cross_entropy_bwd<T>(const float*, const T*, const int64_t*,              \
                                            const float*, const float*, T*, float, float,        \
                                            int64_t, int64_t, int64_t, int64_t, cudaStream_t);

MEGAPP_INSTANTIATE_CROSS_ENTROPY(float)
MEGAPP_INSTANTIATE_CROSS_ENTROPY(__nv_bfloat16)
MEGAPP_INSTANTIATE_CROSS_ENTROPY(__half)

#undef MEGAPP_INSTANTIATE_CROSS_ENTROPY

}  // namespace megapp::cuda
