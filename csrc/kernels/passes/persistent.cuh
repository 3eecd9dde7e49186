// The persistent-kernel machinery of the forward megakernel (megakernel.cu): the counter buffer's
// header, counter waits, the expert-GEMM ring view of the token-major ring, the timeline records,
// and the push queue whose pusher warps copy finished output rows into the source ranks'
// symmetric slots while the consumers run the next task.
//
// The kernel's Params type P provides: counters, n_counters, errors, timeout_ns, rank, ep, state,
// flags (barrier), row_src_rank, row_src_slot, H, comb_bufs (the slot buffers pushed into) and
// xg[1].out (the rows pushed: the routed experts' outputs y).
#pragma once

#include "comm/barrier.cuh"
#include "gemm/expert_gemm.cuh"
#include "gemm/grouped_gemm.cuh"

namespace mok {
namespace persistent {

constexpr int kWarps = gemm::kThreads / 32;         // 12
constexpr int kUnitRows = tuning::kDispatchUnitRows;  // rows a comm warp moves before it signals
constexpr int kUnitsPerTile = gemm::BM / kUnitRows;  // 16: units per 128-row block (its ready target)
constexpr int kPushSlots = tuning::kPushSlots;  // queued pushes per CTA
constexpr int kPusherWarps = 3;  // warps 1-3 of the producer warpgroup
constexpr int kPushBatch = tuning::kPushBatch;  // rows a pusher warp has in flight

// Counter buffer header (the kernels' own counters follow it).
enum Counter : int { kTicket = 0, kRole = 1, kExit = 2, kAbort = 3, kHeader = 4 };

template <class P>
__device__ __forceinline__ Watchdog watchdog(const P& p) {
  return Watchdog{p.counters + kAbort, p.errors, p.timeout_ns, 1 + p.rank};
}

// Timeline record (set_megakernel_timeline, profiling): %globaltimer stamps of one ticket: claimed
// by the producer, dependencies met, first stage full at consumer warpgroup 0, its epilogue done;
// then the SM, kind, m-unit and n-tile. A comm CTA's record (after the ticket records, by role)
// holds its start and end in the first two fields, kind -1.
namespace timeline {
enum TimelineField : int { kClaimNs = 0, kReadyNs, kStartNs, kEndNs, kSm, kKind, kMUnit, kNTile, kTimelineFields };
}  // namespace timeline
constexpr int kMaxTimelineRoles = 1024;  // comm-CTA records at the end of a timeline

template <class P>
__device__ __forceinline__ long long* timeline_record(const P& p, int index) {
  return p.timeline + static_cast<int64_t>(index) * timeline::kTimelineFields;
}

__device__ __forceinline__ long long smid() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// The comm phase of CTA `role` (every thread calls it): move() copies its rows; with the timeline
// on, thread 0 stamps the phase's start and end into the role's record, after the ticket records.
template <class P, class Move>
__device__ __forceinline__ void comm_phase(const P& p, int role, Move move) {
  long long* rec =
      (p.timeline != nullptr && threadIdx.x == 0) ? timeline_record(p, p.timeline_tasks + role) : nullptr;
  if (rec != nullptr) rec[timeline::kClaimNs] = static_cast<long long>(globaltimer_ns());
  move();
  if (rec != nullptr) {
    rec[timeline::kReadyNs] = static_cast<long long>(globaltimer_ns());
    rec[timeline::kSm] = smid();
    rec[timeline::kKind] = -1;
  }
}

// Spin until *ctr >= target (acquire), then order the async proxy (TMA) behind it.
__device__ __forceinline__ void wait_counter(const int* ctr, int target, const Watchdog& w) {
  if (ld_acquire_gpu(ctr) < target) {
    const uint64_t t0 = globaltimer_ns();
    uint32_t spins = 0;
    while (ld_acquire_gpu(ctr) < target)
      if (watchdog_expired(w, t0, spins)) break;
  }
  fence_proxy_async_global();
}

// The token-major ring (gemm::Smem) as expert_gemm.cuh sees it: the same stage layout, plus the
// epilogue's staging tiles.
struct ExpertRing {
  static constexpr int kStages = gemm::kStages;
  const gemm::Smem& sm;
  __nv_bfloat16* staging_base;
  __device__ __forceinline__ uint8_t* w(int s) const { return sm.a(s); }
  __device__ __forceinline__ uint8_t* x(int s) const { return sm.b(s); }
  __device__ __forceinline__ uint64_t* full(int s) const { return &sm.full[s]; }
  __device__ __forceinline__ uint64_t* empty(int s) const { return &sm.empty[s]; }
  __device__ __forceinline__ __nv_bfloat16* staging(int cw) const {
    return staging_base + cw * (64 * xgemm::kStageStride);
  }
};

// ---- the push queue --------------------------------------------------------------------------------

// Consumer warpgroups claim slots in order (tail), wait until the pushers freed them, write the
// request and arrive on full[slot]; the pusher warps take slots in the same order. A request
// {row0, rows, col0, -}: rows [row0, row0 + rows) x columns [col0, col0 + 64) of the pushed rows (a
// consumer warpgroup's part of a task); row0 < 0: the warpgroup is done (sentinel).
struct PushQueue {
  volatile int4* req;  // [kPushSlots]
  uint64_t* full;      // [kPushSlots], 1 arrival (the consumer warpgroup's leader)
  uint64_t* empty;     // [kPushSlots], kPusherWarps arrivals
  int* tail;
};

// One thread, before the CTA's first block-wide sync.
__device__ __forceinline__ void init_push_queue(const PushQueue& q) {
  for (int j = 0; j < kPushSlots; ++j) {
    mbar_init(&q.full[j], 1);
    mbar_init(&q.empty[j], kPusherWarps);
  }
}

__device__ __forceinline__ void push_enqueue(const PushQueue& q, int4 r, const Watchdog& w) {
  const uint32_t i = atomicAdd(q.tail, 1);
  const int s = i % kPushSlots;
  if (!mbar_wait_watch(&q.empty[s], ((i / kPushSlots) & 1) ^ 1, w)) return;  // stalled: the pushers give up too
  q.req[s].x = r.x;
  q.req[s].y = r.y;
  q.req[s].z = r.z;
  q.req[s].w = r.w;
  mbar_arrive(&q.full[s]);
}

// Pusher warp `warp` (0..kPusherWarps-1) copies its share of a request's rows into the slots:
// 4 rows per warp instruction (8 lanes x 16 bytes = a row's 64 columns), kPushBatch of those in
// flight, loads first, then the (peer) stores.
template <class P>
__device__ __forceinline__ void push_request(const P& p, int4 r, int warp, int lane) {
  const int row0 = r.x, rows = r.y, c0 = r.z;
  const int n16 = min(64, p.H - c0) / 8;
  const int sub = lane / 8, v = lane % 8;
  const __nv_bfloat16* y = p.xg[1].out;
  for (int i0 = warp * 4 * kPushBatch; i0 < rows; i0 += kPusherWarps * 4 * kPushBatch) {
    int src[kPushBatch], slot[kPushBatch];
    uint4 val[kPushBatch];
#pragma unroll
    for (int j = 0; j < kPushBatch; ++j) {
      const int i = i0 + 4 * j + sub, row = row0 + i;
      src[j] = (i < rows && v < n16) ? p.row_src_rank[row] : -1;
      slot[j] = src[j] >= 0 ? p.row_src_slot[row] : 0;
      if (src[j] >= 0) val[j] = __ldcg(reinterpret_cast<const uint4*>(y + static_cast<int64_t>(row) * p.H + c0) + v);
    }
#pragma unroll
    for (int j = 0; j < kPushBatch; ++j)
      if (src[j] >= 0)
        st16(static_cast<__nv_bfloat16*>(p.comb_bufs.p[src[j]]) + static_cast<int64_t>(slot[j]) * p.H + c0 + v * 8,
             val[j]);
  }
}

// Named barrier over the pusher warps (ids 2 and 3 are the consumer warpgroups').
__device__ __forceinline__ void pushers_bar_sync() {
  asm volatile("bar.sync 4, %0;" ::"n"(kPusherWarps * 32) : "memory");
}

// The pusher warps: serve the queue until both consumer warpgroups are done, then leave as the
// CTA's exit party: the last party of the grid zeroes the counters and opens the closing barrier.
// A CTA's pushers leave after its consumers, which leave after its producer's last ticket claim, so
// nothing touches the counters after the reset.
template <class P>
__device__ void pushers(const P& p, const PushQueue& q, volatile int* s_misc) {
  const Watchdog w = watchdog(p);
  const int warp = threadIdx.x / 32 - 1, lane = threadIdx.x % 32;
  const int t = threadIdx.x - 32;  // 0 .. 32 kPusherWarps - 1
  int done = 0;
  for (uint32_t i = 0; done < 2; ++i) {
    const int s = i % kPushSlots;
    if (!mbar_wait_watch(&q.full[s], (i / kPushSlots) & 1, w)) break;
    const int4 r = make_int4(q.req[s].x, q.req[s].y, q.req[s].z, q.req[s].w);
    if (r.x < 0) ++done; else push_request(p, r, warp, lane);
    __syncwarp();
    if (lane == 0) mbar_arrive(&q.empty[s]);
  }
  __threadfence_system();  // the pushes into the peers' slots, before the closing barrier
  pushers_bar_sync();
  if (t == 0) s_misc[2] = atomicAdd(p.counters + kExit, 1) == static_cast<int>(gridDim.x) - 1;
  pushers_bar_sync();
  if (s_misc[2] == 0) return;
  __threadfence();
  for (int i = t; i < p.n_counters; i += 32 * kPusherWarps) p.counters[i] = 0;
  if (t == 0) {
    const int epoch = barrier_next_epoch(p.state, 0);
    barrier_arrive(p.flags, p.rank, p.ep, epoch, 0, 1);
  }
}

// The roles after the comm phase (gemm::run_roles): the producer thread (produce(): it claims
// tickets until none is left, then s_misc[1] = 1), the pusher warps 1-3 of warpgroup 0, and the
// consumer warpgroups (consume(cw)).
template <class P, class Produce, class Consume>
__device__ __forceinline__ void run_roles(const P& p, const PushQueue& q, volatile int* s_misc, Produce produce,
                                          Consume consume) {
  gemm::run_roles(
      [&] {
        produce();
        s_misc[1] = 1;
      },
      [&] { pushers(p, q, s_misc); }, consume);
}

// A consumer warpgroup is done: wait (bounded) until the producer's last ticket claim is over
// (s_misc[1]), then tell the pushers.
__device__ __forceinline__ void consumer_done(const PushQueue& q, volatile int* s_misc, uint64_t timeout_ns,
                                              bool leader, const Watchdog& w) {
  const uint64_t t0 = globaltimer_ns();
  while (s_misc[1] == 0 && globaltimer_ns() - t0 < timeout_ns) {
  }
  if (leader) push_enqueue(q, make_int4(-1, 0, 0, 0), w);
}

}  // namespace persistent
}  // namespace mok
