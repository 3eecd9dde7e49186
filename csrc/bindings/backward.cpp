// torch ops of the staged backward's transfers (csrc/kernels/passes/backward.cu): publish, pull,
// the router-weight gradients, push and the closing epilogue.
#include "bindings/common.h"

namespace {

using namespace mok_bindings;

void bwd_publish(const Tensor& grad_out, Tensor& g_dst, const Tensor& probs, Tensor& p_dst, Tensor& state,
                 Tensor& errors, std::vector<int64_t> peer_flags, int64_t rank, double timeout_s,
                 std::vector<int64_t> header, const std::optional<Tensor>& expert_counts,
                 const std::optional<Tensor>& expert_offsets) {
  check_cuda(grad_out, "grad_out", at::kBFloat16);
  check_cuda(g_dst, "grad_out buffer", at::kBFloat16);
  check_cuda(probs, "probs", at::kFloat);
  check_cuda(p_dst, "probs buffer", at::kFloat);
  check_cuda(state, "state", at::kInt);
  check_cuda(errors, "errors", at::kInt);
  TORCH_CHECK(grad_out.numel() == g_dst.numel() && probs.numel() == p_dst.numel(),
              "megatron_mok: bwd_publish buffers differ in size");
  const ScheduleArgs s = schedule_args(expert_counts, expert_offsets);
  c10::cuda::CUDAGuard guard(grad_out.device());
  check(mok::launch_bwd_publish(grad_out.data_ptr(), g_dst.data_ptr(), static_cast<int64_t>(grad_out.nbytes()),
                                probs.data_ptr(), p_dst.data_ptr(), static_cast<int64_t>(probs.nbytes()),
                                peers(peer_flags, "peer_flags"), state.data_ptr<int>(), errors.data_ptr<int>(),
                                static_cast<int>(rank), static_cast<int>(peer_flags.size()), timeout_ns_of(timeout_s),
                                call_header(header), current_stream(), s.counts, s.offsets, s.nle));
}

void bwd_pull(const Tensor& row_src_rank, const Tensor& row_src_slot, const Tensor& expert_offsets, Tensor& g_rows,
              Tensor& row_w, std::vector<int64_t> peer_g, std::vector<int64_t> peer_p, int64_t topk, int64_t num_ctas,
              const std::optional<Tensor>& q, const std::optional<Tensor>& q_scale) {
  for (auto* t : {&row_src_rank, &row_src_slot, &expert_offsets}) check_cuda(*t, "schedule tensor", at::kInt);
  check_cuda(g_rows, "g_rows", at::kBFloat16);
  check_cuda(row_w, "row_w", at::kFloat);
  TORCH_CHECK(g_rows.dim() == 2 && g_rows.size(0) == row_src_rank.numel() && row_w.numel() == g_rows.size(0),
              "megatron_mok: bwd_pull g_rows must be [capacity, H] and row_w [capacity]");
  TORCH_CHECK(peer_g.size() == peer_p.size(), "megatron_mok: peer lists differ in length");
  TORCH_CHECK(q.has_value() == q_scale.has_value(), "megatron_mok: bwd_pull q and q_scale go together");
  void* qp = nullptr;
  float* sp = nullptr;
  int64_t ld = 0;
  if (q.has_value()) {  // the rows quantized on the way (the fp8 dgrad)
    check_cuda(*q, "q", at::kFloat8_e4m3fn);
    TORCH_CHECK(q->sizes() == g_rows.sizes() && g_rows.size(1) % 128 == 0,
                "megatron_mok: bwd_pull q must be [capacity, H] (H a multiple of 128)");
    scale_strides(*q_scale, g_rows.size(0), g_rows.size(1) / 128, false, "bwd_pull");  // [H / 128, ld >= rows]
    sp = q_scale->data_ptr<float>();
    qp = q->data_ptr();
    ld = q_scale->size(1);
  }
  c10::cuda::CUDAGuard guard(g_rows.device());
  check(mok::launch_bwd_pull(row_src_rank.data_ptr<int>(), row_src_slot.data_ptr<int>(), expert_offsets.data_ptr<int>(),
                             static_cast<int>(expert_offsets.numel() - 1), static_cast<int>(row_src_rank.numel()),
                             peers(peer_g, "peer_g"), peers(peer_p, "peer_p"), g_rows.data_ptr(),
                             row_w.data_ptr<float>(), static_cast<int>(g_rows.size(1)), static_cast<int>(topk),
                             static_cast<int>(num_ctas), current_stream(), qp, sp, ld));
}

void bwd_dprobs(const Tensor& dot, const Tensor& row_src_rank, const Tensor& row_src_slot, const Tensor& expert_offsets,
                std::vector<int64_t> peer_dw) {
  check_cuda(dot, "dot", at::kFloat);
  for (auto* t : {&row_src_rank, &row_src_slot, &expert_offsets}) check_cuda(*t, "schedule tensor", at::kInt);
  TORCH_CHECK(dot.dim() == 2 && dot.size(0) == row_src_rank.numel() && dot.stride(1) == 1 && dot.stride(0) == dot.size(1),
              "megatron_mok: bwd_dprobs dot must be a contiguous [capacity, pieces]");
  c10::cuda::CUDAGuard guard(dot.device());
  check(mok::launch_bwd_dprobs(dot.data_ptr<float>(), static_cast<int>(dot.size(1)), row_src_rank.data_ptr<int>(),
                               row_src_slot.data_ptr<int>(), expert_offsets.data_ptr<int>(),
                               static_cast<int>(expert_offsets.numel() - 1), static_cast<int>(row_src_rank.numel()),
                               peers(peer_dw, "peer_dw"), current_stream()));
}

void bwd_push(const Tensor& rows, const Tensor& row_src_rank, const Tensor& row_src_slot, const Tensor& expert_offsets,
              Tensor& state, std::vector<int64_t> peer_slots, std::vector<int64_t> peer_flags, int64_t rank,
              int64_t num_ctas) {
  check_cuda(rows, "rows", at::kBFloat16);
  for (auto* t : {&row_src_rank, &row_src_slot, &expert_offsets}) check_cuda(*t, "schedule tensor", at::kInt);
  check_cuda(state, "state", at::kInt);
  TORCH_CHECK(rows.dim() == 2 && rows.size(0) == row_src_rank.numel(), "megatron_mok: rows must be [capacity, H]");
  TORCH_CHECK(peer_slots.size() == peer_flags.size(), "megatron_mok: peer lists differ in length");
  c10::cuda::CUDAGuard guard(rows.device());
  check(mok::launch_bwd_push(rows.data_ptr(), row_src_rank.data_ptr<int>(), row_src_slot.data_ptr<int>(),
                             expert_offsets.data_ptr<int>(), static_cast<int>(expert_offsets.numel() - 1),
                             static_cast<int>(row_src_rank.numel()), peers(peer_slots, "peer_slots"),
                             static_cast<int>(rows.size(1)), peers(peer_flags, "peer_flags"), state.data_ptr<int>(),
                             static_cast<int>(rank), static_cast<int>(peer_flags.size()), static_cast<int>(num_ctas),
                             current_stream()));
}

void bwd_epilogue_wait(const Tensor& slots, const Tensor& dw_slots, const std::optional<Tensor>& shared_dx, Tensor& dx,
                       Tensor& dprobs, const Tensor& state, Tensor& errors, std::vector<int64_t> peer_flags,
                       int64_t rank, double timeout_s) {
  check_cuda(slots, "slots", at::kBFloat16);
  check_cuda(dw_slots, "dw_slots", at::kFloat);
  check_cuda(dx, "dx", at::kBFloat16);
  check_cuda(dprobs, "dprobs", at::kFloat);
  check_cuda(state, "state", at::kInt);
  check_cuda(errors, "errors", at::kInt);
  TORCH_CHECK(dx.dim() == 2 && dprobs.dim() == 2 && dprobs.size(0) == dx.size(0), "megatron_mok: dx [T, H], dprobs [T, k]");
  const int64_t T = dx.size(0), H = dx.size(1), k = dprobs.size(1);
  TORCH_CHECK(slots.numel() >= T * k * H && dw_slots.numel() >= T * k, "megatron_mok: slot buffers too small");
  const void* sdx = nullptr;
  if (shared_dx.has_value()) {
    check_cuda(*shared_dx, "shared_dx", at::kBFloat16);
    TORCH_CHECK(shared_dx->sizes() == dx.sizes(), "megatron_mok: shared_dx must be [T, H]");
    sdx = shared_dx->data_ptr();
  }
  const mok::PeerPtrs flags = peers(peer_flags, "peer_flags");
  TORCH_CHECK(rank >= 0 && rank < static_cast<int64_t>(peer_flags.size()), "megatron_mok: bad rank");
  c10::cuda::CUDAGuard guard(dx.device());
  check(mok::launch_bwd_epilogue(slots.data_ptr(), dw_slots.data_ptr<float>(), sdx, dx.data_ptr(),
                                 dprobs.data_ptr<float>(), static_cast<int>(T), static_cast<int>(k),
                                 static_cast<int>(H), static_cast<const int*>(flags.p[rank]), state.data_ptr<int>(),
                                 errors.data_ptr<int>(), static_cast<int>(peer_flags.size()), timeout_ns_of(timeout_s),
                                 current_stream()));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatron_mok, m) {
  m.def(
      "bwd_publish(Tensor grad_out, Tensor(a!) g_dst, Tensor probs, Tensor(b!) p_dst, Tensor(c!) state, "
      "Tensor(d!) errors, int[] peer_flags, int rank, float timeout_s, int[] header=[], "
      "Tensor(e!)? expert_counts=None, Tensor(f!)? expert_offsets=None) -> ()");
  m.def(
      "bwd_pull(Tensor row_src_rank, Tensor row_src_slot, Tensor expert_offsets, Tensor(a!) g_rows, "
      "Tensor(b!) row_w, int[] peer_g, int[] peer_p, int topk, int num_ctas, Tensor(c!)? q=None, "
      "Tensor(d!)? q_scale=None) -> ()");
  m.def("bwd_dprobs(Tensor dot, Tensor row_src_rank, Tensor row_src_slot, Tensor expert_offsets, int[] peer_dw) -> ()");
  m.def(
      "bwd_push(Tensor rows, Tensor row_src_rank, Tensor row_src_slot, Tensor expert_offsets, Tensor(a!) state, "
      "int[] peer_slots, int[] peer_flags, int rank, int num_ctas) -> ()");
  m.def(
      "bwd_epilogue_wait(Tensor slots, Tensor dw_slots, Tensor? shared_dx, Tensor(a!) dx, Tensor(b!) dprobs, "
      "Tensor state, Tensor(c!) errors, int[] peer_flags, int rank, float timeout_s) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("bwd_publish", &bwd_publish);
  m.impl("bwd_pull", &bwd_pull);
  m.impl("bwd_dprobs", &bwd_dprobs);
  m.impl("bwd_push", &bwd_push);
  m.impl("bwd_epilogue_wait", &bwd_epilogue_wait);
}
