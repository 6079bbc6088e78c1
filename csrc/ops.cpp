// Schemas of every megapp op. Kernels register per backend with TORCH_LIBRARY_IMPL:
// csrc/cpu/*.cpp in megapp._C, csrc/cuda/bindings.cpp in megapp._C_cuda (loaded after _C).
#include <ATen/ATen.h>
#include <torch/library.h>

TORCH_LIBRARY(megapp, m) {
  // y = gelu_tanh(x + bias); x: [..., h], bias: [h].
  m.def("bias_gelu_fwd(Tensor x, Tensor bias) -> Tensor");
  // Returns (grad_input [..., h], grad_bias [h]); recomputes gelu' from x and bias.
  m.def("bias_gelu_bwd(Tensor grad, Tensor x, Tensor bias) -> (Tensor, Tensor)");
}
