// SwiGLU activation, shared by the fused gate/up GEMM epilogue (and later the backward).
// silu(g) * u in fp32; no fast-math division, so the bits depend only on (g, u).
#pragma once

#include <cuda_runtime.h>

namespace mok {

__device__ __forceinline__ float silu(float g) { return __fdiv_rn(g, __fadd_rn(1.0f, __expf(-g))); }

__device__ __forceinline__ float swiglu(float g, float u) { return __fmul_rn(silu(g), u); }

}  // namespace mok
