// CUDA backward of the mok layer: the transfers and the elementwise pieces. The expert GEMMs run
// between these launches (megatron_mok/kernel_path.py: our grouped GEMM for the gate/up
// recompute, torch._grouped_mm with device offsets for the rest, cuBLAS for the shared expert).
//
// Tight layout (stage 3): the routed GEMMs run on rows where expert e's group holds its real rows
// padded only to kTightAlign (not 128): toffs[e + 1] = toffs[e] + roundup(rows_e, kTightAlign);
// trow[t] = the padded (forward) row of tight row t, or -1 (padding / past toffs[nle]).
//
//   bwd_tight_map: toffs [nle + 1] and trow [capacity] from counts and padded offsets  1 launch
//   bwd_pull:      routed row i pulls grad_out row (token of row_src_slot[i]) and its router weight
//                  from the source rank, writes dy[i] = bf16(w * g) and pushes the router-weight
//                  gradient <g, y_routed[i]> (fp32, fixed order) into slot row_src_slot[i] of the
//                  source rank's symmetric [T * k] fp32 buffer (tight: i = trow[t], dy row t)
//                                                                                    1 launch
//   swiglu_bwd:    dh = [d_gate; d_up] from the gate/up pre-activations h and da      1 launch
//   gather_rows:   dst[t] = src[trow[t]] (0 for padding rows): ctx.act, ctx.x_routed   1 launch each
//   zero_empty:    weight-gradient slabs of experts without rows <- exact zeros       1 launch
//   bwd_push:      routed row i's dx row -> slot row_src_slot[i] of the source rank's symmetric
//                  [T * k, H] buffer; the last block opens the closing barrier       1 launch
//   bwd_epilogue:  closes the barrier, dx[t] = sum_s slot[t, s] in slot order (fp32, no
//                  contraction) + shared dx, cast once; dprobs <- the pushed [T * k] gradients
//
// Determinism: no float atomics; every sum has a fixed order (the dot product: per lane in column
// order, then a butterfly over the warp); slots are unique, so pushes are plain stores. Nothing
// depends on the CTA counts.
#include <algorithm>

#include "barrier.cuh"
#include "bwd_pull.cuh"
#include "swiglu.cuh"

namespace mok {
namespace {

constexpr int kMapThreads = 1024;  // one thread per local expert in the tight-map scan

// ---- tight layout map --------------------------------------------------------------------------

// Every block scans the (<= 1023) groups itself (no inter-block dependency, one launch), then
// fills its grid-stride share of trow. Rows of expert e that the padded layout holds:
// min(counts[e], padded segment size) (smaller only after a capacity overflow).
__global__ void __launch_bounds__(kMapThreads)
    bwd_tight_map_kernel(const int* __restrict__ counts, const int* __restrict__ offsets, int nle, int capacity,
                         int align, int* __restrict__ toffs, int* __restrict__ trow) {
  __shared__ int s_toffs[kMapThreads + 1];
  __shared__ int s_warp[kMapThreads / 32];
  const int e = threadIdx.x, lane = e % 32, warp = e / 32;
  const int rows = e < nle ? segment_rows(counts, offsets, e) : 0;
  // inclusive scan: warp, then warp totals
  int v = warp_inclusive_sum((rows + align - 1) / align * align);
  if (lane == 31) s_warp[warp] = v;
  __syncthreads();
  if (warp == 0) s_warp[lane] = warp_inclusive_sum(lane < kMapThreads / 32 ? s_warp[lane] : 0);
  __syncthreads();
  if (warp > 0) v += s_warp[warp - 1];
  if (e == 0) s_toffs[0] = 0;
  if (e < nle) s_toffs[e + 1] = v;
  __syncthreads();
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i <= nle; i += blockDim.x) toffs[i] = s_toffs[i];
  const int total = s_toffs[nle];
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < capacity; t += gridDim.x * blockDim.x) {
    int p = -1;
    if (t < total) {
      int lo = 0, hi = nle;  // last g with s_toffs[g] <= t (empty groups share an offset)
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (s_toffs[mid] <= t) lo = mid; else hi = mid;
      }
      const int j = t - s_toffs[lo];
      if (j < segment_rows(counts, offsets, lo)) p = offsets[lo] + j;
    }
    trow[t] = p;
  }
}

// ---- gather rows into the tight layout ---------------------------------------------------------

// dst[t] = src[trow[t]] for t < toffs[nle] (one warp per row); padding rows (trow < 0) <- zeros.
__global__ void gather_rows_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                   const int* __restrict__ trow, const int* __restrict__ toffs, int nle, int rows_cap,
                                   int n16) {
  const int total = min(toffs[nle], rows_cap);
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  for (int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; t < total; t += warps) {
    uint4* d = dst + static_cast<int64_t>(t) * n16;
    const int p = trow[t];
    if (p < 0) {
      for (int c = lane; c < n16; c += 32) st16(d + c, make_uint4(0, 0, 0, 0));
    } else {
      warp_copy_row(d, src + static_cast<int64_t>(p) * n16, n16, lane);
    }
  }
}

// ---- publish ----------------------------------------------------------------------------------

__global__ void bwd_publish_kernel(const uint4* __restrict__ g, uint4* __restrict__ g_dst, int64_t g16,
                                   const int* __restrict__ p, int* __restrict__ p_dst, int64_t p4, PeerPtrs flags,
                                   int* state, int* errors, int rank, int ep, uint64_t timeout_ns) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < g16; i += stride) g_dst[i] = g[i];
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < p4; i += stride) p_dst[i] = p[i];
  if (last_block_arrive(state + kStateArrive)) barrier_block(flags, state, errors, rank, ep, timeout_ns, 0);
}

// ---- pull (+ router-weight gradient push) ------------------------------------------------------

// kQuant (the fp8 dgrad): dy also quantized on the way (pull_grad_row_e4m3), into q [rows, H] e4m3 and
// scale [H / 128][scale_ld]; padded rows only (no trow).
template <bool kQuant>
__global__ void bwd_pull_kernel(const int* __restrict__ row_src_rank, const int* __restrict__ row_src_slot,
                                const int* __restrict__ expert_offsets, int nle, int capacity, PeerPtrs g_bufs,
                                PeerPtrs p_bufs, PeerPtrs dw_bufs, const __nv_bfloat16* __restrict__ y,
                                __nv_bfloat16* __restrict__ dy, int H, int k, const int* __restrict__ trow,
                                uint8_t* __restrict__ q, float* __restrict__ scale, int64_t scale_ld) {
  const int total = min(expert_offsets[nle], capacity);
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  for (int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; t < total; t += warps) {
    if constexpr (kQuant) {
      pull_grad_row_e4m3(t, dy + static_cast<int64_t>(t) * H, q + static_cast<int64_t>(t) * H, scale, scale_ld,
                         row_src_rank, row_src_slot, g_bufs, p_bufs, dw_bufs, y, H, k, lane);
    } else {
      const int row = trow ? trow[t] : t;  // padded row: schedule and y_routed index
      pull_grad_row(row, dy + static_cast<int64_t>(t) * H, row_src_rank, row_src_slot, g_bufs, p_bufs, dw_bufs, y, H,
                    k, lane);
    }
  }
}

// ---- SwiGLU backward ---------------------------------------------------------------------------

// h [rows, 2I] = [gate | up] pre-activations, da [rows, I] -> dh [rows, 2I] = [d_gate | d_up]:
//   d_gate = da * up * sig * (1 + g * (1 - sig)),  d_up = da * silu(g)   (fp32, cast once)
__global__ void swiglu_bwd_kernel(const __nv_bfloat16* __restrict__ h, const __nv_bfloat16* __restrict__ da,
                                  __nv_bfloat16* __restrict__ dh, int64_t row_cap, int I, const int* seg_offsets,
                                  int nseg, const int* __restrict__ trow) {
  const int64_t rows = seg_offsets ? min(static_cast<int64_t>(seg_offsets[nseg]), row_cap) : row_cap;
  const int n8 = I / 8;
  const int64_t total = rows * n8;
  const int64_t two_i = 2 * static_cast<int64_t>(I);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / n8;
    const int c = static_cast<int>(i % n8) * 8;
    const int64_t hr = trow ? trow[r] : r;  // h keeps the forward's (padded) rows
    if (hr < 0) {  // tight padding row: zero, it adds nothing to dfc1
      st16(dh + r * two_i + c, make_uint4(0, 0, 0, 0));
      st16(dh + r * two_i + I + c, make_uint4(0, 0, 0, 0));
      continue;
    }
    float g[8], u[8], d[8], dg[8], du[8];
    unpack8(ld16(h + hr * two_i + c), g);
    unpack8(ld16(h + hr * two_i + I + c), u);
    unpack8(ld16(da + r * I + c), d);
#pragma unroll
    for (int j = 0; j < 8; ++j) swiglu_grad(g[j], u[j], d[j], dg[j], du[j]);
    st16(dh + r * two_i + c, pack8(dg));
    st16(dh + r * two_i + I + c, pack8(du));
  }
}

// ---- exact zeros for experts without rows ------------------------------------------------------

__global__ void zero_empty_kernel(uint4* __restrict__ t, int64_t n16_per_seg, const int* __restrict__ seg_counts) {
  const int e = blockIdx.y;
  if (seg_counts[e] != 0) return;
  uint4* base = t + static_cast<int64_t>(e) * n16_per_seg;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n16_per_seg; i += (int64_t)gridDim.x * blockDim.x)
    base[i] = make_uint4(0, 0, 0, 0);
}

// ---- push dx rows (+ opening half of the closing barrier) --------------------------------------

__global__ void bwd_push_kernel(const __nv_bfloat16* __restrict__ rows_in, const int* __restrict__ row_src_rank,
                                const int* __restrict__ row_src_slot, const int* __restrict__ expert_offsets, int nle,
                                int capacity, PeerPtrs slot_bufs, int H, PeerPtrs flags, int* state, int rank, int ep,
                                const int* __restrict__ trow) {
  push_rows_to_source_slots(rows_in, row_src_rank, row_src_slot, expert_offsets, nle, capacity, slot_bufs, H, trow);
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
                               uint64_t timeout_ns, cudaStream_t stream) {
  if (ep < 1 || ep > kMaxPeers || rank < 0 || rank >= ep) return "mok bwd_publish: bad rank / EP size";
  if (g_bytes % 16 || !aligned16(g) || !aligned16(g_dst)) return "mok bwd_publish: grad_out must be 16-byte aligned";
  if (p_bytes % 4 || (reinterpret_cast<uintptr_t>(p) & 3) || (reinterpret_cast<uintptr_t>(p_dst) & 3))
    return "mok bwd_publish: probs must be 4-byte aligned";
  const int64_t g16 = g_bytes / 16, p4 = p_bytes / 4;
  const int threads = 256;
  const int blocks = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>((std::max(g16, p4) + threads - 1) / threads, 2 * num_sms())));
  bwd_publish_kernel<<<blocks, threads, 0, stream>>>(static_cast<const uint4*>(g), static_cast<uint4*>(g_dst), g16,
                                                     static_cast<const int*>(p), static_cast<int*>(p_dst), p4, flags,
                                                     state, errors, rank, ep, timeout_ns);
  return launch_status();
}

const char* launch_bwd_tight_map(const int* counts, const int* offsets, int nle, int capacity, int align, int* toffs,
                                 int* trow, cudaStream_t stream) {
  if (nle < 1 || nle >= kMapThreads) return "mok bwd_tight_map: 1..1023 local experts";
  if (align < 1 || capacity < 0) return "mok bwd_tight_map: bad alignment / capacity";
  const int blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>((capacity + kMapThreads - 1) / kMapThreads, num_sms())));
  bwd_tight_map_kernel<<<blocks, kMapThreads, 0, stream>>>(counts, offsets, nle, capacity, align, toffs, trow);
  return launch_status();
}

const char* launch_gather_rows(const void* src, void* dst, int64_t row_bytes, const int* trow, const int* toffs,
                               int nle, int rows_cap, int num_ctas, cudaStream_t stream) {
  if (row_bytes % 16 || !aligned16(src) || !aligned16(dst)) return "mok gather_rows: rows must be 16-byte aligned";
  if (rows_cap <= 0 || row_bytes == 0) return nullptr;
  if (num_ctas <= 0) num_ctas = 4 * num_sms();
  gather_rows_kernel<<<num_ctas, 256, 0, stream>>>(static_cast<const uint4*>(src), static_cast<uint4*>(dst), trow,
                                                    toffs, nle, rows_cap, static_cast<int>(row_bytes / 16));
  return launch_status();
}

const char* launch_bwd_pull(const int* row_src_rank, const int* row_src_slot, const int* expert_offsets, int nle,
                            int capacity, const PeerPtrs& g_bufs, const PeerPtrs& p_bufs, const PeerPtrs& dw_bufs,
                            const void* y_routed, void* dy, int H, int k, const int* trow, int num_ctas,
                            cudaStream_t stream, void* q, float* scale, int64_t scale_ld) {
  if (H % 8) return "mok bwd_pull: H must be a multiple of 8";
  if (!aligned16(y_routed) || !aligned16(dy)) return "mok bwd_pull: y_routed / dy must be 16-byte aligned";
  if (q != nullptr && (H % 128 || trow != nullptr || scale == nullptr || !aligned16(q)))
    return "mok bwd_pull: quantizing dy needs H a multiple of 128, padded rows (no trow), scales and 16-byte "
           "aligned q";
  if (num_ctas <= 0) num_ctas = 4 * num_sms();
  auto kernel = q != nullptr ? bwd_pull_kernel<true> : bwd_pull_kernel<false>;
  kernel<<<num_ctas, 256, 0, stream>>>(row_src_rank, row_src_slot, expert_offsets, nle, capacity, g_bufs, p_bufs,
                                       dw_bufs, static_cast<const __nv_bfloat16*>(y_routed),
                                       static_cast<__nv_bfloat16*>(dy), H, k, trow, static_cast<uint8_t*>(q), scale,
                                       scale_ld);
  return launch_status();
}

const char* launch_swiglu_backward(const void* h, const void* da, void* dh, int64_t row_cap, int I,
                                   const int* seg_offsets, int nseg, const int* trow, cudaStream_t stream) {
  if (trow != nullptr && seg_offsets == nullptr) return "mok swiglu_backward: trow needs seg_offsets";
  if (I % 8) return "mok swiglu_backward: I must be a multiple of 8";
  if (!aligned16(h) || !aligned16(da) || !aligned16(dh)) return "mok swiglu_backward: operands must be 16-byte aligned";
  if (row_cap <= 0) return nullptr;
  const int64_t work = row_cap * (I / 8);
  const int threads = 256;
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((work + threads - 1) / threads,
                                                                             8 * num_sms())));
  swiglu_bwd_kernel<<<blocks, threads, 0, stream>>>(static_cast<const __nv_bfloat16*>(h),
                                                    static_cast<const __nv_bfloat16*>(da),
                                                    static_cast<__nv_bfloat16*>(dh), row_cap, I, seg_offsets, nseg,
                                                    trow);
  return launch_status();
}

const char* launch_zero_empty_segments(void* t, int64_t bytes_per_seg, const int* seg_counts, int nseg,
                                       cudaStream_t stream) {
  if (bytes_per_seg % 16 || !aligned16(t)) return "mok zero_empty_segments: slabs must be 16-byte aligned";
  if (nseg <= 0 || bytes_per_seg == 0) return nullptr;
  if (nseg > 65535) return "mok zero_empty_segments: too many segments";
  const int64_t n16 = bytes_per_seg / 16;
  const int threads = 256;
  const int bx = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n16 + threads - 1) / threads, 64)));
  zero_empty_kernel<<<dim3(bx, nseg), threads, 0, stream>>>(static_cast<uint4*>(t), n16, seg_counts);
  return launch_status();
}

const char* launch_bwd_push(const void* rows, const int* row_src_rank, const int* row_src_slot,
                            const int* expert_offsets, int nle, int capacity, const PeerPtrs& slot_bufs, int H,
                            const PeerPtrs& flags, int* state, int rank, int ep, const int* trow, int num_ctas,
                            cudaStream_t stream) {
  if (H % 8) return "mok bwd_push: H must be a multiple of 8";
  if (ep < 1 || ep > kMaxPeers || rank < 0 || rank >= ep) return "mok bwd_push: bad rank / EP size";
  if (!aligned16(rows)) return "mok bwd_push: rows must be 16-byte aligned";
  if (num_ctas <= 0) num_ctas = 4 * num_sms();
  bwd_push_kernel<<<num_ctas, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(rows), row_src_rank, row_src_slot,
                                                 expert_offsets, nle, capacity, slot_bufs, H, flags, state, rank, ep,
                                                 trow);
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
