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
// The accumulators are [weight row, token]; the epilogue transposes them into shared memory with
// stmatrix.trans (64 tokens at a time, padded rows: no bank conflicts), then 16-byte row-major stores.
//
// Real rows get the products; padding rows of a segment get +0, as from the token-major GEMM.
//
// Measured: a task's time follows the bytes it
// brings into the SM; ncu names L2 throughput (80-91%) as the busiest unit. Chunks of ~256 rows
// come closest to the dense tile. Experts with 64-85 rows (chunks of N ~ 64-96) run 7-12% slower
// than the token-major tiles did.
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>
#include <type_traits>
#include <utility>

#include "common.cuh"
#include "gemm/grouped_gemm.cuh"  // ring_wait, release_stage
#include "quant/e4m3.cuh"
#include "gemm/swiglu.cuh"

namespace mok {
// xgemm: the eXpert-major GEMM (weights on wgmma's M side, an expert's token rows on its N side).
namespace xgemm {

constexpr int WM = 128;           // weight rows per tile (64 per consumer warpgroup)
constexpr int kMaxTok = tuning::kExpertTaskTokens;  // token rows per task (wgmma N <= 256)
constexpr int kTokAlign = 16;     // token rows of a task are a multiple of this (wgmma N granularity used)
constexpr int BK = 64;            // K per stage (one 128-byte swizzle atom of bf16)
constexpr int kStages = tuning::kExpertGemmStages;
constexpr int kThreads = 384;     // warpgroup 0: producer; 1, 2: consumers
constexpr int kXBox = 64;         // token rows per TMA box
constexpr int kWBytes = WM * BK * 2;        // 16 KB
constexpr int kXBytes = kMaxTok * BK * 2;   // 32 KB
constexpr int kStageStride = 72;            // epilogue staging row: 64 columns + 8 (bank spread)
constexpr int kStageBytesPerWG = 64 * kStageStride * 2;  // 64 tokens
static_assert(kStageStride >= 64 + 4, "a staging row's padding holds a push's (rank, slot)");
constexpr int kMaxSeg = 512;      // experts per launch (task prefix kept in shared memory)
// dynamic shared memory; the chunk prefix ([kMaxSeg + 1] ints) is static shared memory of the kernel
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
  __nv_bfloat16* out;      // [rows, N]
  __nv_bfloat16* pre_out;  // SwiGLU only, optional: [rows, 2 N] = [gate | up] (bf16-rounded)
};

// Shared memory: the ring, the epilogue's staging tiles, the ring barriers. Only the 1024-aligned
// base is kept (the rest are constant offsets: fewer live registers, no spill).
constexpr int kOffStaging = kStages * (kWBytes + kXBytes);
constexpr int kOffBarriers = kOffStaging + 2 * kStageBytesPerWG;

struct Smem {
  static constexpr int kStages = xgemm::kStages;
  static constexpr int kBytes = kSmemBytes;
  uint8_t* base;
  __device__ __forceinline__ uint8_t* w(int s) const { return base + s * kWBytes; }
  __device__ __forceinline__ uint8_t* x(int s) const { return base + kStages * kWBytes + s * kXBytes; }
  __device__ __forceinline__ __nv_bfloat16* staging(int cw) const {
    return reinterpret_cast<__nv_bfloat16*>(base + kOffStaging) + cw * (64 * kStageStride);
  }
  __device__ __forceinline__ uint64_t* full(int s) const { return reinterpret_cast<uint64_t*>(base + kOffBarriers) + s; }
  __device__ __forceinline__ uint64_t* empty(int s) const { return full(kStages + s); }
};

template <class Layout = Smem>
__device__ __forceinline__ Layout carve_smem(uint8_t* raw) {
  return Layout{reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023))};
}

// Token chunks of an expert's rows: tasks of at most kChunk rows (256; the e4m3 GEMM's 128).
template <int kChunk = kMaxTok>
__host__ __device__ constexpr int chunks_of(int rows) { return (rows + kChunk - 1) / kChunk; }

// Real rows of expert e that its segment holds (after a capacity overflow, which the schedule
// flags, the counts exceed the clipped segments: tasks stay inside them, and the chunk count stays
// <= nle + capacity / 256, which bounds the megakernel's per-chunk counters).
__device__ __forceinline__ int seg_rows(const Params& p, int e) {
  return segment_rows(p.seg_counts, p.seg_offsets, e);
}

// Warp 0: chunk_prefix[e] = sum of chunks_of(seg_counts[i]) for i < e (the caller syncs after).
template <int kChunk = kMaxTok>
__device__ __forceinline__ void build_chunk_prefix(const Params& p, int* prefix) {
  const int lane = threadIdx.x % 32;
  int running = 0;
  for (int base = 0; base < p.nseg; base += 32) {
    const int e = base + lane;
    const int incl = warp_inclusive_sum(e < p.nseg ? chunks_of<kChunk>(seg_rows(p, e)) : 0);
    if (e < p.nseg) prefix[e + 1] = running + incl;
    running += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) prefix[0] = 0;
}

// One task: weight block `block` of expert `seg` against token rows [row0, row0 + n_tok) (n_tok a
// multiple of kTokAlign, <= 256), of which the first `n_real` are real. The expert's last chunk
// also writes +0 into the segment's padding rows [pad0, pad1) (else pad0 == pad1).
struct Task {
  int seg, block, row0, n_tok, n_real, pad0, pad1;
};

__device__ __forceinline__ int num_tasks(const Params& p, const int* prefix) { return prefix[p.nseg] * p.n_blocks; }

// Last expert e with prefix[e] <= key * scale (with key < prefix[nseg] * scale: the expert whose
// range holds it; empty experts have no range).
__device__ __forceinline__ int find_expert(const Params& p, const int* prefix, int key, int scale) {
  int lo = 0, hi = p.nseg - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (prefix[mid] * scale <= key) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Weight block `block` of expert e against its chunk c (of ch = chunks_of(rows)). An expert's rows
// split into ch chunks of whole kTokAlign-row units, as equal as the units allow (each <= 256
// rows, none empty); kFullUnits > 0 (the e4m3 row tasks): chunks of kFullUnits units, the last
// one the rest.
template <int kFullUnits = 0>
__device__ __forceinline__ Task make_task(const Params& p, int e, int block, int c, int ch) {
  Task t;
  t.seg = e;
  t.block = block;
  const int rows = seg_rows(p, e);
  const int units = (rows + kTokAlign - 1) / kTokAlign;
  int first;
  if constexpr (kFullUnits > 0) {
    first = c * kFullUnits;
    t.n_tok = kTokAlign * min(kFullUnits, units - first);
  } else {
    const int q = units / ch, r = units % ch;
    first = c * q + min(c, r);
    t.n_tok = kTokAlign * (q + (c < r ? 1 : 0));
  }
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

// Task u (< num_tasks) of the staged launch: expert-major, then block, then chunk.
__device__ __forceinline__ Task decode(const Params& p, const int* prefix, int u) {
  const int e = find_expert(p, prefix, u, p.n_blocks);
  const int ch = prefix[e + 1] - prefix[e];
  const int local = u - prefix[e] * p.n_blocks;
  return make_task(p, e, local / ch, local % ch, ch);
}

// Pair tasks (an even block count; 2-CTA clusters): the two CTAs of a cluster run weight blocks
// 2 j and 2 j + 1 against one chunk of <= 256 token rows, whose 64-row boxes they load half each
// and multicast into both CTAs (produce_task<kPaired>), so a CTA pulls its 16 KB of weights and 16
// KB of tokens from L2 a stage, not 16 + 32 (ncu, unpaired: L2 80-93% busy). Task u (< num_tasks):
// expert-major, then block pair, then chunk (decode's order), so tasks 2 P and 2 P + 1, the CTAs of
// pair unit P, hold one chunk's blocks 2 j, 2 j + 1, and the units after it the same blocks' other
// chunks, which then find the weights in L2 (chunk-major pairs re-read them from HBM: +5.6% gate/up
// at DeepSeek-V3 EP=1 T=4096).
__device__ __forceinline__ Task decode_pair(const Params& p, const int* prefix, int u) {
  const int pairs = p.n_blocks / 2, P = u / 2;
  const int e = find_expert(p, prefix, P, pairs);
  const int ch = prefix[e + 1] - prefix[e];
  const int local = P - prefix[e] * pairs;
  return make_task(p, e, 2 * (local / ch) + u % 2, local % ch, ch);
}

// Task i (< n_blocks * count) of the chunk window [g0, g0 + count) (the megakernel's minibatch):
// the window's experts in order, each block-major over its chunks inside the window. *chunk: the
// global chunk index (prefix[e] + c) of the task.
__device__ __forceinline__ Task decode_window(const Params& p, const int* prefix, int g0, int count, int i,
                                             int* chunk) {
  const int g = g0 + i / p.n_blocks;  // a chunk of the task's expert (its tasks are n_blocks per chunk)
  const int e = find_expert(p, prefix, g, 1);
  const int start = max(g0, prefix[e]), end = min(g0 + count, prefix[e + 1]);
  const int local = i - p.n_blocks * (start - g0);
  const int c = start + local % (end - start);
  *chunk = c;
  return make_task(p, e, local / (end - start), c - prefix[e], prefix[e + 1] - prefix[e]);
}

// ---- the staged kernels' task ring -----------------------------------------------------------------

// Warp 1 of the producer warpgroup (idle in the staged kernels) claims the tasks (gemm::claim_task)
// and decodes them into a ring of kTaskRing slots in shared memory, slot j % kTaskRing for the
// CTA's j-th task. The producer thread takes each one from there and posts its slot as the tag of
// the task's first stage (gemm::post_task); the consumers read the task from the slot, at its start
// and again for the epilogue. So the 24-register producer holds no claim or decode state (with them
// in it, ptxas spilled it), and the consumers decode nothing. The claimer makes the next claim once
// the producer has issued the current task's loads (a full/empty pair of barriers): the latest
// moment, which balances the launch best, while the ring's stages in flight hide the claim's
// latency. A slot is rewritten kTaskRing tasks later, when the consumers are past its task's
// epilogue (each task has >= 1 stage and kTaskRing > kStages + 2).
constexpr int kTaskRing = 8;
constexpr int kTaskInts = 8;  // the task's fields (seg = -1: stop), a flag
struct TaskRing {
  volatile int* ints;  // [kTaskRing][kTaskInts]
  uint64_t* full;      // the claimer's arrival (the next slot is written)
  uint64_t* empty;     // the producer's arrival (its task's loads are issued)
};

// The staged kernels' task bookkeeping, at the end of their shared memory (after the ring's
// barriers; 8-byte aligned): the task tags [gemm::kTaskTags] (gemm::post_task), the producer's count
// of taken tasks (+ 1 int of padding), the mailbox [gemm::kMailbox] ints and its barriers, the
// task ring and its two barriers.
struct TaskTail {
  static constexpr int kOffTaken = 4 * gemm::kTaskTags;
  static constexpr int kOffMailbox = kOffTaken + 8;
  static constexpr int kOffMailboxBarriers = kOffMailbox + 4 * gemm::kMailbox;
  static constexpr int kOffRing = kOffMailboxBarriers + 8 * gemm::kMailbox;
  static constexpr int kOffRingBarriers = kOffRing + 4 * kTaskRing * kTaskInts;
  static constexpr int kBytes = kOffRingBarriers + 2 * 8;
  static_assert(kOffMailboxBarriers % 8 == 0 && kOffRingBarriers % 8 == 0, "mbarriers need 8-byte alignment");
  uint8_t* base;
  __device__ __forceinline__ volatile int* task_tags() const { return reinterpret_cast<volatile int*>(base); }
  __device__ __forceinline__ volatile int* taken() const { return reinterpret_cast<volatile int*>(base + kOffTaken); }
  __device__ __forceinline__ gemm::Mailbox mailbox() const {
    return {reinterpret_cast<volatile int*>(base + kOffMailbox), reinterpret_cast<uint64_t*>(base + kOffMailboxBarriers)};
  }
  __device__ __forceinline__ TaskRing task_ring() const {
    uint64_t* bars = reinterpret_cast<uint64_t*>(base + kOffRingBarriers);
    return {reinterpret_cast<volatile int*>(base + kOffRing), bars, bars + 1};
  }
};

// A ring of `stages` stages whose tags and slots outlive their reading (see gemm::post_task and
// TaskRing).
__host__ __device__ constexpr bool task_tail_fits(int stages) {
  return stages < gemm::kTaskTags && stages + 2 < kTaskRing;
}

// One thread, before the block's first sync.
__device__ __forceinline__ void init_task_ring(const TaskRing& r) {
  mbar_init(r.full, 1);
  mbar_init(r.empty, 1);
}

__device__ __forceinline__ Task load_task(const TaskRing& r, int slot, bool* flag = nullptr) {
  const volatile int* f = r.ints + slot * kTaskInts;
  Task t;
  t.seg = ld_shared_b32(f);
  t.block = ld_shared_b32(f + 1);
  t.row0 = ld_shared_b32(f + 2);
  t.n_tok = ld_shared_b32(f + 3);
  t.n_real = ld_shared_b32(f + 4);
  t.pad0 = ld_shared_b32(f + 5);
  t.pad1 = ld_shared_b32(f + 6);
  if (flag != nullptr) *flag = ld_shared_b32(f + 7) != 0;
  return t;
}

// The claimer thread: claim(j) gives the j-th claim (-1: none left), decode(claim, &task, &flag)
// its task and the flag the producer reads with it.
template <class Claim, class Decode>
__device__ __forceinline__ void claim_tasks(const TaskRing& r, Claim claim, Decode decode) {
  for (uint32_t j = 0;; ++j) {
    mbar_wait(r.empty, (j & 1) ^ 1);
    const int u = claim(j);
    Task t;
    bool flag = false;
    if (u >= 0) decode(u, &t, &flag); else t.seg = -1;
    volatile int* f = r.ints + (j % kTaskRing) * kTaskInts;
    const int v[kTaskInts] = {t.seg, t.block, t.row0, t.n_tok, t.n_real, t.pad0, t.pad1, flag ? 1 : 0};
#pragma unroll
    for (int i = 0; i < (u >= 0 ? kTaskInts : 1); ++i) st_shared_b32(f + i, v[i]);
    mbar_arrive(r.full);
    if (u < 0) return;
  }
}

// The producer thread's task loop: take each task from its slot, post the slot as its first
// stage's tag, produce(task, flag) issues its loads (advancing it), then let the claimer claim the
// next one; at the end the stop stage. Ring: a staged kernel's shared memory (its stages and tail()).
template <class Ring, class Produce>
__device__ __forceinline__ void produce_tasks(const Ring& sm, uint32_t& it, Produce produce) {
  const TaskTail tail = sm.tail();
  for (st_shared_b32(tail.taken(), 0);;) {  // the count in shared memory: a register spilled
    const uint32_t j = ld_shared_b32(tail.taken());
    st_shared_b32(tail.taken(), j + 1);
    mbar_wait(tail.task_ring().full, j & 1);
    const int slot = j % kTaskRing;
    bool flag;
    const Task t = load_task(tail.task_ring(), slot, &flag);
    if (t.seg < 0) break;
    gemm::post_task(tail.task_tags(), it, slot);
    produce(t, flag);
    mbar_arrive(tail.task_ring().empty);
  }
  gemm::arm_stop_stage<false>(sm, it, tail.task_tags() + it % gemm::kTaskTags);
}

// ---- the ring ------------------------------------------------------------------------------------

// Producer thread: the nbox 64-row token boxes of a stage (128-byte rows: 64 bf16 or 128 e4m3 K
// columns from column k0), box i at x + i * kXBox * 128 from token row row0 + i * kXBox. kPaired
// (column pairs): this CTA loads every other box (from its cluster rank) and multicasts it into both
// CTAs' stages.
template <bool kPaired>
__device__ __forceinline__ void load_token_boxes(uint8_t* x, const CUtensorMap* tmX, uint64_t* full, int k0, int row0,
                                                 int nbox) {
  if constexpr (kPaired) {
    for (int i = static_cast<int>(cluster_ctarank()); i < nbox; i += 2)
      tma_load_2d_multicast(x + i * kXBox * 128, tmX, full, k0, row0 + i * kXBox, 0x3);
  } else {
    for (int i = 0; i < nbox; ++i) tma_load_2d(x + i * kXBox * 128, tmX, full, k0, row0 + i * kXBox);
  }
}

// Producer thread: the weight tile and the task's token rows, K block by K block. `Ring` gives the
// stages (w(s), x(s): the token-major ring's a(s), b(s) layout) and their barriers (full(s),
// empty(s)). Megakernel (kWatch): waits under the watchdog, and `tag` goes to stage_tag[s] of the
// task's first stage before it is armed.
// kWMN (the backward's dgrad): the weights are stored [K, M] per expert (M contiguous, as
// Megatron keeps them for the forward); a stage then holds two [64 K rows][64 M] boxes, one per
// consumer warpgroup, which wgmma reads as an MN-major A operand.
// kPaired (decode_pair's tasks): the token boxes are shared (load_token_boxes); the weights stay
// this CTA's own. Each CTA's stage expects the whole stage's bytes.
template <bool kSwiGLU, bool kWatch = false, bool kWMN = false, bool kPaired = false, class Ring>
__device__ __forceinline__ void produce_task(const Params& p, const CUtensorMap* tmW, const CUtensorMap* tmX,
                                             const Ring& sm, const Task& t, uint32_t& it, const Watchdog* w = nullptr,
                                             volatile int* stage_tag = nullptr, int tag = 0) {
  static_assert(!(kSwiGLU && kWMN), "the gate/up pair map is K-major");
  const int nk = (p.K + BK - 1) / BK;
  const int nbox = (t.n_tok + kXBox - 1) / kXBox;
  // SwiGLU: the 4D map's outer coordinate counts 8-row blocks of the gate half
  const int wcoord = kWMN ? t.seg * p.K
                          : (kSwiGLU ? (t.seg * p.w_rows_per_seg + t.block * (WM / 2)) / 8
                                     : t.seg * p.w_rows_per_seg + t.block * WM);
  for (int kb = 0; kb < nk; ++kb, ++it) {
    const int s = it % Ring::kStages;
    gemm::ring_wait<kWatch>(sm.empty(s), ((it / Ring::kStages) & 1) ^ 1, w);
    if (stage_tag != nullptr && kb == 0) stage_tag[s] = tag;
    mbar_arrive_expect_tx(sm.full(s), kWBytes + nbox * kXBox * BK * 2);
    if constexpr (kWMN) {
      tma_load_2d(sm.w(s), tmW, sm.full(s), t.block * WM, wcoord + kb * BK);
      tma_load_2d(sm.w(s) + kWBytes / 2, tmW, sm.full(s), t.block * WM + WM / 2, wcoord + kb * BK);
    } else if constexpr (kSwiGLU) {
      tma_load_4d(sm.w(s), tmW, sm.full(s), kb * BK, 0, 0, wcoord);
    } else {
      tma_load_2d(sm.w(s), tmW, sm.full(s), kb * BK, wcoord);
    }
    load_token_boxes<kPaired>(sm.x(s), tmX, sm.full(s), kb * BK, t.row0, nbox);
  }
}

// wgmma m64 nN k16 (bf16 in, fp32 accumulate) through CuTe's SM90 atom of that shape, on the first
// N / 2 accumulators; kMajorA: the weights K-major (forward) or MN-major (the backward's dgrad). The
// macro only spells out the 16 specialisations (N = 16 .. 256, the task sizes with_task_tokens makes).
template <int N, cute::SM90::GMMA::Major kMajorA>
struct Atom;
#define XGEMM_DEFINE_ATOM(N)                                                                          \
  template <cute::SM90::GMMA::Major kMajorA>                                                          \
  struct Atom<N, kMajorA> {                                                                           \
    using type = cute::SM90::GMMA::MMA_64x##N##x16_F32BF16BF16_SS<kMajorA, cute::SM90::GMMA::Major::K>; \
  };
XGEMM_DEFINE_ATOM(16)
XGEMM_DEFINE_ATOM(32)
XGEMM_DEFINE_ATOM(48)
XGEMM_DEFINE_ATOM(64)
XGEMM_DEFINE_ATOM(80)
XGEMM_DEFINE_ATOM(96)
XGEMM_DEFINE_ATOM(112)
XGEMM_DEFINE_ATOM(128)
XGEMM_DEFINE_ATOM(144)
XGEMM_DEFINE_ATOM(160)
XGEMM_DEFINE_ATOM(176)
XGEMM_DEFINE_ATOM(192)
XGEMM_DEFINE_ATOM(208)
XGEMM_DEFINE_ATOM(224)
XGEMM_DEFINE_ATOM(240)
XGEMM_DEFINE_ATOM(256)
#undef XGEMM_DEFINE_ATOM

template <int N, bool kWMN, size_t... Is>
__device__ __forceinline__ void wgmma_n(float (&d)[128], uint64_t da, uint64_t db, bool accumulate,
                                        std::index_sequence<Is...>) {
  constexpr auto kMajorA = kWMN ? cute::SM90::GMMA::Major::MN : cute::SM90::GMMA::Major::K;
  Atom<N, kMajorA>::type::fma(da, db, d[Is]...,
                     accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

// Consumer warpgroup `cw`: weight rows 64 cw .. 64 cw + 63 of the stage against its N token rows.
// kPaired: each stage is freed on both CTAs' rings (the peer multicasts into this one).
template <int N, bool kWatch, bool kWMN, bool kPaired, class Ring>
__device__ __forceinline__ void mma_task(const Params& p, const Ring& sm, int cw, float (&acc)[128], uint32_t& it,
                                         const Watchdog* w) {
  const int nk = (p.K + BK - 1) / BK;
  int prev = -1;
  for (int kb = 0; kb < nk; ++kb, ++it) {
    const int s = it % Ring::kStages;
    gemm::ring_wait<kWatch>(sm.full(s), (it / Ring::kStages) & 1, w);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      // K-major: 16 K columns are 32 bytes of each 128-byte row; MN-major: 16 rows of 128 bytes of
      // the warpgroup's own [64 K][64 M] box (the 8-row groups 1024 bytes apart either way)
      const uint64_t da = kWMN ? wgmma_desc_sw128_mn(sm.w(s) + cw * (kWBytes / 2) + kk * 16 * 128)
                               : wgmma_desc_sw128(sm.w(s) + cw * (WM / 2) * 128 + kk * 32);
      const uint64_t db = wgmma_desc_sw128(sm.x(s) + kk * 32);
      wgmma_n<N, kWMN>(acc, da, db, kb > 0 || kk > 0, std::make_index_sequence<N / 2>{});
    }
    gemm::commit_and_release_previous<kPaired>(prev, [&](int i) { return sm.empty(i); });
    prev = s;
  }
  wgmma_wait<0>();
  fence_regs(acc);
  gemm::release_stage<kPaired>(sm.empty(prev));
}

// f(std::integral_constant<int, n_tok>{}): a task's token count as a template argument (n_tok =
// 16 .. 16 kMaxUnits, a multiple of kTokAlign; anything else calls nothing). A switch (the macro
// spells out its 16 cases; a fold over the counts compiles to other, unmeasured code).
template <int kMaxUnits, class F>
__device__ __forceinline__ void with_task_tokens(int n_tok, F&& f) {
  switch (n_tok / kTokAlign) {
#define XGEMM_TOKENS_CASE(U)                                                       \
  case U:                                                                          \
    if constexpr (U <= kMaxUnits) f(std::integral_constant<int, U * kTokAlign>{}); \
    break;
    XGEMM_TOKENS_CASE(1) XGEMM_TOKENS_CASE(2) XGEMM_TOKENS_CASE(3) XGEMM_TOKENS_CASE(4) XGEMM_TOKENS_CASE(5)
    XGEMM_TOKENS_CASE(6) XGEMM_TOKENS_CASE(7) XGEMM_TOKENS_CASE(8) XGEMM_TOKENS_CASE(9) XGEMM_TOKENS_CASE(10)
    XGEMM_TOKENS_CASE(11) XGEMM_TOKENS_CASE(12) XGEMM_TOKENS_CASE(13) XGEMM_TOKENS_CASE(14) XGEMM_TOKENS_CASE(15)
    XGEMM_TOKENS_CASE(16)
#undef XGEMM_TOKENS_CASE
    default:
      break;
  }
}

// The task's N as a template argument (N = 16 .. 256).
template <bool kWatch = false, bool kWMN = false, bool kPaired = false, class Ring>
__device__ __forceinline__ void mma_task_any(const Params& p, const Ring& sm, int cw, float (&acc)[128], uint32_t& it,
                                             int n_tok, const Watchdog* w = nullptr) {
  with_task_tokens<kMaxTok / kTokAlign>(
      n_tok, [&](auto n) { mma_task<decltype(n)::value, kWatch, kWMN, kPaired>(p, sm, cw, acc, it, w); });
}

// ---- epilogue --------------------------------------------------------------------------------------

// Accumulator layout of a consumer warpgroup (thread t, warp w = t / 32, lane l, q = l % 4):
// acc[4 g + 2 s + h] holds weight row 16 w + l / 4 + 8 s and token 8 g + 2 q + h.

// Four 8x8 bf16 tiles of the warp's accumulator fragments (r0..r3: this thread's pair of adjacent
// elements of one accumulator row in each), lane 8 m + i giving the address of row i of tile m.
// kTrans: each tile is stored transposed (row i of the stored tile receives the tile's column i, 8
// accumulator rows as 16 contiguous bytes); else as it is. One instruction replaces 8 two-byte
// stores per thread. (Shared-memory addresses are 32-bit here: generic 64-bit pointers cost the
// registers that the megakernel's consumers do not have next to 128 accumulators.)
template <bool kTrans>
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  if constexpr (kTrans)
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0),
                 "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
  else
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
                 "r"(r2), "r"(r3)
                 : "memory");
}

__device__ __forceinline__ int2 ld_shared_v2i(uint32_t addr) {
  int2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void st_shared_v2(uint32_t addr, int x, int y) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(addr), "r"(x), "r"(y) : "memory");
}

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}

// The forward's combine done by the down projection's epilogue: each piece of a finished row also
// goes to slot src_slot[row] of its source rank src_rank[row]'s symmetric [T * k, N] buffer (the
// stores of combine.cu, from the staging tile instead of a second pass over the rows).
struct RowPush {
  const int* src_rank;
  const int* src_slot;
  PeerPtrs bufs;
};

// Rows of the staging tile [64 tokens][kStageStride] written by the warpgroup, then copied out as
// 16-byte row pieces: `cols` staged columns per token (32 SwiGLU, 64 down) to dst columns
// col0 .. col0 + cols (those < n_cols), tokens < n_real of this 64-token slice; push (optional):
// also into the rows' source slots. Their (rank, slot) are loaded once a row, by the first 64
// threads before the barrier, into the row's padding (columns 64 ..): a store that waited for its
// own two index loads cost ~6 us per e4m3 down task.
__device__ __forceinline__ void flush_staging(uint32_t stg, int cols, __nv_bfloat16* dst, int64_t ld, int row0,
                                              int col0, int n_cols, int n_real, int bar,
                                              const RowPush* push = nullptr) {
  const int t = threadIdx.x % 128;
  if (push != nullptr && t < 64) {
    const bool real = t < n_real;
    st_shared_v2(stg + 2 * (t * kStageStride + 64), real ? push->src_rank[row0 + t] : -1,
                 real ? push->src_slot[row0 + t] : 0);
  }
  warpgroup_bar_sync(bar);
  const int vecs = cols / 8;
  for (int idx = t; idx < 64 * vecs; idx += 128) {
    const int c = idx / vecs, v = idx % vecs;
    const int col = col0 + 8 * v;
    if (c < n_real && col < n_cols) {
      const uint4 piece = ld_shared_v4(stg + 2 * (c * kStageStride + 8 * v));
      st16(dst + static_cast<int64_t>(row0 + c) * ld + col, piece);
      if (push != nullptr) {
        const int2 rs = ld_shared_v2i(stg + 2 * (c * kStageStride + 64));
        if (rs.x >= 0)
          st16(static_cast<__nv_bfloat16*>(push->bufs.p[rs.x]) + static_cast<int64_t>(rs.y) * ld + col, piece);
      }
    }
  }
  warpgroup_bar_sync(bar);
}

// +0 into rows [r0, r1) of dst's columns col0 .. col0 + cols (those < n_cols): a segment's padding
// rows, as the token-major GEMM leaves them (its padding rows of A are zero).
// tid / nthreads: this thread among the threads that share the rows (default: a warpgroup).
__device__ __forceinline__ void zero_rows(__nv_bfloat16* dst, int64_t ld, int r0, int r1, int col0, int cols,
                                          int n_cols, int tid = threadIdx.x % 128, int nthreads = 128) {
  const int vecs = cols / 8;
  for (int idx = tid; idx < (r1 - r0) * vecs; idx += nthreads) {
    const int col = col0 + 8 * (idx % vecs);
    if (col < n_cols) st16(dst + static_cast<int64_t>(r0 + idx / vecs) * ld + col, make_uint4(0, 0, 0, 0));
  }
}

// Tokens 64 sl .. 64 sl + 63 of a plain (non-SwiGLU) task into the staging tile, bf16-rounded:
// tiles (g, s) are output columns 16 w + 8 s .. + 7 x tokens 8 g .. 8 g + 7, four per instruction
// as (g, 0), (g, 1), (g + 1, 0), (g + 1, 1); lane 8 m + i addresses token 8 (g8 + m / 2) + i,
// column 16 w + 8 (m % 2).
__device__ __forceinline__ void stage_plain(uint32_t stg, const float (&acc)[128], int sl, int w, int lane) {
#pragma unroll
  for (int g8 = 0; g8 < 8; g8 += 2) {
    const int g = 8 * sl + g8;
    const int m = lane / 8;
    stmatrix_x4<true>(stg + 2 * ((8 * (g8 + m / 2) + lane % 8) * kStageStride + 16 * w + 8 * (m % 2)),
                      gemm::bf16x2_bits(acc[4 * g], acc[4 * g + 1]),
                      gemm::bf16x2_bits(acc[4 * g + 2], acc[4 * g + 3]),
                      gemm::bf16x2_bits(acc[4 * g + 4], acc[4 * g + 5]),
                      gemm::bf16x2_bits(acc[4 * g + 6], acc[4 * g + 7]));
  }
}

// The segment's padding rows of the task's columns (the expert's last chunk: pad0 < pad1), +0.
template <bool kSwiGLU>
__device__ __forceinline__ void store_task_padding(const Params& p, const Task& tk, int cw) {
  if (tk.pad1 > tk.pad0) {
    if constexpr (kSwiGLU) {
      const int col0 = tk.block * (WM / 2) + cw * 32;
      zero_rows(p.out, p.N, tk.pad0, tk.pad1, col0, 32, p.N);
      if (p.pre_out != nullptr) {
        zero_rows(p.pre_out, 2 * p.N, tk.pad0, tk.pad1, col0, 32, p.N);
        zero_rows(p.pre_out + p.N, 2 * p.N, tk.pad0, tk.pad1, col0, 32, p.N);
      }
    } else {
      zero_rows(p.out, p.N, tk.pad0, tk.pad1, tk.block * WM + cw * 64, 64, p.N);
    }
  }
}

// The warpgroup's weight rows of task tk for all its token rows, 64 tokens at a time through the
// staging tile; push (plain only, optional): the rows also go to their source slots (RowPush).
template <bool kSwiGLU, class Ring>
__device__ __forceinline__ void store_task(const Params& p, const Ring& sm, const Task& tk, int cw,
                                           const float (&acc)[128], const RowPush* push = nullptr) {
  const int t = threadIdx.x % 128;
  const int w = t / 32, lane = t % 32;
  const int bar = 2 + cw;
  const uint32_t stg = smem_u32(sm.staging(cw));
  const int rounds = (kSwiGLU && p.pre_out != nullptr) ? 3 : 1;
#pragma unroll
  for (int sl = 0; sl < kMaxTok / 64; ++sl) {
    if (64 * sl >= tk.n_tok) break;
    const int row0 = tk.row0 + 64 * sl;
    const int n_real = tk.n_real - 64 * sl;
    for (int round = 0; round < rounds; ++round) {
      if constexpr (kSwiGLU) {
        // Tile g: output columns 8 w .. 8 w + 7 (gate/up pair j = 8 w + lane / 4) x tokens 8 g .. 8 g + 7;
        // lane 8 m + i addresses token 8 (g8 + m) + i of the slice.
#pragma unroll
        for (int g8 = 0; g8 < 8; g8 += 4) {
          uint32_t v[4];
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            const int g = 8 * sl + g8 + m;
            const float g0 = acc[4 * g], g1 = acc[4 * g + 1], u0 = acc[4 * g + 2], u1 = acc[4 * g + 3];
            v[m] = round == 0 ? gemm::bf16x2_bits(swiglu(g0, u0), swiglu(g1, u1))
                              : (round == 1 ? gemm::bf16x2_bits(g0, g1) : gemm::bf16x2_bits(u0, u1));
          }
          stmatrix_x4<true>(stg + 2 * ((8 * (g8 + lane / 8) + lane % 8) * kStageStride + 8 * w), v[0], v[1], v[2], v[3]);
        }
      } else {
        stage_plain(stg, acc, sl, w, lane);
      }
      if constexpr (kSwiGLU) {
        const int col0 = tk.block * (WM / 2) + cw * 32;
        __nv_bfloat16* dst = round == 0 ? p.out : p.pre_out + (round == 2 ? p.N : 0);
        flush_staging(stg, 32, dst, round == 0 ? p.N : 2 * p.N, row0, col0, p.N, n_real, bar);
        // pre_out's column bound is N for both halves (col0 < N), the offset picks the half
      } else {
        flush_staging(stg, 64, p.out, p.N, row0, tk.block * WM + cw * 64, p.N, n_real, bar, push);
      }
    }
  }
  store_task_padding<kSwiGLU>(p, tk, cw);
}

// The SwiGLU backward fused into the down projection's dgrad (its tasks: da = dy @ fc2[e] for
// output columns i x tokens, dy the rows of grad_out as they are, unweighted). Its inputs and
// optional outputs:
//   h:     [rows, 2 N] the forward's pre-activations [gate | up] (out row r pairs with h row r);
//   row_w: [rows] the router weight of each row (nullptr: 1), applied to da in fp32;
//   act:   [rows, N] bf16(w * silu(gate) * up), the down projection's weight-gradient operand
//          (the forward keeps no activation: this epilogue has gate and up in hand);
//   dot:   [rows, dot_ld] per 64 columns c: sum_j da_j * silu(gate_j) * up_j, the pieces of the
//          router-weight gradient <g, act @ fc2[e]^T> = <g @ fc2[e], act> (summed over the pieces in
//          column order by bwd_dprobs): the forward keeps no expert output either.
// out = dh = [d_gate | d_up] ([rows, 2 N]) of w * da.
struct SwiGLUBwd {
  const __nv_bfloat16* h = nullptr;
  const float* row_w = nullptr;
  __nv_bfloat16* act = nullptr;
  float* dot = nullptr;
  int dot_ld = 0;
};

// The slice's pre-activations into L2 before the slice is staged: below, each piece's loads come
// right before its stores, one after another (holding them in registers spills next to the
// accumulators).
__device__ __forceinline__ void prefetch_swiglu_bwd(const Params& p, const __nv_bfloat16* h, int row0, int col0,
                                                    int n_real) {
  const int64_t ld = 2 * static_cast<int64_t>(p.N);
  for (int idx = threadIdx.x % 128; idx < 64 * 8; idx += 128) {
    const int c = idx / 8, col = col0 + 8 * (idx % 8);
    if (c < n_real && col < p.N) {
      const int hr = row0 + c;
      prefetch_l2(h + hr * ld + col);
      prefetch_l2(h + hr * ld + p.N + col);
    }
  }
}

// dh's e4m3 copy for the fc1 dgrad, written by the epilogue that makes dh (expert_gemm_fp8's row
// tasks): q [rows, 2 N] in gate/up pair blocks (block kb: gate columns 64 kb .. 64 kb + 63, then the
// same up columns) with scale[kb * ld + row], the bits of quantize_rows_e4m3(dh, gate_up_pairs).
// A slice of 64 columns is exactly one pair block, held 8 + 8 values a lane by 8 consecutive lanes.
struct PairBlockE4m3 {
  uint8_t* q = nullptr;
  float* scale = nullptr;
  int64_t ld = 0;
};

// Lane `piece` of the 8 that hold row r's pair block kb: dg / du as dh stores them (the bf16
// pieces), the block's amax over the 8 lanes, then its bytes (q_row: row r of q) and (piece 0) its
// scale. Every lane of the warp calls it (the shuffles); live: the row is real (the same for all 8).
__device__ __forceinline__ void store_pair_block_e4m3(const PairBlockE4m3& e4, uint4 dg, uint4 du, bool live,
                                                      uint8_t* q_row, int r, int kb, int piece) {
  float g[8], u[8];
  unpack8(dg, g);
  unpack8(du, u);
  const float amax = e4m3::octet_amax(g, u);
  if (!live) return;
  const float2 si = e4m3::scale_and_inverse(amax);
  uint8_t* q = q_row + kb * 128 + 8 * piece;
  *reinterpret_cast<uint2*>(q) = e4m3::pack8(g, si.y);
  *reinterpret_cast<uint2*>(q + 64) = e4m3::pack8(u, si.y);
  if (piece == 0) e4.scale[static_cast<int64_t>(kb) * e4.ld + r] = si.x;
}

// One 8-column piece of a token row of da through the SwiGLU backward, in two steps, so a loop can
// issue later pieces' global loads before this one's arithmetic: its global inputs
// (load_swiglu_bwd_piece), then, with its da from shared memory (bf16-rounded, as an unfused da
// would be), its outputs (swiglu_bwd_piece).
struct SwiGLUBwdPiece {
  uint4 g, u;  // the gate and up pre-activations
  float w;     // the row's router weight
};

// Row r, columns col .. col + 7; not live: +0 (into the shuffles).
__device__ __forceinline__ SwiGLUBwdPiece load_swiglu_bwd_piece(const Params& p, const SwiGLUBwd& bw, int r, int col,
                                                                bool live) {
  SwiGLUBwdPiece in{make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0), 1.f};
  if (live) {
    const int64_t ld = 2 * static_cast<int64_t>(p.N);
    in.g = ld16(bw.h + r * ld + col);
    in.u = ld16(bw.h + r * ld + p.N + col);
    if (bw.row_w != nullptr) in.w = bw.row_w[r];
  }
  return in;
}

// The piece's outputs: row r, columns col0 + 8 piece .. + 7 of the 64-column slice col0; row_real: r
// is a real row. The 8 pieces of a row sit on 8 consecutive lanes, which sum its dot piece by a
// fixed butterfly. kE4m3: dh's e4m3 copy too (store_pair_block_e4m3).
template <bool kE4m3>
__device__ __forceinline__ void swiglu_bwd_piece(const Params& p, const SwiGLUBwd& bw, const SwiGLUBwdPiece& in,
                                                 uint4 da, int r, int col0, int piece, bool row_real,
                                                 const PairBlockE4m3& e4) {
  const int64_t ld = 2 * static_cast<int64_t>(p.N);
  const bool lanes_meet = kE4m3 || bw.dot != nullptr;  // every lane goes on to the shuffles
  const bool need_act = bw.act != nullptr || bw.dot != nullptr;
  const int col = col0 + 8 * piece;
  const bool live = row_real && col < p.N;
  if (!lanes_meet && !live) return;  // warp-uniform: lanes_meet is
  float g[8], u[8], d[8], dg[8], du[8], s[8], sig[8];
  const float w = in.w;
  unpack8(in.g, g);
  unpack8(in.u, u);
  unpack8(da, d);
  constexpr int kGroup = kE4m3 ? tuning::kSwiGLUBwdGroupE4m3 : tuning::kSwiGLUBwdGroup;
#pragma unroll
  for (int j = 0; j < 8; j += kGroup) silu_and_sigmoid<kGroup>(g + j, s + j, sig + j);
  if (need_act) {
    float a[8], dot = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      a[j] = __fmul_rn(s[j], u[j]);  // swiglu(g, u)
      dot = __fadd_rn(dot, __fmul_rn(d[j], a[j]));
      a[j] = __fmul_rn(w, a[j]);
    }
    if (bw.act != nullptr && live) st16(bw.act + static_cast<int64_t>(r) * p.N + col, pack8(a));
    if (bw.dot != nullptr) {
#pragma unroll
      for (int off = 1; off < 8; off *= 2) dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, off));
      // a slice past the last column (N not a multiple of 128) has no piece of its own
      if (piece == 0 && row_real && col0 < p.N) bw.dot[static_cast<int64_t>(r) * bw.dot_ld + col0 / 64] = dot;
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) swiglu_grad(g[j], u[j], __fmul_rn(w, d[j]), sig[j], dg[j], du[j]);
  const uint4 dg16 = pack8(dg), du16 = pack8(du);
  if (live) {
    __nv_bfloat16* dst = p.out + r * ld + col;
    st16(dst, dg16);
    st16(dst + p.N, du16);
  }
  if constexpr (kE4m3) store_pair_block_e4m3(e4, dg16, du16, live, e4.q + r * ld, r, col0 / 64, piece);
}

// A warpgroup's staged [64 tokens][64 columns] slice of da through the SwiGLU backward (the e4m3
// row tasks' epilogue), between two barriers of the warpgroup (the staging tile is reused).
template <bool kE4m3 = false>
__device__ __forceinline__ void flush_swiglu_bwd(const Params& p, uint32_t stg, const SwiGLUBwd& bw, int row0,
                                                 int col0, int n_real, int bar, const PairBlockE4m3& e4 = {}) {
  warpgroup_bar_sync(bar);
  for (int idx = threadIdx.x % 128; idx < 64 * 8; idx += 128) {
    const int c = idx / 8, piece = idx % 8, col = col0 + 8 * piece;
    const bool live = c < n_real && col < p.N;
    const SwiGLUBwdPiece in = load_swiglu_bwd_piece(p, bw, row0 + c, col, live);
    const uint4 da = live ? ld_shared_v4(stg + 2 * (c * kStageStride + 8 * piece)) : make_uint4(0, 0, 0, 0);
    swiglu_bwd_piece<kE4m3>(p, bw, in, da, row0 + c, col0, piece, c < n_real, e4);
  }
  warpgroup_bar_sync(bar);
}

// The padding rows [r0, r1) of the SwiGLU backward's outputs, columns col0 .. col0 + cols: +0 in
// dh (both halves) and act (the weight gradient reads a segment's rows up to a multiple of 16).
__device__ __forceinline__ void zero_swiglu_bwd_rows(const Params& p, const SwiGLUBwd& bw, int r0, int r1, int col0,
                                                     int cols, int tid = threadIdx.x % 128, int nthreads = 128) {
  const int64_t ld = 2 * static_cast<int64_t>(p.N);
  zero_rows(p.out, ld, r0, r1, col0, cols, p.N, tid, nthreads);
  zero_rows(p.out + p.N, ld, r0, r1, col0, cols, p.N, tid, nthreads);
  if (bw.act != nullptr) zero_rows(bw.act, p.N, r0, r1, col0, cols, p.N, tid, nthreads);
}

// ---- the bf16 down dgrad: the SwiGLU backward handed off to the epilogue warps --------------------

// The SwiGLU backward reads the pre-activations and writes dh, act and the dot pieces: ~2.5x the
// bytes of a plain epilogue, which, run by both consumer warpgroups at once after the MMA, left the
// tensor pipe idle for it (ncu: 65% active against the fc1 dgrad's 90%). So the consumers only
// stage each task's da tile (bf16) in shared memory and go on to the next task's MMA, and three
// epilogue warps (warps 1-3 of the producer warpgroup, idle in these kernels) run the SwiGLU
// backward from there while it runs. The tile (two [256 tokens][72] halves, 72 KB) takes a ring
// stage's room: tuning::kSwiGLUBwdStages.
constexpr int kEpilogueThreads = 96;  // warps 1-3
constexpr int kHandoffBytesPerWG = kMaxTok * kStageStride * 2;

struct HandoffSmem {
  static constexpr int kStages = tuning::kSwiGLUBwdStages;
  static constexpr int kOffHandoff = kStages * (kWBytes + kXBytes);
  static constexpr int kOffBarriers = kOffHandoff + 2 * kHandoffBytesPerWG;
  static constexpr int kBytes = kOffBarriers + (2 * kStages + 2) * 8 + 1024 /* alignment */;
  uint8_t* base;
  __device__ __forceinline__ uint8_t* w(int s) const { return base + s * kWBytes; }
  __device__ __forceinline__ uint8_t* x(int s) const { return base + kStages * kWBytes + s * kXBytes; }
  // consumer warpgroup cw's 64 columns of the tile: token c at row c (kStageStride columns)
  __device__ __forceinline__ uint32_t handoff(int cw) const { return smem_u32(base + kOffHandoff) + cw * kHandoffBytesPerWG; }
  __device__ __forceinline__ uint64_t* full(int s) const { return reinterpret_cast<uint64_t*>(base + kOffBarriers) + s; }
  __device__ __forceinline__ uint64_t* empty(int s) const { return full(kStages + s); }
  // the tile is staged (one arrival per consumer warp) / read (one per epilogue thread)
  __device__ __forceinline__ uint64_t* handoff_full() const { return full(2 * kStages); }
  __device__ __forceinline__ uint64_t* handoff_empty() const { return full(2 * kStages + 1); }
};
static_assert(HandoffSmem::kBytes + 4 * (kMaxSeg + 1) <= 227 * 1024, "shared memory");

// One thread, before the block's first sync.
__device__ __forceinline__ void init_handoff(const HandoffSmem& sm) {
  mbar_init(sm.handoff_full(), gemm::kConsumerWarps);
  mbar_init(sm.handoff_empty(), kEpilogueThreads);
  mbar_fence_init();
}

// Consumer warpgroup cw, its j-th task (of n_tok tokens): its 64 columns of da into its half of the
// tile, once the epilogue warps have read the previous task's.
__device__ __forceinline__ void hand_off_da(const HandoffSmem& sm, int n_tok, int cw, const float (&acc)[128],
                                            uint32_t j) {
  const int t = threadIdx.x % 128;
  const int w = t / 32, lane = t % 32;
  mbar_wait(sm.handoff_empty(), (j & 1) ^ 1);
  const uint32_t tile = sm.handoff(cw);
#pragma unroll
  for (int sl = 0; sl < kMaxTok / 64; ++sl) {
    if (64 * sl >= n_tok) break;
    stage_plain(tile + 2 * 64 * sl * kStageStride, acc, sl, w, lane);
  }
  __syncwarp();  // the warp's stmatrix stores before its arrival
  if (lane == 0) mbar_arrive(sm.handoff_full());
}

// Epilogue thread tid (of kEpilogueThreads), the CTA's j-th task: the task's 128 columns of dh (and
// act, dot) from its da tile, then the segment's padding rows.
__device__ __forceinline__ void swiglu_bwd_task(const Params& p, const HandoffSmem& sm, const Task& tk,
                                                const SwiGLUBwd& bw, int tid, uint32_t j) {
  const int64_t ld = 2 * static_cast<int64_t>(p.N);
  const int col0 = tk.block * WM;
  mbar_wait(sm.handoff_full(), j & 1);
  // the task's gate and up rows into L2 ahead of the pieces (four 128-byte lines a row)
  for (int idx = tid; idx < 4 * tk.n_real; idx += kEpilogueThreads) {
    const int c = idx / 4, col = col0 + 64 * (idx % 2);
    if (col < p.N) prefetch_l2(bw.h + (tk.row0 + c) * ld + (idx % 4 / 2) * p.N + col);
  }
  // Piece idx: token row idx / 16, half idx / 8 % 2, 8 columns idx % 8 of the half (a row's 16 pieces on
  // 16 consecutive lanes; a warp's pieces are all below n or none: n_tok % 16 == 0). A thread's pieces
  // are idx = tid + kEpilogueThreads i; the global loads of i + 1 .. i + kAhead are in flight while
  // piece i's arithmetic runs (with none, the loop waited on each piece's loads).
  constexpr int kAhead = tuning::kSwiGLUBwdPiecesAhead;
  const int n = 16 * tk.n_tok;
  const auto load = [&](int idx) {
    const int c = idx / 16, col = col0 + 64 * (idx / 8 % 2) + 8 * (idx % 8);
    return load_swiglu_bwd_piece(p, bw, tk.row0 + c, col, idx < n && c < tk.n_real && col < p.N);
  };
  SwiGLUBwdPiece ahead[kAhead];
#pragma unroll
  for (int k = 0; k < kAhead; ++k) ahead[k] = load(tid + k * kEpilogueThreads);
  for (int idx = tid; idx < n; idx += kEpilogueThreads) {
    const SwiGLUBwdPiece in = ahead[0];
#pragma unroll
    for (int k = 0; k + 1 < kAhead; ++k) ahead[k] = ahead[k + 1];
    ahead[kAhead - 1] = load(idx + kAhead * kEpilogueThreads);
    const int c = idx / 16, half = idx / 8 % 2, col = col0 + 64 * half + 8 * (idx % 8);
    const uint4 da = c < tk.n_real && col < p.N ? ld_shared_v4(sm.handoff(half) + 2 * (c * kStageStride + 8 * (idx % 8)))
                                                : make_uint4(0, 0, 0, 0);
    swiglu_bwd_piece<false>(p, bw, in, da, tk.row0 + c, col0 + 64 * half, idx % 8, c < tk.n_real, {});
  }
  mbar_arrive(sm.handoff_empty());
  if (tk.pad1 > tk.pad0) zero_swiglu_bwd_rows(p, bw, tk.pad0, tk.pad1, col0, WM, tid, kEpilogueThreads);
}

// ---- host side -----------------------------------------------------------------------------------

inline SwiGLUBwd swiglu_bwd_of(const SwiGLUBackward& a) {
  return SwiGLUBwd{static_cast<const __nv_bfloat16*>(a.h), a.row_w, static_cast<__nv_bfloat16*>(a.act), a.dot,
                   a.dot_ld};
}

// The SwiGLU backward's arguments, checked on the host (nullptr: fine).
inline const char* check_swiglu_bwd(const SwiGLUBackward& a, int N) {
  if (a.h == nullptr) {
    if (a.row_w != nullptr || a.act != nullptr || a.dot != nullptr) return "row_w, act and dot go with h";
    return nullptr;
  }
  if (!aligned16(a.h) || (a.act != nullptr && !aligned16(a.act))) return "h and act must be 16-byte aligned";
  if (a.dot != nullptr && a.dot_ld < (N + 63) / 64) return "dot needs one column per 64 output columns";
  return nullptr;
}

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
  p.out = static_cast<__nv_bfloat16*>(out);
  p.pre_out = swiglu ? static_cast<__nv_bfloat16*>(pre_out) : nullptr;
  return p;
}

}  // namespace xgemm
}  // namespace mok
