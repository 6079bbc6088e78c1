// CUDA kernels for megapp::rope_fwd / rope_bwd (schemas in csrc/cpu/rope.cpp; megapp._C must be
// loaded first). Only c10 CUDA headers: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "bindings_common.h"
#include "rope_kernel.h"

namespace megapp {
namespace {

using namespace bindings_detail;

void check_inputs(const char* op, const at::Tensor& x, const at::Tensor& freqs) {
  TORCH_CHECK(x.dim() == 4, op, ": x must be 4-D [s, b, heads, d], got shape ", x.sizes());
  TORCH_CHECK(freqs.scalar_type() == at::kFloat, op, ": freqs must be float32 angles, got ",
              freqs.scalar_type());
  TORCH_CHECK(x.is_cuda() && freqs.device() == x.device(), op,
              ": x and freqs must be on the same CUDA device, got ", x.device(), " and ",
              freqs.device());
  TORCH_CHECK(freqs.dim() == 4 && freqs.size(0) == x.size(0) && freqs.size(1) == 1 &&
                  freqs.size(2) == 1,
              op, ": freqs must be [s, 1, 1, rot_dim] with s = x.size(0) = ", x.size(0),
              ", got shape ", freqs.sizes());
  const int64_t rot_dim = freqs.size(3);
  TORCH_CHECK(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= x.size(3), op,
              ": rot_dim (freqs.size(-1) = ", rot_dim,
              ") must be even, positive and at most the head dim d = ", x.size(3));
}

// Shared by forward (src = x) and backward (src = grad, transposed rotation).
template <bool kBackward>
at::Tensor rope_apply(const char* op, const at::Tensor& src_in, const at::Tensor& freqs_in) {
  check_inputs(op, src_in, freqs_in);
  const c10::cuda::CUDAGuard guard(src_in.device());
  const at::Tensor src = src_in.contiguous();
  const at::Tensor freqs = freqs_in.contiguous();
  at::Tensor out = at::empty_like(src, at::MemoryFormat::Contiguous);
  const int64_t seq = src.size(0), bh = src.size(1) * src.size(2), d = src.size(3);
  const int64_t rot_dim = freqs.size(3);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_cuda_floats(src.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    const cudaError_t err =
        kBackward ? cuda::rope_bwd(in_ptr<T>(src), freqs.const_data_ptr<float>(), out_ptr<T>(out),
                                   seq, bh, d, rot_dim, stream)
                  : cuda::rope_fwd(in_ptr<T>(src), freqs.const_data_ptr<float>(), out_ptr<T>(out),
                                   seq, bh, d, rot_dim, stream);
    check_launch(op, err);
  });
  return out;
}

at::Tensor rope_fwd(const at::Tensor& x, const at::Tensor& freqs) {
  return rope_apply<false>("rope_fwd", x, freqs);
}

at::Tensor rope_bwd(const at::Tensor& grad, const at::Tensor& freqs) {
  return rope_apply<true>("rope_bwd", grad, freqs);
}

}  // namespace
}  // namespace megapp

TORCH_LIBRARY_IMPL(megapp, CUDA, m) {
  m.impl("rope_fwd", &megapp::rope_fwd);
  m.impl("rope_bwd", &megapp::rope_bwd);
}
