// Device pieces of the cross-rank barrier (epoch counters in a symmetric int32 [ep] buffer per
// rank, no NVLink multicast), so that other kernels can open or close a barrier themselves:
//   barrier_arrive: this rank's next epoch -> slot `rank` of every peer's buffer (st.release.sys);
//   barrier_wait:   own buffer's slots >= epoch (ld.acquire.sys), %globaltimer timeout ->
//                   errors[kErrPeerTimeout] = 1 + peer; skipped once that flag is set. A slot other
//                   than the epoch itself is checked against that peer's verdict record (below).
// Epochs only grow (state[kStateBarrierEpoch], device memory), so nothing is reset and CUDA-graph
// replay works. Ranks must issue the same sequence of arrive/wait pairs.
//   barrier_block_header: a whole-block barrier that also carries the call's header (CallHeader):
//                   stored with the epoch, compared after the wait -> errors[kErrHeaderMismatch].
// A rank whose host checks failed stores its verdict record and then the negated epoch
// (barrier_reject, barrier.cu); a waiter that finds the record for its epoch sets
// errors[kErrHeaderMismatch] = -(1 + peer). Once errors[kErrHeaderMismatch] is set (a verdict or a
// header mismatch), this rank's barriers open nothing and wait for nothing (state[kStateHalted]
// mirrors the flag for the kernels that open a barrier without the error tensor) until the host
// clears it: every rank stops at the same barrier, so the epochs stay in step.
#pragma once

#include "common.cuh"

namespace mok {

// One thread: the new epoch of this rank (optionally also flips the routing double buffer); 0 while
// halted (nothing is bumped, barrier_arrive stores nothing, barrier_wait returns).
__device__ __forceinline__ int barrier_next_epoch(int* state, int bump_gather) {
  if (state[kStateHalted] != 0) return 0;
  const int e = state[kStateBarrierEpoch] + 1;
  state[kStateBarrierEpoch] = e;
  if (bump_gather) {
    const int g = state[kStateGatherCount];
    state[kStateGatherParity] = g & 1;
    state[kStateGatherCount] = g + 1;
  }
  return e;
}

// Threads tid = 0..nthreads-1 of the caller share the peer loop. Everything the calling thread has
// observed (earlier kernels; other CTAs through an acquire) is visible system-wide first.
__device__ __forceinline__ void barrier_arrive(const PeerPtrs& flags, int rank, int ep, int epoch, int tid,
                                               int nthreads) {
  if (epoch <= 0) return;  // halted
  __threadfence_system();
  for (int p = tid; p < ep; p += nthreads) st_release_sys(static_cast<int*>(flags.p[p]) + rank, epoch);
}

// Rank `src`'s verdict record {epoch it rejected, verdict word} in a barrier buffer (api.h layout).
__device__ __forceinline__ int* verdict_record(void* buf, int ep, int src) {
  return static_cast<int*>(buf) + ep + static_cast<int64_t>(kHeaderRegions) * ep * kHeaderWords +
         static_cast<int64_t>(src) * kVerdictWords;
}

// A peer stalled, or a peer rejected its input / a header differed: waits end at once.
__device__ __forceinline__ bool barrier_stopped(const int* errors) {
  return ld_volatile(errors + kErrPeerTimeout) != 0 || ld_volatile(errors + kErrHeaderMismatch) != 0;
}

// What peer p's slot value v tells a rank waiting for `epoch`: 1 p arrived (v == epoch, or it is
// past it), 0 not yet, -1 p rejected its input at this barrier (flagged). Only v != epoch reads the
// record: the marker -e and a peer that is ahead both may carry a rejection at `epoch` (its record
// is stored before the slot, so the acquire of v sees it).
__device__ __forceinline__ int peer_arrival(const int* mine, int ep, int p, int v, int epoch, int* errors) {
  if (v == epoch) return 1;
  if (v >= 0 && v < epoch) return 0;
  const int* rec = verdict_record(const_cast<int*>(mine), ep, p);
  if (ld_volatile(rec) == epoch) {
    if (atomicCAS(errors + kErrHeaderMismatch, 0, -(1 + p)) == 0)
      atomicExch(errors + kErrHeaderValue, ld_volatile(rec + 1));
    return -1;
  }
  return v > epoch || -v > epoch ? 1 : 0;  // -v < epoch: a stale marker of an earlier call
}

__device__ __forceinline__ void barrier_wait(const int* mine, int ep, int epoch, int* errors, uint64_t timeout_ns,
                                             int tid, int nthreads) {
  // halted (epoch 0), a peer already stalled or rejected: do not wait
  if (epoch <= 0 || barrier_stopped(errors)) return;
  for (int p = tid; p < ep; p += nthreads) {
    int a = peer_arrival(mine, ep, p, ld_acquire_sys(mine + p), epoch, errors);
    if (a > 0) continue;
    if (a < 0) return;
    const uint64_t t0 = globaltimer_ns();
    uint32_t spins = 0;
    while ((a = peer_arrival(mine, ep, p, ld_acquire_sys(mine + p), epoch, errors)) == 0) {
      if ((++spins & 255) == 0) {
        if (barrier_stopped(errors)) return;  // another waiter gave up or saw a rejection
        if (globaltimer_ns() - t0 > timeout_ns) {
          atomicCAS(errors + kErrPeerTimeout, 0, 1 + p);
          return;
        }
      }
    }
    if (a < 0) return;
  }
}

// Thread 0 of a barrier that has the error tensor: state[kStateHalted] = whether
// errors[kErrHeaderMismatch] is set (the host clears both by clearing the flag).
__device__ __forceinline__ void barrier_sync_halt(int* state, const int* errors) {
  state[kStateHalted] = ld_volatile(errors + kErrHeaderMismatch) != 0;
}

// The opening half of a whole-block barrier (all threads of one CTA call it): the block's new epoch
// into every peer's buffer. Returns the epoch (a later barrier_wait on it closes the barrier).
__device__ __forceinline__ int barrier_open_block(const PeerPtrs& flags, int* state, int rank, int ep,
                                                  int bump_gather) {
  __shared__ int s_epoch;
  if (threadIdx.x == 0) s_epoch = barrier_next_epoch(state, bump_gather);
  __syncthreads();
  const int epoch = s_epoch;
  barrier_arrive(flags, rank, ep, epoch, threadIdx.x, blockDim.x);
  return epoch;
}

// Whole-block barrier (all threads of one CTA call it).
__device__ __forceinline__ void barrier_block(const PeerPtrs& flags, int* state, int* errors, int rank, int ep,
                                              uint64_t timeout_ns, int bump_gather) {
  if (threadIdx.x == 0) barrier_sync_halt(state, errors);  // before barrier_open_block's thread 0 reads it
  const int epoch = barrier_open_block(flags, state, rank, ep, bump_gather);
  barrier_wait(static_cast<const int*>(flags.p[rank]), ep, epoch, errors, timeout_ns, threadIdx.x, blockDim.x);
  __syncthreads();
  if (threadIdx.x == 0) barrier_sync_halt(state, errors);  // a rejection seen here halts what follows
}

// All threads of the block, after a barrier: once this rank is stopped, the call's schedule (if
// given: counts [nle], offsets [nle + 1]) becomes empty, so the kernels after the barrier, which move
// only rows below offsets[nle], touch no peer's buffer.
__device__ __forceinline__ void barrier_empty_schedule(const int* errors, int* counts, int* offsets, int nle) {
  if (offsets == nullptr || ld_volatile(errors + kErrHeaderMismatch) == 0) return;
  for (int e = threadIdx.x; e <= nle; e += blockDim.x) {
    if (e < nle) counts[e] = 0;
    offsets[e] = 0;
  }
}

// ---- the per-call header (CallHeader, api.h) ------------------------------------------------
// Rank `src`'s header in region `region` of a barrier buffer (after the ep epoch slots).
__device__ __forceinline__ int* header_slot(void* buf, int ep, int region, int src) {
  return static_cast<int*>(buf) + ep + (static_cast<int64_t>(region) * ep + src) * kHeaderWords;
}

// Thread 0, after the barrier's wait: every rank's header in this rank's buffer against this rank's
// own. The first disagreement (lowest peer, then word) goes into errors[kErrHeaderMismatch] (the first
// one recorded stays) and the peer's word into errors[kErrHeaderValue]. Skipped after a peer timeout
// (the peers' headers may not have arrived) and once the flag is set (a peer's verdict came first).
__device__ __forceinline__ void header_check(const PeerPtrs& flags, const CallHeader& h, int* errors, int rank,
                                             int ep, int region, int site) {
  if (barrier_stopped(errors)) return;
  for (int p = 0; p < ep; ++p) {
    if (p == rank) continue;
    const int* theirs = header_slot(flags.p[rank], ep, region, p);
    for (int w = 0; w < kHeaderWords; ++w) {
      const int v = ld_acquire_sys(theirs + w);
      if (v == h.words[w]) continue;
      if (atomicCAS(errors + kErrHeaderMismatch, 0, 1 + w + kHeaderWords * (site + 2 * p)) == 0)
        atomicExch(errors + kErrHeaderValue, v);
      return;
    }
  }
}

// barrier_block with a header (all threads of one CTA call it): this rank's header goes into its
// slot of region `region` (bump_gather: the routing double-buffer half being gathered, else
// `region`) of every peer's buffer, by the thread that then stores the epoch there (st.release
// orders the two); after the wait thread 0 compares the headers. h.words[0] == 0: barrier_block.
// Halted: nothing is stored, nothing waited for or compared.
__device__ __forceinline__ void barrier_block_header(const PeerPtrs& flags, int* state, int* errors, int rank,
                                                     int ep, uint64_t timeout_ns, int bump_gather,
                                                     const CallHeader& h, int region, int site) {
  if (h.words[0] == 0) {
    barrier_block(flags, state, errors, rank, ep, timeout_ns, bump_gather);
    return;
  }
  __shared__ int s_epoch, s_region;
  if (threadIdx.x == 0) {
    barrier_sync_halt(state, errors);
    s_region = bump_gather ? (state[kStateGatherCount] & 1) : region;
    s_epoch = barrier_next_epoch(state, bump_gather);
  }
  __syncthreads();
  const int epoch = s_epoch, reg = s_region;
  if (epoch > 0) {
    __threadfence_system();
    for (int p = threadIdx.x; p < ep; p += blockDim.x) {
      int* dst = header_slot(flags.p[p], ep, reg, rank);
      for (int w = 0; w < kHeaderWords; ++w) dst[w] = h.words[w];
      st_release_sys(static_cast<int*>(flags.p[p]) + rank, epoch);
    }
  }
  barrier_wait(static_cast<const int*>(flags.p[rank]), ep, epoch, errors, timeout_ns, threadIdx.x, blockDim.x);
  __syncthreads();
  if (threadIdx.x == 0) {
    header_check(flags, h, errors, rank, ep, reg, site);
    barrier_sync_halt(state, errors);
  }
  __syncthreads();
}

// All threads of every block call it after their global writes; true in exactly one block, the last
// to arrive, which then sees every block's writes (and resets the counter for the next launch).
__device__ __forceinline__ bool last_block_arrive(int* counter) {
  __shared__ int s_last;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int total = gridDim.x * gridDim.y * gridDim.z;
    const int last = atomicAdd(counter, 1) == total - 1;
    if (last) {
      *counter = 0;
      __threadfence();
    }
    s_last = last;
  }
  __syncthreads();
  return s_last != 0;
}

}  // namespace mok
