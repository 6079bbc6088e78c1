// Argument checks of the fused ops, written once for both sides: the CPU kernels (csrc/cpu, library
// _C) and the CUDA bindings (csrc/cuda/bindings*.cpp, _C_cuda). Host code on ATen alone, no CUDA
// header, so the CPU build needs no CUDA.
//
// Each check takes the device type its caller's kernels run on (at::kCPU or at::kCUDA): the
// tensors must be there, the CUDA kernels take no float64, and the messages say "CUDA" on that
// side ("x and bias must be on the same CUDA device").
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace megapp::op_checks {

// ---- Helpers for the checks and for the outputs both sides allocate from checked arguments.

// Per-row statistics (norm mean / rstd, the cross entropy's row max and sums) are float, or
// double for double inputs (CPU only: the CUDA kernels take no double).
inline at::ScalarType stats_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Shape of the per-row statistics: x's shape without the last dim.
inline std::vector<int64_t> stats_shape(const at::Tensor& x) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.pop_back();
  return shape;
}

// A contiguous copy (or t itself) of an optional tensor; nullopt stays nullopt.
inline std::optional<at::Tensor> contiguous(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

// " CUDA" on the CUDA side, nothing on the CPU: "on the same CUDA device".
inline const char* device_word(c10::DeviceType device) {
  return device == at::kCUDA ? " CUDA" : "";
}

inline void check_on_device(const char* op, const char* name, const at::Tensor& t,
                            c10::DeviceType device) {
  TORCH_CHECK(t.device().type() == device, op, ": ", name, " must be a ",
              c10::DeviceTypeName(device), " tensor, got ", t.device());
}

// A tensor the kernels read: on `device` and of a floating-point dtype.
inline void check_input(const char* op, const char* name, const at::Tensor& t,
                        c10::DeviceType device) {
  check_on_device(op, name, t, device);
  TORCH_CHECK(t.is_floating_point(), op, ": ", name, " must be a floating-point tensor, got ",
              t.scalar_type());
}

// The dtypes the kernels of `device` are built for.
inline void check_float_dtype(const char* op, at::ScalarType t, c10::DeviceType device) {
  if (device == at::kCUDA) {
    TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, op,
                ": unsupported dtype ", t, " on CUDA (float32, bfloat16, float16)");
  } else {
    TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf, op,
                ": unsupported dtype ", t, " (float32, float64, bfloat16, float16)");
  }
}

inline void check_same_dtype(const char* op, const char* a_name, const at::Tensor& a,
                             const char* b_name, const at::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, ": ", a_name, " and ", b_name,
              " must have the same dtype, got ", a.scalar_type(), " and ", b.scalar_type());
}

inline void check_same_device(const char* op, const char* a_name, const at::Tensor& a,
                              const char* b_name, const at::Tensor& b, c10::DeviceType device) {
  TORCH_CHECK(a.device() == b.device(), op, ": ", a_name, " and ", b_name, " must be on the same",
              device_word(device), " device, got ", a.device(), " and ", b.device());
}

// grad has the shape, dtype and device of `name` (the activation it is the gradient of).
inline void check_grad(const char* op, const at::Tensor& grad, const char* name,
                       const at::Tensor& t, c10::DeviceType device) {
  TORCH_CHECK(grad.sizes() == t.sizes(), op, ": grad shape ", grad.sizes(), " must equal ", name,
              " shape ", t.sizes());
  check_same_dtype(op, "grad", grad, name, t);
  check_same_device(op, "grad", grad, name, t, device);
}

// A bias [cols] added along the last dim of x; shape_name is how the message writes [cols].
inline void check_bias(const char* op, const at::Tensor& x, const at::Tensor& bias,
                       const char* shape_name, c10::DeviceType device) {
  TORCH_CHECK(bias.dim() == 1, op, ": bias must be 1-D ", shape_name, ", got shape ",
              bias.sizes());
  TORCH_CHECK(x.size(-1) == bias.size(0), op, ": last dim of x (", x.size(-1),
              ") must equal the bias size (", bias.size(0), "); x shape ", x.sizes());
  check_same_dtype(op, "x", x, "bias", bias);
  check_same_device(op, "x", x, "bias", bias, device);
}

inline void check_eps(const char* op, double eps) {
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
}

// ---- bias + GeLU: x [..., h], bias [h].

inline void check_bias_gelu(const char* op, const at::Tensor& x, const at::Tensor& bias,
                            c10::DeviceType device) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must be [..., h], got a 0-d tensor");
  check_input(op, "x", x, device);
  check_bias(op, x, bias, "[h]", device);
}

// ---- bias + SwiGLU: x [..., 2f] = [gate | up], bias [2f] or absent; y and grad [..., f].

inline void check_bias_swiglu(const char* op, const at::Tensor& x,
                              const std::optional<at::Tensor>& bias, c10::DeviceType device) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must be [..., 2f], got a 0-d tensor");
  TORCH_CHECK(x.size(-1) % 2 == 0, op, ": last dim of x (", x.size(-1),
              ") must be even: x is [..., 2f] = [gate | up]; x shape ", x.sizes());
  check_input(op, "x", x, device);
  if (bias.has_value()) check_bias(op, x, *bias, "[2f]", device);
}

inline std::vector<int64_t> swiglu_output_shape(const at::Tensor& x) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() /= 2;
  return shape;
}

inline void check_bias_swiglu_grad(const at::Tensor& grad, const at::Tensor& x,
                                   c10::DeviceType device) {
  const char* op = "bias_swiglu_bwd";
  const std::vector<int64_t> grad_shape = swiglu_output_shape(x);
  TORCH_CHECK(grad.sizes() == at::IntArrayRef(grad_shape), op, ": grad shape ", grad.sizes(),
              " must be x's shape with the last dim halved, ", at::IntArrayRef(grad_shape),
              " (x shape ", x.sizes(), ")");
  check_same_dtype(op, "grad", grad, "x", x);
  check_same_device(op, "grad", grad, "x", x, device);
}

// ---- bias + dropout + residual: x and residual [..., h], bias [h] or absent.

inline void check_dropout_args(const char* op, double p, int64_t offset) {
  TORCH_CHECK(p >= 0.0 && p <= 1.0, op, ": dropout probability must be in [0, 1], got ", p);
  TORCH_CHECK(offset >= 0, op, ": offset must be non-negative, got ", offset);
}

inline void check_bias_dropout_add_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                       const at::Tensor& residual, double p, int64_t offset,
                                       c10::DeviceType device) {
  const char* op = "bias_dropout_add_fwd";
  TORCH_CHECK(x.dim() >= 1, op, ": x must be [..., h], got a 0-d tensor");
  check_input(op, "x", x, device);
  TORCH_CHECK(residual.sizes() == x.sizes(), op, ": residual shape ", residual.sizes(),
              " must equal x shape ", x.sizes());
  check_same_dtype(op, "x", x, "residual", residual);
  check_same_device(op, "x", x, "residual", residual, device);
  if (bias.has_value()) check_bias(op, x, *bias, "[h]", device);
  check_dropout_args(op, p, offset);
}

inline void check_bias_dropout_add_bwd(const at::Tensor& grad, double p, int64_t offset,
                                       c10::DeviceType device) {
  const char* op = "bias_dropout_add_bwd";
  TORCH_CHECK(grad.dim() >= 1, op, ": grad must be [..., h], got a 0-d tensor");
  check_input(op, "grad", grad, device);
  check_dropout_args(op, p, offset);
}

// ---- Scaled masked softmax: scores [b, heads, sq, sk], a bool mask broadcasting to them.

inline void check_scores(const char* op, const at::Tensor& x, c10::DeviceType device) {
  TORCH_CHECK(x.dim() == 4, op, ": scores must be 4-D [b, heads, sq, sk], got shape ", x.sizes());
  check_input(op, "scores", x, device);
}

inline void check_softmax_fwd(const at::Tensor& x, bool causal, c10::DeviceType device) {
  const char* op = "scaled_masked_softmax_fwd";
  check_scores(op, x, device);
  const int64_t sq = x.size(2), sk = x.size(3);
  TORCH_CHECK(!causal || sk >= sq, op, ": causal masking needs sk >= sq (queries are the last sq ",
              "of the sk positions), got sq = ", sq, ", sk = ", sk);
}

// The mask expanded to the scores' shape (a view: stride 0 on broadcast dims), or an undefined
// tensor when there is none.
inline at::Tensor expand_softmax_mask(const char* op, const at::Tensor& x,
                                      const std::optional<at::Tensor>& mask) {
  if (!mask.has_value() || !mask->defined()) return at::Tensor();
  const at::Tensor& m = *mask;
  TORCH_CHECK(m.scalar_type() == at::kBool, op, ": mask must be bool (True = masked out), got ",
              m.scalar_type());
  TORCH_CHECK(m.device() == x.device(), op, ": mask and scores must be on the same device, got ",
              m.device(), " and ", x.device());
  TORCH_CHECK(m.dim() <= 4, op, ": mask must broadcast to the scores' shape ", x.sizes(),
              ", got shape ", m.sizes());
  for (int64_t d = 1; d <= m.dim(); ++d) {
    const int64_t size = m.size(-d);
    TORCH_CHECK(size == 1 || size == x.size(-d), op, ": mask of shape ", m.sizes(),
                " does not broadcast to the scores' shape ", x.sizes(),
                " (expected [b or 1, 1, sq, sk])");
  }
  return m.expand(x.sizes());
}

inline void check_softmax_bwd(const at::Tensor& grad, const at::Tensor& y,
                              c10::DeviceType device) {
  const char* op = "scaled_masked_softmax_bwd";
  check_scores(op, y, device);
  check_grad(op, grad, "the softmax output", y, device);
}

// ---- LayerNorm / RMSNorm: x [..., h], weight and bias [h] in x's dtype or float32 for
// bf16/half x; statistics [...] per row in stats_dtype(x).

inline void check_norm_params(const char* op, const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, c10::DeviceType device) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must be [..., h], got a 0-d tensor");
  TORCH_CHECK(weight.dim() == 1, op, ": weight must be 1-D [h], got shape ", weight.sizes());
  TORCH_CHECK(x.size(-1) == weight.size(0), op, ": last dim of x (", x.size(-1),
              ") must equal the weight size (", weight.size(0), "); x shape ", x.sizes());
  TORCH_CHECK(weight.size(0) > 0, op, ": the normalized dim h must be positive, got x shape ",
              x.sizes());
  const at::ScalarType xt = x.scalar_type();
  const at::ScalarType wt = weight.scalar_type();
  check_float_dtype(op, xt, device);
  const bool mixed = wt == at::kFloat && (xt == at::kBFloat16 || xt == at::kHalf);
  TORCH_CHECK(wt == xt || mixed, op,
              ": weight must have x's dtype, or float32 for bfloat16/float16 x; got x ", xt,
              " and weight ", wt);
  check_on_device(op, "x", x, device);
  check_same_device(op, "x", x, "weight", weight, device);
  if (!bias.has_value()) return;
  TORCH_CHECK(bias->sizes() == weight.sizes(), op, ": bias shape ", bias->sizes(),
              " must equal the weight shape ", weight.sizes());
  check_same_dtype(op, "bias", *bias, "weight", weight);
  check_same_device(op, "bias", *bias, "weight", weight, device);
}

inline void check_norm_fwd(const char* op, const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, double eps,
                           c10::DeviceType device) {
  check_norm_params(op, x, weight, bias, device);
  check_eps(op, eps);
}

// One statistic per row of x, in stats_dtype(x), on x's device.
inline void check_norm_stat(const char* op, const char* name, const at::Tensor& stat,
                            const at::Tensor& x, int64_t rows) {
  TORCH_CHECK(stat.numel() == rows, op, ": ", name, " must hold one value per row (", rows,
              "), got shape ", stat.sizes());
  TORCH_CHECK(stat.scalar_type() == stats_dtype(x), op, ": ", name, " must be ", stats_dtype(x),
              " for ", x.scalar_type(), " inputs, got ", stat.scalar_type());
  TORCH_CHECK(stat.device() == x.device(), op, ": ", name, " must be on ", x.device(), ", got ",
              stat.device());
}

// The arguments both norms' backward share: `saved` is x, or y with memory_efficient.
inline void check_norm_bwd(const char* op, const at::Tensor& grad, const at::Tensor& saved,
                           const at::Tensor& rstd, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, c10::DeviceType device) {
  check_norm_params(op, saved, weight, bias, device);
  check_grad(op, grad, "the saved activation", saved, device);
  check_norm_stat(op, "rstd", rstd, saved, saved.numel() / weight.numel());
}

// LayerNorm's backward: the shared arguments and, unless memory_efficient (which saves y and
// no mean), the per-row mean.
inline void check_layer_norm_bwd(const char* op, const at::Tensor& grad, const at::Tensor& saved,
                                 const std::optional<at::Tensor>& mean, const at::Tensor& rstd,
                                 const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 bool memory_efficient, c10::DeviceType device) {
  check_norm_bwd(op, grad, saved, rstd, weight, bias, device);
  TORCH_CHECK(memory_efficient || mean.has_value(), op,
              ": mean is required unless memory_efficient=True");
  if (!memory_efficient) check_norm_stat(op, "mean", *mean, saved, saved.numel() / weight.numel());
}

// x of the norms' *_stats ops (which recompute the forward's statistics).
inline void check_norm_stats_input(const char* op, const at::Tensor& x, double eps,
                                   c10::DeviceType device) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": x must be [..., h] with h > 0, got shape ",
              x.sizes());
  check_float_dtype(op, x.scalar_type(), device);
  check_eps(op, eps);
}

// ---- RoPE: x (or grad) [s, b, heads, d], freqs [s, 1, 1, rot_dim] float32 angles.

inline void check_rope(const char* op, const at::Tensor& x, const at::Tensor& freqs,
                       c10::DeviceType device) {
  TORCH_CHECK(x.dim() == 4, op, ": x must be 4-D [s, b, heads, d], got shape ", x.sizes());
  check_input(op, "x", x, device);
  TORCH_CHECK(freqs.scalar_type() == at::kFloat, op, ": freqs must be float32 angles, got ",
              freqs.scalar_type());
  check_same_device(op, "x", x, "freqs", freqs, device);
  TORCH_CHECK(freqs.dim() == 4 && freqs.size(0) == x.size(0) && freqs.size(1) == 1 &&
                  freqs.size(2) == 1,
              op, ": freqs must be [s, 1, 1, rot_dim] with s = x.size(0) = ", x.size(0),
              ", got shape ", freqs.sizes());
  const int64_t rot_dim = freqs.size(3);
  TORCH_CHECK(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= x.size(3), op,
              ": rot_dim (freqs.size(-1) = ", rot_dim,
              ") must be even, positive and at most the head dim d = ", x.size(3));
}

// ---- Vocab-parallel cross entropy: one rank's logits shard [..., w], of which the first `real`
// ids are real vocabulary; target and the per-row tensors [...].

inline void check_logits(const char* op, const at::Tensor& logits, int64_t real,
                         c10::DeviceType device) {
  TORCH_CHECK(logits.dim() >= 1 && logits.size(-1) > 0, op,
              ": logits must be [..., w] with w >= 1, got shape ", logits.sizes());
  check_on_device(op, "logits", logits, device);
  check_float_dtype(op, logits.scalar_type(), device);
  TORCH_CHECK(real >= 0 && real <= logits.size(-1), op, ": real (", real,
              ") must be in [0, w] with w = ", logits.size(-1));
}

// A per-row tensor [...] (one value per row of logits) of the given dtype on the logits' device.
inline void check_rows(const char* op, const char* name, const at::Tensor& t,
                       const at::Tensor& logits, at::ScalarType dtype) {
  TORCH_CHECK(t.sizes() == logits.sizes().slice(0, logits.dim() - 1), op, ": ", name,
              " must be logits.shape[:-1] = ", logits.sizes().slice(0, logits.dim() - 1),
              ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == logits.device(), op, ": ", name, " must be on ", logits.device(),
              ", got ", t.device());
}

inline void check_cross_entropy_fwd_sums(const at::Tensor& logits, const at::Tensor& target,
                                         const at::Tensor& row_max, int64_t real,
                                         c10::DeviceType device) {
  const char* op = "cross_entropy_fwd_sums";
  check_logits(op, logits, real, device);
  check_rows(op, "target", target, logits, at::kLong);
  check_rows(op, "row_max", row_max, logits, stats_dtype(logits));
}

inline void check_cross_entropy_bwd(const at::Tensor& grad_loss, const at::Tensor& logits,
                                    const at::Tensor& target, const at::Tensor& row_max,
                                    const at::Tensor& log_z, int64_t real, double eps,
                                    int64_t vocab_size, c10::DeviceType device) {
  const char* op = "cross_entropy_bwd";
  check_logits(op, logits, real, device);
  const at::ScalarType acc = stats_dtype(logits);
  check_rows(op, "grad_loss", grad_loss, logits, acc);
  check_rows(op, "target", target, logits, at::kLong);
  check_rows(op, "row_max", row_max, logits, acc);
  check_rows(op, "log_z", log_z, logits, acc);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0 && eps <= 1, op, ": eps must be in [0, 1], got ",
              eps);
  TORCH_CHECK(vocab_size >= 1, op, ": vocab_size must be >= 1, got ", vocab_size);
}

}  // namespace megapp::op_checks
