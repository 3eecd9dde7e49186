// The routed experts' GEMMs in block-scaled e4m3: the gate/up GEMM on column tasks
// (expert_gemm_fp8.cuh), the down projection and the backward's dgrads on row tasks
// (expert_gemm_fp8_rows.cuh).
#include <algorithm>

#include "gemm/expert_gemm_fp8.cuh"
#include "gemm/expert_gemm_fp8_rows.cuh"

namespace mok {
namespace {

using xgemm8::Epilogue;

// The gate/up GEMM (SwiGLU epilogue) on column tasks of <= 256 token rows: persistent CTAs claim
// the expert-major tasks (expert_gemm_kernel's order; gemm::claim_task, xgemm::TaskRing). kPaired
// (an even weight-block count): 2-CTA clusters claim units P in xgemm::decode_pair's order, so the
// cluster's CTAs (tasks 2 P, 2 P + 1) run two weight blocks of one chunk and share its token boxes
// by multicast.
template <bool kPaired>
__global__ void __launch_bounds__(xgemm::kThreads, 1)
    expert_gemm_fp8_kernel(const __grid_constant__ CUtensorMap tmW, const __grid_constant__ CUtensorMap tmX,
                           const __grid_constant__ CUtensorMap tmR, const __grid_constant__ xgemm8::Params p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ int chunk_prefix[xgemm::kMaxSeg + 1];
  const xgemm8::Smem sm = xgemm8::carve_smem(smem_raw);
  if (threadIdx.x < 32) xgemm::build_chunk_prefix<xgemm8::kWideTok>(p.g, chunk_prefix);
  if (threadIdx.x == 32) {
    if (kPaired) gemm::init_mailbox(sm.tail().mailbox());
    xgemm::init_task_ring(sm.tail().task_ring());
  }
  gemm::init_ring_barriers_and_sync<kPaired>(sm, xgemm8::kWideStages);
  const int nk = xgemm8::k_blocks(p.g.K);
  gemm::run_roles<tuning::kE4m3ProducerRegs, tuning::kE4m3ConsumerRegs>(
      [&] {
        tma_prefetch_desc(&tmW);
        tma_prefetch_desc(&tmX);
        tma_prefetch_desc(&tmR);
        uint32_t it = 0;
        xgemm::produce_tasks(sm, it, [&](const xgemm::Task& t, bool) {
          xgemm8::produce_task<true, kPaired>(p.g, &tmW, &tmX, &tmR, sm, t, it);
        });
      },
      [&] {
        if (threadIdx.x != 32) return;
        const int units = xgemm::num_tasks(p.g, chunk_prefix) / (kPaired ? 2 : 1);  // paired: task pairs
        xgemm::claim_tasks(
            sm.tail().task_ring(),
            [&](uint32_t j) { return gemm::claim_task<kPaired>(p.tickets, j, units, sm.tail().mailbox()); },
            [&](int u, xgemm::Task* t, bool*) {
              *t = kPaired ? xgemm::decode_pair(p.g, chunk_prefix, 2 * u + static_cast<int>(cluster_ctarank()))
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
            xgemm8::mma_task_wide_any<kPaired>(p.g, sm, cw, acc, sum, it, t.n_tok, ws);
          }
          // read again from the task's first stage's tag: the task (or its slot) kept live through
          // the main loop costs registers
          const int slot = gemm::task_tag(sm.tail().task_tags(), it - nk);
          xgemm::Task done = xgemm::load_task(sm.tail().task_ring(), slot);
          // the padding rows after the staged stores, from a third read (the task held through the
          // SwiGLU stores spilled)
          done.pad1 = done.pad0;
          xgemm::store_task<true>(p.g, sm, done, cw, acc);
          xgemm::store_task_padding<true>(p.g, xgemm::load_task(sm.tail().task_ring(), slot), cw);
        }
      });
  // paired: no CTA leaves while its peer may still multicast into it or arrive on its barriers
  if constexpr (kPaired) cluster_sync();
}

// The plain GEMMs (the down projection, the backward's dgrads) on row tasks
// (expert_gemm_fp8_rows.cuh): the tokens on wgmma's M side, <= 128 a task, two 128-row weight tiles
// on its N side; persistent CTAs claim them expert-major (as above). kPaired (a multiple of 4 weight
// tiles): 2-CTA clusters claim xgemm8r::decode_pair's units, each CTA one task of the unit, a chunk
// pair's weights loaded half each and multicast (the task ring's flag: shares_w).
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
  gemm::run_roles<tuning::kE4m3ProducerRegs, tuning::kE4m3ConsumerRegs>(
      [&] {
        tma_prefetch_desc(&tmW);
        tma_prefetch_desc(&tmX);
        tma_prefetch_desc(&tmR);
        uint32_t it = 0;
        xgemm::produce_tasks(sm, it, [&](const xgemm::Task& t, bool shares_w) {
          xgemm8r::produce_task<kPaired>(p.g, &tmW, &tmX, &tmR, sm, t, it, shares_w);
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

// The row kernel of an epilogue (the gate/up GEMM runs on column tasks: expert_gemm_fp8_kernel).
template <bool kPaired>
decltype(&expert_gemm_fp8_rows_kernel<Epilogue::kPlain, kPaired>) pick_rows_kernel(Epilogue e) {
  switch (e) {
    case Epilogue::kSwiGLUBackward: return expert_gemm_fp8_rows_kernel<Epilogue::kSwiGLUBackward, kPaired>;
    case Epilogue::kPlainPush: return expert_gemm_fp8_rows_kernel<Epilogue::kPlainPush, kPaired>;
    default: return expert_gemm_fp8_rows_kernel<Epilogue::kPlain, kPaired>;
  }
}

}  // namespace

const char* launch_expert_gemm_fp8(bool swiglu, const void* x8, int64_t rows, int K, const float* x_scale,
                                   int x_scale_ld, const void* w8, const float* w_scale, int nseg,
                                   const int* seg_offsets, const int* seg_counts, void* out, void* pre_out, int N,
                                   const SwiGLUBackward& bwd, const int* push_rank, const int* push_slot,
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
  const void* h = bwd.h;
  if (!aligned16(out) || (pre_out != nullptr && !aligned16(pre_out)))
    return "mok expert_gemm_fp8: out and pre_out must start at a 16-byte aligned address (16-byte accesses)";
  if (const char* m = xgemm::check_swiglu_bwd(bwd, N)) return m;
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
  // the gate/up GEMM on column tasks (paired when its weight-block count is even), the others on
  // row tasks (paired when their weight-tile count is a multiple of 4): the fastest of each
  const bool rows_layout = !swiglu;
  const int task_tok = rows_layout ? xgemm8r::kTok : xgemm8::kWideTok;
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
  p.bwd = xgemm::swiglu_bwd_of(bwd);
  p.push = xgemm::RowPush{push_rank, push_slot, push ? *push_bufs : PeerPtrs{}};
  if (dh_q != nullptr) p.dh_e4m3 = xgemm::PairBlockE4m3{static_cast<uint8_t*>(dh_q), dh_q_scale, dh_q_ld};
  if (tickets == nullptr) return "mok expert_gemm_fp8: needs its task counter";
  p.tickets = tickets;
  // pairs need an even weight-block count (a cluster's two tasks are blocks 2 j, 2 j + 1 of a
  // chunk), row pairs whole pairs of tile pairs
  const bool rows_paired = rows_layout && xgemm8r::pairs_fit(p.g);
  const bool paired = (!rows_layout && p.g.n_blocks % 2 == 0) || rows_paired;
  const Epilogue epi = h != nullptr ? Epilogue::kSwiGLUBackward : (push ? Epilogue::kPlainPush : Epilogue::kPlain);
  const auto kernel = rows_paired    ? pick_rows_kernel<true>(epi)
                      : rows_layout  ? pick_rows_kernel<false>(epi)
                      : paired       ? expert_gemm_fp8_kernel<true>
                                     : expert_gemm_fp8_kernel<false>;
  const int smem = rows_layout ? xgemm8r::kSmemBytes : xgemm8::kSmemBytes;
  cudaLaunchAttribute cluster;
  cudaLaunchConfig_t cfg = launch_config(xgemm::kThreads, smem, stream, paired, &cluster);
  // CTAs (clusters: paired) the launch can run at once
  const int at_once = units_at_once(kernel, cfg, paired);
  if (at_once == 0) return "mok expert_gemm_fp8: cannot raise the shared-memory limit";
  // row tasks and clusters take two weight blocks a unit; a row-pair cluster two row tasks
  const int64_t blocks = rows_layout || paired ? (p.g.n_blocks + 1) / 2 : p.g.n_blocks;
  const int64_t max_units = (((int64_t)nseg + rows / task_tok + 1) * blocks + (rows_paired ? 1 : 0)) / (rows_paired ? 2 : 1);
  cfg.gridDim = persistent_grid(num_ctas, at_once, max_units, paired);
  if (cudaMemsetAsync(tickets, 0, sizeof(int), stream) != cudaSuccess)
    return "mok expert_gemm_fp8: zeroing the task counter failed";
  return launch_ex(cfg, kernel, tmW, tmX, tmR, p);
}

}  // namespace mok
