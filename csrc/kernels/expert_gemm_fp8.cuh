// Block-scaled e4m3 variant of the expert-major grouped GEMM (expert_gemm.cuh): the routed
// experts' forward GEMMs with FP8 operands and fp32 accumulation.
//
// Why: the bf16 tasks run at the rate their operands enter the SM (~45-55 GB/s per SM measured),
// not at the MMA rate. An e4m3 stage of 128 K holds the same 48 KB (128 weight rows + 256 token
// rows, 128 bytes each) as a bf16 stage of 64 K, so a task moves half the bytes per FLOP, and
// wgmma's e4m3 rate is twice bf16's.
//
// Scaling (the usual fine-grained recipe):
// - tokens: one fp32 scale per (row, 128 columns of K); x ~= q * s;
// - weights: one fp32 scale per (expert, weight tile of a task, 128 K): the tile's 128 rows are
//   rows 128 b .. 128 b + 127 (plain) or gate rows 64 b .. 64 b + 63 together with the same up
//   rows (SwiGLU: the rows one task loads), so that one warpgroup sees one weight scale per stage.
// The accumulators hold the sum in units of the current stage's scale product: before stage kb's
// wgmmas, each token's accumulators are multiplied by ratio[kb][t] * wratio[kb] (the previous
// stage's scale over this stage's, computed once by the quantizers), and after the last stage by
// the last scales. One accumulator set, so tasks keep N up to 256 token rows; the rescale needs the
// previous stage's wgmmas complete (wgmma.wait 0 per stage), while the other warpgroup's MMAs run.
//
// Operands (all K-major, as wgmma e4m3 requires):
// - X8 [rows, K] e4m3, its ratio rows XR [K / 128 + 1][rows_pad] fp32 (row kb >= 1: s[kb-1] / s[kb];
//   row K / 128: the last scale; row 0 unused), loaded by TMA as one 1 KB box per stage;
// - W8 [nseg * w_rows, K] e4m3, WR [nseg][n_blocks][K / 128 + 1] fp32 laid out as XR's rows.
// Every output element is owned by one task and reduced in ascending K order: the bits do not
// depend on the grid. Epilogue and padding rows: expert_gemm.cuh's (store_task).
#pragma once

#include "expert_gemm.cuh"

namespace mok {
namespace xgemm8 {

using xgemm::kMaxTok;
using xgemm::WM;
constexpr int BK = 128;                       // K per stage: one 128-byte swizzle row of e4m3
constexpr int kStages = xgemm::kStages;
constexpr int kWBytes = WM * BK;              // 16 KB
constexpr int kXBytes = kMaxTok * BK;         // 32 KB
constexpr int kRBytes = kMaxTok * 4;          // the stage's token ratios (256 fp32)
constexpr int kOffStaging = kStages * (kWBytes + kXBytes);
constexpr int kOffRatios = kOffStaging + 2 * xgemm::kStageBytesPerWG;
constexpr int kOffBarriers = kOffRatios + kStages * kRBytes;
constexpr int kSmemBytes = kOffBarriers + 2 * kStages * 8 + 1024 /* alignment */;
static_assert(kSmemBytes <= 227 * 1024, "shared memory");

struct Params {
  xgemm::Params g;        // segments, shapes, outputs (K in elements = bytes)
  const float* w_ratio;   // [nseg][n_blocks][nkb + 1]
  const float* x_ratio;   // [nkb + 1][x_ratio_ld]
  int x_ratio_ld;
};

struct Smem {
  static constexpr int kStages = xgemm8::kStages;
  uint8_t* base;
  __device__ __forceinline__ uint8_t* w(int s) const { return base + s * kWBytes; }
  __device__ __forceinline__ uint8_t* x(int s) const { return base + kStages * kWBytes + s * kXBytes; }
  __device__ __forceinline__ __nv_bfloat16* staging(int cw) const {
    return reinterpret_cast<__nv_bfloat16*>(base + kOffStaging) + cw * (64 * xgemm::kStageStride);
  }
  __device__ __forceinline__ uint32_t ratios(int s) const { return smem_u32(base + kOffRatios + s * kRBytes); }
  __device__ __forceinline__ uint64_t* full(int s) const { return reinterpret_cast<uint64_t*>(base + kOffBarriers) + s; }
  __device__ __forceinline__ uint64_t* empty(int s) const { return full(kStages + s); }
};

__device__ __forceinline__ Smem carve_smem(uint8_t* raw) {
  return Smem{reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023))};
}

__host__ __device__ constexpr int k_blocks(int K) { return (K + BK - 1) / BK; }

// Producer thread: per stage the weight tile, the task's token rows and their 256 ratios of kb.
template <bool kSwiGLU>
__device__ __forceinline__ void produce_task(const Params& p, const CUtensorMap* tmW, const CUtensorMap* tmX,
                                             const CUtensorMap* tmR, const Smem& sm, const xgemm::Task& t,
                                             uint32_t& it) {
  const int nk = k_blocks(p.g.K);
  const int nbox = (t.n_tok + xgemm::kXBox - 1) / xgemm::kXBox;
  const int wcoord = kSwiGLU ? (t.seg * p.g.w_rows_per_seg + t.block * (WM / 2)) / 8
                             : t.seg * p.g.w_rows_per_seg + t.block * WM;
  for (int kb = 0; kb < nk; ++kb, ++it) {
    const int s = it % kStages;
    gemm::ring_wait<false>(sm.empty(s), ((it / kStages) & 1) ^ 1, nullptr);
    mbar_arrive_expect_tx(sm.full(s), kWBytes + nbox * xgemm::kXBox * BK + kRBytes);
    if constexpr (kSwiGLU)
      tma_load_4d(sm.w(s), tmW, sm.full(s), kb * BK, 0, 0, wcoord);
    else
      tma_load_2d(sm.w(s), tmW, sm.full(s), kb * BK, wcoord);
    for (int i = 0; i < nbox; ++i)
      tma_load_2d(sm.x(s) + i * xgemm::kXBox * BK, tmX, sm.full(s), kb * BK, t.row0 + i * xgemm::kXBox);
    tma_load_2d(reinterpret_cast<void*>(sm.base + kOffRatios + s * kRBytes), tmR, sm.full(s), t.row0, kb);
  }
}

template <int N>
struct Atom;
#define MOK_XGEMM8_ATOM(N) \
  template <>              \
  struct Atom<N> {         \
    using type = cute::SM90::GMMA::MMA_64x##N##x32_F32E4M3E4M3_SS_TN<>; \
  };
MOK_XGEMM8_ATOM(16)
MOK_XGEMM8_ATOM(32)
MOK_XGEMM8_ATOM(48)
MOK_XGEMM8_ATOM(64)
MOK_XGEMM8_ATOM(80)
MOK_XGEMM8_ATOM(96)
MOK_XGEMM8_ATOM(112)
MOK_XGEMM8_ATOM(128)
MOK_XGEMM8_ATOM(144)
MOK_XGEMM8_ATOM(160)
MOK_XGEMM8_ATOM(176)
MOK_XGEMM8_ATOM(192)
MOK_XGEMM8_ATOM(208)
MOK_XGEMM8_ATOM(224)
MOK_XGEMM8_ATOM(240)
MOK_XGEMM8_ATOM(256)
#undef MOK_XGEMM8_ATOM

template <int N, size_t... Is>
__device__ __forceinline__ void wgmma_n(float (&d)[128], uint64_t da, uint64_t db, bool accumulate,
                                        std::index_sequence<Is...>) {
  Atom<N>::type::fma(da, db, d[Is]...,
                     accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

__device__ __forceinline__ float2 ld_shared_f2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

// acc (tokens 8 g + 2 q + h, see expert_gemm.cuh's layout) *= wscale * xs[token], xs a stage's ratio
// row in shared memory (or, final, the last-scale row in global memory).
template <int N, bool kGlobal>
__device__ __forceinline__ void scale_acc(float (&acc)[128], float wscale, uint32_t xs, const float* xg) {
  const int q = (threadIdx.x % 32) % 4;
#pragma unroll
  for (int g = 0; g < N / 8; ++g) {
    const float2 r = kGlobal ? *reinterpret_cast<const float2*>(xg + 8 * g + 2 * q) : ld_shared_f2(xs + 4 * (8 * g + 2 * q));
    const float r0 = r.x * wscale, r1 = r.y * wscale;
    acc[4 * g] *= r0;
    acc[4 * g + 1] *= r1;
    acc[4 * g + 2] *= r0;
    acc[4 * g + 3] *= r1;
  }
}

// Consumer warpgroup `cw`: weight rows 64 cw .. 64 cw + 63 of the stage against its N token rows.
// wr: the task's weight ratio row; xfinal: the task's first row in XR's last-scale row.
template <int N>
__device__ __forceinline__ void mma_task(const Params& p, const Smem& sm, int cw, float (&acc)[128], uint32_t& it,
                                         const float* wr, const float* xfinal) {
  const int nk = k_blocks(p.g.K);
  int prev = -1;
  for (int kb = 0; kb < nk; ++kb, ++it) {
    const int s = it % kStages;
    gemm::ring_wait<false>(sm.full(s), (it / kStages) & 1, nullptr);
    if (kb > 0) {
      // the accumulators into this stage's units (the previous stage's wgmmas must be done)
      const float wratio = __ldg(wr + kb);
      wgmma_wait<0>();
      fence_regs(acc);
      scale_acc<N, false>(acc, wratio, sm.ratios(s), nullptr);
      gemm::release_stage<false>(sm.empty(prev));
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 32; ++kk) {
      const uint64_t da = wgmma_desc_sw128(sm.w(s) + cw * (WM / 2) * 128 + kk * 32);
      const uint64_t db = wgmma_desc_sw128(sm.x(s) + kk * 32);
      wgmma_n<N>(acc, da, db, kb > 0 || kk > 0, std::make_index_sequence<N / 2>{});
    }
    wgmma_commit();
    prev = s;
  }
  wgmma_wait<0>();
  fence_regs(acc);
  gemm::release_stage<false>(sm.empty(prev));
  scale_acc<N, true>(acc, __ldg(wr + nk), 0, xfinal);
}

// The task's N as a template argument (N = 16 .. 256).
__device__ __forceinline__ void mma_task_any(const Params& p, const Smem& sm, int cw, float (&acc)[128], uint32_t& it,
                                             int n_tok, const float* wr, const float* xfinal) {
  switch (n_tok / xgemm::kTokAlign) {
#define MOK_XGEMM8_CASE(U) \
  case U:                  \
    mma_task<U * xgemm::kTokAlign>(p, sm, cw, acc, it, wr, xfinal); \
    break;
    MOK_XGEMM8_CASE(1) MOK_XGEMM8_CASE(2) MOK_XGEMM8_CASE(3) MOK_XGEMM8_CASE(4) MOK_XGEMM8_CASE(5)
    MOK_XGEMM8_CASE(6) MOK_XGEMM8_CASE(7) MOK_XGEMM8_CASE(8) MOK_XGEMM8_CASE(9) MOK_XGEMM8_CASE(10)
    MOK_XGEMM8_CASE(11) MOK_XGEMM8_CASE(12) MOK_XGEMM8_CASE(13) MOK_XGEMM8_CASE(14) MOK_XGEMM8_CASE(15)
    MOK_XGEMM8_CASE(16)
#undef MOK_XGEMM8_CASE
    default:
      break;
  }
}

}  // namespace xgemm8
}  // namespace mok
