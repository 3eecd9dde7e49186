// The block-scaled e4m3 quantizers (quant/e4m3.cuh has the recipe): token rows (bf16 -> e4m3 rows with
// one scale per row and 128 columns) and back, the expert weights (one scale per 128 x 128 tile, with
// an optional transposed copy for the dgrads), and the weight gradients' operands (the transpose of
// an expert's rows, one scale per column and expert).
#include <algorithm>

#include "quant/e4m3.cuh"

namespace mok {
namespace {

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
// checks), their four loads issued before any is used. Measured alone: 3.4-3.6 TB/s, as fast as a
// half warp per item in plain order and 19% faster in gate/up pair order.
constexpr int kGroupItems = tuning::kQuantizeGroupItems;

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

}  // namespace

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
