// CUDA kernels for the ops defined in csrc/ops.cpp (megapp._C must be loaded first). Only c10
// CUDA headers: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE headers.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "bindings_common.h"
#include "bias_gelu_kernel.h"
#include "megapp/op_checks.h"

namespace megapp {
namespace {

using namespace bindings_detail;
using namespace op_checks;

at::Tensor bias_gelu_fwd(const at::Tensor& x_in, const at::Tensor& bias_in) {
  check_bias_gelu("bias_gelu_fwd", x_in, bias_in, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor bias = bias_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t cols = bias.numel();
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  launch_cuda_floats("bias_gelu_fwd", x.scalar_type(), [&](auto tag, cudaStream_t stream) {
    using T = decltype(tag);
    return cuda::bias_gelu_fwd(in_ptr<T>(x), in_ptr<T>(bias), out_ptr<T>(y), rows, cols, stream);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_bwd(const at::Tensor& grad_in,
                                                 const at::Tensor& x_in,
                                                 const at::Tensor& bias_in) {
  check_bias_gelu("bias_gelu_bwd", x_in, bias_in, at::kCUDA);
  check_grad("bias_gelu_bwd", grad_in, "x", x_in, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor x = x_in.contiguous();
  const at::Tensor bias = bias_in.contiguous();
  at::Tensor grad_input = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor grad_bias = at::empty_like(bias, at::MemoryFormat::Contiguous);
  const int64_t cols = bias.numel();
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  // Per-chunk float partial sums of grad_bias, from the caching allocator.
  at::Tensor workspace = at::empty({cuda::bias_gelu_bwd_workspace_numel(rows, cols)},
                                   x.options().dtype(at::kFloat));
  launch_cuda_floats("bias_gelu_bwd", x.scalar_type(), [&](auto tag, cudaStream_t stream) {
    using T = decltype(tag);
    return cuda::bias_gelu_bwd(in_ptr<T>(grad), in_ptr<T>(x), in_ptr<T>(bias),
                               out_ptr<T>(grad_input), out_ptr<T>(grad_bias),
                               out_ptr<float>(workspace), rows, cols, stream);
  });
  return {grad_input, grad_bias};
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_IMPL(megapp, CUDA, m) {
  m.impl("bias_gelu_fwd", &megapp::bias_gelu_fwd);
  m.impl("bias_gelu_bwd", &megapp::bias_gelu_bwd);
}
