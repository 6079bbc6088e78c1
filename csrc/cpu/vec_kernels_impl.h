// The row loops of vec_kernels.h, written once over at::vec::Vectorized and compiled once per
// instruction set: included by vec_kernels_default.cpp and vec_kernels_avx2.cpp, each of which
// defines MEGAPP_ROW_KERNELS_GETTER (the name of its table function) before including it.
//
// The math is the templates of megapp/gelu.h, swiglu.h, norm.h and cross_entropy.h, instantiated on
// Vectorized<acc_t> (Elementwise<Vectorized> below supplies exp and the NaN select), so every
// lane computes the same operations in the same order as the CUDA kernels (where the instruction
// set has FMA, the compiler contracts a·b + c into one rounding, as nvcc does).
// bf16/half data are widened to float in chunks (at::vec::convert_to_float) and rounded once on
// the way out (convert_from_float, round to nearest even). Partial vectors at the end of a row use
// masked loads (zero lanes) and stores, so every element goes through the same vector code.
//
// Row reductions add Vectorized lanes in a fixed order: four accumulators over consecutive
// vectors, then the lanes folded pairwise. Vectorized<float> has 8 lanes (4 for double) in both
// builds, so both add in the same order; the order depends on the row length alone.
//
// Nothing here allocates or needs a static initializer: the AVX2 build may only run on CPUs with
// AVX2.

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "megapp/cross_entropy.h"
#include "megapp/gelu.h"
#include "megapp/norm.h"
#include "megapp/philox.h"
#include "megapp/swiglu.h"
#include "vec_kernels.h"

#ifndef MEGAPP_ROW_KERNELS_GETTER
#error "define MEGAPP_ROW_KERNELS_GETTER before including vec_kernels_impl.h"
#endif

namespace megapp {

// exp and the NaN select of the formula templates, lane by lane.
template <typename S>
struct Elementwise<at::vec::Vectorized<S>> {
  using Vec = at::vec::Vectorized<S>;
  static Vec exp(const Vec& v) { return v.exp(); }
  static Vec sqrt(const Vec& v) { return v.sqrt(); }
  static Vec where_nonzero(const Vec& c, const Vec& a, const Vec& b) {
    return Vec::blendv(a, b, c == Vec(S(0)));
  }
};

namespace cpu_detail {
namespace {

template <typename T>
using acc_type = at::opmath_type<T>;

template <typename T>
constexpr bool kReduced = !std::is_same_v<T, acc_type<T>>;

// Elements of a row handled per staging buffer by the elementwise kernels (1 KiB of floats).
constexpr int64_t kChunk = 256;

// The first `count` lanes (at most size()) from p, zeros after.
template <typename A>
inline at::vec::Vectorized<A> load(const A* p, int64_t count) {
  using Vec = at::vec::Vectorized<A>;
  return count == Vec::size() ? Vec::loadu(p) : Vec::loadu(p, count);
}

template <typename A>
inline void store(const at::vec::Vectorized<A>& v, A* p, int64_t count) {
  using Vec = at::vec::Vectorized<A>;
  if (count == Vec::size()) {
    v.store(p);
  } else {
    v.store(p, static_cast<int>(count));
  }
}

// v with lanes from `count` on set to zero (a partial vector's contribution to a sum).
template <typename A>
inline at::vec::Vectorized<A> head(const at::vec::Vectorized<A>& v, int64_t count) {
  using Vec = at::vec::Vectorized<A>;
  return count == Vec::size() ? v : Vec::set(Vec(A(0)), v, count);
}

// fn(i, count) over [0, n) in whole vectors of A, then one partial vector.
template <typename A, typename Fn>
inline void for_each_vec(int64_t n, Fn&& fn) {
  constexpr int64_t kLanes = at::vec::Vectorized<A>::size();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) fn(i, kLanes);
  if (i < n) fn(i, n - i);
}

// Sum of the lanes of v, folded pairwise in a fixed order.
template <typename A>
inline A lane_sum(const at::vec::Vectorized<A>& v) {
  constexpr int kLanes = at::vec::Vectorized<A>::size();
  alignas(64) A lanes[kLanes];
  v.store(lanes);
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  }
  return lanes[0];
}

// Σ term(i, count) over [0, n): four vector accumulators over consecutive vectors, combined as
// (a0 + a1) + (a2 + a3), then lane_sum. term must return zeros in lanes >= count.
template <typename A, typename Term>
inline A row_sum(int64_t n, Term&& term) {
  using Vec = at::vec::Vectorized<A>;
  constexpr int64_t kLanes = Vec::size();
  Vec a0(A(0)), a1(A(0)), a2(A(0)), a3(A(0));
  int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    a0 = a0 + term(i, kLanes);
    a1 = a1 + term(i + kLanes, kLanes);
    a2 = a2 + term(i + 2 * kLanes, kLanes);
    a3 = a3 + term(i + 3 * kLanes, kLanes);
  }
  for (; i + kLanes <= n; i += kLanes) a0 = a0 + term(i, kLanes);
  if (i < n) a1 = a1 + term(i, n - i);
  return lane_sum<A>((a0 + a1) + (a2 + a3));
}

// dst[0, n) = float(src[0, n)) for bf16/half src.
template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  using RVec = at::vec::Vectorized<T>;
  using FVec = at::vec::Vectorized<float>;
  constexpr int64_t kLanes = RVec::size();  // 2 float vectors
  for (int64_t i = 0; i < n; i += kLanes) {
    const int64_t count = std::min(kLanes, n - i);
    const RVec r = count == kLanes ? RVec::loadu(src + i) : RVec::loadu(src + i, count);
    auto [lo, hi] = at::vec::convert_to_float<T>(r);
    if (count == kLanes) {
      lo.store(dst + i);
      hi.store(dst + i + FVec::size());
    } else {
      store<float>(lo, dst + i, std::min<int64_t>(count, FVec::size()));
      if (count > FVec::size()) store<float>(hi, dst + i + FVec::size(), count - FVec::size());
    }
  }
}

// dst[0, n) = src[0, n) rounded to bf16/half (to nearest even).
template <typename T>
inline void narrow(const float* src, T* dst, int64_t n) {
  using RVec = at::vec::Vectorized<T>;
  using FVec = at::vec::Vectorized<float>;
  constexpr int64_t kLanes = RVec::size();
  for (int64_t i = 0; i < n; i += kLanes) {
    const int64_t count = std::min(kLanes, n - i);
    const int64_t lo_count = std::min<int64_t>(count, FVec::size());
    const FVec lo = load<float>(src + i, lo_count);
    const FVec hi = count > FVec::size() ? load<float>(src + i + FVec::size(), count - lo_count)
                                         : FVec(0.0f);
    const RVec r = at::vec::convert_from_float<T>(lo, hi);
    if (count == kLanes) {
      r.store(dst + i);
    } else {
      r.store(dst + i, static_cast<int>(count));
    }
  }
}

// src[0, n) in acc_type<T>: src itself for float/double, else widened into buf.
template <typename T>
inline const acc_type<T>* as_acc(const T* src, int64_t n, acc_type<T>* buf) {
  if constexpr (kReduced<T>) {
    widen<T>(src, buf, n);
    return buf;
  } else {
    return src;
  }
}

// Where to compute an output destined for dst: dst itself for float/double, else buf (then call
// finish to round buf into dst).
template <typename T>
inline acc_type<T>* out_acc(T* dst, acc_type<T>* buf) {
  if constexpr (kReduced<T>) {
    return buf;
  } else {
    return dst;
  }
}

template <typename T>
inline void finish(const acc_type<T>* buf, T* dst, int64_t n) {
  if constexpr (kReduced<T>) narrow<T>(buf, dst, n);
}

// dst[0, n) = value(i, count) for each vector of A at i (count lanes valid), rounded to T on the
// way (bf16/half: two float vectors per store, no staging buffer).
template <typename T, typename Value>
inline void store_row(T* dst, int64_t n, Value&& value) {
  using A = acc_type<T>;
  if constexpr (!kReduced<T>) {
    for_each_vec<A>(n, [&](int64_t i, int64_t count) { store(value(i, count), dst + i, count); });
  } else {
    using RVec = at::vec::Vectorized<T>;
    using FVec = at::vec::Vectorized<float>;
    constexpr int64_t kLanes = RVec::size();  // 2 float vectors
    for (int64_t i = 0; i < n; i += kLanes) {
      const int64_t count = std::min(kLanes, n - i);
      const int64_t lo_count = std::min<int64_t>(count, FVec::size());
      const FVec lo = value(i, lo_count);
      const FVec hi = count > FVec::size() ? value(i + FVec::size(), count - lo_count) : FVec(0.0f);
      const RVec r = at::vec::convert_from_float<T>(lo, hi);
      if (count == kLanes) {
        r.store(dst + i);
      } else {
        r.store(dst + i, static_cast<int>(count));
      }
    }
  }
}

// One float vector's worth (count <= 8) of bf16/half at p, widened.
template <typename T>
inline at::vec::Vectorized<float> load_widened(const T* p, int64_t count) {
  constexpr int64_t kLanes = at::vec::Vectorized<float>::size();
  at::vec::Vectorized<float> v;
  if (count == kLanes) {
    at::vec::load_to_float<T>(p, v);
  } else {
    alignas(64) T part[kLanes];
    std::memset(static_cast<void*>(part), 0, sizeof(part));
    std::memcpy(static_cast<void*>(part), p, count * sizeof(T));
    at::vec::load_to_float<T>(part, v);
  }
  return v;
}

// Σ term(v) over the vectors v of src[0, n) in acc_type<T> (row_sum's order), and src as an
// acc_type<T> array: src itself for float/double, else widened into buf in the same pass.
template <typename T, typename Term>
inline const acc_type<T>* as_acc_sum(const T* src, int64_t n, acc_type<T>* buf, Term&& term,
                                     acc_type<T>& sum) {
  using A = acc_type<T>;
  if constexpr (kReduced<T>) {
    sum = row_sum<A>(n, [&](int64_t i, int64_t count) {
      const auto v = load_widened<T>(src + i, count);
      store(v, buf + i, count);
      return term(v);
    });
    return buf;
  } else {
    sum = row_sum<A>(n, [&](int64_t i, int64_t count) { return term(load(src + i, count)); });
    return src;
  }
}

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

// LayerNorm / RMSNorm -------------------------------------------------------------------------
//
// bf16/half rows are widened into scratch during the first pass (as_acc_sum) and read from there
// by the later ones (measured faster here than widening in every pass); outputs are rounded as
// they are stored (store_row).

// mean and rstd of one row x[0, cols); returns the row in acc_type<T>. Two passes over the row
// (it is in cache): the variance of the centred values does not cancel the way E[x²] − E[x]²
// does.
template <typename T>
inline const acc_type<T>* layer_norm_row_stats(const T* x, int64_t cols, acc_type<T> eps,
                                               acc_type<T>* scratch, acc_type<T>& mu,
                                               acc_type<T>& rs) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  const A n = static_cast<A>(cols);
  A sum;
  const A* xa = as_acc_sum<T>(x, cols, scratch, [](const Vec& v) { return v; }, sum);
  mu = sum / n;
  const Vec mu_v(mu);
  const A sq = row_sum<A>(cols, [&](int64_t i, int64_t count) {
    const Vec d = load(xa + i, count) - mu_v;
    return head(d * d, count);
  });
  rs = norm_rstd<A>(sq / n, eps);
  return xa;
}

// rstd of one row for RMSNorm; returns the row in acc_type<T>.
template <typename T>
inline const acc_type<T>* rms_norm_row_rstd(const T* x, int64_t cols, acc_type<T> eps,
                                            acc_type<T>* scratch, acc_type<T>& rs) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  A sq;
  const A* xa = as_acc_sum<T>(x, cols, scratch, [](const Vec& v) { return v * v; }, sq);
  rs = norm_rstd<A>(sq / static_cast<A>(cols), eps);
  return xa;
}

template <typename T>
void layer_norm_fwd(const T* x, const acc_type<T>* weight, const acc_type<T>* bias,
                    acc_type<T> eps, T* y, acc_type<T>* mean, acc_type<T>* rstd,
                    acc_type<T>* scratch, int64_t rows, int64_t cols) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  for (int64_t r = 0; r < rows; ++r) {
    A mu, rs;
    const A* xa = layer_norm_row_stats<T>(x + r * cols, cols, eps, scratch, mu, rs);
    const Vec mu_v(mu);
    const Vec rs_v(rs);
    store_row<T>(y + r * cols, cols, [&](int64_t i, int64_t count) {
      const Vec xhat = layer_norm_xhat<Vec>(load(xa + i, count), mu_v, rs_v);
      const Vec b = bias != nullptr ? load(bias + i, count) : Vec(A(0));
      return norm_affine<Vec>(xhat, load(weight + i, count), b);
    });
    mean[r] = mu;
    rstd[r] = rs;
  }
}

// The statistics of layer_norm_fwd alone, bit for bit.
template <typename T>
void layer_norm_stats(const T* x, acc_type<T> eps, acc_type<T>* mean, acc_type<T>* rstd,
                      acc_type<T>* scratch, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    layer_norm_row_stats<T>(x + r * cols, cols, eps, scratch, mean[r], rstd[r]);
  }
}

template <typename T>
void layer_norm_bwd(const T* grad, const T* saved, const acc_type<T>* mean,
                    const acc_type<T>* rstd, const acc_type<T>* weight, const acc_type<T>* bias,
                    bool memory_efficient, T* grad_input, acc_type<T>* grad_weight_acc,
                    acc_type<T>* grad_bias_acc, acc_type<T>* scratch, int64_t rows,
                    int64_t cols) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  const A n = static_cast<A>(cols);
  A* xhat = scratch;  // x̂ of the current row
  for (int64_t r = 0; r < rows; ++r) {
    const A* ga = as_acc<T>(grad + r * cols, cols, scratch + cols);
    const A* sa = as_acc<T>(saved + r * cols, cols, scratch + 2 * cols);
    const Vec rs_v(rstd[r]);
    const Vec mu_v(memory_efficient ? A(0) : mean[r]);
    Vec sum_wg(A(0));
    Vec sum_wg_xhat(A(0));
    for_each_vec<A>(cols, [&](int64_t i, int64_t count) {
      const Vec s = load(sa + i, count);
      const Vec w = load(weight + i, count);
      const Vec b = bias != nullptr ? load(bias + i, count) : Vec(A(0));
      const Vec xh = memory_efficient ? norm_xhat_from_output<Vec>(s, w, b)
                                      : layer_norm_xhat<Vec>(s, mu_v, rs_v);
      const Vec g = load(ga + i, count);
      const Vec wg = w * g;
      store(xh, xhat + i, count);
      // Zero lanes past the row end (x̂ is NaN there in the memory-efficient form).
      sum_wg = sum_wg + head(wg, count);
      sum_wg_xhat = sum_wg_xhat + head(wg * xh, count);
      store(load(grad_weight_acc + i, count) + g * xh, grad_weight_acc + i, count);
      store(load(grad_bias_acc + i, count) + g, grad_bias_acc + i, count);
    });
    const Vec mean_wg(lane_sum<A>(sum_wg) / n);
    const Vec mean_wg_xhat(lane_sum<A>(sum_wg_xhat) / n);
    store_row<T>(grad_input + r * cols, cols, [&](int64_t i, int64_t count) {
      const Vec wg = load(weight + i, count) * load(ga + i, count);
      return layer_norm_grad_input<Vec>(wg, load(xhat + i, count), rs_v, mean_wg, mean_wg_xhat);
    });
  }
}

template <typename T>
void rms_norm_fwd(const T* x, const acc_type<T>* weight, acc_type<T> eps, T* y,
                  acc_type<T>* rstd, acc_type<T>* scratch, int64_t rows, int64_t cols) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  for (int64_t r = 0; r < rows; ++r) {
    A rs;
    const A* xa = rms_norm_row_rstd<T>(x + r * cols, cols, eps, scratch, rs);
    const Vec rs_v(rs);
    store_row<T>(y + r * cols, cols, [&](int64_t i, int64_t count) {
      const Vec xhat = rms_norm_xhat<Vec>(load(xa + i, count), rs_v);
      return norm_affine<Vec>(xhat, load(weight + i, count), Vec(A(0)));
    });
    rstd[r] = rs;
  }
}

// The rstd of rms_norm_fwd alone, bit for bit.
template <typename T>
void rms_norm_stats(const T* x, acc_type<T> eps, acc_type<T>* rstd, acc_type<T>* scratch,
                    int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    rms_norm_row_rstd<T>(x + r * cols, cols, eps, scratch, rstd[r]);
  }
}

template <typename T>
void rms_norm_bwd(const T* grad, const T* saved, const acc_type<T>* rstd,
                  const acc_type<T>* weight, bool memory_efficient, T* grad_input,
                  acc_type<T>* grad_weight_acc, acc_type<T>* scratch, int64_t rows,
                  int64_t cols) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  const A n = static_cast<A>(cols);
  const Vec zero(A(0));
  A* xhat = scratch;  // x̂ of the current row
  for (int64_t r = 0; r < rows; ++r) {
    const A* ga = as_acc<T>(grad + r * cols, cols, scratch + cols);
    const A* sa = as_acc<T>(saved + r * cols, cols, scratch + 2 * cols);
    const Vec rs_v(rstd[r]);
    Vec sum_wg_xhat(A(0));
    for_each_vec<A>(cols, [&](int64_t i, int64_t count) {
      const Vec s = load(sa + i, count);
      const Vec w = load(weight + i, count);
      const Vec xh = memory_efficient ? norm_xhat_from_output<Vec>(s, w, zero)
                                      : rms_norm_xhat<Vec>(s, rs_v);
      const Vec g = load(ga + i, count);
      store(xh, xhat + i, count);
      sum_wg_xhat = sum_wg_xhat + head(w * g * xh, count);
      store(load(grad_weight_acc + i, count) + g * xh, grad_weight_acc + i, count);
    });
    const Vec mean_wg_xhat(lane_sum<A>(sum_wg_xhat) / n);
    store_row<T>(grad_input + r * cols, cols, [&](int64_t i, int64_t count) {
      const Vec wg = load(weight + i, count) * load(ga + i, count);
      return rms_norm_grad_input<Vec>(wg, load(xhat + i, count), rs_v, mean_wg_xhat);
    });
  }
}

// Cross entropy ---------------------------------------------------------------------------
//
// A vocabulary shard's rows are long (thousands of ids) and read straight from the logits: no
// staging buffer, bf16/half widened one float vector at a time.

// count (<= size()) elements at p as one vector of acc_type<T>, zeros after.
template <typename T>
inline at::vec::Vectorized<acc_type<T>> load_acc(const T* p, int64_t count) {
  if constexpr (kReduced<T>) {
    return load_widened<T>(p, count);
  } else {
    return load(p, count);
  }
}

// row_sum for N sums of one pass: term(i, count, acc) adds its N vectors (zeros in lanes >=
// count) into acc[0..N); the accumulators and the order are row_sum's.
template <typename A, int N, typename Term>
inline void row_sums(int64_t n, A (&out)[N], Term&& term) {
  using Vec = at::vec::Vectorized<A>;
  constexpr int64_t kLanes = Vec::size();
  Vec acc[4][N];
  for (auto& a : acc) {
    for (Vec& v : a) v = Vec(A(0));
  }
  int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    for (int j = 0; j < 4; ++j) term(i + j * kLanes, kLanes, acc[j]);
  }
  for (; i + kLanes <= n; i += kLanes) term(i, kLanes, acc[0]);
  if (i < n) term(i, n - i, acc[1]);
  for (int k = 0; k < N; ++k) {
    out[k] = lane_sum<A>((acc[0][k] + acc[1][k]) + (acc[2][k] + acc[3][k]));
  }
}

template <typename T>
void cross_entropy_fwd_max(const T* logits, acc_type<T>* row_max, int64_t rows, int64_t cols,
                           int64_t real) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  constexpr int64_t kLanes = Vec::size();
  const Vec neg_inf(-std::numeric_limits<A>::infinity());
  for (int64_t r = 0; r < rows; ++r) {
    const T* z = logits + r * cols;
    // Four independent maxima hide the latency; a max is exact, so the order does not matter.
    Vec a0 = neg_inf, a1 = neg_inf, a2 = neg_inf, a3 = neg_inf;
    int64_t i = 0;
    for (; i + 4 * kLanes <= real; i += 4 * kLanes) {
      a0 = at::vec::maximum(a0, load_acc<T>(z + i, kLanes));
      a1 = at::vec::maximum(a1, load_acc<T>(z + i + kLanes, kLanes));
      a2 = at::vec::maximum(a2, load_acc<T>(z + i + 2 * kLanes, kLanes));
      a3 = at::vec::maximum(a3, load_acc<T>(z + i + 3 * kLanes, kLanes));
    }
    for (; i < real; i += kLanes) {
      const int64_t count = std::min(kLanes, real - i);
      // Lanes past the real ids are −∞, not the zeros of a masked load.
      a0 = at::vec::maximum(a0, Vec::set(neg_inf, load_acc<T>(z + i, count), count));
    }
    alignas(64) A lanes[kLanes];
    at::vec::maximum(at::vec::maximum(a0, a1), at::vec::maximum(a2, a3)).store(lanes);
    A m = lanes[0];
    for (int64_t l = 1; l < kLanes; ++l) {
      if (std::isnan(lanes[l]) || lanes[l] > m) m = lanes[l];  // NaN propagates, as in torch
    }
    row_max[r] = m;
  }
}

// Ids per partial sum of a vocabulary row: each of row_sums' 32 float lanes adds at most 32
// terms, and the chunk totals are added in order, so the rounding error grows with
// kSumChunk/32 + cols/kSumChunk rather than with cols/32 (a 32000-id row of bf16 logits, whose
// few distinct values round alike, drifted 1e-5 in Σ (z − m) when summed in one go).
constexpr int64_t kSumChunk = 1024;

template <typename T>
void cross_entropy_fwd_sums(const T* logits, const int64_t* target, const acc_type<T>* row_max,
                            acc_type<T>* sums, int64_t n_sums, int64_t rows, int64_t cols,
                            int64_t start, int64_t real) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  const bool smoothing = n_sums == 3;
  for (int64_t r = 0; r < rows; ++r) {
    const T* z = logits + r * cols;
    const A m = row_max[r];
    const Vec m_v(m);
    A total[2] = {A(0), A(0)};  // Σ exp(z − m), Σ (z − m)
    for (int64_t c0 = 0; c0 < real; c0 += kSumChunk) {
      A part[2];
      row_sums<A, 2>(std::min(kSumChunk, real - c0), part,
                     [&](int64_t i, int64_t count, Vec (&acc)[2]) {
                       const Vec zv = load_acc<T>(z + c0 + i, count);
                       acc[0] = acc[0] + head(cross_entropy_exp<Vec>(zv, m_v), count);
                       if (smoothing) {
                         acc[1] = acc[1] + head(cross_entropy_shifted<Vec>(zv, m_v), count);
                       }
                     });
      total[0] += part[0];
      total[1] += part[1];
    }
    const int64_t local = cross_entropy_local_target(target[r], start, real);
    A* out = sums + r * n_sums;
    out[0] = total[0];
    out[1] = local >= 0 ? cross_entropy_shifted<A>(static_cast<A>(z[local]), m) : A(0);
    if (smoothing) out[2] = total[1];
  }
}

template <typename T>
void cross_entropy_bwd(const acc_type<T>* grad_loss, const T* logits, const int64_t* target,
                       const acc_type<T>* row_max, const acc_type<T>* log_z, T* grad,
                       acc_type<T> one_minus_eps, acc_type<T> eps_over_k, int64_t rows,
                       int64_t cols, int64_t start, int64_t real) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  constexpr int64_t kLanes = Vec::size();
  const Vec eps_over_k_v(eps_over_k);
  for (int64_t r = 0; r < rows; ++r) {
    const T* z = logits + r * cols;
    T* g = grad + r * cols;
    const Vec m_v(row_max[r]);
    const Vec log_z_v(log_z[r]);
    const Vec g_v(grad_loss[r]);
    const int64_t local = cross_entropy_local_target(target[r], start, real);
    store_row<T>(g, real, [&](int64_t i, int64_t count) {
      Vec hit(A(0));
      if (local >= i && local < i + count) {  // the one vector holding the target
        alignas(64) A lanes[kLanes] = {};
        lanes[local - i] = one_minus_eps;
        hit = Vec::loadu(lanes);
      }
      const Vec p = cross_entropy_prob<Vec>(load_acc<T>(z + i, count), m_v, log_z_v);
      return cross_entropy_grad<Vec>(p, hit, eps_over_k_v, g_v);
    });
    std::fill(g + real, g + cols, T(0));  // padding ids
  }
}

template <typename T>
constexpr RowKernels<T> kTable = {
    &bias_gelu_fwd<T>,       &bias_gelu_bwd<T>,       &bias_swiglu_fwd<T>, &bias_swiglu_bwd<T>,
    &layer_norm_fwd<T>,      &layer_norm_bwd<T>,      &layer_norm_stats<T>,
    &bias_dropout_add_fwd<T>, &bias_dropout_add_bwd<T>, &rms_norm_fwd<T>,   &rms_norm_bwd<T>,
    &rms_norm_stats<T>,
    &cross_entropy_fwd_max<T>, &cross_entropy_fwd_sums<T>, &cross_entropy_bwd<T>,
};

}  // namespace

template <typename T>
const RowKernels<T>& MEGAPP_ROW_KERNELS_GETTER() {
  return kTable<T>;
}

template const RowKernels<float>& MEGAPP_ROW_KERNELS_GETTER<float>();
template const RowKernels<double>& MEGAPP_ROW_KERNELS_GETTER<double>();
template const RowKernels<c10::BFloat16>& MEGAPP_ROW_KERNELS_GETTER<c10::BFloat16>();
template const RowKernels<c10::Half>& MEGAPP_ROW_KERNELS_GETTER<c10::Half>();

}  // namespace cpu_detail
}  // namespace megapp
