// The persistent forward megakernel (bf16): one launch per layer forward between the opening
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
//   up_done[g]   routed gate/up task halves of token chunk g written (act rows)     (target 2 nb)
//   sup_done[m]  shared gate/up tile halves of m-tile m written (shared_act rows)   (target 2 nt)
// (each consumer warpgroup arrives once per task; nb: the routed gate/up weight blocks per expert,
// nt: the shared gate/up n-tiles).
// A routed down task's epilogue writes its rows of y (64 columns per consumer warpgroup) and queues
// them (a 4-slot shared-memory queue); warps 1-3 of the producer warpgroup (idle otherwise) push
// them (128-byte row pieces) into slot row_src_slot of the source rank's symmetric combine buffer,
// while the consumers already run the next task's MMAs.
//
// Bits: every output element is computed by exactly one task with the K order and epilogue of the
// staged grouped GEMMs, and the dispatch and combine copy values unchanged, so the results do not
// depend on num_comm, the grid size or minibatch_rows (tested bitwise against the staged path).
//
// Counters live in a per-workspace int32 buffer that the last CTA to finish zeroes again, so a
// CUDA graph replays it. Every wait has a watchdog (%globaltimer): a stall sets
// errors[kErrKernelStall] = 1 + rank and an abort flag, and the kernel ends instead of hanging.
#include <string.h>

#include "passes/persistent.cuh"

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
constexpr int kCopyUnroll = tuning::kDispatchCopyUnroll;  // 16-byte loads in flight per lane

// Counter buffer: header (persistent.cuh), then ready[max_mtiles], up_done[max_chunks],
// sup_done[ceil(T / BM)]. Segments start at multiples of kRowAlign (32), so a 128-row m-tile may
// hold several experts and the chunks are bounded by nle + capacity / 256, not by the m-tiles.
enum Kind : int { kSharedUp = 0, kSharedDown = 1, kRoutedUp = 2, kRoutedDown = 3 };

struct TMaps {
  CUtensorMap a[4];  // by Kind
  CUtensorMap b[4];
};

struct Params {
  gemm::Params g[2];      // shared gate/up, shared down (token-major)
  xgemm::Params xg[2];    // routed gate/up, routed down (expert-major): xg[kind - kRoutedUp]
  int shared_mtiles;  // 0: no shared expert
  int mb_chunks;      // routed token chunks per minibatch
  int num_comm;
  int max_mtiles;     // capacity / BM (capacity: a multiple of kTileRows = BM)
  int max_chunks;     // nle + capacity / kMaxTok: routed token chunks at most
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
};



struct Task {
  int kind, m, n;
};

__device__ __forceinline__ int* ready_ctr(const Params& p, int m) { return p.counters + kHeader + m; }
__device__ __forceinline__ int* up_done_ctr(const Params& p, int m) { return p.counters + kHeader + p.max_mtiles + m; }
__device__ __forceinline__ int* sup_done_ctr(const Params& p, int m) {
  return p.counters + kHeader + p.max_mtiles + p.max_chunks + m;
}

// Rows the dispatch writes this launch (device value): the routed rows rounded up to whole m-tiles
// (<= capacity, a multiple of BM), so every m-tile a task reads reaches its ready target; rows past
// the last segment have no source and are zero-filled.
__device__ __forceinline__ int dispatched_rows(const Params& p) {
  return (min(p.expert_offsets[p.nle], p.capacity) + BM - 1) / BM * BM;
}

// Units of a routed kind in a minibatch of `count` chunks: its tasks.
__device__ __forceinline__ int routed_units(const Params& p, int kind, int count) {
  return p.xg[kind - kRoutedUp].n_blocks * count;
}

// Tasks of a shared kind: token-major tiles.
__device__ __forceinline__ int shared_units(const Params& p, int kind) { return p.shared_mtiles * p.g[kind].n_tiles; }

__device__ __forceinline__ int num_tasks(const Params& p, int chunks) {
  const int shared = shared_units(p, kSharedUp) + shared_units(p, kSharedDown);
  if (chunks == 0) return shared;
  const int nb = (chunks + p.mb_chunks - 1) / p.mb_chunks, last = chunks - (nb - 1) * p.mb_chunks;
  const int per_mb = routed_units(p, kRoutedUp, p.mb_chunks) + routed_units(p, kRoutedDown, p.mb_chunks);
  return shared + (nb - 1) * per_mb + routed_units(p, kRoutedUp, last) + routed_units(p, kRoutedDown, last);
}

// Task t (< num_tasks) of the list in the header comment. Shared kinds: m is the m-tile, n the
// n-tile. Routed kinds: m is the minibatch, n the task inside the kind's part of it.
__device__ __forceinline__ Task decode(const Params& p, int t, int chunks) {
  const int s1 = shared_units(p, kSharedUp), s2 = shared_units(p, kSharedDown);
  if (t < s1) return Task{kSharedUp, t / p.g[kSharedUp].n_tiles, t % p.g[kSharedUp].n_tiles};
  t -= s1;
  if (t < s2) return Task{kSharedDown, t / p.g[kSharedDown].n_tiles, t % p.g[kSharedDown].n_tiles};
  t -= s2;
  const int per_mb = routed_units(p, kRoutedUp, p.mb_chunks) + routed_units(p, kRoutedDown, p.mb_chunks);
  const int b = t / per_mb;  // every minibatch before the last is full
  const int r = t - b * per_mb;
  const int u1 = routed_units(p, kRoutedUp, min(p.mb_chunks, chunks - b * p.mb_chunks));
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

// The expert task of routed task tk (kind, minibatch, task; decode gives tk.n < the kind's tasks in
// the minibatch). *chunk: its global chunk index.
__device__ __forceinline__ xgemm::Task routed_task(const Params& p, const int* prefix, const Task& tk, int* chunk) {
  const xgemm::Params& xg = p.xg[tk.kind - kRoutedUp];
  const int g0 = tk.m * p.mb_chunks;
  const int count = min(p.mb_chunks, prefix[p.nle] - g0);
  return xgemm::decode_window(xg, prefix, g0, count, tk.n, chunk);
}

// ---- comm role: pull-dispatch -------------------------------------------------------------------

// Warp-granular units of kUnitRows rows, in increasing order over all dispatching warps, so the
// first m-tiles become ready first. Padding rows (src < 0) are zero-filled, as in dispatch.cu.
__device__ void dispatch_rows(const Params& p, int role) {
  const int rows = dispatched_rows(p);
  const int units = rows / kUnitRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row_bytes = 2 * p.H;
  const int n16 = row_bytes / 16;
  uint8_t* x_dst = reinterpret_cast<uint8_t*>(p.x_routed);
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
    }
    // TMA (async proxy) of other CTAs reads these rows once the counter says so.
    fence_proxy_async_global();
    __threadfence();
    __syncwarp();
    if (lane == 0) red_release_gpu_add(ready_ctr(p, u / kUnitsPerTile), 1);
  }
}

// ---- GEMM roles -----------------------------------------------------------------------------------

__device__ void producer(const Params& p, const TMaps& tm, const gemm::Smem& sm, const ExpertRing& ring,
                         const int* prefix, volatile int* stage_task) {
  const Watchdog w = watchdog(p);
  const int chunks = prefix[p.nle];
  const int total = num_tasks(p, chunks);
  uint32_t it = 0;
  for (;;) {
    int t = -1;
    if (ld_volatile(w.abort) == 0) t = atomicAdd(p.counters + kTicket, 1);  // abort: stop claiming
    if (t >= total) t = -1;
    if (t < 0) break;
    const Task tk = decode(p, t, chunks);
    long long* rec = (p.timeline != nullptr && t < p.timeline_tasks) ? timeline_record(p, t) : nullptr;
    if (rec != nullptr) rec[kClaimNs] = static_cast<long long>(globaltimer_ns());
    if (tk.kind == kSharedUp || tk.kind == kSharedDown) {
      // a down tile waits for its m-tile's gate/up tiles (which arrive once per consumer warpgroup)
      if (tk.kind == kSharedDown) wait_counter(sup_done_ctr(p, tk.m), 2 * p.g[kSharedUp].n_tiles, w);
      stamp_ready(rec, tk.kind, tk.m, tk.n);
      const gemm::Params& g = p.g[tk.kind];
      const int tile = tk.m * g.n_tiles + tk.n;
      if (tk.kind == kSharedUp)
        gemm::produce_tile<true, true>(g, &tm.a[tk.kind], &tm.b[tk.kind], sm, tile, it, &w, stage_task, t);
      else
        gemm::produce_tile<false, true>(g, &tm.a[tk.kind], &tm.b[tk.kind], sm, tile, it, &w, stage_task, t);
      continue;
    }
    int chunk = 0;
    const xgemm::Task xt = routed_task(p, prefix, tk, &chunk);
    const xgemm::Params& xg = p.xg[tk.kind - kRoutedUp];
    if (tk.kind == kRoutedUp) {  // the chunk's rows dispatched (all 128-row m-tiles they touch)
      for (int m = xt.row0 / BM; m <= (xt.row0 + xt.n_tok - 1) / BM; ++m)
        wait_counter(ready_ctr(p, m), kUnitsPerTile, w);
    } else {  // the chunk's act rows: every gate/up block, once per consumer warpgroup
      wait_counter(up_done_ctr(p, chunk), 2 * p.xg[0].n_blocks, w);
    }
    stamp_ready(rec, tk.kind, chunk, xt.block);
    if (tk.kind == kRoutedUp) {
      xgemm::produce_task<true, true>(xg, &tm.a[tk.kind], &tm.b[tk.kind], ring, xt, it, &w, stage_task, t);
    } else {
      xgemm::produce_task<false, true>(xg, &tm.a[tk.kind], &tm.b[tk.kind], ring, xt, it, &w, stage_task, t);
    }
  }
  gemm::arm_stop_stage<true>(ring, it, stage_task + it % ExpertRing::kStages, &w);
}

// One consumer warpgroup. The two warpgroups of a CTA never wait for each other (separate named
// barriers, separate counter arrivals, separate sentinels), so a watchdog exit of one cannot strand
// the other; inside a warpgroup every barrier is reached by all 128 threads in the same order.
__device__ void consumer(const Params& p, const gemm::Smem& sm, const ExpertRing& ring, const int* prefix,
                         const volatile int* stage_task, int cw, volatile int* s_misc, const PushQueue& q) {
  const Watchdog w = watchdog(p);
  const int bar = 2 + cw;
  const bool leader = threadIdx.x % 128 == 0;
  const int chunks = prefix[p.nle];
  float acc[128];
  uint32_t it = 0;
  for (;;) {
    const int s = it % ExpertRing::kStages;
    const bool ok = gemm::ring_wait<true>(ring.full(s), (it / ExpertRing::kStages) & 1, &w);
    if (warpgroup_bar_or(bar, !ok || ld_volatile(w.abort) != 0)) break;  // watchdog: stop (uniformly)
    const int t = stage_task[s];
    if (t < 0) break;
    long long* rec = (p.timeline != nullptr && cw == 0 && leader && t < p.timeline_tasks)
                         ? timeline_record(p, t) : nullptr;
    if (rec != nullptr) rec[kStartNs] = static_cast<long long>(globaltimer_ns());
    const Task tk = decode(p, t, chunks);
    if (tk.kind == kSharedUp || tk.kind == kSharedDown) {
      const gemm::Params& g = p.g[tk.kind];
      const int mt = p.shared_mtiles;
      const int m = tk.m;
      const bool own = m < mt;
      const int tile = min(m, mt - 1) * g.n_tiles + tk.n;
      const bool active = own && gemm::half_active(g, tile, cw);
      gemm::mma_tile<true, false>(g, sm, cw, acc, it, active, &w);
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
    } else {
      int chunk = 0;
      const xgemm::Params& xg = p.xg[tk.kind - kRoutedUp];
      xgemm::mma_task_any<true>(xg, ring, cw, acc, it, routed_task(p, prefix, tk, &chunk).n_tok, &w);
      // decoded again: keeping the task live through the main loop costs registers
      const xgemm::Task xt = routed_task(p, prefix, tk, &chunk);
      if (tk.kind == kRoutedUp) {
        xgemm::store_task<true>(xg, ring, xt, cw, acc);
        // The down tasks of this chunk read these rows through TMA in other CTAs.
        fence_proxy_async_global();
        __threadfence();
        warpgroup_bar_sync(bar);
        if (leader) red_release_gpu_add(up_done_ctr(p, chunk), 1);
      } else {
        xgemm::store_task<false>(xg, ring, xt, cw, acc);
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

__global__ void __launch_bounds__(kThreads, 1)
    megakernel(const __grid_constant__ TMaps tm, const __grid_constant__ Params p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ int chunk_prefix[xgemm::kMaxSeg + 1];  // routed token chunks of the experts before e
  const gemm::Smem sm = gemm::carve_smem(smem_raw);
  volatile int* stage_task = reinterpret_cast<volatile int*>(sm.empty + kStages);  // [kStages]
  // [0] role, [1] producer done, [2] last exit party (persistent::pushers), [3] push queue tail
  volatile int* s_misc = reinterpret_cast<volatile int*>(sm.empty + kStages) + kStages;
  uint64_t* push_bars = reinterpret_cast<uint64_t*>(const_cast<int*>(s_misc + 4));  // full, empty
  const PushQueue q{reinterpret_cast<volatile int4*>(push_bars + 2 * kPushSlots), push_bars, push_bars + kPushSlots,
                    const_cast<int*>(s_misc + 3)};
  __nv_bfloat16* staging = reinterpret_cast<__nv_bfloat16*>(const_cast<int4*>(q.req + kPushSlots));
  const ExpertRing ring{sm, staging};
  if (threadIdx.x >= 32 && threadIdx.x < 64) xgemm::build_chunk_prefix<xgemm::kMaxTok>(p.xg[0], chunk_prefix);
  if (threadIdx.x == 0) {
    for (int s = 0; s < ExpertRing::kStages; ++s) {
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
  // The first CTAs to start dispatch: they are running, so the GEMM tasks that wait on them cannot
  // starve them of SMs (also when the grid is larger than the GPU).
  const int role = s_misc[0];
  if (role < p.num_comm) {
    persistent::comm_phase(p, role, [&] {
      dispatch_rows(p, role);
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
        producer(p, tm, sm, ring, chunk_prefix, stage_task);
      },
      [&](int cw) { consumer(p, sm, ring, chunk_prefix, stage_task, cw, s_misc, q); });
}

// + stage tags [kStages], flags [4], push queue barriers [2 kPushSlots] and requests [kPushSlots]
// (int4), the expert GEMM's epilogue staging
constexpr int kMegaSmemBytes =
    gemm::kSmemBytes + 4 * (kStages + 4) + 8 * 2 * kPushSlots + 16 * kPushSlots + 2 * xgemm::kStageBytesPerWG;
static_assert(kMegaSmemBytes + 4 * (xgemm::kMaxSeg + 1) <= 227 * 1024, "shared memory");
static_assert((4 * (kStages + 4) + 8 * 2 * kPushSlots) % 16 == 0,
              "the staging tiles (after the push requests) need 16-byte alignment");
static_assert((kStages + 4) % 2 == 0, "the push queue barriers need 8-byte alignment");

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

const char* launch(const TMaps& tm, Params p, int num_comm, int num_compute, cudaStream_t stream) {
  cudaLaunchAttribute cluster;
  cudaLaunchConfig_t cfg = launch_config(kThreads, kMegaSmemBytes, stream, false, &cluster);
  const int at_once = units_at_once(megakernel, cfg, false);
  if (at_once == 0) return "mok megakernel: cannot raise the shared-memory limit";
  const int compute = num_compute > 0 ? num_compute : std::max(1, at_once - num_comm);
  p.num_comm = num_comm;
  cfg.gridDim = dim3(num_comm + compute);
  return launch_ex(cfg, megakernel, tm, p);
}

long long* g_timeline = nullptr;  // set_megakernel_timeline
int g_timeline_tasks = 0;

}  // namespace

void set_megakernel_timeline(long long* records, int64_t num_records) {
  g_timeline = records;
  g_timeline_tasks = records != nullptr ? static_cast<int>(std::max<int64_t>(0, num_records - kMaxTimelineRoles)) : 0;
}

// Chunks of routed rows: sum_e ceil(rows_e / 256) <= nle + capacity / 256.
static int max_routed_chunks(int capacity, int nle) { return nle + capacity / xgemm::kMaxTok; }

int64_t megakernel_counter_ints(int capacity, int T, int nle) {
  return kHeader + static_cast<int64_t>(capacity / BM) + max_routed_chunks(capacity, nle) + ceil_div(T, BM);
}

const char* launch_megakernel(const MegaArgs& a, cudaStream_t stream) {
  const bool shared = a.shared_fc1 != nullptr;
  if (a.T <= 0 || a.H <= 0 || a.I <= 0 || (shared && a.Is <= 0)) return "mok megakernel: empty shapes";
  if (a.H % 8 || a.I % 8 || (shared && a.Is % 8)) return "mok megakernel: H, I and Is must be multiples of 8";
  if (a.capacity % kTileRows || a.minibatch_rows <= 0 || a.minibatch_rows % kTileRows)
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
  if (shared) {
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
  if (const char* m = make_tmap_gate_up_pairs(&tm.a[kRoutedUp], a.fc1, a.nle, I, H)) return m;
  if (const char* m = make_tmap_bf16_2d(&tm.b[kRoutedUp], a.x_routed, cap, H, H, xgemm::kXBox)) return m;
  if (const char* m = make_tmap_bf16_2d(&tm.a[kRoutedDown], a.fc2, (uint64_t)a.nle * H, I, I, xgemm::WM)) return m;
  if (const char* m = make_tmap_bf16_2d(&tm.b[kRoutedDown], a.act, cap, I, I, xgemm::kXBox)) return m;
  p.xg[0] = xgemm::make_params(a.expert_offsets, a.expert_counts, a.nle, cap, H, I, true, a.act, a.h);
  p.xg[1] = xgemm::make_params(a.expert_offsets, a.expert_counts, a.nle, cap, I, H, false, a.y_routed, nullptr);
  p.mb_chunks = std::max(1, a.minibatch_rows / xgemm::kMaxTok);
  p.num_comm = a.num_comm;
  p.max_mtiles = cap / BM;
  p.max_chunks = max_routed_chunks(cap, a.nle);
  p.n_counters = static_cast<int>(megakernel_counter_ints(cap, T, a.nle));
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
  // one CTA a unit, no 2-CTA clusters: a cluster's rings advance in lockstep, and for two different
  // expert tasks that costs more (6-7%) than the shared expert's weight multicast saves
  return launch(tm, p, a.num_comm, a.num_compute, stream);
}

}  // namespace mok
