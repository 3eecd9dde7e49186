// One routed row of the backward's pull (one warp), shared by bwd_pull (backward.cu) and the
// backward megakernel's comm CTAs, so both give the same bits: padded row `row` of the schedule
// reads grad_out row row_src_slot[row] / k and router weight [row_src_slot[row]] of rank
// row_src_rank[row] (g_bufs, p_bufs), writes dy = bf16(w * g) (fp32 product, one rounding) and
// stores <g, y[row]> into dw_bufs[src][slot]: fp32, per lane in column order, then a butterfly
// over the warp (a + b == b + a bitwise, so every lane ends with the same value, in a fixed order).
// row < 0 or a padding row (src < 0): dy = 0 (it adds nothing to the weight gradients), nothing
// pushed.
#pragma once

#include "common.cuh"

namespace mok {

template <int kUnroll = 4>
__device__ __forceinline__ void pull_grad_row(int row, __nv_bfloat16* dy_row, const int* __restrict__ row_src_rank,
                                              const int* __restrict__ row_src_slot, const PeerPtrs& g_bufs,
                                              const PeerPtrs& p_bufs, const PeerPtrs& dw_bufs,
                                              const __nv_bfloat16* __restrict__ y, int H, int k, int lane) {
  uint4* dst = reinterpret_cast<uint4*>(dy_row);
  const int n16 = H / 8;
  const int src = row < 0 ? -1 : row_src_rank[row];
  if (src < 0) {
    for (int c = lane; c < n16; c += 32) st16(dst + c, make_uint4(0, 0, 0, 0));
    return;
  }
  const int slot = row_src_slot[row];
  const int token = slot / k;
  const float w = static_cast<const float*>(p_bufs.p[src])[slot];
  const uint4* gs = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(g_bufs.p[src]) +
                                                   static_cast<int64_t>(token) * H);
  const uint4* ys = reinterpret_cast<const uint4*>(y + static_cast<int64_t>(row) * H);
  float acc = 0.f;
  int c = lane;
  for (; c + 32 * (kUnroll - 1) < n16; c += 32 * kUnroll) {
    uint4 gv[kUnroll], yv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      gv[u] = ld16(gs + c + 32 * u);
      yv[u] = ld16(ys + c + 32 * u);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float gf[8], yf[8], o[8];
      unpack8(gv[u], gf);
      unpack8(yv[u], yf);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc = __fadd_rn(acc, __fmul_rn(gf[j], yf[j]));
        o[j] = __fmul_rn(w, gf[j]);
      }
      st16(dst + c + 32 * u, pack8(o));
    }
  }
  for (; c < n16; c += 32) {
    float gf[8], yf[8], o[8];
    unpack8(ld16(gs + c), gf);
    unpack8(ld16(ys + c), yf);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      acc = __fadd_rn(acc, __fmul_rn(gf[j], yf[j]));
      o[j] = __fmul_rn(w, gf[j]);
    }
    st16(dst + c, pack8(o));
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, off));
  if (lane == 0) static_cast<float*>(dw_bufs.p[src])[slot] = acc;
}

}  // namespace mok
