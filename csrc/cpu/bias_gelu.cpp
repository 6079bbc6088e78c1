// CPU kernels for megapp::bias_gelu_fwd / bias_gelu_bwd.
//
// x is [..., h] and is viewed as [rows, h]; bias is [h]. Math runs in at::opmath_type
// (float for bf16/half, the input type otherwise) using the formulas in megapp/gelu.h, in the
// vectorized row loops of vec_kernels_impl.h; this file checks, allocates and splits rows over
// threads.
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

namespace megapp {
namespace {

using namespace cpu_detail;
using namespace op_checks;

at::Tensor bias_gelu_fwd(const at::Tensor& x_in, const at::Tensor& bias_in) {
  check_bias_gelu("bias_gelu_fwd", x_in, bias_in, at::kCPU);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor bias = bias_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t cols = bias.numel();
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto& kernels = row_kernels<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    std::vector<acc_t> bias_acc;
    const acc_t* bp = widened<acc_t>(bias.const_data_ptr<scalar_t>(), cols, bias_acc);
    at::parallel_for(0, rows, rows_grain(cols), [&](int64_t begin, int64_t end) {
      kernels.bias_gelu_fwd(xp + begin * cols, bp, yp + begin * cols, end - begin, cols);
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_bwd(const at::Tensor& grad_in,
                                                 const at::Tensor& x_in,
                                                 const at::Tensor& bias_in) {
  check_bias_gelu("bias_gelu_bwd", x_in, bias_in, at::kCPU);
  check_grad("bias_gelu_bwd", grad_in, "x", x_in, at::kCPU);
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor x = x_in.contiguous();
  const at::Tensor bias = bias_in.contiguous();
  at::Tensor grad_input = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor grad_bias = at::empty_like(bias, at::MemoryFormat::Contiguous);
  const int64_t cols = bias.numel();
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  const RowBlocks blocks(rows, cols);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto& kernels = row_kernels<scalar_t>();
    const scalar_t* gp = grad.const_data_ptr<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* gip = grad_input.mutable_data_ptr<scalar_t>();
    std::vector<acc_t> bias_acc;
    const acc_t* bp = widened<acc_t>(bias.const_data_ptr<scalar_t>(), cols, bias_acc);
    // partial[b * cols + c]: sum of the (unrounded) grad_input of column c over row block b.
    std::vector<acc_t> partial(blocks.count * cols, acc_t(0));
    at::parallel_for(0, blocks.count, 1, [&](int64_t block_begin, int64_t block_end) {
      for (int64_t b = block_begin; b < block_end; ++b) {
        const int64_t r0 = blocks.begin(b);
        const int64_t off = r0 * cols;
        kernels.bias_gelu_bwd(gp + off, xp + off, bp, gip + off, partial.data() + b * cols,
                              blocks.end(b, rows) - r0, cols);
      }
    });
    store_block_sums(partial.data(), blocks.count, cols, grad_bias.mutable_data_ptr<scalar_t>());
  });
  return {grad_input, grad_bias};
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_IMPL(megapp, CPU, m) {
  m.impl("bias_gelu_fwd", &megapp::bias_gelu_fwd);
  m.impl("bias_gelu_bwd", &megapp::bias_gelu_bwd);
}
