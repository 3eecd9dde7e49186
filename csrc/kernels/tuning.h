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
// e4m3 GEMMs: two register sets (128 sums + 64 block sums) need 240 a consumer thread; the
// producer then has 24 (56 / 224 spilled).
constexpr int kE4m3ProducerRegs = 24;
constexpr int kE4m3ConsumerRegs = 240;

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
