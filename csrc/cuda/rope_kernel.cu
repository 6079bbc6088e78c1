// CUDA kernels for rotary position embedding (forward and its transpose). No torch headers: raw
// pointers, shapes and a stream in, cudaError_t out. Per-pair math is megapp/rope.h, shared with
// the CPU kernels; arithmetic is in float.
//
// Block (pos, chunk) handles rows [chunk·R, chunk·R + R) of position pos. threadIdx.x walks the
// channel pairs (VEC pairs per thread, 16-byte accesses to both halves when aligned) and computes
// their sin/cos once; threadIdx.y walks the rows, so each sincos serves R / blockDim.y rows.
#include "rope_kernel.h"

#include <math.h>

#include <algorithm>
#include <cstdint>

#include "megapp/cuda_common.cuh"
#include "megapp/rope.h"

namespace megapp::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxPairThreads = 128;  // threadIdx.x extent; the rest of the block spans rows
constexpr int kRowsPerThread = 4;     // rows sharing one sincos per thread
constexpr int kPackBytes = 16;
constexpr int64_t kMaxGridX = 0x7fffffff;
constexpr int64_t kMaxGridY = 65535;


template <typename T, int VEC, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(const T* __restrict__ src, const float* __restrict__ freqs, T* __restrict__ out,
                int64_t bh, int64_t d, int64_t rot_dim, int64_t rows_per_block) {
  const int64_t pos = blockIdx.x;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  const int64_t row_end = row_begin + rows_per_block < bh ? row_begin + rows_per_block : bh;
  const int64_t half = rot_dim / 2;
  const float* f = freqs + pos * rot_dim;
  const T* src_pos = src + pos * bh * d;
  T* out_pos = out + pos * bh * d;

  for (int64_t j0 = static_cast<int64_t>(threadIdx.x) * VEC; j0 < half;
       j0 += static_cast<int64_t>(blockDim.x) * VEC) {
    float c1[VEC], s1[VEC], c2[VEC], s2[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      rope_sincos(f[j0 + e], &s1[e], &c1[e]);
      rope_sincos(f[j0 + half + e], &s2[e], &c2[e]);
    }
    for (int64_t r = row_begin + threadIdx.y; r < row_end; r += blockDim.y) {
      const T* sr = src_pos + r * d;
      T* orow = out_pos + r * d;
      const Pack<T, VEC> a = load_pack<T, VEC>(sr + j0);
      const Pack<T, VEC> b = load_pack<T, VEC>(sr + j0 + half);
      Pack<T, VEC> oa, ob;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float v1, v2;
        if constexpr (kBackward) {
          rope_bwd_pair(to_acc(a.v[e]), to_acc(b.v[e]), c1[e], s1[e], c2[e], s2[e], &v1, &v2);
        } else {
          rope_fwd_pair(to_acc(a.v[e]), to_acc(b.v[e]), c1[e], s1[e], c2[e], s2[e], &v1, &v2);
        }
        oa.v[e] = from_acc<T>(v1);
        ob.v[e] = from_acc<T>(v2);
      }
      store_pack<T, VEC>(orow + j0, oa);
      store_pack<T, VEC>(orow + j0 + half, ob);
    }
  }
  // Channels past rot_dim pass through (rot_dim and d are multiples of VEC).
  for (int64_t r = row_begin + threadIdx.y; r < row_end; r += blockDim.y) {
    for (int64_t c = rot_dim + static_cast<int64_t>(threadIdx.x) * VEC; c < d;
         c += static_cast<int64_t>(blockDim.x) * VEC) {
      store_pack<T, VEC>(out_pos + r * d + c, load_pack<T, VEC>(src_pos + r * d + c));
    }
  }
}

int pow2_at_least(int64_t n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kPackBytes == 0; }

template <typename T, int VEC, bool kBackward>
cudaError_t launch_vec(const T* src, const float* freqs, T* out, int64_t seq, int64_t bh,
                       int64_t d, int64_t rot_dim, cudaStream_t stream) {
  const int64_t pair_packs = rot_dim / 2 / VEC;
  const int tx = static_cast<int>(std::min<int64_t>(pow2_at_least(pair_packs), kMaxPairThreads));
  const int ty = kThreads / tx;
  // Enough rows per block to amortize sincos, more if bh would overflow gridDim.y.
  const int64_t rows_per_block =
      std::max<int64_t>(static_cast<int64_t>(ty) * kRowsPerThread, ceil_div(bh, kMaxGridY));
  const int64_t chunks = ceil_div(bh, rows_per_block);
  if (seq > kMaxGridX) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(seq), static_cast<unsigned>(chunks));
  const dim3 block(static_cast<unsigned>(tx), static_cast<unsigned>(ty));
  rope_kernel<T, VEC, kBackward>
      <<<grid, block, 0, stream>>>(src, freqs, out, bh, d, rot_dim, rows_per_block);
  return cudaGetLastError();
}

template <bool kBackward, typename T>
cudaError_t launch(const T* src, const float* freqs, T* out, int64_t seq, int64_t bh, int64_t d,
                   int64_t rot_dim, cudaStream_t stream) {
  if (seq == 0 || bh == 0 || d == 0) return cudaSuccess;
  constexpr int kVec = kPackBytes / sizeof(T);
  // Both halves and every row start on 16-byte boundaries.
  if ((rot_dim / 2) % kVec == 0 && d % kVec == 0 && aligned(src) && aligned(out)) {
    return launch_vec<T, kVec, kBackward>(src, freqs, out, seq, bh, d, rot_dim, stream);
  }
  return launch_vec<T, 1, kBackward>(src, freqs, out, seq, bh, d, rot_dim, stream);
}

}  // namespace

cudaError_t rope_fwd(const float* x, const float* freqs, float* y, int64_t seq, int64_t bh,
                     int64_t d, int64_t rot_dim, cudaStream_t stream) {
  return launch<false>(x, freqs, y, seq, bh, d, rot_dim, stream);
}
cudaError_t rope_fwd(const __nv_bfloat16* x, const float* freqs, __nv_bfloat16* y, int64_t seq,
                     int64_t bh, int64_t d, int64_t rot_dim, cudaStream_t stream) {
  return launch<false>(x, freqs, y, seq, bh, d, rot_dim, stream);
}
cudaError_t rope_fwd(const __half* x, const float* freqs, __half* y, int64_t seq, int64_t bh,
                     int64_t d, int64_t rot_dim, cudaStream_t stream) {
  return launch<false>(x, freqs, y, seq, bh, d, rot_dim, stream);
}

cudaError_t rope_bwd(const float* grad, const float* freqs, float* grad_x, int64_t seq,
                     int64_t bh, int64_t d, int64_t rot_dim, cudaStream_t stream) {
  return launch<true>(grad, freqs, grad_x, seq, bh, d, rot_dim, stream);
}
cudaError_t rope_bwd(const __nv_bfloat16* grad, const float* freqs, __nv_bfloat16* grad_x,
                     int64_t seq, int64_t bh, int64_t d, int64_t rot_dim, cudaStream_t stream) {
  return launch<true>(grad, freqs, grad_x, seq, bh, d, rot_dim, stream);
}
cudaError_t rope_bwd(const __half* grad, const float* freqs, __half* grad_x, int64_t seq,
                     int64_t bh, int64_t d, int64_t rot_dim, cudaStream_t stream) {
  return launch<true>(grad, freqs, grad_x, seq, bh, d, rot_dim, stream);
}

}  // namespace megapp::cuda
