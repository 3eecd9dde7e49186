// Grouped GEMM building blocks for sm_90a: TMA loads (128-byte swizzle) into a STAGES-deep
// shared-memory ring, a producer warp, and two consumer warpgroups issuing wgmma m64n256k16
// (bf16 in, fp32 accumulate) on a 128 x 256 tile. The SwiGLU variant loads [gate; up] halves of
// 128 rows each as the 256 B-rows, so gate column j and up column j sit in the same thread's
// accumulators (d[i] and d[i + 64]) and the epilogue computes silu(gate) * up in registers.
//
// Paired mode (kPaired, clusters of 2 CTAs): the two CTAs of a cluster run m-tiles 2j and 2j + 1
// with the same n-tile in lockstep. When both m-tiles lie in one segment (expert) they need the same
// B block: each CTA loads one half of it and multicasts it into both CTAs' rings (cluster multicast,
// on-chip), so the expert's weights leave HBM once per two m-tiles. (Unpaired, the m-tiles of an
// expert run at the same time on different SMs but not in step, and Nsight Compute showed each of
// them re-reading the weights from HBM: the routed GEMMs were HBM-bound.) A stage is refilled only
// after the consumers of both CTAs freed it.
//
// Tiles are owned by exactly one CTA and reduce over K in a fixed order, so the output bits do not
// depend on the grid size, the pairing or on which CTA runs which tile.
#pragma once

#include "common.cuh"
#include "gemm/swiglu.cuh"

namespace mok {
// gemm: the token-major grouped GEMM (token rows on wgmma's M side) and the ring protocol, warp roles
// and task claims every GEMM kernel shares.
namespace gemm {

constexpr int BM = kTileRows;    // rows per tile (segments without seg_counts: BM-aligned, no tile straddles two)
constexpr int BN = 256;          // accumulator columns per tile
constexpr int BK = 64;           // K per stage: one 128-byte swizzle atom of bf16
constexpr int kStages = tuning::kGemmStages;
constexpr int kThreads = 384;    // warpgroup 0: producer; 1, 2: consumers (64 rows each)
constexpr int kABytes = BM * BK * 2;        // 16 KB
constexpr int kBBytes = BN * BK * 2;        // 32 KB
constexpr int kStageBytes = kABytes + kBBytes;
constexpr int kConsumerWarps = 8;         // each arrives once per stage on an empty barrier
constexpr int kSmemBytes = kStages * kStageBytes + 1024 /* alignment */ + 2 * kStages * 8;

struct Params {
  const int* seg_offsets;  // [nseg + 1] on the device, or null: one segment of a_rows rows
  const int* seg_counts;   // [nseg] real rows of each segment (rest: zero padding), or null: all real
  int nseg;
  int a_rows;              // rows of A and out (tiles at or past min(seg end, a_rows) are skipped)
  int K;
  int N;                   // output columns
  int b_rows_per_seg;
  int n_tiles;             // ceil(N / (swiglu ? BN / 2 : BN))
  __nv_bfloat16* out;      // [a_rows, N] row-major
  __nv_bfloat16* pre_out;  // SwiGLU only, optional: [a_rows, 2N] pre-activations [gate | up] (kept for the backward)
};

// The ring: stage s holds A at a(s) (BM x BK) and B at b(s) (BN x BK), 1024-byte aligned.
struct Smem {
  uint8_t* base;
  uint64_t* full;
  uint64_t* empty;
  __device__ __forceinline__ uint8_t* a(int s) const { return base + s * kABytes; }
  __device__ __forceinline__ uint8_t* b(int s) const { return base + kStages * kABytes + s * kBBytes; }
};

__device__ __forceinline__ Smem carve_smem(uint8_t* raw) {
  Smem s;
  s.base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  s.full = reinterpret_cast<uint64_t*>(s.base + kStages * kStageBytes);
  s.empty = s.full + kStages;
  return s;
}

__device__ __forceinline__ int rows_total(const Params& p) {
  return p.seg_offsets ? min(p.seg_offsets[p.nseg], p.a_rows) : p.a_rows;
}

// Segment holding row `row` (segments start at multiples of BM, so a tile is inside one).
__device__ __forceinline__ int find_segment(const Params& p, int row) {
  if (!p.seg_offsets) return 0;
  int lo = 0, hi = p.nseg;  // first index in [0, nseg] with seg_offsets[idx] > row, minus one
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (p.seg_offsets[mid + 1] <= row) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Ring wait: plain, or (megakernel) under a watchdog so a protocol stall cannot hang the GPU.
template <bool kWatch>
__device__ __forceinline__ bool ring_wait(uint64_t* bar, uint32_t parity, const Watchdog* w) {
  if constexpr (kWatch) {
    return mbar_wait_watch(bar, parity, *w);
  } else {
    mbar_wait(bar, parity);
    return true;
  }
}

// A consumer warp frees stage `s` of the ring: one arrival per warp, on this CTA's empty barrier
// and, paired, on the peer's (whose producer multicasts into this CTA's stage): there lane r
// arrives on CTA r's barrier (one mapa path, no rank lookup: that spilled the e4m3 epilogues).
template <bool kPaired>
__device__ __forceinline__ void release_stage(uint64_t* empty) {
  __syncwarp();
  const int lane = threadIdx.x % 32;
  if constexpr (kPaired) {
    if (lane < 2) mbar_arrive_remote(empty, lane);
  } else if (lane == 0) {
    mbar_arrive(empty);
  }
}

// After issuing a stage's wgmmas: commit them, wait until only they are in flight, and free the
// previous stage `prev` (< 0: the task's first stage, nothing to free); empty_of(i) is stage i's
// empty barrier.
template <bool kPaired, class EmptyOf>
__device__ __forceinline__ void commit_and_release_previous(int prev, EmptyOf empty_of) {
  wgmma_commit();
  if (prev >= 0) {
    wgmma_wait<1>();
    release_stage<kPaired>(empty_of(prev));
  }
}

// Ring barriers of a warp-specialised kernel: full (one producer arrival + TMA bytes), empty (the
// consumer warps), initialised by thread 32 before the block-wide sync that follows.
template <class Ring>
__device__ __forceinline__ void init_ring_barriers(const Ring& sm, int stages) {
  if (threadIdx.x == 32) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(sm.full(s), 1);
      mbar_init(sm.empty(s), kConsumerWarps);
    }
    mbar_fence_init();
  }
}

// The warp-specialised roles of every GEMM kernel: warpgroup 0 drops to kProducerRegs registers a
// thread, its thread 0 produces and its warps 1-3 run help() (the megakernel's pushers, the e4m3
// kernels' task claimer; nothing elsewhere); warpgroups 1 and 2 take kConsumerRegs and consume
// (consume(cw), cw = 0 or 1). The defaults and the e4m3 kernels' split: tuning.h.
template <int kProducerRegs = tuning::kProducerRegs, int kConsumerRegs = tuning::kConsumerRegs, class Produce,
          class Help, class Consume>
__device__ __forceinline__ void run_roles(Produce produce, Help help, Consume consume) {
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 65536, "the register file");
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      produce();
    } else if (threadIdx.x >= 32) {
      help();
    }
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    consume(wg - 1);
  }
}

// Empty-barrier arrivals per stage phase: the consumer warps of every CTA that writes the stage.
__host__ __device__ constexpr int empty_arrivals(bool paired) { return kConsumerWarps * (paired ? 2 : 1); }

// init_ring_barriers for a kernel that is paired or not, then the sync that publishes them: paired,
// the empty barriers count both CTAs' consumer warps and the cluster syncs (the peer multicasts
// into this CTA's ring only after its barriers exist); else the block syncs.
template <bool kPaired, class Ring>
__device__ __forceinline__ void init_ring_barriers_and_sync(const Ring& sm, int stages) {
  if (threadIdx.x == 32) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(sm.full(s), 1);
      mbar_init(sm.empty(s), empty_arrivals(kPaired));
    }
    mbar_fence_init();
  }
  if constexpr (kPaired)
    cluster_sync();
  else
    __syncthreads();
}

// ---- task claims of the persistent GEMMs ------------------------------------------------------------

// The task mailbox of a paired CTA: slot j % kMailbox holds its cluster leader's j-th claim (-1:
// stop), published by a remote store and a cluster-scope arrival on full[j % kMailbox].
constexpr int kMailbox = 8;  // slots (> kStages + 1: the leader never overruns the peer)
struct Mailbox {
  volatile int* box;
  uint64_t* full;
};

// One thread, before the first cluster sync (the peer stores into box only after it).
__device__ __forceinline__ void init_mailbox(const Mailbox& mb) {
  for (int j = 0; j < kMailbox; ++j) mbar_init(&mb.full[j], 1);
}

__device__ __forceinline__ void mailbox_send(const Mailbox& mb, uint32_t j, int t) {
  st_shared_cluster(mb.box + j % kMailbox, 1, t);
  mbar_arrive_remote<true>(mb.full + j % kMailbox, 1);
}

__device__ __forceinline__ int mailbox_receive(const Mailbox& mb, uint32_t j) {
  const uint32_t parity = (j / kMailbox) & 1;
  while (!mbar_try_wait<true>(mb.full + j % kMailbox, parity)) {
  }
  return ld_shared_b32(mb.box + j % kMailbox);
}

// The staged launches' j-th task of this CTA (paired: of its cluster), -1 when none is left: the
// next unclaimed one from the launch's ticket counter (so a CTA that starts late or drew short tasks
// takes more, and the launch ends when its work does; measured faster than round-robin). Paired,
// the cluster's first CTA claims and hands the task to the second through the mailbox. Which CTA
// runs a task changes no bit. total: the unit count.
template <bool kPaired>
__device__ __forceinline__ int claim_task(int* tickets, uint32_t j, int total, const Mailbox& mb) {
  if (kPaired && cluster_ctarank() != 0) return mailbox_receive(mb, j);
  int u = atomicAdd(tickets, 1);
  if (u >= total) u = -1;
  if constexpr (kPaired) mailbox_send(mb, j, u);
  return u;
}

// Producer, after its last task: the stage `it`, armed without bytes and its tag (*tag) -1, stops
// the consumers.
template <bool kWatch, class Ring>
__device__ __forceinline__ void arm_stop_stage(const Ring& ring, uint32_t it, volatile int* tag,
                                               const Watchdog* w = nullptr) {
  const int s = it % Ring::kStages;
  ring_wait<kWatch>(ring.empty(s), ((it / Ring::kStages) & 1) ^ 1, w);
  st_shared_b32(tag, -1);
  mbar_arrive(ring.full(s));
}

// The staged kernels' task tags: slot it % kTaskTags holds the tag of the task whose first stage is
// `it`. The producer posts it before that stage is armed (so the tag is not live through the
// task's loads); the consumers read it once the stage is full, and again for the task's epilogue
// (task_tag: a register held through the main loop spilled the SwiGLU epilogue). A slot is
// rewritten at stage it + kTaskTags, which the producer reaches only after the consumers freed
// stage it + kTaskTags - stages - 1: past the task's last stage, so past its epilogue, while a task
// has at most kTaskTags - stages - 1 stages (the launchers check K).
constexpr int kTaskTags = 256;

__device__ __forceinline__ void post_task(volatile int* tags, uint32_t it, int tag) {
  st_shared_b32(tags + it % kTaskTags, tag);
}

// The tag of the task whose first stage is `it` (posted, not yet overwritten: see above).
__device__ __forceinline__ int task_tag(const volatile int* tags, uint32_t it) {
  return ld_shared_b32(tags + it % kTaskTags);
}

// A consumer warpgroup's next task (-1: stop), once its first stage is full. The task's own first
// ring wait then passes at once.
template <class Ring>
__device__ __forceinline__ int next_task(const Ring& ring, uint32_t it, const volatile int* tags) {
  mbar_wait(ring.full(it % Ring::kStages), (it / Ring::kStages) & 1);
  return task_tag(tags, it);
}

// Producer: one thread streams the A and B K-blocks of `tile` through the ring. stage_tag (the
// megakernel): `tag` is written to stage_tag[s] of the tile's first stage before it is armed, so
// the consumers learn which task the stage belongs to. Paired: the peer runs a tile with the same
// n-tile and K, so both rings advance in lockstep. With a complete pair whose two m-tiles lie in one
// segment (each CTA checks the side facing its peer; the answers agree), this CTA loads B half
// cluster_ctarank() and multicasts it to both.
template <bool kSwiGLU, bool kWatch = false, bool kPaired = false>
__device__ __forceinline__ void produce_tile(const Params& p, const CUtensorMap* tmA, const CUtensorMap* tmB,
                                             const Smem& sm, int tile, uint32_t& it, const Watchdog* w = nullptr,
                                             volatile int* stage_tag = nullptr, int tag = 0, bool pair_complete = false) {
  const int m = tile / p.n_tiles, n = tile % p.n_tiles;
  const int row0 = m * BM;
  const int seg = find_segment(p, row0);
  const int brow = seg * p.b_rows_per_seg;
  const int b0 = kSwiGLU ? brow + n * (BN / 2) : brow + n * BN;
  const int b1 = kSwiGLU ? brow + p.N + n * (BN / 2) : b0 + BN / 2;
  const int nk = (p.K + BK - 1) / BK;
  const int half = kPaired ? static_cast<int>(cluster_ctarank()) : 0;
  const bool share_b = kPaired && pair_complete &&
                       (p.seg_offsets == nullptr ||
                        (half == 0 ? row0 + BM < p.seg_offsets[seg + 1] : row0 - BM >= p.seg_offsets[seg]));
  for (int kb = 0; kb < nk; ++kb, ++it) {
    const int s = it % kStages;
    const uint32_t phase = (it / kStages) & 1;
    ring_wait<kWatch>(&sm.empty[s], phase ^ 1, w);
    if (stage_tag != nullptr && kb == 0) stage_tag[s] = tag;
    mbar_arrive_expect_tx(&sm.full[s], kStageBytes);
    tma_load_2d(sm.a(s), tmA, &sm.full[s], kb * BK, row0);
    if (kPaired && share_b) {
      tma_load_2d_multicast(sm.b(s) + half * (kBBytes / 2), tmB, &sm.full[s], kb * BK, half ? b1 : b0, 0x3);
    } else {
      tma_load_2d(sm.b(s), tmB, &sm.full[s], kb * BK, b0);
      tma_load_2d(sm.b(s) + kBBytes / 2, tmB, &sm.full[s], kb * BK, b1);
    }
  }
}

// Does consumer warpgroup `cw` of `tile` hold any real row? Padding rows of a segment are zeros
// (dispatch zero-fills them), so their outputs are exact zeros whether computed or not: skipping
// their wgmmas frees the tensor cores for the other warpgroup and changes no bit.
__device__ __forceinline__ bool half_active(const Params& p, int tile, int cw) {
  const int row = (tile / p.n_tiles) * BM + cw * (BM / 2);
  if (!p.seg_offsets) return row < p.a_rows;
  const int e = find_segment(p, row);
  return p.seg_counts == nullptr || row < p.seg_offsets[e] + p.seg_counts[e];
}

// Consumer warpgroup `cw` (0 or 1): rows 64 cw .. 64 cw + 63 of the tile, all 256 columns.
// An inactive warpgroup only keeps the ring's barrier phases and leaves acc untouched (store_tile
// writes its zeros): any non-wgmma write of acc here makes ptxas serialize every wgmma (C7515).
template <bool kWatch = false, bool kPaired = false>
__device__ __forceinline__ void mma_tile(const Params& p, const Smem& sm, int cw, float (&acc)[128], uint32_t& it,
                                         bool active, const Watchdog* w = nullptr) {
  const int nk = (p.K + BK - 1) / BK;
  if (!active) {
    for (int kb = 0; kb < nk; ++kb, ++it) {
      const int s = it % kStages;
      ring_wait<kWatch>(&sm.full[s], (it / kStages) & 1, w);
      release_stage<kPaired>(&sm.empty[s]);
    }
    return;
  }
  int prev = -1;
  for (int kb = 0; kb < nk; ++kb, ++it) {
    const int s = it % kStages;
    const uint32_t phase = (it / kStages) & 1;
    ring_wait<kWatch>(&sm.full[s], phase, w);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      const uint64_t da = wgmma_desc_sw128(sm.a(s) + cw * (BM / 2) * 128 + kk * 32);
      const uint64_t db = wgmma_desc_sw128(sm.b(s) + kk * 32);
      wgmma_m64n256k16(acc, da, db, (kb > 0 || kk > 0) ? 1 : 0);
    }
    commit_and_release_previous<kPaired>(prev, [&](int i) { return &sm.empty[i]; });
    prev = s;
  }
  wgmma_wait<0>();
  fence_regs(acc);
  release_stage<kPaired>(&sm.empty[prev]);
}

// Two bf16 (rounded to nearest) in one 32-bit word, the first in the low half (lower address).
__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// A butterfly step between lane q and lane q ^ d of a quad: a lane with take_a sends its (a0, a1)
// and replaces them with what its partner sends; the other lane does the same with (b0, b1).
__device__ __forceinline__ void quad_swap(uint32_t& a0, uint32_t& a1, uint32_t& b0, uint32_t& b1, bool take_a, int d) {
  const uint32_t r0 = __shfl_xor_sync(0xffffffffu, take_a ? a0 : b0, d);
  const uint32_t r1 = __shfl_xor_sync(0xffffffffu, take_a ? a1 : b1, d);
  if (take_a) {
    a0 = r0;
    a1 = r1;
  } else {
    b0 = r0;
    b1 = r1;
  }
}

// 4x4 transpose of 32-bit words across the quad (the 4 lanes that share an accumulator row):
// lane q holds w[t] = its two columns of 8-column group t; afterwards it holds group q's 8
// columns, lane 0's pair first. Two butterfly stages: 2x2 blocks with lane q ^ 2, then words
// inside them with lane q ^ 1.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int q) {
  quad_swap(w[0], w[1], w[2], w[3], q & 2, 2);
  quad_swap(w[0], w[2], w[1], w[3], q & 1, 1);
}

// Epilogue straight from the accumulators: bf16 to global memory, rows < row_limit, columns < N.
// A quad first trades its 4-byte pieces (quad_transpose) so that every lane stores 8 consecutive
// columns of a row with one 16-byte store: whole 32-byte sectors and a quarter of the store
// instructions of storing each bf16 pair (ncu: those pair stores backed up the store queue and
// stalled the consumers, ~10% of a gate/up tile and ~18% of a down tile). N is a multiple of 8, so
// an 8-column group is entirely inside or outside the output. SwiGLU with pre_out also stores the
// rounded gate and up values, so the backward needs no gate/up recompute and sees the very values
// the forward activated. !active: the warpgroup's rows are padding (zero rows of A), written as
// +0, the value the MMA and silu(0) * 0 give them.
template <bool kSwiGLU>
__device__ __forceinline__ void store_tile(const Params& p, int tile, int cw, const float (&acc)[128], int row_limit,
                                           bool active = true) {
  const int m = tile / p.n_tiles, n = tile % p.n_tiles;
  const int t = threadIdx.x % 128;
  const int warp = t / 32, lane = t % 32, q = lane % 4;
  const int r0 = m * BM + cw * (BM / 2) + 16 * warp + lane / 4;
  const int c_tile = kSwiGLU ? n * (BN / 2) : n * BN;
  constexpr int kGroups = kSwiGLU ? BN / 16 : BN / 8;  // 8-column output groups per row
  const bool keep_h = kSwiGLU && p.pre_out != nullptr;
#pragma unroll
  for (int g0 = 0; g0 < kGroups; g0 += 4) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // accumulator rows r0 and r0 + 8
      uint32_t w[4], wg[4], wu[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int i = 4 * (g0 + k) + 2 * half;
        if constexpr (kSwiGLU) {
          w[k] = active ? bf16x2_bits(swiglu(acc[i], acc[i + 64]), swiglu(acc[i + 1], acc[i + 65])) : 0u;
          if (keep_h) {
            wg[k] = active ? bf16x2_bits(acc[i], acc[i + 1]) : 0u;
            wu[k] = active ? bf16x2_bits(acc[i + 64], acc[i + 65]) : 0u;
          }
        } else {
          w[k] = active ? bf16x2_bits(acc[i], acc[i + 1]) : 0u;
        }
      }
      quad_transpose(w, q);
      if (keep_h) {
        quad_transpose(wg, q);
        quad_transpose(wu, q);
      }
      const int r = r0 + 8 * half;
      const int c = c_tile + 8 * (g0 + q);
      if (r < row_limit && c < p.N) {
        st16(p.out + static_cast<int64_t>(r) * p.N + c, make_uint4(w[0], w[1], w[2], w[3]));
        if (keep_h) {
          __nv_bfloat16* h = p.pre_out + static_cast<int64_t>(r) * (2 * p.N) + c;
          st16(h, make_uint4(wg[0], wg[1], wg[2], wg[3]));
          st16(h + p.N, make_uint4(wu[0], wu[1], wu[2], wu[3]));
        }
      }
    }
  }
}

// ---- host side ---------------------------------------------------------------------------------

// The GEMM over `nseg` segments (seg_offsets null: one segment of a_rows rows), K-major B of
// b_rows_per_seg rows per segment, N output columns; SwiGLU: B holds [gate; up] (2N rows).
inline Params make_params(const int* seg_offsets, const int* seg_counts, int nseg, int a_rows, int K, int N,
                          int b_rows_per_seg, bool swiglu, void* out, void* pre_out) {
  Params g{};
  g.seg_offsets = seg_offsets;
  g.seg_counts = seg_counts;
  g.nseg = nseg;
  g.a_rows = a_rows;
  g.K = K;
  g.N = N;
  g.b_rows_per_seg = b_rows_per_seg;
  g.n_tiles = (N + (swiglu ? BN / 2 : BN) - 1) / (swiglu ? BN / 2 : BN);
  g.out = static_cast<__nv_bfloat16*>(out);
  g.pre_out = swiglu ? static_cast<__nv_bfloat16*>(pre_out) : nullptr;
  return g;
}

}  // namespace gemm
}  // namespace mok
