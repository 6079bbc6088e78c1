// Helpers shared by the csrc/cpu/*.cpp kernels.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
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

}  // namespace megapp::cpu_detail
