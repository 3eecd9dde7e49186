// Persistent, warp-specialised grouped GEMM (see grouped_gemm.cuh): the routed experts' gate/up
// GEMM with SwiGLU fused in the epilogue, the down GEMM, and the shared expert (one segment).
#include <stdlib.h>

#include "grouped_gemm.cuh"

namespace mok {
namespace {

template <bool kSwiGLU>
__global__ void __launch_bounds__(gemm::kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                        gemm::Params p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const gemm::Smem sm = gemm::carve_smem(smem_raw);
  const int total = gemm::rows_total(p);
  const int num_tiles = (total + gemm::BM - 1) / gemm::BM * p.n_tiles;
  if (threadIdx.x == 0) {
    for (int s = 0; s < gemm::kStages; ++s) {
      mbar_init(&sm.full[s], 1);
      mbar_init(&sm.empty[s], 256);
    }
    mbar_fence_init();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      tma_prefetch_desc(&tmA);
      tma_prefetch_desc(&tmB);
      uint32_t it = 0;
      for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x)
        gemm::produce_tile<kSwiGLU>(p, &tmA, &tmB, sm, tile, it);
    }
  } else {
    setmaxnreg_inc<232>();
    const int cw = wg - 1;
    float acc[128];
    uint32_t it = 0;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const bool active = gemm::half_active(p, tile, cw);
      gemm::mma_tile(p, sm, cw, acc, it, active);
      gemm::store_tile<kSwiGLU>(p, tile, cw, acc, total, active);
    }
  }
}

template <bool kSwiGLU>
const char* launch(const CUtensorMap& tmA, const CUtensorMap& tmB, const gemm::Params& p, int max_tiles, int num_ctas,
                   cudaStream_t stream) {
  static bool configured = false;
  if (!configured) {
    if (cudaFuncSetAttribute(grouped_gemm_kernel<kSwiGLU>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             gemm::kSmemBytes) != cudaSuccess)
      return "mok grouped_gemm: cannot raise the shared-memory limit";
    configured = true;
  }
  if (num_ctas <= 0) num_ctas = num_sms();
  const int grid = max(1, min(num_ctas, max_tiles));
  grouped_gemm_kernel<kSwiGLU><<<grid, gemm::kThreads, gemm::kSmemBytes, stream>>>(tmA, tmB, p);
  return launch_status();
}

}  // namespace

const char* launch_grouped_gemm(bool swiglu, const void* A, int64_t a_rows, int K, const void* B,
                                int b_rows_per_seg, const int* seg_offsets, const int* seg_counts, int nseg,
                                void* out, void* pre_out, int N, int num_ctas, cudaStream_t stream) {
  // MOK_GEMM_SKIP_PAD=0 computes padding rows too (same bits; for A/B timing and as a fallback).
  static const int skip_padding = [] {
    const char* v = getenv("MOK_GEMM_SKIP_PAD");
    return (v != nullptr && v[0] == '0') ? 0 : 1;
  }();
  if (a_rows <= 0 || N <= 0) return nullptr;
  if (K <= 0 || K % 8 || N % 8) return "mok grouped_gemm: K and N must be positive multiples of 8";
  if (a_rows > (int64_t)1 << 30) return "mok grouped_gemm: too many rows";
  if (nseg < 1) return "mok grouped_gemm: no segments";
  CUtensorMap tmA, tmB;
  if (const char* m = make_tmap_bf16_2d(&tmA, A, a_rows, K, K, gemm::BM)) return m;
  if (const char* m = make_tmap_bf16_2d(&tmB, B, (uint64_t)nseg * b_rows_per_seg, K, K, gemm::BN / 2)) return m;
  gemm::Params p;
  p.seg_offsets = seg_offsets;
  p.seg_counts = seg_counts;
  p.nseg = nseg;
  p.skip_padding = skip_padding;
  p.a_rows = static_cast<int>(a_rows);
  p.K = K;
  p.N = N;
  p.b_rows_per_seg = b_rows_per_seg;
  p.n_tiles = (N + (swiglu ? gemm::BN / 2 : gemm::BN) - 1) / (swiglu ? gemm::BN / 2 : gemm::BN);
  p.out = static_cast<__nv_bfloat16*>(out);
  p.pre_out = swiglu ? static_cast<__nv_bfloat16*>(pre_out) : nullptr;
  const int max_tiles = static_cast<int>((a_rows + gemm::BM - 1) / gemm::BM) * p.n_tiles;
  return swiglu ? launch<true>(tmA, tmB, p, max_tiles, num_ctas, stream)
                : launch<false>(tmA, tmB, p, max_tiles, num_ctas, stream);
}

}  // namespace mok
