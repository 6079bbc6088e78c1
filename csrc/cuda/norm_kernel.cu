// CUDA kernels for LayerNorm / RMSNorm over the last dim. No torch headers: raw pointers, shapes
// and a stream in, cudaError_t out. Math is in float via megapp/norm.h, shared with the CPU
// kernels.
//
// Forward and grad_input: one block per row (grid-stride over rows), 16-byte vector accesses when
// the row length and pointers allow, block reductions in float in a fixed tree (deterministic).
// Rows that fit in kRowCacheBytes of shared memory are read from global memory once and reused
// from there for the later passes (two-pass variance, then the output).
// grad_weight / grad_bias: a column kernel writes float partial sums over fixed row chunks, and a
// second kernel sums the chunks in ascending order (deterministic, no atomics).
#include "norm_kernel.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "megapp/cuda_common.cuh"
#include "megapp/norm.h"

namespace megapp::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kMaxRowThreads = 512;
constexpr int64_t kMaxRowBlocks = 1 << 16;  // grid-stride loop over the rows covers the rest
constexpr int kVecBytes = 16;
// Dynamic shared memory for cached rows; below the 48 KiB a kernel may use without opting in.
constexpr int64_t kRowCacheBytes = 40 * 1024;
constexpr int kColThreads = 256;
constexpr int64_t kMinRowsPerChunk = 32;  // grad_weight/grad_bias: rows per partial sum, at least
constexpr int64_t kMaxChunks = 128;       // and at most this many partial sums per column

int64_t num_chunks(int64_t rows) {
  return std::clamp<int64_t>(ceil_div(rows, kMinRowsPerChunk), 1, kMaxChunks);
}

// Sums each of v[0..N) over the block; every thread gets the totals. blockDim.x is a multiple of
// the warp size; scratch holds N·kWarpSize floats. The order is fixed by blockDim.x alone.
template <int N>
__device__ __forceinline__ void block_sum(float (&v)[N], float* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
#pragma unroll
  for (int k = 0; k < N; ++k) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      v[k] += __shfl_xor_sync(0xffffffffu, v[k], offset);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) scratch[k * kWarpSize + warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float total = 0.f;
    for (int w = 0; w < num_warps; ++w) total += scratch[k * kWarpSize + w];
    v[k] = total;
  }
  __syncthreads();  // scratch is reused by the next call
}

// x̂ of one element from the saved activation: x with the row statistics, or the output y.
template <bool kRms, bool kMemEff>
__device__ __forceinline__ float saved_xhat(float s, float mean, float rstd, float w, float b) {
  if constexpr (kMemEff) {
    return norm_xhat_from_output<float>(s, w, b);
  } else if constexpr (kRms) {
    return rms_norm_xhat<float>(s, rstd);
  } else {
    return layer_norm_xhat<float>(s, mean, rstd);
  }
}

template <typename T, typename W, int VEC, bool kRms, bool kCache>
__global__ void __launch_bounds__(kMaxRowThreads)
    norm_fwd_kernel(const T* __restrict__ x, const W* __restrict__ weight,
                    const W* __restrict__ bias, T* __restrict__ y, float* __restrict__ mean,
                    float* __restrict__ rstd, int64_t rows, int64_t cols, float eps) {
  using TV = Pack<T, VEC>;
  using WV = Pack<W, VEC>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float scratch[kWarpSize];
  // Each thread caches exactly the vectors it reads later, so the cache needs no barrier.
  TV* cache = reinterpret_cast<TV*>(smem);
  const int64_t nvec = cols / VEC;
  const float n = static_cast<float>(cols);
  const WV* wv = reinterpret_cast<const WV*>(weight);
  const WV* bv = reinterpret_cast<const WV*>(bias);

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const TV* xr = reinterpret_cast<const TV*>(x + row * cols);
    float sum[1] = {0.f};  // Σx (LayerNorm) or Σx² (RMSNorm)
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      const TV v = xr[i];
      if constexpr (kCache) cache[i] = v;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float a = to_acc(v.v[k]);
        sum[0] += kRms ? a * a : a;
      }
    }
    block_sum(sum, scratch);
    const TV* src = kCache ? cache : xr;

    float mu = 0.f;
    float rs;
    if constexpr (kRms) {
      rs = norm_rstd<float>(sum[0] / n, eps);
    } else {
      mu = sum[0] / n;
      float sq[1] = {0.f};
      for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
        const TV v = src[i];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float d = to_acc(v.v[k]) - mu;
          sq[0] += d * d;
        }
      }
      block_sum(sq, scratch);
      rs = norm_rstd<float>(sq[0] / n, eps);
    }

    TV* yr = reinterpret_cast<TV*>(y + row * cols);
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      const TV v = src[i];
      const WV w = wv[i];
      WV b{};
      if (!kRms && bias != nullptr) b = bv[i];
      TV out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float a = to_acc(v.v[k]);
        const float xhat = kRms ? rms_norm_xhat<float>(a, rs) : layer_norm_xhat<float>(a, mu, rs);
        const float bk = (!kRms && bias != nullptr) ? to_acc(b.v[k]) : 0.f;
        out.v[k] = from_acc<T>(norm_affine<float>(xhat, to_acc(w.v[k]), bk));
      }
      yr[i] = out;
    }
    if (threadIdx.x == 0) {
      if (!kRms) mean[row] = mu;
      rstd[row] = rs;
    }
  }
}

// grad_input of one row per block (grid-stride over rows).
template <typename T, typename W, int VEC, bool kRms, bool kMemEff, bool kCache>
__global__ void __launch_bounds__(kMaxRowThreads)
    norm_bwd_input_kernel(const T* __restrict__ grad, const T* __restrict__ saved,
                          const float* __restrict__ mean, const float* __restrict__ rstd,
                          const W* __restrict__ weight, const W* __restrict__ bias,
                          T* __restrict__ grad_input, int64_t rows, int64_t cols) {
  using TV = Pack<T, VEC>;
  using WV = Pack<W, VEC>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float scratch[2 * kWarpSize];
  const int64_t nvec = cols / VEC;
  TV* cache_g = reinterpret_cast<TV*>(smem);
  TV* cache_s = cache_g + nvec;
  const float n = static_cast<float>(cols);
  const WV* wv = reinterpret_cast<const WV*>(weight);
  const WV* bv = reinterpret_cast<const WV*>(bias);
  const bool has_bias = kMemEff && !kRms && bias != nullptr;

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const TV* gr = reinterpret_cast<const TV*>(grad + row * cols);
    const TV* sr = reinterpret_cast<const TV*>(saved + row * cols);
    const float rs = rstd[row];
    const float mu = (!kRms && !kMemEff) ? mean[row] : 0.f;

    float sums[2] = {0.f, 0.f};  // Σ w·g and Σ w·g·x̂
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      const TV g = gr[i];
      const TV s = sr[i];
      if constexpr (kCache) {
        cache_g[i] = g;
        cache_s[i] = s;
      }
      const WV w = wv[i];
      WV b{};
      if (has_bias) b = bv[i];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float wk = to_acc(w.v[k]);
        const float xh =
            saved_xhat<kRms, kMemEff>(to_acc(s.v[k]), mu, rs, wk, has_bias ? to_acc(b.v[k]) : 0.f);
        const float wg = wk * to_acc(g.v[k]);
        sums[0] += wg;
        sums[1] += wg * xh;
      }
    }
    block_sum(sums, scratch);
    const float mean_wg = sums[0] / n;
    const float mean_wg_xhat = sums[1] / n;

    const TV* gsrc = kCache ? cache_g : gr;
    const TV* ssrc = kCache ? cache_s : sr;
    TV* gir = reinterpret_cast<TV*>(grad_input + row * cols);
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      const TV g = gsrc[i];
      const TV s = ssrc[i];
      const WV w = wv[i];
      WV b{};
      if (has_bias) b = bv[i];
      TV out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float wk = to_acc(w.v[k]);
        const float xh =
            saved_xhat<kRms, kMemEff>(to_acc(s.v[k]), mu, rs, wk, has_bias ? to_acc(b.v[k]) : 0.f);
        const float wg = wk * to_acc(g.v[k]);
        const float gi = kRms ? rms_norm_grad_input<float>(wg, xh, rs, mean_wg_xhat)
                              : layer_norm_grad_input<float>(wg, xh, rs, mean_wg, mean_wg_xhat);
        out.v[k] = from_acc<T>(gi);
      }
      gir[i] = out;
    }
  }
}

// Thread (column c, chunk blockIdx.y) writes the float sums of grad·x̂ (workspace[chunk, c]) and,
// for LayerNorm, of grad (workspace[chunks + chunk, c]) over the chunk's rows. Adjacent threads
// touch adjacent columns, so every row access is coalesced.
template <typename T, typename W, bool kRms, bool kMemEff>
__global__ void norm_bwd_param_partials_kernel(
    const T* __restrict__ grad, const T* __restrict__ saved, const float* __restrict__ mean,
    const float* __restrict__ rstd, const W* __restrict__ weight, const W* __restrict__ bias,
    float* __restrict__ workspace, int64_t rows, int64_t cols, int64_t rows_per_chunk,
    int64_t chunks) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int64_t chunk = blockIdx.y;
  const int64_t row_begin = chunk * rows_per_chunk;
  const int64_t row_end = row_begin + rows_per_chunk < rows ? row_begin + rows_per_chunk : rows;
  const float w = kMemEff ? to_acc(weight[c]) : 1.f;
  const float b = (kMemEff && !kRms && bias != nullptr) ? to_acc(bias[c]) : 0.f;
  float acc_w = 0.f;
  float acc_b = 0.f;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int64_t i = r * cols + c;
    const float g = to_acc(grad[i]);
    const float mu = (!kRms && !kMemEff) ? mean[r] : 0.f;
    const float rs = kMemEff ? 0.f : rstd[r];
    acc_w += g * saved_xhat<kRms, kMemEff>(to_acc(saved[i]), mu, rs, w, b);
    acc_b += g;
  }
  workspace[chunk * cols + c] = acc_w;
  if (!kRms) workspace[(chunks + chunk) * cols + c] = acc_b;
}

// grad_weight[c] (and grad_bias[c]) = Σ_chunk of the partial sums, in ascending chunk order.
template <typename W, bool kRms>
__global__ void norm_bwd_param_sum_kernel(const float* __restrict__ workspace,
                                          W* __restrict__ grad_weight, W* __restrict__ grad_bias,
                                          int64_t chunks, int64_t cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float acc_w = 0.f;
  float acc_b = 0.f;
  for (int64_t k = 0; k < chunks; ++k) {
    acc_w += workspace[k * cols + c];
    if (!kRms) acc_b += workspace[(chunks + k) * cols + c];
  }
  grad_weight[c] = from_acc<W>(acc_w);
  if (!kRms) grad_bias[c] = from_acc<W>(acc_b);
}

// Whether rows of cols T elements (and the [cols] W parameters) can be moved in 16-byte vectors.
template <typename T, typename W>
bool can_vectorize(int64_t cols, std::initializer_list<const void*> t_ptrs,
                   std::initializer_list<const void*> w_ptrs) {
  constexpr int64_t vec = kVecBytes / sizeof(T);
  if (cols % vec != 0) return false;
  for (const void* p : t_ptrs) {
    if (!is_aligned(p, vec * sizeof(T))) return false;
  }
  for (const void* p : w_ptrs) {
    if (!is_aligned(p, vec * sizeof(W))) return false;
  }
  return true;
}

// Threads per row block: one vector per thread up to kMaxRowThreads, a whole number of warps.
int row_threads(int64_t nvec) {
  return static_cast<int>(
      std::clamp<int64_t>(ceil_div(nvec, kWarpSize) * kWarpSize, kWarpSize, kMaxRowThreads));
}

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(std::min(rows, kMaxRowBlocks)); }

template <typename T, typename W, bool kRms>
cudaError_t launch_fwd(const T* x, const W* weight, const W* bias, T* y, float* mean, float* rstd,
                       int64_t rows, int64_t cols, float eps, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  constexpr int kVec = kVecBytes / sizeof(T);
  const bool vec = can_vectorize<T, W>(cols, {x, y}, {weight, bias});
  const bool cache = cols * static_cast<int64_t>(sizeof(T)) <= kRowCacheBytes;
  const dim3 grid(row_blocks(rows));
  const dim3 block(row_threads(vec ? cols / kVec : cols));
  const size_t smem = cache ? cols * sizeof(T) : 0;
  auto launch = [&](auto kernel) {
    kernel<<<grid, block, smem, stream>>>(x, weight, bias, y, mean, rstd, rows, cols, eps);
  };
  if (vec) {
    cache ? launch(norm_fwd_kernel<T, W, kVec, kRms, true>)
          : launch(norm_fwd_kernel<T, W, kVec, kRms, false>);
  } else {
    cache ? launch(norm_fwd_kernel<T, W, 1, kRms, true>)
          : launch(norm_fwd_kernel<T, W, 1, kRms, false>);
  }
  return cudaGetLastError();
}

template <typename T, typename W, bool kRms, bool kMemEff>
cudaError_t launch_bwd(const T* grad, const T* saved, const float* mean, const float* rstd,
                       const W* weight, const W* bias, T* grad_input, W* grad_weight,
                       W* grad_bias, float* workspace, int64_t rows, int64_t cols,
                       cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  if (rows > 0) {
    constexpr int kVec = kVecBytes / sizeof(T);
    const bool vec = can_vectorize<T, W>(cols, {grad, saved, grad_input}, {weight, bias});
    const bool cache = 2 * cols * static_cast<int64_t>(sizeof(T)) <= kRowCacheBytes;
    const dim3 grid(row_blocks(rows));
    const dim3 block(row_threads(vec ? cols / kVec : cols));
    const size_t smem = cache ? 2 * cols * sizeof(T) : 0;
    auto launch = [&](auto kernel) {
      kernel<<<grid, block, smem, stream>>>(grad, saved, mean, rstd, weight, bias, grad_input,
                                            rows, cols);
    };
    if (vec) {
      cache ? launch(norm_bwd_input_kernel<T, W, kVec, kRms, kMemEff, true>)
            : launch(norm_bwd_input_kernel<T, W, kVec, kRms, kMemEff, false>);
    } else {
      cache ? launch(norm_bwd_input_kernel<T, W, 1, kRms, kMemEff, true>)
            : launch(norm_bwd_input_kernel<T, W, 1, kRms, kMemEff, false>);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  // Parameter gradients; with rows == 0 they come out as zeros.
  const int64_t chunks = num_chunks(rows);
  const int64_t rows_per_chunk = std::max<int64_t>(1, ceil_div(rows, chunks));
  const unsigned col_blocks = static_cast<unsigned>(ceil_div(cols, kColThreads));
  norm_bwd_param_partials_kernel<T, W, kRms, kMemEff>
      <<<dim3(col_blocks, static_cast<unsigned>(chunks)), kColThreads, 0, stream>>>(
          grad, saved, mean, rstd, weight, bias, workspace, rows, cols, rows_per_chunk, chunks);
  norm_bwd_param_sum_kernel<W, kRms><<<col_blocks, kColThreads, 0, stream>>>(
      workspace, grad_weight, grad_bias, chunks, cols);
  return cudaGetLastError();
}

}  // namespace

int64_t norm_bwd_workspace_numel(int64_t rows, int64_t cols) { return 2 * num_chunks(rows) * cols; }

template <typename T, typename W>
cudaError_t layer_norm_fwd(const T* x, const W* weight, const W* bias, T* y, float* mean,
                           float* rstd, int64_t rows, int64_t cols, float eps,
                           cudaStream_t stream) {
  return launch_fwd<T, W, false>(x, weight, bias, y, mean, rstd, rows, cols, eps, stream);
}

template <typename T, typename W>
cudaError_t rms_norm_fwd(const T* x, const W* weight, T* y, float* rstd, int64_t rows,
                         int64_t cols, float eps, cudaStream_t stream) {
  return launch_fwd<T, W, true>(x, weight, static_cast<const W*>(nullptr), y, nullptr, rstd, rows,
                                cols, eps, stream);
}

template <typename T, typename W>
cudaError_t layer_norm_bwd(const T* grad, const T* saved, const float* mean, const float* rstd,
                           const W* weight, const W* bias, T* grad_input, W* grad_weight,
                           W* grad_bias, float* workspace, int64_t rows, int64_t cols,
                           bool memory_efficient, cudaStream_t stream) {
  if (memory_efficient) {
    return launch_bwd<T, W, false, true>(grad, saved, mean, rstd, weight, bias, grad_input,
                                         grad_weight, grad_bias, workspace, rows, cols, stream);
  }
  return launch_bwd<T, W, false, false>(grad, saved, mean, rstd, weight, bias, grad_input,
                                        grad_weight, grad_bias, workspace, rows, cols, stream);
}

template <typename T, typename W>
cudaError_t rms_norm_bwd(const T* grad, const T* saved, const float* rstd, const W* weight,
                         T* grad_input, W* grad_weight, float* workspace, int64_t rows,
                         int64_t cols, bool memory_efficient, cudaStream_t stream) {
  const W* no_bias = nullptr;
  W* no_grad_bias = nullptr;
  if (memory_efficient) {
    return launch_bwd<T, W, true, true>(grad, saved, nullptr, rstd, weight, no_bias, grad_input,
                                        grad_weight, no_grad_bias, workspace, rows, cols, stream);
  }
  return launch_bwd<T, W, true, false>(grad, saved, nullptr, rstd, weight, no_bias, grad_input,
                                       grad_weight, no_grad_bias, workspace, rows, cols, stream);
}

#define MEGAPP_INSTANTIATE_NORM(T, W)                                                          \
  template cudaError_t layer_norm_fwd<T, W>(const T*, const W*, const W*, T*, float*, float*,  \
                                            int64_t, int64_t, float, cudaStream_t);            \
  template cudaError_t rms_norm_fwd<T, W>(const T*, const W*, T*, float*, int64_t, int64_t,    \
                                          float, cudaStream_t);                                \
  template cudaError_t layer_norm_bwd<T, W>(const T*, const T*, const float*, const float*,    \
                                            const W*, const W*, T*, W*, W*, float*, int64_t,   \
                                            int64_t, bool, cudaStream_t);                      \
  template cudaError_t rms_norm_bwd<T, W>(const T*, const T*, const float*, const W*, T*, W*,  \
                                          float*, int64_t, int64_t, bool, cudaStream_t);

MEGAPP_INSTANTIATE_NORM(float, float)
MEGAPP_INSTANTIATE_NORM(__nv_bfloat16, __nv_bfloat16)
MEGAPP_INSTANTIATE_NORM(__nv_bfloat16, float)
MEGAPP_INSTANTIATE_NORM(__half, __half)
MEGAPP_INSTANTIATE_NORM(__half, float)

#undef MEGAPP_INSTANTIATE_NORM

}  // namespace megapp::cuda
