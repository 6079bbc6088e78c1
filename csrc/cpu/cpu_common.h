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

// Norm statistics (mean / rstd) are float, or double for double inputs.
inline at::ScalarType stats_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Shape of the per-row statistics: x's shape without the last dim.
inline std::vector<int64_t> stats_shape(const at::Tensor& x) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.pop_back();
  return shape;
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

// Adds partial[b·n .. (b+1)·n) for b = 1, 2, ... into partial[0 .. n), in that order.
template <typename acc_t>
void sum_blocks(std::vector<acc_t>& partial, int64_t blocks, int64_t n) {
  for (int64_t b = 1; b < blocks; ++b) {
    for (int64_t c = 0; c < n; ++c) partial[c] += partial[b * n + c];
  }
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

}  // namespace megapp::cpu_detail
