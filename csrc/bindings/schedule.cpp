// torch op of the routing all-gather and the routed-row schedule (csrc/kernels/comm/schedule.cu).
#include "bindings/common.h"

namespace {

using namespace mok_bindings;

// Routing all-gather (peer stores into every rank's routing buffer), barrier, and the schedule: one
// launch. routing_buf: this rank's [2, ep, T, k] buffer (peer_bufs[rank] maps the same memory).
// header: the call's header (mok::CallHeader; empty: none), carried by the barrier.
void build_schedule(const Tensor& top_experts, Tensor& routing_buf, Tensor& state, Tensor& errors, Tensor& top_all,
                    Tensor& row_src_rank, Tensor& row_src_slot, Tensor& expert_counts, Tensor& expert_offsets,
                    Tensor& scratch, std::vector<int64_t> peer_bufs, std::vector<int64_t> peer_flags, int64_t rank,
                    int64_t num_experts, double timeout_s, std::vector<int64_t> header) {
  TORCH_CHECK(top_experts.is_cuda() && top_experts.is_contiguous(), "megatron_mok: top_experts must be contiguous CUDA");
  TORCH_CHECK(top_experts.scalar_type() == at::kInt || top_experts.scalar_type() == at::kLong,
              "megatron_mok: top_experts must be int32 or int64");
  for (auto* t : {&routing_buf, &state, &errors, &top_all, &row_src_rank, &row_src_slot, &expert_counts,
                  &expert_offsets, &scratch})
    check_cuda(*t, "schedule tensor", at::kInt);
  TORCH_CHECK(top_all.dim() == 3, "megatron_mok: top_all must be [ep, T, k]");
  const int ep = top_all.size(0), T = top_all.size(1), k = top_all.size(2);
  const int nle = expert_counts.numel();
  TORCH_CHECK(top_experts.numel() == static_cast<int64_t>(T) * k, "megatron_mok: top_experts must be [T, k]");
  TORCH_CHECK(routing_buf.numel() == 2 * top_all.numel(), "megatron_mok: routing buffer must be [2, ep, T, k]");
  MOK_CHECK(peer_bufs.size() == static_cast<size_t>(ep) && peer_flags.size() == peer_bufs.size(),
            "megatron_mok: peer_bufs and peer_flags must list the %d ranks of top_all", static_cast<int>(ep));
  TORCH_CHECK(expert_offsets.numel() == nle + 1, "megatron_mok: expert_offsets must have nle + 1 entries");
  TORCH_CHECK(row_src_slot.numel() == row_src_rank.numel(), "megatron_mok: row arrays differ in size");
  TORCH_CHECK(scratch.numel() >= mok::schedule_scratch_ints(ep, T, nle, num_experts), "megatron_mok: scratch too small");
  c10::cuda::CUDAGuard guard(top_all.device());
  check(mok::launch_schedule(top_experts.data_ptr(), top_experts.scalar_type() == at::kLong,
                             routing_buf.data_ptr<int>(), peers(peer_bufs, "peer_bufs"),
                             peers(peer_flags, "peer_flags"), state.data_ptr<int>(), errors.data_ptr<int>(),
                             top_all.data_ptr<int>(), row_src_rank.data_ptr<int>(), row_src_slot.data_ptr<int>(),
                             expert_counts.data_ptr<int>(), expert_offsets.data_ptr<int>(), scratch.data_ptr<int>(),
                             static_cast<int>(rank), ep, T, k, nle, static_cast<int>(num_experts),
                             static_cast<int>(row_src_rank.numel()), timeout_ns_of(timeout_s), call_header(header),
                             current_stream()));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatron_mok, m) {
  m.def(
      "build_schedule(Tensor top_experts, Tensor(a!) routing_buf, Tensor(b!) state, Tensor(c!) errors, "
      "Tensor(d!) top_all, Tensor(e!) row_src_rank, Tensor(f!) row_src_slot, Tensor(g!) expert_counts, "
      "Tensor(h!) expert_offsets, Tensor(i!) scratch, int[] peer_bufs, int[] peer_flags, int rank, int num_experts, "
      "float timeout_s, int[] header=[]) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("build_schedule", &build_schedule);
}
