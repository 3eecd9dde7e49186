// One routed row of the backward's pull (one warp), for bwd_pull (backward.cu): row `row` of the
// schedule reads grad_out row row_src_slot[row] / k and router weight [row_src_slot[row]] of rank
// row_src_rank[row] (g_bufs, p_bufs), copies the row as it is into g_rows and the weight into
// row_w[row]. The down projection's dgrad takes the unweighted rows: its epilogue forms the
// router-weight gradient <g, y> = <g @ fc2[e], act> from that product before it applies w, so the
// forward keeps no expert output. A padding row (src < 0): zeros, weight 0.
#pragma once

#include "common.cuh"
#include "quant/e4m3.cuh"

namespace mok {

// Routed row `row` (of source rank src >= 0): its grad_out row on the source rank; its router
// weight into row_w (lane 0).
__device__ __forceinline__ const uint4* pull_source(int row, int src, const int* __restrict__ row_src_slot,
                                                    const PeerPtrs& g_bufs, const PeerPtrs& p_bufs,
                                                    float* __restrict__ row_w, int H, int k, int lane) {
  const int slot = row_src_slot[row];
  if (lane == 0) row_w[row] = static_cast<const float*>(p_bufs.p[src])[slot];
  return reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(g_bufs.p[src]) +
                                        static_cast<int64_t>(slot / k) * H);
}

__device__ __forceinline__ void pull_grad_row(int row, __nv_bfloat16* g_row, float* __restrict__ row_w,
                                              const int* __restrict__ row_src_rank,
                                              const int* __restrict__ row_src_slot, const PeerPtrs& g_bufs,
                                              const PeerPtrs& p_bufs, int H, int k, int lane) {
  uint4* dst = reinterpret_cast<uint4*>(g_row);
  const int n16 = H / 8;
  const int src = row_src_rank[row];
  if (src < 0) {
    for (int c = lane; c < n16; c += 32) st16(dst + c, make_uint4(0, 0, 0, 0));
    if (lane == 0) row_w[row] = 0.f;
    return;
  }
  warp_copy_row(dst, pull_source(row, src, row_src_slot, g_bufs, p_bufs, row_w, H, k, lane), n16, lane);
}

// pull_grad_row that also quantizes the row for the fp8 dgrad, as quantize_rows_e4m3 would from
// g_rows: e4m3 bytes into q_row, the scale of 128-column block kb into scale[kb * scale_ld + row].
// H must be a multiple of 128: a half warp holds one block, and the loop is warp-uniform (the
// half-warp shuffles).
template <int kUnroll = 4>
__device__ __forceinline__ void pull_grad_row_e4m3(int row, __nv_bfloat16* g_row, float* __restrict__ row_w,
                                                   uint8_t* q_row, float* scale, int64_t scale_ld,
                                                   const int* __restrict__ row_src_rank,
                                                   const int* __restrict__ row_src_slot, const PeerPtrs& g_bufs,
                                                   const PeerPtrs& p_bufs, int H, int k, int lane) {
  uint4* dst = reinterpret_cast<uint4*>(g_row);
  const int n16 = H / 8;
  const int src = row_src_rank[row];
  const float2 zero_si = e4m3::scale_and_inverse(0.f);
  if (src < 0) {  // a zero row: zero bytes, the floor scale
    for (int c = lane; c < n16; c += 32) {
      st16(dst + c, make_uint4(0, 0, 0, 0));
      *reinterpret_cast<uint2*>(q_row + 8 * c) = make_uint2(0, 0);
      if (lane % 16 == 0) scale[(c / 16) * scale_ld + row] = zero_si.x;
    }
    if (lane == 0) row_w[row] = 0.f;
    return;
  }
  const uint4* g = pull_source(row, src, row_src_slot, g_bufs, p_bufs, row_w, H, k, lane);
  for (int base = 0; base < n16; base += 32 * kUnroll) {
    uint4 gv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + 32 * u + lane;
      if (c < n16) gv[u] = ld16(g + c);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + 32 * u + lane;
      if (base + 32 * u >= n16) break;  // warp-uniform
      const bool live = c < n16;         // whole half warps (n16 is a multiple of 16)
      float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (live) {
        st16(dst + c, gv[u]);
        unpack8(gv[u], v);
      }
      const float2 si = e4m3::scale_and_inverse(e4m3::half_warp_amax(v));
      if (live) {
        *reinterpret_cast<uint2*>(q_row + 8 * c) = e4m3::pack8(v, si.y);
        if (lane % 16 == 0) scale[(c / 16) * scale_ld + row] = si.x;
      }
    }
  }
}

}  // namespace mok
