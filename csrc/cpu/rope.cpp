// Schemas and CPU kernels for megapp::rope_fwd / rope_bwd (rotary position embedding).
//
// x is [s, b, heads, d] and is viewed as s·b·heads rows of d; freqs is [s, 1, 1, rot_dim] float32
// angles in the non-interleaved layout of megapp/rope.h. The first rot_dim channels of each row are
// rotated, the rest copied. Math runs in at::opmath_type of x (float for bf16/half), in the
// vectorized row loops of vec_kernels_impl.h, which compute cos/sin once per position and range
// of rows; the kernels are elementwise, hence deterministic.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu_common.h"
#include "megapp/op_checks.h"
#include "vec_kernels.h"

namespace megapp {
namespace {

using namespace cpu_detail;

// Shared driver: src is x (forward) or grad (backward, the transposed rotation).
template <typename scalar_t, bool kBackward>
void rope_apply(const at::Tensor& src, const at::Tensor& freqs, at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto& kernels = row_kernels<scalar_t>();
  const auto kernel = kBackward ? kernels.rope_bwd : kernels.rope_fwd;
  const int64_t rows_per_pos = src.size(1) * src.size(2);
  const int64_t d = src.size(3);
  const int64_t rot_dim = freqs.size(3);
  const int64_t rows = src.size(0) * rows_per_pos;
  const scalar_t* sp = src.const_data_ptr<scalar_t>();
  const float* fp = freqs.const_data_ptr<float>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, rows, rows_grain(d), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> scratch(4 * rot_dim);
    kernel(sp + begin * d, fp, op + begin * d, scratch.data(), begin, end - begin, rows_per_pos,
           d, rot_dim);
  });
}

at::Tensor rope_fwd(const at::Tensor& x_in, const at::Tensor& freqs_in) {
  op_checks::check_rope("rope_fwd", x_in, freqs_in, at::kCPU);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor freqs = freqs_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_fwd", [&] {
    rope_apply<scalar_t, false>(x, freqs, y);
  });
  return y;
}

at::Tensor rope_bwd(const at::Tensor& grad_in, const at::Tensor& freqs_in) {
  op_checks::check_rope("rope_bwd", grad_in, freqs_in, at::kCPU);
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor freqs = freqs_in.contiguous();
  at::Tensor grad_x = at::empty_like(grad, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "rope_bwd", [&] {
    rope_apply<scalar_t, true>(grad, freqs, grad_x);
  });
  return grad_x;
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_FRAGMENT(megapp, m) {
  // y = x·cos(freqs) + rotate_half(x)·sin(freqs) on the first rot_dim channels, the rest copied;
  // x: [s, b, heads, d], freqs: [s, 1, 1, rot_dim] float32 (non-interleaved halves).
  m.def("rope_fwd(Tensor x, Tensor freqs) -> Tensor");
  // grad_x = grad·cos(freqs) − rotate_half(grad·sin(freqs)) (the transpose), channels past
  // rot_dim copied; needs only the frequencies.
  m.def("rope_bwd(Tensor grad, Tensor freqs) -> Tensor");
}

TORCH_LIBRARY_IMPL(megapp, CPU, m) {
  m.impl("rope_fwd", &megapp::rope_fwd);
  m.impl("rope_bwd", &megapp::rope_bwd);
}
