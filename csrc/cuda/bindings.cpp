// CUDA kernels for the ops defined in csrc/ops.cpp (megapp._C must be loaded first). Only c10
// CUDA headers: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE headers.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "bindings_common.h"
#include "bias_gelu_kernel.h"

namespace megapp {
namespace {

using namespace bindings_detail;

void check_inputs(const char* op, const at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(bias.dim() == 1, op, ": bias must be 1-D [h], got shape ", bias.sizes());
  TORCH_CHECK(x.dim() >= 1, op, ": x must be [..., h], got a 0-d tensor");
  TORCH_CHECK(x.size(-1) == bias.size(0), op, ": last dim of x (", x.size(-1),
              ") must equal the bias size (", bias.size(0), "); x shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == bias.scalar_type(), op,
              ": x and bias must have the same dtype, got ", x.scalar_type(), " and ",
              bias.scalar_type());
  TORCH_CHECK(x.is_cuda() && x.device() == bias.device(), op,
              ": x and bias must be on the same CUDA device, got ", x.device(), " and ",
              bias.device());
}

at::Tensor bias_gelu_fwd(const at::Tensor& x_in, const at::Tensor& bias_in) {
  check_inputs("bias_gelu_fwd", x_in, bias_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor bias = bias_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t cols = bias.numel();
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_cuda_floats(x.scalar_type(), "bias_gelu_fwd", [&](auto tag) {
    using T = decltype(tag);
    check_launch("bias_gelu_fwd", cuda::bias_gelu_fwd(in_ptr<T>(x), in_ptr<T>(bias), out_ptr<T>(y),
                                                      rows, cols, stream));
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_bwd(const at::Tensor& grad_in,
                                                 const at::Tensor& x_in,
                                                 const at::Tensor& bias_in) {
  check_inputs("bias_gelu_bwd", x_in, bias_in);
  TORCH_CHECK(grad_in.sizes() == x_in.sizes(), "bias_gelu_bwd: grad shape ", grad_in.sizes(),
              " must equal x shape ", x_in.sizes());
  TORCH_CHECK(grad_in.scalar_type() == x_in.scalar_type() && grad_in.device() == x_in.device(),
              "bias_gelu_bwd: grad and x must have the same dtype and device");
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
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_cuda_floats(x.scalar_type(), "bias_gelu_bwd", [&](auto tag) {
    using T = decltype(tag);
    check_launch("bias_gelu_bwd",
                 cuda::bias_gelu_bwd(in_ptr<T>(grad), in_ptr<T>(x), in_ptr<T>(bias),
                                     out_ptr<T>(grad_input), out_ptr<T>(grad_bias),
                                     out_ptr<float>(workspace), rows, cols, stream));
  });
  return {grad_input, grad_bias};
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_IMPL(megapp, CUDA, m) {
  m.impl("bias_gelu_fwd", &megapp::bias_gelu_fwd);
  m.impl("bias_gelu_bwd", &megapp::bias_gelu_bwd);
}
