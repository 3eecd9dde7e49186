// The routed experts' weight gradients (expert_wgrad.cuh), bf16 and e4m3.
#include "gemm/expert_wgrad.cuh"

namespace mok {
namespace {

// Routed weight gradients (expert_wgrad.cuh): persistent CTAs walk the tasks round-robin.
// E4m3Operands: the accumulators times a_scale[e][m] * b_scale[e][n] first. kAddF32: out is fp32
// and the tiles are added into it (add_task_f32), else out is bf16 and written (store_task_tma).
template <class Ops, bool kAddF32>
__global__ void __launch_bounds__(xgemm::kThreads, 1)
    expert_wgrad_kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                        const __grid_constant__ CUtensorMap tmOut, xwgrad::Params p, const float* a_scale,
                        const float* b_scale) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const auto sm = xwgrad::carve_smem(smem_raw);
  gemm::init_ring_barriers(sm, sm.kStages);
  if (kAddF32 && threadIdx.x == 64) {
    mbar_init(sm.main_grad_full(0), 1);
    mbar_init(sm.main_grad_full(1), 1);
    mbar_fence_init();
  }
  __syncthreads();
  const int tasks = xwgrad::num_tasks(p);
  gemm::run_roles(
      [&] {
        tma_prefetch_desc(&tmA);
        tma_prefetch_desc(&tmB);
        uint32_t it = 0;
        for (int u = blockIdx.x; u < tasks; u += gridDim.x) {
          const xwgrad::Task t = xwgrad::decode(p, u);
          xwgrad::produce_task<Ops>(p, &tmA, &tmB, sm, t, it);
          if constexpr (kAddF32) xwgrad::produce_main_grad_round<Ops>(p, &tmOut, sm, t, it);
        }
      },
      [] {},
      [&](int cw) {
        float acc[128];
        uint32_t it = 0, main_grad_phase = 0;
        for (int u = blockIdx.x; u < tasks; u += gridDim.x) {
          const xwgrad::Task t = xwgrad::decode(p, u);
          // e4m3: the scales' loads are in flight during the MMA
          const auto scales = xwgrad::task_scales<Ops>(p, sm, a_scale, b_scale, t, cw);
          if constexpr (kAddF32) {
            xwgrad::mma_task<Ops>(p, sm, cw, t, acc, it, [&] {
              if (threadIdx.x % 128 == 0) xwgrad::load_main_grad_first_round(sm, &tmOut, t, cw);
            });
            xwgrad::add_task_f32(p, sm, &tmOut, t, cw, acc, main_grad_phase, it, scales);
          } else {
            xwgrad::mma_task<Ops>(p, sm, cw, t, acc, it);
            xwgrad::store_task_tma(p, sm, &tmOut, t, cw, acc, scales);
          }
        }
        if (threadIdx.x % 128 == 0) bulk_wait_all();  // the boxes stay until TMA is done
      });
}

// The persistent grid of a weight-gradient launch: at most one CTA a task.
template <class Kernel>
const char* launch_wgrad(Kernel kernel, int smem, const xwgrad::Params& p, int num_ctas, cudaStream_t stream,
                         const CUtensorMap& tmA, const CUtensorMap& tmB, const CUtensorMap& tmOut,
                         const float* a_scale, const float* b_scale) {
  cudaLaunchConfig_t cfg = launch_config(xgemm::kThreads, smem, stream, false, nullptr);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
    return "mok expert_wgrad: cannot raise the shared-memory limit";
  cfg.gridDim = persistent_grid(num_ctas, num_sms(), (int64_t)p.nseg * p.m_blocks * p.n_blocks, false);
  return launch_ex(cfg, kernel, tmA, tmB, tmOut, p, a_scale, b_scale);
}

const char* check_wgrad_shape(int nseg, int M, int N, const void* out) {
  if (nseg < 1) return "mok expert_wgrad: no segments";
  if (M <= 0 || N <= 0 || M % 8 || N % 8) return "mok expert_wgrad: M and N must be positive multiples of 8";
  if (!aligned16(out)) return "mok expert_wgrad: out must start at a 16-byte aligned address (16-byte stores)";
  return nullptr;
}

// The output map and the kernel instance of a bf16 (written) or fp32 (added into) out.
template <class Ops>
const char* launch_wgrad_out(const xwgrad::Params& p, bool out_f32, int num_ctas, cudaStream_t stream,
                             const CUtensorMap& tmA, const CUtensorMap& tmB, const float* a_scale,
                             const float* b_scale) {
  CUtensorMap tmOut;
  if (const char* m = out_f32 ? xwgrad::make_out_map_f32(&tmOut, p.out, p.nseg, p.M, p.N)
                              : xwgrad::make_out_map(&tmOut, p.out, p.nseg, p.M, p.N))
    return m;
  if (out_f32)
    return launch_wgrad(expert_wgrad_kernel<Ops, true>, xwgrad::Smem::kBytes, p, num_ctas, stream, tmA, tmB, tmOut,
                        a_scale, b_scale);
  return launch_wgrad(expert_wgrad_kernel<Ops, false>, xwgrad::Smem::kBytes, p, num_ctas, stream, tmA, tmB, tmOut,
                      a_scale, b_scale);
}

}  // namespace

const char* launch_expert_wgrad(const void* a, int64_t a_rows, int M, const int* a_offsets, const void* b,
                                int64_t b_rows, int N, const int* b_offsets, const int* counts, int nseg, int nparts,
                                void* out, bool out_f32, int num_ctas, cudaStream_t stream) {
  if (const char* m = check_wgrad_shape(nseg, M, N, out)) return m;
  if (nparts < 1) return "mok expert_wgrad: no parts";
  if (a_rows > (int64_t)1 << 30 || b_rows > (int64_t)1 << 30) return "mok expert_wgrad: too many rows";
  CUtensorMap tmA, tmB;
  if (const char* m = xwgrad::make_operand_maps(&tmA, &tmB, a, a_rows, M, b, b_rows, N)) return m;
  const xwgrad::Params p = xwgrad::make_params(a_offsets, b_offsets, counts, nseg, nparts, M, N, out);
  return launch_wgrad_out<xwgrad::Bf16Operands>(p, out_f32, num_ctas, stream, tmA, tmB, nullptr, nullptr);
}

const char* launch_expert_wgrad_fp8(const void* a_t, int M, const float* a_scale, const void* b_t, int N,
                                    const float* b_scale, int64_t ld, const int* offsets, const int* counts, int nseg,
                                    void* out, bool out_f32, int num_ctas, cudaStream_t stream) {
  if (const char* m = check_wgrad_shape(nseg, M, N, out)) return m;
  if (ld <= 0 || ld % 16 || ld > (int64_t)1 << 30)
    return "mok expert_wgrad_fp8: the transposes' token pitch must be a positive multiple of 16";
  if (!aligned16(a_t) || !aligned16(b_t) || (reinterpret_cast<uintptr_t>(a_scale) & 7) ||
      (reinterpret_cast<uintptr_t>(b_scale) & 7))
    return "mok expert_wgrad_fp8: operands need 16-byte and scales 8-byte aligned addresses";
  CUtensorMap tmA, tmB;
  if (const char* m = xwgrad::make_e4m3_operand_maps(&tmA, &tmB, a_t, M, b_t, N, ld)) return m;
  const xwgrad::Params p = xwgrad::make_params(offsets, offsets, counts, nseg, 1, M, N, out);
  return launch_wgrad_out<xwgrad::E4m3Operands>(p, out_f32, num_ctas, stream, tmA, tmB, a_scale, b_scale);
}

}  // namespace mok
