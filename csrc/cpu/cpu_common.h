// Helpers shared by the csrc/cpu/*.cpp kernels.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace megapp::cpu_detail {

// at::parallel_for grain in rows of cols elements (cols > 0): about GRAIN_SIZE elements a task.
inline int64_t rows_grain(int64_t cols) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / cols);
}

// Parameter gradients (bias, norm weight/bias) are summed over fixed blocks of rows, then the
// blocks in order (b = 0, 1, ...): the blocking depends only on the shape, never on the thread
// count, so the result is bitwise reproducible.
struct RowBlocks {
  static constexpr int64_t kMaxBlocks = 64;
  int64_t count;  // blocks, each about GRAIN_SIZE elements, at most kMaxBlocks
  int64_t rows;   // rows per block (the last block may have fewer)

  RowBlocks(int64_t total_rows, int64_t cols)
      : count(std::clamp<int64_t>(at::divup(total_rows * cols, at::internal::GRAIN_SIZE), 1,
                                  kMaxBlocks)),
        rows(std::max<int64_t>(1, at::divup(total_rows, count))) {}

  int64_t begin(int64_t block) const { return block * rows; }
  int64_t end(int64_t block, int64_t total_rows) const {
    return std::min(total_rows, (block + 1) * rows);
  }
};

// Adds partial[b·n .. (b+1)·n) for b = 1, 2, ... into partial[0 .. n), in that order, and
// rounds the totals once into out[0 .. n).
template <typename acc_t, typename T>
void store_block_sums(acc_t* partial, int64_t blocks, int64_t n, T* out) {
  for (int64_t b = 1; b < blocks; ++b) {
    for (int64_t c = 0; c < n; ++c) partial[c] += partial[b * n + c];
  }
  for (int64_t c = 0; c < n; ++c) out[c] = static_cast<T>(partial[c]);
}

// p[0, n) in acc_t: p itself when it already is acc_t (or null), else a copy widened into
// storage.
template <typename acc_t, typename W>
const acc_t* widened(const W* p, int64_t n, std::vector<acc_t>& storage) {
  if constexpr (std::is_same_v<acc_t, W>) {
    return p;
  } else {
    if (p == nullptr) return nullptr;
    storage.resize(n);
    for (int64_t i = 0; i < n; ++i) storage[i] = static_cast<acc_t>(p[i]);
    return storage.data();
  }
}

// Calls fn(T{}, W{}) with a norm's activation element type T (x's) and parameter element type W:
// W is T, or float for bf16/half x with float32 parameters.
template <typename Fn>
void dispatch_norm_types(const at::Tensor& x, const at::Tensor& weight, Fn&& fn) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "norm", [&] {
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
      fn(scalar_t{}, scalar_t{});
    } else if (weight.scalar_type() == at::kFloat) {
      fn(scalar_t{}, float{});
    } else {
      fn(scalar_t{}, scalar_t{});
    }
  });
}

}  // namespace megapp::cpu_detail
