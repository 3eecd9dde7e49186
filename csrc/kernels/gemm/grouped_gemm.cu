// The token-major grouped GEMM (grouped_gemm.cuh): the shared expert's gate/up GEMM with SwiGLU
// fused in the epilogue and its down GEMM (one segment), and the entry of the routed GEMMs, which
// run expert-major (expert_gemm.cu) once their real-row counts are known.
#include <algorithm>

#include "gemm/grouped_gemm.cuh"

namespace mok {
namespace {

// The token-major GEMM of segments without real-row counts (the shared expert, the backward's
// gate/up recompute of its T rows), in 2-CTA clusters (grouped_gemm.cuh, paired mode). Work unit u:
// n-tile u % n_tiles of m-tiles 2j and 2j + 1 (j = u / n_tiles), one per CTA of the cluster. With an
// odd m-tile count the second CTA of the last pair has no tile of its own: it still loads a valid A/B
// block so that the ring protocol stays symmetric, but computes and stores nothing.
template <bool kSwiGLU>
__global__ void __launch_bounds__(gemm::kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                        gemm::Params p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const gemm::Smem sm = gemm::carve_smem(smem_raw);
  const int total = gemm::rows_total(p);
  const int m_tiles = (total + gemm::BM - 1) / gemm::BM;
  const int num_units = (m_tiles + 1) / 2 * p.n_tiles;
  const int first = blockIdx.x / 2;
  const int stride = gridDim.x / 2;
  const int rank = static_cast<int>(cluster_ctarank());
  if (threadIdx.x == 0) {
    for (int s = 0; s < gemm::kStages; ++s) {
      mbar_init(&sm.full[s], 1);
      mbar_init(&sm.empty[s], gemm::empty_arrivals(true));
    }
    mbar_fence_init();
  }
  cluster_sync();  // the peer multicasts into this CTA's ring only after its barriers exist
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<tuning::kProducerRegs>();  // 40 spills the paired producer (pair bookkeeping)
    if (threadIdx.x == 0) {
      tma_prefetch_desc(&tmA);
      tma_prefetch_desc(&tmB);
      uint32_t it = 0;
      for (int u = first; u < num_units; u += stride) {
        const int mu = u / p.n_tiles, n = u % p.n_tiles;
        const int m = min(2 * mu + rank, m_tiles - 1);
        gemm::produce_tile<kSwiGLU, false, true>(p, &tmA, &tmB, sm, m * p.n_tiles + n, it, nullptr, nullptr, 0,
                                                 2 * mu + 1 < m_tiles);
      }
    }
  } else {
    setmaxnreg_inc<tuning::kConsumerRegs>();
    const int cw = wg - 1;
    float acc[128];
    uint32_t it = 0;
    for (int u = first; u < num_units; u += stride) {
      const int mu = u / p.n_tiles, n = u % p.n_tiles;
      const int m = 2 * mu + rank;
      const bool own = m < m_tiles;
      const int tile = min(m, m_tiles - 1) * p.n_tiles + n;
      const bool active = own && gemm::half_active(p, tile, cw);
      gemm::mma_tile<false, true>(p, sm, cw, acc, it, active);
      if (own) gemm::store_tile<kSwiGLU>(p, tile, cw, acc, total, active);
    }
  }
  cluster_sync();  // no CTA leaves while its peer may still multicast into it or arrive on its barriers
}

template <bool kSwiGLU>
const char* launch(const CUtensorMap& tmA, const CUtensorMap& tmB, const gemm::Params& p, int max_units, int num_ctas,
                   cudaStream_t stream) {
  auto kernel = grouped_gemm_kernel<kSwiGLU>;
  cudaLaunchAttribute cluster;
  cudaLaunchConfig_t cfg = launch_config(gemm::kThreads, gemm::kSmemBytes, stream, true, &cluster);
  const int at_once = units_at_once(kernel, cfg, true);
  if (at_once == 0) return "mok grouped_gemm: cannot raise the shared-memory limit";
  int units = num_ctas > 0 ? num_ctas / 2 : at_once;
  units = max(1, min(units, max_units));
  cfg.gridDim = dim3(2 * units);
  return launch_ex(cfg, kernel, tmA, tmB, p);
}

}  // namespace

const char* launch_grouped_gemm(bool swiglu, const void* A, int64_t a_rows, int K, const void* B,
                                int b_rows_per_seg, const int* seg_offsets, const int* seg_counts, int nseg,
                                void* out, void* pre_out, int N, int num_ctas, cudaStream_t stream) {
  if (a_rows <= 0 || N <= 0) return nullptr;
  if (K <= 0 || K % 8 || N % 8) return "mok grouped_gemm: K and N must be positive multiples of 8";
  if (a_rows > (int64_t)1 << 30) return "mok grouped_gemm: too many rows";
  if (nseg < 1) return "mok grouped_gemm: no segments";
  if (!aligned16(out) || (pre_out != nullptr && !aligned16(pre_out)))
    return "mok grouped_gemm: out and pre_out must start at a 16-byte aligned address (16-byte stores)";
  // routed experts (real-row counts known): expert-major tasks
  if (seg_offsets != nullptr && seg_counts != nullptr)
    return launch_expert_gemm(swiglu, A, a_rows, K, B, nseg, seg_offsets, seg_counts, out, pre_out, N, num_ctas,
                              stream);
  CUtensorMap tmA, tmB;
  if (const char* m = make_tmap_bf16_2d(&tmA, A, a_rows, K, K, gemm::BM)) return m;
  if (const char* m = make_tmap_bf16_2d(&tmB, B, (uint64_t)nseg * b_rows_per_seg, K, K, gemm::BN / 2)) return m;
  const gemm::Params p = gemm::make_params(seg_offsets, seg_counts, nseg, static_cast<int>(a_rows), K, N,
                                           b_rows_per_seg, swiglu, out, pre_out);
  const int m_tiles = static_cast<int>((a_rows + gemm::BM - 1) / gemm::BM);
  const int units = (m_tiles + 1) / 2 * p.n_tiles;
  return swiglu ? launch<true>(tmA, tmB, p, units, num_ctas, stream) : launch<false>(tmA, tmB, p, units, num_ctas, stream);
}

}  // namespace mok
