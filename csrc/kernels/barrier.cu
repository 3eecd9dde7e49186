// Device-side cross-rank barrier over epoch counters in a symmetric int32 [ep] buffer.
//
// No NVLink multicast: each rank stores its epoch into every peer's buffer (peer stores over
// NVLink) and polls its own. Epochs only grow, so nothing is reset and the kernel replays inside
// a CUDA graph (the epoch lives in device memory). A peer that does not arrive within the
// timeout is reported in errors[kErrPeerTimeout] = 1 + peer, and the kernel returns.
#include "common.cuh"

namespace mok {
namespace {

__global__ void barrier_kernel(PeerPtrs flags, int* state, int* errors, int rank, int ep, uint64_t timeout_ns,
                               int bump_gather) {
  __shared__ int s_epoch;
  if (threadIdx.x == 0) {
    const int e = state[kStateBarrierEpoch] + 1;
    state[kStateBarrierEpoch] = e;
    if (bump_gather) {
      const int g = state[kStateGatherCount];
      state[kStateGatherParity] = g & 1;
      state[kStateGatherCount] = g + 1;
    }
    s_epoch = e;
  }
  __syncthreads();
  const int epoch = s_epoch;
  // Everything this rank wrote before (earlier kernels, peer stores included) is visible
  // system-wide before the peers can observe the new epoch.
  __threadfence_system();
  for (int p = threadIdx.x; p < ep; p += blockDim.x) st_release_sys(static_cast<int*>(flags.p[p]) + rank, epoch);

  const int* mine = static_cast<const int*>(flags.p[rank]);
  const bool dead = ld_volatile(errors + kErrPeerTimeout) != 0;  // a peer already stalled: do not wait again
  for (int p = threadIdx.x; p < ep; p += blockDim.x) {
    if (dead) break;
    const uint64_t t0 = globaltimer_ns();
    uint32_t spins = 0;
    while (ld_acquire_sys(mine + p) < epoch) {
      if ((++spins & 255) == 0 && globaltimer_ns() - t0 > timeout_ns) {
        atomicCAS(errors + kErrPeerTimeout, 0, 1 + p);
        break;
      }
    }
  }
  __syncthreads();
}

}  // namespace

const char* launch_barrier(const PeerPtrs& flags, int* state, int* errors, int rank, int ep, uint64_t timeout_ns,
                           int bump_gather, cudaStream_t stream) {
  if (ep < 1 || ep > kMaxPeers || rank < 0 || rank >= ep) return "mok barrier: bad rank / EP size";
  barrier_kernel<<<1, 32, 0, stream>>>(flags, state, errors, rank, ep, timeout_ns, bump_gather);
  return launch_status();
}

}  // namespace mok
