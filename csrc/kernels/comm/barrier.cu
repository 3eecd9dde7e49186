// Device-side cross-rank barrier over epoch counters in a symmetric int32 [ep] buffer (see
// barrier.cuh), alone or fused behind the copy of x into this rank's symmetric x buffer.
//
// No NVLink multicast: each rank stores its epoch into every peer's buffer (peer stores over
// NVLink) and polls its own. A peer that does not arrive within the timeout is reported in
// errors[kErrPeerTimeout] = 1 + peer, and the kernel returns. A rank whose host checks failed joins
// its peers' barrier with barrier_reject_kernel (its verdict, no wait); a barrier that finds the
// rank stopped empties the call's schedule when it is given one.
#include <algorithm>

#include "comm/barrier.cuh"

namespace mok {
namespace {

__global__ void barrier_kernel(PeerPtrs flags, int* state, int* errors, int rank, int ep, uint64_t timeout_ns,
                               int bump_gather, int* counts, int* offsets, int nle) {
  barrier_block(flags, state, errors, rank, ep, timeout_ns, bump_gather);
  barrier_empty_schedule(errors, counts, offsets, nle);
}

// The opening half only: this rank's next epoch into every peer's buffer (after the stream's earlier
// kernels, e.g. a GEMM that pushed rows into the peers); a later wait closes it.
__global__ void barrier_open_kernel(PeerPtrs flags, int* state, int rank, int ep) {
  barrier_open_block(flags, state, rank, ep, 0);
}

// A rank whose host checks failed, in the barrier its peers wait in: its next epoch (and the gather
// flip, if that barrier is the schedule's), its verdict record, then the negated epoch, which no
// waiter takes for an arrival. It does not wait: it raises on the host, and the peers stop.
__global__ void barrier_reject_kernel(PeerPtrs flags, int* state, int* errors, int rank, int ep, int bump_gather,
                                      int verdict) {
  __shared__ int s_epoch;
  if (threadIdx.x == 0) {
    barrier_sync_halt(state, errors);
    s_epoch = barrier_next_epoch(state, bump_gather);
  }
  __syncthreads();
  const int epoch = s_epoch;
  if (epoch <= 0) return;  // halted: the peers stopped at an earlier barrier too
  for (int p = threadIdx.x; p < ep; p += blockDim.x) {
    int* rec = verdict_record(flags.p[p], ep, rank);
    rec[0] = epoch;
    rec[1] = verdict;
    st_release_sys(static_cast<int*>(flags.p[p]) + rank, -epoch);  // orders the record before it
  }
}

// dst <- src (16-byte vectors), then the last block to finish opens the barrier: peers read dst
// only after they have seen this rank's epoch, and this rank goes on only after every peer's copy.
__global__ void publish_barrier_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t n16,
                                       PeerPtrs flags, int* state, int* errors, int rank, int ep,
                                       uint64_t timeout_ns, int* counts, int* offsets, int nle) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n16; i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = src[i];
  if (last_block_arrive(state + kStateArrive)) {
    barrier_block(flags, state, errors, rank, ep, timeout_ns, 0);
    barrier_empty_schedule(errors, counts, offsets, nle);
  }
}

}  // namespace

const char* launch_barrier(const PeerPtrs& flags, int* state, int* errors, int rank, int ep, uint64_t timeout_ns,
                           int bump_gather, cudaStream_t stream, int* expert_counts, int* expert_offsets, int nle) {
  if (ep < 1 || ep > kMaxPeers || rank < 0 || rank >= ep) return "mok barrier: bad rank / EP size";
  if ((expert_counts == nullptr) != (expert_offsets == nullptr) || nle < 0)
    return "mok barrier: expert_counts and expert_offsets go together";
  barrier_kernel<<<1, 32, 0, stream>>>(flags, state, errors, rank, ep, timeout_ns, bump_gather, expert_counts,
                                       expert_offsets, nle);
  return launch_status();
}

const char* launch_barrier_open(const PeerPtrs& flags, int* state, int rank, int ep, cudaStream_t stream) {
  if (ep < 1 || ep > kMaxPeers || rank < 0 || rank >= ep) return "mok barrier_open: bad rank / EP size";
  barrier_open_kernel<<<1, 32, 0, stream>>>(flags, state, rank, ep);
  return launch_status();
}

const char* launch_barrier_reject(const PeerPtrs& flags, int* state, int* errors, int rank, int ep, int bump_gather,
                                  int verdict, cudaStream_t stream) {
  if (ep < 1 || ep > kMaxPeers || rank < 0 || rank >= ep) return "mok barrier_reject: bad rank / EP size";
  barrier_reject_kernel<<<1, 32, 0, stream>>>(flags, state, errors, rank, ep, bump_gather, verdict);
  return launch_status();
}

const char* launch_publish_barrier(const void* src, void* dst, int64_t bytes, const PeerPtrs& flags, int* state,
                                   int* errors, int rank, int ep, uint64_t timeout_ns, cudaStream_t stream,
                                   int* expert_counts, int* expert_offsets, int nle) {
  if (ep < 1 || ep > kMaxPeers || rank < 0 || rank >= ep) return "mok publish_barrier: bad rank / EP size";
  if ((expert_counts == nullptr) != (expert_offsets == nullptr) || nle < 0)
    return "mok publish_barrier: expert_counts and expert_offsets go together";
  if (bytes % 16 || (reinterpret_cast<uintptr_t>(src) & 15) || (reinterpret_cast<uintptr_t>(dst) & 15))
    return "mok publish_barrier: src/dst must be 16-byte aligned, a multiple of 16 bytes";
  const int64_t n16 = bytes / 16;
  const int threads = 256;
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n16 + threads - 1) / threads,
                                                                             2 * num_sms())));
  publish_barrier_kernel<<<blocks, threads, 0, stream>>>(static_cast<const uint4*>(src), static_cast<uint4*>(dst),
                                                         n16, flags, state, errors, rank, ep, timeout_ns,
                                                         expert_counts, expert_offsets, nle);
  return launch_status();
}

}  // namespace mok
