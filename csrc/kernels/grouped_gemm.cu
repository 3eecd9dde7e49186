// Persistent, warp-specialised grouped GEMM (see grouped_gemm.cuh): the routed experts' gate/up
// GEMM with SwiGLU fused in the epilogue, the down GEMM, and the shared expert (one segment).
#include <stdlib.h>

#include <algorithm>
#include <type_traits>

#include "expert_gemm.cuh"
#include "expert_wgrad.cuh"
#include "grouped_gemm.cuh"

namespace mok {
namespace {

// Work unit u: n-tile u % n_tiles of m-unit u / n_tiles; an m-unit is one m-tile (unpaired) or
// m-tiles 2j and 2j + 1, one per CTA of the cluster (paired). Unpaired and paired grids run the same
// tiles, so the same bits. Paired with an odd m-tile count, the second CTA of the last pair has no
// tile of its own: it still loads a valid A/B block so that the ring protocol stays symmetric, but
// computes and stores nothing.
template <bool kSwiGLU, bool kPaired>
__global__ void __launch_bounds__(gemm::kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                        gemm::Params p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const gemm::Smem sm = gemm::carve_smem(smem_raw);
  const int total = gemm::rows_total(p);
  const int m_tiles = (total + gemm::BM - 1) / gemm::BM;
  const int num_units = (kPaired ? (m_tiles + 1) / 2 : m_tiles) * p.n_tiles;
  const int first = kPaired ? blockIdx.x / 2 : blockIdx.x;
  const int stride = kPaired ? gridDim.x / 2 : gridDim.x;
  const int rank = kPaired ? static_cast<int>(cluster_ctarank()) : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < gemm::kStages; ++s) {
      mbar_init(&sm.full[s], 1);
      mbar_init(&sm.empty[s], gemm::empty_arrivals(kPaired));
    }
    mbar_fence_init();
  }
  // paired: the peer multicasts into this CTA's ring only after its barriers exist
  if constexpr (kPaired) cluster_sync(); else __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<56>();  // 40 spills the paired producer (pair bookkeeping)
    if (threadIdx.x == 0) {
      tma_prefetch_desc(&tmA);
      tma_prefetch_desc(&tmB);
      uint32_t it = 0;
      for (int u = first; u < num_units; u += stride) {
        const int mu = u / p.n_tiles, n = u % p.n_tiles;
        const int m = kPaired ? min(2 * mu + rank, m_tiles - 1) : mu;
        gemm::produce_tile<kSwiGLU, false, kPaired>(p, &tmA, &tmB, sm, m * p.n_tiles + n, it, nullptr, nullptr, 0,
                                                    2 * mu + 1 < m_tiles);
      }
    }
  } else {
    setmaxnreg_inc<224>();
    const int cw = wg - 1;
    float acc[128];
    uint32_t it = 0;
    for (int u = first; u < num_units; u += stride) {
      const int mu = u / p.n_tiles, n = u % p.n_tiles;
      const int m = kPaired ? 2 * mu + rank : mu;
      const bool own = m < m_tiles;
      const int tile = min(m, m_tiles - 1) * p.n_tiles + n;
      const bool active = own && gemm::half_active(p, tile, cw);
      gemm::mma_tile<false, kPaired>(p, sm, cw, acc, it, active);
      if (own) gemm::store_tile<kSwiGLU>(p, tile, cw, acc, total, active);
    }
  }
  // paired: no CTA leaves while its peer may still multicast into it or arrive on its barriers
  if constexpr (kPaired) cluster_sync();
}

template <bool kSwiGLU, bool kPaired>
const char* launch(const CUtensorMap& tmA, const CUtensorMap& tmB, const gemm::Params& p, int max_units, int num_ctas,
                   cudaStream_t stream) {
  auto kernel = grouped_gemm_kernel<kSwiGLU, kPaired>;
  cudaLaunchAttribute cluster;
  cudaLaunchConfig_t cfg = launch_config(gemm::kThreads, gemm::kSmemBytes, stream, kPaired, &cluster);
  const int at_once = units_at_once(kernel, cfg, kPaired, "mok grouped_gemm");
  if (at_once == 0) return "mok grouped_gemm: cannot raise the shared-memory limit";
  int units = num_ctas > 0 ? (kPaired ? num_ctas / 2 : num_ctas) : at_once;
  units = max(1, min(units, max_units));
  cfg.gridDim = dim3(kPaired ? 2 * units : units);
  return launch_ex(cfg, kernel, tmA, tmB, p);
}

// The expert-major routed GEMM (expert_gemm.cuh): persistent CTAs walk the tasks round-robin.
// kWMN: the backward's dgrad, weights [K, M] per expert (MN-major A); with h, the SwiGLU backward
// is fused into its epilogue (out = dh; trow maps out rows to h rows).
template <bool kSwiGLU, bool kWMN = false>
__global__ void __launch_bounds__(xgemm::kThreads, 1)
    expert_gemm_kernel(const __grid_constant__ CUtensorMap tmW, const __grid_constant__ CUtensorMap tmX,
                       xgemm::Params p, const __nv_bfloat16* h, const int* trow) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ int chunk_prefix[xgemm::kMaxSeg + 1];  // static: addressed as shared (32-bit), no spill
  const xgemm::Smem sm = xgemm::carve_smem(smem_raw);
  if (threadIdx.x < 32) xgemm::build_chunk_prefix(p, chunk_prefix);
  gemm::init_ring_barriers(sm, xgemm::kStages);
  __syncthreads();
  const int tasks = xgemm::num_tasks(p, chunk_prefix);
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<56>();
    if (threadIdx.x == 0) {
      tma_prefetch_desc(&tmW);
      tma_prefetch_desc(&tmX);
      uint32_t it = 0;
      for (int u = blockIdx.x; u < tasks; u += gridDim.x)
        xgemm::produce_task<kSwiGLU, false, kWMN>(p, &tmW, &tmX, sm, xgemm::decode(p, chunk_prefix, u), it);
    }
  } else {
    setmaxnreg_inc<224>();
    const int cw = wg - 1;
    float acc[128];
    uint32_t it = 0;
    for (int u = blockIdx.x; u < tasks; u += gridDim.x) {
      // decoded twice: keeping the task live through the main loop costs registers (spills)
      xgemm::mma_task_any<false, false, kWMN>(p, sm, cw, acc, it, xgemm::decode(p, chunk_prefix, u).n_tok);
      if (kWMN && h != nullptr)
        xgemm::store_task_swiglu_bwd(p, sm, xgemm::decode(p, chunk_prefix, u), cw, acc, h, trow);
      else
        xgemm::store_task<kSwiGLU>(p, sm, xgemm::decode(p, chunk_prefix, u), cw, acc);
    }
  }
}

template <class Kernel>
const char* launch_expert_kernel(Kernel kernel, const CUtensorMap& tmW, const CUtensorMap& tmX, const xgemm::Params& p,
                                 const void* h, const int* trow, int num_ctas, cudaStream_t stream);

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
  return launch_expert_kernel(swiglu ? expert_gemm_kernel<true> : expert_gemm_kernel<false>, tmW, tmX, p, nullptr,
                              nullptr, num_ctas, stream);
}

template <class Kernel>
const char* launch_expert_kernel(Kernel kernel, const CUtensorMap& tmW, const CUtensorMap& tmX, const xgemm::Params& p,
                                 const void* h, const int* trow, int num_ctas, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = launch_config(xgemm::kThreads, xgemm::kSmemBytes, stream, false, nullptr);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, xgemm::kSmemBytes) != cudaSuccess)
    return "mok grouped_gemm: cannot raise the shared-memory limit of the expert-major GEMM";
  // an upper bound of the task count (the real one is on the device)
  const int64_t max_tasks = ((int64_t)p.nseg + p.a_rows / xgemm::kMaxTok + 1) * p.n_blocks;
  const int ctas = num_ctas > 0 ? num_ctas : num_sms();
  cfg.gridDim = dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ctas, max_tasks))));
  return launch_ex(cfg, kernel, tmW, tmX, p, static_cast<const __nv_bfloat16*>(h), trow);
}

// Routed weight gradients (expert_wgrad.cuh): persistent CTAs walk the tasks round-robin.
// E4m3Operands (TMA stores only): the accumulators times a_scale[e][m] * b_scale[e][n] first.
template <bool kTmaStore, class Ops = xwgrad::Bf16Operands>
__global__ void __launch_bounds__(xgemm::kThreads, 1)
    expert_wgrad_kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                        const __grid_constant__ CUtensorMap tmOut, xwgrad::Params p, const float* a_scale,
                        const float* b_scale) {
  constexpr bool kE4m3 = std::is_same_v<Ops, xwgrad::E4m3Operands>;
  static_assert(kTmaStore || !kE4m3, "the e4m3 weight gradients leave through TMA stores");
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const auto sm = xwgrad::carve_smem<kTmaStore>(smem_raw);
  gemm::init_ring_barriers(sm, sm.kStages);
  __syncthreads();
  const int tasks = xwgrad::num_tasks(p);
  gemm::run_roles(
      [&] {
        tma_prefetch_desc(&tmA);
        tma_prefetch_desc(&tmB);
        uint32_t it = 0;
        for (int u = blockIdx.x; u < tasks; u += gridDim.x)
          xwgrad::produce_task<false, Ops>(p, &tmA, &tmB, sm, xwgrad::decode(p, u), it);
      },
      [] {},
      [&](int cw) {
        float acc[128];
        uint32_t it = 0;
        for (int u = blockIdx.x; u < tasks; u += gridDim.x) {
          // e4m3: the scales' loads are in flight during the MMA
          const auto scales = xwgrad::task_scales<Ops>(p, sm, a_scale, b_scale, xwgrad::decode(p, u), cw);
          xwgrad::mma_task<false, Ops>(p, sm, cw, xwgrad::decode(p, u), acc, it);
          if constexpr (kTmaStore)
            xwgrad::store_task_tma(p, sm, &tmOut, xwgrad::decode(p, u), cw, acc, scales);
          else
            xwgrad::store_task_direct(p, sm, xwgrad::decode(p, u), cw, acc);
        }
        if (kTmaStore && threadIdx.x % 128 == 0) bulk_wait_all();  // the boxes stay until TMA is done
      });
}

// MOK_WGRAD_TMA_STORE=0: the wgrad's epilogue stores from the consumers (4-stage ring), read per
// launch (the A/B switch; same bits).
bool wgrad_tma_store() {
  const char* v = getenv("MOK_WGRAD_TMA_STORE");
  return !(v != nullptr && v[0] == '0');
}

// The persistent grid of a weight-gradient launch: at most one CTA a task.
template <class Kernel>
const char* launch_wgrad(Kernel kernel, int smem, const xwgrad::Params& p, int num_ctas, cudaStream_t stream,
                         const CUtensorMap& tmA, const CUtensorMap& tmB, const CUtensorMap& tmOut,
                         const float* a_scale, const float* b_scale) {
  cudaLaunchConfig_t cfg = launch_config(xgemm::kThreads, smem, stream, false, nullptr);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
    return "mok expert_wgrad: cannot raise the shared-memory limit";
  const int64_t tasks = (int64_t)p.nseg * p.m_blocks * p.n_blocks;
  const int ctas = num_ctas > 0 ? num_ctas : num_sms();
  cfg.gridDim = dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ctas, tasks))));
  return launch_ex(cfg, kernel, tmA, tmB, tmOut, p, a_scale, b_scale);
}

const char* check_wgrad_shape(int nseg, int M, int N, const void* out) {
  if (nseg < 1) return "mok expert_wgrad: no segments";
  if (M <= 0 || N <= 0 || M % 8 || N % 8) return "mok expert_wgrad: M and N must be positive multiples of 8";
  if (!aligned16(out)) return "mok expert_wgrad: out must start at a 16-byte aligned address (16-byte stores)";
  return nullptr;
}

}  // namespace

const char* launch_expert_wgrad(const void* a, int64_t a_rows, int M, const int* a_offsets, const void* b,
                                int64_t b_rows, int N, const int* b_offsets, const int* counts, int nseg, void* out,
                                int num_ctas, cudaStream_t stream) {
  if (const char* m = check_wgrad_shape(nseg, M, N, out)) return m;
  if (a_rows > (int64_t)1 << 30 || b_rows > (int64_t)1 << 30) return "mok expert_wgrad: too many rows";
  CUtensorMap tmA, tmB;
  if (const char* m = xwgrad::make_operand_maps(&tmA, &tmB, a, a_rows, M, b, b_rows, N)) return m;
  const xwgrad::Params p = xwgrad::make_params(a_offsets, b_offsets, counts, nseg, M, N, out);
  CUtensorMap tmOut;
  if (const char* m = xwgrad::make_out_map(&tmOut, out, nseg, M, N)) return m;
  if (wgrad_tma_store())
    return launch_wgrad(expert_wgrad_kernel<true>, xwgrad::Smem<true>::kBytes, p, num_ctas, stream, tmA, tmB, tmOut,
                        nullptr, nullptr);
  return launch_wgrad(expert_wgrad_kernel<false>, xwgrad::Smem<false>::kBytes, p, num_ctas, stream, tmA, tmB, tmOut,
                      nullptr, nullptr);
}

const char* launch_expert_wgrad_fp8(const void* a_t, int M, const float* a_scale, const void* b_t, int N,
                                    const float* b_scale, int64_t ld, const int* offsets, const int* counts, int nseg,
                                    void* out, int num_ctas, cudaStream_t stream) {
  if (const char* m = check_wgrad_shape(nseg, M, N, out)) return m;
  if (ld <= 0 || ld % 16 || ld > (int64_t)1 << 30)
    return "mok expert_wgrad_fp8: the transposes' token pitch must be a positive multiple of 16";
  if (!aligned16(a_t) || !aligned16(b_t) || (reinterpret_cast<uintptr_t>(a_scale) & 7) ||
      (reinterpret_cast<uintptr_t>(b_scale) & 7))
    return "mok expert_wgrad_fp8: operands need 16-byte and scales 8-byte aligned addresses";
  CUtensorMap tmA, tmB;
  if (const char* m = xwgrad::make_e4m3_operand_maps(&tmA, &tmB, a_t, M, b_t, N, ld)) return m;
  const xwgrad::Params p = xwgrad::make_params(offsets, offsets, counts, nseg, M, N, out);
  CUtensorMap tmOut;
  if (const char* m = xwgrad::make_out_map(&tmOut, out, nseg, M, N)) return m;
  return launch_wgrad(expert_wgrad_kernel<true, xwgrad::E4m3Operands>, xwgrad::Smem<true>::kBytes, p, num_ctas,
                      stream, tmA, tmB, tmOut, a_scale, b_scale);
}

const char* launch_expert_dgrad(const void* dy, int64_t rows, int K, const void* w, int M, int nseg,
                                const int* seg_offsets, const int* seg_counts, void* out, const void* h,
                                const int* trow, int num_ctas, cudaStream_t stream) {
  if (rows <= 0 || M <= 0) return nullptr;
  if (K <= 0 || K % 8 || M % 8) return "mok expert_dgrad: K and M must be positive multiples of 8";
  if (rows > (int64_t)1 << 30) return "mok expert_dgrad: too many rows";
  if (nseg < 1 || nseg > xgemm::kMaxSeg) return "mok expert_dgrad: 1 to 512 segments";
  if (seg_offsets == nullptr || seg_counts == nullptr) return "mok expert_dgrad: needs segment offsets and counts";
  if (!aligned16(out) || (h != nullptr && !aligned16(h)))
    return "mok expert_dgrad: out and h must start at a 16-byte aligned address (16-byte stores)";
  CUtensorMap tmW, tmX;
  if (const char* m = make_tmap_bf16_2d(&tmX, dy, rows, K, K, xgemm::kXBox)) return m;
  // [nseg * K rows, M columns]: boxes of 64 K rows x 64 M columns (MN-major A)
  if (const char* m = make_tmap_bf16_2d(&tmW, w, (uint64_t)nseg * K, M, M, xgemm::WM / 2)) return m;
  const xgemm::Params p = xgemm::make_params(seg_offsets, seg_counts, nseg, static_cast<int>(rows), K, M, false, out,
                                             nullptr);
  return launch_expert_kernel(expert_gemm_kernel<false, true>, tmW, tmX, p, h, trow, num_ctas, stream);
}

const char* launch_grouped_gemm(bool swiglu, const void* A, int64_t a_rows, int K, const void* B,
                                int b_rows_per_seg, const int* seg_offsets, const int* seg_counts, int nseg,
                                void* out, void* pre_out, int N, int num_ctas, cudaStream_t stream) {
  if (a_rows <= 0 || N <= 0) return nullptr;
  if (K <= 0 || K % 8 || N % 8) return "mok grouped_gemm: K and N must be positive multiples of 8";
  if (a_rows > (int64_t)1 << 30) return "mok grouped_gemm: too many rows";
  if (nseg < 1) return "mok grouped_gemm: no segments";
  if (!aligned16(out) || (pre_out != nullptr && !aligned16(pre_out)))
    return "mok grouped_gemm: out and pre_out must start at a 16-byte aligned address (16-byte stores)";
  // routed experts (real-row counts known): expert-major tiles, unless MOK_GEMM_EXPERT=0
  if (seg_offsets != nullptr && seg_counts != nullptr && xgemm::enabled())
    return launch_expert_gemm(swiglu, A, a_rows, K, B, nseg, seg_offsets, seg_counts, out, pre_out, N, num_ctas,
                              stream);
  CUtensorMap tmA, tmB;
  if (const char* m = make_tmap_bf16_2d(&tmA, A, a_rows, K, K, gemm::BM)) return m;
  if (const char* m = make_tmap_bf16_2d(&tmB, B, (uint64_t)nseg * b_rows_per_seg, K, K, gemm::BN / 2)) return m;
  const gemm::Params p = gemm::make_params(seg_offsets, seg_counts, nseg, static_cast<int>(a_rows), K, N,
                                           b_rows_per_seg, swiglu, out, pre_out);
  const int m_tiles = static_cast<int>((a_rows + gemm::BM - 1) / gemm::BM);
  if (gemm::pairing_enabled(true)) {
    const int units = (m_tiles + 1) / 2 * p.n_tiles;
    return swiglu ? launch<true, true>(tmA, tmB, p, units, num_ctas, stream)
                  : launch<false, true>(tmA, tmB, p, units, num_ctas, stream);
  }
  const int units = m_tiles * p.n_tiles;
  return swiglu ? launch<true, false>(tmA, tmB, p, units, num_ctas, stream)
                : launch<false, false>(tmA, tmB, p, units, num_ctas, stream);
}

}  // namespace mok
