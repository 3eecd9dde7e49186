// The expert-major bf16 GEMM (expert_gemm.cuh): the routed experts' forward GEMMs and the backward's
// dgrad (weights MN-major, the SwiGLU backward fused into the down projection's dgrad).
#include <algorithm>
#include <type_traits>

#include "gemm/expert_gemm.cuh"

namespace mok {
namespace {

// Shared memory: the 4-stage ring and staging tiles, or (the hand-off kernels) 3 stages and the da tile.
template <bool kSwiGLUBwd>
using LayoutOf = std::conditional_t<kSwiGLUBwd, xgemm::HandoffSmem, xgemm::Smem>;

// The expert-major routed GEMM (expert_gemm.cuh): persistent CTAs walk the tasks round-robin.
// kWMN: the backward's dgrad, weights [K, M] per expert (MN-major A). kSwiGLUBwd (kWMN): the down
// dgrad with the SwiGLU backward fused into its epilogue (out = dh), which warps 1-3 run from the
// consumers' staged da tiles (xgemm::HandoffSmem). kPaired (an even weight-block count): 2-CTA
// clusters walk the pair units (xgemm::decode_pair), the cluster's CTAs running two weight blocks of
// one chunk and sharing its token boxes by multicast; the same tasks, so the same bits.
template <bool kSwiGLU, bool kWMN, bool kSwiGLUBwd, bool kPaired>
__global__ void __launch_bounds__(xgemm::kThreads, 1)
    expert_gemm_kernel(const __grid_constant__ CUtensorMap tmW, const __grid_constant__ CUtensorMap tmX,
                       xgemm::Params p, const xgemm::SwiGLUBwd bw) {
  static_assert(kWMN || !kSwiGLUBwd, "the SwiGLU backward is the down dgrad's epilogue");
  using Layout = LayoutOf<kSwiGLUBwd>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ int chunk_prefix[xgemm::kMaxSeg + 1];  // static: addressed as shared (32-bit), no spill
  const Layout sm = xgemm::carve_smem<Layout>(smem_raw);
  if (threadIdx.x < 32) xgemm::build_chunk_prefix(p, chunk_prefix);
  if constexpr (kSwiGLUBwd)
    if (threadIdx.x == 64) xgemm::init_handoff(sm);
  gemm::init_ring_barriers_and_sync<kPaired>(sm, Layout::kStages);
  // paired: unit u is tasks 2 u, 2 u + 1, this CTA the one of its cluster rank (blockIdx.x % 2)
  const int units = xgemm::num_tasks(p, chunk_prefix) / (kPaired ? 2 : 1);
  const int first = kPaired ? blockIdx.x / 2 : blockIdx.x, stride = kPaired ? gridDim.x / 2 : gridDim.x;
  const auto task = [&](int u) {
    return kPaired ? xgemm::decode_pair(p, chunk_prefix, 2 * u + static_cast<int>(blockIdx.x % 2))
                   : xgemm::decode(p, chunk_prefix, u);
  };
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<kSwiGLUBwd ? tuning::kEpilogueWarpRegs : tuning::kProducerRegs>();
    if (threadIdx.x == 0) {
      tma_prefetch_desc(&tmW);
      tma_prefetch_desc(&tmX);
      uint32_t it = 0;
      for (int u = first; u < units; u += stride)
        xgemm::produce_task<kSwiGLU, false, kWMN, kPaired>(p, &tmW, &tmX, sm, task(u), it);
    }
    if constexpr (kSwiGLUBwd) {
      if (threadIdx.x >= 32) {  // warps 1-3: the SwiGLU backward of each task the consumers hand off
        uint32_t j = 0;
        for (int u = first; u < units; u += stride, ++j) xgemm::swiglu_bwd_task(p, sm, task(u), bw, threadIdx.x - 32, j);
      }
    }
  } else {
    setmaxnreg_inc<kSwiGLUBwd ? tuning::kHandoffConsumerRegs : tuning::kConsumerRegs>();
    const int cw = wg - 1;
    float acc[128];
    uint32_t it = 0, j = 0;
    for (int u = first; u < units; u += stride, ++j) {
      // decoded twice: keeping the task live through the main loop costs registers (spills)
      xgemm::mma_task_any<false, kWMN, kPaired>(p, sm, cw, acc, it, task(u).n_tok);
      if constexpr (kSwiGLUBwd)
        xgemm::hand_off_da(sm, task(u).n_tok, cw, acc, j);
      else
        xgemm::store_task<kSwiGLU>(p, sm, task(u), cw, acc);
    }
  }
  // paired: no CTA leaves while its peer may still multicast into it or arrive on its barriers
  if constexpr (kPaired) cluster_sync();
}

// Launches expert_gemm_kernel<kSwiGLU, kWMN, kSwiGLUBwd, paired>, paired when the weight-block count
// is even.
template <bool kSwiGLU, bool kWMN, bool kSwiGLUBwd>
const char* launch_expert_kernel(const CUtensorMap& tmW, const CUtensorMap& tmX, const xgemm::Params& p,
                                 const xgemm::SwiGLUBwd& bw, int num_ctas, cudaStream_t stream) {
  using Layout = LayoutOf<kSwiGLUBwd>;
  const bool paired = p.n_blocks % 2 == 0;
  const auto kernel = paired ? expert_gemm_kernel<kSwiGLU, kWMN, kSwiGLUBwd, true>
                             : expert_gemm_kernel<kSwiGLU, kWMN, kSwiGLUBwd, false>;
  cudaLaunchAttribute cluster;
  cudaLaunchConfig_t cfg = launch_config(xgemm::kThreads, Layout::kBytes, stream, paired, &cluster);
  // CTAs (paired: clusters) the launch can run at once
  const int at_once = units_at_once(kernel, cfg, paired);
  if (at_once == 0) return "mok grouped_gemm: cannot raise the shared-memory limit of the expert-major GEMM";
  // an upper bound of the unit count (the real one is on the device)
  const int64_t max_units = ((int64_t)p.nseg + p.a_rows / xgemm::kMaxTok + 1) * (paired ? p.n_blocks / 2 : p.n_blocks);
  cfg.gridDim = persistent_grid(num_ctas, at_once, max_units, paired);
  return launch_ex(cfg, kernel, tmW, tmX, p, bw);
}

}  // namespace

const char* launch_expert_gemm(bool swiglu, const void* A, int64_t a_rows, int K, const void* B, int nseg,
                               const int* seg_offsets, const int* seg_counts, void* out, void* pre_out, int N,
                               int num_ctas, cudaStream_t stream) {
  if (nseg > xgemm::kMaxSeg) return "mok grouped_gemm: the expert-major GEMM takes at most 512 segments";
  CUtensorMap tmW, tmX;
  if (const char* m = make_tmap_bf16_2d(&tmX, A, a_rows, K, K, xgemm::kXBox)) return m;
  if (swiglu) {
    if (const char* m = make_tmap_gate_up_pairs(&tmW, B, nseg, N, K)) return m;
  } else if (const char* m = make_tmap_bf16_2d(&tmW, B, (uint64_t)nseg * N, K, K, xgemm::WM)) {
    return m;
  }
  const xgemm::Params p = xgemm::make_params(seg_offsets, seg_counts, nseg, static_cast<int>(a_rows), K, N, swiglu, out, pre_out);
  return swiglu ? launch_expert_kernel<true, false, false>(tmW, tmX, p, xgemm::SwiGLUBwd{}, num_ctas, stream)
                : launch_expert_kernel<false, false, false>(tmW, tmX, p, xgemm::SwiGLUBwd{}, num_ctas, stream);
}

const char* launch_expert_dgrad(const void* dy, int64_t rows, int K, const void* w, int M, int nseg,
                                const int* seg_offsets, const int* seg_counts, void* out, const SwiGLUBackward& bwd,
                                int num_ctas, cudaStream_t stream) {
  if (rows <= 0 || M <= 0) return nullptr;
  if (K <= 0 || K % 8 || M % 8) return "mok expert_dgrad: K and M must be positive multiples of 8";
  if (rows > (int64_t)1 << 30) return "mok expert_dgrad: too many rows";
  if (nseg < 1 || nseg > xgemm::kMaxSeg) return "mok expert_dgrad: 1 to 512 segments";
  if (seg_offsets == nullptr || seg_counts == nullptr) return "mok expert_dgrad: needs segment offsets and counts";
  if (!aligned16(out)) return "mok expert_dgrad: out must start at a 16-byte aligned address (16-byte stores)";
  if (const char* m = xgemm::check_swiglu_bwd(bwd, M)) return m;
  CUtensorMap tmW, tmX;
  if (const char* m = make_tmap_bf16_2d(&tmX, dy, rows, K, K, xgemm::kXBox)) return m;
  // [nseg * K rows, M columns]: boxes of 64 K rows x 64 M columns (MN-major A)
  if (const char* m = make_tmap_bf16_2d(&tmW, w, (uint64_t)nseg * K, M, M, xgemm::WM / 2)) return m;
  const xgemm::Params p = xgemm::make_params(seg_offsets, seg_counts, nseg, static_cast<int>(rows), K, M, false, out,
                                             nullptr);
  return bwd.h != nullptr ? launch_expert_kernel<false, true, true>(tmW, tmX, p, xgemm::swiglu_bwd_of(bwd), num_ctas, stream)
                          : launch_expert_kernel<false, true, false>(tmW, tmX, p, xgemm::SwiGLUBwd{}, num_ctas, stream);
}

}  // namespace mok
