// The routed experts' forward GEMMs in block-scaled e4m3 (expert_gemm_fp8.cuh), and the quantizer
// of their token operands (bf16 rows -> e4m3 rows + the per-stage scale ratios the GEMM reads).
#include <stdlib.h>

#include <algorithm>

#include "expert_gemm_fp8.cuh"

namespace mok {
namespace {

// Persistent CTAs walk the expert-major tasks round-robin (expert_gemm_kernel's order).
template <bool kSwiGLU>
__global__ void __launch_bounds__(xgemm::kThreads, 1)
    expert_gemm_fp8_kernel(const __grid_constant__ CUtensorMap tmW, const __grid_constant__ CUtensorMap tmX,
                           const __grid_constant__ CUtensorMap tmR, xgemm8::Params p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ int chunk_prefix[xgemm::kMaxSeg + 1];
  const xgemm8::Smem sm = xgemm8::carve_smem(smem_raw);
  if (threadIdx.x < 32) xgemm::build_chunk_prefix(p.g, chunk_prefix);
  gemm::init_ring_barriers(sm, xgemm8::kStages);
  __syncthreads();
  const int tasks = xgemm::num_tasks(p.g, chunk_prefix);
  const int nk = xgemm8::k_blocks(p.g.K);
  gemm::run_roles(
      [&] {
        tma_prefetch_desc(&tmW);
        tma_prefetch_desc(&tmX);
        tma_prefetch_desc(&tmR);
        uint32_t it = 0;
        for (int u = blockIdx.x; u < tasks; u += gridDim.x)
          xgemm8::produce_task<kSwiGLU>(p, &tmW, &tmX, &tmR, sm, xgemm::decode(p.g, chunk_prefix, u), it);
      },
      [] {},
      [&](int cw) {
        float acc[128];
        uint32_t it = 0;
        for (int u = blockIdx.x; u < tasks; u += gridDim.x) {
          const xgemm::Task t = xgemm::decode(p.g, chunk_prefix, u);
          const float* wr = p.w_ratio + ((int64_t)t.seg * p.g.n_blocks + t.block) * (nk + 1);
          const float* xfinal = p.x_ratio + (int64_t)nk * p.x_ratio_ld + t.row0;
          xgemm8::mma_task_any(p, sm, cw, acc, it, t.n_tok, wr, xfinal);
          // decoded again: keeping the task live through the main loop costs registers
          xgemm::store_task<kSwiGLU>(p.g, sm, xgemm::decode(p.g, chunk_prefix, u), cw, acc);
        }
      });
}

constexpr float kE4m3Max = 448.f;
constexpr float kMinAmax = 1e-4f;  // all-zero (padding) blocks get a finite scale

__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  return (uint32_t)lo | ((uint32_t)hi << 16);
}

// One warp per row, 128-column blocks in order: s = max(amax, kMinAmax) / 448, q = e4m3(x / s)
// (IEEE division, round to nearest even, saturating), scale[kb][row] = s,
// ratio[kb][row] = s[kb - 1] / s[kb] (kb >= 1), ratio[nkb][row] = s[nkb - 1], ratio[0][row] = 1.
__global__ void __launch_bounds__(256) quantize_rows_e4m3_kernel(const __nv_bfloat16* __restrict__ x,
                                                                 uint8_t* __restrict__ q, float* __restrict__ scale,
                                                                 float* __restrict__ ratio, int64_t rows, int K,
                                                                 int ld, const int* rows_end) {
  const int lane = threadIdx.x % 32;
  if (rows_end != nullptr) rows = min(rows, (int64_t)max(0, *rows_end));
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  const int nkb = K / 128;
  for (int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    const __nv_bfloat16* xr = x + r * K;
    float prev = 1.f;
    for (int kb = 0; kb < nkb; ++kb) {
      const uint2 raw = *reinterpret_cast<const uint2*>(xr + kb * 128 + 4 * lane);
      const __nv_bfloat162 v01 = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
      const __nv_bfloat162 v23 = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
      const float v[4] = {__low2float(v01), __high2float(v01), __low2float(v23), __high2float(v23)};
      float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
      for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      const float s = __fdiv_rn(fmaxf(amax, kMinAmax), kE4m3Max);
      *reinterpret_cast<uint32_t*>(q + r * K + kb * 128 + 4 * lane) =
          e4m3x4(__fdiv_rn(v[0], s), __fdiv_rn(v[1], s), __fdiv_rn(v[2], s), __fdiv_rn(v[3], s));
      if (lane == 0) {
        scale[(int64_t)kb * ld + r] = s;
        ratio[(int64_t)kb * ld + r] = kb == 0 ? 1.f : __fdiv_rn(prev, s);
      }
      prev = s;
    }
    if (lane == 0) ratio[(int64_t)nkb * ld + r] = prev;
  }
}

}  // namespace

const char* launch_expert_gemm_fp8(bool swiglu, const void* x8, int64_t rows, int K, const float* x_ratio,
                                   int x_ratio_ld, const void* w8, const float* w_ratio, int nseg,
                                   const int* seg_offsets, const int* seg_counts, void* out, void* pre_out, int N,
                                   int num_ctas, cudaStream_t stream) {
  if (rows <= 0 || N <= 0) return nullptr;
  if (K <= 0 || K % 128) return "mok expert_gemm_fp8: K must be a positive multiple of 128 (the scale blocks)";
  if (N % 8) return "mok expert_gemm_fp8: N must be a multiple of 8";
  if (rows > (int64_t)1 << 30) return "mok expert_gemm_fp8: too many rows";
  if (nseg < 1 || nseg > xgemm::kMaxSeg) return "mok expert_gemm_fp8: 1 to 512 segments";
  if (seg_offsets == nullptr || seg_counts == nullptr) return "mok expert_gemm_fp8: needs segment offsets and counts";
  if (x_ratio_ld % 4 || x_ratio_ld < rows + xgemm::kTokAlign)
    return "mok expert_gemm_fp8: the scale rows need a pitch >= rows + 16, a multiple of 4 (quantize_rows_e4m3)";
  if (!aligned16(out) || (pre_out != nullptr && !aligned16(pre_out)))
    return "mok expert_gemm_fp8: out and pre_out must start at a 16-byte aligned address (16-byte stores)";
  CUtensorMap tmW, tmX, tmR;
  if (const char* m = make_tmap_e4m3_2d(&tmX, x8, rows, K, xgemm::kXBox)) return m;
  if (swiglu) {
    if (const char* m = make_tmap_gate_up_pairs_e4m3(&tmW, w8, nseg, N, K)) return m;
  } else if (const char* m = make_tmap_e4m3_2d(&tmW, w8, (uint64_t)nseg * N, K, xgemm::WM)) {
    return m;
  }
  const int nkb = xgemm8::k_blocks(K);
  if (const char* m = make_tmap_f32_rows(&tmR, x_ratio, nkb + 1, x_ratio_ld, x_ratio_ld, xgemm::kMaxTok)) return m;
  xgemm8::Params p;
  p.g = xgemm::make_params(seg_offsets, seg_counts, nseg, static_cast<int>(rows), K, N, swiglu, out, pre_out);
  p.w_ratio = w_ratio;
  p.x_ratio = x_ratio;
  p.x_ratio_ld = x_ratio_ld;
  auto kernel = swiglu ? expert_gemm_fp8_kernel<true> : expert_gemm_fp8_kernel<false>;
  cudaLaunchConfig_t cfg = launch_config(xgemm::kThreads, xgemm8::kSmemBytes, stream, false, nullptr);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, xgemm8::kSmemBytes) != cudaSuccess)
    return "mok expert_gemm_fp8: cannot raise the shared-memory limit";
  const int64_t max_tasks = ((int64_t)nseg + rows / xgemm::kMaxTok + 1) * p.g.n_blocks;
  const int ctas = num_ctas > 0 ? num_ctas : num_sms();
  cfg.gridDim = dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ctas, max_tasks))));
  return launch_ex(cfg, kernel, tmW, tmX, tmR, p);
}

const char* launch_quantize_rows_e4m3(const void* x, int64_t rows, int K, void* q, float* scale, float* ratio, int ld,
                                      const int* rows_end, cudaStream_t stream) {
  if (rows <= 0) return nullptr;
  if (K <= 0 || K % 128) return "mok quantize_rows_e4m3: K must be a positive multiple of 128";
  if (ld < rows) return "mok quantize_rows_e4m3: the scale pitch is shorter than the rows";
  if (!aligned16(x) || !aligned16(q)) return "mok quantize_rows_e4m3: x and q must be 16-byte aligned";
  const int64_t blocks = std::min<int64_t>((rows + 7) / 8, 8 * (int64_t)num_sms());
  quantize_rows_e4m3_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), static_cast<uint8_t*>(q), scale, ratio, rows, K, ld, rows_end);
  return launch_status();
}

}  // namespace mok
