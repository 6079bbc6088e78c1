// Row loops of rotary position embedding. See vec_kernels_impl.h.
#pragma once

#include "megapp/rope.h"
#include "vec_common.h"

namespace megapp::cpu_detail {
namespace {

// RoPE ----------------------------------------------------------------------------------------
//
// cos and sin of a position's angles are computed once per range of rows (scalar, libm, as
// rope_sincos defines them) and shared by its b·heads rows; bf16/half rows are widened into
// scratch, rotated there and rounded once.

template <typename T, bool kBackward>
MEGAPP_VEC_FLATTEN void rope_rows(const T* src, const float* freqs, T* out, acc_type<T>* scratch,
                                  int64_t row0, int64_t rows, int64_t rows_per_pos, int64_t d,
                                  int64_t rot_dim) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  const int64_t half = rot_dim / 2;
  A* cos_a = scratch;
  A* sin_a = scratch + rot_dim;
  A* in_buf = scratch + 2 * rot_dim;
  A* out_buf = scratch + 3 * rot_dim;
  int64_t cached_pos = -1;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = (row0 + r) / rows_per_pos;
    if (pos != cached_pos) {
      const float* angles = freqs + pos * rot_dim;
      for (int64_t c = 0; c < rot_dim; ++c) {
        rope_sincos(static_cast<A>(angles[c]), &sin_a[c], &cos_a[c]);
      }
      cached_pos = pos;
    }
    const T* sr = src + r * d;
    T* orow = out + r * d;
    const A* xa = as_acc<T>(sr, rot_dim, in_buf);
    A* oa = out_acc<T>(orow, out_buf);
    for_each_vec<A>(half, [&](int64_t j, int64_t count) {
      const Vec x1 = load(xa + j, count);
      const Vec x2 = load(xa + half + j, count);
      const Vec c1 = load(cos_a + j, count);
      const Vec s1 = load(sin_a + j, count);
      const Vec c2 = load(cos_a + half + j, count);
      const Vec s2 = load(sin_a + half + j, count);
      Vec y1, y2;
      if constexpr (kBackward) {
        rope_bwd_pair<Vec>(x1, x2, c1, s1, c2, s2, &y1, &y2);
      } else {
        rope_fwd_pair<Vec>(x1, x2, c1, s1, c2, s2, &y1, &y2);
      }
      store(y1, oa + j, count);
      store(y2, oa + half + j, count);
    });
    finish<T>(oa, orow, rot_dim);
    std::copy(sr + rot_dim, sr + d, orow + rot_dim);  // channels past rot_dim pass through
  }
}

template <typename T>
void rope_fwd(const T* x, const float* freqs, T* y, acc_type<T>* scratch, int64_t row0,
              int64_t rows, int64_t rows_per_pos, int64_t d, int64_t rot_dim) {
  rope_rows<T, false>(x, freqs, y, scratch, row0, rows, rows_per_pos, d, rot_dim);
}

template <typename T>
void rope_bwd(const T* grad, const float* freqs, T* grad_x, acc_type<T>* scratch, int64_t row0,
              int64_t rows, int64_t rows_per_pos, int64_t d, int64_t rot_dim) {
  rope_rows<T, true>(grad, freqs, grad_x, scratch, row0, rows, rows_per_pos, d, rot_dim);
}

}  // namespace
}  // namespace megapp::cpu_detail
