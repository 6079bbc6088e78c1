// Vectorized row loops of the CPU kernels, one table of function pointers per element type and
// instruction set.
//
// The op files (bias_gelu.cpp, layer_norm.cpp, ...) check and allocate tensors, split rows over
// threads and reduce parameter gradients; the loops over the elements of a range of rows live in
// vec_kernels_impl.h, written once with at::vec::Vectorized and compiled twice:
// vec_kernels_default.cpp for the baseline instruction set of the build, and on x86-64 with GCC
// vec_kernels_avx2.cpp for AVX2 + FMA + F16C (ATen's CPU_CAPABILITY=AVX2: 8 float lanes, Sleef
// exp). row_kernels<T>() picks the table once per process, as torch picks its own CPU kernels
// (the ATEN_CPU_CAPABILITY environment variable lowers both).
//
// Pointers are to contiguous [rows, cols] data; parameters (bias, weight) are passed widened to
// the accumulation type acc_t = at::opmath_type<T> (float for bf16/half). Parameter-gradient
// partial sums are added, unrounded, row after row into the caller's acc_t arrays, so the caller
// controls the blocking (and with it the summation order).
#pragma once

#include <ATen/OpMathType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "vec_isa.h"

namespace megapp::cpu_detail {

// The dropout of bias_dropout_add: element n (flat index + offset) is kept iff its Philox draw
// (seed, n) is below threshold, then scaled by scale; active == false keeps everything unscaled.
struct DropoutMask {
  bool active;
  uint64_t seed;
  uint64_t offset;
  uint64_t threshold;
  double scale;
};

// The masking of scaled_masked_softmax over [b, heads, sq, sk] scores: row r (bh = r / sq,
// q = r % sq) attends keys [0, causal_key_limit(q, sq, sk)) when causal, all sk otherwise, except
// those whose padding-mask element data[(bh / heads)·stride_b + (bh % heads)·stride_h +
// q·stride_q + k·stride_k] is true (the mask broadcast to the scores' shape, stride 0 on broadcast
// dims; data null: no padding mask).
struct SoftmaxMask {
  const bool* data;
  int64_t stride_b, stride_h, stride_q, stride_k;
  int64_t heads, sq;
  bool causal;
};

template <typename T>
struct RowKernels {
  using acc_t = at::opmath_type<T>;

  // y = gelu_tanh(x + bias); x, y: [rows, cols], bias: [cols].
  void (*bias_gelu_fwd)(const T* x, const acc_t* bias, T* y, int64_t rows, int64_t cols);
  // grad_input = grad·gelu'(x + bias); grad_bias_acc[c] += Σ_rows grad_input[:, c].
  void (*bias_gelu_bwd)(const T* grad, const T* x, const acc_t* bias, T* grad_input,
                        acc_t* grad_bias_acc, int64_t rows, int64_t cols);
  // y = silu(gate + b_gate)·(up + b_up); x: [rows, 2f] = [gate | up], bias: [2f] or null,
  // y: [rows, f].
  void (*bias_swiglu_fwd)(const T* x, const acc_t* bias, T* y, int64_t rows, int64_t f);
  // grad: [rows, f]; grad_input: [rows, 2f]; grad_bias_acc: [2f] or null (then bias is null).
  void (*bias_swiglu_bwd)(const T* grad, const T* x, const acc_t* bias, T* grad_input,
                          acc_t* grad_bias_acc, int64_t rows, int64_t f);
  // LayerNorm of each row; bias may be null; writes y and the per-row mean and rstd.
  // scratch: cols.
  void (*layer_norm_fwd)(const T* x, const acc_t* weight, const acc_t* bias, acc_t eps, T* y,
                         acc_t* mean, acc_t* rstd, acc_t* scratch, int64_t rows, int64_t cols);
  // saved is x (mean, rstd per row) or, with memory_efficient, y (mean unused, may be null).
  // grad_weight_acc / grad_bias_acc: [cols], Σ_rows grad·x̂ and Σ_rows grad. scratch: 3·cols.
  void (*layer_norm_bwd)(const T* grad, const T* saved, const acc_t* mean, const acc_t* rstd,
                         const acc_t* weight, const acc_t* bias, bool memory_efficient,
                         T* grad_input, acc_t* grad_weight_acc, acc_t* grad_bias_acc,
                         acc_t* scratch, int64_t rows, int64_t cols);
  // The per-row mean and rstd of layer_norm_fwd, bit for bit, without y. scratch: cols.
  void (*layer_norm_stats)(const T* x, acc_t eps, acc_t* mean, acc_t* rstd, acc_t* scratch,
                           int64_t rows, int64_t cols);
  // out = residual + dropout(x + bias) of each row; bias may be null. Row r's element c is kept
  // per the Philox draw of counter mask.offset + (row0 + r)·cols + c (megapp/philox.h).
  void (*bias_dropout_add_fwd)(const T* x, const acc_t* bias, const T* residual, T* out,
                               const DropoutMask& mask, int64_t row0, int64_t rows, int64_t cols);
  // grad_x = grad kept and scaled as in the forward; grad_bias_acc[c] += Σ_rows grad_x[:, c]
  // unless null.
  void (*bias_dropout_add_bwd)(const T* grad, T* grad_x, acc_t* grad_bias_acc,
                               const DropoutMask& mask, int64_t row0, int64_t rows, int64_t cols);
  // RMSNorm of each row; writes y and the per-row rstd. scratch: cols.
  void (*rms_norm_fwd)(const T* x, const acc_t* weight, acc_t eps, T* y, acc_t* rstd,
                       acc_t* scratch, int64_t rows, int64_t cols);
  // saved is x or, with memory_efficient, y. grad_weight_acc: [cols]. scratch: 3·cols.
  void (*rms_norm_bwd)(const T* grad, const T* saved, const acc_t* rstd, const acc_t* weight,
                       bool memory_efficient, T* grad_input, acc_t* grad_weight_acc,
                       acc_t* scratch, int64_t rows, int64_t cols);
  // The per-row rstd of rms_norm_fwd, bit for bit, without y. scratch: cols.
  void (*rms_norm_stats)(const T* x, acc_t eps, acc_t* rstd, acc_t* scratch, int64_t rows,
                         int64_t cols);
  // Cross entropy over a vocabulary shard: rows of cols logits whose first `real` ids are real
  // (the rest padding); target holds global ids, the shard starts at id `start`
  // (megapp/cross_entropy.h).
  // row_max[r] = max_{k<real} z[r, k] (−∞ when real == 0).
  void (*cross_entropy_fwd_max)(const T* logits, acc_t* row_max, int64_t rows, int64_t cols,
                                int64_t real);
  // sums[r, 0..n_sums) = Σ_{k<real} exp(z − m), z_t − m (0 when t is not in the shard) and, when
  // n_sums == 3, Σ_{k<real} (z − m); one pass over the row, m = row_max[r].
  void (*cross_entropy_fwd_sums)(const T* logits, const int64_t* target, const acc_t* row_max,
                                 acc_t* sums, int64_t n_sums, int64_t rows, int64_t cols,
                                 int64_t start, int64_t real);
  // grad[r, k] = ((exp((z − m) − log Z) − (1 − ε)[k = t]) − ε/K)·grad_loss[r] for k < real, 0
  // for padding; one_minus_eps = 1 − ε and eps_over_k = ε/K.
  void (*cross_entropy_bwd)(const acc_t* grad_loss, const T* logits, const int64_t* target,
                            const acc_t* row_max, const acc_t* log_z, T* grad,
                            acc_t one_minus_eps, acc_t eps_over_k, int64_t rows, int64_t cols,
                            int64_t start, int64_t real);
  // y = softmax(scale·x + mask) of rows row0 .. row0 + rows of the scores, sk each: masked keys
  // exactly 0, a fully masked row all zeros (megapp/softmax.h). scratch: sk.
  void (*scaled_masked_softmax_fwd)(const T* x, T* y, const SoftmaxMask& mask, acc_t scale,
                                    acc_t* scratch, int64_t row0, int64_t rows, int64_t sk);
  // grad_x = scale·y·(grad − Σ grad·y) of each row of sk.
  void (*scaled_masked_softmax_bwd)(const T* grad, const T* y, T* grad_x, acc_t scale,
                                    int64_t rows, int64_t sk);
  // RoPE of rows row0 .. row0 + rows of d channels, rows_per_pos (b·heads) rows per position:
  // the first rot_dim channels of a row at position p rotated by the float32 angles
  // freqs[p·rot_dim ..) (megapp/rope.h), the rest copied. scratch: 4·rot_dim.
  void (*rope_fwd)(const T* x, const float* freqs, T* y, acc_t* scratch, int64_t row0,
                   int64_t rows, int64_t rows_per_pos, int64_t d, int64_t rot_dim);
  // The transposed rotation (the backward), same arguments with grad for x and grad_x for y.
  void (*rope_bwd)(const T* grad, const float* freqs, T* grad_x, acc_t* scratch, int64_t row0,
                   int64_t rows, int64_t rows_per_pos, int64_t d, int64_t rot_dim);
};

// The tables of each compiled instruction set (explicitly instantiated for float, double,
// c10::BFloat16 and c10::Half).
template <typename T>
const RowKernels<T>& row_kernels_default();
#if defined(MEGAPP_HAVE_AVX2_KERNELS)
template <typename T>
const RowKernels<T>& row_kernels_avx2();
#endif

// The table for this process: AVX2 when it was compiled, the CPU has AVX2, FMA and F16C, and
// torch's own CPU capability is AVX2 or higher; the baseline one otherwise.
template <typename T>
const RowKernels<T>& row_kernels();

// "avx2" or "default": the instruction set row_kernels() uses.
const char* row_kernels_isa();

}  // namespace megapp::cpu_detail
