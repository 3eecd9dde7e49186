// SwiGLU and its gradient, shared by the fused GEMM epilogues and the backward's kernels.
// silu(g) * u in fp32; no fast-math division, so the bits depend only on (g, u).
#pragma once

#include <cuda_runtime.h>

namespace mok {

__device__ __forceinline__ float silu(float g) { return __fdiv_rn(g, __fadd_rn(1.0f, __expf(-g))); }

__device__ __forceinline__ float swiglu(float g, float u) { return __fmul_rn(silu(g), u); }

// d_gate = d * u * sig * (1 + g * (1 - sig)),  d_up = d * silu(g)   (fp32, same bits on every path)
__device__ __forceinline__ void swiglu_grad(float g, float u, float d, float& dg, float& du) {
  const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, __expf(-g)));
  const float s = __fmul_rn(g, sig);
  const float dsilu = __fmul_rn(sig, __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, sig))));
  dg = __fmul_rn(__fmul_rn(d, u), dsilu);
  du = __fmul_rn(d, s);
}

}  // namespace mok
