// Schemas and CPU kernels for megapp::scaled_masked_softmax_fwd / scaled_masked_softmax_bwd.
//
// Scores x are [b, heads, sq, sk] and are viewed as rows of sk. Math runs in at::opmath_type of x
// (float for bf16/half) with the formulas of megapp/softmax.h, in the vectorized row loops of
// vec_kernels_impl.h; the rows are split over threads with at::parallel_for, each row reduced by
// one task in a fixed order, so the result does not depend on the thread count. The mask is
// indexed through its broadcast strides (a [b or 1, 1, sq, sk] padding mask is never
// materialized per head).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "cpu_common.h"
#include "megapp/op_checks.h"
#include "vec_kernels.h"

namespace megapp {
namespace {

using namespace cpu_detail;
using namespace op_checks;

at::Tensor scaled_masked_softmax_fwd(const at::Tensor& x_in, const std::optional<at::Tensor>& mask,
                                     double scale, bool causal) {
  constexpr const char* op = "scaled_masked_softmax_fwd";
  check_softmax_fwd(x_in, causal, at::kCPU);
  const int64_t batch = x_in.size(0), heads = x_in.size(1), sq = x_in.size(2), sk = x_in.size(3);
  const at::Tensor mask_expanded = expand_softmax_mask(op, x_in, mask);
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t rows = batch * heads * sq;
  if (rows == 0 || sk == 0) return y;
  SoftmaxMask masking{nullptr, 0, 0, 0, 0, heads, sq, causal};
  if (mask_expanded.defined()) {
    masking.data = mask_expanded.const_data_ptr<bool>();
    masking.stride_b = mask_expanded.stride(0);
    masking.stride_h = mask_expanded.stride(1);
    masking.stride_q = mask_expanded.stride(2);
    masking.stride_k = mask_expanded.stride(3);
  }

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), op, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto& kernels = row_kernels<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, rows_grain(sk), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> scratch(sk);
      kernels.scaled_masked_softmax_fwd(xp + begin * sk, yp + begin * sk, masking,
                                        static_cast<acc_t>(scale), scratch.data(), begin,
                                        end - begin, sk);
    });
  });
  return y;
}

at::Tensor scaled_masked_softmax_bwd(const at::Tensor& grad_in, const at::Tensor& y_in,
                                     double scale) {
  constexpr const char* op = "scaled_masked_softmax_bwd";
  check_softmax_bwd(grad_in, y_in, at::kCPU);
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor y = y_in.contiguous();
  at::Tensor grad_x = at::empty_like(y, at::MemoryFormat::Contiguous);
  const int64_t sk = y.size(3);
  const int64_t rows = sk == 0 ? 0 : y.numel() / sk;
  if (rows == 0) return grad_x;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), op, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto& kernels = row_kernels<scalar_t>();
    const scalar_t* gp = grad.const_data_ptr<scalar_t>();
    const scalar_t* yp = y.const_data_ptr<scalar_t>();
    scalar_t* dxp = grad_x.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, rows_grain(sk), [&](int64_t begin, int64_t end) {
      kernels.scaled_masked_softmax_bwd(gp + begin * sk, yp + begin * sk, dxp + begin * sk,
                                        static_cast<acc_t>(scale), end - begin, sk);
    });
  });
  return grad_x;
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_FRAGMENT(megapp, m) {
  // y = softmax(scale·x + mask) over the last dim; x: [b, heads, sq, sk]; mask: bool,
  // broadcastable to x ([b or 1, 1, sq, sk]), True = masked out; causal masks keys
  // j > i + (sk − sq). Fully masked rows give zeros.
  m.def("scaled_masked_softmax_fwd(Tensor x, Tensor? mask, float scale, bool causal) -> Tensor");
  // dx = scale·y·(dy − Σ dy·y), from the forward's output y only.
  m.def("scaled_masked_softmax_bwd(Tensor grad, Tensor y, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(megapp, CPU, m) {
  m.impl("scaled_masked_softmax_fwd", &megapp::scaled_masked_softmax_fwd);
  m.impl("scaled_masked_softmax_bwd", &megapp::scaled_masked_softmax_bwd);
}
