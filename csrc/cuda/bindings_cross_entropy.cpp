// CUDA kernels for megapp::cross_entropy_fwd_max / cross_entropy_fwd_sums / cross_entropy_bwd
// (schemas in csrc/cpu/cross_entropy.cpp; megapp._C must be loaded first). Only c10 CUDA
// headers: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "bindings_common.h"
#include "cross_entropy_kernel.h"

namespace megapp {
namespace {

using namespace bindings_detail;

void check_logits(const char* op, const at::Tensor& logits, int64_t real) {
  TORCH_CHECK(logits.dim() >= 1 && logits.size(-1) > 0, op,
              ": logits must be [..., w] with w >= 1, got shape ", logits.sizes());
  TORCH_CHECK(logits.is_cuda(), op, ": logits must be a CUDA tensor, got ", logits.device());
  TORCH_CHECK(real >= 0 && real <= logits.size(-1), op, ": real (", real,
              ") must be in [0, w] with w = ", logits.size(-1));
}

// A per-row tensor [...] (one value per row of logits) of the given dtype on the logits' device.
void check_rows(const char* op, const char* name, const at::Tensor& t, const at::Tensor& logits,
                at::ScalarType dtype) {
  TORCH_CHECK(t.sizes() == logits.sizes().slice(0, logits.dim() - 1), op, ": ", name,
              " must be logits.shape[:-1] = ", logits.sizes().slice(0, logits.dim() - 1),
              ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == logits.device(), op, ": ", name, " must be on ", logits.device(),
              ", got ", t.device());
}

std::vector<int64_t> row_shape(const at::Tensor& logits) {
  std::vector<int64_t> shape = logits.sizes().vec();
  shape.pop_back();
  return shape;
}

at::Tensor cross_entropy_fwd_max(const at::Tensor& logits_in, int64_t real) {
  const char* op = "cross_entropy_fwd_max";
  check_logits(op, logits_in, real);
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = logits_in.contiguous();
  at::Tensor row_max = at::empty(row_shape(logits), logits.options().dtype(at::kFloat));
  const int64_t cols = logits.size(-1);
  const int64_t rows = logits.numel() / cols;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_cuda_floats(logits.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    check_launch(op, cuda::cross_entropy_fwd_max(in_ptr<T>(logits), out_ptr<float>(row_max), rows,
                                                 cols, real, stream));
  });
  return row_max;
}

at::Tensor cross_entropy_fwd_sums(const at::Tensor& logits_in, const at::Tensor& target_in,
                                  const at::Tensor& row_max_in, int64_t start, int64_t real,
                                  bool smoothing) {
  const char* op = "cross_entropy_fwd_sums";
  check_logits(op, logits_in, real);
  check_rows(op, "target", target_in, logits_in, at::kLong);
  check_rows(op, "row_max", row_max_in, logits_in, at::kFloat);
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor target = target_in.contiguous();
  const at::Tensor row_max = row_max_in.contiguous();
  const int64_t n_sums = smoothing ? 3 : 2;
  std::vector<int64_t> shape = row_shape(logits);
  shape.push_back(n_sums);
  at::Tensor sums = at::empty(shape, logits.options().dtype(at::kFloat));
  const int64_t cols = logits.size(-1);
  const int64_t rows = logits.numel() / cols;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_cuda_floats(logits.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    check_launch(op, cuda::cross_entropy_fwd_sums(
                         in_ptr<T>(logits), in_ptr<int64_t>(target), in_ptr<float>(row_max),
                         out_ptr<float>(sums), n_sums, rows, cols, start, real, stream));
  });
  return sums;
}

at::Tensor cross_entropy_bwd(const at::Tensor& grad_loss_in, const at::Tensor& logits_in,
                             const at::Tensor& target_in, const at::Tensor& row_max_in,
                             const at::Tensor& log_z_in, int64_t start, int64_t real, double eps,
                             int64_t vocab_size) {
  const char* op = "cross_entropy_bwd";
  check_logits(op, logits_in, real);
  check_rows(op, "grad_loss", grad_loss_in, logits_in, at::kFloat);
  check_rows(op, "target", target_in, logits_in, at::kLong);
  check_rows(op, "row_max", row_max_in, logits_in, at::kFloat);
  check_rows(op, "log_z", log_z_in, logits_in, at::kFloat);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0 && eps <= 1, op, ": eps must be in [0, 1], got ",
              eps);
  TORCH_CHECK(vocab_size >= 1, op, ": vocab_size must be >= 1, got ", vocab_size);
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor grad_loss = grad_loss_in.contiguous();
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor target = target_in.contiguous();
  const at::Tensor row_max = row_max_in.contiguous();
  const at::Tensor log_z = log_z_in.contiguous();
  at::Tensor grad = at::empty_like(logits, at::MemoryFormat::Contiguous);
  const int64_t cols = logits.size(-1);
  const int64_t rows = logits.numel() / cols;
  // The two weights in double, rounded once to float (as the CPU kernel and the reference).
  const float one_minus_eps = static_cast<float>(1.0 - eps);
  const float eps_over_k = static_cast<float>(eps / static_cast<double>(vocab_size));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_cuda_floats(logits.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    check_launch(op, cuda::cross_entropy_bwd(in_ptr<float>(grad_loss), in_ptr<T>(logits),
                                             in_ptr<int64_t>(target), in_ptr<float>(row_max),
                                             in_ptr<float>(log_z), out_ptr<T>(grad),
                                             one_minus_eps, eps_over_k, rows, cols, start, real,
                                             stream));
  });
  return grad;
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_IMPL(megapp, CUDA, m) {
  m.impl("cross_entropy_fwd_max", &megapp::cross_entropy_fwd_max);
  m.impl("cross_entropy_fwd_sums", &megapp::cross_entropy_fwd_sums);
  m.impl("cross_entropy_bwd", &megapp::cross_entropy_bwd);
}
