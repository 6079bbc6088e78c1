// Schemas and CPU kernels for megapp::rms_norm_fwd / rms_norm_bwd (RMSNorm over the last dim).
//
// x is [..., h] and is viewed as [rows, h]; weight is [h], in x's dtype or float32 when x is
// bf16/half. Math runs in at::opmath_type of x (float for bf16/half, the input type otherwise)
// with the formulas in megapp/norm.h, in the vectorized row loops of vec_kernels_impl.h; rstd is
// returned in that type, shaped x.shape[:-1].
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "cpu_common.h"
#include "megapp/op_checks.h"
#include "vec_kernels.h"

TORCH_LIBRARY_FRAGMENT(megapp, m) {
  // y = x·rstd·weight over the last dim, rstd = 1/√(mean(x²) + eps); x: [..., h], weight: [h].
  // Returns (y [..., h] in x's dtype, rstd [...] in float32, float64 for float64 x).
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  // Returns (grad_input [..., h], grad_weight [h]). `saved` is the input x, or with
  // memory_efficient=True the output y (x̂ = y/weight, NaN where weight == 0).
  m.def(
      "rms_norm_bwd(Tensor grad, Tensor saved, Tensor rstd, Tensor weight, bool memory_efficient) "
      "-> (Tensor, Tensor)");
  // rstd [...] of x [..., h]: the statistic rms_norm_fwd returns, bit for bit, for a backward
  // that recomputes it from x instead of keeping it.
  m.def("rms_norm_stats(Tensor x, float eps) -> Tensor");
}

namespace megapp {
namespace {

using namespace cpu_detail;
using namespace op_checks;

template <typename T, typename W>
void forward_impl(const at::Tensor& x, const at::Tensor& weight, at::Tensor& y, at::Tensor& rstd,
                  double eps) {
  using acc_t = at::opmath_type<T>;
  const auto& kernels = row_kernels<T>();
  const int64_t cols = weight.numel();
  const int64_t rows = x.numel() / cols;
  const T* xp = x.const_data_ptr<T>();
  T* yp = y.mutable_data_ptr<T>();
  acc_t* rp = rstd.mutable_data_ptr<acc_t>();
  std::vector<acc_t> weight_acc;
  const acc_t* wp = widened<acc_t>(weight.const_data_ptr<W>(), cols, weight_acc);
  at::parallel_for(0, rows, rows_grain(cols), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> scratch(cols);
    kernels.rms_norm_fwd(xp + begin * cols, wp, static_cast<acc_t>(eps), yp + begin * cols,
                         rp + begin, scratch.data(), end - begin, cols);
  });
}

template <typename T, typename W>
void backward_impl(const at::Tensor& grad, const at::Tensor& saved, const at::Tensor& rstd,
                   const at::Tensor& weight, bool memory_efficient, at::Tensor& grad_input,
                   at::Tensor& grad_weight) {
  using acc_t = at::opmath_type<T>;
  const auto& kernels = row_kernels<T>();
  const int64_t cols = weight.numel();
  const int64_t rows = saved.numel() / cols;
  const RowBlocks blocks(rows, cols);
  const T* gp = grad.const_data_ptr<T>();
  const T* sp = saved.const_data_ptr<T>();
  const acc_t* rp = rstd.const_data_ptr<acc_t>();
  T* gip = grad_input.mutable_data_ptr<T>();
  std::vector<acc_t> weight_acc;
  const acc_t* wp = widened<acc_t>(weight.const_data_ptr<W>(), cols, weight_acc);
  // partial[b * cols + c]: Σ g·x̂ of column c over row block b, in acc_t.
  std::vector<acc_t> partial(blocks.count * cols, acc_t(0));
  at::parallel_for(0, blocks.count, 1, [&](int64_t block_begin, int64_t block_end) {
    std::vector<acc_t> scratch(3 * cols);
    for (int64_t b = block_begin; b < block_end; ++b) {
      const int64_t r0 = blocks.begin(b);
      kernels.rms_norm_bwd(gp + r0 * cols, sp + r0 * cols, rp + r0, wp, memory_efficient,
                           gip + r0 * cols, partial.data() + b * cols, scratch.data(),
                           blocks.end(b, rows) - r0, cols);
    }
  });
  store_block_sums(partial.data(), blocks.count, cols, grad_weight.mutable_data_ptr<W>());
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x_in, const at::Tensor& weight_in,
                                                double eps) {
  check_norm_fwd("rms_norm_fwd", x_in, weight_in, std::nullopt, eps, at::kCPU);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor rstd = at::empty(stats_shape(x), x.options().dtype(stats_dtype(x)));
  dispatch_norm_types(x, weight, [&](auto t_tag, auto w_tag) {
    forward_impl<decltype(t_tag), decltype(w_tag)>(x, weight, y, rstd, eps);
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& grad_in,
                                                const at::Tensor& saved_in,
                                                const at::Tensor& rstd_in,
                                                const at::Tensor& weight_in,
                                                bool memory_efficient) {
  check_norm_bwd("rms_norm_bwd", grad_in, saved_in, rstd_in, weight_in, std::nullopt, at::kCPU);
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor saved = saved_in.contiguous();
  const at::Tensor rstd = rstd_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  at::Tensor grad_input = at::empty_like(saved, at::MemoryFormat::Contiguous);
  at::Tensor grad_weight = at::empty_like(weight, at::MemoryFormat::Contiguous);
  dispatch_norm_types(saved, weight, [&](auto t_tag, auto w_tag) {
    backward_impl<decltype(t_tag), decltype(w_tag)>(grad, saved, rstd, weight, memory_efficient,
                                                    grad_input, grad_weight);
  });
  return {grad_input, grad_weight};
}

at::Tensor rms_norm_stats(const at::Tensor& x_in, double eps) {
  constexpr const char* op = "rms_norm_stats";
  check_norm_stats_input(op, x_in, eps, at::kCPU);
  const at::Tensor x = x_in.contiguous();
  at::Tensor rstd = at::empty(stats_shape(x), x.options().dtype(stats_dtype(x)));
  const int64_t cols = x.size(-1);
  const int64_t rows = x.numel() / cols;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), op, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto& kernels = row_kernels<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    acc_t* rp = rstd.mutable_data_ptr<acc_t>();
    at::parallel_for(0, rows, rows_grain(cols), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> scratch(cols);
      kernels.rms_norm_stats(xp + begin * cols, static_cast<acc_t>(eps), rp + begin,
                             scratch.data(), end - begin, cols);
    });
  });
  return rstd;
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_IMPL(megapp, CPU, m) {
  m.impl("rms_norm_fwd", &megapp::rms_norm_fwd);
  m.impl("rms_norm_bwd", &megapp::rms_norm_bwd);
  m.impl("rms_norm_stats", &megapp::rms_norm_stats);
}
