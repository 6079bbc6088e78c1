// Portability macros shared by the CPU (C++) and CUDA (nvcc) sources.
#pragma once

#if defined(__CUDACC__)
#define MEGAPP_HOST_DEVICE __host__ __device__
#define MEGAPP_INLINE __forceinline__
#else
#define MEGAPP_HOST_DEVICE
#define MEGAPP_INLINE inline
#endif
