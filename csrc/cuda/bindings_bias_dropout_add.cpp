// CUDA kernels for megapp::bias_dropout_add_fwd / bias_dropout_add_bwd (schemas in
// csrc/cpu/bias_dropout_add.cpp; megapp._C must be loaded first). Only c10 CUDA headers:
// ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE headers.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "bindings_common.h"
#include "bias_dropout_add_kernel.h"

namespace megapp {
namespace {

using namespace bindings_detail;

void check_dropout_args(const char* op, double p, int64_t offset) {
  TORCH_CHECK(p >= 0.0 && p <= 1.0, op, ": dropout probability must be in [0, 1], got ", p);
  TORCH_CHECK(offset >= 0, op, ": offset must be non-negative, got ", offset);
}

void check_fwd_inputs(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                      const at::Tensor& residual) {
  const char* op = "bias_dropout_add_fwd";
  TORCH_CHECK(x.dim() >= 1, op, ": x must be [..., h], got a 0-d tensor");
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got ", x.device());
  TORCH_CHECK(residual.sizes() == x.sizes(), op, ": residual shape ", residual.sizes(),
              " must equal x shape ", x.sizes());
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), op,
              ": x and residual must have the same dtype, got ", x.scalar_type(), " and ",
              residual.scalar_type());
  TORCH_CHECK(residual.device() == x.device(), op,
              ": x and residual must be on the same CUDA device, got ", x.device(), " and ",
              residual.device());
  if (!bias.has_value()) return;
  TORCH_CHECK(bias->dim() == 1, op, ": bias must be 1-D [h], got shape ", bias->sizes());
  TORCH_CHECK(x.size(-1) == bias->size(0), op, ": last dim of x (", x.size(-1),
              ") must equal the bias size (", bias->size(0), "); x shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == bias->scalar_type(), op,
              ": x and bias must have the same dtype, got ", x.scalar_type(), " and ",
              bias->scalar_type());
  TORCH_CHECK(x.device() == bias->device(), op,
              ": x and bias must be on the same CUDA device, got ", x.device(), " and ",
              bias->device());
}

at::Tensor bias_dropout_add_fwd(const at::Tensor& x_in, const std::optional<at::Tensor>& bias_in,
                                const at::Tensor& residual_in, double p, int64_t seed,
                                int64_t offset) {
  check_fwd_inputs(x_in, bias_in, residual_in);
  check_dropout_args("bias_dropout_add_fwd", p, offset);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor residual = residual_in.contiguous();
  const std::optional<at::Tensor> bias =
      bias_in.has_value() ? std::optional<at::Tensor>(bias_in->contiguous()) : std::nullopt;
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t cols = x.size(-1);
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_cuda_floats(x.scalar_type(), "bias_dropout_add_fwd", [&](auto tag) {
    using T = decltype(tag);
    check_launch("bias_dropout_add_fwd",
                 cuda::bias_dropout_add_fwd(in_ptr<T>(x), in_ptr<T>(bias), in_ptr<T>(residual),
                                            out_ptr<T>(out), rows, cols, p,
                                            static_cast<uint64_t>(seed),
                                            static_cast<uint64_t>(offset), stream));
  });
  return out;
}

std::tuple<at::Tensor, std::optional<at::Tensor>> bias_dropout_add_bwd(const at::Tensor& grad_in,
                                                                       double p, int64_t seed,
                                                                       int64_t offset,
                                                                       bool bias_grad) {
  TORCH_CHECK(grad_in.dim() >= 1, "bias_dropout_add_bwd: grad must be [..., h], got a 0-d tensor");
  TORCH_CHECK(grad_in.is_cuda(), "bias_dropout_add_bwd: grad must be a CUDA tensor, got ",
              grad_in.device());
  check_dropout_args("bias_dropout_add_bwd", p, offset);
  const c10::cuda::CUDAGuard guard(grad_in.device());
  const at::Tensor grad = grad_in.contiguous();
  at::Tensor grad_x = at::empty_like(grad, at::MemoryFormat::Contiguous);
  const int64_t cols = grad.size(-1);
  const int64_t rows = cols == 0 ? 0 : grad.numel() / cols;
  std::optional<at::Tensor> grad_bias;
  std::optional<at::Tensor> workspace;
  if (bias_grad) {
    grad_bias = at::empty({cols}, grad.options());
    // Per-chunk float partial sums of grad_bias, from the caching allocator.
    workspace = at::empty({cuda::bias_dropout_add_bwd_workspace_numel(rows, cols)},
                          grad.options().dtype(at::kFloat));
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_cuda_floats(grad.scalar_type(), "bias_dropout_add_bwd", [&](auto tag) {
    using T = decltype(tag);
    check_launch("bias_dropout_add_bwd",
                 cuda::bias_dropout_add_bwd(in_ptr<T>(grad), out_ptr<T>(grad_x),
                                            out_ptr<T>(grad_bias), out_ptr<float>(workspace),
                                            rows, cols, p, static_cast<uint64_t>(seed),
                                            static_cast<uint64_t>(offset), stream));
  });
  return {grad_x, grad_bias};
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_IMPL(megapp, CUDA, m) {
  m.impl("bias_dropout_add_fwd", &megapp::bias_dropout_add_fwd);
  m.impl("bias_dropout_add_bwd", &megapp::bias_dropout_add_bwd);
}
