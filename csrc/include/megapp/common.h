// Portability macros and elementwise primitives shared by the CPU (C++) and CUDA (nvcc) sources.
#pragma once

#include <math.h>

#if defined(__CUDACC__)
#define MEGAPP_HOST_DEVICE __host__ __device__
#define MEGAPP_INLINE __forceinline__
#else
#define MEGAPP_HOST_DEVICE
#define MEGAPP_INLINE inline
#endif

namespace megapp {

// The few non-arithmetic primitives the formula templates in megapp/*.h call, per value type T.
// Defined here for the scalar accumulation types; the CPU kernels specialize it for
// at::vec::Vectorized<float/double> (csrc/cpu/vec_kernels_impl.h), so the same templates run on
// whole vectors there.
template <typename T>
struct Elementwise;

template <>
struct Elementwise<float> {
  static MEGAPP_HOST_DEVICE MEGAPP_INLINE float exp(float v) { return ::expf(v); }
  static MEGAPP_HOST_DEVICE MEGAPP_INLINE float sqrt(float v) { return ::sqrtf(v); }
  // a where c != 0, b where c == 0 (both are evaluated).
  static MEGAPP_HOST_DEVICE MEGAPP_INLINE float where_nonzero(float c, float a, float b) {
    return c != 0.0f ? a : b;
  }
};

template <>
struct Elementwise<double> {
  static MEGAPP_HOST_DEVICE MEGAPP_INLINE double exp(double v) { return ::exp(v); }
  static MEGAPP_HOST_DEVICE MEGAPP_INLINE double sqrt(double v) { return ::sqrt(v); }
  static MEGAPP_HOST_DEVICE MEGAPP_INLINE double where_nonzero(double c, double a, double b) {
    return c != 0.0 ? a : b;
  }
};

}  // namespace megapp
