// Schemas and CPU kernels for megapp::bias_swiglu_fwd / bias_swiglu_bwd.
//
// x is [..., 2f] = [gate | up] along the last dim and is viewed as [rows, 2f]; bias is [2f] or
// absent; y is [..., f]. Math runs in at::opmath_type (float for bf16/half, the input type
// otherwise) using the formulas in megapp/swiglu.h, in the vectorized row loops of
// vec_kernels_impl.h; this file checks, allocates and splits rows over threads.
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
  // y = silu(x[..., :f] + bias[:f]) · (x[..., f:] + bias[f:]); x: [..., 2f], bias: [2f] or None.
  m.def("bias_swiglu_fwd(Tensor x, Tensor? bias) -> Tensor");
  // Returns (grad_input [..., 2f], grad_bias [2f] or None when bias is None); recomputes the
  // activation from x and bias. grad_bias is summed in opmath in a shape-only order.
  m.def("bias_swiglu_bwd(Tensor grad, Tensor x, Tensor? bias) -> (Tensor, Tensor?)");
}

namespace megapp {
namespace {

using namespace cpu_detail;
using namespace op_checks;

at::Tensor bias_swiglu_fwd(const at::Tensor& x_in, const std::optional<at::Tensor>& bias_in) {
  check_bias_swiglu("bias_swiglu_fwd", x_in, bias_in, at::kCPU);
  const at::Tensor x = x_in.contiguous();
  const std::optional<at::Tensor> bias = contiguous(bias_in);
  at::Tensor y = at::empty(swiglu_output_shape(x), x.options());
  const int64_t f = x.size(-1) / 2;
  const int64_t rows = f == 0 ? 0 : x.numel() / (2 * f);

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "bias_swiglu_fwd", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const auto& kernels = row_kernels<scalar_t>();
        const scalar_t* xp = x.const_data_ptr<scalar_t>();
        scalar_t* yp = y.mutable_data_ptr<scalar_t>();
        std::vector<acc_t> bias_acc;
        const acc_t* bp = bias.has_value()
                              ? widened<acc_t>(bias->const_data_ptr<scalar_t>(), 2 * f, bias_acc)
                              : nullptr;
        at::parallel_for(0, rows, rows_grain(2 * f), [&](int64_t begin, int64_t end) {
          kernels.bias_swiglu_fwd(xp + begin * 2 * f, bp, yp + begin * f, end - begin, f);
        });
      });
  return y;
}

std::tuple<at::Tensor, std::optional<at::Tensor>> bias_swiglu_bwd(
    const at::Tensor& grad_in, const at::Tensor& x_in, const std::optional<at::Tensor>& bias_in) {
  check_bias_swiglu("bias_swiglu_bwd", x_in, bias_in, at::kCPU);
  check_bias_swiglu_grad(grad_in, x_in, at::kCPU);
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor x = x_in.contiguous();
  const std::optional<at::Tensor> bias = contiguous(bias_in);
  at::Tensor grad_input = at::empty_like(x, at::MemoryFormat::Contiguous);
  std::optional<at::Tensor> grad_bias;
  if (bias.has_value()) grad_bias = at::empty_like(*bias, at::MemoryFormat::Contiguous);
  const int64_t f = x.size(-1) / 2;
  const int64_t cols = 2 * f;
  const int64_t rows = f == 0 ? 0 : x.numel() / cols;
  const RowBlocks blocks(rows, cols);

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "bias_swiglu_bwd", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const auto& kernels = row_kernels<scalar_t>();
        const scalar_t* gp = grad.const_data_ptr<scalar_t>();
        const scalar_t* xp = x.const_data_ptr<scalar_t>();
        scalar_t* gip = grad_input.mutable_data_ptr<scalar_t>();
        std::vector<acc_t> bias_acc;
        const acc_t* bp = bias.has_value()
                              ? widened<acc_t>(bias->const_data_ptr<scalar_t>(), cols, bias_acc)
                              : nullptr;
        // partial[b * cols + c]: sum of the (unrounded) grad_input of column c over row block b.
        std::vector<acc_t> partial(bp != nullptr ? blocks.count * cols : 0, acc_t(0));
        at::parallel_for(0, blocks.count, 1, [&](int64_t block_begin, int64_t block_end) {
          for (int64_t b = block_begin; b < block_end; ++b) {
            const int64_t r0 = blocks.begin(b);
            acc_t* acc = bp != nullptr ? partial.data() + b * cols : nullptr;
            kernels.bias_swiglu_bwd(gp + r0 * f, xp + r0 * cols, bp, gip + r0 * cols, acc,
                                    blocks.end(b, rows) - r0, f);
          }
        });
        if (bp == nullptr) return;
        store_block_sums(partial.data(), blocks.count, cols,
                         grad_bias->mutable_data_ptr<scalar_t>());
      });
  return {grad_input, grad_bias};
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_IMPL(megapp, CPU, m) {
  m.impl("bias_swiglu_fwd", &megapp::bias_swiglu_fwd);
  m.impl("bias_swiglu_bwd", &megapp::bias_swiglu_bwd);
}
