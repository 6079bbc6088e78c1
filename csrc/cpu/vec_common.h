// Vector helpers of the CPU row loops (vec_*.h): loads and stores of partial vectors, widening
// of bf16/half, and row sums and maxima in a fixed order. See vec_kernels_impl.h.
#pragma once

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

#include "megapp/common.h"
#include "vec_kernels.h"

// Inlines every call in a loop so marked: with the baseline build's generic Vectorized, GCC keeps
// the helpers and formula templates below as calls that pass each vector through the stack (RoPE
// ran 2.5× slower); the AVX2 build inlines them either way.
#if defined(__GNUC__)
#define MEGAPP_VEC_FLATTEN __attribute__((flatten))
#else
#define MEGAPP_VEC_FLATTEN
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

// dst[0, n) = buf[0, n) rounded to bf16/half (to nearest even); nothing for float/double, whose
// out_acc wrote dst directly.
template <typename T>
inline void finish(const acc_type<T>* buf, T* dst, int64_t n) {
  if constexpr (kReduced<T>) {
    store_row<T>(dst, n, [&](int64_t i, int64_t count) { return load<float>(buf + i, count); });
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

// count (<= size()) elements at p as one vector of acc_type<T>, zeros after.
template <typename T>
inline at::vec::Vectorized<acc_type<T>> load_acc(const T* p, int64_t count) {
  if constexpr (kReduced<T>) {
    return load_widened<T>(p, count);
  } else {
    return load(p, count);
  }
}

// max over [0, n) of term(i, count) (lanes >= count ignored): four independent vector maxima,
// then the lanes. A max is exact, so the order cannot change the value; NaN propagates, as in
// torch. −∞ for n == 0.
template <typename A, typename Term>
inline A row_max(int64_t n, Term&& term) {
  using Vec = at::vec::Vectorized<A>;
  constexpr int64_t kLanes = Vec::size();
  const Vec neg_inf(-std::numeric_limits<A>::infinity());
  Vec a0 = neg_inf, a1 = neg_inf, a2 = neg_inf, a3 = neg_inf;
  int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    a0 = at::vec::maximum(a0, term(i, kLanes));
    a1 = at::vec::maximum(a1, term(i + kLanes, kLanes));
    a2 = at::vec::maximum(a2, term(i + 2 * kLanes, kLanes));
    a3 = at::vec::maximum(a3, term(i + 3 * kLanes, kLanes));
  }
  for (; i < n; i += kLanes) {
    const int64_t count = std::min(kLanes, n - i);
    // Lanes past the end are −∞, not the zeros of a masked load.
    const Vec v = term(i, count);
    a0 = at::vec::maximum(a0, count == kLanes ? v : Vec::set(neg_inf, v, count));
  }
  alignas(64) A lanes[kLanes];
  at::vec::maximum(at::vec::maximum(a0, a1), at::vec::maximum(a2, a3)).store(lanes);
  A m = lanes[0];
  for (int64_t l = 1; l < kLanes; ++l) {
    if (std::isnan(lanes[l]) || lanes[l] > m) m = lanes[l];
  }
  return m;
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

}  // namespace
}  // namespace cpu_detail
}  // namespace megapp
