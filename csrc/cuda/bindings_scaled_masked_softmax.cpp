// CUDA kernels for megapp::scaled_masked_softmax_fwd / _bwd (schemas in
// csrc/cpu/scaled_masked_softmax.cpp; megapp._C must be loaded first). Only c10 CUDA headers:
// ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE headers.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

#include "bindings_common.h"
#include "scaled_masked_softmax_kernel.h"

namespace megapp {
namespace {

using namespace bindings_detail;

void check_scores(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 4, op, ": scores must be 4-D [b, heads, sq, sk], got shape ", x.sizes());
  TORCH_CHECK(x.is_cuda(), op, ": scores must be a CUDA tensor, got ", x.device());
}

// The padding mask as a view broadcast to the scores' shape (stride 0 on broadcast dims);
// `expanded` keeps it alive for the launch.
cuda::SoftmaxMask mask_view(const char* op, const at::Tensor& x,
                            const std::optional<at::Tensor>& mask, at::Tensor& expanded) {
  if (!mask.has_value() || !mask->defined()) return {nullptr, 0, 0, 0, 0};
  const at::Tensor& m = *mask;
  TORCH_CHECK(m.scalar_type() == at::kBool, op, ": mask must be bool (True = masked out), got ",
              m.scalar_type());
  TORCH_CHECK(m.device() == x.device(), op, ": mask and scores must be on the same device, got ",
              m.device(), " and ", x.device());
  TORCH_CHECK(m.dim() <= 4, op, ": mask must broadcast to the scores' shape ", x.sizes(),
              ", got shape ", m.sizes());
  for (int64_t d = 1; d <= m.dim(); ++d) {
    const int64_t size = m.size(-d);
    TORCH_CHECK(size == 1 || size == x.size(-d), op, ": mask of shape ", m.sizes(),
                " does not broadcast to the scores' shape ", x.sizes(),
                " (expected [b or 1, 1, sq, sk])");
  }
  expanded = m.expand(x.sizes());
  return {expanded.const_data_ptr<bool>(), expanded.stride(0), expanded.stride(1),
          expanded.stride(2), expanded.stride(3)};
}

at::Tensor scaled_masked_softmax_fwd(const at::Tensor& x_in, const std::optional<at::Tensor>& mask,
                                     double scale, bool causal) {
  constexpr const char* op = "scaled_masked_softmax_fwd";
  check_scores(op, x_in);
  const int64_t batch = x_in.size(0), heads = x_in.size(1), sq = x_in.size(2), sk = x_in.size(3);
  TORCH_CHECK(!causal || sk >= sq, op, ": causal masking needs sk >= sq (queries are the last sq ",
              "of the sk positions), got sq = ", sq, ", sk = ", sk);
  const c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor mask_expanded;
  const cuda::SoftmaxMask mv = mask_view(op, x_in, mask, mask_expanded);
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_cuda_floats(x.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    check_launch(op, cuda::scaled_masked_softmax_fwd(in_ptr<T>(x), mv, out_ptr<T>(y), batch, heads,
                                                     sq, sk, static_cast<float>(scale), causal,
                                                     stream));
  });
  return y;
}

at::Tensor scaled_masked_softmax_bwd(const at::Tensor& grad_in, const at::Tensor& y_in,
                                     double scale) {
  constexpr const char* op = "scaled_masked_softmax_bwd";
  check_scores(op, y_in);
  TORCH_CHECK(grad_in.sizes() == y_in.sizes(), op, ": grad shape ", grad_in.sizes(),
              " must equal the softmax output's shape ", y_in.sizes());
  TORCH_CHECK(grad_in.scalar_type() == y_in.scalar_type() && grad_in.device() == y_in.device(),
              op, ": grad and the softmax output must have the same dtype and device");
  const c10::cuda::CUDAGuard guard(y_in.device());
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor y = y_in.contiguous();
  at::Tensor grad_x = at::empty_like(y, at::MemoryFormat::Contiguous);
  const int64_t sk = y.size(3);
  const int64_t rows = sk == 0 ? 0 : y.numel() / sk;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_cuda_floats(y.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    check_launch(op, cuda::scaled_masked_softmax_bwd(in_ptr<T>(grad), in_ptr<T>(y),
                                                     out_ptr<T>(grad_x), rows, sk,
                                                     static_cast<float>(scale), stream));
  });
  return grad_x;
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_IMPL(megapp, CUDA, m) {
  m.impl("scaled_masked_softmax_fwd", &megapp::scaled_masked_softmax_fwd);
  m.impl("scaled_masked_softmax_bwd", &megapp::scaled_masked_softmax_bwd);
}
