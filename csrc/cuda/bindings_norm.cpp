// CUDA kernels for megapp::layer_norm_fwd / layer_norm_bwd / rms_norm_fwd / rms_norm_bwd (schemas
// in csrc/cpu/layer_norm.cpp and csrc/cpu/rms_norm.cpp; megapp._C must be loaded first). Only c10
// CUDA headers: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "bindings_common.h"
#include "norm_kernel.h"

namespace megapp {
namespace {

using namespace bindings_detail;

void check_params(const char* op, const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must be [..., h], got a 0-d tensor");
  TORCH_CHECK(weight.dim() == 1, op, ": weight must be 1-D [h], got shape ", weight.sizes());
  TORCH_CHECK(x.size(-1) == weight.size(0), op, ": last dim of x (", x.size(-1),
              ") must equal the weight size (", weight.size(0), "); x shape ", x.sizes());
  TORCH_CHECK(weight.size(0) > 0, op, ": the normalized dim h must be positive, got x shape ",
              x.sizes());
  const at::ScalarType xt = x.scalar_type();
  const at::ScalarType wt = weight.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf, op,
              ": unsupported dtype ", xt, " on CUDA (float32, bfloat16, float16)");
  const bool mixed = wt == at::kFloat && (xt == at::kBFloat16 || xt == at::kHalf);
  TORCH_CHECK(wt == xt || mixed, op,
              ": weight must have x's dtype, or float32 for bfloat16/float16 x; got x ", xt,
              " and weight ", wt);
  TORCH_CHECK(x.is_cuda() && weight.device() == x.device(), op,
              ": x and weight must be on the same CUDA device, got ", x.device(), " and ",
              weight.device());
  if (bias.has_value()) {
    TORCH_CHECK(bias->sizes() == weight.sizes(), op, ": bias shape ", bias->sizes(),
                " must equal the weight shape ", weight.sizes());
    TORCH_CHECK(bias->scalar_type() == wt, op, ": bias and weight must have the same dtype, got ",
                bias->scalar_type(), " and ", wt);
    TORCH_CHECK(bias->device() == x.device(), op, ": bias must be on ", x.device(), ", got ",
                bias->device());
  }
}

void check_grad(const char* op, const at::Tensor& grad, const at::Tensor& saved) {
  TORCH_CHECK(grad.sizes() == saved.sizes(), op, ": grad shape ", grad.sizes(),
              " must equal the saved activation shape ", saved.sizes());
  TORCH_CHECK(grad.scalar_type() == saved.scalar_type() && grad.device() == saved.device(), op,
              ": grad and the saved activation must have the same dtype and device");
}

void check_stats(const char* op, const char* name, const at::Tensor& stat, const at::Tensor& x,
                 int64_t rows) {
  TORCH_CHECK(stat.numel() == rows, op, ": ", name, " must hold one value per row (", rows,
              "), got shape ", stat.sizes());
  TORCH_CHECK(stat.scalar_type() == at::kFloat && stat.device() == x.device(), op, ": ", name,
              " must be float32 on ", x.device(), ", got ", stat.scalar_type(), " on ",
              stat.device());
}

void check_eps(const char* op, double eps) {
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
}

std::vector<int64_t> stats_shape(const at::Tensor& x) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.pop_back();
  return shape;
}

// Calls fn(T{}, W{}) with the CUDA element types of the activations (x_dtype) and the
// parameters (w_dtype); check_params has restricted the pair.
template <typename Fn>
void dispatch_norm_types(at::ScalarType x_dtype, at::ScalarType w_dtype, Fn&& fn) {
  const bool float_params = w_dtype == at::kFloat;
  switch (x_dtype) {
    case at::kFloat:
      return fn(float{}, float{});
    case at::kBFloat16:
      return float_params ? fn(__nv_bfloat16{}, float{}) : fn(__nv_bfloat16{}, __nv_bfloat16{});
    case at::kHalf:
      return float_params ? fn(__half{}, float{}) : fn(__half{}, __half{});
    default:
      TORCH_CHECK(false, "megapp norm: unsupported dtype ", x_dtype, " on CUDA");
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(
    const at::Tensor& x_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in,
    double eps) {
  const char* op = "layer_norm_fwd";
  check_params(op, x_in, weight_in, bias_in);
  check_eps(op, eps);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const std::optional<at::Tensor> bias = contiguous(bias_in);
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor mean = at::empty(stats_shape(x), x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty(stats_shape(x), x.options().dtype(at::kFloat));
  const int64_t cols = weight.numel();
  const int64_t rows = x.numel() / cols;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_norm_types(x.scalar_type(), weight.scalar_type(), [&](auto t_tag, auto w_tag) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    check_launch(op, cuda::layer_norm_fwd<T, W>(in_ptr<T>(x), in_ptr<W>(weight), in_ptr<W>(bias),
                                                out_ptr<T>(y), out_ptr<float>(mean),
                                                out_ptr<float>(rstd), rows, cols,
                                                static_cast<float>(eps), stream));
  });
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(
    const at::Tensor& grad_in, const at::Tensor& saved_in, const std::optional<at::Tensor>& mean_in,
    const at::Tensor& rstd_in, const at::Tensor& weight_in,
    const std::optional<at::Tensor>& bias_in, bool memory_efficient) {
  const char* op = "layer_norm_bwd";
  check_params(op, saved_in, weight_in, bias_in);
  check_grad(op, grad_in, saved_in);
  const int64_t cols = weight_in.numel();
  const int64_t rows = saved_in.numel() / cols;
  check_stats(op, "rstd", rstd_in, saved_in, rows);
  TORCH_CHECK(memory_efficient || mean_in.has_value(), op,
              ": mean is required unless memory_efficient=True");
  if (!memory_efficient) check_stats(op, "mean", *mean_in, saved_in, rows);
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
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_norm_types(saved.scalar_type(), weight.scalar_type(), [&](auto t_tag, auto w_tag) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    check_launch(op, cuda::layer_norm_bwd<T, W>(
                         in_ptr<T>(grad), in_ptr<T>(saved), in_ptr<float>(mean),
                         in_ptr<float>(rstd), in_ptr<W>(weight), in_ptr<W>(bias),
                         out_ptr<T>(grad_input), out_ptr<W>(grad_weight), out_ptr<W>(grad_bias),
                         out_ptr<float>(workspace), rows, cols, memory_efficient, stream));
  });
  return {grad_input, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x_in, const at::Tensor& weight_in,
                                                double eps) {
  const char* op = "rms_norm_fwd";
  check_params(op, x_in, weight_in, std::nullopt);
  check_eps(op, eps);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor rstd = at::empty(stats_shape(x), x.options().dtype(at::kFloat));
  const int64_t cols = weight.numel();
  const int64_t rows = x.numel() / cols;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_norm_types(x.scalar_type(), weight.scalar_type(), [&](auto t_tag, auto w_tag) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    check_launch(op, cuda::rms_norm_fwd<T, W>(in_ptr<T>(x), in_ptr<W>(weight), out_ptr<T>(y),
                                              out_ptr<float>(rstd), rows, cols,
                                              static_cast<float>(eps), stream));
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& grad_in,
                                                const at::Tensor& saved_in,
                                                const at::Tensor& rstd_in,
                                                const at::Tensor& weight_in,
                                                bool memory_efficient) {
  const char* op = "rms_norm_bwd";
  check_params(op, saved_in, weight_in, std::nullopt);
  check_grad(op, grad_in, saved_in);
  const int64_t cols = weight_in.numel();
  const int64_t rows = saved_in.numel() / cols;
  check_stats(op, "rstd", rstd_in, saved_in, rows);
  const c10::cuda::CUDAGuard guard(saved_in.device());
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor saved = saved_in.contiguous();
  const at::Tensor rstd = rstd_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  at::Tensor grad_input = at::empty_like(saved, at::MemoryFormat::Contiguous);
  at::Tensor grad_weight = at::empty_like(weight, at::MemoryFormat::Contiguous);
  at::Tensor workspace = at::empty({cuda::norm_bwd_workspace_numel(rows, cols)},
                                   saved.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_norm_types(saved.scalar_type(), weight.scalar_type(), [&](auto t_tag, auto w_tag) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    check_launch(op, cuda::rms_norm_bwd<T, W>(in_ptr<T>(grad), in_ptr<T>(saved),
                                              in_ptr<float>(rstd), in_ptr<W>(weight),
                                              out_ptr<T>(grad_input), out_ptr<W>(grad_weight),
                                              out_ptr<float>(workspace), rows, cols,
                                              memory_efficient, stream));
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
