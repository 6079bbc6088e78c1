// Philox-4x32-10 counter-based RNG (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11) and the dropout mask built on it. One definition for the CPU and CUDA kernels, mirrored
// bit for bit by the PyTorch reference in megapp/fusions/bias_ops.py.
//
// The mask is a pure function of (seed, n): element n of a dropout call (n = offset + flat index)
// draws lane n % 4 of philox4x32_10(counter = {lo(n/4), hi(n/4), 0, 0}, key = {lo(seed),
// hi(seed)}) and is kept iff that 32-bit draw is below floor((1 - p)·2^32). No state is stored:
// backward regenerates the mask from (seed, offset), and a caller that splits a tensor gets the
// slice of the whole tensor's mask by passing the slice's first flat index as the offset.
#pragma once

#include <stdint.h>

#include "megapp/common.h"

namespace megapp {

// Random123's constants for Philox-4x32: round multipliers and Weyl key increments.
constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;  // golden ratio
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;  // sqrt(3) - 1
constexpr int kPhiloxRounds = 10;

// Four 32-bit draws of one Philox block.
struct PhiloxBlock {
  uint32_t v[4];
};

MEGAPP_HOST_DEVICE MEGAPP_INLINE void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi,
                                                     uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  lo = a * b;
  hi = __umulhi(a, b);
#else
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  lo = static_cast<uint32_t>(product);
  hi = static_cast<uint32_t>(product >> 32);
#endif
}

// Philox-4x32 with 10 rounds; the key is bumped between rounds (9 bumps), as in Random123.
MEGAPP_HOST_DEVICE MEGAPP_INLINE PhiloxBlock philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2,
                                                           uint32_t c3, uint32_t k0, uint32_t k1) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < kPhiloxRounds; ++round) {
    if (round > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kPhiloxM0, c0, hi0, lo0);
    philox_mulhilo(kPhiloxM1, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return PhiloxBlock{{c0, c1, c2, c3}};
}

// The four draws for counter indices 4·block .. 4·block + 3 under seed.
MEGAPP_HOST_DEVICE MEGAPP_INLINE PhiloxBlock dropout_philox_block(uint64_t seed, uint64_t block) {
  return philox4x32_10(static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 0u, 0u,
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// Draws below the threshold are kept: floor((1 - p)·2^32), in [0, 2^32]. Host-side, in double,
// exactly as the Python reference computes it (IEEE double, truncation toward zero).
inline uint64_t dropout_keep_threshold(double p) {
  return static_cast<uint64_t>((1.0 - p) * 4294967296.0);
}

// 1/(1 - p), or 0 when p == 1 (everything dropped).
inline double dropout_scale(double p) { return p < 1.0 ? 1.0 / (1.0 - p) : 0.0; }

MEGAPP_HOST_DEVICE MEGAPP_INLINE uint32_t philox_lane(const PhiloxBlock& b, uint32_t lane) {
  // Selects instead of b.v[lane]: a dynamic index would put the block in local memory on the GPU.
  return lane == 0 ? b.v[0] : lane == 1 ? b.v[1] : lane == 2 ? b.v[2] : b.v[3];
}

// Keep bits of counter indices n0 .. n0 + 3: bit j is set iff element n0 + j is kept. One Philox
// block when n0 is a multiple of 4, two otherwise.
MEGAPP_HOST_DEVICE MEGAPP_INLINE uint32_t dropout_keep4(uint64_t seed, uint64_t n0,
                                                        uint64_t threshold) {
  const uint64_t block = n0 >> 2;
  const uint32_t lane0 = static_cast<uint32_t>(n0 & 3);
  const PhiloxBlock first = dropout_philox_block(seed, block);
  uint32_t bits = 0;
  if (lane0 == 0) {
#if defined(__CUDACC__)
#pragma unroll
#endif
    for (uint32_t j = 0; j < 4; ++j) bits |= static_cast<uint32_t>(first.v[j] < threshold) << j;
    return bits;
  }
  const PhiloxBlock second = dropout_philox_block(seed, block + 1);
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (uint32_t j = 0; j < 4; ++j) {
    const uint32_t lane = lane0 + j;
    const uint32_t draw = lane < 4 ? philox_lane(first, lane) : philox_lane(second, lane - 4);
    bits |= static_cast<uint32_t>(draw < threshold) << j;
  }
  return bits;
}

}  // namespace megapp
