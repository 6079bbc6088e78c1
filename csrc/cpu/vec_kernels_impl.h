// The row loops of vec_kernels.h, written once over at::vec::Vectorized and compiled once per
// instruction set: included by vec_kernels_default.cpp and vec_kernels_avx2.cpp, each of which
// defines MEGAPP_ROW_KERNELS_GETTER (the name of its table function) before including it. The
// loops live in one header per op family (vec_elementwise.h, vec_norm.h, vec_cross_entropy.h,
// vec_softmax.h, vec_rope.h) on the helpers of vec_common.h; this file gathers them in a table.
//
// The math is the templates of megapp/gelu.h, swiglu.h, norm.h, cross_entropy.h, softmax.h and
// rope.h, instantiated on Vectorized<acc_t> (Elementwise<Vectorized> below supplies exp and the
// NaN select), so every lane computes the same operations in the same order as the CUDA kernels
// (where the instruction set has FMA, the compiler contracts a·b + c into one rounding, as nvcc
// does).
// bf16/half data are widened to float in chunks (at::vec::convert_to_float) and rounded once on
// the way out (convert_from_float, round to nearest even). Partial vectors at the end of a row use
// masked loads (zero lanes) and stores, so every element goes through the same vector code.
//
// Row reductions add Vectorized lanes in a fixed order: four accumulators over consecutive
// vectors, then the lanes folded pairwise. Vectorized<float> has 8 lanes (4 for double) in both
// builds, so both add in the same order; the order depends on the row length alone.
//
// Nothing here allocates or needs a static initializer: the AVX2 build may only run on CPUs with
// AVX2.

#include "vec_common.h"
#include "vec_cross_entropy.h"
#include "vec_elementwise.h"
#include "vec_norm.h"
#include "vec_rope.h"
#include "vec_softmax.h"

#ifndef MEGAPP_ROW_KERNELS_GETTER
#error "define MEGAPP_ROW_KERNELS_GETTER before including vec_kernels_impl.h"
#endif

namespace megapp::cpu_detail {
namespace {

template <typename T>
constexpr RowKernels<T> kTable = {
    &bias_gelu_fwd<T>,       &bias_gelu_bwd<T>,       &bias_swiglu_fwd<T>, &bias_swiglu_bwd<T>,
    &layer_norm_fwd<T>,      &layer_norm_bwd<T>,      &layer_norm_stats<T>,
    &bias_dropout_add_fwd<T>, &bias_dropout_add_bwd<T>, &rms_norm_fwd<T>,   &rms_norm_bwd<T>,
    &rms_norm_stats<T>,
    &cross_entropy_fwd_max<T>, &cross_entropy_fwd_sums<T>, &cross_entropy_bwd<T>,
    &scaled_masked_softmax_fwd<T>, &scaled_masked_softmax_bwd<T>, &rope_fwd<T>, &rope_bwd<T>,
};

}  // namespace

template <typename T>
const RowKernels<T>& MEGAPP_ROW_KERNELS_GETTER() {
  return kTable<T>;
}

template const RowKernels<float>& MEGAPP_ROW_KERNELS_GETTER<float>();
template const RowKernels<double>& MEGAPP_ROW_KERNELS_GETTER<double>();
template const RowKernels<c10::BFloat16>& MEGAPP_ROW_KERNELS_GETTER<c10::BFloat16>();
template const RowKernels<c10::Half>& MEGAPP_ROW_KERNELS_GETTER<c10::Half>();

}  // namespace megapp::cpu_detail
