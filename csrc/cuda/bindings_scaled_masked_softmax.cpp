// CUDA kernels for megapp::scaled_masked_softmax_fwd / _bwd (schemas in
// csrc/cpu/scaled_masked_softmax.cpp; megapp._C must be loaded first). Only c10 CUDA headers:
// ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE headers.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

#include "bindings_common.h"
#include "megapp/op_checks.h"
#include "scaled_masked_softmax_kernel.h"

namespace megapp {
namespace {

using namespace bindings_detail;
using namespace op_checks;

// The kernels' view of a mask expand_softmax_mask returned (undefined: no mask); `expanded` must
// stay alive for the launch.
cuda::SoftmaxMask mask_view(const at::Tensor& expanded) {
  if (!expanded.defined()) return {nullptr, 0, 0, 0, 0};
  return {expanded.const_data_ptr<bool>(), expanded.stride(0), expanded.stride(1),
          expanded.stride(2), expanded.stride(3)};
}

at::Tensor scaled_masked_softmax_fwd(const at::Tensor& x_in, const std::optional<at::Tensor>& mask,
                                     double scale, bool causal) {
  constexpr const char* op = "scaled_masked_softmax_fwd";
  check_softmax_fwd(x_in, causal, at::kCUDA);
  const int64_t batch = x_in.size(0), heads = x_in.size(1), sq = x_in.size(2), sk = x_in.size(3);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor mask_expanded = expand_softmax_mask(op, x_in, mask);
  const cuda::SoftmaxMask mv = mask_view(mask_expanded);
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  launch_cuda_floats(op, x.scalar_type(), [&](auto tag, cudaStream_t stream) {
    using T = decltype(tag);
    return cuda::scaled_masked_softmax_fwd(in_ptr<T>(x), mv, out_ptr<T>(y), batch, heads, sq, sk,
                                           static_cast<float>(scale), causal, stream);
  });
  return y;
}

at::Tensor scaled_masked_softmax_bwd(const at::Tensor& grad_in, const at::Tensor& y_in,
                                     double scale) {
  constexpr const char* op = "scaled_masked_softmax_bwd";
  check_softmax_bwd(grad_in, y_in, at::kCUDA);
  const c10::cuda::CUDAGuard guard(y_in.device());
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor y = y_in.contiguous();
  at::Tensor grad_x = at::empty_like(y, at::MemoryFormat::Contiguous);
  const int64_t sk = y.size(3);
  const int64_t rows = sk == 0 ? 0 : y.numel() / sk;
  launch_cuda_floats(op, y.scalar_type(), [&](auto tag, cudaStream_t stream) {
    using T = decltype(tag);
    return cuda::scaled_masked_softmax_bwd(in_ptr<T>(grad), in_ptr<T>(y), out_ptr<T>(grad_x),
                                           rows, sk, static_cast<float>(scale), stream);
  });
  return grad_x;
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_IMPL(megapp, CUDA, m) {
  m.impl("scaled_masked_softmax_fwd", &megapp::scaled_masked_softmax_fwd);
  m.impl("scaled_masked_softmax_bwd", &megapp::scaled_masked_softmax_bwd);
}
