// CUDA kernels for megapp::cross_entropy_fwd_max / cross_entropy_fwd_sums / cross_entropy_bwd
// (schemas in csrc/cpu/cross_entropy.cpp; megapp._C must be loaded first). Only c10 CUDA
// headers: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "bindings_common.h"
#include "cross_entropy_kernel.h"
#include "megapp/op_checks.h"

namespace megapp {
namespace {

using namespace bindings_detail;
using namespace op_checks;

at::Tensor cross_entropy_fwd_max(const at::Tensor& logits_in, int64_t real) {
  const char* op = "cross_entropy_fwd_max";
  check_logits(op, logits_in, real, at::kCUDA);
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = logits_in.contiguous();
  at::Tensor row_max = at::empty(stats_shape(logits), logits.options().dtype(at::kFloat));
  const int64_t cols = logits.size(-1);
  const int64_t rows = logits.numel() / cols;
  launch_cuda_floats(op, logits.scalar_type(), [&](auto tag, cudaStream_t stream) {
    using T = decltype(tag);
    return cuda::cross_entropy_fwd_max(in_ptr<T>(logits), out_ptr<float>(row_max), rows, cols,
                                       real, stream);
  });
  return row_max;
}

at::Tensor cross_entropy_fwd_sums(const at::Tensor& logits_in, const at::Tensor& target_in,
                                  const at::Tensor& row_max_in, int64_t start, int64_t real,
                                  bool smoothing) {
  const char* op = "cross_entropy_fwd_sums";
  check_cross_entropy_fwd_sums(logits_in, target_in, row_max_in, real, at::kCUDA);
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor target = target_in.contiguous();
  const at::Tensor row_max = row_max_in.contiguous();
  const int64_t n_sums = smoothing ? 3 : 2;
  std::vector<int64_t> shape = stats_shape(logits);
  shape.push_back(n_sums);
  at::Tensor sums = at::empty(shape, logits.options().dtype(at::kFloat));
  const int64_t cols = logits.size(-1);
  const int64_t rows = logits.numel() / cols;
  launch_cuda_floats(op, logits.scalar_type(), [&](auto tag, cudaStream_t stream) {
    using T = decltype(tag);
    return cuda::cross_entropy_fwd_sums(in_ptr<T>(logits), in_ptr<int64_t>(target),
                                        in_ptr<float>(row_max), out_ptr<float>(sums), n_sums, rows,
                                        cols, start, real, stream);
  });
  return sums;
}

at::Tensor cross_entropy_bwd(const at::Tensor& grad_loss_in, const at::Tensor& logits_in,
                             const at::Tensor& target_in, const at::Tensor& row_max_in,
                             const at::Tensor& log_z_in, int64_t start, int64_t real, double eps,
                             int64_t vocab_size) {
  const char* op = "cross_entropy_bwd";
  check_cross_entropy_bwd(grad_loss_in, logits_in, target_in, row_max_in, log_z_in, real, eps,
                          vocab_size, at::kCUDA);
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
  launch_cuda_floats(op, logits.scalar_type(), [&](auto tag, cudaStream_t stream) {
    using T = decltype(tag);
    return cuda::cross_entropy_bwd(in_ptr<float>(grad_loss), in_ptr<T>(logits),
                                   in_ptr<int64_t>(target), in_ptr<float>(row_max),
                                   in_ptr<float>(log_z), out_ptr<T>(grad), one_minus_eps,
                                   eps_over_k, rows, cols, start, real, stream);
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
