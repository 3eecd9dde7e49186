// SwiGLU and its gradient, shared by the fused GEMM epilogues and the backward's kernels.
// silu(g) * u in fp32; no fast-math division, so the bits depend only on (g, u).
#pragma once

#include <cuda_runtime.h>

namespace mok {

__device__ __forceinline__ float silu(float g) { return __fdiv_rn(g, __fadd_rn(1.0f, __expf(-g))); }

__device__ __forceinline__ float swiglu(float g, float u) { return __fmul_rn(silu(g), u); }

// d_gate = d * u * sig * (1 + g * (1 - sig)),  d_up = d * silu(g), from sig = 1 / (1 + exp(-g))
// (fp32, same bits on every path)
__device__ __forceinline__ void swiglu_grad(float g, float u, float d, float sig, float& dg, float& du) {
  const float s = __fmul_rn(g, sig);
  const float dsilu = __fmul_rn(sig, __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, sig))));
  dg = __fmul_rn(__fmul_rn(d, u), dsilu);
  du = __fmul_rn(d, s);
}

// silu(g) (the bits of silu() above) and sig = 1 / (1 + exp(-g)) correctly rounded, of N values at
// once. __fdiv_rn checks each division for its slow path inline, which makes every division a block
// of its own (a dependent chain of MUFU and FMA, then a branch); one warp of an SM sub-partition
// running the SwiGLU backward waits on them one after another. Here both divisions by
// b = 1 + exp(-g) share one reciprocal, refined by FMAs (r ~ 1/b, then q = a r corrected by the
// exact remainder a - b q, Markstein), with no branch, so the N values overlap. That is the
// correctly rounded quotient where b < 2^60 and a is 0 or 2^-60 <= |a| <= 2^60 (no subnormal,
// infinite or NaN step); any other value of the N sends all N through __fdiv_rn. The same bits as
// silu() and __fdiv_rn for every fp32 g: tested (tests/gpu/test_swiglu_1gpu.py).
__device__ __forceinline__ float rcp_approx(float b) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  return r;
}

__device__ __forceinline__ float div_refined(float a, float b, float r) {
  const float q = __fmul_rn(a, r);
  return __fmaf_rn(r, __fmaf_rn(-b, q, a), q);
}

template <int N>
__device__ __forceinline__ void silu_and_sigmoid(const float* g, float* silu_g, float* sig) {
  float b[N];
  bool fast = true;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    b[j] = __fadd_rn(1.0f, __expf(-g[j]));
    float r = rcp_approx(b[j]);
    r = __fmaf_rn(r, __fmaf_rn(-b[j], r, 1.0f), r);
    sig[j] = div_refined(1.0f, b[j], r);
    silu_g[j] = g[j] == 0.0f ? g[j] : div_refined(g[j], b[j], r);  // +-0 / b keeps the sign
    const float ag = fabsf(g[j]);
    fast &= (b[j] < 0x1p60f) & ((ag == 0.0f) | ((ag >= 0x1p-60f) & (ag <= 0x1p60f)));  // no branches
  }
  if (!fast) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      sig[j] = __fdiv_rn(1.0f, b[j]);
      silu_g[j] = __fdiv_rn(g[j], b[j]);
    }
  }
}

}  // namespace mok
