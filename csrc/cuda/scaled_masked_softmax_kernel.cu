// CUDA kernels for the scaled masked softmax over attention-score rows. No torch headers: raw
// pointers, shapes and a stream in, cudaError_t out. Per-element math is megapp/softmax.h, shared
// with the CPU kernels; all arithmetic and reductions are in float.
//
// Three row kernels, picked by the row length sk (in 16-byte packs when sk and the pointers allow
// vector accesses):
//   - warp per row (sk <= 32·32 elements): the row lives in registers, one read and one write;
//   - block per row (sk <= 512·32 with 16-byte packs): the same with block-wide reductions;
//   - streaming block per row (longer rows): an online max/sum pass, then a normalizing pass
//     that reads the scores again (two reads and one write).
// Reductions use a fixed shuffle tree, so results are deterministic run to run.
#include "scaled_masked_softmax_kernel.h"

#include <math.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "megapp/cuda_common.cuh"
#include "megapp/softmax.h"

namespace megapp::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kWarpRowsPerBlock = 4;    // warp-per-row kernels: 128 threads per block
constexpr int kMaxRowThreads = 512;     // block-per-row kernels
constexpr int kMaxElemsPerThread = 32;  // register cache per thread, in floats
constexpr int kPackBytes = 16;
constexpr int64_t kMaxGrid = 0x7fffffff;  // gridDim.x limit

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> zero_pack() {
  Pack<T, N> pack;
#pragma unroll
  for (int e = 0; e < N; ++e) pack.v[e] = from_acc<T>(0.f);
  return pack;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// Butterfly sum: every lane ends with the same (commutatively identical) value.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// Max or sum over the threads of one row, returned to all of them. A warp-per-row reduction
// uses shuffles only (warps of one block hold different rows); a block-per-row one combines
// the per-warp results through shared memory.
template <bool kWarpPerRow, bool kMax>
__device__ __forceinline__ float row_reduce(float v, float* smem) {
  v = kMax ? warp_max(v) : warp_sum(v);
  if constexpr (kWarpPerRow) {
    return v;
  } else {
    const int warp = threadIdx.x / kWarp;
    const int lane = threadIdx.x % kWarp;
    __syncthreads();  // the previous reduction has finished reading smem
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    const float identity = kMax ? -INFINITY : 0.f;
    v = lane < static_cast<int>(blockDim.x / kWarp) ? smem[lane] : identity;
    return kMax ? warp_max(v) : warp_sum(v);
  }
}

struct RowInfo {
  int64_t limit;      // keys [0, limit) may be attended (causal bound)
  const bool* mask;   // the row's padding mask (element stride stride_k), or nullptr
};

__device__ __forceinline__ RowInfo row_info(int64_t row, const SoftmaxMask& mask, int64_t heads,
                                            int64_t sq, int64_t sk, bool causal) {
  const int64_t q = row % sq;
  const int64_t bh = row / sq;
  RowInfo info;
  info.limit = causal ? causal_key_limit(q, sq, sk) : sk;
  info.mask = mask.data == nullptr ? nullptr
                                   : mask.data + (bh / heads) * mask.stride_b +
                                         (bh % heads) * mask.stride_h + q * mask.stride_q;
  return info;
}

__device__ __forceinline__ bool is_masked(const RowInfo& info, int64_t stride_k, int64_t c) {
  return c >= info.limit || (info.mask != nullptr && info.mask[c * stride_k]);
}

// Forward with the row cached in registers: ITERS packs of VEC elements per thread, the row
// handled by one warp (kWarpPerRow) or by the whole block.
template <typename T, int VEC, int ITERS, bool kWarpPerRow>
__global__ void __launch_bounds__(kMaxRowThreads)
    softmax_fwd_reg_kernel(const T* __restrict__ x, SoftmaxMask mask, T* __restrict__ y,
                           int64_t rows, int64_t heads, int64_t sq, int64_t sk, float scale,
                           bool causal) {
  __shared__ float smem[kWarp];
  const int threads = kWarpPerRow ? kWarp : static_cast<int>(blockDim.x);
  const int tid =
      kWarpPerRow ? static_cast<int>(threadIdx.x % kWarp) : static_cast<int>(threadIdx.x);
  const int64_t row = kWarpPerRow ? static_cast<int64_t>(blockIdx.x) * kWarpRowsPerBlock +
                                        threadIdx.x / kWarp
                                  : static_cast<int64_t>(blockIdx.x);
  if (row >= rows) return;  // whole warps only
  const RowInfo info = row_info(row, mask, heads, sq, sk, causal);
  const T* xr = x + row * sk;
  T* yr = y + row * sk;

  float v[ITERS][VEC];
  float row_max = -INFINITY;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int64_t c0 = (static_cast<int64_t>(it) * threads + tid) * VEC;
    if (c0 < info.limit) {  // sk % VEC == 0, so the whole pack is inside the row
      const Pack<T, VEC> p = load_pack<T, VEC>(xr + c0);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        v[it][e] = softmax_logit<float>(to_acc(p.v[e]), scale,
                                        is_masked(info, mask.stride_k, c0 + e));
        row_max = fmaxf(row_max, v[it][e]);
      }
    } else {  // past the causal limit or the row: not even read
#pragma unroll
      for (int e = 0; e < VEC; ++e) v[it][e] = -INFINITY;
    }
  }
  row_max = row_reduce<kWarpPerRow, true>(row_max, smem);
  if (row_max == -INFINITY) {  // fully masked row (uniform over the row's threads): zeros
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int64_t c0 = (static_cast<int64_t>(it) * threads + tid) * VEC;
      if (c0 < sk) store_pack<T, VEC>(yr + c0, zero_pack<T, VEC>());
    }
    return;
  }
  float sum = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      v[it][e] = softmax_exp(v[it][e] - row_max);  // masked: exp(−∞) = 0
      sum += v[it][e];
    }
  }
  sum = row_reduce<kWarpPerRow, false>(sum, smem);
  const float inv = 1.f / sum;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int64_t c0 = (static_cast<int64_t>(it) * threads + tid) * VEC;
    if (c0 < sk) {
      Pack<T, VEC> out;
#pragma unroll
      for (int e = 0; e < VEC; ++e) out.v[e] = from_acc<T>(v[it][e] * inv);
      store_pack<T, VEC>(yr + c0, out);
    }
  }
}

// Forward for rows too long for registers: an online (max, Σexp) pass, then a second read.
template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxRowThreads)
    softmax_fwd_stream_kernel(const T* __restrict__ x, SoftmaxMask mask, T* __restrict__ y,
                              int64_t heads, int64_t sq, int64_t sk, float scale, bool causal) {
  __shared__ float smem[kWarp];
  const int64_t row = blockIdx.x;
  const RowInfo info = row_info(row, mask, heads, sq, sk, causal);
  const T* xr = x + row * sk;
  T* yr = y + row * sk;
  const int64_t step = static_cast<int64_t>(blockDim.x) * VEC;

  float m = -INFINITY;  // running max of this thread's logits
  float s = 0.f;        // Σ exp(z − m) over them
  for (int64_t c0 = static_cast<int64_t>(threadIdx.x) * VEC; c0 < info.limit; c0 += step) {
    const Pack<T, VEC> p = load_pack<T, VEC>(xr + c0);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float z =
          softmax_logit<float>(to_acc(p.v[e]), scale, is_masked(info, mask.stride_k, c0 + e));
      if (z == -INFINITY) continue;  // contributes exactly 0
      if (z > m) {
        s = s * softmax_exp(m - z) + 1.f;
        m = z;
      } else {
        s += softmax_exp(z - m);
      }
    }
  }
  const float row_max = row_reduce<false, true>(m, smem);
  if (row_max == -INFINITY) {  // fully masked row (uniform over the block): zeros
    for (int64_t c0 = static_cast<int64_t>(threadIdx.x) * VEC; c0 < sk; c0 += step) {
      store_pack<T, VEC>(yr + c0, zero_pack<T, VEC>());
    }
    return;
  }
  const float sum = row_reduce<false, false>(m == -INFINITY ? 0.f : s * softmax_exp(m - row_max),
                                             smem);
  const float inv = 1.f / sum;
  for (int64_t c0 = static_cast<int64_t>(threadIdx.x) * VEC; c0 < sk; c0 += step) {
    Pack<T, VEC> out = zero_pack<T, VEC>();
    if (c0 < info.limit) {
      const Pack<T, VEC> p = load_pack<T, VEC>(xr + c0);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float z =
            softmax_logit<float>(to_acc(p.v[e]), scale, is_masked(info, mask.stride_k, c0 + e));
        out.v[e] = from_acc<T>(softmax_exp(z - row_max) * inv);
      }
    }
    store_pack<T, VEC>(yr + c0, out);
  }
}

// Backward with the row (y and grad) cached in registers.
template <typename T, int VEC, int ITERS, bool kWarpPerRow>
__global__ void __launch_bounds__(kMaxRowThreads)
    softmax_bwd_reg_kernel(const T* __restrict__ grad, const T* __restrict__ y,
                           T* __restrict__ grad_x, int64_t rows, int64_t sk, float scale) {
  __shared__ float smem[kWarp];
  const int threads = kWarpPerRow ? kWarp : static_cast<int>(blockDim.x);
  const int tid =
      kWarpPerRow ? static_cast<int>(threadIdx.x % kWarp) : static_cast<int>(threadIdx.x);
  const int64_t row = kWarpPerRow ? static_cast<int64_t>(blockIdx.x) * kWarpRowsPerBlock +
                                        threadIdx.x / kWarp
                                  : static_cast<int64_t>(blockIdx.x);
  if (row >= rows) return;  // whole warps only
  const int64_t off = row * sk;

  float yv[ITERS][VEC];
  float gv[ITERS][VEC];
  float dot = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int64_t c0 = (static_cast<int64_t>(it) * threads + tid) * VEC;
    if (c0 < sk) {
      const Pack<T, VEC> py = load_pack<T, VEC>(y + off + c0);
      const Pack<T, VEC> pg = load_pack<T, VEC>(grad + off + c0);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        yv[it][e] = to_acc(py.v[e]);
        gv[it][e] = to_acc(pg.v[e]);
        dot += yv[it][e] * gv[it][e];
      }
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) yv[it][e] = gv[it][e] = 0.f;
    }
  }
  dot = row_reduce<kWarpPerRow, false>(dot, smem);
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int64_t c0 = (static_cast<int64_t>(it) * threads + tid) * VEC;
    if (c0 < sk) {
      Pack<T, VEC> out;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        out.v[e] = from_acc<T>(softmax_grad<float>(yv[it][e], gv[it][e], dot, scale));
      }
      store_pack<T, VEC>(grad_x + off + c0, out);
    }
  }
}

// Backward for long rows: Σ grad·y in one pass, the gradient in a second.
template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxRowThreads)
    softmax_bwd_stream_kernel(const T* __restrict__ grad, const T* __restrict__ y,
                              T* __restrict__ grad_x, int64_t sk, float scale) {
  __shared__ float smem[kWarp];
  const int64_t off = static_cast<int64_t>(blockIdx.x) * sk;
  const int64_t step = static_cast<int64_t>(blockDim.x) * VEC;
  float dot = 0.f;
  for (int64_t c0 = static_cast<int64_t>(threadIdx.x) * VEC; c0 < sk; c0 += step) {
    const Pack<T, VEC> py = load_pack<T, VEC>(y + off + c0);
    const Pack<T, VEC> pg = load_pack<T, VEC>(grad + off + c0);
#pragma unroll
    for (int e = 0; e < VEC; ++e) dot += to_acc(py.v[e]) * to_acc(pg.v[e]);
  }
  dot = row_reduce<false, false>(dot, smem);
  for (int64_t c0 = static_cast<int64_t>(threadIdx.x) * VEC; c0 < sk; c0 += step) {
    const Pack<T, VEC> py = load_pack<T, VEC>(y + off + c0);
    const Pack<T, VEC> pg = load_pack<T, VEC>(grad + off + c0);
    Pack<T, VEC> out;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      out.v[e] = from_acc<T>(softmax_grad<float>(to_acc(py.v[e]), to_acc(pg.v[e]), dot, scale));
    }
    store_pack<T, VEC>(grad_x + off + c0, out);
  }
}

int pow2_at_least(int64_t n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kPackBytes == 0; }

// Calls fn(std::integral_constant<int, I>) for I = iters, a power of two <= kMaxIters.
template <int kMaxIters, typename Fn>
void dispatch_iters(int iters, Fn&& fn) {
  switch (iters) {
    case 1:
      return fn(std::integral_constant<int, 1>{});
    case 2:
      if constexpr (kMaxIters >= 2) return fn(std::integral_constant<int, 2>{});
      break;
    case 4:
      if constexpr (kMaxIters >= 4) return fn(std::integral_constant<int, 4>{});
      break;
    case 8:
      if constexpr (kMaxIters >= 8) return fn(std::integral_constant<int, 8>{});
      break;
    case 16:
      if constexpr (kMaxIters >= 16) return fn(std::integral_constant<int, 16>{});
      break;
    case 32:
      if constexpr (kMaxIters >= 32) return fn(std::integral_constant<int, 32>{});
      break;
    default:
      break;
  }
}

// How a row of sk elements (sk / VEC packs) is spread over threads.
struct RowPlan {
  enum Kind { kWarpRow, kBlockRow, kStream } kind;
  int iters;    // packs per thread (register kernels)
  int threads;  // threads per block
  int64_t blocks;
};

template <int VEC>
RowPlan plan_rows(int64_t rows, int64_t sk) {
  constexpr int kMaxIters = kMaxElemsPerThread / VEC;
  const int64_t packs = sk / VEC;
  if (packs <= static_cast<int64_t>(kWarp) * kMaxIters) {
    return {RowPlan::kWarpRow, pow2_at_least(ceil_div(packs, kWarp)), kWarp * kWarpRowsPerBlock,
            ceil_div(rows, kWarpRowsPerBlock)};
  }
  // Unvectorized long rows would need 32 registers per thread for only 512·32 elements: stream.
  if (VEC > 1 && packs <= static_cast<int64_t>(kMaxRowThreads) * kMaxIters) {
    // About 4 packs per thread, 128 to 512 threads.
    const int threads = static_cast<int>(
        std::clamp<int64_t>(pow2_at_least(ceil_div(packs, 4)), 4 * kWarp, kMaxRowThreads));
    return {RowPlan::kBlockRow, pow2_at_least(ceil_div(packs, threads)), threads, rows};
  }
  return {RowPlan::kStream, 0, kMaxRowThreads, rows};
}

template <typename T, int VEC>
cudaError_t launch_fwd(const T* x, SoftmaxMask mask, T* y, int64_t rows, int64_t heads,
                       int64_t sq, int64_t sk, float scale, bool causal, cudaStream_t stream) {
  constexpr int kMaxIters = kMaxElemsPerThread / VEC;
  const RowPlan plan = plan_rows<VEC>(rows, sk);
  if (plan.blocks > kMaxGrid) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(plan.blocks));
  const dim3 block(static_cast<unsigned>(plan.threads));
  if (plan.kind == RowPlan::kStream) {
    softmax_fwd_stream_kernel<T, VEC>
        <<<grid, block, 0, stream>>>(x, mask, y, heads, sq, sk, scale, causal);
  } else if (plan.kind == RowPlan::kWarpRow) {
    dispatch_iters<kMaxIters>(plan.iters, [&](auto iters) {
      softmax_fwd_reg_kernel<T, VEC, decltype(iters)::value, true>
          <<<grid, block, 0, stream>>>(x, mask, y, rows, heads, sq, sk, scale, causal);
    });
  } else if constexpr (VEC > 1) {
    dispatch_iters<kMaxIters>(plan.iters, [&](auto iters) {
      softmax_fwd_reg_kernel<T, VEC, decltype(iters)::value, false>
          <<<grid, block, 0, stream>>>(x, mask, y, rows, heads, sq, sk, scale, causal);
    });
  }
  return cudaGetLastError();
}

template <typename T, int VEC>
cudaError_t launch_bwd(const T* grad, const T* y, T* grad_x, int64_t rows, int64_t sk,
                       float scale, cudaStream_t stream) {
  constexpr int kMaxIters = kMaxElemsPerThread / VEC;
  const RowPlan plan = plan_rows<VEC>(rows, sk);
  if (plan.blocks > kMaxGrid) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(plan.blocks));
  const dim3 block(static_cast<unsigned>(plan.threads));
  if (plan.kind == RowPlan::kStream) {
    softmax_bwd_stream_kernel<T, VEC><<<grid, block, 0, stream>>>(grad, y, grad_x, sk, scale);
  } else if (plan.kind == RowPlan::kWarpRow) {
    dispatch_iters<kMaxIters>(plan.iters, [&](auto iters) {
      softmax_bwd_reg_kernel<T, VEC, decltype(iters)::value, true>
          <<<grid, block, 0, stream>>>(grad, y, grad_x, rows, sk, scale);
    });
  } else if constexpr (VEC > 1) {
    dispatch_iters<kMaxIters>(plan.iters, [&](auto iters) {
      softmax_bwd_reg_kernel<T, VEC, decltype(iters)::value, false>
          <<<grid, block, 0, stream>>>(grad, y, grad_x, rows, sk, scale);
    });
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t fwd(const T* x, SoftmaxMask mask, T* y, int64_t batch, int64_t heads, int64_t sq,
                int64_t sk, float scale, bool causal, cudaStream_t stream) {
  const int64_t rows = batch * heads * sq;
  if (rows == 0 || sk == 0) return cudaSuccess;
  constexpr int kVec = kPackBytes / sizeof(T);
  // Rows start on 16-byte boundaries when sk is a multiple of the pack and the base is aligned.
  if (sk % kVec == 0 && aligned(x) && aligned(y)) {
    return launch_fwd<T, kVec>(x, mask, y, rows, heads, sq, sk, scale, causal, stream);
  }
  return launch_fwd<T, 1>(x, mask, y, rows, heads, sq, sk, scale, causal, stream);
}

template <typename T>
cudaError_t bwd(const T* grad, const T* y, T* grad_x, int64_t rows, int64_t sk, float scale,
                cudaStream_t stream) {
  if (rows == 0 || sk == 0) return cudaSuccess;
  constexpr int kVec = kPackBytes / sizeof(T);
  if (sk % kVec == 0 && aligned(grad) && aligned(y) && aligned(grad_x)) {
    return launch_bwd<T, kVec>(grad, y, grad_x, rows, sk, scale, stream);
  }
  return launch_bwd<T, 1>(grad, y, grad_x, rows, sk, scale, stream);
}

}  // namespace

cudaError_t scaled_masked_softmax_fwd(const float* x, SoftmaxMask mask, float* y, int64_t batch,
                                      int64_t heads, int64_t sq, int64_t sk, float scale,
                                      bool causal, cudaStream_t stream) {
  return fwd(x, mask, y, batch, heads, sq, sk, scale, causal, stream);
}
cudaError_t scaled_masked_softmax_fwd(const __nv_bfloat16* x, SoftmaxMask mask, __nv_bfloat16* y,
                                      int64_t batch, int64_t heads, int64_t sq, int64_t sk,
                                      float scale, bool causal, cudaStream_t stream) {
  return fwd(x, mask, y, batch, heads, sq, sk, scale, causal, stream);
}
cudaError_t scaled_masked_softmax_fwd(const __half* x, SoftmaxMask mask, __half* y, int64_t batch,
                                      int64_t heads, int64_t sq, int64_t sk, float scale,
                                      bool causal, cudaStream_t stream) {
  return fwd(x, mask, y, batch, heads, sq, sk, scale, causal, stream);
}

cudaError_t scaled_masked_softmax_bwd(const float* grad, const float* y, float* grad_x,
                                      int64_t rows, int64_t sk, float scale, cudaStream_t stream) {
  return bwd(grad, y, grad_x, rows, sk, scale, stream);
}
cudaError_t scaled_masked_softmax_bwd(const __nv_bfloat16* grad, const __nv_bfloat16* y,
                                      __nv_bfloat16* grad_x, int64_t rows, int64_t sk, float scale,
                                      cudaStream_t stream) {
  return bwd(grad, y, grad_x, rows, sk, scale, stream);
}
cudaError_t scaled_masked_softmax_bwd(const __half* grad, const __half* y, __half* grad_x,
                                      int64_t rows, int64_t sk, float scale, cudaStream_t stream) {
  return bwd(grad, y, grad_x, rows, sk, scale, stream);
}

}  // namespace megapp::cuda
