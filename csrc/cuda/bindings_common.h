// Host-side helpers shared by the csrc/cuda/bindings*.cpp files. Only c10 CUDA headers and
// ATen/ATen.h: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE headers.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <optional>

namespace megapp::bindings_detail {

inline void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

// Raw pointers in the CUDA element type T (float, __nv_bfloat16 or __half); the caller has
// checked that the tensor's dtype has the same layout. Absent optional tensors give null.
template <typename T>
const T* in_ptr(const at::Tensor& t) {
  return static_cast<const T*>(t.const_data_ptr());
}
template <typename T>
const T* in_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? in_ptr<T>(*t) : nullptr;
}
template <typename T>
T* out_ptr(at::Tensor& t) {
  return static_cast<T*>(t.mutable_data_ptr());
}
template <typename T>
T* out_ptr(std::optional<at::Tensor>& t) {
  return t.has_value() ? out_ptr<T>(*t) : nullptr;
}

// Calls fn(T{}) with the CUDA element type matching dtype.
template <typename Fn>
void dispatch_cuda_floats(at::ScalarType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case at::kFloat:
      return fn(float{});
    case at::kBFloat16:
      return fn(__nv_bfloat16{});
    case at::kHalf:
      return fn(__half{});
    default:
      TORCH_CHECK(false, op, ": unsupported dtype ", dtype,
                  " on CUDA (float32, bfloat16, float16)");
  }
}

// Launches a kernel on the current stream with the CUDA element type of dtype: launch(T{}, stream)
// starts it and returns the launch status, which is checked.
template <typename Fn>
void launch_cuda_floats(const char* op, at::ScalarType dtype, Fn&& launch) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_cuda_floats(dtype, op, [&](auto tag) { check_launch(op, launch(tag, stream)); });
}

}  // namespace megapp::bindings_detail
