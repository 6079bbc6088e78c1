// The vectorized row loops (vec_kernels_impl.h) for the build's baseline instruction set: ATen's
// generic at::vec::Vectorized (8 float lanes as plain arrays, which the compiler maps onto SSE2 on
// x86-64; NEON on arm64), exp from libm lane by lane.
#define CPU_CAPABILITY DEFAULT
#define MEGAPP_ROW_KERNELS_GETTER row_kernels_default
#include "vec_kernels_impl.h"
