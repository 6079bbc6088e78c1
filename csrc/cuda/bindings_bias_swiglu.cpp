// CUDA kernels for megapp::bias_swiglu_fwd / bias_swiglu_bwd (schemas in csrc/cpu/bias_swiglu.cpp;
// megapp._C must be loaded first). Only c10 CUDA headers: ATen/cuda/CUDAContext.h would pull in
// cuBLAS/cuSPARSE headers.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "bindings_common.h"
#include "bias_swiglu_kernel.h"
#include "megapp/op_checks.h"

namespace megapp {
namespace {

using namespace bindings_detail;
using namespace op_checks;

at::Tensor bias_swiglu_fwd(const at::Tensor& x_in, const std::optional<at::Tensor>& bias_in) {
  check_bias_swiglu("bias_swiglu_fwd", x_in, bias_in, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const std::optional<at::Tensor> bias = contiguous(bias_in);
  at::Tensor y = at::empty(swiglu_output_shape(x), x.options());
  const int64_t f = x.size(-1) / 2;
  const int64_t rows = f == 0 ? 0 : x.numel() / (2 * f);
  launch_cuda_floats("bias_swiglu_fwd", x.scalar_type(), [&](auto tag, cudaStream_t stream) {
    using T = decltype(tag);
    return cuda::bias_swiglu_fwd(in_ptr<T>(x), in_ptr<T>(bias), out_ptr<T>(y), rows, f, stream);
  });
  return y;
}

std::tuple<at::Tensor, std::optional<at::Tensor>> bias_swiglu_bwd(
    const at::Tensor& grad_in, const at::Tensor& x_in, const std::optional<at::Tensor>& bias_in) {
  check_bias_swiglu("bias_swiglu_bwd", x_in, bias_in, at::kCUDA);
  check_bias_swiglu_grad(grad_in, x_in, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor x = x_in.contiguous();
  const std::optional<at::Tensor> bias = contiguous(bias_in);
  at::Tensor grad_input = at::empty_like(x, at::MemoryFormat::Contiguous);
  std::optional<at::Tensor> grad_bias;
  std::optional<at::Tensor> workspace;
  const int64_t f = x.size(-1) / 2;
  const int64_t rows = f == 0 ? 0 : x.numel() / (2 * f);
  if (bias.has_value()) {
    grad_bias = at::empty_like(*bias, at::MemoryFormat::Contiguous);
    // Per-chunk float partial sums of grad_bias, from the caching allocator.
    workspace = at::empty({cuda::bias_swiglu_bwd_workspace_numel(rows, f)},
                          x.options().dtype(at::kFloat));
  }
  launch_cuda_floats("bias_swiglu_bwd", x.scalar_type(), [&](auto tag, cudaStream_t stream) {
    using T = decltype(tag);
    return cuda::bias_swiglu_bwd(in_ptr<T>(grad), in_ptr<T>(x), in_ptr<T>(bias),
                                 out_ptr<T>(grad_input), out_ptr<T>(grad_bias),
                                 out_ptr<float>(workspace), rows, f, stream);
  });
  return {grad_input, grad_bias};
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_IMPL(megapp, CUDA, m) {
  m.impl("bias_swiglu_fwd", &megapp::bias_swiglu_fwd);
  m.impl("bias_swiglu_bwd", &megapp::bias_swiglu_bwd);
}
