// Device pieces of the cross-rank barrier (epoch counters in a symmetric int32 [ep] buffer per
// rank, no NVLink multicast), so that other kernels can open or close a barrier themselves:
//   barrier_arrive: this rank's next epoch -> slot `rank` of every peer's buffer (st.release.sys);
//   barrier_wait:   own buffer's slots >= epoch (ld.acquire.sys), %globaltimer timeout ->
//                   errors[kErrPeerTimeout] = 1 + peer; skipped once that flag is set.
// Epochs only grow (state[kStateBarrierEpoch], device memory), so nothing is reset and CUDA-graph
// replay works. Ranks must issue the same sequence of arrive/wait pairs.
//   barrier_block_header: a whole-block barrier that also carries the call's header (CallHeader):
//                   stored with the epoch, compared after the wait -> errors[kErrHeaderMismatch].
#pragma once

#include "common.cuh"

namespace mok {

// One thread: the new epoch of this rank (optionally also flips the routing double buffer).
__device__ __forceinline__ int barrier_next_epoch(int* state, int bump_gather) {
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
  __threadfence_system();
  for (int p = tid; p < ep; p += nthreads) st_release_sys(static_cast<int*>(flags.p[p]) + rank, epoch);
}

__device__ __forceinline__ void barrier_wait(const int* mine, int ep, int epoch, int* errors, uint64_t timeout_ns,
                                             int tid, int nthreads) {
  if (ld_volatile(errors + kErrPeerTimeout) != 0) return;  // a peer already stalled: do not wait again
  for (int p = tid; p < ep; p += nthreads) {
    if (ld_acquire_sys(mine + p) >= epoch) continue;
    const uint64_t t0 = globaltimer_ns();
    uint32_t spins = 0;
    while (ld_acquire_sys(mine + p) < epoch) {
      if ((++spins & 255) == 0) {
        if (ld_volatile(errors + kErrPeerTimeout) != 0) return;  // another waiter gave up
        if (globaltimer_ns() - t0 > timeout_ns) {
          atomicCAS(errors + kErrPeerTimeout, 0, 1 + p);
          return;
        }
      }
    }
  }
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
  const int epoch = barrier_open_block(flags, state, rank, ep, bump_gather);
  barrier_wait(static_cast<const int*>(flags.p[rank]), ep, epoch, errors, timeout_ns, threadIdx.x, blockDim.x);
  __syncthreads();
}

// ---- the per-call header (CallHeader, api.h) ------------------------------------------------
// Rank `src`'s header in region `region` of a barrier buffer (after the ep epoch slots).
__device__ __forceinline__ int* header_slot(void* buf, int ep, int region, int src) {
  return static_cast<int*>(buf) + ep + (static_cast<int64_t>(region) * ep + src) * kHeaderWords;
}

// Thread 0, after the barrier's wait: every rank's header in this rank's buffer against this rank's
// own. The first disagreement (lowest peer, then word) goes into errors[kErrHeaderMismatch] (the first
// one recorded stays) and the peer's word into errors[kErrHeaderValue]. Skipped after a peer timeout
// (the peers' headers may not have arrived).
__device__ __forceinline__ void header_check(const PeerPtrs& flags, const CallHeader& h, int* errors, int rank,
                                             int ep, int region, int site) {
  if (ld_volatile(errors + kErrPeerTimeout) != 0) return;
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
__device__ __forceinline__ void barrier_block_header(const PeerPtrs& flags, int* state, int* errors, int rank,
                                                     int ep, uint64_t timeout_ns, int bump_gather,
                                                     const CallHeader& h, int region, int site) {
  if (h.words[0] == 0) {
    barrier_block(flags, state, errors, rank, ep, timeout_ns, bump_gather);
    return;
  }
  __shared__ int s_epoch, s_region;
  if (threadIdx.x == 0) {
    s_region = bump_gather ? (state[kStateGatherCount] & 1) : region;
    s_epoch = barrier_next_epoch(state, bump_gather);
  }
  __syncthreads();
  const int epoch = s_epoch, reg = s_region;
  __threadfence_system();
  for (int p = threadIdx.x; p < ep; p += blockDim.x) {
    int* dst = header_slot(flags.p[p], ep, reg, rank);
    for (int w = 0; w < kHeaderWords; ++w) dst[w] = h.words[w];
    st_release_sys(static_cast<int*>(flags.p[p]) + rank, epoch);
  }
  barrier_wait(static_cast<const int*>(flags.p[rank]), ep, epoch, errors, timeout_ns, threadIdx.x, blockDim.x);
  __syncthreads();
  if (threadIdx.x == 0) header_check(flags, h, errors, rank, ep, reg, site);
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
