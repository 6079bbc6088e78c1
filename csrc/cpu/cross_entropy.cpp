// Schemas and CPU kernels for megapp::cross_entropy_fwd_max / cross_entropy_fwd_sums /
// cross_entropy_bwd: the per-shard work of the vocabulary-parallel cross entropy
// (megapp/tensor_parallel/cross_entropy.py does the all-reduces in between and forms the loss).
//
// logits is one rank's shard [..., w] of the padded vocabulary, viewed as [rows, w]: its ids are
// [start, start + w), of which the first `real` are real vocabulary ids and the rest padding.
// Math runs in at::opmath_type of the logits (float for bf16/half, the input type otherwise) with
// the formulas of megapp/cross_entropy.h, in the vectorized row loops of vec_kernels_impl.h; the
// rows are split over threads with at::parallel_for, each row reduced by one task in a fixed
// order (the result does not depend on the thread count).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "cpu_common.h"
#include "megapp/op_checks.h"
#include "vec_kernels.h"

TORCH_LIBRARY_FRAGMENT(megapp, m) {
  // Row max over the real ids [0, real) of logits [..., w] (−inf when real == 0). Returns [...]
  // in float32 (float64 for float64 logits).
  m.def("cross_entropy_fwd_max(Tensor logits, int real) -> Tensor");
  // One pass over each row, with row_max the max over the whole vocabulary (all-reduced): returns
  // [..., 2] = (Σ_{k<real} exp(z − m), z_t − m) or, with smoothing, [..., 3] adding
  // Σ_{k<real} (z − m); z_t − m is 0 where target (global int64 ids [...]) is not in
  // [start, start + real). Dtype as cross_entropy_fwd_max.
  m.def(
      "cross_entropy_fwd_sums(Tensor logits, Tensor target, Tensor row_max, int start, int real, "
      "bool smoothing) -> Tensor");
  // grad [..., w] in the logits' dtype: ((exp((z − m) − log_z) − (1 − eps)[k = t]) − eps/K)·g for
  // k < real, 0 for padding ids; grad_loss, row_max, log_z: [...] float32 (float64 for float64
  // logits); eps is the smoothing weight (0 without) and vocab_size the real vocabulary K.
  m.def(
      "cross_entropy_bwd(Tensor grad_loss, Tensor logits, Tensor target, Tensor row_max, "
      "Tensor log_z, int start, int real, float eps, int vocab_size) -> Tensor");
}

namespace megapp {
namespace {

using namespace cpu_detail;
using namespace op_checks;

at::Tensor cross_entropy_fwd_max(const at::Tensor& logits_in, int64_t real) {
  constexpr const char* op = "cross_entropy_fwd_max";
  check_logits(op, logits_in, real, at::kCPU);
  const at::Tensor logits = logits_in.contiguous();
  at::Tensor row_max = at::empty(stats_shape(logits), logits.options().dtype(stats_dtype(logits)));
  const int64_t cols = logits.size(-1);
  const int64_t rows = logits.numel() / cols;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), op, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto& kernels = row_kernels<scalar_t>();
    const scalar_t* zp = logits.const_data_ptr<scalar_t>();
    acc_t* mp = row_max.mutable_data_ptr<acc_t>();
    at::parallel_for(0, rows, rows_grain(cols), [&](int64_t begin, int64_t end) {
      kernels.cross_entropy_fwd_max(zp + begin * cols, mp + begin, end - begin, cols, real);
    });
  });
  return row_max;
}

at::Tensor cross_entropy_fwd_sums(const at::Tensor& logits_in, const at::Tensor& target_in,
                                  const at::Tensor& row_max_in, int64_t start, int64_t real,
                                  bool smoothing) {
  constexpr const char* op = "cross_entropy_fwd_sums";
  check_cross_entropy_fwd_sums(logits_in, target_in, row_max_in, real, at::kCPU);
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor target = target_in.contiguous();
  const at::Tensor row_max = row_max_in.contiguous();
  const int64_t n_sums = smoothing ? 3 : 2;
  std::vector<int64_t> shape = stats_shape(logits);
  shape.push_back(n_sums);
  at::Tensor sums = at::empty(shape, logits.options().dtype(stats_dtype(logits)));
  const int64_t cols = logits.size(-1);
  const int64_t rows = logits.numel() / cols;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), op, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto& kernels = row_kernels<scalar_t>();
    const scalar_t* zp = logits.const_data_ptr<scalar_t>();
    const int64_t* tp = target.const_data_ptr<int64_t>();
    const acc_t* mp = row_max.const_data_ptr<acc_t>();
    acc_t* sp = sums.mutable_data_ptr<acc_t>();
    at::parallel_for(0, rows, rows_grain(cols), [&](int64_t begin, int64_t end) {
      kernels.cross_entropy_fwd_sums(zp + begin * cols, tp + begin, mp + begin,
                                     sp + begin * n_sums, n_sums, end - begin, cols, start, real);
    });
  });
  return sums;
}

at::Tensor cross_entropy_bwd(const at::Tensor& grad_loss_in, const at::Tensor& logits_in,
                             const at::Tensor& target_in, const at::Tensor& row_max_in,
                             const at::Tensor& log_z_in, int64_t start, int64_t real, double eps,
                             int64_t vocab_size) {
  constexpr const char* op = "cross_entropy_bwd";
  check_cross_entropy_bwd(grad_loss_in, logits_in, target_in, row_max_in, log_z_in, real, eps,
                          vocab_size, at::kCPU);
  const at::Tensor grad_loss = grad_loss_in.contiguous();
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor target = target_in.contiguous();
  const at::Tensor row_max = row_max_in.contiguous();
  const at::Tensor log_z = log_z_in.contiguous();
  at::Tensor grad = at::empty_like(logits, at::MemoryFormat::Contiguous);
  const int64_t cols = logits.size(-1);
  const int64_t rows = logits.numel() / cols;
  // The two weights in double, rounded once to the accumulation type (as the reference does).
  const double one_minus_eps = 1.0 - eps;
  const double eps_over_k = eps / static_cast<double>(vocab_size);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), op, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto& kernels = row_kernels<scalar_t>();
    const acc_t* gp = grad_loss.const_data_ptr<acc_t>();
    const scalar_t* zp = logits.const_data_ptr<scalar_t>();
    const int64_t* tp = target.const_data_ptr<int64_t>();
    const acc_t* mp = row_max.const_data_ptr<acc_t>();
    const acc_t* lp = log_z.const_data_ptr<acc_t>();
    scalar_t* out = grad.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, rows_grain(cols), [&](int64_t begin, int64_t end) {
      kernels.cross_entropy_bwd(gp + begin, zp + begin * cols, tp + begin, mp + begin,
                                lp + begin, out + begin * cols, static_cast<acc_t>(one_minus_eps),
                                static_cast<acc_t>(eps_over_k), end - begin, cols, start, real);
    });
  });
  return grad;
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_IMPL(megapp, CPU, m) {
  m.impl("cross_entropy_fwd_max", &megapp::cross_entropy_fwd_max);
  m.impl("cross_entropy_fwd_sums", &megapp::cross_entropy_fwd_sums);
  m.impl("cross_entropy_bwd", &megapp::cross_entropy_bwd);
}
