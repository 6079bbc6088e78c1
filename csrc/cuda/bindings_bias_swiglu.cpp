// CUDA kernels for megapp::bias_swiglu_fwd / bias_swiglu_bwd (schemas in csrc/cpu/bias_swiglu.cpp;
// megapp._C must be loaded first). Only c10 CUDA headers: ATen/cuda/CUDAContext.h would pull in
// cuBLAS/cuSPARSE headers.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "bindings_common.h"
#include "bias_swiglu_kernel.h"

namespace megapp {
namespace {

using namespace bindings_detail;

void check_inputs(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must be [..., 2f], got a 0-d tensor");
  TORCH_CHECK(x.size(-1) % 2 == 0, op, ": last dim of x (", x.size(-1),
              ") must be even: x is [..., 2f] = [gate | up]; x shape ", x.sizes());
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got ", x.device());
  if (!bias.has_value()) return;
  TORCH_CHECK(bias->dim() == 1, op, ": bias must be 1-D [2f], got shape ", bias->sizes());
  TORCH_CHECK(x.size(-1) == bias->size(0), op, ": last dim of x (", x.size(-1),
              ") must equal the bias size (", bias->size(0), "); x shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == bias->scalar_type(), op,
              ": x and bias must have the same dtype, got ", x.scalar_type(), " and ",
              bias->scalar_type());
  TORCH_CHECK(x.device() == bias->device(), op,
              ": x and bias must be on the same CUDA device, got ", x.device(), " and ",
              bias->device());
}

std::vector<int64_t> output_shape(const at::Tensor& x) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() /= 2;
  return shape;
}

at::Tensor bias_swiglu_fwd(const at::Tensor& x_in, const std::optional<at::Tensor>& bias_in) {
  check_inputs("bias_swiglu_fwd", x_in, bias_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const std::optional<at::Tensor> bias = contiguous(bias_in);
  at::Tensor y = at::empty(output_shape(x), x.options());
  const int64_t f = x.size(-1) / 2;
  const int64_t rows = f == 0 ? 0 : x.numel() / (2 * f);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_cuda_floats(x.scalar_type(), "bias_swiglu_fwd", [&](auto tag) {
    using T = decltype(tag);
    check_launch("bias_swiglu_fwd", cuda::bias_swiglu_fwd(in_ptr<T>(x), in_ptr<T>(bias),
                                                          out_ptr<T>(y), rows, f, stream));
  });
  return y;
}

std::tuple<at::Tensor, std::optional<at::Tensor>> bias_swiglu_bwd(
    const at::Tensor& grad_in, const at::Tensor& x_in, const std::optional<at::Tensor>& bias_in) {
  check_inputs("bias_swiglu_bwd", x_in, bias_in);
  const std::vector<int64_t> grad_shape = output_shape(x_in);
  TORCH_CHECK(grad_in.sizes() == at::IntArrayRef(grad_shape), "bias_swiglu_bwd: grad shape ",
              grad_in.sizes(), " must be x's shape with the last dim halved, ",
              at::IntArrayRef(grad_shape), " (x shape ", x_in.sizes(), ")");
  TORCH_CHECK(grad_in.scalar_type() == x_in.scalar_type() && grad_in.device() == x_in.device(),
              "bias_swiglu_bwd: grad and x must have the same dtype and device, got ",
              grad_in.scalar_type(), " on ", grad_in.device(), " and ", x_in.scalar_type(),
              " on ", x_in.device());
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
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_cuda_floats(x.scalar_type(), "bias_swiglu_bwd", [&](auto tag) {
    using T = decltype(tag);
    check_launch("bias_swiglu_bwd",
                 cuda::bias_swiglu_bwd(in_ptr<T>(grad), in_ptr<T>(x), in_ptr<T>(bias),
                                       out_ptr<T>(grad_input), out_ptr<T>(grad_bias),
                                       out_ptr<float>(workspace), rows, f, stream));
  });
  return {grad_input, grad_bias};
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_IMPL(megapp, CUDA, m) {
  m.impl("bias_swiglu_fwd", &megapp::bias_swiglu_fwd);
  m.impl("bias_swiglu_bwd", &megapp::bias_swiglu_bwd);
}
