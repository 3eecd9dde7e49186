// Shared device helpers of the mok kernels: PTX wrappers for mbarriers, TMA, wgmma, system-scope
// flags, and the error-flag codes. No torch headers here (kernel files compile on CPU-only boxes).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "api.h"
#include "tuning.h"

namespace mok {

// Slots of the workspace's int32 error tensor (mirror of megatron_mok.workspace.ErrorCode).
enum ErrorCode : int {
  kErrCapacityOverflow = 0,
  kErrExpertIdOutOfRange = 1,
  kErrDuplicateExpert = 2,
  kErrNonfiniteProbs = 3,
  kErrPeerTimeout = 4,
  kErrKernelStall = 5,  // 1 + the rank whose in-kernel wait (megakernel watchdog) gave up
  kErrHeaderMismatch = 6,  // 1 + word + kHeaderWords * (site + 2 * peer): a peer's call header differs (api.h)
  kErrHeaderValue = 7,     // that peer's value of that word
};

// Expert segments of the routed rows start at multiples of kRowAlign (megatron_mok.config.ROW_ALIGN:
// the e4m3 weight gradients' 32-token groups); capacities are multiples of kTileRows (TILE_ROWS).
constexpr int kRowAlign = 32;
constexpr int kTileRows = 128;

// ---- small utilities ------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Volatile 32-bit accesses to shared memory through the shared window (STS/LDS; a volatile generic
// pointer becomes a 64-bit generic access, two registers in the 24-register producers).
__device__ __forceinline__ void st_shared_b32(const volatile int* p, int v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_u32(const_cast<const int*>(p))), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_shared_b32(const volatile int* p) {
  int v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(smem_u32(const_cast<const int*>(p))) : "memory");
  return v;
}

// Deterministic "max" error flag (the reference records max(token + 1)).
__device__ __forceinline__ void flag_max(int* flag, int value) { atomicMax(flag, value); }

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int ld_acquire_sys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(int* p, int v) {
  asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int ld_volatile(const int* p) {
  return *reinterpret_cast<const volatile int*>(p);
}

// GPU-scope flags between CTAs of one launch (the megakernel's ready counters).
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Returns the old value; acquires what the earlier adders released (a "last arrival" test).
__device__ __forceinline__ int atom_add_acq_rel_gpu(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// Orders this thread's generic-proxy global accesses with async-proxy (TMA) accesses: global data
// written with ordinary stores by one CTA and read by TMA in another needs it on both sides.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Named barriers over one warpgroup (128 threads); id 0 is __syncthreads.
__device__ __forceinline__ void warpgroup_bar_sync(int id) { asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory"); }

// OR of `pred` over the warpgroup (every thread gets the same answer).
__device__ __forceinline__ bool warpgroup_bar_or(int id, bool pred) {
  uint32_t out;
  asm volatile(
      "{\n"
      ".reg .pred p, q;\n"
      "setp.ne.u32 q, %1, 0;\n"
      "bar.red.or.pred p, %2, 128, q;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(out)
      : "r"((uint32_t)pred), "r"(id)
      : "memory");
  return out != 0;
}

// A spin-wait guard: gives up after timeout_ns, or at once when another waiter of the launch gave
// up (*abort != 0). Giving up records `code` in errors[kErrKernelStall] and sets *abort, so a bug
// or a stalled dependency ends the kernel (with garbage and a raised error) instead of hanging.
struct Watchdog {
  int* abort;
  int* errors;
  uint64_t timeout_ns;
  int code;
};

// Call in a spin loop with the loop's start time; true: stop waiting.
__device__ __forceinline__ bool watchdog_expired(const Watchdog& w, uint64_t t0, uint32_t& spins) {
  if ((++spins & 63) != 0) return false;
  if (ld_volatile(w.abort) != 0) return true;
  if (globaltimer_ns() - t0 > w.timeout_ns) {
    atomicCAS(w.errors + kErrKernelStall, 0, w.code);
    atomicExch(w.abort, 1);
    return true;
  }
  return false;
}

// 16-byte vector copies. Loads from peers use the non-coherent-free ordinary path (ld.global):
// the barrier that precedes the copy provides the ordering.
__device__ __forceinline__ uint4 ld16(const void* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ void st16(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Inclusive sum of v over the lanes 0..lane of a full warp.
__device__ __forceinline__ int warp_inclusive_sum(int v) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const int o = __shfl_up_sync(0xffffffffu, v, off);
    if (lane >= off) v += o;
  }
  return v;
}

// Real rows of expert e that its padded segment holds: min(counts[e], segment size), smaller than
// the count only after a capacity overflow (which the schedule flags).
__device__ __forceinline__ int segment_rows(const int* counts, const int* offsets, int e) {
  return max(0, min(counts[e], offsets[e + 1] - offsets[e]));
}

// 8 bf16 <-> 8 fp32 (one 16-byte vector); packing rounds to nearest.
__device__ __forceinline__ void unpack8(uint4 v, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 p = __bfloat1622float2(h[j]);
    f[2 * j] = p.x;
    f[2 * j + 1] = p.y;
  }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 o;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
  return o;
}

// One warp copies a row of n16 16-byte vectors, UNROLL loads in flight per lane.
template <int UNROLL = 4>
__device__ __forceinline__ void warp_copy_row(uint4* __restrict__ dst, const uint4* __restrict__ src, int n16, int lane) {
  int c = lane;
  for (; c + 32 * (UNROLL - 1) < n16; c += 32 * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) v[u] = ld16(src + c + 32 * u);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) st16(dst + c + 32 * u, v[u]);
  }
  for (; c < n16; c += 32) st16(dst + c, ld16(src + c));
}

// Push each routed row into slot row_src_slot of its source rank's [T * k, H] buffer (one warp per
// row, grid-strided; padding rows skipped). Slots are unique, so plain stores: no atomics.
__device__ __forceinline__ void push_rows_to_source_slots(const __nv_bfloat16* __restrict__ rows,
                                                          const int* __restrict__ row_src_rank,
                                                          const int* __restrict__ row_src_slot,
                                                          const int* __restrict__ expert_offsets, int nle,
                                                          int capacity, const PeerPtrs& slot_bufs, int H) {
  const int total = min(expert_offsets[nle], capacity);
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  const int n16 = H / 8;
  for (int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < total; row += warps) {
    const int dst_rank = row_src_rank[row];
    if (dst_rank < 0) continue;
    const int64_t slot = row_src_slot[row];
    uint4* dst = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(slot_bufs.p[dst_rank]) + slot * H);
    warp_copy_row(dst, reinterpret_cast<const uint4*>(rows + static_cast<int64_t>(row) * H), n16, lane);
  }
}

// ---- mbarrier -------------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@!P1 bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// One poll of the mbarrier's phase. kClusterAcquire: acquire at cluster scope (the phase was
// completed by another CTA's cluster-scope release: the paired staged GEMMs' task mailbox).
template <bool kClusterAcquire = false>
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t ok;
  if constexpr (kClusterAcquire)
    asm volatile(
        "{\n.reg .pred P1;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 P1, [%1], %2;\n"
        "selp.b32 %0, 1, 0, P1;\n}\n"
        : "=r"(ok)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  else
    asm volatile(
        "{\n.reg .pred P1;\nmbarrier.try_wait.parity.shared::cta.b64 P1, [%1], %2;\nselp.b32 %0, 1, 0, P1;\n}\n"
        : "=r"(ok)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  return ok != 0;
}

// mbar_wait with a watchdog; false: gave up (the phase did not complete).
template <bool kClusterAcquire = false>
__device__ __forceinline__ bool mbar_wait_watch(uint64_t* bar, uint32_t parity, const Watchdog& w) {
  if (mbar_try_wait<kClusterAcquire>(bar, parity)) return true;
  const uint64_t t0 = globaltimer_ns();
  uint32_t spins = 0;
  while (!mbar_try_wait<kClusterAcquire>(bar, parity))
    if (watchdog_expired(w, t0, spins)) return false;
  return true;
}

// ---- TMA ------------------------------------------------------------------------------------

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<uint64_t>(p)) : "memory");
}

__device__ __forceinline__ void tma_prefetch_desc(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// 2D tiled load of box {c0 (inner), c1} into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                            int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}

// 3D tiled load of box {c0 (inner), c1, c2} into shared memory, completing on `bar` (the fp32
// weight-gradient epilogue's main_grad boxes).
__device__ __forceinline__ void tma_load_3d(void* smem_dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
      : "memory");
}

// 4D tiled load of box {c0 (inner), c1, c2, c3} (the expert GEMM's interleaved gate/up weights).
__device__ __forceinline__ void tma_load_4d(void* smem_dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar))
      : "memory");
}

// An L2 cache policy under which the lines an access brings in are the first to be evicted.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// TMA store of a 3D box from shared memory (a bulk group of this thread; out-of-bounds parts of the
// box are not written) under the L2 cache policy `policy`. The smem writes it reads must be fenced
// into the async proxy first.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* smem_src, int c0, int c1, int c2,
                                             uint64_t policy) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%2, %3, %4}], [%1], %5;" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(smem_src)), "r"(c0), "r"(c1), "r"(c2), "l"(policy)
               : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// This thread's bulk groups have read their shared memory (it may be overwritten).
__device__ __forceinline__ void bulk_wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// ... until at most N of this thread's most recent bulk groups may still read shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory"); }
// This thread's bulk groups are complete (their global writes done).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Generic-proxy shared-memory writes made visible to the async proxy (TMA stores, wgmma).
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Cluster multicast (on-chip, SM to SM inside a thread-block cluster; not NVLink multicast): the
// box lands at the same shared-memory offset in every CTA of cta_mask and completes `bar` (same
// offset) in each of them.
__device__ __forceinline__ void tma_load_2d_multicast(void* smem_dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                                      int c1, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, "
      "%3}], [%4], %5;" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar)), "h"(cta_mask)
      : "memory");
}

// The same for a 4D box (the interleaved gate/up weights).
__device__ __forceinline__ void tma_load_4d_multicast(void* smem_dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                                      int c1, int c2, int c3, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, "
      "%3, %4, %5}], [%6], %7;" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar)), "h"(cta_mask)
      : "memory");
}

// ---- thread-block clusters --------------------------------------------------------------------

__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// All threads of all CTAs of the cluster; orders shared-memory writes (mbarrier init) and remote
// accesses before it against those after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// Arrive on the mbarrier at the same shared-memory offset in CTA `cta` of the cluster. Default
// semantics (CTA-scope release) suffice to free a ring stage, whose reads (wgmma) completed before;
// a cluster-scope release costs a GPU-scope fence (MEMBAR.ALL.GPU) per arrival. kClusterRelease:
// the receiver (acquire.cluster) also sees this thread's earlier shared::cluster stores (the
// paired staged GEMMs' task mailbox).
template <bool kClusterRelease = false>
__device__ __forceinline__ void mbar_arrive_remote(uint64_t* bar, uint32_t cta) {
  if constexpr (kClusterRelease)
    asm volatile(
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(smem_u32(bar)),
        "r"(cta)
        : "memory");
  else
    asm volatile(
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(smem_u32(bar)),
        "r"(cta)
        : "memory");
}

// Store v at the same shared-memory offset as `p` in CTA `cta` of the cluster.
__device__ __forceinline__ void st_shared_cluster(volatile int* p, uint32_t cta, int v) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "st.shared::cluster.u32 [remote], %2;\n"
      "}\n" ::"r"(smem_u32(const_cast<int*>(p))),
      "r"(cta), "r"(v)
      : "memory");
}

// ---- wgmma ----------------------------------------------------------------------------------

// Shared-memory matrix descriptor for a K-major tile written by TMA with 128-byte swizzle:
// rows of 64 bf16 (128 B), 8-row core groups 1024 B apart. The tile base must be 1024-aligned.
__device__ __forceinline__ uint64_t wgmma_desc_sw128(const void* smem) {
  uint64_t addr = smem_u32(smem);
  uint64_t desc = 0;
  desc |= (addr & 0x3FFFFull) >> 4;   // start address
  desc |= (uint64_t)1 << 16;          // leading byte offset (unused for swizzled K-major)
  desc |= (uint64_t)(1024 >> 4) << 32;  // stride byte offset: 8 rows x 128 B
  desc |= (uint64_t)1 << 62;          // 128-byte swizzle
  return desc;
}

// The same for an MN-major tile: 128-byte rows of 64 M (or N) elements, one row per K, 8-row groups
// 1024 B apart (SBO); the leading byte offset steps to the next 64 elements of M, here the next
// 8 KB box (a warpgroup's m64 operand spans one, so wgmma does not step).
__device__ __forceinline__ uint64_t wgmma_desc_sw128_mn(const void* smem) {
  uint64_t addr = smem_u32(smem);
  uint64_t desc = 0;
  desc |= (addr & 0x3FFFFull) >> 4;
  desc |= (uint64_t)(8192 >> 4) << 16;
  desc |= (uint64_t)(1024 >> 4) << 32;
  desc |= (uint64_t)1 << 62;
  return desc;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

template <int kRegs>
__device__ __forceinline__ void fence_regs(float (&d)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <uint32_t kRegCount>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegCount));
}
template <uint32_t kRegCount>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegCount));
}

// D[64 x 256] (+)= A[64 x 16] * B[256 x 16]^T, bf16 inputs from shared memory, fp32 accumulators.
// Accumulator layout (thread t of the warpgroup, warp w = t / 32, lane l): d[i] holds
// row 16 w + l / 4 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (l % 4) + (i % 2).
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                 int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]),
        "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]),
        "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]),
        "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// ---- host helpers ---------------------------------------------------------------------------

using TmapEncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                  const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                  CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled from the driver (no -lcuda symbol needed at run time), or nullptr.
inline TmapEncodeFn tmap_encoder() {
  static TmapEncodeFn encode = nullptr;
  if (encode == nullptr) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult qres;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &qres) ==
            cudaSuccess &&
        qres == cudaDriverEntryPointSuccess)
      encode = reinterpret_cast<TmapEncodeFn>(fn);
  }
  return encode;
}

// A tensor map of `rank` dims (dims[0] contiguous; byte strides of dims 1.. in strides), box `box`,
// out-of-bounds elements read as zero.
inline const char* encode_tmap(CUtensorMap* map, CUtensorMapDataType dtype, CUtensorMapSwizzle swizzle,
                               const void* base, cuuint32_t rank, const cuuint64_t* dims, const cuuint64_t* strides,
                               const cuuint32_t* box) {
  TmapEncodeFn encode = tmap_encoder();
  if (encode == nullptr) return "mok: cannot load cuTensorMapEncodeTiled from the CUDA driver";
  if (reinterpret_cast<uintptr_t>(base) & 15) return "mok: TMA operands need 16-byte aligned addresses";
  for (cuuint32_t i = 0; i + 1 < rank; ++i)
    if (strides[i] % 16) return "mok: TMA operands need 16-byte aligned rows";
  const cuuint32_t estr[5] = {1, 1, 1, 1, 1};
  CUresult r = encode(map, dtype, rank, const_cast<void*>(base), dims, strides, box, estr,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? nullptr : "mok: cuTensorMapEncodeTiled failed";
}

// The same in bf16 with the 128-byte swizzle (every GEMM operand).
inline const char* encode_tmap_bf16(CUtensorMap* map, const void* base, cuuint32_t rank, const cuuint64_t* dims,
                                    const cuuint64_t* strides, const cuuint32_t* box) {
  for (cuuint32_t i = 0; i + 1 < rank; ++i)
    if (strides[i] % 16) return "mok: TMA operands need 16-byte aligned rows (row length a multiple of 8 bf16)";
  return encode_tmap(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, CU_TENSOR_MAP_SWIZZLE_128B, base, rank, dims, strides,
                     box);
}

// A 2D bf16 tensor: `rows` x `cols` (cols contiguous, row pitch `ld` elements), box {64 cols,
// box_rows rows}. Returns nullptr on success, else a message.
inline const char* make_tmap_bf16_2d(CUtensorMap* map, const void* base, uint64_t rows, uint64_t cols,
                                     uint64_t ld, uint32_t box_rows) {
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {ld * 2};
  const cuuint32_t box[2] = {64, box_rows};
  return encode_tmap_bf16(map, base, 2, dims, strides, box);
}

// Gate/up weights [nseg * 2 n, k] (per expert: n gate rows, then n up rows) seen as 4D
// {k, 8 rows, gate|up, 8-row block}: a box {64, 8, 2, 8} is 64 K-columns of eight pairs
// [8 gate rows; the same 8 up rows], 128 rows in shared memory. The block count stops n rows short
// of the end, so that no in-bounds coordinate addresses past the tensor (blocks past it read zeros).
inline const char* make_tmap_gate_up_pairs(CUtensorMap* map, const void* base, uint64_t nseg, uint64_t n,
                                           uint64_t k) {
  if (n % 8) return "mok: the gate/up pair map needs n a multiple of 8";
  const cuuint64_t dims[4] = {k, 8, 2, (nseg * 2 * n - n) / 8};
  const cuuint64_t strides[3] = {k * 2, n * k * 2, 8 * k * 2};
  const cuuint32_t box[4] = {64, 8, 2, 8};
  return encode_tmap_bf16(map, base, 4, dims, strides, box);
}

// e4m3 operands (bytes): a 2D tensor `rows` x `cols` with box {128 cols, box_rows rows}, and the
// gate/up pair map of make_tmap_gate_up_pairs with 128 K-columns per box.
inline const char* make_tmap_e4m3_2d(CUtensorMap* map, const void* base, uint64_t rows, uint64_t cols,
                                     uint32_t box_rows) {
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols};
  const cuuint32_t box[2] = {128, box_rows};
  return encode_tmap(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, CU_TENSOR_MAP_SWIZZLE_128B, base, 2, dims, strides, box);
}

inline const char* make_tmap_gate_up_pairs_e4m3(CUtensorMap* map, const void* base, uint64_t nseg, uint64_t n,
                                                uint64_t k) {
  if (n % 8) return "mok: the gate/up pair map needs n a multiple of 8";
  const cuuint64_t dims[4] = {k, 8, 2, (nseg * 2 * n - n) / 8};
  const cuuint64_t strides[3] = {k, n * k, 8 * k};
  const cuuint32_t box[4] = {128, 8, 2, 8};
  return encode_tmap(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, CU_TENSOR_MAP_SWIZZLE_128B, base, 4, dims, strides, box);
}

// fp32 rows without swizzle: `rows` x `cols`, row pitch `ld` elements, box {box_cols, 1 row}.
inline const char* make_tmap_f32_rows(CUtensorMap* map, const void* base, uint64_t rows, uint64_t cols, uint64_t ld,
                                      uint32_t box_cols) {
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {ld * 4};
  const cuuint32_t box[2] = {box_cols, 1};
  return encode_tmap(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, CU_TENSOR_MAP_SWIZZLE_NONE, base, 2, dims, strides, box);
}

inline int num_sms() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  return n > 0 ? n : 132;
}

inline const char* launch_status() {
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

// A launch configuration of `threads`-thread CTAs, as 2-CTA clusters when paired (*cluster holds
// the attribute); the caller sets gridDim.
inline cudaLaunchConfig_t launch_config(int threads, int smem_bytes, cudaStream_t stream, bool paired,
                                        cudaLaunchAttribute* cluster) {
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  if (paired) {
    cluster->id = cudaLaunchAttributeClusterDimension;
    cluster->val.clusterDim.x = 2;
    cluster->val.clusterDim.y = 1;
    cluster->val.clusterDim.z = 1;
    cfg.attrs = cluster;
    cfg.numAttrs = 1;
  }
  return cfg;
}

// How many of kernel's CTAs (unpaired) or 2-CTA clusters (paired) fit on the current device at once,
// its shared-memory limit raised to cfg's there first; 0: the limit could not be raised. Both are
// per device (one process may drive several GPUs), so the figure is cached per (kernel, device):
// the occupancy query costs host time at every launch.
template <typename Kernel>
int units_at_once(Kernel kernel, const cudaLaunchConfig_t& cfg, bool paired) {
  struct Entry {
    const void* kernel;
    int device, smem, units;
  };
  static std::mutex mu;
  static std::vector<Entry> cache;
  int dev = 0;
  cudaGetDevice(&dev);
  const void* key = reinterpret_cast<const void*>(kernel);
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const Entry& e : cache)
      if (e.kernel == key && e.device == dev && e.smem == static_cast<int>(cfg.dynamicSmemBytes)) return e.units;
  }
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, cfg.dynamicSmemBytes) != cudaSuccess)
    return 0;
  int units = paired ? num_sms() / 2 : num_sms();
  if (paired) {
    cudaLaunchConfig_t probe = cfg;
    probe.gridDim = dim3(2);
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, kernel, &probe) == cudaSuccess && n > 0) units = n;
    cudaGetLastError();
  }
  std::lock_guard<std::mutex> lock(mu);
  cache.push_back(Entry{key, dev, static_cast<int>(cfg.dynamicSmemBytes), units});
  return units;
}

// The grid of a persistent launch of units (a CTA, or paired a 2-CTA cluster): num_ctas CTAs when
// > 0 (paired: num_ctas / 2 units), else as many units as run at once (at_once, units_at_once);
// at most max_units units, at least one.
inline dim3 persistent_grid(int num_ctas, int at_once, int64_t max_units, bool paired) {
  const int64_t units = num_ctas > 0 ? (paired ? num_ctas / 2 : num_ctas) : at_once;
  return dim3(static_cast<unsigned>((paired ? 2 : 1) * std::max<int64_t>(1, std::min<int64_t>(units, max_units))));
}

// cudaLaunchKernelEx, its error as a message (nullptr: launched).
template <typename Kernel, typename... Args>
const char* launch_ex(const cudaLaunchConfig_t& cfg, Kernel kernel, const Args&... args) {
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return cudaGetErrorString(e);
  }
  return launch_status();
}

}  // namespace mok
