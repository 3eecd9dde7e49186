// The staged backward's transfers and elementwise launches; the expert GEMMs (expert_dgrad,
// expert_wgrad and their e4m3 forms) run between them.
//
//   bwd_publish:   grad_out and the router weights into this rank's symmetric buffers, a barrier
//                  (carrying the backward's call header, compared before any peer buffer is read)
//   bwd_pull:      routed row i pulls grad_out row (token of row_src_slot[i]) and its router weight
//                  from the source rank into g_rows[i] (as it is) and row_w[i]    1 launch
//   bwd_dprobs:    after the down projection's dgrad: routed row i's router-weight gradient, the
//                  sum of the dgrad epilogue's per-64-column dot pieces in column order, into slot
//                  row_src_slot[i] of the source rank's symmetric [T * k] fp32 buffer  1 launch
//   bwd_push:      routed row i's dx row -> slot row_src_slot[i] of the source rank's symmetric
//                  [T * k, H] buffer; the last block opens the closing barrier       1 launch
//   bwd_epilogue:  closes the barrier, dx[t] = sum_s slot[t, s] in slot order (fp32, no
//                  contraction) + shared dx, cast once; dprobs <- the pushed [T * k] gradients
//
// Determinism: no float atomics; every sum has a fixed order (the dot pieces: per lane in column
// order, a butterfly over 8 lanes, then the pieces in column order); slots are unique, so pushes
// are plain stores. Nothing depends on the CTA counts.
#include <algorithm>

#include "comm/barrier.cuh"
#include "comm/pull.cuh"

namespace mok {
namespace {

// ---- publish ----------------------------------------------------------------------------------

__global__ void bwd_publish_kernel(const uint4* __restrict__ g, uint4* __restrict__ g_dst, int64_t g16,
                                   const int* __restrict__ p, int* __restrict__ p_dst, int64_t p4, PeerPtrs flags,
                                   int* state, int* errors, int rank, int ep, uint64_t timeout_ns,
                                   CallHeader header, int* counts, int* offsets, int nle) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < g16; i += stride) g_dst[i] = g[i];
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < p4; i += stride) p_dst[i] = p[i];
  if (last_block_arrive(state + kStateArrive)) {
    barrier_block_header(flags, state, errors, rank, ep, timeout_ns, 0, header, /*region=*/2, /*site=*/1);
    barrier_empty_schedule(errors, counts, offsets, nle);  // stopped: no later kernel moves a row
  }
}

// ---- pull ------------------------------------------------------------------------------------

// kQuant (the fp8 dgrad): the rows also quantized on the way (pull_grad_row_e4m3), into q [rows, H]
// e4m3 and scale [H / 128][scale_ld].
template <bool kQuant>
__global__ void bwd_pull_kernel(const int* __restrict__ row_src_rank, const int* __restrict__ row_src_slot,
                                const int* __restrict__ expert_offsets, int nle, int capacity, PeerPtrs g_bufs,
                                PeerPtrs p_bufs, __nv_bfloat16* __restrict__ g_rows, float* __restrict__ row_w, int H,
                                int k, uint8_t* __restrict__ q, float* __restrict__ scale, int64_t scale_ld) {
  const int total = min(expert_offsets[nle], capacity);
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  for (int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; t < total; t += warps) {
    if constexpr (kQuant) {
      pull_grad_row_e4m3(t, g_rows + static_cast<int64_t>(t) * H, row_w, q + static_cast<int64_t>(t) * H, scale,
                         scale_ld, row_src_rank, row_src_slot, g_bufs, p_bufs, H, k, lane);
    } else {
      pull_grad_row(t, g_rows + static_cast<int64_t>(t) * H, row_w, row_src_rank, row_src_slot, g_bufs, p_bufs, H, k,
                    lane);
    }
  }
}

// ---- router-weight gradients --------------------------------------------------------------------

__global__ void bwd_dprobs_kernel(const float* __restrict__ dot, int dot_ld, const int* __restrict__ row_src_rank,
                                  const int* __restrict__ row_src_slot, const int* __restrict__ expert_offsets,
                                  int nle, int capacity, PeerPtrs dw_bufs) {
  const int total = min(expert_offsets[nle], capacity);
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < total; r += gridDim.x * blockDim.x) {
    const int src = row_src_rank[r];
    if (src < 0) continue;
    const float* pieces = dot + static_cast<int64_t>(r) * dot_ld;
    float sum = 0.f;
    for (int j = 0; j < dot_ld; ++j) sum = __fadd_rn(sum, pieces[j]);
    static_cast<float*>(dw_bufs.p[src])[row_src_slot[r]] = sum;
  }
}

// ---- push dx rows (+ opening half of the closing barrier) --------------------------------------

__global__ void bwd_push_kernel(const __nv_bfloat16* __restrict__ rows_in, const int* __restrict__ row_src_rank,
                                const int* __restrict__ row_src_slot, const int* __restrict__ expert_offsets, int nle,
                                int capacity, PeerPtrs slot_bufs, int H, PeerPtrs flags, int* state, int rank,
                                int ep) {
  push_rows_to_source_slots(rows_in, row_src_rank, row_src_slot, expert_offsets, nle, capacity, slot_bufs, H);
  // every block fenced its pushes (system scope) in last_block_arrive; the last one arrives for the
  // rank: the epilogue (bwd_epilogue with wait_flags) closes the barrier
  if (last_block_arrive(state + kStateArrive)) barrier_open_block(flags, state, rank, ep, 0);
}

// ---- epilogue ---------------------------------------------------------------------------------

// grid (ceil(H / 8 / blockDim), T): one thread per 8 columns of one token.
__global__ void bwd_epilogue_kernel(const __nv_bfloat16* __restrict__ slots, const float* __restrict__ dw_slots,
                                    const __nv_bfloat16* __restrict__ shared_dx, __nv_bfloat16* __restrict__ dx,
                                    float* __restrict__ dprobs, int k, int H, const int* wait_flags, const int* state,
                                    int* errors, int ep, uint64_t timeout_ns) {
  if (wait_flags != nullptr) {
    if (threadIdx.x == 0) barrier_wait(wait_flags, ep, state[kStateBarrierEpoch], errors, timeout_ns, 0, 1);
    __syncthreads();
  }
  const int64_t t = blockIdx.y;
  if (blockIdx.x == 0)
    for (int s = threadIdx.x; s < k; s += blockDim.x) dprobs[t * k + s] = __ldcg(dw_slots + t * k + s);
  const int c8 = blockIdx.x * blockDim.x + threadIdx.x;
  if (c8 * 8 >= H) return;
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.f;
  for (int s = 0; s < k; ++s) {
    float f[8];
    // .cg: peers wrote the slots during this backward (never through this SM's L1)
    unpack8(__ldcg(reinterpret_cast<const uint4*>(slots + (t * k + s) * H + c8 * 8)), f);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], f[j]);
  }
  if (shared_dx != nullptr) {
    float f[8];
    unpack8(ld16(shared_dx + t * H + c8 * 8), f);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], f[j]);
  }
  st16(dx + t * H + c8 * 8, pack8(acc));
}

}  // namespace

const char* launch_bwd_publish(const void* g, void* g_dst, int64_t g_bytes, const void* p, void* p_dst,
                               int64_t p_bytes, const PeerPtrs& flags, int* state, int* errors, int rank, int ep,
                               uint64_t timeout_ns, const CallHeader& header, cudaStream_t stream, int* expert_counts,
                               int* expert_offsets, int nle) {
  if (ep < 1 || ep > kMaxPeers || rank < 0 || rank >= ep) return "mok bwd_publish: bad rank / EP size";
  if ((expert_counts == nullptr) != (expert_offsets == nullptr) || nle < 0)
    return "mok bwd_publish: the schedule's counts and offsets go together";
  if (g_bytes % 16 || !aligned16(g) || !aligned16(g_dst)) return "mok bwd_publish: grad_out must be 16-byte aligned";
  if (p_bytes % 4 || (reinterpret_cast<uintptr_t>(p) & 3) || (reinterpret_cast<uintptr_t>(p_dst) & 3))
    return "mok bwd_publish: probs must be 4-byte aligned";
  const int64_t g16 = g_bytes / 16, p4 = p_bytes / 4;
  const int threads = 256;
  const int blocks = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>((std::max(g16, p4) + threads - 1) / threads, 2 * num_sms())));
  bwd_publish_kernel<<<blocks, threads, 0, stream>>>(static_cast<const uint4*>(g), static_cast<uint4*>(g_dst), g16,
                                                     static_cast<const int*>(p), static_cast<int*>(p_dst), p4, flags,
                                                     state, errors, rank, ep, timeout_ns, header, expert_counts,
                                                     expert_offsets, nle);
  return launch_status();
}

const char* launch_bwd_pull(const int* row_src_rank, const int* row_src_slot, const int* expert_offsets, int nle,
                            int capacity, const PeerPtrs& g_bufs, const PeerPtrs& p_bufs, void* g_rows,
                            float* row_w, int H, int k, int num_ctas, cudaStream_t stream, void* q, float* scale,
                            int64_t scale_ld) {
  if (H % 8) return "mok bwd_pull: H must be a multiple of 8";
  if (!aligned16(g_rows) || row_w == nullptr) return "mok bwd_pull: g_rows must be 16-byte aligned, row_w given";
  if (q != nullptr && (H % 128 || scale == nullptr || !aligned16(q)))
    return "mok bwd_pull: quantizing the rows needs H a multiple of 128, scales and 16-byte aligned q";
  if (num_ctas <= 0) num_ctas = tuning::kCopyCtasPerSm * num_sms();
  auto kernel = q != nullptr ? bwd_pull_kernel<true> : bwd_pull_kernel<false>;
  kernel<<<num_ctas, 256, 0, stream>>>(row_src_rank, row_src_slot, expert_offsets, nle, capacity, g_bufs, p_bufs,
                                       static_cast<__nv_bfloat16*>(g_rows), row_w, H, k, static_cast<uint8_t*>(q),
                                       scale, scale_ld);
  return launch_status();
}

const char* launch_bwd_dprobs(const float* dot, int dot_ld, const int* row_src_rank, const int* row_src_slot,
                              const int* expert_offsets, int nle, int capacity, const PeerPtrs& dw_bufs,
                              cudaStream_t stream) {
  if (dot == nullptr || dot_ld <= 0) return "mok bwd_dprobs: needs the dot pieces";
  const int threads = 256;
  const int blocks = std::max(1, std::min((capacity + threads - 1) / threads, 4 * num_sms()));
  bwd_dprobs_kernel<<<blocks, threads, 0, stream>>>(dot, dot_ld, row_src_rank, row_src_slot, expert_offsets, nle,
                                                    capacity, dw_bufs);
  return launch_status();
}

const char* launch_bwd_push(const void* rows, const int* row_src_rank, const int* row_src_slot,
                            const int* expert_offsets, int nle, int capacity, const PeerPtrs& slot_bufs, int H,
                            const PeerPtrs& flags, int* state, int rank, int ep, int num_ctas,
                            cudaStream_t stream) {
  if (H % 8) return "mok bwd_push: H must be a multiple of 8";
  if (ep < 1 || ep > kMaxPeers || rank < 0 || rank >= ep) return "mok bwd_push: bad rank / EP size";
  if (!aligned16(rows)) return "mok bwd_push: rows must be 16-byte aligned";
  if (num_ctas <= 0) num_ctas = tuning::kCopyCtasPerSm * num_sms();
  bwd_push_kernel<<<num_ctas, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(rows), row_src_rank, row_src_slot,
                                                 expert_offsets, nle, capacity, slot_bufs, H, flags, state, rank, ep);
  return launch_status();
}

const char* launch_bwd_epilogue(const void* slots, const float* dw_slots, const void* shared_dx, void* dx,
                                float* dprobs, int T, int k, int H, const int* wait_flags, const int* state,
                                int* errors, int ep, uint64_t timeout_ns, cudaStream_t stream) {
  if (wait_flags != nullptr && (state == nullptr || errors == nullptr || ep < 1 || ep > kMaxPeers))
    return "mok bwd_epilogue: the barrier wait needs state, errors and the EP size";
  if (H % 8) return "mok bwd_epilogue: H must be a multiple of 8";
  if (T <= 0) return nullptr;
  if (T > 65535) return "mok bwd_epilogue: more than 65535 tokens";
  const int threads = 128;
  dim3 grid((H / 8 + threads - 1) / threads, T);
  bwd_epilogue_kernel<<<grid, threads, 0, stream>>>(static_cast<const __nv_bfloat16*>(slots), dw_slots,
                                                    static_cast<const __nv_bfloat16*>(shared_dx),
                                                    static_cast<__nv_bfloat16*>(dx), dprobs, k, H, wait_flags, state,
                                                    errors, ep, timeout_ns);
  return launch_status();
}

}  // namespace mok
