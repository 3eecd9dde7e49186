// torch ops of the cross-rank barrier (csrc/kernels/comm/barrier.cu).
#include "bindings/common.h"

namespace {

using namespace mok_bindings;

void barrier(Tensor& state, Tensor& errors, std::vector<int64_t> peer_flags, int64_t rank, double timeout_s,
             int64_t bump_gather, const std::optional<Tensor>& expert_counts,
             const std::optional<Tensor>& expert_offsets) {
  check_cuda(state, "state", at::kInt);
  check_cuda(errors, "errors", at::kInt);
  const ScheduleArgs s = schedule_args(expert_counts, expert_offsets);
  c10::cuda::CUDAGuard guard(state.device());
  check(mok::launch_barrier(peers(peer_flags, "peer_flags"), state.data_ptr<int>(), errors.data_ptr<int>(),
                            static_cast<int>(rank), static_cast<int>(peer_flags.size()), timeout_ns_of(timeout_s),
                            static_cast<int>(bump_gather), current_stream(), s.counts, s.offsets, s.nle));
}

void barrier_open(Tensor& state, std::vector<int64_t> peer_flags, int64_t rank) {
  check_cuda(state, "state", at::kInt);
  c10::cuda::CUDAGuard guard(state.device());
  check(mok::launch_barrier_open(peers(peer_flags, "peer_flags"), state.data_ptr<int>(), static_cast<int>(rank),
                                 static_cast<int>(peer_flags.size()), current_stream()));
}

// This rank's host checks failed: its verdict word into the barrier its peers wait in (no wait).
void barrier_reject(Tensor& state, const Tensor& errors, std::vector<int64_t> peer_flags, int64_t rank, int64_t verdict,
                    int64_t bump_gather) {
  check_cuda(state, "state", at::kInt);
  check_cuda(errors, "errors", at::kInt);
  TORCH_CHECK(verdict >= 0 && verdict <= INT32_MAX, "megatron_mok: barrier_reject verdict must fit int32");
  c10::cuda::CUDAGuard guard(state.device());
  check(mok::launch_barrier_reject(peers(peer_flags, "peer_flags"), state.data_ptr<int>(), errors.data_ptr<int>(),
                                   static_cast<int>(rank), static_cast<int>(peer_flags.size()),
                                   static_cast<int>(bump_gather), static_cast<int>(verdict), current_stream()));
}

// dst (this rank's symmetric buffer) <- src, then a barrier (one launch).
void publish_barrier(const Tensor& src, Tensor& dst, Tensor& state, Tensor& errors, std::vector<int64_t> peer_flags,
                     int64_t rank, double timeout_s, const std::optional<Tensor>& expert_counts,
                     const std::optional<Tensor>& expert_offsets) {
  TORCH_CHECK(src.is_cuda() && src.is_contiguous() && dst.is_cuda() && dst.is_contiguous(),
              "megatron_mok: publish_barrier src/dst must be contiguous CUDA tensors");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type() && src.numel() == dst.numel(),
              "megatron_mok: publish_barrier src and dst differ in dtype or size");
  check_cuda(state, "state", at::kInt);
  check_cuda(errors, "errors", at::kInt);
  const ScheduleArgs s = schedule_args(expert_counts, expert_offsets);
  c10::cuda::CUDAGuard guard(src.device());
  check(mok::launch_publish_barrier(src.data_ptr(), dst.data_ptr(), static_cast<int64_t>(src.nbytes()),
                                    peers(peer_flags, "peer_flags"), state.data_ptr<int>(), errors.data_ptr<int>(),
                                    static_cast<int>(rank), static_cast<int>(peer_flags.size()),
                                    timeout_ns_of(timeout_s), current_stream(), s.counts, s.offsets, s.nle));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatron_mok, m) {
  m.def(
      "publish_barrier(Tensor src, Tensor(a!) dst, Tensor(b!) state, Tensor(c!) errors, int[] peer_flags, int rank, "
      "float timeout_s, Tensor(d!)? expert_counts=None, Tensor(e!)? expert_offsets=None) -> ()");
  m.def(
      "barrier(Tensor(a!) state, Tensor(b!) errors, int[] peer_flags, int rank, float timeout_s, int bump_gather, "
      "Tensor(c!)? expert_counts=None, Tensor(d!)? expert_offsets=None) -> ()");
  m.def("barrier_open(Tensor(a!) state, int[] peer_flags, int rank) -> ()");
  m.def("barrier_reject(Tensor(a!) state, Tensor errors, int[] peer_flags, int rank, int verdict, "
        "int bump_gather) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("publish_barrier", &publish_barrier);
  m.impl("barrier", &barrier);
  m.impl("barrier_open", &barrier_open);
  m.impl("barrier_reject", &barrier_reject);
}
