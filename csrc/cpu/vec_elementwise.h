// Row loops of bias + GeLU, bias + SwiGLU and bias + dropout + residual. See vec_kernels_impl.h.
#pragma once

#include "megapp/gelu.h"
#include "megapp/philox.h"
#include "megapp/swiglu.h"
#include "vec_common.h"

namespace megapp::cpu_detail {
namespace {

// bias + GeLU ---------------------------------------------------------------------------------

template <typename T>
void bias_gelu_fwd(const T* x, const acc_type<T>* bias, T* y, int64_t rows, int64_t cols) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  alignas(64) A in_buf[kChunk];
  alignas(64) A out_buf[kChunk];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c0 = 0; c0 < cols; c0 += kChunk) {
      const int64_t n = std::min(kChunk, cols - c0);
      const A* xa = as_acc<T>(x + r * cols + c0, n, in_buf);
      A* ya = out_acc<T>(y + r * cols + c0, out_buf);
      const A* b = bias + c0;
      for_each_vec<A>(n, [&](int64_t i, int64_t count) {
        const Vec z = load(xa + i, count) + load(b + i, count);
        store(gelu_tanh_fwd<Vec>(z), ya + i, count);
      });
      finish<T>(ya, y + r * cols + c0, n);
    }
  }
}

template <typename T>
void bias_gelu_bwd(const T* grad, const T* x, const acc_type<T>* bias, T* grad_input,
                   acc_type<T>* grad_bias_acc, int64_t rows, int64_t cols) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  alignas(64) A grad_buf[kChunk];
  alignas(64) A x_buf[kChunk];
  alignas(64) A out_buf[kChunk];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c0 = 0; c0 < cols; c0 += kChunk) {
      const int64_t n = std::min(kChunk, cols - c0);
      const int64_t off = r * cols + c0;
      const A* ga = as_acc<T>(grad + off, n, grad_buf);
      const A* xa = as_acc<T>(x + off, n, x_buf);
      A* gia = out_acc<T>(grad_input + off, out_buf);
      const A* b = bias + c0;
      A* acc = grad_bias_acc + c0;
      for_each_vec<A>(n, [&](int64_t i, int64_t count) {
        const Vec z = load(xa + i, count) + load(b + i, count);
        const Vec g = load(ga + i, count) * gelu_tanh_grad<Vec>(z);
        store(g, gia + i, count);
        store(load(acc + i, count) + g, acc + i, count);
      });
      finish<T>(gia, grad_input + off, n);
    }
  }
}

// bias + SwiGLU -------------------------------------------------------------------------------

template <typename T>
void bias_swiglu_fwd(const T* x, const acc_type<T>* bias, T* y, int64_t rows, int64_t f) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  alignas(64) A gate_buf[kChunk];
  alignas(64) A up_buf[kChunk];
  alignas(64) A out_buf[kChunk];
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + r * 2 * f;
    const T* up = gate + f;
    for (int64_t c0 = 0; c0 < f; c0 += kChunk) {
      const int64_t n = std::min(kChunk, f - c0);
      const A* ga = as_acc<T>(gate + c0, n, gate_buf);
      const A* ua = as_acc<T>(up + c0, n, up_buf);
      A* ya = out_acc<T>(y + r * f + c0, out_buf);
      for_each_vec<A>(n, [&](int64_t i, int64_t count) {
        Vec g = load(ga + i, count);
        Vec u = load(ua + i, count);
        if (bias != nullptr) {
          g = g + load(bias + c0 + i, count);
          u = u + load(bias + f + c0 + i, count);
        }
        store(swiglu_fwd<Vec>(g, u), ya + i, count);
      });
      finish<T>(ya, y + r * f + c0, n);
    }
  }
}

template <typename T>
void bias_swiglu_bwd(const T* grad, const T* x, const acc_type<T>* bias, T* grad_input,
                     acc_type<T>* grad_bias_acc, int64_t rows, int64_t f) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  alignas(64) A dy_buf[kChunk];
  alignas(64) A gate_buf[kChunk];
  alignas(64) A up_buf[kChunk];
  alignas(64) A dgate_buf[kChunk];
  alignas(64) A dup_buf[kChunk];
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + r * 2 * f;
    const T* up = gate + f;
    T* dgate = grad_input + r * 2 * f;
    T* dup = dgate + f;
    for (int64_t c0 = 0; c0 < f; c0 += kChunk) {
      const int64_t n = std::min(kChunk, f - c0);
      const A* dya = as_acc<T>(grad + r * f + c0, n, dy_buf);
      const A* ga = as_acc<T>(gate + c0, n, gate_buf);
      const A* ua = as_acc<T>(up + c0, n, up_buf);
      A* dga = out_acc<T>(dgate + c0, dgate_buf);
      A* dua = out_acc<T>(dup + c0, dup_buf);
      for_each_vec<A>(n, [&](int64_t i, int64_t count) {
        Vec g = load(ga + i, count);
        Vec u = load(ua + i, count);
        if (bias != nullptr) {
          g = g + load(bias + c0 + i, count);
          u = u + load(bias + f + c0 + i, count);
        }
        Vec dg, du;
        swiglu_bwd<Vec>(g, u, load(dya + i, count), dg, du);
        store(dg, dga + i, count);
        store(du, dua + i, count);
        if (grad_bias_acc != nullptr) {
          A* acc_gate = grad_bias_acc + c0 + i;
          A* acc_up = grad_bias_acc + f + c0 + i;
          store(load(acc_gate, count) + dg, acc_gate, count);
          store(load(acc_up, count) + du, acc_up, count);
        }
      });
      finish<T>(dga, dgate + c0, n);
      finish<T>(dua, dup + c0, n);
    }
  }
}

// bias + dropout + residual ------------------------------------------------------------------

// Philox blocks drawn per batch: independent counters the compiler can run side by side in
// vector lanes (dropout_philox_block's rounds unroll completely).
constexpr int64_t kPhiloxBatch = 8;
// Blocks covering kChunk counters at any alignment, rounded up to whole batches.
constexpr int64_t kChunkBlocks =
    (kChunk / 4 + 2 + kPhiloxBatch - 1) / kPhiloxBatch * kPhiloxBatch;

// keep[i] = 1 if counter n + i is kept, else 0, for i < count <= kChunk.
template <typename A>
inline void dropout_keep_flags(const DropoutMask& mask, uint64_t n, int64_t count, A* keep) {
  const uint64_t block0 = n >> 2;
  const int64_t blocks = static_cast<int64_t>(((n + count - 1) >> 2) - block0 + 1);
  alignas(64) uint32_t draws[4 * kChunkBlocks];
  for (int64_t b = 0; b < blocks; b += kPhiloxBatch) {
    for (int64_t j = 0; j < kPhiloxBatch; ++j) {
      const PhiloxBlock block = dropout_philox_block(mask.seed, block0 + b + j);
      for (int k = 0; k < 4; ++k) draws[4 * (b + j) + k] = block.v[k];
    }
  }
  const uint32_t* first = draws + (n & 3);
  for (int64_t i = 0; i < count; ++i) keep[i] = first[i] < mask.threshold ? A(1) : A(0);
}

// z kept and scaled, or exactly 0: the select of the scalar formula, lane by lane.
template <typename A>
inline at::vec::Vectorized<A> dropout_apply(const at::vec::Vectorized<A>& z,
                                            const at::vec::Vectorized<A>& keep,
                                            const at::vec::Vectorized<A>& scale) {
  using Vec = at::vec::Vectorized<A>;
  return Vec::blendv(Vec(A(0)), z * scale, keep == Vec(A(1)));
}

template <typename T>
void bias_dropout_add_fwd(const T* x, const acc_type<T>* bias, const T* residual, T* out,
                          const DropoutMask& mask, int64_t row0, int64_t rows, int64_t cols) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  const Vec scale(static_cast<A>(mask.scale));
  alignas(64) A x_buf[kChunk];
  alignas(64) A res_buf[kChunk];
  alignas(64) A out_buf[kChunk];
  alignas(64) A keep[kChunk];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = (row0 + r) * cols;
    for (int64_t c0 = 0; c0 < cols; c0 += kChunk) {
      const int64_t n = std::min(kChunk, cols - c0);
      const int64_t off = r * cols + c0;
      const A* xa = as_acc<T>(x + off, n, x_buf);
      const A* ra = as_acc<T>(residual + off, n, res_buf);
      A* oa = out_acc<T>(out + off, out_buf);
      if (mask.active) dropout_keep_flags<A>(mask, mask.offset + row + c0, n, keep);
      for_each_vec<A>(n, [&](int64_t i, int64_t count) {
        Vec z = load(xa + i, count);
        if (bias != nullptr) z = z + load(bias + c0 + i, count);
        if (mask.active) z = dropout_apply<A>(z, load(keep + i, count), scale);
        store(load(ra + i, count) + z, oa + i, count);
      });
      finish<T>(oa, out + off, n);
    }
  }
}

template <typename T>
void bias_dropout_add_bwd(const T* grad, T* grad_x, acc_type<T>* grad_bias_acc,
                          const DropoutMask& mask, int64_t row0, int64_t rows, int64_t cols) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  const Vec scale(static_cast<A>(mask.scale));
  alignas(64) A grad_buf[kChunk];
  alignas(64) A out_buf[kChunk];
  alignas(64) A keep[kChunk];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = (row0 + r) * cols;
    for (int64_t c0 = 0; c0 < cols; c0 += kChunk) {
      const int64_t n = std::min(kChunk, cols - c0);
      const int64_t off = r * cols + c0;
      const A* ga = as_acc<T>(grad + off, n, grad_buf);
      A* gxa = out_acc<T>(grad_x + off, out_buf);
      if (mask.active) dropout_keep_flags<A>(mask, mask.offset + row + c0, n, keep);
      for_each_vec<A>(n, [&](int64_t i, int64_t count) {
        Vec g = load(ga + i, count);
        if (mask.active) g = dropout_apply<A>(g, load(keep + i, count), scale);
        store(g, gxa + i, count);
        if (grad_bias_acc != nullptr) {
          A* acc = grad_bias_acc + c0 + i;
          store(load(acc, count) + g, acc, count);
        }
      });
      finish<T>(gxa, grad_x + off, n);
    }
  }
}

}  // namespace
}  // namespace megapp::cpu_detail
