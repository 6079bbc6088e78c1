// Schemas and CPU kernels for megapp::scaled_masked_softmax_fwd / scaled_masked_softmax_bwd.
//
// Scores x are [b, heads, sq, sk] and are viewed as rows of sk; each row is one task of
// at::parallel_for and is reduced in a fixed order in at::opmath_type (float for bf16/half), so
// the result does not depend on the thread count. The mask is indexed through its broadcast strides
// (a [b or 1, 1, sq, sk] padding mask is never materialized per head).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <vector>

#include "megapp/op_checks.h"
#include "megapp/softmax.h"

namespace megapp {
namespace {

using namespace op_checks;

// The padding mask broadcast to the scores' shape: element (bi, hi, q, k) is at
// data[bi·sb + hi·sh + q·sq + k·sk] (stride 0 on broadcast dims).
struct MaskView {
  const bool* data = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_q = 0, stride_k = 0;
};

// The view of a mask expand_softmax_mask returned (undefined: no mask).
MaskView mask_view(const at::Tensor& expanded) {
  if (!expanded.defined()) return {};
  return {expanded.const_data_ptr<bool>(), expanded.stride(0), expanded.stride(1),
          expanded.stride(2), expanded.stride(3)};
}

// Σ term(c) for c in [0, n) in acc_t over kLanes interleaved partial sums, combined pairwise: a
// fixed order (deterministic) whose rounding error grows like n / kLanes instead of n.
constexpr int kLanes = 8;

template <typename acc_t, typename Term>
acc_t lane_sum(int64_t n, Term&& term) {
  acc_t lanes[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += term(c + l);
  }
  for (int l = 0; c < n; ++c, ++l) lanes[l] += term(c);
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

int64_t rows_grain(int64_t cols) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, cols));
}

at::Tensor scaled_masked_softmax_fwd(const at::Tensor& x_in, const std::optional<at::Tensor>& mask,
                                     double scale, bool causal) {
  constexpr const char* op = "scaled_masked_softmax_fwd";
  check_softmax_fwd(x_in, causal, at::kCPU);
  const int64_t batch = x_in.size(0), heads = x_in.size(1), sq = x_in.size(2), sk = x_in.size(3);
  const at::Tensor mask_expanded = expand_softmax_mask(op, x_in, mask);
  const MaskView mv = mask_view(mask_expanded);
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t rows = batch * heads * sq;
  if (rows == 0 || sk == 0) return y;

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "scaled_masked_softmax_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
    const acc_t scale_acc = static_cast<acc_t>(scale);
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, rows_grain(sk), [&](int64_t begin, int64_t end) {
      // The row's logits, then its exponentials, in acc_t: one rounding to scalar_t at the end.
      std::vector<acc_t> buf(sk);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t q = r % sq;
        const int64_t bh = r / sq;
        const int64_t limit = causal ? causal_key_limit(q, sq, sk) : sk;
        const bool* mrow = mv.data == nullptr ? nullptr
                                              : mv.data + (bh / heads) * mv.stride_b +
                                                    (bh % heads) * mv.stride_h + q * mv.stride_q;
        const scalar_t* xr = xp + r * sk;
        scalar_t* yr = yp + r * sk;
        acc_t row_max = neg_inf;
        for (int64_t c = 0; c < limit; ++c) {
          const bool masked = mrow != nullptr && mrow[c * mv.stride_k];
          buf[c] = softmax_logit<acc_t>(static_cast<acc_t>(xr[c]), scale_acc, masked);
          row_max = std::max(row_max, buf[c]);
        }
        // Keys past the causal limit are masked: exactly 0.
        std::fill(yr + limit, yr + sk, scalar_t(0));
        if (row_max == neg_inf) {  // fully masked row: zeros, not 0/0
          std::fill(yr, yr + limit, scalar_t(0));
          continue;
        }
        const acc_t sum = lane_sum<acc_t>(limit, [&](int64_t c) {
          buf[c] = softmax_exp(buf[c] - row_max);
          return buf[c];
        });
        const acc_t inv = acc_t(1) / sum;
        for (int64_t c = 0; c < limit; ++c) yr[c] = static_cast<scalar_t>(buf[c] * inv);
      }
    });
  });
  return y;
}

at::Tensor scaled_masked_softmax_bwd(const at::Tensor& grad_in, const at::Tensor& y_in,
                                     double scale) {
  check_softmax_bwd(grad_in, y_in, at::kCPU);
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor y = y_in.contiguous();
  at::Tensor grad_x = at::empty_like(y, at::MemoryFormat::Contiguous);
  const int64_t sk = y.size(3);
  const int64_t rows = sk == 0 ? 0 : y.numel() / sk;

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, y.scalar_type(), "scaled_masked_softmax_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t scale_acc = static_cast<acc_t>(scale);
    const scalar_t* gp = grad.const_data_ptr<scalar_t>();
    const scalar_t* yp = y.const_data_ptr<scalar_t>();
    scalar_t* dxp = grad_x.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, rows_grain(sk), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gr = gp + r * sk;
        const scalar_t* yr = yp + r * sk;
        scalar_t* dxr = dxp + r * sk;
        const acc_t dot = lane_sum<acc_t>(
            sk, [&](int64_t c) { return static_cast<acc_t>(gr[c]) * static_cast<acc_t>(yr[c]); });
        for (int64_t c = 0; c < sk; ++c) {
          dxr[c] = static_cast<scalar_t>(softmax_grad<acc_t>(
              static_cast<acc_t>(yr[c]), static_cast<acc_t>(gr[c]), dot, scale_acc));
        }
      }
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
