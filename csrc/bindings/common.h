// Shared pieces of the torch op bindings (csrc/bindings/*.cpp): argument checks and the
// conversions from torch arguments (tensors, peer address lists, timeouts) to the launchers'.
// The bindings are the only files that include torch headers; the kernels live in csrc/kernels/
// behind csrc/kernels/api.h.
//
// Symmetric peer buffers arrive as int[] lists of addresses (one per rank, rank order) taken from
// torch symmetric memory handles on the Python side; they are passed to the kernels by value.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/api.h"

namespace mok_bindings {

using at::Tensor;

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// A launcher's result: nullptr, or the message to raise.
inline void check(const char* msg) { TORCH_CHECK(msg == nullptr, msg); }

// Messages that carry numbers are formatted by snprintf and handed to TORCH_CHECK as one C string:
// the GPU machines' toolchain links libstdc++ statically into the extension, and formatting an
// integer through TORCH_CHECK's iostream there segfaults (string-only messages do not).
template <class... Args>
std::string format(const char* f, Args... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, f, args...);
  return std::string(buf);
}
#define MOK_CHECK(cond, ...) TORCH_CHECK(cond, ::mok_bindings::format(__VA_ARGS__).c_str())

inline void check_cuda(const Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), "megatron_mok: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dtype, "megatron_mok: ", name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(t.is_contiguous(), "megatron_mok: ", name, " must be contiguous");
}

inline mok::PeerPtrs peers(const std::vector<int64_t>& ptrs, const char* name) {
  MOK_CHECK(!ptrs.empty() && ptrs.size() <= static_cast<size_t>(mok::kMaxPeers),
            "megatron_mok: %s must list 1..%d peer addresses, got %zu", name, static_cast<int>(mok::kMaxPeers),
            ptrs.size());
  mok::PeerPtrs p{};
  for (size_t i = 0; i < ptrs.size(); ++i) {
    MOK_CHECK(ptrs[i] != 0 && ptrs[i] % 16 == 0, "megatron_mok: %s[%zu] is not a 16-byte aligned address", name, i);
    p.p[i] = reinterpret_cast<void*>(ptrs[i]);
  }
  return p;
}

// The call header of a barrier (mok::CallHeader): empty -> none; else kHeaderWords int32 values,
// the first (the magic) nonzero. The barrier buffers must then hold mok::barrier_flag_ints(ep) ints.
inline mok::CallHeader call_header(const std::vector<int64_t>& words) {
  mok::CallHeader h{};
  if (words.empty()) return h;
  MOK_CHECK(words.size() == static_cast<size_t>(mok::kHeaderWords), "megatron_mok: header must hold %d words, got %zu",
            static_cast<int>(mok::kHeaderWords), words.size());
  for (size_t i = 0; i < words.size(); ++i) {
    TORCH_CHECK(words[i] >= INT32_MIN && words[i] <= INT32_MAX, "megatron_mok: header word ", i, " (", words[i],
                ") does not fit int32");
    h.words[i] = static_cast<int>(words[i]);
  }
  TORCH_CHECK(h.words[0] != 0, "megatron_mok: header word 0 (the magic) must be nonzero");
  return h;
}

inline uint64_t timeout_ns_of(double timeout_s) {
  TORCH_CHECK(timeout_s > 0, "megatron_mok: timeouts must be positive");
  const double ns = timeout_s * 1e9;
  return ns > 1.8e19 ? UINT64_MAX : static_cast<uint64_t>(ns);
}

// The call's schedule (optional): (counts, offsets, nle) for a barrier that empties it once this rank
// is stopped (a peer's verdict or a header mismatch): the barriers' and bwd_publish's.
struct ScheduleArgs {
  int* counts = nullptr;
  int* offsets = nullptr;
  int nle = 0;
};

inline ScheduleArgs schedule_args(const std::optional<Tensor>& counts, const std::optional<Tensor>& offsets) {
  TORCH_CHECK(counts.has_value() == offsets.has_value(), "megatron_mok: expert_counts and expert_offsets go together");
  if (!counts.has_value()) return {};
  check_cuda(*counts, "expert_counts", at::kInt);
  check_cuda(*offsets, "expert_offsets", at::kInt);
  TORCH_CHECK(offsets->numel() == counts->numel() + 1, "megatron_mok: expert_offsets must have nle + 1 entries");
  return {counts->data_ptr<int>(), offsets->data_ptr<int>(), static_cast<int>(counts->numel())};
}

// Weight tiles of the e4m3 GEMM per expert: 128 rows, or (swiglu) 64 gate rows with the same up rows.
inline int64_t e4m3_weight_tiles(int64_t n, bool swiglu) { return swiglu ? (n + 63) / 64 : (n + 127) / 128; }

// The scales of rows x 128-column blocks: [K / 128, ld >= rows] (the GEMM's; scale_rows false) or
// [rows' >= rows, pitch >= K / 128] (one row per token, the dispatch's; scale_rows true).
inline std::pair<int64_t, int64_t> scale_strides(const Tensor& scale, int64_t rows, int64_t nkb, bool scale_rows,
                                          const char* op) {
  check_cuda(scale, "scale", at::kFloat);
  if (scale_rows) {
    MOK_CHECK(scale.dim() == 2 && scale.size(0) >= rows && scale.size(1) >= nkb,
              "megatron_mok: %s scale must be [>= rows, >= K / 128] (scale_rows)", op);
    return {scale.size(1), 1};
  }
  MOK_CHECK(scale.dim() == 2 && scale.size(0) == nkb && scale.size(1) >= rows && scale.size(1) % 4 == 0,
            "megatron_mok: %s scale must be [K / 128, ld >= rows], ld a multiple of 4", op);
  return {1, scale.size(1)};
}

}  // namespace mok_bindings
