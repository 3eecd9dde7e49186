// The persistent backward megakernel (issue #4): one launch per layer backward, between the
// opening barrier (bwd_publish: grad_out and probs in this rank's symmetric buffers) and the
// epilogue (bwd_epilogue with wait_flags closes the barrier this kernel opens at its end).
//
// The CTA layout is the forward megakernel's (megakernel.cu, persistent.cuh): 1 producer thread,
// 2 consumer warpgroups on a 4-stage TMA ring, 3 pusher warps. The first `num_comm` CTAs to start
// first pull with all 384 threads (bwd_pull.cuh, the bits of bwd_pull): every routed row reads its
// grad_out row and router weight from the source rank, writes dy = bf16(w * g) and stores the
// router-weight gradient <g, y_routed> into the source rank's slot; then they compute too.
//
// GEMM work is one fixed linear list of tickets, identical on every rank. Each ticket is a task
// (or a group of weight-gradient tasks of one expert) of the staged backward's kernels
// (expert_gemm.cuh kWMN dgrads, expert_wgrad.cuh), with their K order and epilogue values, so the
// bits are the staged path's for every num_comm, grid size, minibatch and tuning switch:
//
//   [shared dgrad down]  dhs = SwiGLU'(shared_h, g @ shared_fc2)       waits on nothing
//   [shared wgrad down]  dsfc2 = g^T @ shared_act                      nothing
//   [shared dgrad up]    shared dx = dhs @ shared_fc1                  sdh_done[chunk]
//   [shared wgrad up]    dsfc1 = dhs^T @ x                             sdh_done[every chunk]
//   phase ph = 0 .. nb + lag, two parts merged evenly (decode; MOK_BWD_INTERLEAVE = lag, 0: off):
//     A: minibatch ph's routed dgrads (token chunks [ph mb, (ph + 1) mb)):
//        [dgrad down]    dh = SwiGLU'(h, dy @ fc2[e])                  ready[m]: the chunk's dy rows
//        [dgrad up]      dx rows = dh @ fc1[e], pushed to the sources  dh_done[chunk]
//     B: the weight gradients of the experts whose chunks all lie in minibatches <= ph - lag:
//        [wgrad down]    dfc2[e] = dy^T @ act                          ready[m]: e's dy rows
//        [wgrad up]      dfc1[e] = dh^T @ x_routed                     dh_done[e's chunks]
//
// The shared expert's work fills the SMs while the pull is on NVLink. Merging the weight gradients
// (bound by their HBM stores: ~11 GB of bf16 dW at DeepSeek-V3 EP=2) with the next minibatch's
// dgrads (bound by the tensor cores) keeps both busy; the last phases' weight gradients hide the
// pushes of the last dx rows. A task waits only on earlier tickets or on the pull (which waits on
// nothing), and producers claim tickets in order, so no grid size can deadlock.
// Counters (local, ld.acquire.gpu / red.release.gpu):
//   ready[m]     pull units (8 rows, one warp) of 128-row block m written      (target 16)
//   dh_done[g]   dgrad-down task halves of routed chunk g written (dh rows)    (target 2 n_blocks)
//   sdh_done[g]  shared dgrad-down task halves of shared chunk g written       (target 2 n_blocks)
// The dgrad-up epilogue queues its dx rows for the pusher warps (persistent.cuh), which store them
// into slot row_src_slot of the source rank's symmetric [T * k, H] buffer.
//
// Switches read per launch (same bits): MOK_BWD_STAGES (4 with two TMA-store boxes per warpgroup,
// or 3 with four: measured 2% slower), MOK_BWD_WGRAD_GROUP (8), MOK_WGRAD_TMA_STORE (1),
// MOK_BWD_INTERLEAVE (0: every routed weight gradient after the last minibatch; lag >= 1: merged).
//
// Unpaired only (the forward measured 2-CTA clusters slower for expert tasks). Every wait has a
// watchdog; the last CTA zeroes the counters (CUDA-graph replays start from zero) and opens the
// closing barrier.
#include <stdlib.h>

#include "bwd_pull.cuh"
#include "expert_wgrad.cuh"
#include "persistent.cuh"

namespace mok {
namespace {

using gemm::BM;
using gemm::kThreads;
using persistent::kHeader;
using persistent::kPushSlots;
using persistent::kRole;
using persistent::kTicket;
using persistent::PushQueue;
using persistent::wait_counter;
using persistent::watchdog;
using persistent::timeline_record;
using persistent::kMaxTimelineRoles;
using namespace persistent::timeline;

using persistent::kWarps;
using persistent::kUnitRows;  // rows a pulling warp writes before it signals
using persistent::kUnitsPerTile;

constexpr int kMiscInts = 8;  // the CTA's shared flags (s_misc)

enum Kind : int {
  kSharedDgradDown = 0,
  kSharedWgradDown,
  kDgradDown,
  kDgradUp,
  kSharedDgradUp,
  kSharedWgradUp,
  kWgradDown,
  kWgradUp,
  kKinds
};

__device__ __forceinline__ bool is_wgrad(int kind) {
  return kind == kSharedWgradDown || kind == kSharedWgradUp || kind == kWgradDown || kind == kWgradUp;
}

__host__ __device__ __forceinline__ int wgrad_index(int kind) {  // TMaps::out
  return kind == kSharedWgradDown ? 0 : kind == kSharedWgradUp ? 1 : kind == kWgradDown ? 2 : 3;
}

struct TMaps {
  CUtensorMap a[kKinds];  // dgrads: the weights (MN-major A); wgrads: A
  CUtensorMap b[kKinds];  // dgrads: the token rows; wgrads: B
  CUtensorMap out[4];     // wgrads: dW as [nseg][M][N] (TMA stores), by wgrad_index
};

// Shared memory (dynamic, 1024-aligned: the kernel's only static shared memory is chunk_prefix,
// exactly 2 KB): the kS-stage ring, then per consumer warpgroup the TMA-store boxes of the weight
// gradients (the dgrad epilogues use them as their staging tile once TMA has read them), then the
// barriers, tags, flags and the push queue. kS = 3 leaves room for four boxes (a warpgroup's whole
// 64 x 256 half of a weight-gradient tile, the standalone kernel's layout), kS = 4 for two, and
// then no room for the usual alignment slack either.
constexpr int kMaxPrefix = 512;  // chunk_prefix entries: at most 511 local experts

template <int kS>
struct BwdRing {
  static constexpr int kStages = kS;
  static constexpr int kBoxes = kS == 3 ? 4 : 2;
  static constexpr int kOutPerWG = kBoxes * xwgrad::kBoxBytes;
  static constexpr int kRingBytes = kS * gemm::kStageBytes;
  static constexpr int kOffBars = kRingBytes + 2 * kOutPerWG;
  static constexpr int kOffTags = kOffBars + 16 * kS;
  static constexpr int kOffMisc = kOffTags + 4 * kS;
  static constexpr int kOffPushBars = (kOffMisc + 4 * kMiscInts + 15) / 16 * 16;
  static constexpr int kOffPushReqs = kOffPushBars + 16 * kPushSlots;
  static constexpr int kBytes = kOffPushReqs + 16 * kPushSlots;
  static_assert(xgemm::kStageBytesPerWG <= kOutPerWG, "the dgrad staging tile lives in the boxes");
  static_assert(kBytes + 4 * kMaxPrefix <= 227 * 1024, "shared memory");

  uint8_t* base;
  __device__ __forceinline__ uint8_t* w(int s) const { return base + s * gemm::kABytes; }
  __device__ __forceinline__ uint8_t* x(int s) const { return base + kS * gemm::kABytes + s * gemm::kBBytes; }
  __device__ __forceinline__ uint64_t* full(int s) const { return reinterpret_cast<uint64_t*>(base + kOffBars) + s; }
  __device__ __forceinline__ uint64_t* empty(int s) const { return full(kS + s); }
  __device__ __forceinline__ uint8_t* out(int cw) const { return base + kRingBytes + cw * kOutPerWG; }
  __device__ __forceinline__ __nv_bfloat16* staging(int cw) const { return reinterpret_cast<__nv_bfloat16*>(out(cw)); }
  __device__ __forceinline__ volatile int* stage_tags() const {
    return reinterpret_cast<volatile int*>(base + kOffTags);
  }
  // [0] role, [1] producer done, [2] last party, [3] push tail, [4] task count
  __device__ __forceinline__ volatile int* misc() const { return reinterpret_cast<volatile int*>(base + kOffMisc); }
  __device__ __forceinline__ PushQueue push_queue() const {
    uint64_t* bars = reinterpret_cast<uint64_t*>(base + kOffPushBars);
    return PushQueue{reinterpret_cast<volatile int4*>(base + kOffPushReqs), bars, bars + kPushSlots,
                     const_cast<int*>(misc() + 3)};
  }
};

struct Params {
  xgemm::Params xg[2];    // routed dgrads: [0] down (dy @ fc2[e] -> dh), [1] up (dh @ fc1[e] -> dx rows, pushed)
  xgemm::Params sg[2];    // shared dgrads: [0] down (g @ shared_fc2 -> dhs), [1] up (dhs @ shared_fc1 -> shared dx)
  xwgrad::Params wg[2];   // routed: [0] dfc2 = dy^T act, [1] dfc1 = dh^T x_routed
  xwgrad::Params swg[2];  // shared: [0] dsfc2 = g^T shared_act, [1] dsfc1 = dhs^T x
  const __nv_bfloat16* h;         // [capacity, 2I] forward gate/up pre-activations
  const __nv_bfloat16* shared_h;  // [T, 2Is]
  int shared;                     // 1: the layer has a shared expert
  int shared_chunks;              // token chunks of the shared expert's dgrads
  int mb_chunks;                  // routed token chunks per minibatch
  int wgrad_gsize[4];             // weight-gradient tasks per ticket, by wgrad_index (routed: MOK_BWD_WGRAD_GROUP)
  int wgrad_gpe[4];               // weight-gradient tickets per expert, by wgrad_index
  int shared_tickets[kKinds];     // tickets of each shared kind (0: no shared expert, or routed kinds)
  int shared_ticket_total;
  int interleave;                 // lag >= 1: weight gradients merged with the dgrads that many minibatches on
  int wgrad_tma_store;            // 1: the weight gradients leave through TMA stores, else from the consumers
  int num_comm;
  int max_mtiles;                 // capacity / BM
  int n_counters;
  int capacity, nle, H, k, rank, ep;
  const int* row_src_rank;
  const int* row_src_slot;
  const int* expert_offsets;
  const __nv_bfloat16* y_routed;
  __nv_bfloat16* dy;
  int* counters;
  int* state;
  int* errors;
  uint64_t timeout_ns;
  PeerPtrs g_bufs;     // symmetric grad_out [T, H] of every rank
  PeerPtrs p_bufs;     // symmetric probs [T * k]
  PeerPtrs dw_bufs;    // symmetric router-weight gradients [T * k]
  PeerPtrs comb_bufs;  // symmetric dx slots [T * k, H] (persistent.cuh pushes xg[1].out into them)
  PeerPtrs flags;
  long long* timeline;  // null, or kTimelineFields int64 per ticket, then per pulling CTA (profiling)
  int timeline_tasks;   // ticket records in timeline (tickets past it are not recorded)
};

struct Task {
  int kind, m, n;  // routed dgrads: minibatch, task in it; wgrads: group; shared dgrads: task index
};

// Weight-gradient tasks (expert_wgrad.cuh order: expert, then row block, then column block) go in
// groups of up to MOK_BWD_WGRAD_GROUP consecutive tasks of one routed expert per ticket: such a
// task is short (K = the expert's rows, ~4 stages at 256 rows), and a ticket costs an atomic and
// the dependency checks. The shared expert's (K = T) go one per ticket.
struct WgradGroup {
  int first, count;  // tasks [first, first + count) of the kind, all of one expert
};

__device__ __forceinline__ int group_size(const Params& p, int kind) { return p.wgrad_gsize[wgrad_index(kind)]; }

__device__ __forceinline__ int groups_per_expert(const Params& p, int kind) { return p.wgrad_gpe[wgrad_index(kind)]; }

__device__ __forceinline__ WgradGroup wgrad_group_of(const Params& p, int kind, const xwgrad::Params& wp, int u) {
  const int per = wp.m_blocks * wp.n_blocks, gpe = groups_per_expert(p, kind), g = group_size(p, kind);
  const int e = u / gpe, j = (u % gpe) * g;
  return WgradGroup{e * per + j, min(g, per - j)};
}

__device__ __forceinline__ int* ready_ctr(const Params& p, int m) { return p.counters + kHeader + m; }
__device__ __forceinline__ int* dh_done_ctr(const Params& p, int g) { return p.counters + kHeader + p.max_mtiles + g; }
__device__ __forceinline__ int* sdh_done_ctr(const Params& p, int g) {
  return p.counters + kHeader + 2 * p.max_mtiles + g;
}

__device__ __forceinline__ int routed_rows(const Params& p) { return min(p.expert_offsets[p.nle], p.capacity); }

__device__ __forceinline__ const xgemm::Params& dgrad_params(const Params& p, int kind) {
  return kind == kDgradDown ? p.xg[0] : kind == kDgradUp ? p.xg[1] : kind == kSharedDgradDown ? p.sg[0] : p.sg[1];
}

__device__ __forceinline__ const xwgrad::Params& wgrad_params(const Params& p, int kind) {
  return kind == kWgradDown ? p.wg[0] : kind == kWgradUp ? p.wg[1] : kind == kSharedWgradDown ? p.swg[0] : p.swg[1];
}

__device__ __forceinline__ bool is_shared(int kind) {
  return kind == kSharedDgradDown || kind == kSharedWgradDown || kind == kSharedDgradUp || kind == kSharedWgradUp;
}

// Tickets of a shared kind (host-computed: the divisions cost the producer's registers).
__device__ __forceinline__ int shared_tickets(const Params& p, int kind) { return p.shared_tickets[kind]; }

// Routed weight-gradient tickets of one expert: its dfc2 groups, then its dfc1 groups.
__device__ __forceinline__ int wgrad_tickets_per_expert(const Params& p) {
  return groups_per_expert(p, kWgradDown) + groups_per_expert(p, kWgradUp);
}

__device__ __forceinline__ int num_tasks(const Params& p, int chunks) {
  return p.shared_ticket_total + chunks * (p.xg[0].n_blocks + p.xg[1].n_blocks) + p.nle * wgrad_tickets_per_expert(p);
}

// True when t is below n (a task of that part of the list); else t moves past the part.
__device__ __forceinline__ bool within(int& t, int n) {
  if (t < n) return true;
  t -= n;
  return false;
}

// Experts whose routed weight gradients may run once the dgrads of minibatches <= q are listed: all
// their chunks lie in those minibatches (interleave), or none before the last minibatch (the
// weight gradients all at the end). Experts come in chunk order, so these are a prefix of them.
__device__ __forceinline__ int experts_done_by(const Params& p, const int* prefix, int q, int nb) {
  if (q >= nb - 1) return p.nle;
  if (q < 0 || !p.interleave) return 0;
  const int bound = (q + 1) * p.mb_chunks;
  int lo = 0, hi = p.nle;  // first e with prefix[e + 1] > bound
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (prefix[mid + 1] <= bound) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Task t (< num_tasks) of the list in the header comment. Phase ph (0 .. nb + lag) merges the
// dgrad tasks of minibatch ph (A, in their order: down, then up) with the weight-gradient tickets
// of the experts done by minibatch ph - lag (B; lag = the interleave switch, >= 1), spread evenly:
// ticket i of the phase is B's number floor(i nB / n) when that count steps at i, else A's number
// i - floor(i nB / n). Every ticket still waits only on earlier ones; a lag of 2 leaves a phase
// between the dgrads and the weight gradients that wait on them.
__device__ __forceinline__ Task decode(const Params& p, const int* prefix, int t, int chunks) {
  if (within(t, shared_tickets(p, kSharedDgradDown))) return Task{kSharedDgradDown, 0, t};
  if (within(t, shared_tickets(p, kSharedWgradDown))) return Task{kSharedWgradDown, 0, t};
  if (within(t, shared_tickets(p, kSharedDgradUp))) return Task{kSharedDgradUp, 0, t};
  if (within(t, shared_tickets(p, kSharedWgradUp))) return Task{kSharedWgradUp, 0, t};
  const int nb0 = p.xg[0].n_blocks, nb1 = p.xg[1].n_blocks;
  const int nb = (chunks + p.mb_chunks - 1) / p.mb_chunks;
  const int gd = groups_per_expert(p, kWgradDown), per_e = wgrad_tickets_per_expert(p);
  const int lag = max(p.interleave, 1);
  for (int ph = 0; ph <= nb + lag; ++ph) {
    const int count = ph < nb ? min(p.mb_chunks, chunks - ph * p.mb_chunks) : 0;
    const int n_a = count * (nb0 + nb1);
    const int e0 = experts_done_by(p, prefix, ph - lag - 1, nb);
    const int n_b = (experts_done_by(p, prefix, ph - lag, nb) - e0) * per_e;
    if (within(t, n_a + n_b)) {
      const int64_t n = n_a + n_b;
      const int b0 = static_cast<int>(static_cast<int64_t>(t) * n_b / n);
      if (static_cast<int64_t>(t + 1) * n_b / n > b0) {  // B's ticket b0
        const int e = e0 + b0 / per_e, r = b0 % per_e;
        return r < gd ? Task{kWgradDown, 0, e * gd + r} : Task{kWgradUp, 0, e * (per_e - gd) + r - gd};
      }
      const int a = t - b0;
      return a < nb0 * count ? Task{kDgradDown, ph, a} : Task{kDgradUp, ph, a - nb0 * count};
    }
  }
  return Task{kWgradUp, 0, 0};  // not reached (t < num_tasks)
}

// The expert-GEMM task of a dgrad kind; *chunk: its chunk (global for the routed kinds).
__device__ __forceinline__ xgemm::Task dgrad_task(const Params& p, const int* prefix, const Task& tk, int* chunk) {
  if (tk.kind == kDgradDown || tk.kind == kDgradUp) {
    const int g0 = tk.m * p.mb_chunks;
    return xgemm::decode_window(dgrad_params(p, tk.kind), prefix, g0, min(p.mb_chunks, prefix[p.nle] - g0), tk.n,
                                chunk);
  }
  *chunk = tk.n % p.shared_chunks;  // one segment: block-major, then chunk (xgemm::decode's order)
  return xgemm::make_task(dgrad_params(p, tk.kind), 0, tk.n / p.shared_chunks, *chunk, p.shared_chunks);
}

// ---- comm role: the pull --------------------------------------------------------------------------

// Warp-granular units of kUnitRows rows, in increasing order over all pulling warps, so the first
// 128-row blocks become ready first.
__device__ void pull_rows(const Params& p, int role) {
  const int units = routed_rows(p) / kUnitRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int u = role * kWarps + warp; u < units; u += p.num_comm * kWarps) {
    for (int i = 0; i < kUnitRows; ++i) {
      const int row = u * kUnitRows + i;
      // 8 loads in flight per lane and operand (bwd_pull: 4; the same sums in the same order): a row
      // of a peer is fetched in half the NVLink round trips
      pull_grad_row<8>(row, p.dy + static_cast<int64_t>(row) * p.H, p.row_src_rank, p.row_src_slot, p.g_bufs,
                       p.p_bufs, p.dw_bufs, p.y_routed, p.H, p.k, lane);
    }
    // TMA (async proxy) of other CTAs reads these rows once the counter says so.
    fence_proxy_async_global();
    __threadfence();
    __syncwarp();
    if (lane == 0) red_release_gpu_add(ready_ctr(p, u / kUnitsPerTile), 1);
  }
  __threadfence_system();  // the router-weight gradients stored into the peers, before the closing barrier
}

// ---- GEMM roles -------------------------------------------------------------------------------------

// Every 128-row block that rows [row0, row1) touch has been pulled.
__device__ __forceinline__ void wait_pulled(const Params& p, int row0, int row1, const Watchdog& w) {
  for (int m = row0 / BM; m <= (row1 - 1) / BM; ++m) wait_counter(ready_ctr(p, m), kUnitsPerTile, w);
}

__device__ __forceinline__ void stamp_ready(long long* rec, const Task& tk, int unit) {
  if (rec == nullptr) return;
  rec[kReadyNs] = static_cast<long long>(globaltimer_ns());
  rec[kSm] = persistent::smid();
  rec[kKind] = tk.kind;
  rec[kMUnit] = unit;  // the chunk (dgrads) or the expert (weight gradients)
  rec[kNTile] = tk.n;
}

template <class Ring>
__device__ void producer(const Params& p, const TMaps& tm, const Ring& ring, const int* prefix,
                         volatile int* stage_task, volatile int* s_total) {
  const Watchdog w = watchdog(p);
  const int chunks = prefix[p.nle];
  *s_total = num_tasks(p, chunks);  // kept in shared memory: a register for it spills
  uint32_t it = 0;
  for (;;) {
    const int t = ld_volatile(w.abort) == 0 ? atomicAdd(p.counters + kTicket, 1) : -1;  // abort: stop claiming
    if (t < 0 || t >= *s_total) break;
    long long* rec = (p.timeline != nullptr && t < p.timeline_tasks) ? timeline_record(p, t) : nullptr;
    if (rec != nullptr) rec[kClaimNs] = static_cast<long long>(globaltimer_ns());
    const Task tk = decode(p, prefix, t, chunks);
    const CUtensorMap* ta = &tm.a[tk.kind];
    const CUtensorMap* tb = &tm.b[tk.kind];
    if (is_wgrad(tk.kind)) {
      const xwgrad::Params& wp = wgrad_params(p, tk.kind);
      const WgradGroup grp = wgrad_group_of(p, tk.kind, wp, tk.n);
      const int e = xwgrad::decode(wp, grp.first).seg;
      if (tk.kind == kWgradDown) {
        const int kr = xwgrad::k_rows(wp, e);
        if (kr > 0) wait_pulled(p, wp.a_offsets[e], wp.a_offsets[e] + kr, w);
      } else if (tk.kind == kWgradUp) {
        for (int g = prefix[e]; g < prefix[e + 1]; ++g) wait_counter(dh_done_ctr(p, g), 2 * p.xg[0].n_blocks, w);
      } else if (tk.kind == kSharedWgradUp) {
        for (int g = 0; g < p.shared_chunks; ++g) wait_counter(sdh_done_ctr(p, g), 2 * p.sg[0].n_blocks, w);
      }
      stamp_ready(rec, tk, e);
      for (int j = 0; j < grp.count; ++j)  // the consumers learn of the group from its first stage
        xwgrad::produce_task<true>(wp, ta, tb, ring, xwgrad::decode(wp, grp.first + j), it, &w,
                                   j == 0 ? stage_task : nullptr, t);
      continue;
    }
    int chunk = 0;
    const xgemm::Task xt = dgrad_task(p, prefix, tk, &chunk);
    if (tk.kind == kDgradDown) wait_pulled(p, xt.row0, xt.row0 + xt.n_tok, w);
    else if (tk.kind == kDgradUp) wait_counter(dh_done_ctr(p, chunk), 2 * p.xg[0].n_blocks, w);
    else if (tk.kind == kSharedDgradUp) wait_counter(sdh_done_ctr(p, chunk), 2 * p.sg[0].n_blocks, w);
    stamp_ready(rec, tk, chunk);
    xgemm::produce_task<false, true, true>(dgrad_params(p, tk.kind), ta, tb, ring, xt, it, &w, stage_task, t);
  }
  gemm::arm_stop_stage<true>(ring, it, stage_task + it % Ring::kStages, &w);
}

// The dgrad-down epilogue's rows are read through TMA by tasks in other CTAs: publish them.
__device__ __forceinline__ void signal_rows_written(int* ctr, int bar, bool leader) {
  fence_proxy_async_global();
  __threadfence();
  warpgroup_bar_sync(bar);
  if (leader) red_release_gpu_add(ctr, 1);
}

// One consumer warpgroup. The two warpgroups of a CTA never wait for each other (separate named
// barriers, counter arrivals and sentinels), so a watchdog exit of one cannot strand the other.
template <class Ring>
__device__ void consumer(const Params& p, const TMaps& tm, const Ring& ring, const int* prefix,
                         const volatile int* stage_task, int cw, volatile int* s_misc, const PushQueue& q) {
  const Watchdog w = watchdog(p);
  const int bar = 2 + cw;
  const bool leader = threadIdx.x % 128 == 0;
  const int chunks = prefix[p.nle];
  float acc[128];
  uint32_t it = 0;
  for (;;) {
    const int s = it % Ring::kStages;
    const bool ok = gemm::ring_wait<true>(ring.full(s), (it / Ring::kStages) & 1, &w);
    if (warpgroup_bar_or(bar, !ok || ld_volatile(w.abort) != 0)) break;  // watchdog: stop (uniformly)
    const int t = stage_task[s];
    if (t < 0) break;
    long long* rec = (p.timeline != nullptr && cw == 0 && leader && t < p.timeline_tasks) ? timeline_record(p, t)
                                                                                           : nullptr;
    if (rec != nullptr) rec[kStartNs] = static_cast<long long>(globaltimer_ns());
    const Task tk = decode(p, prefix, t, chunks);
    if (is_wgrad(tk.kind)) {
      const xwgrad::Params& wp = wgrad_params(p, tk.kind);
      const WgradGroup grp = wgrad_group_of(p, tk.kind, wp, tk.n);
      for (int j = 0; j < grp.count; ++j) {
        xwgrad::mma_task<true>(wp, ring, cw, xwgrad::decode(wp, grp.first + j), acc, it, &w);
        if (p.wgrad_tma_store) {
          if constexpr (Ring::kBoxes == 4)
            xwgrad::store_task_tma(wp, ring, &tm.out[wgrad_index(tk.kind)], xwgrad::decode(wp, grp.first + j), cw, acc);
          else
            xwgrad::store_task_tma2(wp, ring, &tm.out[wgrad_index(tk.kind)], xwgrad::decode(wp, grp.first + j), cw,
                                    acc);
        } else {
          if (leader) bulk_wait_read_all();  // (an A/B switch: no TMA stores in flight; kept uniform)
          warpgroup_bar_sync(bar);
          xwgrad::store_task_direct(wp, ring, xwgrad::decode(wp, grp.first + j), cw, acc);
        }
      }
      if (rec != nullptr) rec[kEndNs] = static_cast<long long>(globaltimer_ns());
      continue;
    }
    int chunk = 0;
    const xgemm::Params& gp = dgrad_params(p, tk.kind);
    xgemm::mma_task_any<true, false, true>(gp, ring, cw, acc, it, dgrad_task(p, prefix, tk, &chunk).n_tok,
                                           &w);
    // decoded again: keeping the task live through the main loop costs registers
    const xgemm::Task xt = dgrad_task(p, prefix, tk, &chunk);
    if (leader) bulk_wait_read_all();  // the staging tile is the boxes: TMA has read the last weight gradient
    warpgroup_bar_sync(bar);
    if (tk.kind == kDgradDown || tk.kind == kSharedDgradDown) {
      const bool routed = tk.kind == kDgradDown;
      xgemm::store_task_swiglu_bwd(gp, ring, xt, cw, acc, routed ? p.h : p.shared_h, nullptr);
      signal_rows_written(routed ? dh_done_ctr(p, chunk) : sdh_done_ctr(p, chunk), bar, leader);
    } else {
      xgemm::store_task<false>(gp, ring, xt, cw, acc);
      if (tk.kind == kDgradUp) {
        __threadfence_block();    // the pushers (other warps of this CTA) read these rows
        warpgroup_bar_sync(bar);  // the warpgroup's columns are written
        if (leader && xt.n_real > 0)
          persistent::push_enqueue(q, make_int4(xt.row0, xt.n_real, xt.block * xgemm::WM + cw * 64, 0), w);
      }
    }
    if (rec != nullptr) rec[kEndNs] = static_cast<long long>(globaltimer_ns());
  }
  if (leader) bulk_wait_all();  // the boxes stay until TMA has stored them
  persistent::consumer_done(q, s_misc, p.timeout_ns, leader, w);
}

template <int kS>
__global__ void __launch_bounds__(kThreads, 1)
    bwd_megakernel(const __grid_constant__ TMaps tm, const __grid_constant__ Params p) {
  using Ring = BwdRing<kS>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ int chunk_prefix[kMaxPrefix];  // routed token chunks of the experts before e
  if (smem_u32(smem_raw) % 1024 != 0) {     // no alignment slack (see BwdRing): never seen, but never silent
    if (threadIdx.x == 0) {
      atomicCAS(p.errors + kErrKernelStall, 0, 1 + p.rank);
      atomicExch(p.counters + persistent::kAbort, 1);
    }
    return;
  }
  const Ring ring{smem_raw};
  volatile int* stage_task = ring.stage_tags();
  volatile int* s_misc = ring.misc();
  const PushQueue q = ring.push_queue();
  if (threadIdx.x >= 32 && threadIdx.x < 64) xgemm::build_chunk_prefix(p.xg[0], chunk_prefix);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kS; ++s) {
      mbar_init(ring.full(s), 1);
      mbar_init(ring.empty(s), gemm::empty_arrivals(false));
    }
    persistent::init_push_queue(q);
    mbar_fence_init();
    s_misc[1] = 0;
    s_misc[3] = 0;  // push queue tail
    s_misc[0] = atomicAdd(p.counters + kRole, 1);
  }
  __syncthreads();
  // The first CTAs to start pull: they are running, so the tasks that wait on them cannot starve
  // them of SMs (also when the grid is larger than the GPU).
  if (s_misc[0] < p.num_comm) {
    const int role = s_misc[0];
    persistent::comm_phase(p, role, [&] {
      pull_rows(p, role);
      __syncthreads();  // the pushers' exit (below) comes after every thread's system fence
    });
  }
  persistent::run_roles(
      p, q, s_misc,
      [&] {
        for (int i = 0; i < kKinds; ++i) {
          if (!p.shared && is_shared(i)) continue;  // shared maps only if used
          tma_prefetch_desc(&tm.a[i]);
          tma_prefetch_desc(&tm.b[i]);
        }
        producer(p, tm, ring, chunk_prefix, stage_task, s_misc + 4);
      },
      [&](int cw) { consumer(p, tm, ring, chunk_prefix, stage_task, cw, s_misc, q); });
}

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

// A tuning switch read per launch (same bits for every value); out of [lo, hi] or unset: dflt.
int env_int(const char* name, int dflt, int lo, int hi) {
  const char* v = getenv(name);
  if (v == nullptr || *v == 0) return dflt;
  const long x = strtol(v, nullptr, 10);
  return x < lo || x > hi ? dflt : static_cast<int>(x);
}

// Tensor maps of a dgrad kind: the weights [nseg * K rows, M] in boxes of 64 x 64 (MN-major A) and
// the token rows [rows, K] in boxes of kXBox rows.
const char* dgrad_maps(CUtensorMap* tw, CUtensorMap* tx, const void* w, int nseg, int K, int M, const void* rows,
                       int n_rows) {
  if (const char* m = make_tmap_bf16_2d(tx, rows, n_rows, K, K, xgemm::kXBox)) return m;
  return make_tmap_bf16_2d(tw, w, (uint64_t)nseg * K, M, M, xgemm::WM / 2);
}

template <int kS>
const char* launch(const TMaps& tm, const Params& p, int num_comm, int num_compute, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = launch_config(kThreads, BwdRing<kS>::kBytes, stream, false, nullptr);
  const int at_once = units_at_once(bwd_megakernel<kS>, cfg, false, "mok bwd_megakernel");
  if (at_once == 0) return "mok bwd_megakernel: cannot raise the shared-memory limit";
  const int compute = num_compute > 0 ? num_compute : std::max(1, at_once - num_comm);
  cfg.gridDim = dim3(num_comm + compute);
  return launch_ex(cfg, bwd_megakernel<kS>, tm, p);
}

}  // namespace

int64_t bwd_megakernel_counter_ints(int capacity, int T) {
  return persistent::kHeader + 2 * static_cast<int64_t>(capacity / BM) + ceil_div(T, BM);
}

const char* launch_bwd_megakernel(const BwdMegaArgs& a, cudaStream_t stream) {
  const bool shared = a.shared_fc1 != nullptr;
  if (a.T <= 0 || a.H <= 0 || a.I <= 0 || (shared && a.Is <= 0)) return "mok bwd_megakernel: empty shapes";
  if (a.H % 8 || a.I % 8 || (shared && a.Is % 8)) return "mok bwd_megakernel: H, I and Is must be multiples of 8";
  if (a.capacity % BM || a.minibatch_rows <= 0 || a.minibatch_rows % BM)
    return "mok bwd_megakernel: capacity and minibatch_rows must be multiples of 128";
  if (a.ep < 1 || a.ep > kMaxPeers || a.rank < 0 || a.rank >= a.ep) return "mok bwd_megakernel: bad rank / EP size";
  if (a.num_comm < 1) return "mok bwd_megakernel: needs at least one pulling CTA";
  if (a.nle < 1 || a.nle >= kMaxPrefix) return "mok bwd_megakernel: 1 to 511 local experts";
  if (a.h == nullptr) return "mok bwd_megakernel: needs the gate/up pre-activations h";
  if (shared && (a.shared_seg == nullptr || a.shared_act == nullptr || a.shared_h == nullptr))
    return "mok bwd_megakernel: the shared expert needs shared_act, shared_h and its segment {0, T, T}";
  for (const void* out : {a.dy, a.dh, a.dx_rows, a.dfc1, a.dfc2, a.dhs, a.shared_dx, a.dsfc1, a.dsfc2})
    if (out != nullptr && !aligned16(out))
      return "mok bwd_megakernel: the outputs must start at 16-byte aligned addresses (16-byte stores)";

  TMaps tm;
  memset(&tm, 0, sizeof(tm));
  Params p;
  memset(&p, 0, sizeof(p));
  const int T = a.T, H = a.H, I = a.I, Is = a.Is, cap = a.capacity, nle = a.nle;
  const int* offs = a.expert_offsets;
  const int* counts = a.expert_counts;
  if (const char* m = dgrad_maps(&tm.a[kDgradDown], &tm.b[kDgradDown], a.fc2, nle, H, I, a.dy, cap)) return m;
  if (const char* m = dgrad_maps(&tm.a[kDgradUp], &tm.b[kDgradUp], a.fc1, nle, 2 * I, H, a.dh, cap)) return m;
  p.xg[0] = xgemm::make_params(offs, counts, nle, cap, H, I, false, a.dh, nullptr);
  p.xg[1] = xgemm::make_params(offs, counts, nle, cap, 2 * I, H, false, a.dx_rows, nullptr);
  if (const char* m = xwgrad::make_operand_maps(&tm.a[kWgradDown], &tm.b[kWgradDown], a.dy, cap, H, a.act, cap, I))
    return m;
  if (const char* m = xwgrad::make_operand_maps(&tm.a[kWgradUp], &tm.b[kWgradUp], a.dh, cap, 2 * I, a.x_routed, cap, H))
    return m;
  p.wg[0] = xwgrad::make_params(offs, offs, counts, nle, H, I, a.dfc2);
  p.wg[1] = xwgrad::make_params(offs, offs, counts, nle, 2 * I, H, a.dfc1);
  if (const char* m = xwgrad::make_out_map(&tm.out[wgrad_index(kWgradDown)], a.dfc2, nle, H, I)) return m;
  if (const char* m = xwgrad::make_out_map(&tm.out[wgrad_index(kWgradUp)], a.dfc1, nle, 2 * I, H)) return m;
  if (shared) {
    const int* soffs = a.shared_seg;
    const int* scount = a.shared_seg + 2;
    if (const char* m = dgrad_maps(&tm.a[kSharedDgradDown], &tm.b[kSharedDgradDown], a.shared_fc2, 1, H, Is, a.g, T))
      return m;
    if (const char* m = dgrad_maps(&tm.a[kSharedDgradUp], &tm.b[kSharedDgradUp], a.shared_fc1, 1, 2 * Is, H, a.dhs, T))
      return m;
    p.sg[0] = xgemm::make_params(soffs, scount, 1, T, H, Is, false, a.dhs, nullptr);
    p.sg[1] = xgemm::make_params(soffs, scount, 1, T, 2 * Is, H, false, a.shared_dx, nullptr);
    if (const char* m = xwgrad::make_operand_maps(&tm.a[kSharedWgradDown], &tm.b[kSharedWgradDown], a.g, T, H,
                                                  a.shared_act, T, Is))
      return m;
    if (const char* m =
            xwgrad::make_operand_maps(&tm.a[kSharedWgradUp], &tm.b[kSharedWgradUp], a.dhs, T, 2 * Is, a.x, T, H))
      return m;
    p.swg[0] = xwgrad::make_params(soffs, soffs, scount, 1, H, Is, a.dsfc2);
    p.swg[1] = xwgrad::make_params(soffs, soffs, scount, 1, 2 * Is, H, a.dsfc1);
    if (const char* m = xwgrad::make_out_map(&tm.out[wgrad_index(kSharedWgradDown)], a.dsfc2, 1, H, Is)) return m;
    if (const char* m = xwgrad::make_out_map(&tm.out[wgrad_index(kSharedWgradUp)], a.dsfc1, 1, 2 * Is, H)) return m;
    p.shared = 1;
    p.shared_chunks = xgemm::chunks_of(T);
  }
  p.h = static_cast<const __nv_bfloat16*>(a.h);
  p.shared_h = static_cast<const __nv_bfloat16*>(a.shared_h);
  p.mb_chunks = std::max(1, a.minibatch_rows / xgemm::kMaxTok);
  const int group = env_int("MOK_BWD_WGRAD_GROUP", 8, 1, 1 << 20);
  for (int kind : {kSharedWgradDown, kSharedWgradUp, kWgradDown, kWgradUp}) {
    const bool routed = kind == kWgradDown || kind == kWgradUp;
    const xwgrad::Params& wp = routed ? p.wg[kind == kWgradUp] : p.swg[kind == kSharedWgradUp];
    const int i = wgrad_index(kind), g = routed ? group : 1;
    p.wgrad_gsize[i] = g;
    p.wgrad_gpe[i] = ceil_div(wp.m_blocks * wp.n_blocks, g);
    if (!routed && shared) p.shared_tickets[kind] = p.wgrad_gpe[i];
  }
  if (shared) {
    p.shared_tickets[kSharedDgradDown] = p.shared_chunks * p.sg[0].n_blocks;
    p.shared_tickets[kSharedDgradUp] = p.shared_chunks * p.sg[1].n_blocks;
  }
  for (int kind = 0; kind < kKinds; ++kind) p.shared_ticket_total += p.shared_tickets[kind];
  p.interleave = env_int("MOK_BWD_INTERLEAVE", 0, 0, 64);
  p.wgrad_tma_store = env_int("MOK_WGRAD_TMA_STORE", 1, 0, 1);
  p.max_mtiles = cap / BM;
  p.n_counters = static_cast<int>(bwd_megakernel_counter_ints(cap, T));
  p.capacity = cap;
  p.nle = nle;
  p.H = H;
  p.k = a.k;
  p.rank = a.rank;
  p.ep = a.ep;
  p.row_src_rank = a.row_src_rank;
  p.row_src_slot = a.row_src_slot;
  p.expert_offsets = offs;
  p.y_routed = static_cast<const __nv_bfloat16*>(a.y_routed);
  p.dy = static_cast<__nv_bfloat16*>(a.dy);
  p.counters = a.counters;
  p.state = a.state;
  p.errors = a.errors;
  p.timeout_ns = a.timeout_ns;
  p.g_bufs = a.g_bufs;
  p.p_bufs = a.p_bufs;
  p.dw_bufs = a.dw_bufs;
  p.comb_bufs = a.slot_bufs;
  p.flags = a.flags;
  p.timeline = megakernel_timeline_records(&p.timeline_tasks);
  if (p.timeline != nullptr && a.num_comm > kMaxTimelineRoles)
    return "mok bwd_megakernel: the timeline records at most 1024 pulling CTAs";

  p.num_comm = a.num_comm;
  return env_int("MOK_BWD_STAGES", 4, 3, 4) == 3 ? launch<3>(tm, p, a.num_comm, a.num_compute, stream)
                                                   : launch<4>(tm, p, a.num_comm, a.num_compute, stream);
}

}  // namespace mok
