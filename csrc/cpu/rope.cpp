// Schemas and CPU kernels for megapp::rope_fwd / rope_bwd (rotary position embedding).
//
// x is [s, b, heads, d] and is viewed as s·b·heads rows of d; freqs is [s, 1, 1, rot_dim] float32
// angles in the non-interleaved layout of megapp/rope.h. The first rot_dim channels of each row are
// rotated, the rest copied. cos/sin are computed once per position and chunk of rows, in
// at::opmath_type (float for bf16/half); the kernels are elementwise, hence deterministic.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "megapp/op_checks.h"
#include "megapp/rope.h"

namespace megapp {
namespace {

// Shared driver: src is x (forward) or grad (backward, the transposed rotation).
template <typename scalar_t, bool kBackward>
void rope_apply(const at::Tensor& src, const at::Tensor& freqs, at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t seq = src.size(0);
  const int64_t bh = src.size(1) * src.size(2);
  const int64_t d = src.size(3);
  const int64_t rot_dim = freqs.size(3);
  const int64_t half = rot_dim / 2;
  const scalar_t* sp = src.const_data_ptr<scalar_t>();
  const float* fp = freqs.const_data_ptr<float>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  const int64_t rows = seq * bh;
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / d);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> cos_v(rot_dim), sin_v(rot_dim);
    int64_t cached_pos = -1;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t pos = r / bh;
      if (pos != cached_pos) {  // one sin/cos per (position, channel) per chunk of rows
        for (int64_t c = 0; c < rot_dim; ++c) {
          rope_sincos(static_cast<acc_t>(fp[pos * rot_dim + c]), &sin_v[c], &cos_v[c]);
        }
        cached_pos = pos;
      }
      const scalar_t* sr = sp + r * d;
      scalar_t* orow = op + r * d;
      for (int64_t j = 0; j < half; ++j) {
        acc_t a, b;
        const acc_t v1 = static_cast<acc_t>(sr[j]);
        const acc_t v2 = static_cast<acc_t>(sr[j + half]);
        if constexpr (kBackward) {
          rope_bwd_pair(v1, v2, cos_v[j], sin_v[j], cos_v[j + half], sin_v[j + half], &a, &b);
        } else {
          rope_fwd_pair(v1, v2, cos_v[j], sin_v[j], cos_v[j + half], sin_v[j + half], &a, &b);
        }
        orow[j] = static_cast<scalar_t>(a);
        orow[j + half] = static_cast<scalar_t>(b);
      }
      std::copy(sr + rot_dim, sr + d, orow + rot_dim);  // channels past rot_dim pass through
    }
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
