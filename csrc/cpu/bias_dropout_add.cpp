// Schemas and CPU kernels for megapp::bias_dropout_add_fwd / bias_dropout_add_bwd.
//
// out = residual + dropout(x + bias, p): x and residual are [..., h] viewed as [rows, h]; bias is
// [h] or absent. The keep mask is regenerated from (seed, offset) with the Philox stream of
// megapp/philox.h, never stored. Math runs in at::opmath_type (float for bf16/half), in the
// vectorized row loops of vec_kernels_impl.h (Philox blocks drawn 8 at a time); this file checks,
// allocates and splits rows over threads.
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
#include "megapp/philox.h"
#include "vec_kernels.h"

TORCH_LIBRARY_FRAGMENT(megapp, m) {
  // out = residual + mask·(x + bias)/(1 − p); x, residual: [..., h], bias: [h] or None. Element i
  // (flat index) is kept per the Philox draw (seed, offset + i); p == 0 draws nothing.
  m.def(
      "bias_dropout_add_fwd(Tensor x, Tensor? bias, Tensor residual, float p, int seed, "
      "int offset) -> Tensor");
  // Returns (grad_x = mask·grad/(1 − p) [..., h], grad_bias [h] or None unless bias_grad); the
  // residual's gradient is grad itself. grad_bias is summed in opmath in a shape-only order.
  m.def(
      "bias_dropout_add_bwd(Tensor grad, float p, int seed, int offset, bool bias_grad) -> "
      "(Tensor, Tensor?)");
}

namespace megapp {
namespace {

using namespace cpu_detail;
using namespace op_checks;

at::Tensor bias_dropout_add_fwd(const at::Tensor& x_in, const std::optional<at::Tensor>& bias_in,
                                const at::Tensor& residual_in, double p, int64_t seed,
                                int64_t offset) {
  check_bias_dropout_add_fwd(x_in, bias_in, residual_in, p, offset, at::kCPU);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor residual = residual_in.contiguous();
  const std::optional<at::Tensor> bias = contiguous(bias_in);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t cols = x.size(-1);
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  const DropoutMask mask{p > 0.0, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                         dropout_keep_threshold(p), dropout_scale(p)};

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "bias_dropout_add_fwd", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const auto& kernels = row_kernels<scalar_t>();
        const scalar_t* xp = x.const_data_ptr<scalar_t>();
        const scalar_t* rp = residual.const_data_ptr<scalar_t>();
        scalar_t* op = out.mutable_data_ptr<scalar_t>();
        std::vector<acc_t> bias_acc;
        const acc_t* bp = bias.has_value()
                              ? widened<acc_t>(bias->const_data_ptr<scalar_t>(), cols, bias_acc)
                              : nullptr;
        at::parallel_for(0, rows, rows_grain(cols), [&](int64_t begin, int64_t end) {
          const int64_t off = begin * cols;
          kernels.bias_dropout_add_fwd(xp + off, bp, rp + off, op + off, mask, begin, end - begin,
                                       cols);
        });
      });
  return out;
}

std::tuple<at::Tensor, std::optional<at::Tensor>> bias_dropout_add_bwd(const at::Tensor& grad_in,
                                                                       double p, int64_t seed,
                                                                       int64_t offset,
                                                                       bool bias_grad) {
  check_bias_dropout_add_bwd(grad_in, p, offset, at::kCPU);
  const at::Tensor grad = grad_in.contiguous();
  at::Tensor grad_x = at::empty_like(grad, at::MemoryFormat::Contiguous);
  const int64_t cols = grad.size(-1);
  const int64_t rows = cols == 0 ? 0 : grad.numel() / cols;
  std::optional<at::Tensor> grad_bias;
  if (bias_grad) grad_bias = at::empty({cols}, grad.options());
  const DropoutMask mask{p > 0.0, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                         dropout_keep_threshold(p), dropout_scale(p)};
  const RowBlocks blocks(rows, cols);

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, grad.scalar_type(), "bias_dropout_add_bwd", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const auto& kernels = row_kernels<scalar_t>();
        const scalar_t* gp = grad.const_data_ptr<scalar_t>();
        scalar_t* gxp = grad_x.mutable_data_ptr<scalar_t>();
        // partial[b * cols + c]: sum of the (unrounded) grad_x of column c over row block b.
        std::vector<acc_t> partial(bias_grad ? blocks.count * cols : 0, acc_t(0));
        at::parallel_for(0, blocks.count, 1, [&](int64_t block_begin, int64_t block_end) {
          for (int64_t b = block_begin; b < block_end; ++b) {
            const int64_t r0 = blocks.begin(b);
            acc_t* acc = bias_grad ? partial.data() + b * cols : nullptr;
            kernels.bias_dropout_add_bwd(gp + r0 * cols, gxp + r0 * cols, acc, mask, r0,
                                         blocks.end(b, rows) - r0, cols);
          }
        });
        if (!bias_grad) return;
        store_block_sums(partial.data(), blocks.count, cols,
                         grad_bias->mutable_data_ptr<scalar_t>());
      });
  return {grad_x, grad_bias};
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_IMPL(megapp, CPU, m) {
  m.impl("bias_dropout_add_fwd", &megapp::bias_dropout_add_fwd);
  m.impl("bias_dropout_add_bwd", &megapp::bias_dropout_add_bwd);
}
