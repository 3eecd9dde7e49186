// Row tasks of the block-scaled e4m3 expert GEMM (expert_gemm_fp8.cuh), for its plain-weight
// launches (the down projection and the backward's dgrads): the tokens are wgmma's M side (64 rows a consumer warpgroup, <= 128 a task) and two 128-row
// weight tiles its N side (256 output columns a task, one 128-column slice per tile).
//
// Why: with the weights on the M side (column tasks, expert_gemm_fp8.cuh) each thread's
// accumulators span up to 32 token columns per slice, so the promotion of a 128-K block loads 32
// token scales from shared memory and multiplies each by the weight scale before its 64 FMAs (ncu:
// the promotion's shared loads and the wgmma waits are most of the stall samples, and the tensor
// pipe is busy 41% of the time). Here a thread holds two token rows: the promotion
// is two shared loads and two multiplies per stage and slice, then its 64 FMAs. Bytes per stage:
// 16 KB of tokens and 32 KB of weights for 8.4 MFLOP, as the 256-token column tasks.
//
// Bits: the same as the column tasks: every element is the sum over its 128-K
// blocks, in ascending order, of the block's e4m3 products summed by the tensor cores, times
// (token scale * weight scale), added with one fma.
//
// Accumulator layout of a consumer warpgroup (thread t, warp w = t / 32, lane l, q = l % 4):
// acc[64 j + 4 g + 2 s + h] holds token row 16 w + l / 4 + 8 s of the warpgroup's 64 and column
// 8 g + 2 q + h of weight tile j.
#pragma once

#include "gemm/expert_gemm_fp8.cuh"

namespace mok {
// xgemm8r: the e4m3 expert-major GEMM's Row tasks (an expert's token rows on wgmma's M side).
namespace xgemm8r {

using xgemm8::BK;
using xgemm8::kWBytes;
constexpr int kTok = tuning::kE4m3RowTaskTokens;  // token rows per task: two warpgroups of 64
constexpr int kTiles = 2;                     // 128-row weight tiles per task
constexpr int kStages = tuning::kE4m3RowStages;
constexpr int kXBytes = kTok * BK;            // 16 KB
constexpr int kWTaskBytes = kTiles * kWBytes;  // 32 KB
constexpr int kRBytes = kTok * 4;             // the stage's token scales (128 fp32)
constexpr int kOffStaging = kStages * (kWTaskBytes + kXBytes);
constexpr int kOffScales = kOffStaging + 2 * xgemm::kStageBytesPerWG;
constexpr int kOffBarriers = kOffScales + kStages * kRBytes;
// then the task bookkeeping (xgemm::TaskTail)
constexpr int kOffTail = kOffBarriers + 2 * kStages * 8;
constexpr int kSmemBytes = kOffTail + xgemm::TaskTail::kBytes + 1024 /* alignment */;
static_assert(xgemm::task_tail_fits(kStages), "a task's tag and slot outlive their reading");
static_assert(kSmemBytes <= 227 * 1024, "shared memory");

struct Smem {
  static constexpr int kStages = xgemm8r::kStages;
  uint8_t* base;
  __device__ __forceinline__ uint8_t* w(int s) const { return base + s * kWTaskBytes; }  // tile j at + j kWBytes
  __device__ __forceinline__ uint8_t* x(int s) const { return base + kStages * kWTaskBytes + s * kXBytes; }
  __device__ __forceinline__ __nv_bfloat16* staging(int cw) const {
    return reinterpret_cast<__nv_bfloat16*>(base + kOffStaging) + cw * (64 * xgemm::kStageStride);
  }
  __device__ __forceinline__ uint8_t* scales(int s) const { return base + kOffScales + s * kRBytes; }
  __device__ __forceinline__ uint64_t* full(int s) const { return reinterpret_cast<uint64_t*>(base + kOffBarriers) + s; }
  __device__ __forceinline__ uint64_t* empty(int s) const { return full(kStages + s); }
  __device__ __forceinline__ xgemm::TaskTail tail() const { return {base + kOffTail}; }
};

__device__ __forceinline__ Smem carve_smem(uint8_t* raw) {
  return Smem{reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023))};
}

// A task's `block` is a pair of weight tiles (2 block, 2 block + 1: those < n_blocks).
__host__ __device__ __forceinline__ int task_blocks(const xgemm::Params& g) { return (g.n_blocks + 1) / 2; }
__device__ __forceinline__ int tiles_of(const xgemm::Params& g, const xgemm::Task& t) {
  return min(kTiles, g.n_blocks - kTiles * t.block);
}
__device__ __forceinline__ int num_tasks(const xgemm::Params& g, const int* prefix) {
  return prefix[g.nseg] * task_blocks(g);
}

// Task u: expert-major, then tile pair, then chunk (the chunks of one pair run side by side and
// share its weights in L2); chunks of 128 rows, the last one the rest (prefix from
// build_chunk_prefix<kTok>): equal chunks fill more m64 tiles (170 rows as 96 + 80 take four, as
// 128 + 48 three).
__device__ __forceinline__ xgemm::Task decode(const xgemm::Params& g, const int* prefix, int u) {
  const int nb = task_blocks(g);
  const int e = xgemm::find_expert(g, prefix, u, nb);
  const int ch = prefix[e + 1] - prefix[e];
  const int local = u - prefix[e] * nb;
  return xgemm::make_task<kTok / xgemm::kTokAlign>(g, e, local / ch, local % ch, ch);
}

// Row pairs (a multiple of 4 weight tiles, so tile pairs come in pairs): the two CTAs of a 2-CTA
// cluster run two tasks in step:
// - chunks 2 i and 2 i + 1 of an expert against one tile pair (CTA r: chunk 2 i + r), the weights
//   shared (shares_w: CTA r loads tile r of the pair and multicasts it into both rings);
// - an expert's odd last chunk against tile pairs 2 j and 2 j + 1 (CTA r: 2 j + r), each CTA
//   loading its own operands (sharing the token boxes was no faster).
// Measured in the layer against one CTA a task: 4-12% faster where a full chunk pairs with a short
// one (129-255 rows an expert), as fast with two full chunks.
// Cluster unit P, expert-major, then tile pair, then chunk pair: an expert of c chunks has
// c * nb / 2 units (nb tile pairs), so the units' prefix is the chunks' times nb / 2.
__host__ __device__ __forceinline__ bool pairs_fit(const xgemm::Params& g) { return g.n_blocks % 4 == 0; }
__device__ __forceinline__ int num_pair_units(const xgemm::Params& g, const int* prefix) {
  return prefix[g.nseg] * (task_blocks(g) / 2);
}
__device__ __forceinline__ xgemm::Task decode_pair(const xgemm::Params& g, const int* prefix, int P, int rank,
                                                   bool& shares_w) {
  const int half = task_blocks(g) / 2;
  const int e = xgemm::find_expert(g, prefix, P, half);
  const int ch = prefix[e + 1] - prefix[e];
  const int local = P - prefix[e] * half;
  const int hc = ch / 2, hc1 = max(hc, 1);  // hc = 0: no chunk pairs (shares_w is false)
  shares_w = local < 2 * hc * half;
  const int block = shares_w ? local / hc1 : 2 * (local - 2 * hc * half) + rank;
  const int c = shares_w ? 2 * (local % hc1) + rank : ch - 1;
  return xgemm::make_task<kTok / xgemm::kTokAlign>(g, e, block, c, ch);
}

// Producer thread: per stage the task's weight tiles, its token rows (64-row boxes) and their 128
// scales of block kb.
// kPaired (row pairs, decode_pair): shares_w, this CTA loads tile `rank` of the pair and multicasts
// it, and the peer multicasts the other, so a stage still expects the task's whole bytes.
template <bool kPaired = false>
__device__ __forceinline__ void produce_task(const xgemm::Params& g, const CUtensorMap* tmW, const CUtensorMap* tmX,
                                             const CUtensorMap* tmR, const Smem& sm, const xgemm::Task& t,
                                             uint32_t& it, bool shares_w = false) {
  const int nk = xgemm8::k_blocks(g.K);
  const int nbox = (t.n_tok + xgemm::kXBox - 1) / xgemm::kXBox;
  const int tiles = tiles_of(g, t);
  const bool w_mc = kPaired && shares_w;
  const int rank = w_mc ? static_cast<int>(cluster_ctarank()) : 0;
  for (int kb = 0; kb < nk; ++kb, ++it) {
    const int s = it % kStages;
    gemm::ring_wait<false>(sm.empty(s), ((it / kStages) & 1) ^ 1, nullptr);
    mbar_arrive_expect_tx(sm.full(s), tiles * kWBytes + nbox * xgemm::kXBox * BK + kRBytes);
    for (int j = w_mc ? rank : 0; j < tiles; j += w_mc ? kTiles : 1) {
      const int tile = kTiles * t.block + j;
      const int c1 = t.seg * g.w_rows_per_seg + tile * xgemm::WM;
      if (w_mc)
        tma_load_2d_multicast(sm.w(s) + j * kWBytes, tmW, sm.full(s), kb * BK, c1, 0x3);
      else
        tma_load_2d(sm.w(s) + j * kWBytes, tmW, sm.full(s), kb * BK, c1);
    }
    xgemm::load_token_boxes<false>(sm.x(s), tmX, sm.full(s), kb * BK, t.row0, nbox);
    tma_load_2d(sm.scales(s), tmR, sm.full(s), t.row0, kb);
  }
}

// wgmma m64 n128 k32 into sum (a fresh sum unless accumulate).
template <size_t... Is>
__device__ __forceinline__ void wgmma_tile(float (&sum)[64], uint64_t da, uint64_t db, bool accumulate,
                                           std::index_sequence<Is...>) {
  cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>::fma(
      da, db, sum[Is]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

// Tile j of stage s: the warpgroup's 64 token rows against the tile's 128 weight rows, the four
// k32 steps summed afresh into sum, waited for, and added to acc[64 j ..] times the rows' scales
// (s0: row 16 w + l / 4, s1: 8 rows below).
template <int j>
__device__ __forceinline__ void mma_tile(const Smem& sm, int s, int cw, float (&acc)[128], float (&sum)[64], float s0,
                                         float s1, const float* ws) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BK / 32; ++kk) {
    const uint64_t da = wgmma_desc_sw128(sm.x(s) + cw * 64 * BK + kk * 32);
    const uint64_t db = wgmma_desc_sw128(sm.w(s) + j * kWBytes + kk * 32);
    // a runtime flag for the fresh start, as in xgemm8::mma_slice (a constant one: C7511)
    wgmma_tile(sum, da, db, kk > 0 || ws == nullptr, std::make_index_sequence<64>{});
  }
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(sum[i])::"memory");
#pragma unroll
  for (int g = 0; g < 16; ++g) {
    float* a = acc + 64 * j + 4 * g;
    a[0] = fmaf(sum[4 * g], s0, a[0]);
    a[1] = fmaf(sum[4 * g + 1], s0, a[1]);
    a[2] = fmaf(sum[4 * g + 2], s1, a[2]);
    a[3] = fmaf(sum[4 * g + 3], s1, a[3]);
  }
}

// Consumer warpgroup `cw` of task t: per stage tile 0, then tile 1 (if the task has it), each
// promoted while the other warpgroup's wgmmas run. ws: the weight scales of tile 2 block. A
// warpgroup without token rows (n_tok <= 64 for cw = 1) only frees the stages; kPaired: on both
// CTAs' rings (the peer multicasts into ours).
template <bool kPaired = false>
__device__ __forceinline__ void mma_task(const xgemm::Params& g, const Smem& sm, int cw, const xgemm::Task& t,
                                         float (&acc)[128], float (&sum)[64], uint32_t& it, const float* ws) {
  const int nk = xgemm8::k_blocks(g.K);
  const bool two = tiles_of(g, t) > 1, active = 64 * cw < t.n_tok;
  const float* ws1 = ws + nk;  // tile 2 block + 1 (read only if the task has it)
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  // the weight scales one block ahead (their global load stalled the promotion: ncu)
  float w0_next = __ldg(ws), w1_next = two ? __ldg(ws1) : 0.f;
  const int lane = threadIdx.x % 32, row = 64 * cw + 16 * ((threadIdx.x % 128) / 32) + lane / 4;
  for (int kb = 0; kb < nk; ++kb, ++it) {
    const int s = it % kStages;
    const float w0 = w0_next, w1 = w1_next;
    if (kb + 1 < nk) {
      w0_next = __ldg(ws + kb + 1);
      if (two) w1_next = __ldg(ws1 + kb + 1);
    }
    gemm::ring_wait<false>(sm.full(s), (it / kStages) & 1, nullptr);
    if (active) {
      const uint32_t xs = smem_u32(sm.scales(s)) + 4 * row;
      const float x0 = ld_shared_f32(xs), x1 = ld_shared_f32(xs + 4 * 8);
      mma_tile<0>(sm, s, cw, acc, sum, x0 * w0, x1 * w0, ws);
      if (two) mma_tile<1>(sm, s, cw, acc, sum, x0 * w1, x1 * w1, ws);
    }
    if constexpr (kPaired) {
      // lane r arrives on CTA r's barrier (xgemm8::mma_task_wide's pair release)
      __syncwarp();
      if (threadIdx.x % 32 < 2) mbar_arrive_remote(sm.empty(s), threadIdx.x % 32);
    } else {
      gemm::release_stage<false>(sm.empty(s));
    }
  }
  fence_regs(acc);
}

// ---- epilogue ------------------------------------------------------------------------------------

// 64 tokens x 64 output columns (columns 64 c .. 64 c + 63 of the warpgroup's result, c = 0..3) into
// the staging tile, bf16-rounded: tiles (s, g) are token rows 16 w + 8 s .. + 7 x columns 8 g ..
// 8 g + 7, four per instruction as (s, g) = (0, g), (1, g), (0, g + 1), (1, g + 1); lane 8 m + i
// addresses row i of tile m.
__device__ __forceinline__ void stage_rows_plain(uint32_t stg, const float (&acc)[128], int c, int w, int lane) {
  const int m = lane / 8;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int g = 8 * c + 2 * k;  // the first of the instruction's two column groups
    xgemm::stmatrix_x4<false>(stg + 2 * ((16 * w + 8 * (m % 2) + lane % 8) * xgemm::kStageStride + 8 * (2 * k + m / 2)),
                       gemm::bf16x2_bits(acc[4 * g], acc[4 * g + 1]),
                       gemm::bf16x2_bits(acc[4 * g + 2], acc[4 * g + 3]),
                       gemm::bf16x2_bits(acc[4 * g + 4], acc[4 * g + 5]),
                       gemm::bf16x2_bits(acc[4 * g + 6], acc[4 * g + 7]));
  }
}

// Padding rows r0 .. r1 - 1 of dh's e4m3 copy, pair blocks kb0 and kb0 + 1 (those below K / 128):
// zero bytes and the scale of an all-zero block, as quantize_rows_e4m3 gives the zero rows.
__device__ __forceinline__ void zero_pair_blocks_e4m3(const xgemm::PairBlockE4m3& e4, int K, int r0, int r1,
                                                      int kb0) {
  const int blocks = min(2, K / 128 - kb0);
  for (int idx = threadIdx.x % 128; idx < (r1 - r0) * 8 * blocks; idx += 128) {
    const int r = r0 + idx / (8 * blocks), piece = idx % (8 * blocks);
    st16(e4.q + static_cast<int64_t>(r) * K + kb0 * 128 + 16 * piece, make_uint4(0, 0, 0, 0));
    if (piece % 8 == 0) e4.scale[static_cast<int64_t>(kb0 + piece / 8) * e4.ld + r] = e4m3::scale_and_inverse(0.f).x;
  }
}

// The warpgroup's 64 token rows of task tk: plain (also pushed into the rows' source slots: push),
// or the SwiGLU backward of the products (xgemm::SwiGLUBwd). The expert's last chunk also writes +0
// into the segment's padding rows, the columns of tile cw.
template <xgemm8::Epilogue kEpi>
__device__ __forceinline__ void store_task(const xgemm8::Params& p, const Smem& sm, const xgemm::Task& tk, int cw,
                                           float (&acc)[128]) {
  using xgemm8::Epilogue;
  const xgemm::Params& g = p.g;
  const int w = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const int bar = 2 + cw;
  const uint32_t stg = smem_u32(sm.staging(cw));
  const int tiles = tiles_of(g, tk);
  const int row0 = tk.row0 + 64 * cw, n_real = tk.n_real - 64 * cw;
  if (n_real > 0) {
#pragma unroll  // constant indices into acc (the SwiGLU backward's two flush forms left it in local memory)
    for (int j = 0; j < kTiles; ++j) {
      if (j >= tiles) break;
      const int tile = kTiles * tk.block + j;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col0 = tile * xgemm::WM + 64 * half;
        if constexpr (kEpi == Epilogue::kSwiGLUBackward) {
          xgemm::prefetch_swiglu_bwd(g, p.bwd.h, row0, col0, n_real);
          stage_rows_plain(stg, acc, 2 * j + half, w, lane);
          if (p.dh_e4m3.q != nullptr)
            xgemm::flush_swiglu_bwd<true>(g, stg, p.bwd, row0, col0, n_real, bar, p.dh_e4m3);
          else
            xgemm::flush_swiglu_bwd(g, stg, p.bwd, row0, col0, n_real, bar);
        } else {
          stage_rows_plain(stg, acc, 2 * j + half, w, lane);
          xgemm::flush_staging(stg, 64, g.out, g.N, row0, col0, g.N, n_real, bar,
                               kEpi == Epilogue::kPlainPush ? &p.push : nullptr);
        }
      }
    }
  }
  if (tk.pad1 > tk.pad0 && cw < tiles) {
    const int tile = kTiles * tk.block + cw;
    if constexpr (kEpi == Epilogue::kSwiGLUBackward) {
      xgemm::zero_swiglu_bwd_rows(g, p.bwd, tk.pad0, tk.pad1, tile * xgemm::WM, xgemm::WM);
      if (p.dh_e4m3.q != nullptr) zero_pair_blocks_e4m3(p.dh_e4m3, 2 * g.N, tk.pad0, tk.pad1, 2 * tile);
    } else {
      xgemm::zero_rows(g.out, g.N, tk.pad0, tk.pad1, tile * xgemm::WM, xgemm::WM, g.N);
    }
  }
}

}  // namespace xgemm8r
}  // namespace mok
