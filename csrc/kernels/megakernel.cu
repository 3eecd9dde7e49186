// The persistent forward megakernel (stage 4): one launch per layer forward between the opening
// barrier (publish_barrier: x copied into the symmetric buffer) and the epilogue (which closes the
// barrier this kernel opens at its end).
//
// Every CTA is a GEMM CTA (1 producer thread + 2 consumer warpgroups, 4-stage TMA ring) plus 3
// pusher warps (below). The first `num_comm` CTAs to start first pull-dispatch routed rows with all
// 384 threads, then join the GEMM work. GEMM work is a fixed linear task list, identical on every
// rank:
//
//   [shared gate/up tiles][shared down tiles]        token-major tiles (grouped_gemm.cuh)
//   then per minibatch b (routed token chunks [b * mb, (b + 1) * mb)): [gate/up tasks][down tasks]
//
// Routed tasks are expert-major (expert_gemm.cuh): (expert, weight block, token chunk of <= 256 of
// the expert's rows), inside a minibatch ordered by expert, then block, then chunk.
//
// A producer claims tasks in increasing order from a global ticket; a task waits only on earlier
// tasks (or on the dispatch, which waits on nothing), so the persistent scheduler cannot deadlock,
// whatever the grid size. Dependencies are local counters (ld.acquire.gpu / red.release.gpu):
//   ready[m]     dispatch units (8 rows, one warp) of 128-row block m written        (target 16)
//   up_done[g]   routed gate/up task halves of token chunk g written (act rows)     (target 2 n1)
//   sup_done[m]  shared gate/up tile halves of m-tile m written (shared_act rows)   (target 2 n1s)
// (each consumer warpgroup arrives once per task).
// A routed down task's epilogue writes its rows of y (64 columns per consumer warpgroup) and queues
// them (a 4-slot shared-memory queue); warps 1-3 of the producer warpgroup (idle otherwise) push
// them (128-byte row pieces) into slot row_src_slot of the source rank's symmetric combine buffer,
// while the consumers already run the next task's MMAs.
//
// Bits: every output element is computed by exactly one task with the K order and epilogue of the
// staged grouped GEMMs, and the dispatch and combine copy values unchanged, so the results do not
// depend on num_comm, the grid size or minibatch_rows (tested bitwise against the staged path).
//
// Paired (MOK_GEMM_PAIRED=1; the default is unpaired, same bits): CTAs run in 2-CTA clusters; the
// cluster's first CTA claims a unit and hands it to the second through a shared-memory mailbox.
// Shared-expert units are pairs of m-tiles (2j, 2j + 1) with one n-tile, sharing the weights through
// cluster multicast (grouped_gemm.cuh); routed units are two consecutive tasks of one kind, one per
// CTA, whose rings advance in lockstep. Dispatching is per cluster.
//
// FP8 (kFp8; block-scaled e4m3 routed GEMMs, expert_gemm_fp8.cuh, unpaired only): the peers' x
// buffers hold e4m3 rows and a second symmetric buffer their scale rows (quantize_rows_e4m3); the
// dispatch copies both (the scales into the GEMM's [kb][row] layout). Routed tasks are the e4m3
// tasks (token chunks of <= 128 rows) on a ring of 6 stages of 32 KB laid over the token-major
// ring (E4M3Ring). A chunk's act is quantized per 128-column block kb, which 4 warpgroup epilogues
// write (gate/up tasks 2 kb and 2 kb + 1): the last of them (kb_done[chunk][kb] reaches 4)
// quantizes the block into act8 (the bits of quantize_rows_e4m3) and arrives on up_done[chunk]
// (target I / 128). The shared expert stays bf16, as expert-major tasks of one segment (its T rows
// in chunks of <= 128; the same bits as the token-major tiles): no wgmma of this instance
// accumulates into the upper half of the accumulator array, where the e4m3 tasks promote (a 256-wide
// bf16 wgmma there makes ptxas serialize every wgmma, C7515). Same bits as the staged fp8 launches;
// measured 1-13% slower than them at 8 of 10 shapes (docs/KERNELS.md, ninth session), so fp8
// defaults to the staged path.
//
// Counters live in a per-workspace int32 buffer that the last CTA to finish zeroes again, so a
// CUDA graph replays it. Every wait has a watchdog (%globaltimer): a stall sets
// errors[kErrKernelStall] = 1 + rank and an abort flag, and the kernel ends instead of hanging.
#include <stdlib.h>

#include "e4m3.cuh"
#include "expert_gemm_fp8.cuh"
#include "persistent.cuh"

namespace mok {
namespace {

using gemm::BM;
using gemm::BN;
using gemm::kStages;
using gemm::kThreads;
using persistent::ExpertRing;
using persistent::PushQueue;
using persistent::kPushSlots;
using persistent::kTicket;
using persistent::kRole;
using persistent::kHeader;
using persistent::push_enqueue;
using persistent::smid;
using persistent::wait_counter;
using persistent::watchdog;
using persistent::timeline_record;
using persistent::kMaxTimelineRoles;
using namespace persistent::timeline;

using persistent::kWarps;
using persistent::kUnitRows;       // rows a dispatching warp copies before it signals
using persistent::kUnitsPerTile;
constexpr int kCopyUnroll = 8;                  // 16-byte loads in flight per lane
using gemm::kMailbox;
using gemm::Mailbox;

// Counter buffer: header (persistent.cuh), then ready[max_mtiles], up_done[max_mtiles],
// sup_done[ceil(T / BM)], fp8: kb_done[max_mtiles][I / 128].
enum Kind : int { kSharedUp = 0, kSharedDown = 1, kRoutedUp = 2, kRoutedDown = 3 };

struct TMaps {
  CUtensorMap a[4];  // by Kind
  CUtensorMap b[4];
  CUtensorMap r[2];  // fp8: the routed token operands' scales [K / 128][capacity], by kind - kRoutedUp
};

struct Params {
  gemm::Params g[2];      // shared gate/up, shared down (token-major)
  xgemm::Params xg[2];    // routed gate/up, routed down (expert-major): xg[kind - kRoutedUp]
  int shared_mtiles;  // 0: no shared expert
  int mb_chunks;      // routed token chunks per minibatch
  int num_comm;
  int max_mtiles;     // capacity / BM
  int n_counters;
  int capacity, nle, H, k, rank;
  const int* row_src_rank;
  const int* row_src_slot;
  const int* expert_offsets;
  __nv_bfloat16* x_routed;
  int* counters;
  int* state;
  int* errors;
  int ep;
  uint64_t timeout_ns;
  PeerPtrs x_bufs;
  PeerPtrs comb_bufs;
  PeerPtrs flags;
  long long* timeline;  // null, or kTimelineFields int64 per task, then per dispatching CTA (profiling)
  int timeline_tasks;   // task records in timeline (tasks past it are not recorded)
  // fp8 (kFp8)
  const float* w_scale[2];  // routed fc1 / fc2 weight scales [nle][n_blocks][K / 128]
  uint8_t* x8_routed;       // [capacity, H] e4m3, dispatched (x_bufs: the peers' e4m3 rows)
  float* x8_scale;          // [H / 128][capacity]
  PeerPtrs xs_bufs;         // the peers' scale rows [T][xs_pitch] fp32
  int xs_pitch;
  uint8_t* act8;            // [capacity, I] e4m3
  float* act8_scale;        // [I / 128][capacity]
  int act_kb;               // I / 128
  int kb_done_base;         // counter index of kb_done[0][0]
  xgemm::Params xs[2];      // the shared expert as one expert-major segment (gate/up, down)
  int shared_chunks;        // its token chunks (<= 128 rows; sup_done counts per chunk)
};

// The fp8 instance's ring: the token-major ring's bytes as 6 stages of 32 KB (the e4m3 tasks'
// 128 weight rows and <= 128 token rows of 128 K, or the shared expert's bf16 tasks of <= 128 rows
// and 64 K), the e4m3 stages' token scales, barriers and stage tags in a tail after the staging
// tiles (the 6 stages of the staged e4m3 kernel; against 4 the layer time moved within the noise,
// docs/KERNELS.md ninth session, calls 2-3).
struct E4M3Ring {
  static constexpr int kStages = xgemm8::kStages;
  static constexpr int kScaleBytes = xgemm8::kRBytes;
  static constexpr int kStageBytes = xgemm8::kWBytes + xgemm8::kXBytes;
  static constexpr int kTailBytes = kStages * (xgemm8::kRBytes + 2 * 8 + 4);
  uint8_t* base;  // 1024-aligned
  uint8_t* tail;  // scales [kStages][128 fp32], full [kStages], empty [kStages], stage tags [kStages]
  __nv_bfloat16* staging_base;
  __device__ __forceinline__ uint8_t* w(int s) const { return base + s * kStageBytes; }
  __device__ __forceinline__ uint8_t* x(int s) const { return base + s * kStageBytes + xgemm8::kWBytes; }
  __device__ __forceinline__ uint8_t* scales(int s) const { return tail + s * xgemm8::kRBytes; }
  __device__ __forceinline__ uint64_t* full(int s) const {
    return reinterpret_cast<uint64_t*>(tail + kStages * xgemm8::kRBytes) + s;
  }
  __device__ __forceinline__ uint64_t* empty(int s) const { return full(kStages + s); }
  __device__ __forceinline__ volatile int* stage_tags() const { return reinterpret_cast<volatile int*>(full(2 * kStages)); }
  __device__ __forceinline__ __nv_bfloat16* staging(int cw) const {
    return staging_base + cw * (64 * xgemm::kStageStride);
  }
};
static_assert(E4M3Ring::kStages * E4M3Ring::kStageBytes <= gemm::kStages * gemm::kStageBytes,
              "the e4m3 stages fit the token-major ring");
static_assert(xgemm8::kXBytes >= xgemm8::kMaxTok * xgemm::BK * 2, "a bf16 stage of <= 128 token rows fits");


struct Task {
  int kind, m, n;
};

__device__ __forceinline__ int* ready_ctr(const Params& p, int m) { return p.counters + kHeader + m; }
__device__ __forceinline__ int* up_done_ctr(const Params& p, int m) { return p.counters + kHeader + p.max_mtiles + m; }
__device__ __forceinline__ int* sup_done_ctr(const Params& p, int m) {
  return p.counters + kHeader + 2 * p.max_mtiles + m;
}
__device__ __forceinline__ int* kb_done_ctr(const Params& p, int chunk, int kb) {
  return p.counters + p.kb_done_base + chunk * p.act_kb + kb;
}

// Routed rows that exist this launch (device value; a multiple of BM).
__device__ __forceinline__ int routed_rows(const Params& p) { return min(p.expert_offsets[p.nle], p.capacity); }

// m-units of `m_tiles` m-tiles: the m-tiles themselves, or (paired) pairs of them.
template <bool kPaired>
__device__ __forceinline__ int m_units(int m_tiles) {
  return kPaired ? (m_tiles + 1) / 2 : m_tiles;
}

// Units of a routed kind in a minibatch of `count` chunks: its tasks one by one, or (paired) two by two.
template <bool kPaired>
__device__ __forceinline__ int routed_units(const Params& p, int kind, int count) {
  return m_units<kPaired>(p.xg[kind - kRoutedUp].n_blocks * count);
}

// Tasks of a shared kind: token-major tiles (or pairs of them), or (fp8) expert-major tasks.
template <bool kPaired, bool kFp8>
__device__ __forceinline__ int shared_units(const Params& p, int kind) {
  return kFp8 ? p.shared_chunks * p.xs[kind].n_blocks : m_units<kPaired>(p.shared_mtiles) * p.g[kind].n_tiles;
}

template <bool kPaired, bool kFp8>
__device__ __forceinline__ int num_tasks(const Params& p, int chunks) {
  const int shared = shared_units<kPaired, kFp8>(p, kSharedUp) + shared_units<kPaired, kFp8>(p, kSharedDown);
  if (chunks == 0) return shared;
  const int nb = (chunks + p.mb_chunks - 1) / p.mb_chunks, last = chunks - (nb - 1) * p.mb_chunks;
  const int per_mb = routed_units<kPaired>(p, kRoutedUp, p.mb_chunks) + routed_units<kPaired>(p, kRoutedDown, p.mb_chunks);
  return shared + (nb - 1) * per_mb + routed_units<kPaired>(p, kRoutedUp, last) +
         routed_units<kPaired>(p, kRoutedDown, last);
}

// Task t (< num_tasks) of the list in the header comment. Shared kinds: m is the m-tile or (paired)
// the pair, n the n-tile; fp8: n is the task (block-major over the chunks). Routed kinds: m is the
// minibatch, n the unit inside the kind's part of it.
template <bool kPaired, bool kFp8>
__device__ __forceinline__ Task decode(const Params& p, int t, int chunks) {
  const int s1 = shared_units<kPaired, kFp8>(p, kSharedUp), s2 = shared_units<kPaired, kFp8>(p, kSharedDown);
  if (t < s1) return kFp8 ? Task{kSharedUp, 0, t} : Task{kSharedUp, t / p.g[kSharedUp].n_tiles, t % p.g[kSharedUp].n_tiles};
  t -= s1;
  if (t < s2)
    return kFp8 ? Task{kSharedDown, 0, t}
                : Task{kSharedDown, t / p.g[kSharedDown].n_tiles, t % p.g[kSharedDown].n_tiles};
  t -= s2;
  const int per_mb = routed_units<kPaired>(p, kRoutedUp, p.mb_chunks) + routed_units<kPaired>(p, kRoutedDown, p.mb_chunks);
  const int b = t / per_mb;  // every minibatch before the last is full
  const int r = t - b * per_mb;
  const int u1 = routed_units<kPaired>(p, kRoutedUp, min(p.mb_chunks, chunks - b * p.mb_chunks));
  return r < u1 ? Task{kRoutedUp, b, r} : Task{kRoutedDown, b, r - u1};
}

// Timeline (rec non-null): the task's dependencies are met; where and what it is.
__device__ __forceinline__ void stamp_ready(long long* rec, int kind, int m_unit, int n_tile) {
  if (rec == nullptr) return;
  rec[kReadyNs] = static_cast<long long>(globaltimer_ns());
  rec[kSm] = smid();
  rec[kKind] = kind;
  rec[kMUnit] = m_unit;
  rec[kNTile] = n_tile;
}

// fp8: the shared expert's task of shared unit tk (block-major: task n is block n / chunks, chunk
// n % chunks).
__device__ __forceinline__ xgemm::Task shared_task(const Params& p, const Task& tk) {
  const int ch = p.shared_chunks;
  return xgemm::make_task(p.xs[tk.kind], 0, tk.n / ch, tk.n % ch, ch);
}

// The expert task of CTA `rank` in routed unit tk (kind, minibatch, unit); false: none (the idle
// half of an incomplete pair). *chunk: its global chunk index.
template <bool kPaired>
__device__ __forceinline__ bool routed_task(const Params& p, const int* prefix, const Task& tk, int rank,
                                            xgemm::Task* out, int* chunk) {
  const xgemm::Params& xg = p.xg[tk.kind - kRoutedUp];
  const int g0 = tk.m * p.mb_chunks;
  const int count = min(p.mb_chunks, prefix[p.nle] - g0);
  const int i = kPaired ? 2 * tk.n + rank : tk.n;
  if (i >= xg.n_blocks * count) return false;
  *out = xgemm::decode_window(xg, prefix, g0, count, i, chunk);
  return true;
}

// ---- comm role: pull-dispatch -------------------------------------------------------------------

// Warp-granular units of kUnitRows rows, in increasing order over all dispatching warps, so the
// first m-tiles become ready first. Padding rows (src < 0) are zero-filled, as in dispatch.cu.
// fp8: e4m3 rows, and each row's H / 128 scales into column `row` of x8_scale (padding rows: 0).
template <bool kFp8>
__device__ void dispatch_rows(const Params& p, int role) {
  const int rows = routed_rows(p);
  const int units = rows / kUnitRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row_bytes = kFp8 ? p.H : 2 * p.H;
  const int n16 = row_bytes / 16;
  uint8_t* x_dst = kFp8 ? p.x8_routed : reinterpret_cast<uint8_t*>(p.x_routed);
  for (int u = role * kWarps + warp; u < units; u += p.num_comm * kWarps) {
    const int row0 = u * kUnitRows;
    int my_src = -1, my_tok = 0;
    if (lane < kUnitRows) {
      my_src = p.row_src_rank[row0 + lane];
      if (my_src >= 0) my_tok = p.row_src_slot[row0 + lane] / p.k;
    }
    for (int i = 0; i < kUnitRows; ++i) {
      const int src = __shfl_sync(0xffffffffu, my_src, i);
      const int tok = __shfl_sync(0xffffffffu, my_tok, i);
      uint4* dst = reinterpret_cast<uint4*>(x_dst + static_cast<int64_t>(row0 + i) * row_bytes);
      if (src < 0) {
        for (int c = lane; c < n16; c += 32) st16(dst + c, make_uint4(0, 0, 0, 0));
      } else {
        const uint4* s =
            reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(p.x_bufs.p[src]) + static_cast<int64_t>(tok) * row_bytes);
        warp_copy_row<kCopyUnroll>(dst, s, n16, lane);
      }
      if constexpr (kFp8) {
        const float* s = src < 0 ? nullptr : static_cast<const float*>(p.xs_bufs.p[src]) + static_cast<int64_t>(tok) * p.xs_pitch;
        for (int kb = lane; kb < p.H / 128; kb += 32)
          p.x8_scale[static_cast<int64_t>(kb) * p.capacity + row0 + i] = s == nullptr ? 0.f : s[kb];
      }
    }
    // TMA (async proxy) of other CTAs reads these rows once the counter says so.
    fence_proxy_async_global();
    __threadfence();
    __syncwarp();
    if (lane == 0) red_release_gpu_add(ready_ctr(p, u / kUnitsPerTile), 1);
  }
}

// ---- GEMM roles -----------------------------------------------------------------------------------

template <bool kPaired, bool kFp8, class Ring>
__device__ void producer(const Params& p, const TMaps& tm, const gemm::Smem& sm, const Ring& ring,
                         const int* prefix, volatile int* stage_task, const Mailbox& mb) {
  const Watchdog w = watchdog(p);
  const int chunks = prefix[p.nle];
  const int total = num_tasks<kPaired, kFp8>(p, chunks);
  const int rank = kPaired ? static_cast<int>(cluster_ctarank()) : 0;
  uint32_t it = 0;
  for (uint32_t j = 0;; ++j) {
    int t = -1;
    if (rank == 0) {
      if (ld_volatile(w.abort) == 0) t = atomicAdd(p.counters + kTicket, 1);  // abort: stop claiming
      if (t >= total) t = -1;
      if constexpr (kPaired) gemm::mailbox_send(mb, j, t);
    } else {
      t = gemm::mailbox_receive<true>(mb, j, &w);
    }
    if (t < 0) break;
    const Task tk = decode<kPaired, kFp8>(p, t, chunks);
    long long* rec = (p.timeline != nullptr && rank == 0 && t < p.timeline_tasks) ? timeline_record(p, t) : nullptr;
    if (rec != nullptr) rec[kClaimNs] = static_cast<long long>(globaltimer_ns());
    if (kFp8 && (tk.kind == kSharedUp || tk.kind == kSharedDown)) {  // expert-major, one segment
      const xgemm::Task xt = shared_task(p, tk);
      const int chunk = tk.n % p.shared_chunks;
      if (tk.kind == kSharedDown) wait_counter(sup_done_ctr(p, chunk), 2 * p.xs[kSharedUp].n_blocks, w);
      stamp_ready(rec, tk.kind, chunk, xt.block);
      if (tk.kind == kSharedUp)
        xgemm::produce_task<true, true>(p.xs[0], &tm.a[kSharedUp], &tm.b[kSharedUp], ring, xt, it, &w, stage_task, t);
      else
        xgemm::produce_task<false, true>(p.xs[1], &tm.a[kSharedDown], &tm.b[kSharedDown], ring, xt, it, &w, stage_task, t);
      continue;
    }
    if (tk.kind == kSharedUp || tk.kind == kSharedDown) {
      const int mt = p.shared_mtiles;
      // both CTAs wait for both m-tiles of a pair (gate/up tiles arrive once per consumer warpgroup)
      if (tk.kind == kSharedDown)
        for (int m = kPaired ? 2 * tk.m : tk.m; m <= (kPaired ? min(2 * tk.m + 1, mt - 1) : tk.m); ++m)
          wait_counter(sup_done_ctr(p, m), 2 * p.g[kSharedUp].n_tiles, w);
      stamp_ready(rec, tk.kind, tk.m, tk.n);
      const gemm::Params& g = p.g[tk.kind];
      // paired, odd m-tile count: the second CTA of the last pair loads a valid block but computes nothing
      const int m = kPaired ? min(2 * tk.m + rank, mt - 1) : tk.m;
      const bool pair_complete = 2 * tk.m + 1 < mt;
      const int tile = m * g.n_tiles + tk.n;
      if (tk.kind == kSharedUp)
        gemm::produce_tile<true, true, kPaired>(g, &tm.a[tk.kind], &tm.b[tk.kind], sm, tile, it, &w, stage_task, t,
                                                pair_complete);
      else
        gemm::produce_tile<false, true, kPaired>(g, &tm.a[tk.kind], &tm.b[tk.kind], sm, tile, it, &w, stage_task, t,
                                                 pair_complete);
      continue;
    }
    // routed: this CTA's expert task; the idle half of an incomplete pair loads its partner's blocks
    xgemm::Task xt;
    int chunk = 0;
    const bool own = routed_task<kPaired>(p, prefix, tk, rank, &xt, &chunk);
    if (!own) routed_task<kPaired>(p, prefix, tk, 0, &xt, &chunk);
    const xgemm::Params& xg = p.xg[tk.kind - kRoutedUp];
    if (own) {
      if (tk.kind == kRoutedUp) {  // the chunk's rows dispatched (all 128-row m-tiles they touch)
        for (int m = xt.row0 / BM; m <= (xt.row0 + xt.n_tok - 1) / BM; ++m)
          wait_counter(ready_ctr(p, m), kUnitsPerTile, w);
      } else {  // the chunk's act rows: every gate/up block, once per consumer warpgroup (fp8: every
                // quantized 128-column block)
        wait_counter(up_done_ctr(p, chunk), kFp8 ? p.act_kb : 2 * p.xg[0].n_blocks, w);
      }
    }
    stamp_ready(rec, tk.kind, chunk, xt.block);
    if constexpr (kFp8) {
      const CUtensorMap* tmR = &tm.r[tk.kind - kRoutedUp];
      if (tk.kind == kRoutedUp)
        xgemm8::produce_task<true, true>(xg, &tm.a[tk.kind], &tm.b[tk.kind], tmR, ring, xt, it, &w, stage_task, t);
      else
        xgemm8::produce_task<false, true>(xg, &tm.a[tk.kind], &tm.b[tk.kind], tmR, ring, xt, it, &w, stage_task, t);
    } else if (tk.kind == kRoutedUp) {
      xgemm::produce_task<true, true>(xg, &tm.a[tk.kind], &tm.b[tk.kind], ring, xt, it, &w, stage_task, t);
    } else {
      xgemm::produce_task<false, true>(xg, &tm.a[tk.kind], &tm.b[tk.kind], ring, xt, it, &w, stage_task, t);
    }
  }
  gemm::arm_stop_stage<true>(ring, it, stage_task + it % Ring::kStages, &w);
}

// One consumer warpgroup. The two warpgroups of a CTA never wait for each other (separate named
// barriers, separate counter arrivals, separate sentinels), so a watchdog exit of one cannot strand
// the other; inside a warpgroup every barrier is reached by all 128 threads in the same order.
// fp8, after a gate/up task's epilogue: its warpgroup wrote 32 columns of the chunk's act block
// kb = block / 2; the fourth of the block's writers quantizes it (rows [row0, row0 + n_tok), whole
// 128-column blocks, a half warp per row as quantize_rows_e4m3) and arrives on up_done[chunk].
__device__ void quantize_act_block(const Params& p, const xgemm::Task& xt, int chunk, int bar, bool leader,
                                   volatile int* s_last) {
  const int kb = xt.block / 2;
  __threadfence();  // this warpgroup's act columns, before its arrival
  warpgroup_bar_sync(bar);
  if (leader) *s_last = atom_add_acq_rel_gpu(kb_done_ctr(p, chunk, kb), 1) == 3;
  warpgroup_bar_sync(bar);
  const bool last = *s_last != 0;
  warpgroup_bar_sync(bar);  // s_last read by all before the warpgroup's next task may rewrite it
  if (!last) return;
  __threadfence();
  const int t = threadIdx.x % 128, hw = t / 16, lane = t % 16;
  const int rows = min(xt.n_tok, p.capacity - xt.row0);
  const int I = p.xg[0].N;
  const int64_t col = 128 * kb + 8 * lane;
  constexpr int kBatch = 4;  // rows a half warp has in flight (8 makes the consumers spill)
  for (int r0 = 0; r0 < rows; r0 += 8 * kBatch) {  // warp-uniform trip count: the shuffles span the warp
    uint4 raw[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int r = r0 + hw + 8 * u;
      raw[u] = r < rows ? __ldcg(reinterpret_cast<const uint4*>(p.xg[0].out + (int64_t)(xt.row0 + r) * I + col))
                        : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int r = r0 + hw + 8 * u, row = xt.row0 + r;
      float v[8];
      unpack8(raw[u], v);
      const float amax = e4m3::half_warp_amax(v);
      if (r < rows)
        e4m3::store_half_warp_block(v, amax, p.act8 + (int64_t)row * I + col,
                                    p.act8_scale + (int64_t)kb * p.capacity + row, lane);
    }
  }
  fence_proxy_async_global();  // the down tasks read act8 and its scales through TMA
  __threadfence();
  warpgroup_bar_sync(bar);
  if (leader) red_release_gpu_add(up_done_ctr(p, chunk), 1);
}

template <bool kPaired, bool kFp8, class Ring>
__device__ void consumer(const Params& p, const gemm::Smem& sm, const Ring& ring, const int* prefix,
                         const volatile int* stage_task, int cw, volatile int* s_misc, const PushQueue& q,
                         volatile int* s_last) {
  const Watchdog w = watchdog(p);
  const int bar = 2 + cw;
  const bool leader = threadIdx.x % 128 == 0;
  const int chunks = prefix[p.nle];
  const int rank = kPaired ? static_cast<int>(cluster_ctarank()) : 0;
  float acc[128];
  uint32_t it = 0;
  for (;;) {
    const int s = it % Ring::kStages;
    const bool ok = gemm::ring_wait<true>(ring.full(s), (it / Ring::kStages) & 1, &w);
    if (warpgroup_bar_or(bar, !ok || ld_volatile(w.abort) != 0)) break;  // watchdog: stop (uniformly)
    const int t = stage_task[s];
    if (t < 0) break;
    long long* rec = (p.timeline != nullptr && rank == 0 && cw == 0 && leader && t < p.timeline_tasks)
                         ? timeline_record(p, t) : nullptr;
    if (rec != nullptr) rec[kStartNs] = static_cast<long long>(globaltimer_ns());
    const Task tk = decode<kPaired, kFp8>(p, t, chunks);
    if (kFp8 && (tk.kind == kSharedUp || tk.kind == kSharedDown)) {
      const xgemm::Params& xg = p.xs[tk.kind];
      xgemm::Task xt = shared_task(p, tk);
      xgemm::mma_task_any<true, false, false, xgemm8::kMaxTok / xgemm::kTokAlign>(xg, ring, cw, acc, it, xt.n_tok, &w);
      xt = shared_task(p, tk);  // decoded again: keeping the task live through the main loop costs registers
      if (tk.kind == kSharedUp) {
        xgemm::store_task<true, xgemm8::kMaxTok>(xg, ring, xt, cw, acc);
        // The shared down tasks of this chunk read these rows through TMA in other CTAs.
        fence_proxy_async_global();
        __threadfence();
        warpgroup_bar_sync(bar);
        if (leader) red_release_gpu_add(sup_done_ctr(p, tk.n % p.shared_chunks), 1);
      } else {
        xgemm::store_task<false, xgemm8::kMaxTok>(xg, ring, xt, cw, acc);
      }
    } else if (tk.kind == kSharedUp || tk.kind == kSharedDown) {
      if constexpr (!kFp8) {  // (no 256-wide bf16 wgmma in the fp8 instance, see the header)
        const gemm::Params& g = p.g[tk.kind];
        const int mt = p.shared_mtiles;
        const int m = kPaired ? 2 * tk.m + rank : tk.m;
        const bool own = m < mt;  // paired, odd m-tile count: the last pair has one tile
        const int tile = min(m, mt - 1) * g.n_tiles + tk.n;
        const bool active = own && gemm::half_active(g, tile, cw);
        gemm::mma_tile<true, kPaired>(g, sm, cw, acc, it, active, &w);
        if (!own) continue;
        const int row_limit = gemm::rows_total(g);
        if (tk.kind == kSharedUp) {
          gemm::store_tile<true>(g, tile, cw, acc, row_limit, active);
          // The down tiles of this m-tile read these rows through TMA in other CTAs.
          fence_proxy_async_global();
          __threadfence();
          warpgroup_bar_sync(bar);
          if (leader) red_release_gpu_add(sup_done_ctr(p, m), 1);
        } else {
          gemm::store_tile<false>(g, tile, cw, acc, row_limit, active);
        }
      }
    } else {
      xgemm::Task xt;
      int chunk = 0;
      const xgemm::Params& xg = p.xg[tk.kind - kRoutedUp];
      if (!routed_task<kPaired>(p, prefix, tk, rank, &xt, &chunk)) {
        xgemm::skip_task<true, kPaired>(xg, ring, it, &w);
        continue;
      }
      constexpr int kTok = kFp8 ? xgemm8::kMaxTok : xgemm::kMaxTok;
      constexpr int kAccOff = kFp8 ? xgemm8::kAcc : 0;  // where the e4m3 MMA leaves its result
      if constexpr (kFp8) {
        const int nk = xgemm8::k_blocks(xg.K);
        const float* ws = p.w_scale[tk.kind - kRoutedUp] + ((int64_t)xt.seg * xg.n_blocks + xt.block) * nk;
        xgemm8::mma_task_any(xg, ring, cw, acc, it, xt.n_tok, ws);
      } else {
        xgemm::mma_task_any<true, kPaired>(xg, ring, cw, acc, it, xt.n_tok, &w);
      }
      // decoded again: keeping the task live through the main loop costs registers
      routed_task<kPaired>(p, prefix, tk, rank, &xt, &chunk);
      if (tk.kind == kRoutedUp) {
        xgemm::store_task<true, kTok, kAccOff>(xg, ring, xt, cw, acc);
        if constexpr (kFp8) {
          quantize_act_block(p, xt, chunk, bar, leader, s_last + cw);
        } else {
          // The down tasks of this chunk read these rows through TMA in other CTAs.
          fence_proxy_async_global();
          __threadfence();
          warpgroup_bar_sync(bar);
          if (leader) red_release_gpu_add(up_done_ctr(p, chunk), 1);
        }
      } else {
        xgemm::store_task<false, kTok, kAccOff>(xg, ring, xt, cw, acc);
        __threadfence_block();    // the pushers (other warps of this CTA) read these rows of y
        warpgroup_bar_sync(bar);  // the warpgroup's columns of y are written
        if (leader && xt.n_real > 0)
          push_enqueue(q, make_int4(xt.row0, xt.n_real, xt.block * xgemm::WM + cw * 64, 0), w);
      }
    }
    if (rec != nullptr) rec[kEndNs] = static_cast<long long>(globaltimer_ns());
  }

  persistent::consumer_done(q, s_misc, p.timeout_ns, leader, w);
}

template <bool kPaired, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    megakernel(const __grid_constant__ TMaps tm, const __grid_constant__ Params p) {
  static_assert(!(kPaired && kFp8), "the fp8 megakernel runs unpaired");
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ int chunk_prefix[xgemm::kMaxSeg + 1];  // routed token chunks of the experts before e
  __shared__ int s_last[2];                         // fp8: a consumer warpgroup quantizes the act block
  const gemm::Smem sm = gemm::carve_smem(smem_raw);
  volatile int* stage_task = reinterpret_cast<volatile int*>(sm.empty + kStages);  // [kStages] (fp8: the ring's)
  volatile int* s_misc = reinterpret_cast<volatile int*>(sm.empty + kStages) + kStages;  // [0] role,
                                                                      // [1] producer done, [2 + cw] last party
  const Mailbox mb{s_misc + 4, reinterpret_cast<uint64_t*>(const_cast<int*>(s_misc + 4 + kMailbox))};
  uint64_t* push_bars = mb.full + kMailbox;  // full [kPushSlots], empty [kPushSlots]
  const PushQueue q{reinterpret_cast<volatile int4*>(push_bars + 2 * kPushSlots), push_bars, push_bars + kPushSlots,
                    const_cast<int*>(s_misc + 3)};
  __nv_bfloat16* staging = reinterpret_cast<__nv_bfloat16*>(const_cast<int4*>(q.req + kPushSlots));
  using Ring = std::conditional_t<kFp8, E4M3Ring, ExpertRing>;
  const Ring ring = [&] {
    if constexpr (kFp8) {  // the tail after the staging tiles, 128-aligned
      const uintptr_t end = reinterpret_cast<uintptr_t>(staging) + 2 * xgemm::kStageBytesPerWG;
      return E4M3Ring{sm.base, reinterpret_cast<uint8_t*>((end + 127) & ~uintptr_t(127)), staging};
    } else {
      return ExpertRing{sm, staging};
    }
  }();
  if constexpr (kFp8) stage_task = ring.stage_tags();
  if (threadIdx.x >= 32 && threadIdx.x < 64)
    xgemm::build_chunk_prefix<kFp8 ? xgemm8::kMaxTok : xgemm::kMaxTok>(p.xg[0], chunk_prefix);
  const int rank = kPaired ? static_cast<int>(cluster_ctarank()) : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < Ring::kStages; ++s) {
      mbar_init(ring.full(s), 1);
      mbar_init(ring.empty(s), gemm::empty_arrivals(kPaired));
    }
    gemm::init_mailbox(mb);
    persistent::init_push_queue(q);
    mbar_fence_init();
    s_misc[1] = 0;
    s_misc[3] = 0;  // push queue tail
    if (rank == 0) {  // one role per cluster: both CTAs of a cluster dispatch, or neither
      const int role = atomicAdd(p.counters + kRole, 1);
      s_misc[0] = role;
      if constexpr (kPaired) st_shared_cluster(s_misc, 1, role);
    }
  }
  // paired: also orders the peer's role store and barrier inits before any remote access
  if constexpr (kPaired) cluster_sync(); else __syncthreads();
  // The first CTAs to start dispatch: they are running, so the GEMM tasks that wait on them cannot
  // starve them of SMs (also when the grid is larger than the GPU).
  const int role = kPaired ? 2 * s_misc[0] + rank : s_misc[0];
  if (role < p.num_comm) {
    persistent::comm_phase(p, role, [&] {
      dispatch_rows<kFp8>(p, role);
      if (p.timeline != nullptr) __syncthreads();  // all of this CTA's rows copied (role is per CTA: all threads)
    });
  }
  persistent::run_roles(
      p, q, s_misc,
      [&] {
        for (int i = p.shared_mtiles > 0 ? 0 : kRoutedUp; i < 4; ++i) {  // shared maps only if used
          tma_prefetch_desc(&tm.a[i]);
          tma_prefetch_desc(&tm.b[i]);
        }
        if constexpr (kFp8) {
          tma_prefetch_desc(&tm.r[0]);
          tma_prefetch_desc(&tm.r[1]);
        }
        producer<kPaired, kFp8>(p, tm, sm, ring, chunk_prefix, stage_task, mb);
      },
      [&](int cw) { consumer<kPaired, kFp8>(p, sm, ring, chunk_prefix, stage_task, cw, s_misc, q, s_last); });
  // paired: no CTA leaves while its peer may still multicast into it or arrive on its barriers
  if constexpr (kPaired) cluster_sync();
}

// + stage tags [kStages], flags [4], mailbox [kMailbox] ints, mailbox barriers [kMailbox], push
// queue barriers [2 kPushSlots] and requests [kPushSlots] (int4), the expert GEMM's epilogue staging
constexpr int kMegaSmemBytes = gemm::kSmemBytes + 4 * (kStages + 4 + kMailbox) + 8 * (kMailbox + 2 * kPushSlots) +
                               16 * kPushSlots + 2 * xgemm::kStageBytesPerWG;
// fp8: + the e4m3 ring's tail (128-aligned)
constexpr int kMegaSmemBytesFp8 = kMegaSmemBytes + 128 + E4M3Ring::kTailBytes;
static_assert(kMegaSmemBytesFp8 + 4 * (xgemm::kMaxSeg + 3) <= 227 * 1024, "shared memory");
static_assert((4 * (kStages + 4 + kMailbox) + 8 * (kMailbox + 2 * kPushSlots)) % 16 == 0,
              "the staging tiles (after the push requests) need 16-byte alignment");
static_assert((kStages + 4 + kMailbox) % 2 == 0, "the mailbox barriers need 8-byte alignment");

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

template <bool kPaired, bool kFp8>
const char* launch(const TMaps& tm, Params p, int num_comm, int num_compute, cudaStream_t stream) {
  cudaLaunchAttribute cluster;
  cudaLaunchConfig_t cfg = launch_config(kThreads, kFp8 ? kMegaSmemBytesFp8 : kMegaSmemBytes, stream, kPaired, &cluster);
  const int at_once = units_at_once(megakernel<kPaired, kFp8>, cfg, kPaired, "mok megakernel");
  if (at_once == 0) return "mok megakernel: cannot raise the shared-memory limit";
  const int per = kPaired ? 2 : 1;  // CTAs per unit
  const int comm_units = ceil_div(num_comm, per);
  const int compute_units = num_compute > 0 ? ceil_div(num_compute, per) : std::max(1, at_once - comm_units);
  p.num_comm = per * comm_units;
  cfg.gridDim = dim3(per * (comm_units + compute_units));
  return launch_ex(cfg, megakernel<kPaired, kFp8>, tm, p);
}

}  // namespace

namespace {
long long* g_timeline = nullptr;  // set_megakernel_timeline
int g_timeline_tasks = 0;
}  // namespace

void set_megakernel_timeline(long long* records, int64_t num_records) {
  g_timeline = records;
  g_timeline_tasks = records != nullptr ? static_cast<int>(std::max<int64_t>(0, num_records - kMaxTimelineRoles)) : 0;
}

long long* megakernel_timeline_records(int* task_records) {
  *task_records = g_timeline_tasks;
  return g_timeline;
}

int64_t megakernel_counter_ints(int capacity, int T, int act_kb) {
  return kHeader + static_cast<int64_t>(capacity / BM) * (2 + act_kb) + ceil_div(T, BM);
}

// MOK_GEMM_SKIP_PAD / MOK_GEMM_PAIRED: as for the staged GEMMs (grouped_gemm.cuh), same bits.
const char* launch_megakernel(const MegaArgs& a, cudaStream_t stream) {
  const bool shared = a.shared_fc1 != nullptr;
  if (a.T <= 0 || a.H <= 0 || a.I <= 0 || (shared && a.Is <= 0)) return "mok megakernel: empty shapes";
  if (a.H % 8 || a.I % 8 || (shared && a.Is % 8)) return "mok megakernel: H, I and Is must be multiples of 8";
  if (a.capacity % BM || a.minibatch_rows <= 0 || a.minibatch_rows % BM)
    return "mok megakernel: capacity and minibatch_rows must be multiples of 128";
  if (a.ep < 1 || a.ep > kMaxPeers || a.rank < 0 || a.rank >= a.ep) return "mok megakernel: bad rank / EP size";
  if (a.num_comm < 1) return "mok megakernel: needs at least one dispatching CTA";
  for (const void* out : {a.act, a.h, a.y_routed, a.shared_act, a.shared_h, a.shared_y})
    if (out != nullptr && !aligned16(out))
      return "mok megakernel: the GEMM outputs must start at 16-byte aligned addresses (16-byte stores)";
  if (g_timeline != nullptr && a.num_comm > kMaxTimelineRoles)
    return "mok megakernel: the timeline records at most 1024 dispatching CTAs";

  TMaps tm;
  memset(&tm, 0, sizeof(tm));
  Params p;
  memset(&p, 0, sizeof(p));
  const int T = a.T, H = a.H, I = a.I, Is = a.Is, cap = a.capacity;
  const bool fp8 = a.fc1_q != nullptr;
  if (shared && fp8) {  // expert-major: a = the weights, b = the token rows
    if (a.shared_seg == nullptr) return "mok megakernel: the fp8 shared expert needs its segment [0, T, T]";
    if (const char* m = make_tmap_gate_up_pairs(&tm.a[kSharedUp], a.shared_fc1, 1, Is, H)) return m;
    if (const char* m = make_tmap_bf16_2d(&tm.b[kSharedUp], a.x, T, H, H, xgemm::kXBox)) return m;
    if (const char* m = make_tmap_bf16_2d(&tm.a[kSharedDown], a.shared_fc2, H, Is, Is, xgemm::WM)) return m;
    if (const char* m = make_tmap_bf16_2d(&tm.b[kSharedDown], a.shared_act, T, Is, Is, xgemm::kXBox)) return m;
    p.xs[0] = xgemm::make_params(a.shared_seg, a.shared_seg + 2, 1, T, H, Is, true, a.shared_act, a.shared_h);
    p.xs[1] = xgemm::make_params(a.shared_seg, a.shared_seg + 2, 1, T, Is, H, false, a.shared_y, nullptr);
    p.shared_chunks = xgemm::chunks_of<xgemm8::kMaxTok>(T);
    p.shared_mtiles = ceil_div(T, BM);
  } else if (shared) {
    if (const char* m = make_tmap_bf16_2d(&tm.a[kSharedUp], a.x, T, H, H, BM)) return m;
    if (const char* m = make_tmap_bf16_2d(&tm.b[kSharedUp], a.shared_fc1, 2 * (uint64_t)Is, H, H, BN / 2)) return m;
    if (const char* m = make_tmap_bf16_2d(&tm.a[kSharedDown], a.shared_act, T, Is, Is, BM)) return m;
    if (const char* m = make_tmap_bf16_2d(&tm.b[kSharedDown], a.shared_fc2, H, Is, Is, BN / 2)) return m;
    p.g[kSharedUp] = gemm::make_params(nullptr, nullptr, 1, T, H, Is, 2 * Is, true, a.shared_act, a.shared_h);
    p.g[kSharedDown] = gemm::make_params(nullptr, nullptr, 1, T, Is, H, H, false, a.shared_y, nullptr);
    p.shared_mtiles = ceil_div(T, BM);
  }
  // routed kinds (expert-major): a = the weights (wgmma's A, M side), b = the token rows (N side)
  if (a.nle > xgemm::kMaxSeg) return "mok megakernel: at most 512 local experts";
  if (fp8) {
    if (H % 128 || I % 128) return "mok megakernel: fp8 needs H and I multiples of 128 (the scale blocks)";
    if (a.fc1_scale == nullptr || a.fc2_q == nullptr || a.fc2_scale == nullptr || a.x8_routed == nullptr ||
        a.x8_scale == nullptr || a.act8 == nullptr || a.act8_scale == nullptr)
      return "mok megakernel: fp8 needs both weights' e4m3 copies and scales, and the e4m3 row buffers";
    if (a.xs_pitch < H / 128) return "mok megakernel: the scale rows' pitch is below H / 128";
    for (const void* b : {static_cast<const void*>(a.x8_routed), static_cast<const void*>(a.act8),
                          static_cast<const void*>(a.x8_scale), static_cast<const void*>(a.act8_scale)})
      if (!aligned16(b)) return "mok megakernel: the e4m3 rows and scales must start at 16-byte aligned addresses";
    if (const char* m = make_tmap_gate_up_pairs_e4m3(&tm.a[kRoutedUp], a.fc1_q, a.nle, I, H)) return m;
    if (const char* m = make_tmap_e4m3_2d(&tm.b[kRoutedUp], a.x8_routed, cap, H, xgemm::kXBox)) return m;
    if (const char* m = make_tmap_f32_rows(&tm.r[0], a.x8_scale, H / 128, cap, cap, xgemm8::kMaxTok)) return m;
    if (const char* m = make_tmap_e4m3_2d(&tm.a[kRoutedDown], a.fc2_q, (uint64_t)a.nle * H, I, xgemm::WM)) return m;
    if (const char* m = make_tmap_e4m3_2d(&tm.b[kRoutedDown], a.act8, cap, I, xgemm::kXBox)) return m;
    if (const char* m = make_tmap_f32_rows(&tm.r[1], a.act8_scale, I / 128, cap, cap, xgemm8::kMaxTok)) return m;
    p.w_scale[0] = a.fc1_scale;
    p.w_scale[1] = a.fc2_scale;
    p.x8_routed = static_cast<uint8_t*>(a.x8_routed);
    p.x8_scale = a.x8_scale;
    p.xs_bufs = a.xs_bufs;
    p.xs_pitch = a.xs_pitch;
    p.act8 = static_cast<uint8_t*>(a.act8);
    p.act8_scale = a.act8_scale;
    p.act_kb = I / 128;
    p.kb_done_base = kHeader + 2 * (cap / BM) + ceil_div(T, BM);
  } else {
    if (const char* m = make_tmap_gate_up_pairs(&tm.a[kRoutedUp], a.fc1, a.nle, I, H)) return m;
    if (const char* m = make_tmap_bf16_2d(&tm.b[kRoutedUp], a.x_routed, cap, H, H, xgemm::kXBox)) return m;
    if (const char* m = make_tmap_bf16_2d(&tm.a[kRoutedDown], a.fc2, (uint64_t)a.nle * H, I, I, xgemm::WM)) return m;
    if (const char* m = make_tmap_bf16_2d(&tm.b[kRoutedDown], a.act, cap, I, I, xgemm::kXBox)) return m;
  }
  p.xg[0] = xgemm::make_params(a.expert_offsets, a.expert_counts, a.nle, cap, H, I, true, a.act, a.h);
  p.xg[1] = xgemm::make_params(a.expert_offsets, a.expert_counts, a.nle, cap, I, H, false, a.y_routed, nullptr);
  p.mb_chunks = std::max(1, a.minibatch_rows / (fp8 ? xgemm8::kMaxTok : xgemm::kMaxTok));
  p.num_comm = a.num_comm;
  p.max_mtiles = cap / BM;
  p.n_counters = static_cast<int>(megakernel_counter_ints(cap, T, fp8 ? I / 128 : 0));
  p.capacity = cap;
  p.nle = a.nle;
  p.H = H;
  p.k = a.k;
  p.rank = a.rank;
  p.ep = a.ep;
  p.row_src_rank = a.row_src_rank;
  p.row_src_slot = a.row_src_slot;
  p.expert_offsets = a.expert_offsets;
  p.x_routed = static_cast<__nv_bfloat16*>(a.x_routed);
  p.counters = a.counters;
  p.state = a.state;
  p.errors = a.errors;
  p.timeout_ns = a.timeout_ns;
  p.x_bufs = a.x_bufs;
  p.comb_bufs = a.comb_bufs;
  p.flags = a.flags;
  p.timeline = g_timeline;
  p.timeline_tasks = g_timeline_tasks;
  // unpaired by default: a cluster's rings advance in lockstep, and for two different expert tasks
  // that costs more (6-7%, device call 3) than the shared expert's multicast saves
  if (fp8) return launch<false, true>(tm, p, a.num_comm, a.num_compute, stream);  // MOK_GEMM_PAIRED: bf16 only
  return gemm::pairing_enabled(false) ? launch<true, false>(tm, p, a.num_comm, a.num_compute, stream)
                : launch<false, false>(tm, p, a.num_comm, a.num_compute, stream);
}

}  // namespace mok
