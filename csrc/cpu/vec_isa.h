// Which instruction-set builds of the vectorized row loops (vec_kernels_impl.h) this compiler
// makes. No includes: vec_kernels_avx2.cpp reads it before it switches the instruction set on.
#pragma once

// AVX2 + FMA + F16C on x86-64 with GCC: vec_kernels_avx2.cpp enables them with
// `#pragma GCC target`, so the build needs no per-file compiler flags.
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__)
#define MEGAPP_HAVE_AVX2_KERNELS 1
#endif
