// The routed experts' forward GEMMs in block-scaled e4m3 (expert_gemm_fp8.cuh), and the quantizer
// of their token operands (bf16 rows -> e4m3 rows + one scale per row and 128 columns).
#include <stdlib.h>
#include <string.h>

#include <cuda_fp8.h>

#include <algorithm>

#include "e4m3.cuh"
#include "expert_gemm_fp8.cuh"
#include "expert_gemm_fp8_rows.cuh"

namespace mok {
namespace {

using xgemm8::Epilogue;

// Persistent CTAs claim the expert-major tasks (expert_gemm_kernel's order; gemm::claim_task,
// xgemm::TaskRing), tasks of <= kChunk token rows: 256 (the bf16 tasks' chunks; one chunk per expert
// of <= 256 rows reads its weights once) or 128 (MOK_FP8_TASK_ROWS=128: the earlier chunks, same
// bits). kPaired (MOK_FP8_TASKS=pairs; 256-row chunks, an even block count): 2-CTA clusters claim
// units P in xgemm8::decode_pair's order, so the cluster's CTAs (tasks 2 P, 2 P + 1) run two weight
// blocks of one chunk and share its token boxes by multicast.
template <Epilogue kEpi, int kChunk, bool kPaired = false>
__global__ void __launch_bounds__(xgemm::kThreads, 1)
    expert_gemm_fp8_kernel(const __grid_constant__ CUtensorMap tmW, const __grid_constant__ CUtensorMap tmX,
                           const __grid_constant__ CUtensorMap tmR, const __grid_constant__ xgemm8::Params p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ int chunk_prefix[xgemm::kMaxSeg + 1];
  const xgemm8::Smem sm = xgemm8::carve_smem(smem_raw);
  if (threadIdx.x < 32) xgemm::build_chunk_prefix<kChunk>(p.g, chunk_prefix);
  if (threadIdx.x == 32) {
    if (kPaired) gemm::init_mailbox(sm.tail().mailbox());
    xgemm::init_task_ring(sm.tail().task_ring());
  }
  gemm::init_ring_barriers_and_sync<kPaired>(sm, xgemm8::kWideStages);
  const int nk = xgemm8::k_blocks(p.g.K);
  gemm::run_roles<24, 240>(
      [&] {
        tma_prefetch_desc(&tmW);
        tma_prefetch_desc(&tmX);
        tma_prefetch_desc(&tmR);
        uint32_t it = 0;
        xgemm::produce_tasks(sm, it, [&](const xgemm::Task& t, bool) {
          xgemm8::produce_task<kEpi == Epilogue::kSwiGLU, false, kPaired>(p.g, &tmW, &tmX, &tmR, sm, t, it);
        });
      },
      [&] {
        if (threadIdx.x != 32) return;
        const int units = xgemm::num_tasks(p.g, chunk_prefix) / (kPaired ? 2 : 1);  // paired: task pairs
        xgemm::claim_tasks(
            sm.tail().task_ring(),
            [&](uint32_t j) { return gemm::claim_task<kPaired>(p.tickets, j, units, sm.tail().mailbox()); },
            [&](int u, xgemm::Task* t, bool*) {
              *t = kPaired ? xgemm8::decode_pair(p.g, chunk_prefix, 2 * u + static_cast<int>(cluster_ctarank()))
                           : xgemm::decode(p.g, chunk_prefix, u);
            });
      },
      [&](int cw) {
        float acc[128], sum[64];
        uint32_t it = 0;
        for (;;) {
          {
            const int slot = gemm::next_task(sm, it, sm.tail().task_tags());
            if (slot < 0) break;
            const xgemm::Task t = xgemm::load_task(sm.tail().task_ring(), slot);
            const float* ws = p.w_scale + ((int64_t)t.seg * p.g.n_blocks + t.block) * nk;
            xgemm8::mma_task_wide_any<kChunk, kPaired>(p.g, sm, cw, acc, sum, it, t.n_tok, ws);
          }
          // read again from the task's first stage's tag: the task (or its slot) kept live through
          // the main loop costs registers
          const int slot = gemm::task_tag(sm.tail().task_tags(), it - nk);
          xgemm::Task done = xgemm::load_task(sm.tail().task_ring(), slot);
          if constexpr (kEpi == Epilogue::kSwiGLUBackward) {
            xgemm::store_task_swiglu_bwd<kChunk, 0>(p.g, sm, done, cw, acc, p.h, nullptr);
          } else {
            // the padding rows after the staged stores, from a third read (the task held through
            // the SwiGLU stores spilled)
            done.pad1 = done.pad0;
            xgemm::store_task<kEpi == Epilogue::kSwiGLU, kChunk, 0>(
                p.g, sm, done, cw, acc, kEpi == Epilogue::kPlainPush ? &p.push : nullptr);
            xgemm::store_task_padding<kEpi == Epilogue::kSwiGLU>(p.g, xgemm::load_task(sm.tail().task_ring(), slot), cw);
          }
        }
      });
  // paired: no CTA leaves while its peer may still multicast into it or arrive on its barriers
  if constexpr (kPaired) cluster_sync();
}

// Row tasks (expert_gemm_fp8_rows.cuh): the tokens on wgmma's M side, <= 128 a task,
// two 128-row weight tiles on its N side; persistent CTAs claim them expert-major (as above).
// kPaired (MOK_FP8_ROW_PAIRS=1, the default): 2-CTA clusters claim xgemm8r::decode_pair's units,
// each CTA one task of the unit, a chunk pair's weights loaded half each and multicast (the task
// ring's flag: shares_w).
template <Epilogue kEpi, bool kPaired = false>
__global__ void __launch_bounds__(xgemm::kThreads, 1)
    expert_gemm_fp8_rows_kernel(const __grid_constant__ CUtensorMap tmW, const __grid_constant__ CUtensorMap tmX,
                                const __grid_constant__ CUtensorMap tmR, const __grid_constant__ xgemm8::Params p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ int chunk_prefix[xgemm::kMaxSeg + 1];
  const xgemm8r::Smem sm = xgemm8r::carve_smem(smem_raw);
  if (threadIdx.x < 32) xgemm::build_chunk_prefix<xgemm8r::kTok>(p.g, chunk_prefix);
  if (threadIdx.x == 32) {
    if (kPaired) gemm::init_mailbox(sm.tail().mailbox());
    xgemm::init_task_ring(sm.tail().task_ring());
  }
  gemm::init_ring_barriers_and_sync<kPaired>(sm, xgemm8r::kStages);
  const int nk = xgemm8::k_blocks(p.g.K);
  gemm::run_roles<24, 240>(
      [&] {
        tma_prefetch_desc(&tmW);
        tma_prefetch_desc(&tmX);
        tma_prefetch_desc(&tmR);
        uint32_t it = 0;
        xgemm::produce_tasks(sm, it, [&](const xgemm::Task& t, bool shares_w) {
          xgemm8r::produce_task<kEpi == Epilogue::kSwiGLU, kPaired>(p.g, &tmW, &tmX, &tmR, sm, t, it, shares_w);
        });
      },
      [&] {
        if (threadIdx.x != 32) return;
        const int units = kPaired ? xgemm8r::num_pair_units(p.g, chunk_prefix) : xgemm8r::num_tasks(p.g, chunk_prefix);
        xgemm::claim_tasks(
            sm.tail().task_ring(),
            [&](uint32_t j) { return gemm::claim_task<kPaired>(p.tickets, j, units, sm.tail().mailbox()); },
            [&](int u, xgemm::Task* t, bool* shares_w) {
              if constexpr (kPaired)
                *t = xgemm8r::decode_pair(p.g, chunk_prefix, u, static_cast<int>(cluster_ctarank()), *shares_w);
              else
                *t = xgemm8r::decode(p.g, chunk_prefix, u);
            });
      },
      [&](int cw) {
        float acc[128], sum[64];
        uint32_t it = 0;
        for (;;) {
          {
            const int slot = gemm::next_task(sm, it, sm.tail().task_tags());
            if (slot < 0) break;
            const xgemm::Task t = xgemm::load_task(sm.tail().task_ring(), slot);
            const float* ws = p.w_scale + ((int64_t)t.seg * p.g.n_blocks + xgemm8r::kTiles * t.block) * nk;
            xgemm8r::mma_task<kPaired>(p.g, sm, cw, t, acc, sum, it, ws);
          }
          // read again (as in expert_gemm_fp8_kernel)
          const int slot = gemm::task_tag(sm.tail().task_tags(), it - nk);
          xgemm8r::store_task<kEpi>(p, sm, xgemm::load_task(sm.tail().task_ring(), slot), cw, acc);
        }
      });
  // paired: no CTA leaves while its peer may still multicast into it or arrive on its barriers
  if constexpr (kPaired) cluster_sync();
}

// Where the scale of (row, 128-column block kb) lives: the GEMM's [kb][row] (row stride 1) or the
// dispatch's [row][kb] rows (kb stride 1).
struct ScaleLayout {
  int64_t row_stride, kb_stride;
  __device__ __forceinline__ int64_t at(int64_t r, int kb) const { return r * row_stride + kb * kb_stride; }
};

// Eight lanes per (row, 128-column block) item, 16 columns a lane as two 16-byte loads: q =
// e4m3(x * 448 / amax') (round to nearest even, saturating), scale amax' / 448. Lane l holds the
// block's columns 8 l .. 8 l + 7 and 64 + 8 l .. 64 + 8 l + 7, so each load and each 8-byte store of
// the eight lanes covers 128 and 64 contiguous bytes. gate_up_pairs: x [rows, K] holds [gate | up]
// (K / 2 columns each) and q's block kb is gate columns 64 kb .. 64 kb + 63, then the same up
// columns (the K order of fc1's transposed e4m3 copy): the same lanes, other source columns.
// A lane group takes kGroupItems consecutive items (row-major over (row, kb); int32: the launcher
// checks), their four loads issued before any is used. Measured (seventeenth session, alone): 3.4-3.6
// TB/s, as the half-warp kernel before it in plain order and 19% faster in gate/up pair order.
constexpr int kGroupItems = 2;

__global__ void __launch_bounds__(256) quantize_rows_e4m3_kernel(const __nv_bfloat16* __restrict__ x,
                                                                 uint8_t* __restrict__ q, float* __restrict__ scale,
                                                                 int64_t rows, int K, ScaleLayout sl,
                                                                 const int* rows_end, bool gate_up_pairs) {
  if (rows_end != nullptr) rows = min(rows, (int64_t)max(0, *rows_end));
  const int nkb = K / 128;
  const int items = static_cast<int>(rows) * nkb;
  const int l8 = threadIdx.x % 8;
  // the lane's two 8-column pieces of block kb: source columns c0 + 64 kb, c1 + 64 kb (pairs) or
  // c0 + 128 kb, c1 + 128 kb; q bytes 8 l8 and 64 + 8 l8 of the block
  const int c0 = 8 * l8, c1 = (gate_up_pairs ? K / 2 : 64) + 8 * l8, kb_cols = gate_up_pairs ? 64 : 128;
  const int groups = gridDim.x * (blockDim.x / 8);
  for (int first = kGroupItems * ((int)blockIdx.x * (blockDim.x / 8) + (int)threadIdx.x / 8); first < items;
       first += kGroupItems * groups) {
    float v[kGroupItems][2][8];  // the lane's two pieces of each item
    int row[kGroupItems], kb[kGroupItems];
#pragma unroll
    for (int u = 0; u < kGroupItems; ++u) {
      const int item = first + u;
      row[u] = item / nkb;
      kb[u] = item - row[u] * nkb;
      if (item < items) {
        const __nv_bfloat16* src = x + (int64_t)row[u] * K + kb[u] * kb_cols;
        unpack8(ld16(src + c0), v[u][0]);
        unpack8(ld16(src + c1), v[u][1]);
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) v[u][j / 8][j % 8] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kGroupItems; ++u) {
      const int item = first + u;
      const float amax = e4m3::octet_amax(v[u][0], v[u][1]);
      if (item < items) {
        const float2 si = e4m3::scale_and_inverse(amax);
        uint8_t* dst = q + (int64_t)row[u] * K + kb[u] * 128 + 8 * l8;
        *reinterpret_cast<uint2*>(dst) = e4m3::pack8(v[u][0], si.y);
        *reinterpret_cast<uint2*>(dst + 64) = e4m3::pack8(v[u][1], si.y);
        if (l8 == 0) scale[sl.at(row[u], kb[u])] = si.x;
      }
    }
  }
}

// x[r][c] = bf16(e4m3 q[r][c] * scale of (r, c / 128)), 8 columns a thread; rows below
// min(rows, *rows_end) only.
__global__ void __launch_bounds__(256) dequantize_rows_e4m3_kernel(const uint8_t* __restrict__ q,
                                                                   const float* __restrict__ scale,
                                                                   __nv_bfloat16* __restrict__ x, int64_t rows, int K,
                                                                   ScaleLayout sl, const int* rows_end) {
  if (rows_end != nullptr) rows = min(rows, (int64_t)max(0, *rows_end));
  const int per_row = K / 8;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows * per_row;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / per_row;
    const int c = static_cast<int>(i % per_row) * 8;
    const float s = scale[sl.at(r, c / 128)];
    float v[8];
    e4m3::unpack8(*reinterpret_cast<const uint2*>(q + r * K + c), v);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] *= s;
    st16(x + r * K + c, pack8(v));
  }
}

// The weight gradients' e4m3 operands (expert_wgrad_fp8): one CTA per (64 columns, expert).
// Pass 1: each column's amax over the expert's real rows (thread: 8 columns of every 32nd row).
// Pass 2: 128-row chunks, a thread quantizes rows 4 i .. 4 i + 3 of its 8 columns (rows past the
// count as zeros) and stores each column's 4 bytes as one word of the transposed tile
// [64 columns][128 rows], whose 16-byte chunks are XOR-swizzled by column / 8 (conflict-free
// stores; each column row then leaves as 16-byte pieces). The segment's columns of q_t are
// written up to ceil128(count), clipped to the segment.
template <bool kE4m3In>
__global__ void __launch_bounds__(256) quantize_columns_e4m3_kernel(const void* __restrict__ x,
                                                                    const float* __restrict__ x_scale, ScaleLayout sl,
                                                                    int C, const int* __restrict__ offsets,
                                                                    const int* __restrict__ counts,
                                                                    uint8_t* __restrict__ q_t, int64_t ld,
                                                                    float* __restrict__ scale) {
  __shared__ float part[32][64];
  __shared__ float inverse[64];
  __shared__ __align__(16) uint32_t tile[64 * 32];
  const int e = blockIdx.y, c = blockIdx.x * 64 + 8 * (threadIdx.x % 8);
  const int cg = threadIdx.x % 8, lane_r = threadIdx.x / 8;
  const int64_t off = offsets[e];
  const int seg = offsets[e + 1] - offsets[e];
  const int n = max(0, min(counts[e], seg));
  auto load8 = [&](int64_t row, float (&v)[8]) {
    if constexpr (kE4m3In) {  // dequantized to bf16 first, as dequantize_rows_e4m3 gives the rows
      e4m3::unpack8(*reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(x) + row * C + c), v);
      const float s = x_scale[sl.at(row, c / 128)];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = __bfloat162float(__float2bfloat16_rn(v[j] * s));
    } else {
      unpack8(ld16(static_cast<const __nv_bfloat16*>(x) + row * C + c), v);
    }
  };
  float amax[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int r = lane_r; r < n; r += 32) {
    float v[8];
    load8(off + r, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) amax[j] = fmaxf(amax[j], fabsf(v[j]));
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) part[lane_r][8 * cg + j] = amax[j];
  __syncthreads();
  if (threadIdx.x < 64) {
    float a = 0.f;
    for (int i = 0; i < 32; ++i) a = fmaxf(a, part[i][threadIdx.x]);
    const float2 si = e4m3::scale_and_inverse(a);
    scale[static_cast<int64_t>(e) * C + blockIdx.x * 64 + threadIdx.x] = si.x;
    inverse[threadIdx.x] = si.y;
  }
  __syncthreads();
  float inv[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) inv[j] = inverse[8 * cg + j];
  const int written = min((n + 127) / 128 * 128, seg);
  for (int t0 = 0; t0 < written; t0 += 128) {
    float v[4][8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = t0 + 4 * lane_r + i;
      if (r < n) {
        load8(off + r, v[i]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[i][j] = 0.f;
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)  // column 8 cg + j, rows 4 lane_r .. + 3: word lane_r of its row, swizzled
      tile[(8 * cg + j) * 32 + (lane_r ^ (4 * cg))] =
          e4m3::pack4(v[0][j] * inv[j], v[1][j] * inv[j], v[2][j] * inv[j], v[3][j] * inv[j]);
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = threadIdx.x / 8 + 32 * h, piece = threadIdx.x % 8;  // 16-byte piece of the column's row
      if (t0 + 16 * piece < written)
        *reinterpret_cast<uint4*>(q_t + (blockIdx.x * 64 + col) * ld + off + t0 + 16 * piece) =
            *reinterpret_cast<const uint4*>(&tile[col * 32 + 4 * (piece ^ (col / 8))]);
    }
    __syncthreads();
  }
}

constexpr int kTransposePitch = 144;  // bytes per row of the transposed tile (16-byte aligned rows)

// One CTA per (expert, 128-row weight tile, 128 columns): the tile's rows are rows 128 t .. 128 t + 127
// (plain) or gate rows 64 t .. 64 t + 63 and the same up rows (swiglu: w holds [gate (n); up (n)]),
// rows at or past n of a half count as zeros (fp8.quantize_weight pads them). A thread holds 8
// columns of 8 rows (16-byte loads); s = max(amax, kMinAmax) / 448, q = e4m3(w * 448 / amax').
// q_t (optional; whole tiles only): the transposed copy [nseg][K][tiles * 128] for the backward's
// dgrads, the tile's rows in the order above as its columns 128 t .. 128 t + 127, with the same
// scale at scale_t [nseg][K / 128][tiles].
__global__ void __launch_bounds__(256) quantize_weight_e4m3_kernel(const __nv_bfloat16* __restrict__ w,
                                                                      uint8_t* __restrict__ q,
                                                                      float* __restrict__ scale, int rows, int n,
                                                                      int K, int tiles, bool swiglu,
                                                                      uint8_t* __restrict__ q_t,
                                                                      float* __restrict__ scale_t) {
  __shared__ float warp_max[8];
  __shared__ __align__(16) uint8_t tile_t[128 * kTransposePitch];  // [column][row] of the quantized tile
  const int nkb = K / 128;
  const int kb = blockIdx.x % nkb, tile = (blockIdx.x / nkb) % tiles, seg = blockIdx.x / nkb / tiles;
  const int chunk = threadIdx.x % 16, r0 = threadIdx.x / 16;
  // the tile's row 16 j + r0: its offset in w and q (-1: past n, a zero row)
  auto offset = [&](int j) -> int64_t {
    const int rl = r0 + 16 * j;
    const int half = swiglu ? rl / 64 : 0, idx = swiglu ? tile * 64 + rl % 64 : tile * 128 + rl;
    return idx < n ? ((int64_t)seg * rows + half * n + idx) * K + kb * 128 + 8 * chunk : -1;
  };
  // the rows stay packed bf16 (32 registers, 3 CTAs an SM: more loads in flight than 64 fp32 would allow)
  uint4 raw[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int64_t off = offset(j);
    raw[j] = off >= 0 ? ld16(w + off) : make_uint4(0, 0, 0, 0);
  }
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float v[8];
    unpack8(raw[j], v);
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
#pragma unroll
  for (int i = 1; i < 8; ++i) amax = fmaxf(amax, warp_max[i]);
  const float2 si = e4m3::scale_and_inverse(amax);
  const float s = si.x;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int64_t off = offset(j);
    if (off < 0) continue;
    float v[8];
    unpack8(raw[j], v);
    const uint2 out = e4m3::pack8(v, si.y);
    *reinterpret_cast<uint2*>(q + off) = out;
    if (q_t != nullptr) {  // the 16-byte units of row 8 chunk + e XOR-swizzled by chunk: 2-way bank conflicts, not 16
#pragma unroll
      for (int e = 0; e < 8; ++e)
        tile_t[(8 * chunk + e) * kTransposePitch + ((r0 + 16 * j) ^ (16 * (chunk % 8)))] =
            static_cast<uint8_t>((e < 4 ? out.x : out.y) >> (8 * (e % 4)));
    }
  }
  if (threadIdx.x == 0) scale[((int64_t)seg * tiles + tile) * nkb + kb] = s;
  if (q_t == nullptr) return;
  if (threadIdx.x == 0) scale_t[((int64_t)seg * nkb + kb) * tiles + tile] = s;
  __syncthreads();
  // 128 rows (the tile's columns) x 8 pieces of 16 bytes
  const int64_t ld_t = (int64_t)tiles * 128;
#pragma unroll
  for (int i = threadIdx.x; i < 128 * 8; i += 256) {
    const int c = i / 8, piece = i % 8;
    const uint4 val = *reinterpret_cast<const uint4*>(tile_t + c * kTransposePitch + 16 * (piece ^ (c / 8 % 8)));
    *reinterpret_cast<uint4*>(q_t + ((int64_t)seg * K + kb * 128 + c) * ld_t + tile * 128 + 16 * piece) = val;
  }
}

template <int kChunk, bool kPaired = false>
decltype(&expert_gemm_fp8_kernel<Epilogue::kPlain, kChunk, kPaired>) pick_kernel(Epilogue e) {
  switch (e) {
    case Epilogue::kSwiGLU: return expert_gemm_fp8_kernel<Epilogue::kSwiGLU, kChunk, kPaired>;
    case Epilogue::kSwiGLUBackward: return expert_gemm_fp8_kernel<Epilogue::kSwiGLUBackward, kChunk, kPaired>;
    case Epilogue::kPlainPush: return expert_gemm_fp8_kernel<Epilogue::kPlainPush, kChunk, kPaired>;
    default: return expert_gemm_fp8_kernel<Epilogue::kPlain, kChunk, kPaired>;
  }
}

template <bool kPaired = false>
decltype(&expert_gemm_fp8_rows_kernel<Epilogue::kPlain, kPaired>) pick_rows_kernel(Epilogue e) {
  switch (e) {
    case Epilogue::kSwiGLU: return expert_gemm_fp8_rows_kernel<Epilogue::kSwiGLU, kPaired>;
    case Epilogue::kSwiGLUBackward: return expert_gemm_fp8_rows_kernel<Epilogue::kSwiGLUBackward, kPaired>;
    case Epilogue::kPlainPush: return expert_gemm_fp8_rows_kernel<Epilogue::kPlainPush, kPaired>;
    default: return expert_gemm_fp8_rows_kernel<Epilogue::kPlain, kPaired>;
  }
}

// MOK_FP8_TASKS: auto (the default: pairs for the SwiGLU forward, rows otherwise; the fastest of
// each at DeepSeek-V3 EP=2, eleventh session), rows (expert_gemm_fp8_rows_kernel), columns
// (expert_gemm_fp8_kernel: the weights on wgmma's M side; MOK_FP8_TASK_ROWS=128 or 256 token rows a
// task) or pairs (its paired form: 256-row column tasks in 2-CTA clusters; an odd weight-block count
// runs unpaired). Same bits.
enum class TaskLayout { kRows, kColumns256, kColumns128, kPairs };

const char* task_layout(bool swiglu, TaskLayout* layout) {
  const char* tasks = getenv("MOK_FP8_TASKS");
  const char* rows = getenv("MOK_FP8_TASK_ROWS");
  const bool automatic = tasks == nullptr || strcmp(tasks, "auto") == 0;
  if (automatic || strcmp(tasks, "pairs") == 0 || strcmp(tasks, "rows") == 0) {
    *layout = (automatic ? swiglu : tasks[0] == 'p') ? TaskLayout::kPairs : TaskLayout::kRows;
    return rows == nullptr ? nullptr : "mok expert_gemm_fp8: MOK_FP8_TASK_ROWS goes with MOK_FP8_TASKS=columns";
  }
  if (strcmp(tasks, "columns") != 0) return "mok expert_gemm_fp8: MOK_FP8_TASKS must be auto, rows, columns or pairs";
  if (rows == nullptr || strcmp(rows, "256") == 0) {
    *layout = TaskLayout::kColumns256;
    return nullptr;
  }
  *layout = TaskLayout::kColumns128;
  return strcmp(rows, "128") == 0 ? nullptr : "mok expert_gemm_fp8: MOK_FP8_TASK_ROWS must be 128 or 256";
}

// An A/B switch read per launch: unset or "1" is on, "0" off, anything else the error `bad`.
const char* env_switch(const char* name, const char* bad, bool* on) {
  const char* v = getenv(name);
  *on = v == nullptr || strcmp(v, "1") == 0;
  return *on || strcmp(v, "0") == 0 ? nullptr : bad;
}

// MOK_FP8_ROW_PAIRS: 1 (the default) runs the row-task launches in 2-CTA clusters whose chunk pairs
// share their weights by multicast (xgemm8r::decode_pair; a weight-tile count that is not a
// multiple of 4 runs unpaired); 0 one CTA a task. Same bits.
const char* row_pairs(bool* on) {
  return env_switch("MOK_FP8_ROW_PAIRS", "mok expert_gemm_fp8: MOK_FP8_ROW_PAIRS must be 0 or 1", on);
}

// MOK_GEMM_TICKETS: 1 (the default) the CTAs claim tasks from the launch's counter, 0 round-robin.
// Same bits.
const char* task_tickets(bool* on) {
  return env_switch("MOK_GEMM_TICKETS", "mok expert_gemm_fp8: MOK_GEMM_TICKETS must be 0 or 1", on);
}

}  // namespace

const char* launch_expert_gemm_fp8(bool swiglu, const void* x8, int64_t rows, int K, const float* x_scale,
                                   int x_scale_ld, const void* w8, const float* w_scale, int nseg,
                                   const int* seg_offsets, const int* seg_counts, void* out, void* pre_out, int N,
                                   const void* h, const int* push_rank, const int* push_slot,
                                   const PeerPtrs* push_bufs, void* dh_q, float* dh_q_scale, int64_t dh_q_ld,
                                   int* tickets, int num_ctas, cudaStream_t stream) {
  if (rows <= 0 || N <= 0) return nullptr;
  if (K <= 0 || K % 128) return "mok expert_gemm_fp8: K must be a positive multiple of 128 (the scale blocks)";
  if (xgemm8::k_blocks(K) + std::max(xgemm8::kWideStages, xgemm8r::kStages) + 1 > gemm::kTaskTags)
    return "mok expert_gemm_fp8: K must be at most 128 * 251 (a task's stages outlive its tag: gemm::kTaskTags)";
  if (N % 8) return "mok expert_gemm_fp8: N must be a multiple of 8";
  if (rows > (int64_t)1 << 30) return "mok expert_gemm_fp8: too many rows";
  if (nseg < 1 || nseg > xgemm::kMaxSeg) return "mok expert_gemm_fp8: 1 to 512 segments";
  if (seg_offsets == nullptr || seg_counts == nullptr) return "mok expert_gemm_fp8: needs segment offsets and counts";
  if (x_scale_ld % 4 || x_scale_ld < rows)
    return "mok expert_gemm_fp8: the token scales need a pitch >= rows, a multiple of 4 (quantize_rows_e4m3)";
  if (!aligned16(out) || (pre_out != nullptr && !aligned16(pre_out)) || (h != nullptr && !aligned16(h)))
    return "mok expert_gemm_fp8: out, pre_out and h must start at a 16-byte aligned address (16-byte accesses)";
  if (h != nullptr && (swiglu || pre_out != nullptr))
    return "mok expert_gemm_fp8: h (the SwiGLU backward epilogue) goes with plain weights and no pre_out";
  const bool push = push_rank != nullptr;
  if (push && (swiglu || h != nullptr || push_slot == nullptr || push_bufs == nullptr))
    return "mok expert_gemm_fp8: the push into source slots goes with plain weights, slots and peer buffers";
  if (dh_q != nullptr) {
    if (h == nullptr || dh_q_scale == nullptr)
      return "mok expert_gemm_fp8: dh's e4m3 copy goes with h (the SwiGLU backward) and its scales";
    if (N % 64) return "mok expert_gemm_fp8: dh's e4m3 copy needs N a multiple of 64 (whole gate/up pair blocks)";
    if (dh_q_ld % 4 || dh_q_ld < rows || !aligned16(dh_q))
      return "mok expert_gemm_fp8: dh's e4m3 copy needs 16-byte aligned rows and a scale pitch >= rows, a multiple of 4";
  }
  CUtensorMap tmW, tmX, tmR;
  if (const char* m = make_tmap_e4m3_2d(&tmX, x8, rows, K, xgemm::kXBox)) return m;
  if (swiglu) {
    if (const char* m = make_tmap_gate_up_pairs_e4m3(&tmW, w8, nseg, N, K)) return m;
  } else if (const char* m = make_tmap_e4m3_2d(&tmW, w8, (uint64_t)nseg * N, K, xgemm::WM)) {
    return m;
  }
  TaskLayout layout;
  if (const char* m = task_layout(swiglu, &layout)) return m;
  const bool rows_layout = layout == TaskLayout::kRows;
  const int task_tok = layout == TaskLayout::kColumns128 || rows_layout ? 128 : xgemm8::kWideTok;
  const int nkb = xgemm8::k_blocks(K);
  // the scale box: the column kernels' stages take kWideTok scales whatever their task size (their
  // expect_tx counts kScaleBytes; a smaller box hangs them), the row kernel's 128
  const int scale_box = rows_layout ? xgemm8r::kTok : xgemm8::kWideTok;
  if (const char* m = make_tmap_f32_rows(&tmR, x_scale, nkb, x_scale_ld, x_scale_ld, scale_box)) return m;
  xgemm8::Params p;
  p.g = xgemm::make_params(seg_offsets, seg_counts, nseg, static_cast<int>(rows), K, N, swiglu, out, pre_out);
  p.w_scale = w_scale;
  p.x_scale = x_scale;
  p.x_scale_ld = x_scale_ld;
  p.h = static_cast<const __nv_bfloat16*>(h);
  p.push = xgemm::RowPush{push_rank, push_slot, push ? *push_bufs : PeerPtrs{}};
  // dh's e4m3 copy: from the row tasks' epilogue, else by quantize_rows_e4m3 after the GEMM
  if (dh_q != nullptr && rows_layout)
    p.dh_e4m3 = xgemm::PairBlockE4m3{static_cast<uint8_t*>(dh_q), dh_q_scale, dh_q_ld};
  // pairs need an even weight-block count (a cluster's two tasks are blocks 2 j, 2 j + 1 of a
  // chunk), row pairs whole pairs of tile pairs
  bool rows_paired_wanted, dynamic;
  if (const char* m = row_pairs(&rows_paired_wanted)) return m;
  if (const char* m = task_tickets(&dynamic)) return m;
  if (dynamic && tickets == nullptr) return "mok expert_gemm_fp8: needs its task counter (MOK_GEMM_TICKETS=1)";
  p.tickets = dynamic ? tickets : nullptr;
  const bool rows_paired = rows_layout && rows_paired_wanted && xgemm8r::pairs_fit(p.g);
  const bool paired = (layout == TaskLayout::kPairs && p.g.n_blocks % 2 == 0) || rows_paired;
  const Epilogue epi = swiglu ? Epilogue::kSwiGLU
                               : (h != nullptr ? Epilogue::kSwiGLUBackward : (push ? Epilogue::kPlainPush : Epilogue::kPlain));
  const auto kernel = rows_paired ? pick_rows_kernel<true>(epi)
                      : rows_layout ? pick_rows_kernel(epi)
                      : paired    ? pick_kernel<xgemm8::kWideTok, true>(epi)
                                  : (task_tok == 128 ? pick_kernel<128>(epi) : pick_kernel<xgemm8::kWideTok>(epi));
  const int smem = rows_layout ? xgemm8r::kSmemBytes : xgemm8::kSmemBytes;
  cudaLaunchAttribute cluster;
  cudaLaunchConfig_t cfg = launch_config(xgemm::kThreads, smem, stream, paired, &cluster);
  // CTAs (clusters: paired) the launch can run at once
  const int at_once = units_at_once(kernel, cfg, paired, "expert_gemm_fp8");
  if (at_once == 0) return "mok expert_gemm_fp8: cannot raise the shared-memory limit";
  // row tasks and clusters take two weight blocks a unit; a row-pair cluster two row tasks
  const int64_t blocks = rows_layout || paired ? (p.g.n_blocks + 1) / 2 : p.g.n_blocks;
  const int64_t max_units = (((int64_t)nseg + rows / task_tok + 1) * blocks + (rows_paired ? 1 : 0)) / (rows_paired ? 2 : 1);
  const int64_t units = num_ctas > 0 ? (paired ? num_ctas / 2 : num_ctas) : at_once;
  cfg.gridDim = dim3(static_cast<unsigned>((paired ? 2 : 1) * std::max<int64_t>(1, std::min<int64_t>(units, max_units))));
  if (dynamic && cudaMemsetAsync(tickets, 0, sizeof(int), stream) != cudaSuccess)
    return "mok expert_gemm_fp8: zeroing the task counter failed";
  if (const char* m = launch_ex(cfg, kernel, tmW, tmX, tmR, p)) return m;
  if (dh_q == nullptr || rows_layout) return nullptr;
  return launch_quantize_rows_e4m3(out, rows, 2 * N, dh_q, dh_q_scale, 1, dh_q_ld, seg_offsets + nseg, true, stream);
}

const char* launch_quantize_rows_e4m3(const void* x, int64_t rows, int K, void* q, float* scale,
                                      int64_t scale_row_stride, int64_t scale_kb_stride, const int* rows_end,
                                      bool gate_up_pairs, cudaStream_t stream) {
  if (rows <= 0) return nullptr;
  if (K <= 0 || K % 128) return "mok quantize_rows_e4m3: K must be a positive multiple of 128";
  if (!aligned16(x) || !aligned16(q)) return "mok quantize_rows_e4m3: x and q must be 16-byte aligned";
  if (rows * (K / 128) > INT32_MAX) return "mok quantize_rows_e4m3: more than 2^31 (row, 128-column) blocks";
  // 32 lane groups a CTA, kGroupItems items each a round; at most 8 CTAs an SM's worth of rounds
  // in flight (the rest by the grid stride)
  const int64_t groups = (rows * (K / 128) + kGroupItems - 1) / kGroupItems;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((groups + 31) / 32, 8 * (int64_t)num_sms()));
  quantize_rows_e4m3_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), static_cast<uint8_t*>(q), scale, rows, K,
      ScaleLayout{scale_row_stride, scale_kb_stride}, rows_end, gate_up_pairs);
  return launch_status();
}

const char* launch_dequantize_rows_e4m3(const void* q, const float* scale, int64_t scale_row_stride,
                                        int64_t scale_kb_stride, void* x, int64_t rows, int K, const int* rows_end,
                                        cudaStream_t stream) {
  if (rows <= 0) return nullptr;
  if (K <= 0 || K % 128) return "mok dequantize_rows_e4m3: K must be a positive multiple of 128";
  if (!aligned16(x) || !aligned16(q)) return "mok dequantize_rows_e4m3: x and q must be 16-byte aligned";
  const int64_t items = rows * (K / 8);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((items + 255) / 256, 16 * (int64_t)num_sms()));
  dequantize_rows_e4m3_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      static_cast<const uint8_t*>(q), scale, static_cast<__nv_bfloat16*>(x), rows, K,
      ScaleLayout{scale_row_stride, scale_kb_stride}, rows_end);
  return launch_status();
}

const char* launch_quantize_columns_e4m3(const void* x, bool x_e4m3, const float* x_scale, int64_t scale_row_stride,
                                         int64_t scale_kb_stride, int64_t rows, int C, const int* offsets,
                                         const int* counts, int nseg, void* q_t, int64_t ld, float* scale,
                                         cudaStream_t stream) {
  if (nseg <= 0 || C <= 0) return nullptr;
  if (C % 64) return "mok quantize_columns_e4m3: the column count must be a multiple of 64";
  if (x_e4m3 && (C % 128 || x_scale == nullptr)) return "mok quantize_columns_e4m3: e4m3 rows need their 128-column scales";
  if (ld < rows || ld % 16) return "mok quantize_columns_e4m3: q_t's pitch must be >= rows and a multiple of 16";
  if (nseg > 65535) return "mok quantize_columns_e4m3: at most 65535 segments";
  if (!aligned16(x) || !aligned16(q_t)) return "mok quantize_columns_e4m3: x and q_t must be 16-byte aligned";
  const dim3 grid(static_cast<unsigned>(C / 64), static_cast<unsigned>(nseg));
  const ScaleLayout sl{scale_row_stride, scale_kb_stride};
  if (x_e4m3)
    quantize_columns_e4m3_kernel<true><<<grid, 256, 0, stream>>>(x, x_scale, sl, C, offsets, counts,
                                                                  static_cast<uint8_t*>(q_t), ld, scale);
  else
    quantize_columns_e4m3_kernel<false><<<grid, 256, 0, stream>>>(x, x_scale, sl, C, offsets, counts,
                                                                   static_cast<uint8_t*>(q_t), ld, scale);
  return launch_status();
}

const char* launch_quantize_weight_e4m3(const void* w, int nseg, int rows, int K, bool swiglu, void* q, float* scale,
                                        void* q_t, float* scale_t, cudaStream_t stream) {
  if (nseg <= 0 || rows <= 0) return nullptr;
  if (K <= 0 || K % 128) return "mok quantize_weight_e4m3: K must be a positive multiple of 128";
  if (swiglu && rows % 2) return "mok quantize_weight_e4m3: swiglu weights hold [gate; up]: an even row count";
  if (!aligned16(w) || !aligned16(q)) return "mok quantize_weight_e4m3: w and q must be 16-byte aligned";
  const int n = swiglu ? rows / 2 : rows;
  const int tiles = swiglu ? (n + 63) / 64 : (n + 127) / 128;
  if ((q_t == nullptr) != (scale_t == nullptr)) return "mok quantize_weight_e4m3: q_t and scale_t go together";
  if (q_t != nullptr && (n % (swiglu ? 64 : 128) || !aligned16(q_t)))
    return "mok quantize_weight_e4m3: the transposed copy needs whole tiles (rows a multiple of 128) and 16-byte "
           "alignment";
  const int64_t blocks = (int64_t)nseg * tiles * (K / 128);
  if (blocks > INT32_MAX) return "mok quantize_weight_e4m3: too many blocks";
  quantize_weight_e4m3_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(w), static_cast<uint8_t*>(q), scale, rows, n, K, tiles, swiglu,
      static_cast<uint8_t*>(q_t), scale_t);
  return launch_status();
}

}  // namespace mok
