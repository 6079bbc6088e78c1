// The vectorized row loops (vec_kernels_impl.h) for AVX2 + FMA + F16C: ATen's CPU_CAPABILITY=AVX2
// Vectorized (8 float lanes in a ymm register, Sleef's vectorized exp, F16C half conversions).
//
// The instruction set is switched on here rather than with compiler flags, so that setup.py
// compiles every csrc/cpu file alike: `#pragma GCC target` before any include makes GCC generate
// AVX2 code for everything below, and the macros that -mavx2 -mfma -mf16c would predefine (the
// C++ front end does not define them for the pragma) select ATen's and Sleef's AVX2 code paths.
// row_kernels() (vec_dispatch.cpp) calls into this file only on CPUs with AVX2, FMA and F16C.
// Code that runs at load time on any CPU must not come from here: the file defines no static
// objects (the c10 headers' <iostream> adds its usual initializer, a plain call).
#include "vec_isa.h"

#if defined(MEGAPP_HAVE_AVX2_KERNELS)
#pragma GCC target("avx2,fma,f16c")
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define __F16C__ 1
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define MEGAPP_ROW_KERNELS_GETTER row_kernels_avx2
#include "vec_kernels_impl.h"
#endif
