// The expert-major bf16 GEMM (expert_gemm.cuh): the routed experts' forward GEMMs and the backward's
// dgrad (weights MN-major, the SwiGLU backward fused into the down projection's dgrad).
#include <algorithm>

#include "gemm/expert_gemm.cuh"

namespace mok {
namespace {

// The expert-major routed GEMM (expert_gemm.cuh): persistent CTAs walk the tasks round-robin.
// kWMN: the backward's dgrad, weights [K, M] per expert (MN-major A); with bw.h, the SwiGLU
// backward is fused into its epilogue (out = dh).
template <bool kSwiGLU, bool kWMN = false>
__global__ void __launch_bounds__(xgemm::kThreads, 1)
    expert_gemm_kernel(const __grid_constant__ CUtensorMap tmW, const __grid_constant__ CUtensorMap tmX,
                       xgemm::Params p, const xgemm::SwiGLUBwd bw) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ int chunk_prefix[xgemm::kMaxSeg + 1];  // static: addressed as shared (32-bit), no spill
  const xgemm::Smem sm = xgemm::carve_smem(smem_raw);
  if (threadIdx.x < 32) xgemm::build_chunk_prefix(p, chunk_prefix);
  gemm::init_ring_barriers(sm, xgemm::kStages);
  __syncthreads();
  const int tasks = xgemm::num_tasks(p, chunk_prefix);
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<tuning::kProducerRegs>();
    if (threadIdx.x == 0) {
      tma_prefetch_desc(&tmW);
      tma_prefetch_desc(&tmX);
      uint32_t it = 0;
      for (int u = blockIdx.x; u < tasks; u += gridDim.x)
        xgemm::produce_task<kSwiGLU, false, kWMN>(p, &tmW, &tmX, sm, xgemm::decode(p, chunk_prefix, u), it);
    }
  } else {
    setmaxnreg_inc<tuning::kConsumerRegs>();
    const int cw = wg - 1;
    float acc[128];
    uint32_t it = 0;
    for (int u = blockIdx.x; u < tasks; u += gridDim.x) {
      // decoded twice: keeping the task live through the main loop costs registers (spills)
      xgemm::mma_task_any<false, kWMN>(p, sm, cw, acc, it, xgemm::decode(p, chunk_prefix, u).n_tok);
      if (kWMN && bw.h != nullptr)
        xgemm::store_task_swiglu_bwd(p, sm, xgemm::decode(p, chunk_prefix, u), cw, acc, bw);
      else
        xgemm::store_task<kSwiGLU>(p, sm, xgemm::decode(p, chunk_prefix, u), cw, acc);
    }
  }
}

template <class Kernel>
const char* launch_expert_kernel(Kernel kernel, const CUtensorMap& tmW, const CUtensorMap& tmX, const xgemm::Params& p,
                                 const xgemm::SwiGLUBwd& bw, int num_ctas, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = launch_config(xgemm::kThreads, xgemm::kSmemBytes, stream, false, nullptr);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, xgemm::kSmemBytes) != cudaSuccess)
    return "mok grouped_gemm: cannot raise the shared-memory limit of the expert-major GEMM";
  // an upper bound of the task count (the real one is on the device)
  const int64_t max_tasks = ((int64_t)p.nseg + p.a_rows / xgemm::kMaxTok + 1) * p.n_blocks;
  const int ctas = num_ctas > 0 ? num_ctas : num_sms();
  cfg.gridDim = dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ctas, max_tasks))));
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
  return launch_expert_kernel(swiglu ? expert_gemm_kernel<true> : expert_gemm_kernel<false>, tmW, tmX, p,
                              xgemm::SwiGLUBwd{}, num_ctas, stream);
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
  return launch_expert_kernel(expert_gemm_kernel<false, true>, tmW, tmX, p, xgemm::swiglu_bwd_of(bwd), num_ctas,
                              stream);
}

}  // namespace mok
