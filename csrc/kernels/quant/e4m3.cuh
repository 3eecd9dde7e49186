// The block-scaled e4m3 recipe's device pieces (megatron_mok/fp8.py gives the same bits): per
// block of 128 values, s = max(amax, kMinAmax) / 448 (stored; dequantizes) and
// q = e4m3(x * (448 / max(amax, kMinAmax))) (round to nearest even, saturating).
#pragma once

#include <cuda_fp8.h>

#include "common.cuh"

namespace mok {
namespace e4m3 {

constexpr float kMax = 448.f;
constexpr float kMinAmax = 1e-4f;  // all-zero (padding) blocks get a finite scale

__device__ __forceinline__ uint32_t pack4(float a, float b, float c, float d) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  return (uint32_t)lo | ((uint32_t)hi << 16);
}

// (s, 448 / a) of a block with absolute maximum amax; both IEEE divisions, as fp8.py computes them.
__device__ __forceinline__ float2 scale_and_inverse(float amax) {
  const float a = fmaxf(amax, kMinAmax);
  return make_float2(__fdiv_rn(a, kMax), __fdiv_rn(kMax, a));
}

__device__ __forceinline__ uint2 pack8(const float (&v)[8], float inv) {
  return make_uint2(pack4(v[0] * inv, v[1] * inv, v[2] * inv, v[3] * inv),
                    pack4(v[4] * inv, v[5] * inv, v[6] * inv, v[7] * inv));
}

// Eight e4m3 values (bytes of raw, lowest first) as floats (exact).
__device__ __forceinline__ void unpack8(uint2 raw, float (&v)[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint8_t b = static_cast<uint8_t>(((j < 4 ? raw.x : raw.y) >> (8 * (j % 4))) & 0xff);
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
    v[j] = __half2float(__half(h));
  }
}

// amax of a 128-value block held 8 per lane by 16 consecutive lanes (a half warp). Every lane of
// the warp must call it (the shuffles span the warp; the halves do not mix).
__device__ __forceinline__ float half_warp_amax(const float (&v)[8]) {
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
  for (int o = 8; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  return amax;
}

// amax of a 128-value block held 16 per lane, as two pieces of 8, by 8 consecutive lanes. Every lane
// of the warp must call it (the shuffles span the warp; the groups of 8 do not mix).
__device__ __forceinline__ float octet_amax(const float (&a)[8], const float (&b)[8]) {
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fmaxf(fabsf(a[j]), fabsf(b[j])));
#pragma unroll
  for (int o = 4; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  return amax;
}

// A half warp's quantized block: 8 bytes a lane at q, and (lane 0 of the half) the scale.
__device__ __forceinline__ void store_half_warp_block(const float (&v)[8], float amax, uint8_t* q, float* scale,
                                                      int half_lane) {
  const float2 si = scale_and_inverse(amax);
  *reinterpret_cast<uint2*>(q) = pack8(v, si.y);
  if (half_lane == 0) *scale = si.x;
}

}  // namespace e4m3
}  // namespace mok
