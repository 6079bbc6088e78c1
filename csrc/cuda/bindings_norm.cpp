// CUDA kernels for megapp::layer_norm_fwd / layer_norm_bwd / rms_norm_fwd / rms_norm_bwd (schemas
// in csrc/cpu/layer_norm.cpp and csrc/cpu/rms_norm.cpp; megapp._C must be loaded first). Only c10
// CUDA headers: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "bindings_common.h"
#include "megapp/op_checks.h"
#include "norm_kernel.h"

namespace megapp {
namespace {

using namespace bindings_detail;
using namespace op_checks;

// Launches a norm kernel on the current stream with the CUDA element types of the activations
// (x's) and the parameters (weight's), a pair check_norm_params has restricted: launch(T{}, W{},
// stream) starts it and returns the launch status, which is checked.
template <typename Fn>
void launch_norm(const char* op, const at::Tensor& x, const at::Tensor& weight, Fn&& launch) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto run = [&](auto t_tag, auto w_tag) { check_launch(op, launch(t_tag, w_tag, stream)); };
  const bool float_params = weight.scalar_type() == at::kFloat;
  switch (x.scalar_type()) {
    case at::kFloat:
      return run(float{}, float{});
    case at::kBFloat16:
      return float_params ? run(__nv_bfloat16{}, float{}) : run(__nv_bfloat16{}, __nv_bfloat16{});
    case at::kHalf:
      return float_params ? run(__half{}, float{}) : run(__half{}, __half{});
    default:
      TORCH_CHECK(false, op, ": unsupported dtype ", x.scalar_type(), " on CUDA");
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(
    const at::Tensor& x_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in,
    double eps) {
  const char* op = "layer_norm_fwd";
  check_norm_fwd(op, x_in, weight_in, bias_in, eps, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const std::optional<at::Tensor> bias = contiguous(bias_in);
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor mean = at::empty(stats_shape(x), x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty(stats_shape(x), x.options().dtype(at::kFloat));
  const int64_t cols = weight.numel();
  const int64_t rows = x.numel() / cols;
  launch_norm(op, x, weight, [&](auto t_tag, auto w_tag, cudaStream_t stream) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    return cuda::layer_norm_fwd<T, W>(in_ptr<T>(x), in_ptr<W>(weight), in_ptr<W>(bias),
                                      out_ptr<T>(y), out_ptr<float>(mean), out_ptr<float>(rstd),
                                      rows, cols, static_cast<float>(eps), stream);
  });
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(
    const at::Tensor& grad_in, const at::Tensor& saved_in, const std::optional<at::Tensor>& mean_in,
    const at::Tensor& rstd_in, const at::Tensor& weight_in,
    const std::optional<at::Tensor>& bias_in, bool memory_efficient) {
  const char* op = "layer_norm_bwd";
  check_layer_norm_bwd(op, grad_in, saved_in, mean_in, rstd_in, weight_in, bias_in,
                       memory_efficient, at::kCUDA);
  const int64_t cols = weight_in.numel();
  const int64_t rows = saved_in.numel() / cols;
  const c10::cuda::CUDAGuard guard(saved_in.device());
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor saved = saved_in.contiguous();
  const at::Tensor rstd = rstd_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const std::optional<at::Tensor> mean =
      memory_efficient ? std::nullopt : std::optional<at::Tensor>(mean_in->contiguous());
  const std::optional<at::Tensor> bias = contiguous(bias_in);
  at::Tensor grad_input = at::empty_like(saved, at::MemoryFormat::Contiguous);
  at::Tensor grad_weight = at::empty_like(weight, at::MemoryFormat::Contiguous);
  at::Tensor grad_bias = at::empty_like(weight, at::MemoryFormat::Contiguous);
  // Per-chunk float partial sums of grad_weight / grad_bias, from the caching allocator.
  at::Tensor workspace = at::empty({cuda::norm_bwd_workspace_numel(rows, cols)},
                                   saved.options().dtype(at::kFloat));
  launch_norm(op, saved, weight, [&](auto t_tag, auto w_tag, cudaStream_t stream) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    return cuda::layer_norm_bwd<T, W>(in_ptr<T>(grad), in_ptr<T>(saved), in_ptr<float>(mean),
                                      in_ptr<float>(rstd), in_ptr<W>(weight), in_ptr<W>(bias),
                                      out_ptr<T>(grad_input), out_ptr<W>(grad_weight),
                                      out_ptr<W>(grad_bias), out_ptr<float>(workspace), rows, cols,
                                      memory_efficient, stream);
  });
  return {grad_input, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x_in, const at::Tensor& weight_in,
                                                double eps) {
  const char* op = "rms_norm_fwd";
  check_norm_fwd(op, x_in, weight_in, std::nullopt, eps, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor rstd = at::empty(stats_shape(x), x.options().dtype(at::kFloat));
  const int64_t cols = weight.numel();
  const int64_t rows = x.numel() / cols;
  launch_norm(op, x, weight, [&](auto t_tag, auto w_tag, cudaStream_t stream) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    return cuda::rms_norm_fwd<T, W>(in_ptr<T>(x), in_ptr<W>(weight), out_ptr<T>(y),
                                    out_ptr<float>(rstd), rows, cols, static_cast<float>(eps),
                                    stream);
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& grad_in,
                                                const at::Tensor& saved_in,
                                                const at::Tensor& rstd_in,
                                                const at::Tensor& weight_in,
                                                bool memory_efficient) {
  const char* op = "rms_norm_bwd";
  check_norm_bwd(op, grad_in, saved_in, rstd_in, weight_in, std::nullopt, at::kCUDA);
  const int64_t cols = weight_in.numel();
  const int64_t rows = saved_in.numel() / cols;
  const c10::cuda::CUDAGuard guard(saved_in.device());
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor saved = saved_in.contiguous();
  const at::Tensor rstd = rstd_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  at::Tensor grad_input = at::empty_like(saved, at::MemoryFormat::Contiguous);
  at::Tensor grad_weight = at::empty_like(weight, at::MemoryFormat::Contiguous);
  at::Tensor workspace = at::empty({cuda::norm_bwd_workspace_numel(rows, cols)},
                                   saved.options().dtype(at::kFloat));
  launch_norm(op, saved, weight, [&](auto t_tag, auto w_tag, cudaStream_t stream) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    return cuda::rms_norm_bwd<T, W>(in_ptr<T>(grad), in_ptr<T>(saved), in_ptr<float>(rstd),
                                    in_ptr<W>(weight), out_ptr<T>(grad_input),
                                    out_ptr<W>(grad_weight), out_ptr<float>(workspace), rows, cols,
                                    memory_efficient, stream);
  });
  return {grad_input, grad_weight};
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_IMPL(megapp, CUDA, m) {
  m.impl("layer_norm_fwd", &megapp::layer_norm_fwd);
  m.impl("layer_norm_bwd", &megapp::layer_norm_bwd);
  m.impl("rms_norm_fwd", &megapp::rms_norm_fwd);
  m.impl("rms_norm_bwd", &megapp::rms_norm_bwd);
}
