// Host-side launchers of the mok kernels: plain C++ with raw pointers and a cudaStream_t, so the
// kernel files need no torch headers. csrc/bindings.cpp wraps them as torch ops.
//
// Every launcher returns nullptr on success, else a static error message.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace mok {

constexpr int kMaxPeers = 72;  // an NVLink domain (NVL72); the EP size may be anything up to this

// One address per rank of the EP group (rank order): peers' symmetric buffers.
struct PeerPtrs {
  void* p[kMaxPeers];
};

// Indices of the per-workspace int32 `state` tensor (local, not symmetric).
enum StateSlot : int {
  kStateBarrierEpoch = 0,  // barriers this rank has entered (monotonic epoch)
  kStateGatherCount = 1,   // routing all-gathers issued (selects the double-buffer half)
  kStateGatherParity = 2,  // half of the routing buffer that the current schedule reads
  kStateInts = 8,
};

// Routing all-gather: writes top_experts (int32/int64 [T, k], n = T * k values), saturated to
// [-1, num_experts], as int32 into half (state[kStateGatherCount] & 1) of every rank's symmetric
// [2, ep, T, k] buffer, row `rank`.
const char* launch_gather_routing(const void* top_experts, bool is_int64, int n, const PeerPtrs& bufs,
                                  const int* state, int rank, int ep, int num_experts, cudaStream_t stream);

// Cross-rank barrier on epoch counters: each rank stores its new epoch into slot `rank` of every
// peer's symmetric int32 [ep] flag buffer (st.release.sys), then waits (ld.acquire.sys) until all
// slots of its own buffer reach the epoch, for at most timeout_ns; a timeout writes 1 + peer into
// errors[kErrPeerTimeout] and returns instead of hanging. Later barriers skip waiting once that
// flag is set. bump_gather: also advance the routing double buffer (after the all-gather).
const char* launch_barrier(const PeerPtrs& flags, int* state, int* errors, int rank, int ep, uint64_t timeout_ns,
                           int bump_gather, cudaStream_t stream);

// Scratch int32 elements that launch_schedule needs.
int64_t schedule_scratch_ints(int ep, int T, int nle, int num_experts);

// The routed-row schedule of docs/ARCHITECTURE.md from the gathered routing (half
// state[kStateGatherParity] of routing_buf [2, ep, T, k]). Writes top_all [ep, T, k] (a copy),
// row_src_rank / row_src_slot [capacity], expert_counts [nle], expert_offsets [nle + 1]; flags
// bad expert ids, duplicates and capacity overflow (of any rank) into errors.
const char* launch_schedule(const int* routing_buf, const int* state, int* errors, int* top_all, int* row_src_rank,
                            int* row_src_slot, int* expert_counts, int* expert_offsets, int* scratch, int rank,
                            int ep, int T, int k, int nle, int num_experts, int capacity, cudaStream_t stream);

// Pull-dispatch: routed row i (i < min(expert_offsets[nle], capacity)) <- row
// row_src_slot[i] / k of rank row_src_rank[i]'s symmetric x [T, H]; padding rows are zeroed.
const char* launch_dispatch(const int* row_src_rank, const int* row_src_slot, const int* expert_offsets, int nle,
                            int capacity, const PeerPtrs& x_bufs, void* x_routed, int H, int k, int num_ctas,
                            cudaStream_t stream);

// Grouped GEMM out[r, :] = A[r, :] @ B[seg(r)]^T (bf16 in, fp32 accumulate, bf16 out), wgmma + TMA,
// warp-specialised, persistent. Segments: seg_offsets [nseg + 1] on the device (128-aligned,
// rows >= min(seg_offsets[nseg], a_rows) are not computed) or, when seg_offsets is null, one
// segment of a_rows rows. seg_counts [nseg] (optional): real rows of each segment; the rest of a
// segment must be zero rows of A (their outputs are written as zeros without computing them).
// B is [nseg * b_rows_per_seg, K]. swiglu: B rows of a segment are [gate (N); up (N)] and
// out = silu(A gate^T) * (A up^T) (N = out columns).
const char* launch_grouped_gemm(bool swiglu, const void* A, int64_t a_rows, int K, const void* B,
                                int b_rows_per_seg, const int* seg_offsets, const int* seg_counts, int nseg,
                                void* out, int N, int num_ctas, cudaStream_t stream);

// Push-combine: routed row i's output y[i] -> slot row_src_slot[i] of rank row_src_rank[i]'s
// symmetric combine buffer [T * k, H]. Slots are unique: plain stores, no atomics.
const char* launch_combine(const void* y, const int* row_src_rank, const int* row_src_slot, const int* expert_offsets,
                           int nle, int capacity, const PeerPtrs& comb_bufs, int H, int num_ctas, cudaStream_t stream);

// out[t] = sum_{s < k} probs[t, s] * comb[t * k + s] (fp32, slot order, no contraction)
//          + shared_y[t] (if not null); cast once to bf16.
const char* launch_epilogue(const void* comb, const float* probs, const void* shared_y, void* out, int T, int k, int H,
                            cudaStream_t stream);

}  // namespace mok
