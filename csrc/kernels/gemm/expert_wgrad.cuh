// Weight gradients of the routed experts on expert_gemm.cuh's ring protocol: dW[e] = A_e^T @ B_e, reduced over the expert's token rows, for
//   dfc2[e] [H, I] = dy[rows of e]^T @ act[rows of e]     (A = dy, B = act)
//   dfc1[e] [2I, H] = dh[rows of e]^T @ x_routed[rows of e] (A = dh, B = x_routed).
// Both operands are token-row-major, so the MMA's K is the token axis and both are MN-major: a
// stage holds A as two [64 rows][64 M] boxes (one per consumer warpgroup) and B as four
// [64 rows][64 N] boxes, read by wgmma with both transpose bits.
//
// A task is (expert e, 128 rows of dW[e], 256 columns of dW[e]); its K loop runs over the expert's
// rows in ascending order and one task owns each output element: the bits do not depend on the
// grid or the task order. A and B may use different row layouts: a_offsets / b_offsets give each
// expert's first row in each. Parts: the rows of several micro-batches, each in its own layout
// inside the same A and B (row p of offsets / counts per part), reduce into one accumulator, part
// after part, so main_grad is read and written once for all of them. Only the first ceil16(rows) rows enter the MMA (the last stage issues
// only its 16-row groups inside them), and rows between the real count and that bound must be zero
// in A or B (padding rows). Experts without rows get exact zeros (a bf16 out) or add nothing (an
// fp32 out, which the tiles are added into: add_task_f32).
//
// e4m3 (E4m3Operands, expert_wgrad_fp8): the same tasks on the operands' transposes [M][tokens] and
// [N][tokens] (ops.quantize_columns_e4m3: one scale per row of the transpose and expert, both over
// the expert's rows), 128 tokens a stage in 32-token MMA groups (the same 48 KB a stage); the
// tensor cores sum over all of the expert's rows and the epilogue multiplies by the two scales.
//
// Epilogue: a task's 128 x 256 bf16 tile is 64 KB, which global stores from the consumers would
// drain at HBM speed before the next task's MMA could start. Instead each warpgroup stmatrix-es its
// 64 x 256 half into four swizzled [64][64] boxes and one thread hands them to TMA stores; the
// warpgroup goes on to the next task and waits only before it overwrites the boxes (until TMA has
// read them). The boxes take one ring stage (3, not 4); measured faster than two boxes per
// warpgroup filled twice next to 4 stages, and than 16-byte stores from the consumers.
#pragma once

#include <algorithm>
#include <type_traits>

#include "gemm/expert_gemm.cuh"

namespace mok {
// xwgrad: the eXpert weight gradients (dW[e] = A_e^T B_e over an expert's token rows).
namespace xwgrad {

constexpr int WM = xgemm::WM;  // dW rows per task (64 per consumer warpgroup)
constexpr int WN = 256;        // dW columns per task (wgmma N)
constexpr int BK = xgemm::BK;  // token rows per stage
constexpr int kABytes = xgemm::kWBytes, kBBytes = xgemm::kXBytes;  // 16 + 32 KB per stage

// Shared memory: the ring (kStages of A and B), the output boxes, the ring barriers; the base is
// 1024-aligned.
struct Smem {
  static constexpr int kStages = tuning::kWgradStages;
  static constexpr int kOutPerWG = 4 * 64 * 128;  // four [64][64] bf16 boxes per consumer warpgroup
  static constexpr int kOffOut = kStages * (kABytes + kBBytes);
  static constexpr int kOffBarriers = kOffOut + 2 * kOutPerWG;
  // fp32 out: one barrier per consumer warpgroup, main_grad loaded into its boxes
  static constexpr int kOffMainGradBarriers = kOffBarriers + 2 * kStages * 8;
  static constexpr int kOffColScales = kOffMainGradBarriers + 2 * 8;  // e4m3: a task's column scales per warpgroup
  static constexpr int kBytes = kOffColScales + 2 * WN * 4 + 1024 /* alignment */;
  uint8_t* base;
  __device__ __forceinline__ uint8_t* w(int s) const { return base + s * kABytes; }
  __device__ __forceinline__ uint8_t* x(int s) const { return base + kStages * kABytes + s * kBBytes; }
  __device__ __forceinline__ uint8_t* out(int cw) const { return base + kOffOut + cw * kOutPerWG; }
  __device__ __forceinline__ uint64_t* full(int s) const { return reinterpret_cast<uint64_t*>(base + kOffBarriers) + s; }
  __device__ __forceinline__ uint64_t* empty(int s) const { return full(kStages + s); }
  __device__ __forceinline__ uint64_t* main_grad_full(int cw) const {
    return reinterpret_cast<uint64_t*>(base + kOffMainGradBarriers) + cw;
  }
  __device__ __forceinline__ float* col_scales(int cw) const {
    return reinterpret_cast<float*>(base + kOffColScales) + cw * WN;
  }
};
static_assert(Smem::kBytes <= 227 * 1024, "shared memory");

__device__ __forceinline__ Smem carve_smem(uint8_t* raw) {
  return Smem{reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023))};
}

struct Params {
  const int* a_offsets;  // [nparts][nseg + 1]: expert e's first row of part q in A
  const int* b_offsets;  // [nparts][nseg + 1]: the same in B
  const int* counts;     // [nparts][nseg]: real rows of expert e in part q
  int nseg, nparts;
  int M, N;              // dW[e] is [M, N]
  int m_blocks, n_blocks;
  bool m_fastest;        // consecutive tasks of an expert walk dW's row blocks (decode)
  void* out;             // [nseg, M, N]: bf16 (written) or fp32 (added into)
};

// Rows of expert e that enter the MMA: the real ones rounded up to kGroup (an MMA's K: 16 bf16, 32
// e4m3 rows), inside both segments.
template <int kGroup = 16>
__device__ __forceinline__ int k_rows(const Params& p, int e, int q) {
  const int* ao = p.a_offsets + q * (p.nseg + 1);
  const int* bo = p.b_offsets + q * (p.nseg + 1);
  const int rows = max(0, min(p.counts[q * p.nseg + e], min(ao[e + 1] - ao[e], bo[e + 1] - bo[e])));
  return (rows + kGroup - 1) / kGroup * kGroup;
}

// Whether any part of expert e has rows (else its tile is zeros, or adds nothing).
template <int kGroup = 16>
__device__ __forceinline__ bool has_rows(const Params& p, int e) {
  for (int q = 0; q < p.nparts; ++q)
    if (k_rows<kGroup>(p, e, q) > 0) return true;
  return false;
}

struct Task {
  int seg, mb, nb;
};

__device__ __forceinline__ int num_tasks(const Params& p) { return p.nseg * p.m_blocks * p.n_blocks; }

// Expert-major (an expert's A and B stay in L2 while its tasks run). Inside an expert, consecutive
// tasks share a slice of the wider operand and walk the narrower one's slices: the dW stores stream
// through L2 faster than an expert's tasks come back to a slice, so the operand whose slices are
// read by tasks far apart is read from HBM again, and that should be the narrower one.
__device__ __forceinline__ Task decode(const Params& p, int u) {
  const int per = p.m_blocks * p.n_blocks, e = u / per, r = u % per;
  if (p.m_fastest) return Task{e, r % p.m_blocks, r / p.m_blocks};
  return Task{e, r / p.n_blocks, r % p.n_blocks};
}

template <size_t... Is>
__device__ __forceinline__ void wgmma_mn_mn(float (&d)[128], uint64_t da, uint64_t db, bool accumulate,
                                            std::index_sequence<Is...>) {
  using Atom = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::MN, cute::SM90::GMMA::Major::MN>;
  Atom::fma(da, db, d[Is]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

template <size_t... Is>
__device__ __forceinline__ void wgmma_e4m3_k(float (&d)[128], uint64_t da, uint64_t db, bool accumulate,
                                             std::index_sequence<Is...>) {
  using Atom = cute::SM90::GMMA::MMA_64x256x32_F32E4M3E4M3_SS_TN<>;
  Atom::fma(da, db, d[Is]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

// How a stage's operands arrive and enter the MMA. Both layouts move 16 KB of A and 32 KB of B a
// stage, so they share the ring.
// Bf16Operands: the token-row-major operands themselves, 64 rows a stage as [64 rows][64 M] boxes
// (MN-major), 16-row MMA groups.
struct Bf16Operands {
  static constexpr int kStageRows = BK, kGroup = 16;
  template <class Ring>
  static __device__ __forceinline__ void load(const Ring& sm, int s, const CUtensorMap* tmA, const CUtensorMap* tmB,
                                              const Task& t, int a_row, int b_row) {
#pragma unroll
    for (int i = 0; i < 2; ++i) tma_load_2d(sm.w(s) + i * (kABytes / 2), tmA, sm.full(s), t.mb * WM + 64 * i, a_row);
#pragma unroll
    for (int i = 0; i < 4; ++i) tma_load_2d(sm.x(s) + i * (kBBytes / 4), tmB, sm.full(s), t.nb * WN + 64 * i, b_row);
  }
  // 16-row group kk of stage s
  template <class Ring>
  static __device__ __forceinline__ void mma(const Ring& sm, int s, int cw, int kk, float (&acc)[128], bool accumulate) {
    const uint64_t da = wgmma_desc_sw128_mn(sm.w(s) + cw * (kABytes / 2) + kk * 16 * 128);
    const uint64_t db = wgmma_desc_sw128_mn(sm.x(s) + kk * 16 * 128);
    wgmma_mn_mn(acc, da, db, accumulate, std::make_index_sequence<128>{});
  }
};

// E4m3Operands (expert_wgrad_fp8): the operands' e4m3 transposes [M or N rows][tokens]
// (quantize_columns_e4m3), 128 tokens a stage as [64 rows][128 tokens] boxes (K-major), 32-token
// MMA groups.
struct E4m3Operands {
  static constexpr int kStageRows = 128, kGroup = 32;
  template <class Ring>
  static __device__ __forceinline__ void load(const Ring& sm, int s, const CUtensorMap* tmA, const CUtensorMap* tmB,
                                              const Task& t, int a_row, int b_row) {
#pragma unroll
    for (int i = 0; i < 2; ++i) tma_load_2d(sm.w(s) + i * (kABytes / 2), tmA, sm.full(s), a_row, t.mb * WM + 64 * i);
#pragma unroll
    for (int i = 0; i < 4; ++i) tma_load_2d(sm.x(s) + i * (kBBytes / 4), tmB, sm.full(s), b_row, t.nb * WN + 64 * i);
  }
  template <class Ring>
  static __device__ __forceinline__ void mma(const Ring& sm, int s, int cw, int kk, float (&acc)[128], bool accumulate) {
    const uint64_t da = wgmma_desc_sw128(sm.w(s) + cw * (kABytes / 2) + kk * 32);
    const uint64_t db = wgmma_desc_sw128(sm.x(s) + kk * 32);
    wgmma_e4m3_k(acc, da, db, accumulate, std::make_index_sequence<128>{});
  }
};

// Producer thread: the task's stages (none for an expert without rows: its consumers take no
// stage either, and store_task writes its zeros).
template <class Ops = Bf16Operands, class Ring>
__device__ __forceinline__ void produce_task(const Params& p, const CUtensorMap* tmA, const CUtensorMap* tmB,
                                             const Ring& sm, const Task& t, uint32_t& it) {
  constexpr int kStages = Ring::kStages;
  for (int q = 0; q < p.nparts; ++q) {
    const int nk = (k_rows<Ops::kGroup>(p, t.seg, q) + Ops::kStageRows - 1) / Ops::kStageRows;
    const int a0 = p.a_offsets[q * (p.nseg + 1) + t.seg], b0 = p.b_offsets[q * (p.nseg + 1) + t.seg];
    for (int kb = 0; kb < nk; ++kb, ++it) {
      const int s = it % kStages;
      gemm::ring_wait<false>(sm.empty(s), ((it / kStages) & 1) ^ 1, nullptr);
      mbar_arrive_expect_tx(sm.full(s), kABytes + kBBytes);
      Ops::load(sm, s, tmA, tmB, t, a0 + kb * Ops::kStageRows, b0 + kb * Ops::kStageRows);
    }
  }
}

// The first G MMA groups of stage s (accumulating onto acc unless this is the task's first).
// The fence sits right before the wgmmas: no branch between them (ptxas would fence each, C7519).
template <int G, class Ops, class Ring>
__device__ __forceinline__ void issue_groups(const Ring& sm, int s, int cw, float (&acc)[128], bool accumulate) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < G; ++kk) Ops::mma(sm, s, cw, kk, acc, accumulate || kk > 0);
}

// A task's last stage with G < 4 groups, completed before the branches join.
template <int G, class Ops, class Ring>
__device__ __forceinline__ void tail_stage(const Ring& sm, int s, int cw, float (&acc)[128], bool accumulate) {
  issue_groups<G, Ops>(sm, s, cw, acc, accumulate);
  wgmma_commit();
  wgmma_wait<0>();
}

struct Nothing {
  __device__ __forceinline__ void operator()() const {}
};

// Consumer warpgroup cw: dW rows 64 cw .. 64 cw + 63 of the task against its 256 columns, over its
// parts in order. in_flight() runs once, while the MMA of the task's second full stage (or its only
// full stage; with none, before its first stage) is in flight: the fp32 epilogue's first main_grad
// load starts there.
template <class Ops = Bf16Operands, class Ring, class InFlight = Nothing>
__device__ __forceinline__ void mma_task(const Params& p, const Ring& sm, int cw, const Task& t, float (&acc)[128],
                                         uint32_t& it, InFlight&& in_flight = InFlight{}) {
  constexpr int kStages = Ring::kStages;
  static_assert(Ops::kStageRows == 4 * Ops::kGroup, "four MMA groups a stage");
  int total_full = 0;  // full stages of all parts (0 rows in every part: store_task writes zeros)
  for (int q = 0; q < p.nparts; ++q) total_full += k_rows<Ops::kGroup>(p, t.seg, q) / Ops::kStageRows;
  const int flight_at = min(1, total_full - 1);
  int done = 0;  // full stages issued
  bool started = false, flown = false;
  for (int q = 0; q < p.nparts; ++q) {
    const int kr = k_rows<Ops::kGroup>(p, t.seg, q);
    const int full = kr / Ops::kStageRows, tail = (kr % Ops::kStageRows) / Ops::kGroup;
    int prev = -1;
    for (int kb = 0; kb < full; ++kb, ++it, ++done) {
      const int s = it % kStages;
      gemm::ring_wait<false>(sm.full(s), (it / kStages) & 1, nullptr);
      issue_groups<4, Ops>(sm, s, cw, acc, started);
      started = true;
      gemm::commit_and_release_previous<false>(prev, [&](int i) { return sm.empty(i); });
      prev = s;
      if (!flown && done == flight_at) {  // once: a part's tail may have run it already
        in_flight();
        flown = true;
      }
    }
    wgmma_wait<0>();
    if (prev >= 0) gemm::release_stage<false>(sm.empty(prev));
    if (tail > 0) {
      if (!flown) {  // the flight stage lies in a later part, or there is none; an expert without rows loads nothing
        in_flight();
        flown = true;
      }
      // the part's last stage holds 1-3 MMA groups: one straight-line sequence per count, with
      // nothing in flight across the branch
      const int s = it % kStages;
      gemm::ring_wait<false>(sm.full(s), (it / kStages) & 1, nullptr);
      if (tail == 1) tail_stage<1, Ops>(sm, s, cw, acc, started);
      else if (tail == 2) tail_stage<2, Ops>(sm, s, cw, acc, started);
      else tail_stage<3, Ops>(sm, s, cw, acc, started);
      started = true;
      gemm::release_stage<false>(sm.empty(s));
      ++it;
    }
  }
  fence_regs(acc);
}

// Accumulator layout: acc[4 g + 2 s + h] holds dW row 16 w + l / 4 + 8 s, column 8 g + 2 q + h.

// What the epilogue multiplies accumulator acc[4 g + i] by before rounding: nothing (bf16), or
// (e4m3) a_scale[e][row] * b_scale[e][column] of its row and column (layout above); an expert's
// operands carry one scale per row and expert, so the token sum needs no promotion. The task's
// scales are loaded from global memory before its MMA (four registers a thread); the epilogue puts
// the 256 column scales into the warpgroup's shared array (stage) and reads each 64-column slice's
// 16 scales a thread at once (slice), so no load latency sits between the packing instructions.
struct Unscaled {
  struct Slice {
    __device__ __forceinline__ float operator()(int, int, float v) const { return v; }
  };
  __device__ __forceinline__ void stage() const {}
  __device__ __forceinline__ Slice slice(int) const { return {}; }
};

struct RowColumnScales {
  float row[2];  // rows 16 w + lane / 4 (+ 8)
  float col[2];  // columns tid and tid + 128 of the task (0 past N)
  float* shared;  // the warpgroup's 256 column scales in shared memory
  struct Slice {
    float row[2];
    float2 col[8];  // columns 8 j + 2 (lane % 4) (+ 1) of the slice
    // acc[4 g + i], g = 8 sl + j
    __device__ __forceinline__ float operator()(int j, int i, float v) const {
      return v * row[i / 2] * (i % 2 ? col[j].y : col[j].x);
    }
  };
  __device__ __forceinline__ void stage() const {
    const int tid = threadIdx.x % 128;
    shared[tid] = col[0];
    shared[tid + 128] = col[1];
  }
  __device__ __forceinline__ Slice slice(int sl) const {
    Slice s{{row[0], row[1]}, {}};
    const int q2 = 2 * (threadIdx.x % 4);
#pragma unroll
    for (int j = 0; j < 8; ++j) s.col[j] = *reinterpret_cast<const float2*>(shared + 64 * sl + 8 * j + q2);
    return s;
  }
};

// The epilogue's scales of task t for warpgroup cw: Unscaled (bf16), or the row and column scales
// (e4m3), whose loads are issued here, before the task's MMA.
template <class Ops, class Ring>
__device__ __forceinline__ auto task_scales(const Params& p, const Ring& sm, const float* a_scale,
                                            const float* b_scale, const Task& t, int cw) {
  if constexpr (std::is_same_v<Ops, Bf16Operands>) {
    return Unscaled{};
  } else {
    const int tid = threadIdx.x % 128;
    const int r0 = t.mb * WM + cw * 64 + 16 * (tid / 32) + (tid % 32) / 4;
    const float* sa = a_scale + static_cast<int64_t>(t.seg) * p.M;
    const float* sb = b_scale + static_cast<int64_t>(t.seg) * p.N;
    const int c0 = t.nb * WN + tid;
    return RowColumnScales{{r0 < p.M ? __ldg(sa + r0) : 0.f, r0 + 8 < p.M ? __ldg(sa + r0 + 8) : 0.f},
                           {c0 < p.N ? __ldg(sb + c0) : 0.f, c0 + 128 < p.N ? __ldg(sb + c0 + 128) : 0.f},
                           sm.col_scales(cw)};
  }
}

constexpr int kBoxBytes = 64 * 128;  // a [64 rows][64 columns] bf16 box of the TMA-store epilogues

// Columns 64 sl .. 64 sl + 63 of the warpgroup's 64 x 256 half into one swizzled [64][64] box
// (128-byte rows, 16-byte chunk c of row r at c ^ (r % 8), the TMA SWIZZLE_128B layout), or zeros:
// tiles (g, 0), (g, 1), (g + 1, 0), (g + 1, 1) per instruction; lane 8 m + i addresses row
// 16 w + 8 (m % 2) + i, 16-byte chunk g8 + m / 2 of the slice.
template <class Slice>
__device__ __forceinline__ void stage_box(uint32_t box, const float (&acc)[128], int sl, int w, int lane, bool zero,
                                          const Slice& scale) {
  if (zero) {
    for (int i = threadIdx.x % 128; i < kBoxBytes / 16; i += 128)
      asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};" ::"r"(box + 16 * i), "r"(0) : "memory");
    return;
  }
#pragma unroll
  for (int g8 = 0; g8 < 8; g8 += 2) {
    const int g = 8 * sl + g8;
    const int m = lane / 8;
    const int row = 16 * w + 8 * (m % 2) + lane % 8;
    const int chunk = g8 + m / 2;
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = scale(g8 + i / 4, i % 4, acc[4 * g + i]);
    xgemm::stmatrix_x4<false>(box + row * 128 + ((chunk ^ (row % 8)) << 4), gemm::bf16x2_bits(v[0], v[1]),
                              gemm::bf16x2_bits(v[2], v[3]), gemm::bf16x2_bits(v[4], v[5]),
                              gemm::bf16x2_bits(v[6], v[7]));
  }
}

// The warpgroup's threads have written its boxes: fence them into the async proxy, then one thread
// hands them to TMA, issue(policy), as one bulk group. The policy is evict-first: the output is
// written once and not read here, so the operands that the expert's other tasks read again stay in L2.
template <class Issue>
__device__ __forceinline__ void store_boxes(int cw, Issue&& issue) {
  fence_proxy_async_shared();
  warpgroup_bar_sync(2 + cw);
  if (threadIdx.x % 128 == 0) {
    issue(l2_evict_first_policy());
    bulk_commit_group();
  }
}

// One round of a TMA-store epilogue on the warpgroup's four boxes: wait until TMA has read their
// previous contents, stage() fills them, then store_boxes(issue).
template <class Stage, class Issue>
__device__ __forceinline__ void box_round(int cw, Stage&& stage, Issue&& issue) {
  if (threadIdx.x % 128 == 0) bulk_wait_read_all();
  warpgroup_bar_sync(2 + cw);
  stage();
  store_boxes(cw, issue);
}

// TMA stores: the warpgroup's 64 x 256 half as four swizzled [64 rows][64 columns] boxes (128-byte
// rows, 16-byte chunk c of row r at c ^ (r % 8), the TMA SWIZZLE_128B layout), stored into out
// viewed as [nseg][M][N] (rows past M, columns past N are not written).
template <class Ring, class Scale = Unscaled>
__device__ __forceinline__ void store_task_tma(const Params& p, const Ring& sm, const CUtensorMap* tmOut,
                                               const Task& t, int cw, const float (&acc)[128],
                                               const Scale& scale = Scale{}) {
  const int tid = threadIdx.x % 128;
  const int w = tid / 32, lane = tid % 32;
  const uint32_t boxes = smem_u32(sm.out(cw));
  scale.stage();  // the previous task's slices were read before its closing barrier
  const bool zero = !has_rows(p, t.seg);  // an expert without rows: exact zeros, the accumulators unread
  box_round(
      cw,
      [&] {
#pragma unroll
        for (int sl = 0; sl < WN / 64; ++sl)
          stage_box(boxes + sl * kBoxBytes, acc, sl, w, lane, zero, scale.slice(sl));
      },
      [&](uint64_t policy) {
#pragma unroll
        for (int i = 0; i < WN / 64; ++i)
          tma_store_3d(tmOut, sm.out(cw) + i * kBoxBytes, t.nb * WN + 64 * i, t.mb * WM + cw * 64, t.seg, policy);
      });
}

// fp32 epilogue (Megatron's main_grad, gradient-accumulation fusion): out += the task's tile in
// fp32, so dW is never rounded to bf16 nor written twice. Each element has one owner, which reads,
// adds and writes it: no atomics, and the same bits as main_grad.add_(dW) in fp32. A [64 rows][32
// columns] fp32 box has 128-byte rows like the bf16 boxes; four boxes hold 128 columns, so a
// warpgroup adds its 64 x 256 half in two rounds of four boxes: TMA loads main_grad into them, the
// threads add their accumulators in place, TMA stores them back. Both loads are in flight before
// the MMA ends: the first round's into the warpgroup's boxes, issued during the task's MMA
// (load_main_grad_first_round from mma_task's in_flight); the second round's into the B part of
// the two ring slots after the task's last stage (produce_main_grad_round, warpgroup cw's in slot
// it + cw), issued by the producer as those slots free up; the consumers give them back once TMA
// has read the stored boxes out of them.
//
// Columns 32 b .. 32 b + 31 of the half (b = 0..7) in one swizzled box: acc[4 g + 2 s + h] (layout
// above) is at row 16 w + lane / 4 + 8 s, 16-byte chunk 2 (g % 4) + (lane % 4) / 2 at c ^ (r % 8),
// bytes 8 (lane % 2) .. +7.
template <class Slice>
__device__ __forceinline__ void add_box_f32(uint32_t box, const float (&acc)[128], int b, int w, int lane,
                                            const Slice& scale) {
#pragma unroll
  for (int gg = 0; gg < 4; ++gg) {
    const int g = 4 * b + gg;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int row = 16 * w + lane / 4 + 8 * s;
      const int chunk = 2 * gg + (lane % 4) / 2;
      const uint32_t addr = box + row * 128 + ((chunk ^ (row % 8)) << 4) + (lane % 2) * 8;
      float m0, m1;
      asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(m0), "=f"(m1) : "r"(addr) : "memory");
      const float v0 = __fadd_rn(m0, scale(g % 8, 2 * s, acc[4 * g + 2 * s]));
      const float v1 = __fadd_rn(m1, scale(g % 8, 2 * s + 1, acc[4 * g + 2 * s + 1]));
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(v0), "f"(v1) : "memory");
    }
  }
}

// fp32 box b (columns 32 b .. 32 b + 31 of warpgroup cw's 64 x 256 half of task t) in the fp32 out
// map's coordinates: where its main_grad is loaded from and stored back to.
struct F32Box {
  int col, row, seg;
  __device__ __forceinline__ F32Box(const Task& t, int cw, int b)
      : col(t.nb * WN + 32 * b), row(t.mb * WM + cw * 64), seg(t.seg) {}
};

// Thread 0 of warpgroup cw: once TMA has read the boxes' last contents, load the first round of
// its main_grad (columns 0 .. 127 of the warpgroup's 64 rows of task t) into them (parts past M or
// N load as zeros and are not stored back).
template <class Ring>
__device__ __forceinline__ void load_main_grad_first_round(const Ring& sm, const CUtensorMap* tmOut, const Task& t,
                                                           int cw) {
  bulk_wait_read_all();
  mbar_arrive_expect_tx(sm.main_grad_full(cw), 4 * kBoxBytes);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const F32Box c(t, cw, i);
    tma_load_3d(sm.out(cw) + i * kBoxBytes, tmOut, sm.main_grad_full(cw), c.col, c.row, c.seg);
  }
}

// Producer thread, after task t's stages: the second round of each warpgroup's main_grad (columns
// 128 .. 255 of its 64 rows) into the B part of the next two ring slots, warpgroup cw's into slot
// it + cw. An expert without rows loads nothing (its consumers take no slot either).
template <class Ops, class Ring>
__device__ __forceinline__ void produce_main_grad_round(const Params& p, const CUtensorMap* tmOut, const Ring& sm,
                                                        const Task& t, uint32_t& it) {
  static_assert(4 * kBoxBytes <= kBBytes, "a round's four boxes fit a stage's B part");
  if (!has_rows<Ops::kGroup>(p, t.seg)) return;
#pragma unroll
  for (int cw = 0; cw < 2; ++cw, ++it) {
    const int s = it % Ring::kStages;
    gemm::ring_wait<false>(sm.empty(s), ((it / Ring::kStages) & 1) ^ 1, nullptr);
    mbar_arrive_expect_tx(sm.full(s), 4 * kBoxBytes);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const F32Box c(t, cw, 4 + i);
      tma_load_3d(sm.x(s) + i * kBoxBytes, tmOut, sm.full(s), c.col, c.row, c.seg);
    }
  }
}

// out (fp32, viewed as [nseg][M][N]) += the warpgroup's 64 x 256 half: the first round in its boxes
// (loaded from mma_task's in_flight; phase: the parity of main_grad_full(cw)'s next phase), the
// second in ring slot it + cw (produce_main_grad_round). Both ring slots go back once TMA has read
// this warpgroup's stores out of them. An expert without rows adds (and loads) nothing.
template <class Ring, class Scale = Unscaled>
__device__ __forceinline__ void add_task_f32(const Params& p, const Ring& sm, const CUtensorMap* tmOut,
                                             const Task& t, int cw, const float (&acc)[128], uint32_t& phase,
                                             uint32_t& it, const Scale& scale = Scale{}) {
  constexpr int kStages = Ring::kStages;
  if (!has_rows(p, t.seg)) return;
  const int tid = threadIdx.x % 128;
  const int w = tid / 32, lane = tid % 32;
  const int slot = (it + cw) % kStages;
  scale.stage();  // the previous task's slices were read before its last barrier
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint8_t* const boxes = half == 0 ? sm.out(cw) : sm.x(slot);
    if (half == 0) {
      mbar_wait(sm.main_grad_full(cw), phase);
      phase ^= 1;
      warpgroup_bar_sync(2 + cw);  // the column scales staged
    } else {
      gemm::ring_wait<false>(sm.full(slot), ((it + cw) / kStages) & 1, nullptr);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int sl = 2 * half + i;  // 64-column slice: boxes 2 sl and 2 sl + 1
      const auto sc = scale.slice(sl);
      add_box_f32(smem_u32(boxes) + (2 * i) * kBoxBytes, acc, 2 * sl, w, lane, sc);
      add_box_f32(smem_u32(boxes) + (2 * i + 1) * kBoxBytes, acc, 2 * sl + 1, w, lane, sc);
    }
    store_boxes(cw, [&](uint64_t policy) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const F32Box c(t, cw, 4 * half + i);
        tma_store_3d(tmOut, boxes + i * kBoxBytes, c.col, c.row, c.seg, policy);
      }
    });
  }
  // Free both slots. The other warpgroup's slot is waited for first: its fill is what proves that
  // the slot's previous phase has ended, so this arrival cannot count toward that phase.
  const uint32_t other = it + 1 - cw;
  gemm::ring_wait<false>(sm.full(other % kStages), (other / kStages) & 1, nullptr);
  if (tid == 0) bulk_wait_read_all();
  warpgroup_bar_sync(2 + cw);
#pragma unroll
  for (int i = 0; i < 2; ++i, ++it) gemm::release_stage<false>(sm.empty(it % kStages));
}

// ---- host side -----------------------------------------------------------------------------------

inline Params make_params(const int* a_offsets, const int* b_offsets, const int* counts, int nseg, int nparts, int M,
                          int N, void* out) {
  Params p{};
  p.a_offsets = a_offsets;
  p.b_offsets = b_offsets;
  p.counts = counts;
  p.nseg = nseg;
  p.nparts = nparts;
  p.M = M;
  p.N = N;
  p.m_blocks = (M + WM - 1) / WM;
  p.n_blocks = (N + WN - 1) / WN;
  p.m_fastest = M < N;  // A ([rows, M]) is the narrower operand
  p.out = out;
  return p;
}

// out viewed as [nseg][M][N] in boxes of 64 x 64 (the TMA-store epilogues; rows past M stay in
// their expert).
inline const char* make_out_map(CUtensorMap* map, void* out, int nseg, int M, int N) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(N), static_cast<cuuint64_t>(M), static_cast<cuuint64_t>(nseg)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(N) * 2, static_cast<cuuint64_t>(M) * N * 2};
  const cuuint32_t box[3] = {64, 64, 1};
  return encode_tmap_bf16(map, out, 3, dims, strides, box);
}

// The fp32 epilogue's out [nseg][M][N] in boxes of 64 rows x 32 columns (add_task_f32: loaded and
// stored).
inline const char* make_out_map_f32(CUtensorMap* map, void* out, int nseg, int M, int N) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(N), static_cast<cuuint64_t>(M), static_cast<cuuint64_t>(nseg)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(N) * 4, static_cast<cuuint64_t>(M) * N * 4};
  const cuuint32_t box[3] = {32, 64, 1};
  return encode_tmap(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, CU_TENSOR_MAP_SWIZZLE_128B, out, 3, dims, strides, box);
}

// The operands [a_rows, M] and [b_rows, N] in boxes of 64 rows (K) x 64 columns (MN-major).
inline const char* make_operand_maps(CUtensorMap* tmA, CUtensorMap* tmB, const void* a, int64_t a_rows, int M,
                                     const void* b, int64_t b_rows, int N) {
  if (const char* m = make_tmap_bf16_2d(tmA, a, std::max<int64_t>(a_rows, 1), M, M, BK)) return m;
  return make_tmap_bf16_2d(tmB, b, std::max<int64_t>(b_rows, 1), N, N, BK);
}

// expert_wgrad_fp8's operands [rows, ld] e4m3 (rows = M or N, tokens contiguous) in boxes of 64
// rows x 128 tokens (K-major).
inline const char* make_e4m3_operand_maps(CUtensorMap* tmA, CUtensorMap* tmB, const void* a_t, int M,
                                          const void* b_t, int N, int64_t ld) {
  if (const char* m = make_tmap_e4m3_2d(tmA, a_t, M, ld, 64)) return m;
  return make_tmap_e4m3_2d(tmB, b_t, N, ld, 64);
}

}  // namespace xwgrad
}  // namespace mok
