// Row loops of LayerNorm and RMSNorm. See vec_kernels_impl.h.
#pragma once

#include "megapp/norm.h"
#include "vec_common.h"

namespace megapp::cpu_detail {
namespace {

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

}  // namespace
}  // namespace megapp::cpu_detail
