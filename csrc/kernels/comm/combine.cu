// Push-combine and the fixed-order epilogue.
//
// combine: every real routed row writes its expert output into its unique slot (token * k + s) of
// the source rank's symmetric [T * k, H] buffer (16-byte stores over NVLink, no atomics).
// epilogue: after a barrier, each rank sums its k slots per token in slot order in fp32 with
// explicit round-to-nearest multiplies and adds (no FMA contraction, so the bits depend only on the
// inputs), adds the shared expert output, and casts once. With `errors` it also flags NaN/inf router
// weights (errors[kErrNonfiniteProbs] = max(it, 1 + token), as functional.flag_nonfinite_probs):
// the weights pass through it anyway, so the staged forward needs no separate check launches.
#include "comm/barrier.cuh"

namespace mok {
namespace {

__global__ void combine_kernel(const __nv_bfloat16* __restrict__ y, const int* __restrict__ row_src_rank,
                               const int* __restrict__ row_src_slot, const int* __restrict__ expert_offsets, int nle,
                               int capacity, PeerPtrs comb_bufs, int H) {
  push_rows_to_source_slots(y, row_src_rank, row_src_slot, expert_offsets, nle, capacity, comb_bufs, H);
}

// grid (ceil(H / 8 / blockDim), T): one thread per 8 columns of one token; the token's first
// thread checks its weights.
__global__ void epilogue_kernel(const __nv_bfloat16* __restrict__ comb, const float* __restrict__ probs,
                                const __nv_bfloat16* __restrict__ shared_y, __nv_bfloat16* __restrict__ out, int k,
                                int H, const int* wait_flags, const int* state, int* errors, int ep,
                                uint64_t timeout_ns) {
  if (wait_flags != nullptr) {  // closing half of the barrier after the megakernel
    if (threadIdx.x == 0) barrier_wait(wait_flags, ep, state[kStateBarrierEpoch], errors, timeout_ns, 0, 1);
    __syncthreads();
  }
  const int c8 = blockIdx.x * blockDim.x + threadIdx.x;
  if (c8 * 8 >= H) return;
  const int64_t t = blockIdx.y;
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.f;
  for (int s = 0; s < k; ++s) {
    const float p = probs[t * k + s];
    if (c8 == 0 && errors != nullptr && !isfinite(p)) flag_max(errors + kErrNonfiniteProbs, static_cast<int>(t) + 1);
    float f[8];
    // .cg: the slots were written by peers during this forward (never through this SM's L1)
    unpack8(__ldcg(reinterpret_cast<const uint4*>(comb + (t * k + s) * H + c8 * 8)), f);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(p, f[j]));
  }
  if (shared_y != nullptr) {
    float f[8];
    unpack8(ld16(shared_y + t * H + c8 * 8), f);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], f[j]);
  }
  uint4 o;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
  st16(out + t * H + c8 * 8, o);
}

}  // namespace

const char* launch_combine(const void* y, const int* row_src_rank, const int* row_src_slot, const int* expert_offsets,
                           int nle, int capacity, const PeerPtrs& comb_bufs, int H, int num_ctas, cudaStream_t stream) {
  if (H % 8) return "mok combine: H must be a multiple of 8";
  if (num_ctas <= 0) num_ctas = tuning::kCopyCtasPerSm * num_sms();
  combine_kernel<<<num_ctas, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(y), row_src_rank, row_src_slot,
                                                expert_offsets, nle, capacity, comb_bufs, H);
  return launch_status();
}

const char* launch_epilogue(const void* comb, const float* probs, const void* shared_y, void* out, int T, int k, int H,
                            const int* wait_flags, const int* state, int* errors, int ep, uint64_t timeout_ns,
                            cudaStream_t stream) {
  if (wait_flags != nullptr && (state == nullptr || errors == nullptr || ep < 1 || ep > kMaxPeers))
    return "mok epilogue: the barrier wait needs state, errors and the EP size";
  if (H % 8) return "mok epilogue: H must be a multiple of 8";
  if (T <= 0) return nullptr;
  if (T > 65535) return "mok epilogue: more than 65535 tokens";
  const int threads = 128;
  dim3 grid((H / 8 + threads - 1) / threads, T);
  epilogue_kernel<<<grid, threads, 0, stream>>>(static_cast<const __nv_bfloat16*>(comb), probs,
                                                static_cast<const __nv_bfloat16*>(shared_y),
                                                static_cast<__nv_bfloat16*>(out), k, H, wait_flags, state, errors,
                                                ep, timeout_ns);
  return launch_status();
}

}  // namespace mok
