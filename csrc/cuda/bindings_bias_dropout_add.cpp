// CUDA kernels for megapp::bias_dropout_add_fwd / bias_dropout_add_bwd (schemas in
// csrc/cpu/bias_dropout_add.cpp; megapp._C must be loaded first). Only c10 CUDA headers:
// ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE headers.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "bindings_common.h"
#include "bias_dropout_add_kernel.h"
#include "megapp/op_checks.h"

namespace megapp {
namespace {

using namespace bindings_detail;
using namespace op_checks;

at::Tensor bias_dropout_add_fwd(const at::Tensor& x_in, const std::optional<at::Tensor>& bias_in,
                                const at::Tensor& residual_in, double p, int64_t seed,
                                int64_t offset) {
  check_bias_dropout_add_fwd(x_in, bias_in, residual_in, p, offset, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor residual = residual_in.contiguous();
  const std::optional<at::Tensor> bias = contiguous(bias_in);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t cols = x.size(-1);
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  launch_cuda_floats("bias_dropout_add_fwd", x.scalar_type(), [&](auto tag, cudaStream_t stream) {
    using T = decltype(tag);
    return cuda::bias_dropout_add_fwd(in_ptr<T>(x), in_ptr<T>(bias), in_ptr<T>(residual),
                                      out_ptr<T>(out), rows, cols, p, static_cast<uint64_t>(seed),
                                      static_cast<uint64_t>(offset), stream);
  });
  return out;
}

std::tuple<at::Tensor, std::optional<at::Tensor>> bias_dropout_add_bwd(const at::Tensor& grad_in,
                                                                       double p, int64_t seed,
                                                                       int64_t offset,
                                                                       bool bias_grad) {
  const char* op = "bias_dropout_add_bwd";
  check_bias_dropout_add_bwd(grad_in, p, offset, at::kCUDA);
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
  launch_cuda_floats(op, grad.scalar_type(), [&](auto tag, cudaStream_t stream) {
    using T = decltype(tag);
    return cuda::bias_dropout_add_bwd(in_ptr<T>(grad), out_ptr<T>(grad_x), out_ptr<T>(grad_bias),
                                      out_ptr<float>(workspace), rows, cols, p,
                                      static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                                      stream);
  });
  return {grad_x, grad_bias};
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_IMPL(megapp, CUDA, m) {
  m.impl("bias_dropout_add_fwd", &megapp::bias_dropout_add_fwd);
  m.impl("bias_dropout_add_bwd", &megapp::bias_dropout_add_bwd);
}
