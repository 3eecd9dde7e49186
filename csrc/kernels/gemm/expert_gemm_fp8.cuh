// Block-scaled e4m3 variant of the expert-major grouped GEMM (expert_gemm.cuh): the routed
// experts' forward GEMMs with FP8 operands and fp32 accumulation.
//
// Why: per stage of 128 K a task of 128 weight rows and N token rows moves (128 + N) x 128 bytes
// for 2 x 128 x N x 128 FLOP; wgmma's e4m3 rate is twice bf16's. Tasks hold up to 256 token rows
// (one chunk per expert of <= 256 rows: its weights are read once), measured 3-14% faster than
// 128-row tasks; they run the tensor pipe at ~41% (ncu), bound by the wait-and-promote loop of each
// warpgroup rather than by operand ingest. This file has the column tasks (the weights on wgmma's
// M side), which the SwiGLU gate/up GEMM runs; expert_gemm_fp8_rows.cuh the row tasks of the others.
//
// Scaling (the usual fine-grained recipe, as DeepSeek-V3 trains with it):
// - tokens: one fp32 scale per (row, 128 columns of K); x ~= q * s;
// - weights: one fp32 scale per (expert, weight tile of a task, 128 K): the tile's 128 rows are
//   rows 128 b .. 128 b + 127 (plain) or gate rows 64 b .. 64 b + 63 together with the same up
//   rows (SwiGLU: the rows one task loads), so that one warpgroup sees one weight scale per stage.
// Promotion: e4m3 wgmma accumulates with reduced precision (~14 bits, DeepSeek-V3 report), so
// each 128-K block is summed afresh by the tensor cores into a second register set and added to
// the fp32 accumulators by the CUDA cores, times its scales (CUTLASS's default fp8 mainloop and
// DeepGEMM do the same); one warpgroup promotes while the other's wgmmas run. Measured: the
// results equal the bf16 rounding of the exact products of the e4m3 operands.
// Register sets: a task (<= 256 tokens, "wide") keeps the result in a 128-register array (the bf16
// layout) and the block sums of one 128-token slice in a 64-register array, with 240 registers a
// consumer thread.
//
// Operands (all K-major, as wgmma e4m3 requires):
// - X8 [rows, K] e4m3 with XS [K / 128][x_scale_ld] fp32 (transposed: a stage's token scales are
//   one TMA box);
// - W8 [nseg * w_rows, K] e4m3 with WS [nseg][n_blocks][K / 128] fp32.
// The backward's dgrads run on the same tasks with the weights' transposed e4m3 copies
// (quantize_weight_e4m3's q_t: the same 128 x 128 tiles and scales, so K is the forward's output
// side): dy against fc2^T with the SwiGLU backward in the epilogue, then dh (its columns in gate/up
// pair order, as fc1^T's K) against fc1^T.
// Every output element is owned by one task and reduced in ascending K order: the bits do not
// depend on the grid. Epilogue and padding rows: expert_gemm.cuh's (store_task).
#pragma once

#include "gemm/expert_gemm.cuh"

namespace mok {
// xgemm8: the expert-major GEMM in 8-bit (e4m3) operands, column tasks (weights on wgmma's M side).
namespace xgemm8 {

using xgemm::WM;
constexpr int BK = 128;                       // K per stage: one 128-byte swizzle row of e4m3
constexpr int kWBytes = WM * BK;              // 16 KB
// The wide tasks: <= 256 token rows (xgemm::kMaxTok, the bf16 tasks' chunks), the fp32 sums in a
// 128-register array (the bf16 layout, read by the epilogues) and the block sums of one <= 128-token
// slice in a second, 64-register array.
constexpr int kWideTok = xgemm::kMaxTok;
constexpr int kWideStages = tuning::kE4m3ColumnStages;
constexpr int kWideXBytes = kWideTok * BK;    // 32 KB
constexpr int kWideRBytes = kWideTok * 4;     // 1 KB
constexpr int kOffStaging = kWideStages * (kWBytes + kWideXBytes);
constexpr int kOffScales = kOffStaging + 2 * xgemm::kStageBytesPerWG;
constexpr int kOffBarriers = kOffScales + kWideStages * kWideRBytes;
// then the task bookkeeping (xgemm::TaskTail)
constexpr int kOffTail = kOffBarriers + 2 * kWideStages * 8;
constexpr int kSmemBytes = kOffTail + xgemm::TaskTail::kBytes + 1024 /* alignment */;
static_assert(xgemm::task_tail_fits(kWideStages), "a task's tag and slot outlive their reading");
static_assert(kSmemBytes <= 227 * 1024, "shared memory");

// What a task's epilogue writes (expert_gemm.cuh's stores): the forward's SwiGLU (act, optional
// pre-activations), plain rows (also pushed into their source slots: kPlainPush), or the backward's
// SwiGLU gradient from the down projection's dgrad (xgemm::SwiGLUBwd).
enum class Epilogue { kPlain, kSwiGLU, kSwiGLUBackward, kPlainPush };

struct Params {
  xgemm::Params g;        // segments, shapes, outputs (K in elements = bytes)
  const float* w_scale;   // [nseg][n_blocks][nkb]
  const float* x_scale;   // [nkb][x_scale_ld]
  int x_scale_ld;
  xgemm::SwiGLUBwd bwd;    // kSwiGLUBackward: the forward's pre-activations and the extra outputs
  xgemm::RowPush push;     // kPlainPush: the rows' source slots (the forward's combine)
  xgemm::PairBlockE4m3 dh_e4m3;  // kSwiGLUBackward (optional): dh's e4m3 copy as well
  int* tickets = nullptr;  // the launch's task counter, zero at launch (gemm::claim_task)
};

struct Smem {
  static constexpr int kStages = kWideStages;
  static constexpr int kScaleBytes = kWideRBytes;
  uint8_t* base;
  __device__ __forceinline__ uint8_t* w(int s) const { return base + s * kWBytes; }
  __device__ __forceinline__ uint8_t* x(int s) const { return base + kStages * kWBytes + s * kWideXBytes; }
  __device__ __forceinline__ __nv_bfloat16* staging(int cw) const {
    return reinterpret_cast<__nv_bfloat16*>(base + kOffStaging) + cw * (64 * xgemm::kStageStride);
  }
  __device__ __forceinline__ uint8_t* scales(int s) const { return base + kOffScales + s * kWideRBytes; }
  __device__ __forceinline__ uint64_t* full(int s) const { return reinterpret_cast<uint64_t*>(base + kOffBarriers) + s; }
  __device__ __forceinline__ uint64_t* empty(int s) const { return full(kStages + s); }
  __device__ __forceinline__ xgemm::TaskTail tail() const { return {base + kOffTail}; }
};

__device__ __forceinline__ Smem carve_smem(uint8_t* raw) {
  return Smem{reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023))};
}

__host__ __device__ constexpr int k_blocks(int K) { return (K + BK - 1) / BK; }

// Producer thread: per stage the weight tile, the task's token rows and their scales of block kb
// (one TMA box of Ring::kScaleBytes from row0: 256 fp32). `Ring` gives the stages (w(s), x(s),
// scales(s)) and their barriers.
// kPaired (pair tasks, 2-CTA clusters): the token boxes are shared (xgemm::load_token_boxes); the
// weights and scales stay this CTA's own.
template <bool kSwiGLU, bool kPaired = false, class Ring>
__device__ __forceinline__ void produce_task(const xgemm::Params& g, const CUtensorMap* tmW, const CUtensorMap* tmX,
                                             const CUtensorMap* tmR, const Ring& sm, const xgemm::Task& t,
                                             uint32_t& it) {
  const int nk = k_blocks(g.K);
  const int nbox = (t.n_tok + xgemm::kXBox - 1) / xgemm::kXBox;
  const int wcoord = kSwiGLU ? (t.seg * g.w_rows_per_seg + t.block * (WM / 2)) / 8
                             : t.seg * g.w_rows_per_seg + t.block * WM;
  for (int kb = 0; kb < nk; ++kb, ++it) {
    const int s = it % Ring::kStages;
    gemm::ring_wait<false>(sm.empty(s), ((it / Ring::kStages) & 1) ^ 1, nullptr);
    mbar_arrive_expect_tx(sm.full(s), kWBytes + nbox * xgemm::kXBox * BK + Ring::kScaleBytes);
    if constexpr (kSwiGLU)
      tma_load_4d(sm.w(s), tmW, sm.full(s), kb * BK, 0, 0, wcoord);
    else
      tma_load_2d(sm.w(s), tmW, sm.full(s), kb * BK, wcoord);
    xgemm::load_token_boxes<kPaired>(sm.x(s), tmX, sm.full(s), kb * BK, t.row0, nbox);
    tma_load_2d(sm.scales(s), tmR, sm.full(s), t.row0, kb);
  }
}

// wgmma m64 nN k32 (e4m3 in, fp32 accumulate, both operands K-major): CuTe's SM90 atom of that
// shape; the macro spells out the specialisations N = 16 .. 128 (a 128-token slice of a task).
template <int N>
struct Atom;
#define XGEMM8_DEFINE_ATOM(N) \
  template <>                 \
  struct Atom<N> {            \
    using type = cute::SM90::GMMA::MMA_64x##N##x32_F32E4M3E4M3_SS_TN<>; \
  };
XGEMM8_DEFINE_ATOM(16)
XGEMM8_DEFINE_ATOM(32)
XGEMM8_DEFINE_ATOM(48)
XGEMM8_DEFINE_ATOM(64)
XGEMM8_DEFINE_ATOM(80)
XGEMM8_DEFINE_ATOM(96)
XGEMM8_DEFINE_ATOM(112)
XGEMM8_DEFINE_ATOM(128)
#undef XGEMM8_DEFINE_ATOM

__device__ __forceinline__ float2 ld_shared_f2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

// dst[kDst ..] (tokens 8 g + 2 q + h of the layout in expert_gemm.cuh, from the slice's first) +=
// sum * wscale * xs[token], sum = src[0 ..] (the block sums), xs the slice's token scales in
// shared memory.
template <int N, int kDst, int kSrc>
__device__ __forceinline__ void promote(float (&dst)[128], float (&src)[kSrc], float wscale, uint32_t xs) {
#pragma unroll
  for (int i = 0; i < N / 2; ++i) asm volatile("" : "+f"(src[i])::"memory");  // after the wgmma wait
  const int q = (threadIdx.x % 32) % 4;
#pragma unroll
  for (int g = 0; g < N / 8; ++g) {
    const float2 r = ld_shared_f2(xs + 4 * (8 * g + 2 * q));
    const float s0 = r.x * wscale, s1 = r.y * wscale;
    float* a = dst + kDst + 4 * g;
    a[0] = fmaf(src[4 * g], s0, a[0]);
    a[1] = fmaf(src[4 * g + 1], s1, a[1]);
    a[2] = fmaf(src[4 * g + 2], s0, a[2]);
    a[3] = fmaf(src[4 * g + 3], s1, a[3]);
  }
}

// A wide task's block sums: wgmma m64 nN k32 into sum[0 .. N / 2).
template <int N, size_t... Is>
__device__ __forceinline__ void wgmma_sum(float (&sum)[64], uint64_t da, uint64_t db, bool accumulate,
                                          std::index_sequence<Is...>) {
  Atom<N>::type::fma(da, db, sum[Is]...,
                     accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

// Slice j (tokens 128 j .. 128 j + N - 1) of a wide task's stage s: its four k32 steps summed afresh
// into sum, waited for, promoted into acc[64 j ..].
template <int N, int j, class Ring>
__device__ __forceinline__ void mma_slice(const Ring& sm, int s, int cw, float (&acc)[128], float (&sum)[64],
                                          float wscale, const float* ws) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BK / 32; ++kk) {
    const uint64_t da = wgmma_desc_sw128(sm.w(s) + cw * (WM / 2) * 128 + kk * 32);
    const uint64_t db = wgmma_desc_sw128(sm.x(s) + j * 128 * BK + kk * 32);
    // a runtime flag for the fresh start (kk == 0; ws is never null): a constant one makes ptxas
    // serialize the wgmmas (C7511)
    wgmma_sum<N>(sum, da, db, kk > 0 || ws == nullptr, std::make_index_sequence<N / 2>{});
  }
  wgmma_commit();
  wgmma_wait<0>();
  promote<N, 64 * j>(acc, sum, wscale, smem_u32(sm.scales(s)) + 4 * 128 * j);
}

// Consumer warpgroup `cw` of a wide task (N = 16 .. 256 token rows): per stage the slices of
// tokens 0 .. 127 and 128 .. N - 1, each summed, waited for and promoted while the other
// warpgroup's wgmmas run. acc holds the result in the bf16 tasks' layout (store_task at offset 0);
// every element is still its k-blocks' promoted sums in ascending order.
template <int N, bool kPaired, class Ring>
__device__ __forceinline__ void mma_task_wide(const xgemm::Params& g, const Ring& sm, int cw, float (&acc)[128],
                                              float (&sum)[64], uint32_t& it, const float* ws) {
  constexpr int N0 = N < 128 ? N : 128, N1 = N - N0;
  const int nk = k_blocks(g.K);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  float wscale_next = __ldg(ws);  // one block ahead: the load's latency stalled the promotion (ncu)
  for (int kb = 0; kb < nk; ++kb, ++it) {
    const int s = it % Ring::kStages;
    const float wscale = wscale_next;
    if (kb + 1 < nk) wscale_next = __ldg(ws + kb + 1);
    gemm::ring_wait<false>(sm.full(s), (it / Ring::kStages) & 1, nullptr);
    mma_slice<N0, 0>(sm, s, cw, acc, sum, wscale, ws);
    if constexpr (N1 > 0) mma_slice<N1, 1>(sm, s, cw, acc, sum, wscale, ws);
    gemm::release_stage<kPaired>(sm.empty(s));  // paired: on both CTAs' rings
  }
  fence_regs(acc);
}

// The task's N as a template argument (N = 16 .. 256).
template <bool kPaired = false, class Ring>
__device__ __forceinline__ void mma_task_wide_any(const xgemm::Params& g, const Ring& sm, int cw, float (&acc)[128],
                                                  float (&sum)[64], uint32_t& it, int n_tok, const float* ws) {
  xgemm::with_task_tokens<kWideTok / xgemm::kTokAlign>(
      n_tok, [&](auto n) { mma_task_wide<decltype(n)::value, kPaired>(g, sm, cw, acc, sum, it, ws); });
}

}  // namespace xgemm8
}  // namespace mok
