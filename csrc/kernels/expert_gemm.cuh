// Expert-major grouped GEMM for sm_90a (the routed experts' GEMMs with A and B swapped).
//
// Why: at ~256 rows per expert the routed GEMMs sit on H200's ridge, and the token-major tiles of
// grouped_gemm.cuh (128 token rows x 256 weight rows) waste both sides of it: an expert's rows
// rarely fill whole 128-row tiles (26% padding tiles at DSv3 EP=2 T=4096), and an expert's tail
// tile reads the full weight block again. Here the weights are the MMA's M side (128 weight rows
// per tile, one per consumer warpgroup half) and the tokens its N side: wgmma takes any N that is a
// multiple of 8, so a task covers a whole chunk of up to 256 of an expert's token rows, rounded up
// to 16. An expert with <= 256 rows reads each weight block once; padding costs < 16 rows.
//
// Tasks (expert e, weight block b, token chunk c), expert-major then block then chunk, so the
// chunks of one weight block run back to back (the second hits L2) and the 32 (gate/up) or 56
// (down) blocks that read one token chunk run within one wave. Every output element is owned by
// one task and reduced over K in ascending order: the bits do not depend on the grid.
//
// Gate/up (kSwiGLU): a 4D tensor map loads the weight tile as eight [8 gate rows; 8 up rows] pairs,
// so in the wgmma accumulator layout each thread holds gate column j (row 16w + l/4) and up column
// j (row 16w + 8 + l/4) of the same tokens, and silu(gate) * up is computed in registers.
// The accumulators are [weight row, token]; the epilogue transposes them through shared memory
// (64 tokens at a time, padded rows: no bank conflicts) into 16-byte row-major stores.
//
// Tall tasks: an expert with <= 128 rows (one chunk, N <= 128) runs 256 weight rows per task, two
// m64 blocks per consumer warpgroup, in the same 48 KB stage (weights in its 32 KB part, tokens in
// its 16 KB part): more FLOPs per byte brought into the SM, which is what bounds these tasks
// (~55 GB/s per SM; device call 3 of 2026-11-30 in docs/KERNELS.md).
//
// Real rows get the products; padding rows of a segment get +0, as from the token-major GEMM.
#pragma once

#include "common.cuh"
#include "grouped_gemm.cuh"  // ring_wait, release_stage
#include "swiglu.cuh"

namespace mok {
namespace xgemm {

constexpr int WM = 128;           // weight rows per tile (64 per consumer warpgroup); tall tasks: 2 WM
constexpr int kMaxTok = 256;      // token rows per task (wgmma N <= 256)
constexpr int kTallRows = 128;    // experts with at most this many rows run tall tasks
constexpr int kTokAlign = 16;     // token rows of a task are a multiple of this (wgmma N granularity used)
constexpr int BK = 64;            // K per stage (one 128-byte swizzle atom of bf16)
constexpr int kStages = 4;
constexpr int kThreads = 384;     // warpgroup 0: producer; 1, 2: consumers
constexpr int kXBox = 64;         // token rows per TMA box
constexpr int kWBytes = WM * BK * 2;        // 16 KB
constexpr int kXBytes = kMaxTok * BK * 2;   // 32 KB
constexpr int kStageStride = 72;            // epilogue staging row: 64 columns + 8 (bank spread)
constexpr int kStageBytesPerWG = 64 * kStageStride * 2;  // 64 tokens
constexpr int kMaxSeg = 512;      // experts per launch (task prefix kept in shared memory)
// dynamic shared memory; the expert prefixes (2 x [kMaxSeg + 1] ints) are static shared memory
constexpr int kSmemBytes = kStages * (kWBytes + kXBytes) + 2 * kStageBytesPerWG + 2 * kStages * 8 + 1024 /* alignment */;

struct Params {
  const int* seg_offsets;  // [nseg + 1] token row offsets (segments may hold padding rows)
  const int* seg_counts;   // [nseg] real rows of each segment
  int nseg;
  int a_rows;              // rows of the token operand and the outputs
  int K;
  int N;                   // output columns (SwiGLU: I; the weights hold 2 N rows per expert)
  int w_rows_per_seg;      // weight rows per expert (SwiGLU: 2 N)
  int n_blocks;            // weight tiles per expert: ceil(N / 64) (SwiGLU) or ceil(N / 128)
  int n_blocks_tall;       // the same for tall tasks: ceil(N / 128) (SwiGLU) or ceil(N / 256)
  __nv_bfloat16* out;      // [rows, N]
  __nv_bfloat16* pre_out;  // SwiGLU only, optional: [rows, 2 N] = [gate | up] (bf16-rounded)
};

// Shared memory: the ring, the epilogue's staging tiles, the ring barriers. Only the 1024-aligned
// base is kept (the rest are constant offsets: fewer live registers, no spill).
constexpr int kOffStaging = kStages * (kWBytes + kXBytes);
constexpr int kOffBarriers = kOffStaging + 2 * kStageBytesPerWG;

struct Smem {
  uint8_t* base;
  __device__ __forceinline__ uint8_t* w(int s) const { return base + s * kWBytes; }
  __device__ __forceinline__ uint8_t* x(int s) const { return base + kStages * kWBytes + s * kXBytes; }
  __device__ __forceinline__ __nv_bfloat16* staging(int cw) const {
    return reinterpret_cast<__nv_bfloat16*>(base + kOffStaging) + cw * (64 * kStageStride);
  }
  __device__ __forceinline__ uint64_t* full(int s) const { return reinterpret_cast<uint64_t*>(base + kOffBarriers) + s; }
  __device__ __forceinline__ uint64_t* empty(int s) const { return full(kStages + s); }
};

__device__ __forceinline__ Smem carve_smem(uint8_t* raw) {
  return Smem{reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023))};
}

// Real rows of expert e that its segment holds (after a capacity overflow, which the schedule
// flags, the counts exceed the clipped segments: tasks stay inside them, and the chunk count stays
// <= the 128-row blocks, which bounds the megakernel's per-chunk counters).
__device__ __forceinline__ int seg_rows(const Params& p, int e) {
  return max(0, min(p.seg_counts[e], p.seg_offsets[e + 1] - p.seg_offsets[e]));
}

__host__ __device__ constexpr bool is_tall_rows(int rows) { return rows > 0 && rows <= kTallRows; }
__host__ __device__ constexpr int chunks_of(int rows) { return (rows + kMaxTok - 1) / kMaxTok; }

// Per-expert prefixes in shared memory: token chunks and tall experts before expert e ([nseg + 1]
// each). They define every launch's task list; both GEMM kinds of a layer share them.
struct Prefix {
  int* chunks;
  int* talls;
};

// Warp 0 of the caller: builds the prefixes (the caller syncs after).
__device__ __forceinline__ void build_prefix(const Params& p, const Prefix& pf) {
  const int lane = threadIdx.x % 32;
  int run_c = 0, run_t = 0;
  for (int base = 0; base < p.nseg; base += 32) {
    const int e = base + lane;
    const int rows = e < p.nseg ? seg_rows(p, e) : 0;
    int c = chunks_of(rows), t = is_tall_rows(rows) ? 1 : 0;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int oc = __shfl_up_sync(0xffffffffu, c, d), ot = __shfl_up_sync(0xffffffffu, t, d);
      if (lane >= d) {
        c += oc;
        t += ot;
      }
    }
    if (e < p.nseg) {
      pf.chunks[e + 1] = run_c + c;
      pf.talls[e + 1] = run_t + t;
    }
    run_c += __shfl_sync(0xffffffffu, c, 31);
    run_t += __shfl_sync(0xffffffffu, t, 31);
  }
  if (lane == 0) pf.chunks[0] = pf.talls[0] = 0;
}

// One task: weight block `block` of expert `seg` against token rows [row0, row0 + n_tok) (n_tok a
// multiple of kTokAlign, <= 256; tall: <= 128), of which the first `n_real` are real. The
// expert's last chunk also writes +0 into the segment's padding rows [pad0, pad1) (else pad0 ==
// pad1).
struct Task {
  int seg, block, row0, n_tok, n_real, pad0, pad1, tall;
};

__device__ __forceinline__ bool is_tall(const Prefix& pf, int e) { return pf.talls[e + 1] > pf.talls[e]; }
__device__ __forceinline__ int blocks_of(const Params& p, bool tall) { return tall ? p.n_blocks_tall : p.n_blocks; }

// Tasks of the experts before e (each: chunks x blocks).
__device__ __forceinline__ int task_base(const Params& p, const Prefix& pf, int e) {
  return p.n_blocks * (pf.chunks[e] - pf.talls[e]) + p.n_blocks_tall * pf.talls[e];
}

// Last expert e with key(e) <= v, key nondecreasing (with v below key(nseg): the expert whose range
// holds v; empty experts have no range).
template <class Key>
__device__ __forceinline__ int find_expert(const Params& p, int v, Key key) {
  int lo = 0, hi = p.nseg - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (key(mid) <= v) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Index of the first task of token chunk g (g == all chunks: the task count).
__device__ __forceinline__ int task_of_chunk(const Params& p, const Prefix& pf, int g) {
  if (g >= pf.chunks[p.nseg]) return task_base(p, pf, p.nseg);
  const int e = find_expert(p, g, [&](int i) { return pf.chunks[i]; });
  return task_base(p, pf, e) + (g - pf.chunks[e]) * blocks_of(p, is_tall(pf, e));
}

__device__ __forceinline__ int num_tasks(const Params& p, const Prefix& pf) { return task_base(p, pf, p.nseg); }

// Weight block `block` of expert e against its chunk c (of ch). An expert's rows split into ch
// chunks of whole kTokAlign-row units, as equal as the units allow (each <= 256 rows, none empty).
__device__ __forceinline__ Task make_task(const Params& p, int e, int block, int c, int ch, bool tall) {
  Task t;
  t.seg = e;
  t.block = block;
  t.tall = tall;
  const int rows = seg_rows(p, e);
  const int units = (rows + kTokAlign - 1) / kTokAlign;
  const int q = units / ch, r = units % ch;
  const int first = c * q + min(c, r);
  t.n_tok = kTokAlign * (q + (c < r ? 1 : 0));
  t.row0 = p.seg_offsets[e] + kTokAlign * first;
  t.n_real = max(0, min(min(t.n_tok, rows - kTokAlign * first), p.a_rows - t.row0));
  t.pad0 = t.pad1 = 0;
  if (c == ch - 1) {
    t.pad0 = t.row0 + t.n_real;
    t.pad1 = max(t.pad0, min(p.seg_offsets[e + 1], p.a_rows));
    t.pad0 = min(t.pad0, t.pad1);
  }
  return t;
}

// Task i of the chunk window [g0, g0 + count) (the staged launch: all chunks; the megakernel: a
// minibatch): the window's experts in order, each block-major over its chunks inside the window, so
// the chunks of one weight block run back to back. *chunk: the task's global chunk index.
__device__ __forceinline__ Task decode_window(const Params& p, const Prefix& pf, int g0, int count, int i,
                                             int* chunk) {
  const int u = task_of_chunk(p, pf, g0) + i;
  const int e = find_expert(p, u, [&](int j) { return task_base(p, pf, j); });
  const bool tall = is_tall(pf, e);
  const int nb = blocks_of(p, tall);
  const int start = max(g0, pf.chunks[e]), end = min(g0 + count, pf.chunks[e + 1]);
  const int local = u - task_base(p, pf, e) - (start - pf.chunks[e]) * nb;
  const int c = start + local % (end - start);
  *chunk = c;
  return make_task(p, e, local / (end - start), c - pf.chunks[e], pf.chunks[e + 1] - pf.chunks[e], tall);
}

// ---- the ring ------------------------------------------------------------------------------------

// Producer thread: the weight tile and the task's token rows, K block by K block. `Ring` gives the
// stages (w(s): 16 KB, x(s): 32 KB, the token-major ring's a(s), b(s) layout) and their barriers
// (full(s), empty(s)). Tall tasks swap the parts: 256 weight rows in x(s), <= 128 tokens in w(s).
// Megakernel (kWatch): waits under the watchdog, and `tag` goes to stage_tag[s] of the task's first
// stage before it is armed.
template <bool kSwiGLU, bool kWatch = false, class Ring>
__device__ __forceinline__ void produce_task(const Params& p, const CUtensorMap* tmW, const CUtensorMap* tmX,
                                             const Ring& sm, const Task& t, uint32_t& it, const Watchdog* w = nullptr,
                                             volatile int* stage_tag = nullptr, int tag = 0) {
  const int nk = (p.K + BK - 1) / BK;
  const int nbox = (t.n_tok + kXBox - 1) / kXBox;
  const int wboxes = t.tall ? 2 : 1;  // weight boxes of WM rows
  const int wrow = t.seg * p.w_rows_per_seg + t.block * wboxes * (kSwiGLU ? WM / 2 : WM);
  for (int kb = 0; kb < nk; ++kb, ++it) {
    const int s = it % kStages;
    gemm::ring_wait<kWatch>(sm.empty(s), ((it / kStages) & 1) ^ 1, w);
    if (stage_tag != nullptr && kb == 0) stage_tag[s] = tag;
    mbar_arrive_expect_tx(sm.full(s), wboxes * kWBytes + nbox * kXBox * BK * 2);
    uint8_t* wdst = t.tall ? sm.x(s) : sm.w(s);
    uint8_t* xdst = t.tall ? sm.w(s) : sm.x(s);
    for (int j = 0; j < wboxes; ++j) {
      if constexpr (kSwiGLU)  // the 4D map's outer coordinate counts 8-row blocks of the gate half
        tma_load_4d(wdst + j * kWBytes, tmW, sm.full(s), kb * BK, 0, 0, wrow / 8 + j * (WM / 16));
      else
        tma_load_2d(wdst + j * kWBytes, tmW, sm.full(s), kb * BK, wrow + j * WM);
    }
    for (int i = 0; i < nbox; ++i)
      tma_load_2d(xdst + i * kXBox * 128, tmX, sm.full(s), kb * BK, t.row0 + i * kXBox);
  }
}

// Consumer warpgroup `cw`: weight rows 64 cw .. 64 cw + 63 of the stage against its N token rows;
// tall: rows 128 cw .. 128 cw + 127 as two m64 blocks, into acc[0, N / 2) and acc[64, 64 + N / 2).
// kPaired (megakernel clusters): a stage is freed on both CTAs' empty barriers (the ring protocol
// of grouped_gemm.cuh; the expert tasks themselves share nothing).
template <int N, bool kTall, bool kWatch, bool kPaired, class Ring>
__device__ __forceinline__ void mma_task(const Params& p, const Ring& sm, int cw, float (&acc)[128], uint32_t& it,
                                         const Watchdog* w) {
  const int nk = (p.K + BK - 1) / BK;
  int prev = -1;
  for (int kb = 0; kb < nk; ++kb, ++it) {
    const int s = it % kStages;
    gemm::ring_wait<kWatch>(sm.full(s), (it / kStages) & 1, w);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      if constexpr (kTall) {
        const uint64_t db = wgmma_desc_sw128(sm.w(s) + kk * 32);
        const uint64_t da0 = wgmma_desc_sw128(sm.x(s) + cw * WM * 128 + kk * 32);
        const uint64_t da1 = wgmma_desc_sw128(sm.x(s) + (cw * WM + 64) * 128 + kk * 32);
        wgmma_n<N, 0>(acc, da0, db, kb > 0 || kk > 0, std::make_index_sequence<N / 2>{});
        wgmma_n<N, 64>(acc, da1, db, kb > 0 || kk > 0, std::make_index_sequence<N / 2>{});
      } else {
        const uint64_t da = wgmma_desc_sw128(sm.w(s) + cw * (WM / 2) * 128 + kk * 32);
        const uint64_t db = wgmma_desc_sw128(sm.x(s) + kk * 32);
        // N > 128: two wgmmas (tokens 0..127 into acc[0, 64), the rest into acc[64, ...)), so that
        // every variant's accumulators start at 0 or 64 like the tall tasks' (one N = 256 tuple
        // next to them serializes all wgmmas: ptxas C7511)
        constexpr int kN0 = N > 128 ? 128 : N;
        wgmma_n<kN0, 0>(acc, da, db, kb > 0 || kk > 0, std::make_index_sequence<kN0 / 2>{});
        if constexpr (N > 128) {
          const uint64_t db1 = wgmma_desc_sw128(sm.x(s) + 128 * 128 + kk * 32);
          wgmma_n<N - 128, 64>(acc, da, db1, kb > 0 || kk > 0, std::make_index_sequence<(N - 128) / 2>{});
        }
      }
    }
    wgmma_commit();
    if (prev >= 0) {
      wgmma_wait<1>();
      gemm::release_stage<kPaired>(sm.empty(prev));
    }
    prev = s;
  }
  wgmma_wait<0>();
  fence_regs(acc);
  gemm::release_stage<kPaired>(sm.empty(prev));
}

// A task this warpgroup does not compute (the idle half of an incomplete megakernel pair): keep the
// ring's phases only.
template <bool kWatch, bool kPaired, class Ring>
__device__ __forceinline__ void skip_task(const Params& p, const Ring& sm, uint32_t& it, const Watchdog* w) {
  const int nk = (p.K + BK - 1) / BK;
  for (int kb = 0; kb < nk; ++kb, ++it) {
    const int s = it % kStages;
    gemm::ring_wait<kWatch>(sm.full(s), (it / kStages) & 1, w);
    gemm::release_stage<kPaired>(sm.empty(s));
  }
}

// The task's shape as template arguments (N = 16 .. 256; tall: N <= 128).
template <bool kWatch = false, bool kPaired = false, class Ring>
__device__ __forceinline__ void mma_task_any(const Params& p, const Ring& sm, int cw, float (&acc)[128], uint32_t& it,
                                             const Task& t, const Watchdog* w = nullptr) {
  switch ((t.tall ? 16 : 0) + t.n_tok / kTokAlign) {
#define MOK_XGEMM_CASE(U) \
  case U:                 \
    mma_task<U * kTokAlign, false, kWatch, kPaired>(p, sm, cw, acc, it, w); \
    break;
#define MOK_XGEMM_TALL(U) \
  case 16 + U:            \
    mma_task<U * kTokAlign, true, kWatch, kPaired>(p, sm, cw, acc, it, w); \
    break;
    MOK_XGEMM_CASE(1) MOK_XGEMM_CASE(2) MOK_XGEMM_CASE(3) MOK_XGEMM_CASE(4) MOK_XGEMM_CASE(5) MOK_XGEMM_CASE(6)
    MOK_XGEMM_CASE(7) MOK_XGEMM_CASE(8) MOK_XGEMM_CASE(9) MOK_XGEMM_CASE(10) MOK_XGEMM_CASE(11)
    MOK_XGEMM_CASE(12) MOK_XGEMM_CASE(13) MOK_XGEMM_CASE(14) MOK_XGEMM_CASE(15)
    MOK_XGEMM_CASE(16)
    MOK_XGEMM_TALL(1) MOK_XGEMM_TALL(2) MOK_XGEMM_TALL(3) MOK_XGEMM_TALL(4) MOK_XGEMM_TALL(5) MOK_XGEMM_TALL(6)
    MOK_XGEMM_TALL(7) MOK_XGEMM_TALL(8)
#undef MOK_XGEMM_CASE
#undef MOK_XGEMM_TALL
    default:
      break;
  }
}

// ---- epilogue --------------------------------------------------------------------------------------

// Accumulator layout of a consumer warpgroup (thread t, warp w = t / 32, lane l, q = l % 4):
// acc[4 g + 2 s + h] holds weight row 16 w + l / 4 + 8 s and token 8 g + 2 q + h.

// Rows of the staging tile [64 tokens][kStageStride] written by the warpgroup, then copied out as
// 16-byte row pieces: `cols` staged columns per token (32 SwiGLU, 64 down) to dst columns
// col0 .. col0 + cols (those < n_cols), tokens < n_real of this 64-token slice.
// (Shared-memory addresses are 32-bit here: generic 64-bit pointers cost the registers that the
// megakernel's consumers do not have next to 128 accumulators.)
__device__ __forceinline__ void st_shared_bf16(uint32_t addr, float v) {
  const __nv_bfloat16 b = __float2bfloat16_rn(v);
  asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"(*reinterpret_cast<const uint16_t*>(&b)) : "memory");
}

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}

__device__ __forceinline__ void flush_staging(uint32_t stg, int cols, __nv_bfloat16* dst, int64_t ld, int row0,
                                              int col0, int n_cols, int n_real, int bar) {
  warpgroup_bar_sync(bar);
  const int t = threadIdx.x % 128;
  const int vecs = cols / 8;
  for (int idx = t; idx < 64 * vecs; idx += 128) {
    const int c = idx / vecs, v = idx % vecs;
    const int col = col0 + 8 * v;
    if (c < n_real && col < n_cols)
      st16(dst + static_cast<int64_t>(row0 + c) * ld + col, ld_shared_v4(stg + 2 * (c * kStageStride + 8 * v)));
  }
  warpgroup_bar_sync(bar);
}

// +0 into rows [r0, r1) of dst's columns col0 .. col0 + cols (those < n_cols): a segment's padding
// rows, as the token-major GEMM leaves them (its padding rows of A are zero).
__device__ __forceinline__ void zero_rows(__nv_bfloat16* dst, int64_t ld, int r0, int r1, int col0, int cols,
                                          int n_cols) {
  const int vecs = cols / 8;
  for (int idx = threadIdx.x % 128; idx < (r1 - r0) * vecs; idx += 128) {
    const int col = col0 + 8 * (idx % vecs);
    if (col < n_cols) st16(dst + static_cast<int64_t>(r0 + idx / vecs) * ld + col, make_uint4(0, 0, 0, 0));
  }
}

// One m64 block of a warpgroup's accumulators (from acc[kOff]; kSlices 64-token slices at most) to
// its output columns: 32 (SwiGLU: the [gate; up] pairs' outputs, with pre_out also gate and up)
// or 64 (down), starting at col0.
template <bool kSwiGLU, int kSlices, int kOff>
__device__ __forceinline__ void store_block(const Params& p, uint32_t stg, const Task& tk, int col0, int bar,
                                            const float (&acc)[128]) {
  const int t = threadIdx.x % 128;
  const int w = t / 32, lane = t % 32, q = lane % 4, r = lane / 4;
  const int rounds = (kSwiGLU && p.pre_out != nullptr) ? 3 : 1;
#pragma unroll
  for (int sl = 0; sl < kSlices; ++sl) {
    if (64 * sl >= tk.n_tok) break;
    const int row0 = tk.row0 + 64 * sl;
    const int n_real = tk.n_real - 64 * sl;
    for (int round = 0; round < rounds; ++round) {
#pragma unroll
      for (int g8 = 0; g8 < 8; ++g8) {
        const int g = 8 * sl + g8;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int c = 8 * g8 + 2 * q + h;
          const float lo = acc[kOff + 4 * g + h], hi = acc[kOff + 4 * g + 2 + h];
          if constexpr (kSwiGLU) {
            // lo: gate j, hi: up j, j = 8 w + r of the block's 32 columns
            const float v = round == 0 ? swiglu(lo, hi) : (round == 1 ? lo : hi);
            st_shared_bf16(stg + 2 * (c * kStageStride + 8 * w + r), v);
          } else {
            st_shared_bf16(stg + 2 * (c * kStageStride + 16 * w + r), lo);
            st_shared_bf16(stg + 2 * (c * kStageStride + 16 * w + 8 + r), hi);
          }
        }
      }
      if constexpr (kSwiGLU) {
        // pre_out's column bound is N for both halves (col0 < N), the offset picks the half
        __nv_bfloat16* dst = round == 0 ? p.out : p.pre_out + (round == 2 ? p.N : 0);
        flush_staging(stg, 32, dst, round == 0 ? p.N : 2 * p.N, row0, col0, p.N, n_real, bar);
      } else {
        flush_staging(stg, 64, p.out, p.N, row0, col0, p.N, n_real, bar);
      }
    }
  }
}

// First output column of consumer warpgroup cw in task tk (its columns are contiguous: 32 or 64 per
// m64 block, two blocks when tall).
template <bool kSwiGLU>
__device__ __forceinline__ int task_col0(const Task& tk, int cw) {
  const int per_block = kSwiGLU ? 32 : 64;  // columns of one m64 block
  return (tk.tall ? 2 : 1) * per_block * (2 * tk.block + cw);
}

template <bool kSwiGLU, class Ring>
__device__ __forceinline__ void store_task(const Params& p, const Ring& sm, const Task& tk, int cw,
                                           const float (&acc)[128]) {
  const int bar = 2 + cw;
  const uint32_t stg = smem_u32(sm.staging(cw));
  constexpr int kBlockCols = kSwiGLU ? 32 : 64;
  const int col0 = task_col0<kSwiGLU>(tk, cw);
  if (tk.tall) {
    store_block<kSwiGLU, 2, 0>(p, stg, tk, col0, bar, acc);
    store_block<kSwiGLU, 2, 64>(p, stg, tk, col0 + kBlockCols, bar, acc);
  } else {
    store_block<kSwiGLU, kMaxTok / 64, 0>(p, stg, tk, col0, bar, acc);
  }
  if (tk.pad1 > tk.pad0) {
    const int cols = (tk.tall ? 2 : 1) * kBlockCols;
    zero_rows(p.out, p.N, tk.pad0, tk.pad1, col0, cols, p.N);
    if (kSwiGLU && p.pre_out != nullptr) {
      zero_rows(p.pre_out, 2 * p.N, tk.pad0, tk.pad1, col0, cols, p.N);
      zero_rows(p.pre_out + p.N, 2 * p.N, tk.pad0, tk.pad1, col0, cols, p.N);
    }
  }
}

// ---- host side -----------------------------------------------------------------------------------

inline Params make_params(const int* seg_offsets, const int* seg_counts, int nseg, int a_rows, int K, int N,
                          bool swiglu, void* out, void* pre_out) {
  Params p{};
  p.seg_offsets = seg_offsets;
  p.seg_counts = seg_counts;
  p.nseg = nseg;
  p.a_rows = a_rows;
  p.K = K;
  p.N = N;
  p.w_rows_per_seg = swiglu ? 2 * N : N;
  p.n_blocks = swiglu ? (N + WM / 2 - 1) / (WM / 2) : (N + WM - 1) / WM;
  p.n_blocks_tall = swiglu ? (N + WM - 1) / WM : (N + 2 * WM - 1) / (2 * WM);
  p.out = static_cast<__nv_bfloat16*>(out);
  p.pre_out = swiglu ? static_cast<__nv_bfloat16*>(pre_out) : nullptr;
  return p;
}

// MOK_GEMM_EXPERT=0: routed GEMMs run token-major (grouped_gemm.cuh) instead (read per launch).
inline bool enabled() {
  const char* v = getenv("MOK_GEMM_EXPERT");
  return !(v != nullptr && v[0] == '0');
}

}  // namespace xgemm
}  // namespace mok
