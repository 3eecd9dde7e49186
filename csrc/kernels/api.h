// The mok kernel library's API: host-side launchers, plain C++ with raw pointers and a cudaStream_t,
// so the kernel files need no torch headers; csrc/bindings/*.cpp wrap them as torch ops.
//
// Every launcher returns nullptr on success, else a static error message.
//
// Layout of csrc/kernels/: comm/ (the cross-rank barrier, the routing schedule, dispatch, combine,
// the backward's pull), gemm/ (the GEMM core: the token-major grouped GEMM and its TMA ring, the
// expert-major bf16 and e4m3 tasks, the weight gradients), quant/ (the e4m3 recipe and quantizers),
// passes/ (the persistent forward megakernel, the staged backward's launches); tuning.h holds the
// performance knobs, common.cuh the shared device helpers (PTX wrappers, TMA maps).
//
// Shape names: T tokens of this rank, k experts per token (top-k), H the hidden size, I / Is the
// routed / shared experts' intermediate size, ep the expert-parallel group size, nle the number of
// local experts (this rank's), capacity the routed rows this rank can hold (a multiple of 128; each
// local expert's segment of it starts at a multiple of 32, kRowAlign).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace mok {

constexpr int kMaxPeers = 72;  // an NVLink domain (NVL72); the EP size may be anything up to this

// One address per rank of the EP group (rank order): peers' symmetric buffers.
struct PeerPtrs {
  void* p[kMaxPeers];
};

// The per-call header (issue #33): the values of a call that can change between calls (T, H, k, E,
// capacity, dtype, precision; words[0] a nonzero magic), known on the host at launch. The first
// device barrier of a call (the schedule's, bwd_publish's) stores it into this rank's slot of every
// peer's barrier buffer before its epoch, and compares every rank's slot with its own after the wait;
// a mismatch sets errors[kErrHeaderMismatch] = 1 + word + kHeaderWords * (site + 2 * peer) (site 0:
// the schedule, 1: bwd_publish; the lowest disagreeing peer, then word) and errors[kErrHeaderValue] =
// the peer's word. words[0] == 0: no header (nothing stored or compared).
constexpr int kHeaderWords = 8;
constexpr int kHeaderRegions = 3;  // 0, 1: the schedule (its routing double-buffer half); 2: bwd_publish
struct CallHeader {
  int words[kHeaderWords];
};

// int32 elements of a barrier buffer with header regions: ep epoch slots, then
// [kHeaderRegions][ep][kHeaderWords] headers (rank q's header in slot q of every peer's buffer).
// Then [ep][kVerdictWords]: rank q's verdict record {rejected epoch, verdict word} (barrier_reject).
constexpr int kVerdictWords = 2;
inline int64_t barrier_flag_ints(int ep) {
  return ep + static_cast<int64_t>(kHeaderRegions) * ep * kHeaderWords + static_cast<int64_t>(kVerdictWords) * ep;
}

// Indices of the per-workspace int32 `state` tensor (local, not symmetric).
enum StateSlot : int {
  kStateBarrierEpoch = 0,  // barriers this rank has entered (monotonic epoch)
  kStateGatherCount = 1,   // routing all-gathers issued (selects the double-buffer half)
  kStateGatherParity = 2,  // half of the routing buffer that the current schedule reads
  kStateArrive = 3,        // blocks of a fused kernel that have arrived (the last one resets it)
  // The schedule kernel's task scheduler; all zero between launches (its last block resets them).
  kStateSchedTicket = 4,    // next task ticket
  kStateSchedDone = 5,      // finished tasks of phases 0 and 1
  kStateSchedReleased = 6,  // phases released (1: routing gathered, 2: scan done)
  kStateSchedExit = 7,      // blocks that have exited
  kStateSchedAbort = 8,     // a wait of the launch gave up (watchdog)
  kStateHalted = 9,  // errors[kErrHeaderMismatch] was set at a barrier: barriers open nothing (barrier.cuh)
  kStateInts = 16,          // the Python side mirrors it (STATE_INTS)
};

// ---- comm/: the cross-rank barrier, the routing schedule, dispatch and combine --------------

// dst[0, bytes) <- src (this rank's symmetric x buffer), then a full barrier (one launch).
// expert_counts [nle] / expert_offsets [nle + 1] (optional): the schedule of the call, emptied once
// errors[kErrHeaderMismatch] is set (a peer's verdict, a header mismatch): no later kernel that reads
// it touches a peer's rows (also launch_barrier's).
const char* launch_publish_barrier(const void* src, void* dst, int64_t bytes, const PeerPtrs& flags, int* state,
                                   int* errors, int rank, int ep, uint64_t timeout_ns, cudaStream_t stream,
                                   int* expert_counts = nullptr, int* expert_offsets = nullptr, int nle = 0);

// Cross-rank barrier on epoch counters: each rank stores its new epoch into slot `rank` of every
// peer's symmetric int32 [ep] flag buffer (st.release.sys), then waits (ld.acquire.sys) until all
// slots of its own buffer reach the epoch, for at most timeout_ns; a timeout writes 1 + peer into
// errors[kErrPeerTimeout] and returns instead of hanging. Later barriers skip waiting once that
// flag is set. bump_gather: also advance the routing double buffer (after the all-gather).
const char* launch_barrier(const PeerPtrs& flags, int* state, int* errors, int rank, int ep, uint64_t timeout_ns,
                           int bump_gather, cudaStream_t stream, int* expert_counts = nullptr,
                           int* expert_offsets = nullptr, int nle = 0);

// The opening half of that barrier alone (after the stream's earlier kernels); a later wait on the
// same epoch (bwd_epilogue with wait_flags) closes it.
const char* launch_barrier_open(const PeerPtrs& flags, int* state, int rank, int ep, cudaStream_t stream);

// A rank whose host checks failed joins the barrier its peers wait in, without waiting: its verdict
// record {next epoch, verdict} into every peer's buffer, then the negated epoch into its slot (the
// waiters set errors[kErrHeaderMismatch] = -(1 + rank), errors[kErrHeaderValue] = verdict).
// bump_gather: the peers are in the schedule's barrier (which flips the routing double buffer).
const char* launch_barrier_reject(const PeerPtrs& flags, int* state, int* errors, int rank, int ep, int bump_gather,
                                  int verdict, cudaStream_t stream);

// Scratch int32 elements that launch_schedule needs (uninitialised is fine).
int64_t schedule_scratch_ints(int ep, int T, int nle, int num_experts);

// Routing all-gather + the routed-row schedule of docs/DESIGN.md, one launch: top_experts
// (int32/int64 [T, k]), saturated to [-1, num_experts], goes as int32 into half
// (state[kStateGatherCount] & 1) of every rank's symmetric [2, ep, T, k] routing buffer
// (route_bufs; routing_buf: this rank's), row `rank`; a cross-rank barrier over `flags` (with the
// double-buffer bump); then top_all [ep, T, k] (a copy), row_src_rank / row_src_slot [capacity],
// expert_counts [nle], expert_offsets [nle + 1]. Flags bad expert ids, duplicates and capacity
// overflow (of any rank) into errors; a stalled in-kernel wait sets errors[kErrKernelStall] =
// 1 + rank and ends the kernel. header (words[0] != 0): the call's header rides on the barrier
// (CallHeader; flags buffers of barrier_flag_ints(ep) ints).
const char* launch_schedule(const void* top_experts, bool is_int64, const int* routing_buf, const PeerPtrs& route_bufs,
                            const PeerPtrs& flags, int* state, int* errors, int* top_all, int* row_src_rank,
                            int* row_src_slot, int* expert_counts, int* expert_offsets, int* scratch, int rank, int ep,
                            int T, int k, int nle, int num_experts, int capacity, uint64_t timeout_ns,
                            const CallHeader& header, cudaStream_t stream);

// Pull-dispatch: routed row i (i < min(expert_offsets[nle], capacity)) <- row
// row_src_slot[i] / k of rank row_src_rank[i]'s symmetric x [T, H]; padding rows are zeroed.
const char* launch_dispatch(const int* row_src_rank, const int* row_src_slot, const int* expert_offsets, int nle,
                            int capacity, const PeerPtrs& x_bufs, void* x_routed, int H, int k, int num_ctas,
                            cudaStream_t stream);

// The e4m3 dispatch: routed row i <- row row_src_slot[i] / k of rank row_src_rank[i]'s q [T, H]
// e4m3, and its H / 128 scales (that rank's s [T, scale_pitch] fp32) -> scale_t[kb * scale_ld + i],
// the layout launch_expert_gemm_fp8 reads (scale_ld >= capacity); padding rows get zeros.
const char* launch_dispatch_e4m3(const int* row_src_rank, const int* row_src_slot, const int* expert_offsets, int nle,
                                 int capacity, const PeerPtrs& q_bufs, void* q_routed, int H, const PeerPtrs& s_bufs,
                                 int scale_pitch, float* scale_t, int64_t scale_ld, int k, int num_ctas,
                                 cudaStream_t stream);

// Push-combine: routed row i's output y[i] -> slot row_src_slot[i] of rank row_src_rank[i]'s
// symmetric combine buffer [T * k, H]. Slots are unique: plain stores, no atomics.
const char* launch_combine(const void* y, const int* row_src_rank, const int* row_src_slot, const int* expert_offsets,
                           int nle, int capacity, const PeerPtrs& comb_bufs, int H, int num_ctas, cudaStream_t stream);

// out[t] = sum_{s < k} probs[t, s] * comb[t * k + s] (fp32, slot order, no contraction)
//          + shared_y[t] (if not null); cast once to bf16.
// wait_flags (optional, this rank's barrier buffer): every block first waits until all ep slots
// reach state[kStateBarrierEpoch] (the epoch the megakernel's last CTA published), i.e. the
// closing half of the barrier that follows the megakernel.
const char* launch_epilogue(const void* comb, const float* probs, const void* shared_y, void* out, int T, int k, int H,
                            const int* wait_flags, const int* state, int* errors, int ep, uint64_t timeout_ns,
                            cudaStream_t stream);

// ---- gemm/: the grouped GEMMs ---------------------------------------------------------------

// Grouped GEMM out[r, :] = A[r, :] @ B[seg(r)]^T (bf16 in, fp32 accumulate, bf16 out), wgmma + TMA,
// warp-specialised, persistent. Segments: seg_offsets [nseg + 1] on the device (without seg_counts
// 128-aligned: a token-major tile never straddles two segments; with seg_counts 16-aligned; rows
// >= min(seg_offsets[nseg], a_rows) are not computed) or, when seg_offsets is null, one
// segment of a_rows rows. seg_counts [nseg] (optional): real rows of each segment; the rest of a
// segment must be zero rows of A (their outputs are written as zeros without computing them).
// B is [nseg * b_rows_per_seg, K]. swiglu: B rows of a segment are [gate (N); up (N)] and
// out = silu(A gate^T) * (A up^T) (N = out columns); pre_out (optional, [a_rows, 2N]) then also
// receives the bf16 pre-activations [A gate^T | A up^T].
const char* launch_grouped_gemm(bool swiglu, const void* A, int64_t a_rows, int K, const void* B,
                                int b_rows_per_seg, const int* seg_offsets, const int* seg_counts, int nseg,
                                void* out, void* pre_out, int N, int num_ctas, cudaStream_t stream);

// The expert-major form launch_grouped_gemm takes when seg_offsets and seg_counts are given (the
// routed experts): the weights on wgmma's M side, each expert's real rows in tasks of <= 256 rows
// (gemm/expert_gemm.cuh); B is [nseg * (swiglu ? 2 N : N), K]. Arguments as launch_grouped_gemm's.
const char* launch_expert_gemm(bool swiglu, const void* A, int64_t a_rows, int K, const void* B, int nseg,
                               const int* seg_offsets, const int* seg_counts, void* out, void* pre_out, int N,
                               int num_ctas, cudaStream_t stream);

// The SwiGLU backward fused into the down projection's dgrad epilogue (gemm/expert_gemm.cuh:
// xgemm::SwiGLUBwd). With da = bf16(dy @ w[e]) of the unweighted grad_out rows dy:
//   h      [rows, 2 M] the forward's pre-activations [gate | up] (nullptr: no SwiGLU backward);
//   row_w  [rows] fp32 router weight of each row (nullptr: 1); out = dh = [d_gate | d_up] of w * da;
//   act    [rows, M] bf16 (optional): bf16(w * silu(gate) * up), the down wgrad's operand;
//   dot    [rows, dot_ld] fp32 (optional): per 64 columns, sum da * silu(gate) * up (the pieces of
//          the router-weight gradient, launch_bwd_dprobs sums them).
struct SwiGLUBackward {
  const void* h = nullptr;
  const float* row_w = nullptr;
  void* act = nullptr;
  float* dot = nullptr;
  int dot_ld = 0;
};

// Block-scaled e4m3 routed GEMM (expert_gemm_fp8.cuh), the expert-major launch of
// launch_grouped_gemm with e4m3 operands: x8 [rows, K] with x_scale [K / 128][x_scale_ld]
// (launch_quantize_rows_e4m3), w8 [nseg * (swiglu ? 2 N : N), K] with w_scale
// [nseg][weight tiles][K / 128] (tiles of 128 rows; swiglu: gate rows 64 b .. +63 with the same up
// rows). Outputs as launch_grouped_gemm's (bf16). K a multiple of 128. bwd.h (optional, plain
// weights only): the backward's down-projection dgrad, out = dh [rows, 2 N] (launch_expert_dgrad's
// epilogue).
// push_rank (optional, plain weights only): each real row also goes to slot push_slot[row] of rank
// push_rank[row]'s buffer push_bufs (the forward's combine, launch_combine's stores, in the epilogue).
// dh_q (optional, with bwd.h): dh's e4m3 copy as well, the bits of launch_quantize_rows_e4m3(dh,
// gate_up_pairs) for rows below seg_offsets[nseg]: dh_q [rows, 2 N] with dh_q_scale
// [2 N / 128][dh_q_ld], written by the epilogue.
// tickets: one int of device memory this launch alone uses (zeroed on the stream, then the CTAs
// claim their tasks from it). bwd (with h): the SwiGLU backward's other inputs and outputs
// (SwiGLUBackward, launch_expert_dgrad's).
const char* launch_expert_gemm_fp8(bool swiglu, const void* x8, int64_t rows, int K, const float* x_scale,
                                   int x_scale_ld, const void* w8, const float* w_scale, int nseg,
                                   const int* seg_offsets, const int* seg_counts, void* out, void* pre_out, int N,
                                   const SwiGLUBackward& bwd, const int* push_rank, const int* push_slot,
                                   const PeerPtrs* push_bufs, void* dh_q, float* dh_q_scale, int64_t dh_q_ld,
                                   int* tickets, int num_ctas, cudaStream_t stream);

// The routed dgrad, expert-major: out[r] = dy[r] @ w[e] ([rows, K] x [K, M]) for the rows r of
// segment e (real rows from seg_counts; a segment's other rows get zeros). With bwd.h: the SwiGLU
// backward fused (SwiGLUBackward), out = dh [rows, 2 M].
const char* launch_expert_dgrad(const void* dy, int64_t rows, int K, const void* w, int M, int nseg,
                                const int* seg_offsets, const int* seg_counts, void* out, const SwiGLUBackward& bwd,
                                int num_ctas, cudaStream_t stream);

// Routed weight gradients, expert-major: out[e] = a[rows of e]^T @ b[rows of e] ([M, N] per
// expert, fp32 accumulation over the rows in ascending order, one bf16 rounding). Expert e's rows
// of part q start at a_offsets[q][e] in a ([a_rows, M]) and b_offsets[q][e] in b ([b_rows, N])
// (offsets [nparts][nseg + 1], counts [nparts][nseg]); counts[q][e] real rows, rounded up to 16
// (rows between must be zero in a or b); the parts reduce in order into one accumulator; experts
// without rows get zeros. out_f32: out is fp32 and out[e] += the product in fp32 (no rounding to
// bf16; Megatron's main_grad under gradient-accumulation fusion); an expert without rows adds nothing.
const char* launch_expert_wgrad(const void* a, int64_t a_rows, int M, const int* a_offsets, const void* b,
                                int64_t b_rows, int N, const int* b_offsets, const int* counts, int nseg, int nparts,
                                void* out, bool out_f32, int num_ctas, cudaStream_t stream);

// The same in e4m3: out[e] = (a_t[:, rows of e] @ b_t[:, rows of e]^T) * a_scale[e][m] * b_scale[e][n]
// with a_t [M, ld], b_t [N, ld] from launch_quantize_columns_e4m3 (one row layout: expert e's
// rows start at offsets[e]); counts[e] real rows, rounded up to 32 (rows between must be zero in
// a_t or b_t, and finite in both); experts without rows get zeros. out_f32 as launch_expert_wgrad.
const char* launch_expert_wgrad_fp8(const void* a_t, int M, const float* a_scale, const void* b_t, int N,
                                    const float* b_scale, int64_t ld, const int* offsets, const int* counts, int nseg,
                                    void* out, bool out_f32, int num_ctas, cudaStream_t stream);

// ---- quant/: the e4m3 quantizers ------------------------------------------------------------

// x [rows, K] bf16 -> q [rows, K] e4m3 with one scale per (row, 128 columns) at
// scale[row * scale_row_stride + kb * scale_kb_stride] (the GEMM's [kb][ld]: strides 1, ld; the
// dispatch's rows [row][kb pitch]: strides pitch, 1). rows_end (optional device int): only rows
// below min(rows, *rows_end) are quantized. gate_up_pairs: x holds [gate | up] and q's 128-column
// block kb is gate columns 64 kb .. 64 kb + 63 with the same up columns (fc1's transposed K order).
const char* launch_quantize_rows_e4m3(const void* x, int64_t rows, int K, void* q, float* scale,
                                      int64_t scale_row_stride, int64_t scale_kb_stride, const int* rows_end,
                                      bool gate_up_pairs, cudaStream_t stream);

// The inverse: x [rows, K] bf16 = e4m3 q times its scale (scales as above), rounded once.
const char* launch_dequantize_rows_e4m3(const void* q, const float* scale, int64_t scale_row_stride,
                                        int64_t scale_kb_stride, void* x, int64_t rows, int K, const int* rows_end,
                                        cudaStream_t stream);

// w [nseg, rows, K] bf16 -> q [nseg, rows, K] e4m3 with one scale per (expert, 128-row tile, 128
// columns), scale [nseg][tiles][K / 128]; swiglu: w holds [gate; up] and tile t is gate rows
// 64 t .. 64 t + 63 with the same up rows (the tiles launch_expert_gemm_fp8 reads). q_t / scale_t
// (optional, whole tiles only): the transposed copy [nseg][K][tiles * 128] (a tile's rows in that
// order are its columns 128 t ..) with scale_t [nseg][K / 128][tiles], the dgrads' weights.
const char* launch_quantize_weight_e4m3(const void* w, int nseg, int rows, int K, bool swiglu, void* q, float* scale,
                                        void* q_t, float* scale_t, cudaStream_t stream);

// x [rows, C] (bf16, or e4m3 with scales at x_scale[sl(row, c / 128)]) -> its transpose q_t [C, ld]
// in e4m3, one scale per (expert, column): scale[e][c] = max(amax, 1e-4) / 448 over expert e's real
// rows (offsets[e] .. + counts[e]), q_t[c][r] = e4m3(x[r][c] * 448 / max(amax, 1e-4)). Columns
// offsets[e] .. + ceil128(counts[e]) of q_t, clipped to the segment, are written (rows past the
// count as zeros; offsets multiples of 16, inside ld).
const char* launch_quantize_columns_e4m3(const void* x, bool x_e4m3, const float* x_scale, int64_t scale_row_stride,
                                         int64_t scale_kb_stride, int64_t rows, int C, const int* offsets,
                                         const int* counts, int nseg, void* q_t, int64_t ld, float* scale,
                                         cudaStream_t stream);

// ---- passes/backward.cu: the staged backward's transfers ------------------------------------

// g_dst <- g (grad_out [T, H] bf16, 16-byte aligned), p_dst <- p (probs [T, k] fp32): this rank's
// symmetric buffers; then the last block runs a full barrier (one launch) that carries the
// backward's header (CallHeader, site 1) when header.words[0] != 0. expert_counts / expert_offsets
// (optional): the call's schedule, emptied once errors[kErrHeaderMismatch] is set (launch_barrier's).
const char* launch_bwd_publish(const void* g, void* g_dst, int64_t g_bytes, const void* p, void* p_dst,
                               int64_t p_bytes, const PeerPtrs& flags, int* state, int* errors, int rank, int ep,
                               uint64_t timeout_ns, const CallHeader& header, cudaStream_t stream,
                               int* expert_counts = nullptr, int* expert_offsets = nullptr, int nle = 0);

// Pull of the backward: routed row i (< min(expert_offsets[nle], capacity)) reads grad_out row
// row_src_slot[i] / k and router weight [row_src_slot[i]] of rank row_src_rank[i] (g_bufs, p_bufs)
// and writes the row as it is into g_rows[i] and the weight into row_w[i] (the down dgrad's
// epilogue applies it). Padding rows: zeros, weight 0.
// q (optional; H a multiple of 128): the rows also quantized for the fp8 dgrad, the bits of
// launch_quantize_rows_e4m3 on g_rows: q [rows, H] e4m3, scale [H / 128][scale_ld].
const char* launch_bwd_pull(const int* row_src_rank, const int* row_src_slot, const int* expert_offsets, int nle,
                            int capacity, const PeerPtrs& g_bufs, const PeerPtrs& p_bufs, void* g_rows,
                            float* row_w, int H, int k, int num_ctas, cudaStream_t stream, void* q = nullptr,
                            float* scale = nullptr, int64_t scale_ld = 0);

// The router-weight gradients: routed row i's <g, y_i> = the sum of its dgrad dot pieces
// dot[i, 0 .. dot_ld) in column order (SwiGLUBackward::dot), stored into
// dw_bufs[row_src_rank[i]][row_src_slot[i]] (the source rank's symmetric [T * k] fp32 buffer).
// Padding rows: nothing. Launched before the push that opens the closing barrier.
const char* launch_bwd_dprobs(const float* dot, int dot_ld, const int* row_src_rank, const int* row_src_slot,
                              const int* expert_offsets, int nle, int capacity, const PeerPtrs& dw_bufs,
                              cudaStream_t stream);

// Push of the backward: routed row i's rows[i] -> slot row_src_slot[i] of rank row_src_rank[i]'s
// symmetric [T * k, H] buffer (like launch_combine); then the last block opens a barrier (new epoch
// stored into every peer's flag); launch_bwd_epilogue with wait_flags closes it.
const char* launch_bwd_push(const void* rows, const int* row_src_rank, const int* row_src_slot,
                            const int* expert_offsets, int nle, int capacity, const PeerPtrs& slot_bufs, int H,
                            const PeerPtrs& flags, int* state, int rank, int ep, int num_ctas, cudaStream_t stream);

// dx[t] = sum_{s < k} slots[t * k + s] (fp32, slot order, no contraction) + shared_dx[t] (if not
// null), cast once to bf16; dprobs[t * k + s] = dw_slots[t * k + s]. wait_flags: as in
// launch_epilogue (closing half of the barrier that launch_bwd_push opened).
const char* launch_bwd_epilogue(const void* slots, const float* dw_slots, const void* shared_dx, void* dx,
                                float* dprobs, int T, int k, int H, const int* wait_flags, const int* state,
                                int* errors, int ep, uint64_t timeout_ns, cudaStream_t stream);

// ---- passes/megakernel.cu: the persistent forward megakernel --------------------------------

struct MegaArgs {
  // inputs
  const void* x;           // [T, H] (the shared expert's A operand)
  const void* fc1;         // [nle, 2I, H]
  const void* fc2;         // [nle, H, I]
  const void* shared_fc1;  // [2Is, H] or null (no shared expert)
  const void* shared_fc2;  // [H, Is]
  const int* row_src_rank;
  const int* row_src_slot;
  const int* expert_counts;
  const int* expert_offsets;
  // outputs (the forward context) and scratch
  void* x_routed;    // [capacity, H]
  void* act;         // [capacity, I]
  void* h;           // [capacity, 2I] gate/up pre-activations, or null (not kept)
  void* y_routed;    // [capacity, H]
  void* shared_act;  // [T, Is]
  void* shared_h;    // [T, 2Is] or null
  void* shared_y;    // [T, H]
  int* counters;     // megakernel_counter_ints(...) int32, zero before the first launch
  int* state;
  int* errors;
  PeerPtrs x_bufs;     // symmetric x [T, H] of every rank
  PeerPtrs comb_bufs;  // symmetric combine slots [T * k, H] of every rank
  PeerPtrs flags;      // symmetric barrier buffers
  int T, H, I, Is, k, nle, capacity, rank, ep;
  int num_comm;        // CTAs that pull-dispatch first (then compute)
  int num_compute;     // other CTAs (0: one per remaining SM)
  int minibatch_rows;  // multiple of 128
  uint64_t timeout_ns;  // watchdog of every wait inside the kernel
};

// int32 counters the megakernel needs (MegaArgs::counters).
int64_t megakernel_counter_ints(int capacity, int T, int nle);

// One launch: pull-dispatch, shared expert, routed gate/up (+SwiGLU) and down GEMMs, push-combine
// into the source ranks' slots, and the opening half of the closing barrier (launch_epilogue with
// wait_flags closes it). Same bits as the staged kernels for every num_comm / num_compute /
// minibatch_rows.
const char* launch_megakernel(const MegaArgs& a, cudaStream_t stream);

// Profiling: later megakernel launches stamp each task into `records`
// (int64 [num_records, 8]: claimed, dependencies met, first stage full, epilogue done
// (%globaltimer ns), SM, kind, m-unit, n-tile), the last 1024 records being the dispatching or
// pulling CTAs' (start, end, SM, kind -1). null: off.
void set_megakernel_timeline(long long* records, int64_t num_records);

}  // namespace mok
