// Schemas and CPU kernels for megapp::layer_norm_fwd / layer_norm_bwd (LayerNorm over the last dim).
//
// x is [..., h] and is viewed as [rows, h]; weight and bias are [h], in x's dtype or float32 when
// x is bf16/half (mixed precision, as Apex's mixed fused layer norm). Math runs in
// at::opmath_type of x (float for bf16/half, the input type otherwise) with the formulas in
// megapp/norm.h, in the vectorized row loops of vec_kernels_impl.h; mean and rstd are returned
// in that type, shaped x.shape[:-1].
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu_common.h"
#include "megapp/op_checks.h"
#include "vec_kernels.h"

TORCH_LIBRARY_FRAGMENT(megapp, m) {
  // y = (x − mean)·rstd·weight + bias over the last dim; x: [..., h], weight/bias: [h].
  // Returns (y [..., h] in x's dtype, mean [...], rstd [...]); the statistics are float32
  // (float64 for float64 x).
  m.def(
      "layer_norm_fwd(Tensor x, Tensor weight, Tensor? bias, float eps) "
      "-> (Tensor, Tensor, Tensor)");
  // Returns (grad_input [..., h], grad_weight [h], grad_bias [h]). `saved` is the input x with its
  // mean and rstd, or with memory_efficient=True the output y (mean unused; x̂ = (y − bias)/weight,
  // NaN where weight == 0). grad_bias = Σ_rows grad is returned even when bias is None.
  m.def(
      "layer_norm_bwd(Tensor grad, Tensor saved, Tensor? mean, Tensor rstd, Tensor weight, "
      "Tensor? bias, bool memory_efficient) -> (Tensor, Tensor, Tensor)");
  // (mean [...], rstd [...]) of x [..., h]: the statistics layer_norm_fwd returns, bit for bit,
  // for a backward that recomputes them from x instead of keeping them.
  m.def("layer_norm_stats(Tensor x, float eps) -> (Tensor, Tensor)");
}

namespace megapp {
namespace {

using namespace cpu_detail;
using namespace op_checks;

template <typename T, typename W>
void forward_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias,
                  at::Tensor& y, at::Tensor& mean, at::Tensor& rstd, double eps) {
  using acc_t = at::opmath_type<T>;
  const auto& kernels = row_kernels<T>();
  const int64_t cols = weight.numel();
  const int64_t rows = x.numel() / cols;
  const T* xp = x.const_data_ptr<T>();
  T* yp = y.mutable_data_ptr<T>();
  acc_t* mp = mean.mutable_data_ptr<acc_t>();
  acc_t* rp = rstd.mutable_data_ptr<acc_t>();
  std::vector<acc_t> weight_acc, bias_acc;
  const acc_t* wp = widened<acc_t>(weight.const_data_ptr<W>(), cols, weight_acc);
  const acc_t* bp =
      bias != nullptr ? widened<acc_t>(bias->const_data_ptr<W>(), cols, bias_acc) : nullptr;
  at::parallel_for(0, rows, rows_grain(cols), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> scratch(cols);
    kernels.layer_norm_fwd(xp + begin * cols, wp, bp, static_cast<acc_t>(eps),
                           yp + begin * cols, mp + begin, rp + begin, scratch.data(),
                           end - begin, cols);
  });
}

template <typename T, typename W>
void backward_impl(const at::Tensor& grad, const at::Tensor& saved, const at::Tensor* mean,
                   const at::Tensor& rstd, const at::Tensor& weight, const at::Tensor* bias,
                   bool memory_efficient, at::Tensor& grad_input, at::Tensor& grad_weight,
                   at::Tensor& grad_bias) {
  using acc_t = at::opmath_type<T>;
  const auto& kernels = row_kernels<T>();
  const int64_t cols = weight.numel();
  const int64_t rows = saved.numel() / cols;
  const RowBlocks blocks(rows, cols);
  const T* gp = grad.const_data_ptr<T>();
  const T* sp = saved.const_data_ptr<T>();
  const acc_t* mp = mean != nullptr ? mean->const_data_ptr<acc_t>() : nullptr;
  const acc_t* rp = rstd.const_data_ptr<acc_t>();
  T* gip = grad_input.mutable_data_ptr<T>();
  std::vector<acc_t> weight_acc, bias_acc;
  const acc_t* wp = widened<acc_t>(weight.const_data_ptr<W>(), cols, weight_acc);
  const acc_t* bp =
      bias != nullptr ? widened<acc_t>(bias->const_data_ptr<W>(), cols, bias_acc) : nullptr;
  // partial[b * cols + c] (grad_weight) and partial[(blocks + b) * cols + c] (grad_bias): sums
  // over row block b in acc_t.
  std::vector<acc_t> partial(2 * blocks.count * cols, acc_t(0));
  acc_t* pw = partial.data();
  acc_t* pb = partial.data() + blocks.count * cols;
  at::parallel_for(0, blocks.count, 1, [&](int64_t block_begin, int64_t block_end) {
    std::vector<acc_t> scratch(3 * cols);
    for (int64_t b = block_begin; b < block_end; ++b) {
      const int64_t r0 = blocks.begin(b);
      kernels.layer_norm_bwd(gp + r0 * cols, sp + r0 * cols, mp != nullptr ? mp + r0 : nullptr,
                             rp + r0, wp, bp, memory_efficient, gip + r0 * cols, pw + b * cols,
                             pb + b * cols, scratch.data(), blocks.end(b, rows) - r0, cols);
    }
  });
  store_block_sums(pw, blocks.count, cols, grad_weight.mutable_data_ptr<W>());
  store_block_sums(pb, blocks.count, cols, grad_bias.mutable_data_ptr<W>());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(
    const at::Tensor& x_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in,
    double eps) {
  check_norm_fwd("layer_norm_fwd", x_in, weight_in, bias_in, eps, at::kCPU);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const std::optional<at::Tensor> bias = contiguous(bias_in);
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const auto stats_options = x.options().dtype(stats_dtype(x));
  at::Tensor mean = at::empty(stats_shape(x), stats_options);
  at::Tensor rstd = at::empty(stats_shape(x), stats_options);
  dispatch_norm_types(x, weight, [&](auto t_tag, auto w_tag) {
    forward_impl<decltype(t_tag), decltype(w_tag)>(x, weight, bias ? &*bias : nullptr, y, mean,
                                                   rstd, eps);
  });
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(
    const at::Tensor& grad_in, const at::Tensor& saved_in, const std::optional<at::Tensor>& mean_in,
    const at::Tensor& rstd_in, const at::Tensor& weight_in,
    const std::optional<at::Tensor>& bias_in, bool memory_efficient) {
  const char* op = "layer_norm_bwd";
  check_layer_norm_bwd(op, grad_in, saved_in, mean_in, rstd_in, weight_in, bias_in,
                       memory_efficient, at::kCPU);
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor saved = saved_in.contiguous();
  const at::Tensor rstd = rstd_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const std::optional<at::Tensor> mean =
      memory_efficient ? std::nullopt : std::optional<at::Tensor>(mean_in->contiguous());
  const std::optional<at::Tensor> bias = contiguous(bias_in);
  at::Tensor grad_input = at::empty_like(saved, at::MemoryFormat::Contiguous);
  at::Tensor grad_weight = at::empty_like(weight, at::MemoryFormat::Contiguous);
  at::Tensor grad_bias = at::empty_like(weight, at::MemoryFormat::Contiguous);
  dispatch_norm_types(saved, weight, [&](auto t_tag, auto w_tag) {
    backward_impl<decltype(t_tag), decltype(w_tag)>(
        grad, saved, mean ? &*mean : nullptr, rstd, weight, bias ? &*bias : nullptr,
        memory_efficient, grad_input, grad_weight, grad_bias);
  });
  return {grad_input, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor> layer_norm_stats(const at::Tensor& x_in, double eps) {
  constexpr const char* op = "layer_norm_stats";
  check_norm_stats_input(op, x_in, eps, at::kCPU);
  const at::Tensor x = x_in.contiguous();
  const auto stats_options = x.options().dtype(stats_dtype(x));
  at::Tensor mean = at::empty(stats_shape(x), stats_options);
  at::Tensor rstd = at::empty(stats_shape(x), stats_options);
  const int64_t cols = x.size(-1);
  const int64_t rows = x.numel() / cols;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), op, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto& kernels = row_kernels<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    acc_t* mp = mean.mutable_data_ptr<acc_t>();
    acc_t* rp = rstd.mutable_data_ptr<acc_t>();
    at::parallel_for(0, rows, rows_grain(cols), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> scratch(cols);
      kernels.layer_norm_stats(xp + begin * cols, static_cast<acc_t>(eps), mp + begin,
                               rp + begin, scratch.data(), end - begin, cols);
    });
  });
  return {mean, rstd};
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_IMPL(megapp, CPU, m) {
  m.impl("layer_norm_fwd", &megapp::layer_norm_fwd);
  m.impl("layer_norm_bwd", &megapp::layer_norm_bwd);
  m.impl("layer_norm_stats", &megapp::layer_norm_stats);
}
