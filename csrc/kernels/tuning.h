// The performance knobs of the mok kernels, in one place. Every value here was chosen by measuring
// the layer on H100/H200 (docs/DESIGN.md has the figures); none of them changes a result bit: the
// GEMMs reduce every output element in one fixed order whatever the ring depth, the task size or
// the grid, and the copy kernels move values unchanged. Sizes that are protocol (buffer layouts the
// Python side mirrors, ring-protocol bounds) stay next to the code that depends on them.
#pragma once

namespace mok {
namespace tuning {

// ---- shared-memory rings: K blocks of TMA loads in flight per CTA --------------------------------

// Token-major grouped GEMM (gemm::, the shared expert): 4 stages of 48 KB, the most that fit in the
// 227 KB of shared memory.
constexpr int kGemmStages = 4;
// Expert-major bf16 GEMM (xgemm::, the routed experts and the megakernel): 4 stages of 48 KB, the
// most that fit next to the epilogue's staging tiles.
constexpr int kExpertGemmStages = 4;
// The bf16 down dgrad with the SwiGLU backward handed off to epilogue warps (xgemm::HandoffSmem):
// 3 stages, the fourth stage's room holds the 72 KB da tile.
constexpr int kSwiGLUBwdStages = 3;
// e4m3 column tasks (xgemm8::, the routed gate/up GEMM): 4 stages of 48 KB of operands, the most
// that fit next to the staging tiles and the token scales.
constexpr int kE4m3ColumnStages = 4;
// e4m3 row tasks (xgemm8r::, the other e4m3 GEMMs): 4 stages of 48 KB, likewise.
constexpr int kE4m3RowStages = 4;
// Weight gradients (xwgrad::): 3 stages; the fourth stage's room holds the four TMA-store boxes of
// each consumer warpgroup, measured faster than 4 stages with two boxes per warpgroup.
constexpr int kWgradStages = 3;

// ---- task sizes ------------------------------------------------------------------------------------

// Token rows of an expert-major task (wgmma N <= 256): an expert of <= 256 rows reads each weight
// block once; 256-row e4m3 column tasks measured 3-14% faster than 128-row ones.
constexpr int kExpertTaskTokens = 256;
// Token rows of an e4m3 row task: two consumer warpgroups of wgmma M = 64.
constexpr int kE4m3RowTaskTokens = 128;

// ---- register split of the warp-specialised GEMMs (setmaxnreg) ------------------------------------

// bf16 GEMMs: the producer warpgroup keeps 56 registers a thread (40 spills the paired producer's
// pair bookkeeping and the megakernel's pusher warps), the consumers take 224 for 128 accumulators.
constexpr int kProducerRegs = 56;
constexpr int kConsumerRegs = 224;
// The bf16 down dgrad's epilogue warps (the producer warpgroup) run the SwiGLU backward with three
// pieces' loads in flight: 120 registers (112 spilled); its consumers only stage da, in 192.
constexpr int kEpilogueWarpRegs = 120;
constexpr int kHandoffConsumerRegs = 192;
// setmaxnreg only moves registers between the warpgroups of a 384-thread CTA, launched at 168 a thread
// (65536 / 384, a multiple of 8): the consumers' increase must come out of the producer's decrease,
// or their setmaxnreg waits forever.
constexpr int kRegsAtLaunch = 168;
static_assert(kProducerRegs + 2 * kConsumerRegs <= 3 * kRegsAtLaunch, "setmaxnreg split");
static_assert(kEpilogueWarpRegs + 2 * kHandoffConsumerRegs <= 3 * kRegsAtLaunch, "setmaxnreg split");
// Pieces (8 columns of a token row) an epilogue thread has its global loads in flight for, ahead of
// the one it computes: the down dgrads at the one-GPU proxy's T=2048 (routed and shared, one kernel
// name in the layer's trace) ran 1.16 ms with none, 1.08 with one and with three (three in the run
// that measured the layer against the consumers' epilogue, docs/DESIGN.md section 8).
constexpr int kSwiGLUBwdPiecesAhead = 3;
// Values of a SwiGLU-backward piece whose divisions by 1 + exp(-g) overlap (silu_and_sigmoid, no
// branch): 4 in the bf16 down dgrad's epilogue warps (the bf16 backward within the run's spread:
// those warps wait for work, not for these divisions); 2 in the e4m3 row tasks' consumers, where 4
// spilled beside their accumulators (their down dgrad at the one-GPU proxy 0.71 against 0.78 ms).
constexpr int kSwiGLUBwdGroup = 4;
constexpr int kSwiGLUBwdGroupE4m3 = 2;
// e4m3 GEMMs: two register sets (128 sums + 64 block sums) need 240 a consumer thread; the
// producer then has 24 (56 / 224 spilled).
constexpr int kE4m3ProducerRegs = 24;
constexpr int kE4m3ConsumerRegs = 240;
static_assert(kE4m3ProducerRegs + 2 * kE4m3ConsumerRegs <= 3 * kRegsAtLaunch, "setmaxnreg split");

// ---- the persistent forward megakernel --------------------------------------------------------------

// Rows a dispatching warp copies before it signals them ready (16 signals per 128-row m-tile).
constexpr int kDispatchUnitRows = 8;
// 16-byte loads in flight per lane of a dispatching warp.
constexpr int kDispatchCopyUnroll = 8;
// Queued row pushes per CTA (the consumers' finished down-projection pieces), and the rows a pusher
// warp has in flight.
constexpr int kPushSlots = 4;
constexpr int kPushBatch = 4;

// ---- copy and elementwise launches ------------------------------------------------------------------

// Default grid of the row-copy kernels (dispatch, combine, the backward's pull and push): CTAs of
// 256 threads (8 warps, one row each at a time) per SM.
constexpr int kCopyCtasPerSm = 4;
// (row, 128-column) items a lane group of quantize_rows_e4m3 loads before it uses any: 2 reached
// 3.4-3.6 TB/s alone.
constexpr int kQuantizeGroupItems = 2;

}  // namespace tuning
}  // namespace mok
