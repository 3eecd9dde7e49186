// Routing all-gather and the routed-row schedule (docs/DESIGN.md), built on the device with
// prefix sums: no host sync, and the row order is a pure function of the routing.
//
// Row order inside local expert e: (source rank, source token) ascending. The tokens of every
// source rank are cut into chunks of kChunk tokens; the position of a routed pair is
//   expert_offsets[e] + (rows of e in all earlier (rank, chunk) blocks)
//                     + (tokens before it in its chunk that also chose e),
// the first from a count pass + scan, the second from a per-chunk bitmask and popcounts.
// One launch (schedule_kernel): gather, cross-rank barrier, count, scan, fill.
// Stopped (errors[kErrHeaderMismatch] set: a peer rejected its input or a header differed, at this
// barrier or an earlier one not yet raised): no routing goes to the peers, and the schedule is empty
// (no rows, zero counts and offsets, top_all -1), so no kernel that uses it touches a peer's rows.
#include <algorithm>

#include "comm/barrier.cuh"

namespace mok {
namespace {

constexpr int kChunk = 256;         // tokens per block in the count and fill passes
constexpr int kMaxExperts = 8192;   // smem histogram bound of the count pass
constexpr int kMaxLocalExperts = 1024;  // smem bitmask bound of the fill pass (32 KB)

struct SchedArgs {
  const void* top_experts;  // [T, k] int32 or int64
  int is_int64;
  PeerPtrs route_bufs;  // symmetric routing [2, ep, T, k] of every rank
  const int* routing;   // this rank's routing buffer (the count tasks read it)
  PeerPtrs flags;       // symmetric barrier buffers
  int* state;
  int* errors;
  int* top_all;          // [ep, T, k]
  int* chunk_counts;     // [nle, ep * nchunks]: counts, then (after the scan) row bases
  int* expert_rows_all;  // [num_experts] histogram over all ranks
  int* row_src_rank;
  int* row_src_slot;
  int* expert_counts;
  int* expert_offsets;
  uint64_t timeout_ns;   // the cross-rank barrier
  uint64_t watchdog_ns;  // waits for a release (the count tasks' one contains the barrier)
  int rank, ep, T, k, nle, num_experts, nchunks, capacity;
  int gather_tasks;  // gather tasks (the first tickets)
  CallHeader header;  // the call's header, carried by the barrier (words[0] == 0: none)
};

// Gather task `task` of a.gather_tasks (strided over the elements): this rank's routing into
// every rank's routing buffer, zero histogram, -1 row arrays. Ids are saturated to
// [-1, num_experts] before narrowing (as the reference does), so an invalid id stays invalid
// (2**32 never wraps to 0) and the gathered routing has the reference's bits.
__device__ void gather_task(const SchedArgs& a, int task, bool stop) {
  const int n = a.T * a.k;
  const int first = task * blockDim.x + threadIdx.x, stride = a.gather_tasks * blockDim.x;
  // The double-buffer flip happens after every gather task is done: all of them see the same half.
  const int half = a.state[kStateGatherCount] & 1;
  const int64_t off = (static_cast<int64_t>(half) * a.ep + a.rank) * n;
  for (int i = stop ? n : first; i < n; i += stride) {
    const long long w = a.is_int64 ? static_cast<const long long*>(a.top_experts)[i]
                                   : static_cast<long long>(static_cast<const int*>(a.top_experts)[i]);
    const int v = static_cast<int>(w < -1 ? -1 : (w > a.num_experts ? a.num_experts : w));
    for (int q = 0; q < a.ep; ++q) static_cast<int*>(a.route_bufs.p[q])[off + i] = v;
  }
  for (int i = first; i < a.num_experts; i += stride) a.expert_rows_all[i] = 0;
  for (int i = first; i < a.capacity; i += stride) {
    a.row_src_rank[i] = -1;
    a.row_src_slot[i] = -1;
  }
}

// The scan of the count pass, run by its last block: per-expert scan over (rank, chunk) blocks,
// padded offsets, overflow check of every rank (so all ranks raise the same error). s_off: nle + 1
// ints of shared memory. Other blocks' writes are read with .cg loads (never through L1).
__device__ void scan_block(int* chunk_counts, const int* expert_rows_all, int* errors, int* expert_counts,
                           int* expert_offsets, int ep, int nle, int nchunks, int capacity, int* s_off, bool stop) {
  if (stop) {  // the empty schedule
    for (int e = threadIdx.x; e <= nle; e += blockDim.x) {
      if (e < nle) expert_counts[e] = 0;
      expert_offsets[e] = 0;
    }
    return;
  }
  const int J = ep * nchunks;
  for (int e = threadIdx.x; e < nle; e += blockDim.x) {
    int* row = chunk_counts + static_cast<int64_t>(e) * J;
    int run = 0;
    for (int j = 0; j < J; ++j) {
      const int v = __ldcg(row + j);
      row[j] = run;
      run += v;
    }
    expert_counts[e] = run;
    s_off[e] = (run + kRowAlign - 1) / kRowAlign * kRowAlign;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0;
    for (int e = 0; e < nle; ++e) {
      const int v = s_off[e];
      s_off[e] = run;
      run += v;
    }
    s_off[nle] = run;
  }
  __syncthreads();
  for (int e = threadIdx.x; e <= nle; e += blockDim.x) expert_offsets[e] = min(s_off[e], capacity);
  for (int e = threadIdx.x; e < nle; e += blockDim.x) {
    int* row = chunk_counts + static_cast<int64_t>(e) * J;
    for (int j = 0; j < J; ++j) row[j] += s_off[e];
  }
  // Padded rows of every rank (the reference flags the largest one that exceeds the capacity).
  for (int q = threadIdx.x; q < ep; q += blockDim.x) {
    int rows = 0;
    for (int e = 0; e < nle; ++e)
      rows += (__ldcg(expert_rows_all + q * nle + e) + kRowAlign - 1) / kRowAlign * kRowAlign;
    if (rows > capacity) flag_max(errors + kErrCapacityOverflow, rows);
  }
}

// Count task, item j = (source rank r, chunk c): copies the gathered routing into top_all, checks it,
// counts the rows of every local expert in the chunk, and adds every expert's rows to the global
// histogram (integer atomics: the result does not depend on their order). Data written in this
// launch by other blocks or ranks is read with .cg loads (never through L1).
__device__ void count_task(const SchedArgs& a, int j, int* s_hist /* [num_experts] */, bool stop) {
  if (stop) {  // nothing is read; top_all holds -1 (no valid routing)
    const int t = (j % a.nchunks) * kChunk + threadIdx.x;
    int* dst = a.top_all + (static_cast<int64_t>(j / a.nchunks) * a.T + t) * a.k;
    if (t < a.T)
      for (int s = 0; s < a.k; ++s) dst[s] = -1;
    return;
  }
  for (int g = threadIdx.x; g < a.num_experts; g += blockDim.x) s_hist[g] = 0;
  __syncthreads();
  const int c = j % a.nchunks, r = j / a.nchunks;
  const int t = c * kChunk + threadIdx.x;
  const int T = a.T, k = a.k;
  const int half = __ldcg(a.state + kStateGatherParity);
  const int* src = a.routing + (static_cast<int64_t>(half) * a.ep + r) * T * k;
  int* dst = a.top_all + static_cast<int64_t>(r) * T * k;
  if (t < T) {
    for (int s = 0; s < k; ++s) {
      const int g = __ldcg(src + t * k + s);
      dst[t * k + s] = g;
      for (int s2 = 0; s2 < s; ++s2)
        if (__ldcg(src + t * k + s2) == g) flag_max(a.errors + kErrDuplicateExpert, t + 1);
      if (g < 0 || g >= a.num_experts) {
        flag_max(a.errors + kErrExpertIdOutOfRange, t + 1);
      } else {
        atomicAdd(&s_hist[g], 1);
      }
    }
  }
  __syncthreads();
  const int lo = a.rank * a.nle;
  const int J = a.ep * a.nchunks;
  for (int e = threadIdx.x; e < a.nle; e += blockDim.x)
    a.chunk_counts[static_cast<int64_t>(e) * J + r * a.nchunks + c] = s_hist[lo + e];
  for (int g = threadIdx.x; g < a.num_experts; g += blockDim.x)
    if (s_hist[g]) atomicAdd(a.expert_rows_all + g, s_hist[g]);
}

// Fill task (after the scan), item j = (source rank r, chunk c): rank of each pair among the
// chunk's tokens that chose the same expert, from a bitmask of those tokens; writes the pair into
// its row.
__device__ void fill_task(const SchedArgs& a, int j, uint32_t* s_mask /* [nle][kChunk / 32] */, bool stop) {
  if (stop) return;  // the rows stay -1 (gather_task)
  constexpr int W = kChunk / 32;
  for (int i = threadIdx.x; i < a.nle * W; i += blockDim.x) s_mask[i] = 0;
  __syncthreads();
  const int c = j % a.nchunks, r = j / a.nchunks;
  const int t = c * kChunk + threadIdx.x;
  const int k = a.k;
  const int* row = a.top_all + (static_cast<int64_t>(r) * a.T + t) * k;
  const int lo = a.rank * a.nle;
  const int w = threadIdx.x / 32;
  const uint32_t bit = 1u << (threadIdx.x % 32);
  if (t < a.T) {
    for (int s = 0; s < k; ++s) {
      const int e = __ldcg(row + s) - lo;
      if (e >= 0 && e < a.nle) atomicOr(&s_mask[e * W + w], bit);
    }
  }
  __syncthreads();
  if (t < a.T) {
    const int J = a.ep * a.nchunks;
    for (int s = 0; s < k; ++s) {
      const int e = __ldcg(row + s) - lo;
      if (e < 0 || e >= a.nle) continue;
      int before = __popc(s_mask[e * W + w] & (bit - 1));
      for (int ww = 0; ww < w; ++ww) before += __popc(s_mask[e * W + ww]);
      const int pos = __ldcg(a.chunk_counts + static_cast<int64_t>(e) * J + r * a.nchunks + c) + before;
      if (pos < a.capacity) {  // beyond: overflow, flagged by the scan; never written out of bounds
        a.row_src_rank[pos] = r;
        a.row_src_slot[pos] = t * k + s;
      }
    }
  }
}

// Thread 0: waits until state[kStateSchedReleased] >= level; false: the watchdog gave up.
__device__ bool wait_released(const int* released, int level, const Watchdog& w) {
  if (ld_acquire_gpu(released) >= level) return true;
  const uint64_t t0 = globaltimer_ns();
  uint32_t spins = 0;
  while (ld_acquire_gpu(released) < level) {
    if (watchdog_expired(w, t0, spins)) return false;
    __nanosleep(64);
  }
  return true;
}

// All threads, after their writes of a task; true in the block that finished the phase's last task
// (it then sees every task's writes). sys: the task stored into peers' buffers.
__device__ bool finished_phase(int* done, int phase_end, bool sys) {
  __shared__ int s_last;
  if (sys) {
    __threadfence_system();
  } else {
    __threadfence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    s_last = atomicAdd(done, 1) == phase_end - 1;
    if (s_last) __threadfence();
  }
  __syncthreads();
  return s_last != 0;
}

// The whole schedule in one launch. Tasks, claimed in increasing order from a ticket:
//   phase 0: gather_tasks gather tasks; phase 1: J count tasks; phase 2: J fill tasks (J = ep * nchunks).
// The block that finishes the last gather task runs the cross-rank barrier (and the double-buffer
// flip; it carries the call's header, compared before any data that peers stored is read), the one that finishes the last count task runs the scan; each then releases the next
// phase (state[kStateSchedReleased] = 1, then 2). A task waits only for the release of earlier tasks,
// all claimed by blocks that are running, so no co-residency of the grid is assumed: any grid size
// and any other work on the GPU make progress. Every wait has a watchdog (errors[kErrKernelStall]).
// The scheduler slots of state are zero at the start; the last block to exit zeroes them again
// (next launch, CUDA-graph replay).
__global__ void __launch_bounds__(kChunk) schedule_kernel(const SchedArgs a) {
  extern __shared__ int s_buf[];  // count: histogram; scan: padded offsets; fill: bitmasks
  __shared__ int s_task, s_ok, s_stop;
  int* const st = a.state;
  const int J = a.ep * a.nchunks;
  const int end0 = a.gather_tasks, end1 = end0 + J, total = end1 + J;
  const Watchdog w{st + kStateSchedAbort, a.errors, a.watchdog_ns, 1 + a.rank};
  for (;;) {
    if (threadIdx.x == 0) {
      s_task = atomicAdd(st + kStateSchedTicket, 1);
      s_stop = ld_volatile(a.errors + kErrHeaderMismatch) != 0;  // gather: set before this launch
    }
    __syncthreads();
    const int task = s_task;
    if (task >= total) break;
    const int phase = task < end0 ? 0 : (task < end1 ? 1 : 2);
    if (phase > 0) {
      if (threadIdx.x == 0) {
        s_ok = wait_released(st + kStateSchedReleased, phase, w);
        s_stop = ld_volatile(a.errors + kErrHeaderMismatch) != 0;  // count, fill: also by the barrier
      }
      __syncthreads();
      if (!s_ok) break;
    }
    const bool stop = s_stop != 0;
    if (phase == 0) {
      gather_task(a, task, stop);
    } else if (phase == 1) {
      count_task(a, task - end0, s_buf, stop);
    } else {
      fill_task(a, task - end1, reinterpret_cast<uint32_t*>(s_buf), stop);
      __syncthreads();  // s_task and s_buf are reused by the next task
      continue;
    }
    if (finished_phase(st + kStateSchedDone, phase == 0 ? end0 : end1, phase == 0)) {
      if (phase == 0) {
        barrier_block_header(a.flags, st, a.errors, a.rank, a.ep, a.timeout_ns, /*bump_gather=*/1, a.header,
                             /*region: the gather's half*/ 0, /*site=*/0);
      } else {
        scan_block(a.chunk_counts, a.expert_rows_all, a.errors, a.expert_counts, a.expert_offsets, a.ep, a.nle,
                   a.nchunks, a.capacity, s_buf, stop);
      }
      __threadfence();
      __syncthreads();
      if (threadIdx.x == 0) red_release_gpu_add(st + kStateSchedReleased, 1);
    }
  }
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(st + kStateSchedExit, 1) == static_cast<int>(gridDim.x) - 1) {
      __threadfence();
      for (int i = kStateSchedTicket; i <= kStateSchedAbort; ++i) st[i] = 0;
    }
  }
}

}  // namespace

int64_t schedule_scratch_ints(int ep, int T, int nle, int num_experts) {
  const int nchunks = (T + kChunk - 1) / kChunk;
  return static_cast<int64_t>(nle) * ep * nchunks + num_experts;  // chunk_counts, expert_rows_all
}

const char* launch_schedule(const void* top_experts, bool is_int64, const int* routing_buf, const PeerPtrs& route_bufs,
                            const PeerPtrs& flags, int* state, int* errors, int* top_all, int* row_src_rank,
                            int* row_src_slot, int* expert_counts, int* expert_offsets, int* scratch, int rank, int ep,
                            int T, int k, int nle, int num_experts, int capacity, uint64_t timeout_ns,
                            const CallHeader& header, cudaStream_t stream) {
  if (ep < 1 || ep > kMaxPeers || rank < 0 || rank >= ep) return "mok schedule: bad rank / EP size";
  if (num_experts > kMaxExperts) return "mok schedule: more than 8192 experts";
  if (nle > kMaxLocalExperts) return "mok schedule: more than 1024 local experts";
  if (nle * ep != num_experts) return "mok schedule: num_experts != nle * ep";
  if (T <= 0 || k <= 0 || capacity % kRowAlign) return "mok schedule: bad T / k / capacity";
  SchedArgs a{};
  a.top_experts = top_experts;
  a.is_int64 = is_int64 ? 1 : 0;
  a.route_bufs = route_bufs;
  a.routing = routing_buf;
  a.flags = flags;
  a.state = state;
  a.errors = errors;
  a.top_all = top_all;
  a.nchunks = (T + kChunk - 1) / kChunk;
  a.chunk_counts = scratch;
  a.expert_rows_all = scratch + static_cast<int64_t>(nle) * ep * a.nchunks;
  a.row_src_rank = row_src_rank;
  a.row_src_slot = row_src_slot;
  a.expert_counts = expert_counts;
  a.expert_offsets = expert_offsets;
  a.timeout_ns = timeout_ns;
  // Longer than the barrier's own timeout, so a late peer is reported as PEER_TIMEOUT, not a stall.
  constexpr uint64_t kMarginNs = 1000000000ull;
  a.watchdog_ns = timeout_ns > UINT64_MAX - kMarginNs ? UINT64_MAX : timeout_ns + kMarginNs;
  a.rank = rank;
  a.ep = ep;
  a.T = T;
  a.k = k;
  a.nle = nle;
  a.num_experts = num_experts;
  a.capacity = capacity;
  a.header = header;
  const size_t smem = sizeof(int) * std::max({num_experts, nle + 1, nle * (kChunk / 32)});
  // Grid: enough blocks for the J count / fill items and for ~4 gather elements per thread, at most
  // 4 per SM (<= 32 KB smem, 256 threads: all resident at once on sm_90; the tickets do not need it).
  const int J = ep * a.nchunks;
  const int gather_work = std::max({T * k, capacity, num_experts});
  const int blocks = std::max(1, std::min(4 * num_sms(), std::max(J, (gather_work + 4 * kChunk - 1) / (4 * kChunk))));
  a.gather_tasks = blocks;
  schedule_kernel<<<blocks, kChunk, smem, stream>>>(a);
  return launch_status();
}

}  // namespace mok
