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

}  // namespace

const char* launch_dispatch(const int* row_src_rank, const int* row_src_slot, const int* expert_offsets, int nle,
                            int capacity, const PeerPtrs& x_bufs, void* x_routed, int H, int k, int num_ctas,
                            cudaStream_t stream) {
  if (H % 8) return "mok dispatch: H must be a multiple of 8";
  if (num_ctas <= 0) num_ctas = tuning::kCopyCtasPerSm * num_sms();
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
  if (num_ctas <= 0) num_ctas = tuning::kCopyCtasPerSm * num_sms();
  dispatch_kernel<true><<<num_ctas, 256, 0, stream>>>(row_src_rank, row_src_slot, expert_offsets, nle, capacity,
                                                       q_bufs, static_cast<uint8_t*>(q_routed), H, k, s_bufs, scale_t,
                                                       H / 128, scale_pitch, scale_ld);
  return launch_status();
}

}  // namespace mok
