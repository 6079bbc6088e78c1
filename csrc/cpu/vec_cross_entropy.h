// Row loops of the vocabulary-parallel cross entropy. See vec_kernels_impl.h.
#pragma once

#include "megapp/cross_entropy.h"
#include "vec_common.h"

namespace megapp::cpu_detail {
namespace {

// Cross entropy ---------------------------------------------------------------------------
//
// A vocabulary shard's rows are long (thousands of ids) and read straight from the logits: no
// staging buffer, bf16/half widened one float vector at a time.

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
  for (int64_t r = 0; r < rows; ++r) {
    const T* z = logits + r * cols;
    // Qualified: the parameter row_max hides the helper.
    row_max[r] = cpu_detail::row_max<A>(
        real, [&](int64_t i, int64_t count) { return load_acc<T>(z + i, count); });
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

}  // namespace
}  // namespace megapp::cpu_detail
