// CUDA kernels for megapp::rope_fwd / rope_bwd (schemas in csrc/cpu/rope.cpp; megapp._C must be
// loaded first). Only c10 CUDA headers: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "bindings_common.h"
#include "megapp/op_checks.h"
#include "rope_kernel.h"

namespace megapp {
namespace {

using namespace bindings_detail;

// Shared by forward (src = x) and backward (src = grad, transposed rotation).
template <bool kBackward>
at::Tensor rope_apply(const char* op, const at::Tensor& src_in, const at::Tensor& freqs_in) {
  op_checks::check_rope(op, src_in, freqs_in, at::kCUDA);
  const c10::cuda::CUDAGuard guard(src_in.device());
  const at::Tensor src = src_in.contiguous();
  const at::Tensor freqs = freqs_in.contiguous();
  at::Tensor out = at::empty_like(src, at::MemoryFormat::Contiguous);
  const int64_t seq = src.size(0), bh = src.size(1) * src.size(2), d = src.size(3);
  const int64_t rot_dim = freqs.size(3);
  launch_cuda_floats(op, src.scalar_type(), [&](auto tag, cudaStream_t stream) {
    using T = decltype(tag);
    return kBackward ? cuda::rope_bwd(in_ptr<T>(src), in_ptr<float>(freqs), out_ptr<T>(out), seq,
                                      bh, d, rot_dim, stream)
                     : cuda::rope_fwd(in_ptr<T>(src), in_ptr<float>(freqs), out_ptr<T>(out), seq,
                                      bh, d, rot_dim, stream);
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
