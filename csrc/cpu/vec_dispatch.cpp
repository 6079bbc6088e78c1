// row_kernels<T>(): the vectorized row loops for this CPU, chosen once per process.
#include <ATen/Version.h>
#include <torch/library.h>

#include <string>

#include "vec_kernels.h"

TORCH_LIBRARY_FRAGMENT(megapp, m) {
  // "avx2" or "default": the instruction set of the CPU kernels' vectorized loops in this process.
  m.def("cpu_kernels_isa() -> str",
        [] { return std::string(megapp::cpu_detail::row_kernels_isa()); });
}

namespace megapp::cpu_detail {
namespace {

bool use_avx2() {
#if defined(MEGAPP_HAVE_AVX2_KERNELS)
  static const bool use = [] {
    // Follow torch's own choice, which ATEN_CPU_CAPABILITY=default lowers, and check the CPU.
    const std::string torch_isa = at::get_cpu_capability();
    if (torch_isa != "AVX2" && torch_isa != "AVX512") return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return use;
#else
  return false;
#endif
}

}  // namespace

template <typename T>
const RowKernels<T>& row_kernels() {
#if defined(MEGAPP_HAVE_AVX2_KERNELS)
  if (use_avx2()) return row_kernels_avx2<T>();
#endif
  return row_kernels_default<T>();
}

template const RowKernels<float>& row_kernels<float>();
template const RowKernels<double>& row_kernels<double>();
template const RowKernels<c10::BFloat16>& row_kernels<c10::BFloat16>();
template const RowKernels<c10::Half>& row_kernels<c10::Half>();

const char* row_kernels_isa() { return use_avx2() ? "avx2" : "default"; }

}  // namespace megapp::cpu_detail
