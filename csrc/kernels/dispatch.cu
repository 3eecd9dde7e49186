// Pull-dispatch: every routed row of this rank reads its token row from the source rank's
// symmetric x buffer over NVLink (16-byte vector loads), in schedule order. Padding rows of each
// expert segment are zero-filled. One warp per row, a grid-stride loop over rows.
#include "common.cuh"

namespace mok {
namespace {

// Rows of row_bytes (a multiple of 16). kScales (the e4m3 dispatch): each row's nkb fp32 scales too,
// read from row `token` of the source rank's [T, pitch] scale buffer and written to
// scale_t[kb * ld + row], the [kb][ld] layout expert_gemm_fp8 reads (the lanes of a warp write
// consecutive kb of one row; the warps of a CTA consecutive rows, so L2 merges the sectors). Before,
// a transposing copy of all capacity rows followed the dispatch on the forward's critical path.
template <bool kScales>
__global__ void dispatch_kernel(const int* __restrict__ row_src_rank, const int* __restrict__ row_src_slot,
                                const int* __restrict__ expert_offsets, int nle, int capacity, PeerPtrs x_bufs,
                                uint8_t* __restrict__ x_routed, int row_bytes, int k, PeerPtrs s_bufs,
                                float* __restrict__ scale_t, int nkb, int pitch, int64_t ld) {
  const int total = min(expert_offsets[nle], capacity);
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  const int n16 = row_bytes / 16;
  for (int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < total; row += warps) {
    uint4* dst = reinterpret_cast<uint4*>(x_routed + static_cast<int64_t>(row) * row_bytes);
    const int src = row_src_rank[row];
    const int token = src < 0 ? 0 : row_src_slot[row] / k;
    if constexpr (kScales) {
      const float* s = src < 0 ? nullptr : static_cast<const float*>(s_bufs.p[src]) + static_cast<int64_t>(token) * pitch;
      for (int kb = lane; kb < nkb; kb += 32) scale_t[kb * ld + row] = s == nullptr ? 0.f : s[kb];
    }
    if (src < 0) {
      for (int c = lane; c < n16; c += 32) st16(dst + c, make_uint4(0, 0, 0, 0));
    } else {
      const uint4* s =
          reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(x_bufs.p[src]) + static_cast<int64_t>(token) * row_bytes);
      warp_copy_row(dst, s, n16, lane);
    }
  }
}

// The remote tokens this rank needs, each pulled once (DeepEP's dedup): token t of source rank
// src != rank goes to rows_out[src][t] (and its scale row to scales_out[src][t]) if any of its k
// experts is local (global ids rank * nle .. + nle - 1), the rows its routed rows read. One warp
// per (src, token), tokens of one source consecutive (contiguous NVLink reads). The dispatches
// then read every remote row locally: at DeepSeek-V3 EP=2 a remote token feeds ~4 routed rows,
// which before pulled it ~4 times.
__global__ void pull_tokens_kernel(const int* __restrict__ top_all, int T, int k, int ep, int rank, int nle,
                                   PeerPtrs row_bufs, uint8_t* __restrict__ rows_out, int row_bytes,
                                   PeerPtrs scale_bufs, uint8_t* __restrict__ scales_out, int scale_bytes) {
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  const int64_t pairs = static_cast<int64_t>(ep - 1) * T;
  const int lo = rank * nle;
  for (int64_t i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; i < pairs; i += warps) {
    const int q = static_cast<int>(i / T), t = static_cast<int>(i % T);
    const int src = q < rank ? q : q + 1;
    const int e = lane < k ? top_all[(static_cast<int64_t>(src) * T + t) * k + lane] : -1;
    if (!__any_sync(0xffffffffu, e >= lo && e < lo + nle)) continue;
    // row t of src's buffer -> row (src, t) of the local copy
    auto copy = [&](const PeerPtrs& bufs, uint8_t* out, int bytes) {
      warp_copy_row(reinterpret_cast<uint4*>(out + (static_cast<int64_t>(src) * T + t) * bytes),
                    reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(bufs.p[src]) +
                                                   static_cast<int64_t>(t) * bytes),
                    bytes / 16, lane);
    };
    copy(row_bufs, rows_out, row_bytes);
    if (scales_out != nullptr) copy(scale_bufs, scales_out, scale_bytes);
  }
}

}  // namespace

const char* launch_pull_tokens(const int* top_all, int T, int k, int ep, int rank, int nle, const PeerPtrs& row_bufs,
                               void* rows_out, int row_bytes, const PeerPtrs& scale_bufs, void* scales_out,
                               int scale_bytes, int num_ctas, cudaStream_t stream) {
  if (k < 1 || k > 32) return "mok pull_tokens: top-k must be 1 to 32";
  if (row_bytes <= 0 || row_bytes % 16 || (scales_out != nullptr && (scale_bytes <= 0 || scale_bytes % 16)))
    return "mok pull_tokens: row and scale-row bytes must be positive multiples of 16";
  if (rank < 0 || rank >= ep) return "mok pull_tokens: rank outside the expert-parallel group";
  if (ep < 2 || T <= 0) return nullptr;  // nothing remote
  if (num_ctas <= 0) num_ctas = 4 * num_sms();
  pull_tokens_kernel<<<num_ctas, 256, 0, stream>>>(top_all, T, k, ep, rank, nle, row_bufs,
                                                   static_cast<uint8_t*>(rows_out), row_bytes, scale_bufs,
                                                   static_cast<uint8_t*>(scales_out), scale_bytes);
  return launch_status();
}

const char* launch_dispatch(const int* row_src_rank, const int* row_src_slot, const int* expert_offsets, int nle,
                            int capacity, const PeerPtrs& x_bufs, void* x_routed, int H, int k, int num_ctas,
                            cudaStream_t stream) {
  if (H % 8) return "mok dispatch: H must be a multiple of 8";
  if (num_ctas <= 0) num_ctas = 4 * num_sms();
  dispatch_kernel<false><<<num_ctas, 256, 0, stream>>>(row_src_rank, row_src_slot, expert_offsets, nle, capacity,
                                                        x_bufs, static_cast<uint8_t*>(x_routed), 2 * H, k, PeerPtrs{},
                                                        nullptr, 0, 0, 0);
  return launch_status();
}

const char* launch_dispatch_e4m3(const int* row_src_rank, const int* row_src_slot, const int* expert_offsets, int nle,
                                 int capacity, const PeerPtrs& q_bufs, void* q_routed, int H, const PeerPtrs& s_bufs,
                                 int scale_pitch, float* scale_t, int64_t scale_ld, int k, int num_ctas,
                                 cudaStream_t stream) {
  if (H % 128) return "mok dispatch_e4m3: H must be a multiple of 128";
  if (scale_pitch < H / 128) return "mok dispatch_e4m3: the peers' scale pitch is below H / 128";
  if (scale_ld < capacity) return "mok dispatch_e4m3: the scale leading dimension is below the capacity";
  if (num_ctas <= 0) num_ctas = 4 * num_sms();
  dispatch_kernel<true><<<num_ctas, 256, 0, stream>>>(row_src_rank, row_src_slot, expert_offsets, nle, capacity,
                                                       q_bufs, static_cast<uint8_t*>(q_routed), H, k, s_bufs, scale_t,
                                                       H / 128, scale_pitch, scale_ld);
  return launch_status();
}

}  // namespace mok
