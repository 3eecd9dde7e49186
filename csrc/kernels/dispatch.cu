// Pull-dispatch: every routed row of this rank reads its token row from the source rank's
// symmetric x buffer over NVLink (16-byte vector loads), in schedule order. Padding rows of each
// expert segment are zero-filled. One warp per row, a grid-stride loop over rows.
#include "common.cuh"

namespace mok {
namespace {


__global__ void dispatch_kernel(const int* __restrict__ row_src_rank, const int* __restrict__ row_src_slot,
                                const int* __restrict__ expert_offsets, int nle, int capacity, PeerPtrs x_bufs,
                                __nv_bfloat16* __restrict__ x_routed, int H, int k) {
  const int total = min(expert_offsets[nle], capacity);
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  const int n16 = H / 8;
  for (int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < total; row += warps) {
    uint4* dst = reinterpret_cast<uint4*>(x_routed + static_cast<int64_t>(row) * H);
    const int src = row_src_rank[row];
    if (src < 0) {
      for (int c = lane; c < n16; c += 32) st16(dst + c, make_uint4(0, 0, 0, 0));
    } else {
      const int token = row_src_slot[row] / k;
      const uint4* s =
          reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(x_bufs.p[src]) + static_cast<int64_t>(token) * H);
      warp_copy_row(dst, s, n16, lane);
    }
  }
}

}  // namespace

const char* launch_dispatch(const int* row_src_rank, const int* row_src_slot, const int* expert_offsets, int nle,
                            int capacity, const PeerPtrs& x_bufs, void* x_routed, int H, int k, int num_ctas,
                            cudaStream_t stream) {
  if (H % 8) return "mok dispatch: H must be a multiple of 8";
  if (num_ctas <= 0) num_ctas = 4 * num_sms();
  dispatch_kernel<<<num_ctas, 256, 0, stream>>>(row_src_rank, row_src_slot, expert_offsets, nle, capacity, x_bufs,
                                                 static_cast<__nv_bfloat16*>(x_routed), H, k);
  return launch_status();
}

}  // namespace mok
