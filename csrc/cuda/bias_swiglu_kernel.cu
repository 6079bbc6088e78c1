// CUDA kernels for bias + SwiGLU. No torch headers: raw pointers, shapes and a stream in,
// cudaError_t out. Math is in float via megapp/swiglu.h, shared with the CPU kernels.
//
// Loads and stores are 16-byte vectors (4 floats or 8 bf16/half) when f is a multiple of the
// vector width and every pointer is 16-byte aligned, element-wise otherwise.
#include "bias_swiglu_kernel.h"

#include <algorithm>

#include "megapp/cuda_bias_grad.cuh"
#include "megapp/cuda_common.cuh"
#include "megapp/swiglu.h"

namespace megapp::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxForwardBlocks = 1 << 16;  // grid-stride loop covers the rest
using bias_grad::num_chunks;

// Thread i handles outputs [N·(i mod f/N), +N) of row i / (f/N); N divides f.
template <typename T, int N, bool kHasBias>
__global__ void bias_swiglu_fwd_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                       T* __restrict__ y, int64_t rows, int64_t f) {
  const int64_t groups = f / N;
  const int64_t total = rows * groups;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t r = i / groups;
    const int64_t c = (i - r * groups) * N;
    const T* xr = x + r * 2 * f;
    const Pack<T, N> gate = load_pack<T, N>(xr + c);
    const Pack<T, N> up = load_pack<T, N>(xr + f + c);
    Pack<T, N> bias_gate, bias_up;
    if constexpr (kHasBias) {
      bias_gate = load_pack<T, N>(bias + c);
      bias_up = load_pack<T, N>(bias + f + c);
    }
    Pack<T, N> out;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float g = to_acc(gate.v[j]);
      float u = to_acc(up.v[j]);
      if constexpr (kHasBias) {
        g += to_acc(bias_gate.v[j]);
        u += to_acc(bias_up.v[j]);
      }
      out.v[j] = from_acc<T>(swiglu_fwd<float>(g, u));
    }
    store_pack<T, N>(y + r * f + c, out);
  }
}

// Thread (column group blockIdx.x·blockDim.x + threadIdx.x, chunk blockIdx.y) writes grad_input
// for N gate and N up columns over the chunk's rows and, with a workspace, the float sums of
// those values into workspace[chunk, ·]. Adjacent threads touch adjacent vectors of one row.
template <typename T, int N, bool kHasBias>
__global__ void bias_swiglu_bwd_kernel(const T* __restrict__ grad, const T* __restrict__ x,
                                       const T* __restrict__ bias, T* __restrict__ grad_input,
                                       float* __restrict__ workspace, int64_t rows, int64_t f,
                                       int64_t rows_per_chunk) {
  const int64_t group = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (group >= f / N) return;
  const int64_t c = group * N;
  const int64_t cols = 2 * f;
  const int64_t chunk = blockIdx.y;
  const int64_t row_begin = chunk * rows_per_chunk;
  const int64_t row_end = row_begin + rows_per_chunk < rows ? row_begin + rows_per_chunk : rows;
  float bias_gate[N], bias_up[N], acc_gate[N], acc_up[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    bias_gate[j] = kHasBias ? to_acc(bias[c + j]) : 0.f;
    bias_up[j] = kHasBias ? to_acc(bias[f + c + j]) : 0.f;
    acc_gate[j] = 0.f;
    acc_up[j] = 0.f;
  }
  for (int64_t r = row_begin; r < row_end; ++r) {
    const Pack<T, N> dy = load_pack<T, N>(grad + r * f + c);
    const Pack<T, N> gate = load_pack<T, N>(x + r * cols + c);
    const Pack<T, N> up = load_pack<T, N>(x + r * cols + f + c);
    Pack<T, N> dgate, dup;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float g = to_acc(gate.v[j]);
      float u = to_acc(up.v[j]);
      if constexpr (kHasBias) {  // no "+ 0" without a bias: keeps −0 as the CPU kernel does
        g += bias_gate[j];
        u += bias_up[j];
      }
      float dg, du;
      swiglu_bwd<float>(g, u, to_acc(dy.v[j]), dg, du);
      dgate.v[j] = from_acc<T>(dg);
      dup.v[j] = from_acc<T>(du);
      acc_gate[j] += dg;
      acc_up[j] += du;
    }
    store_pack<T, N>(grad_input + r * cols + c, dgate);
    store_pack<T, N>(grad_input + r * cols + f + c, dup);
  }
  if (workspace == nullptr) return;
  float* ws = workspace + chunk * cols;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    ws[c + j] = acc_gate[j];
    ws[f + c + j] = acc_up[j];
  }
}

template <typename T, int N>
cudaError_t launch_fwd_vec(const T* x, const T* bias, T* y, int64_t rows, int64_t f,
                           cudaStream_t stream) {
  const int64_t total = rows * (f / N);
  const unsigned blocks =
      static_cast<unsigned>(std::min(ceil_div(total, kThreads), kMaxForwardBlocks));
  if (bias != nullptr) {
    bias_swiglu_fwd_kernel<T, N, true><<<blocks, kThreads, 0, stream>>>(x, bias, y, rows, f);
  } else {
    bias_swiglu_fwd_kernel<T, N, false><<<blocks, kThreads, 0, stream>>>(x, bias, y, rows, f);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_fwd(const T* x, const T* bias, T* y, int64_t rows, int64_t f,
                       cudaStream_t stream) {
  if (rows * f == 0) return cudaSuccess;
  constexpr int kVec = 16 / sizeof(T);
  if (f % kVec == 0 && is_aligned(x, 16) && is_aligned(bias, 16) && is_aligned(y, 16)) {
    return launch_fwd_vec<T, kVec>(x, bias, y, rows, f, stream);
  }
  return launch_fwd_vec<T, 1>(x, bias, y, rows, f, stream);
}

template <typename T, int N>
cudaError_t launch_bwd_vec(const T* grad, const T* x, const T* bias, T* grad_input,
                           float* workspace, int64_t rows, int64_t f, int64_t chunks,
                           cudaStream_t stream) {
  const int64_t groups = f / N;
  const int64_t rows_per_chunk = std::max<int64_t>(1, ceil_div(rows, chunks));
  // Narrow f: fewer threads per block instead of idle ones (a multiple of the warp size).
  const int threads = static_cast<int>(std::min<int64_t>(kThreads, ceil_div(groups, 32) * 32));
  const dim3 grid(static_cast<unsigned>(ceil_div(groups, threads)), static_cast<unsigned>(chunks));
  if (bias != nullptr) {
    bias_swiglu_bwd_kernel<T, N, true><<<grid, threads, 0, stream>>>(
        grad, x, bias, grad_input, workspace, rows, f, rows_per_chunk);
  } else {
    bias_swiglu_bwd_kernel<T, N, false><<<grid, threads, 0, stream>>>(
        grad, x, bias, grad_input, workspace, rows, f, rows_per_chunk);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(const T* grad, const T* x, const T* bias, T* grad_input, T* grad_bias,
                       float* workspace, int64_t rows, int64_t f, cudaStream_t stream) {
  if (f == 0) return cudaSuccess;
  const int64_t chunks = num_chunks(rows, f);
  if (grad_bias == nullptr) workspace = nullptr;
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = f % kVec == 0 && is_aligned(grad, 16) && is_aligned(x, 16) &&
                   is_aligned(bias, 16) && is_aligned(grad_input, 16);
  const cudaError_t err =
      vec ? launch_bwd_vec<T, kVec>(grad, x, bias, grad_input, workspace, rows, f, chunks, stream)
          : launch_bwd_vec<T, 1>(grad, x, bias, grad_input, workspace, rows, f, chunks, stream);
  if (err != cudaSuccess || grad_bias == nullptr) return err;
  const int64_t cols = 2 * f;
  return bias_grad::sum_chunks(workspace, grad_bias, chunks, cols, stream);
}

}  // namespace

int64_t bias_swiglu_bwd_workspace_numel(int64_t rows, int64_t f) {
  return num_chunks(rows, f) * 2 * f;
}

cudaError_t bias_swiglu_fwd(const float* x, const float* bias, float* y, int64_t rows, int64_t f,
                            cudaStream_t stream) {
  return launch_fwd(x, bias, y, rows, f, stream);
}
cudaError_t bias_swiglu_fwd(const __nv_bfloat16* x, const __nv_bfloat16* bias, __nv_bfloat16* y,
                            int64_t rows, int64_t f, cudaStream_t stream) {
  return launch_fwd(x, bias, y, rows, f, stream);
}
cudaError_t bias_swiglu_fwd(const __half* x, const __half* bias, __half* y, int64_t rows,
                            int64_t f, cudaStream_t stream) {
  return launch_fwd(x, bias, y, rows, f, stream);
}

cudaError_t bias_swiglu_bwd(const float* grad, const float* x, const float* bias,
                            float* grad_input, float* grad_bias, float* workspace, int64_t rows,
                            int64_t f, cudaStream_t stream) {
  return launch_bwd(grad, x, bias, grad_input, grad_bias, workspace, rows, f, stream);
}
cudaError_t bias_swiglu_bwd(const __nv_bfloat16* grad, const __nv_bfloat16* x,
                            const __nv_bfloat16* bias, __nv_bfloat16* grad_input,
                            __nv_bfloat16* grad_bias, float* workspace, int64_t rows, int64_t f,
                            cudaStream_t stream) {
  return launch_bwd(grad, x, bias, grad_input, grad_bias, workspace, rows, f, stream);
}
cudaError_t bias_swiglu_bwd(const __half* grad, const __half* x, const __half* bias,
                            __half* grad_input, __half* grad_bias, float* workspace, int64_t rows,
                            int64_t f, cudaStream_t stream) {
  return launch_bwd(grad, x, bias, grad_input, grad_bias, workspace, rows, f, stream);
}

}  // namespace megapp::cuda
