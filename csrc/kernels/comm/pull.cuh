// One routed row of the backward's pull (one warp), for bwd_pull (backward.cu): row `row` of the
// schedule
// reads grad_out row row_src_slot[row] / k and router weight [row_src_slot[row]] of rank
// row_src_rank[row] (g_bufs, p_bufs), writes dy = bf16(w * g) (fp32 product, one rounding) and
// stores <g, y[row]> into dw_bufs[src][slot]: fp32, per lane in column order, then a butterfly
// over the warp (a + b == b + a bitwise, so every lane ends with the same value, in a fixed order).
// A padding row (src < 0): dy = 0 (it adds nothing to the weight gradients), nothing pushed.
#pragma once

#include "common.cuh"
#include "quant/e4m3.cuh"

namespace mok {

// What routed row `row` (of source rank src >= 0) reads: its router weight, its grad_out row on the
// source rank and its own expert output row y.
struct PullSource {
  int slot;
  float w;
  const uint4* g;
  const uint4* y;
};

__device__ __forceinline__ PullSource pull_source(int row, int src, const int* __restrict__ row_src_slot,
                                                  const PeerPtrs& g_bufs, const PeerPtrs& p_bufs,
                                                  const __nv_bfloat16* __restrict__ y, int H, int k) {
  const int slot = row_src_slot[row];
  const int token = slot / k;
  return PullSource{slot, static_cast<const float*>(p_bufs.p[src])[slot],
                    reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(g_bufs.p[src]) +
                                                   static_cast<int64_t>(token) * H),
                    reinterpret_cast<const uint4*>(y + static_cast<int64_t>(row) * H)};
}

// The warp's per-lane <g, y> sums, in a fixed butterfly order, into the source's slot.
__device__ __forceinline__ void push_router_grad(float acc, const PullSource& ps, const PeerPtrs& dw_bufs, int src,
                                                 int lane) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, off));
  if (lane == 0) static_cast<float*>(dw_bufs.p[src])[ps.slot] = acc;
}

// One 16-byte piece of a row: acc += <g, y> per element in order, returns bf16(w * g).
__device__ __forceinline__ uint4 pull_piece(uint4 gv, uint4 yv, float w, float& acc) {
  float gf[8], yf[8], o[8];
  unpack8(gv, gf);
  unpack8(yv, yf);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    acc = __fadd_rn(acc, __fmul_rn(gf[j], yf[j]));
    o[j] = __fmul_rn(w, gf[j]);
  }
  return pack8(o);
}

template <int kUnroll = 4>
__device__ __forceinline__ void pull_grad_row(int row, __nv_bfloat16* dy_row, const int* __restrict__ row_src_rank,
                                              const int* __restrict__ row_src_slot, const PeerPtrs& g_bufs,
                                              const PeerPtrs& p_bufs, const PeerPtrs& dw_bufs,
                                              const __nv_bfloat16* __restrict__ y, int H, int k, int lane) {
  uint4* dst = reinterpret_cast<uint4*>(dy_row);
  const int n16 = H / 8;
  const int src = row_src_rank[row];
  if (src < 0) {
    for (int c = lane; c < n16; c += 32) st16(dst + c, make_uint4(0, 0, 0, 0));
    return;
  }
  const PullSource ps = pull_source(row, src, row_src_slot, g_bufs, p_bufs, y, H, k);
  float acc = 0.f;
  int c = lane;
  for (; c + 32 * (kUnroll - 1) < n16; c += 32 * kUnroll) {
    uint4 gv[kUnroll], yv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      gv[u] = ld16(ps.g + c + 32 * u);
      yv[u] = ld16(ps.y + c + 32 * u);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) st16(dst + c + 32 * u, pull_piece(gv[u], yv[u], ps.w, acc));
  }
  for (; c < n16; c += 32) st16(dst + c, pull_piece(ld16(ps.g + c), ld16(ps.y + c), ps.w, acc));
  push_router_grad(acc, ps, dw_bufs, src, lane);
}

// pull_grad_row (the same bits of dy and <g, y>) that also quantizes dy row `row` for the fp8
// dgrad, as quantize_rows_e4m3 would from dy: e4m3 bytes into q_row, the scale of 128-column block
// kb into scale[kb * scale_ld + row]. H must be a multiple of 128: a half warp holds one block, and
// the loop is warp-uniform (the half-warp shuffles).
template <int kUnroll = 4>
__device__ __forceinline__ void pull_grad_row_e4m3(int row, __nv_bfloat16* dy_row, uint8_t* q_row, float* scale,
                                                   int64_t scale_ld, const int* __restrict__ row_src_rank,
                                                   const int* __restrict__ row_src_slot, const PeerPtrs& g_bufs,
                                                   const PeerPtrs& p_bufs, const PeerPtrs& dw_bufs,
                                                   const __nv_bfloat16* __restrict__ y, int H, int k, int lane) {
  uint4* dst = reinterpret_cast<uint4*>(dy_row);
  const int n16 = H / 8;
  const int src = row_src_rank[row];
  const float2 zero_si = e4m3::scale_and_inverse(0.f);
  if (src < 0) {  // a zero row: zero bytes, the floor scale
    for (int c = lane; c < n16; c += 32) {
      st16(dst + c, make_uint4(0, 0, 0, 0));
      *reinterpret_cast<uint2*>(q_row + 8 * c) = make_uint2(0, 0);
      if (lane % 16 == 0) scale[(c / 16) * scale_ld + row] = zero_si.x;
    }
    return;
  }
  const PullSource ps = pull_source(row, src, row_src_slot, g_bufs, p_bufs, y, H, k);
  float acc = 0.f;
  for (int base = 0; base < n16; base += 32 * kUnroll) {
    uint4 gv[kUnroll], yv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + 32 * u + lane;
      if (c < n16) {
        gv[u] = ld16(ps.g + c);
        yv[u] = ld16(ps.y + c);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + 32 * u + lane;
      if (base + 32 * u >= n16) break;  // warp-uniform
      const bool live = c < n16;         // whole half warps (n16 is a multiple of 16)
      float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (live) {
        const uint4 o = pull_piece(gv[u], yv[u], ps.w, acc);
        st16(dst + c, o);
        unpack8(o, v);  // the bf16 values, as the standalone quantizer reads them
      }
      const float2 si = e4m3::scale_and_inverse(e4m3::half_warp_amax(v));
      if (live) {
        *reinterpret_cast<uint2*>(q_row + 8 * c) = e4m3::pack8(v, si.y);
        if (lane % 16 == 0) scale[(c / 16) * scale_ld + row] = si.x;
      }
    }
  }
  push_router_grad(acc, ps, dw_bufs, src, lane);
}

}  // namespace mok
