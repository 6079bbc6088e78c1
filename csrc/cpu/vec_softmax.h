// Row loops of the scaled masked softmax. See vec_kernels_impl.h.
#pragma once

#include "megapp/softmax.h"
#include "vec_common.h"

namespace megapp::cpu_detail {
namespace {

// Scaled masked softmax -----------------------------------------------------------------------
//
// A row is read once: its logits go to scratch in the max pass, are replaced by their
// exponentials in the sum pass and scaled by 1/Σ on the way out. Keys past the causal limit are
// neither read nor computed, only zeroed.

// The padding-mask flags of keys [0, count) at m (element stride `stride`), as 1 (masked) or 0
// lanes; zeros past count.
template <typename A>
inline at::vec::Vectorized<A> mask_flags(const bool* m, int64_t stride, int64_t count) {
  using Vec = at::vec::Vectorized<A>;
  alignas(64) A flags[Vec::size()] = {};
  if (stride == 1) {
    for (int64_t l = 0; l < count; ++l) flags[l] = m[l] ? A(1) : A(0);
  } else {
    for (int64_t l = 0; l < count; ++l) flags[l] = m[l * stride] ? A(1) : A(0);
  }
  return Vec::loadu(flags);
}

template <typename T>
MEGAPP_VEC_FLATTEN void scaled_masked_softmax_fwd(const T* x, T* y, const SoftmaxMask& mask,
                                                  acc_type<T> scale, acc_type<T>* scratch,
                                                  int64_t row0, int64_t rows, int64_t sk) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  const Vec scale_v(scale);
  const int64_t stride_k = mask.stride_k;
  A* z = scratch;  // the row's logits, then its exponentials
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t q = (row0 + r) % mask.sq;
    const int64_t bh = (row0 + r) / mask.sq;
    const int64_t limit = mask.causal ? causal_key_limit(q, mask.sq, sk) : sk;
    const bool* m = mask.data == nullptr ? nullptr
                                         : mask.data + (bh / mask.heads) * mask.stride_b +
                                               (bh % mask.heads) * mask.stride_h +
                                               q * mask.stride_q;
    const T* xr = x + r * sk;
    T* yr = y + r * sk;
    std::fill(yr + limit, yr + sk, T(0));  // keys past the causal limit: exactly 0
    const A z_max = row_max<A>(limit, [&](int64_t i, int64_t count) {
      const Vec xv = load_acc<T>(xr + i, count);
      Vec zv;
      if (m == nullptr) {
        zv = softmax_logit<Vec>(xv, scale_v, false);
      } else {
        const Vec flags = mask_flags<A>(m + i * stride_k, stride_k, count);
        zv = softmax_logit_where<Vec>(xv, scale_v, flags);
      }
      store(zv, z + i, count);
      return zv;
    });
    if (z_max == -std::numeric_limits<A>::infinity()) {  // fully masked row: zeros, not 0/0
      std::fill(yr, yr + limit, T(0));
      continue;
    }
    const Vec max_v(z_max);
    const A sum = row_sum<A>(limit, [&](int64_t i, int64_t count) {
      const Vec e = softmax_exp<Vec>(load(z + i, count) - max_v);
      store(e, z + i, count);
      return head(e, count);
    });
    const Vec inv(A(1) / sum);
    store_row<T>(yr, limit, [&](int64_t i, int64_t count) { return load(z + i, count) * inv; });
  }
}

template <typename T>
MEGAPP_VEC_FLATTEN void scaled_masked_softmax_bwd(const T* grad, const T* y, T* grad_x,
                                                  acc_type<T> scale, int64_t rows, int64_t sk) {
  using A = acc_type<T>;
  using Vec = at::vec::Vectorized<A>;
  const Vec scale_v(scale);
  for (int64_t r = 0; r < rows; ++r) {
    const T* gr = grad + r * sk;
    const T* yr = y + r * sk;
    // Masked loads are zero past count, and so are their products.
    const Vec dot(row_sum<A>(sk, [&](int64_t i, int64_t count) {
      return load_acc<T>(gr + i, count) * load_acc<T>(yr + i, count);
    }));
    store_row<T>(grad_x + r * sk, sk, [&](int64_t i, int64_t count) {
      return softmax_grad<Vec>(load_acc<T>(yr + i, count), load_acc<T>(gr + i, count), dot,
                               scale_v);
    });
  }
}

}  // namespace
}  // namespace megapp::cpu_detail
