// torch ops of the forward's transfers and passes: the pull-dispatch (bf16 and e4m3), the
// push-combine, the fixed-order epilogue (csrc/kernels/comm/) and the persistent megakernel
// (csrc/kernels/passes/megakernel.cu).
#include "bindings/common.h"

namespace {

using namespace mok_bindings;

void dispatch(const Tensor& row_src_rank, const Tensor& row_src_slot, const Tensor& expert_offsets, Tensor& x_routed,
              std::vector<int64_t> peer_x, int64_t topk, int64_t num_ctas) {
  for (auto* t : {&row_src_rank, &row_src_slot, &expert_offsets}) check_cuda(*t, "schedule tensor", at::kInt);
  check_cuda(x_routed, "x_routed", at::kBFloat16);
  TORCH_CHECK(x_routed.dim() == 2 && x_routed.size(0) == row_src_rank.numel(), "megatron_mok: x_routed must be [capacity, H]");
  c10::cuda::CUDAGuard guard(x_routed.device());
  check(mok::launch_dispatch(row_src_rank.data_ptr<int>(), row_src_slot.data_ptr<int>(), expert_offsets.data_ptr<int>(),
                             static_cast<int>(expert_offsets.numel() - 1), static_cast<int>(row_src_rank.numel()),
                             peers(peer_x, "peer_x"), x_routed.data_ptr(), static_cast<int>(x_routed.size(1)),
                             static_cast<int>(topk), static_cast<int>(num_ctas), current_stream()));
}

void dispatch_e4m3(const Tensor& row_src_rank, const Tensor& row_src_slot, const Tensor& expert_offsets,
                   Tensor& q_routed, Tensor& scale_t, std::vector<int64_t> peer_q, std::vector<int64_t> peer_s,
                   int64_t scale_pitch, int64_t topk, int64_t num_ctas) {
  for (auto* t : {&row_src_rank, &row_src_slot, &expert_offsets}) check_cuda(*t, "schedule tensor", at::kInt);
  check_cuda(q_routed, "q_routed", at::kFloat8_e4m3fn);
  check_cuda(scale_t, "scale_t", at::kFloat);
  const int64_t cap = row_src_rank.numel();
  TORCH_CHECK(q_routed.dim() == 2 && q_routed.size(0) == cap, "megatron_mok: q_routed must be [capacity, H]");
  const int64_t H = q_routed.size(1);
  MOK_CHECK(scale_t.dim() == 2 && scale_t.size(0) == H / 128 && scale_t.size(1) >= cap,
            "megatron_mok: scale_t must be [H / 128 = %lld, >= capacity = %lld]", static_cast<long long>(H / 128),
            static_cast<long long>(cap));
  TORCH_CHECK(peer_q.size() == peer_s.size(), "megatron_mok: peer_q and peer_s must list the same ranks");
  c10::cuda::CUDAGuard guard(q_routed.device());
  check(mok::launch_dispatch_e4m3(row_src_rank.data_ptr<int>(), row_src_slot.data_ptr<int>(),
                                  expert_offsets.data_ptr<int>(), static_cast<int>(expert_offsets.numel() - 1),
                                  static_cast<int>(cap), peers(peer_q, "peer_q"), q_routed.data_ptr(),
                                  static_cast<int>(H), peers(peer_s, "peer_s"), static_cast<int>(scale_pitch),
                                  scale_t.data_ptr<float>(), scale_t.size(1), static_cast<int>(topk),
                                  static_cast<int>(num_ctas), current_stream()));
}

void combine(const Tensor& y, const Tensor& row_src_rank, const Tensor& row_src_slot, const Tensor& expert_offsets,
             Tensor& state, std::vector<int64_t> peer_comb, int64_t num_ctas) {
  check_cuda(y, "y", at::kBFloat16);
  for (auto* t : {&row_src_rank, &row_src_slot, &expert_offsets}) check_cuda(*t, "schedule tensor", at::kInt);
  check_cuda(state, "state", at::kInt);
  TORCH_CHECK(y.dim() == 2 && y.size(0) == row_src_rank.numel(), "megatron_mok: y must be [capacity, H]");
  c10::cuda::CUDAGuard guard(y.device());
  check(mok::launch_combine(y.data_ptr(), row_src_rank.data_ptr<int>(), row_src_slot.data_ptr<int>(),
                            expert_offsets.data_ptr<int>(), static_cast<int>(expert_offsets.numel() - 1),
                            static_cast<int>(row_src_rank.numel()), peers(peer_comb, "peer_comb"),
                            static_cast<int>(y.size(1)), static_cast<int>(num_ctas), current_stream()));
}

// Checked shapes of the epilogue's tensors (both epilogue ops).
struct EpilogueArgs {
  int T, H, k;
  const void* shared_y;
};

EpilogueArgs epilogue_args(const Tensor& comb, const Tensor& probs, const std::optional<Tensor>& shared_y,
                           const Tensor& out) {
  check_cuda(comb, "comb", at::kBFloat16);
  check_cuda(probs, "probs", at::kFloat);
  check_cuda(out, "out", at::kBFloat16);
  TORCH_CHECK(out.dim() == 2 && probs.dim() == 2 && probs.size(0) == out.size(0), "megatron_mok: out [T, H], probs [T, k]");
  const int64_t T = out.size(0), H = out.size(1), k = probs.size(1);
  TORCH_CHECK(comb.numel() >= T * k * H, "megatron_mok: combine buffer smaller than [T * k, H]");
  const void* sy = nullptr;
  if (shared_y.has_value()) {
    check_cuda(*shared_y, "shared_y", at::kBFloat16);
    TORCH_CHECK(shared_y->sizes() == out.sizes(), "megatron_mok: shared_y must be [T, H]");
    sy = shared_y->data_ptr();
  }
  return {static_cast<int>(T), static_cast<int>(H), static_cast<int>(k), sy};
}

// errors (optional): NaN/inf router weights are flagged there (functional.flag_nonfinite_probs' value).
void moe_epilogue(const Tensor& comb, const Tensor& probs, const std::optional<Tensor>& shared_y, Tensor& out,
                  const std::optional<Tensor>& errors) {
  const EpilogueArgs e = epilogue_args(comb, probs, shared_y, out);
  if (errors.has_value()) check_cuda(*errors, "errors", at::kInt);
  c10::cuda::CUDAGuard guard(out.device());
  check(mok::launch_epilogue(comb.data_ptr(), probs.data_ptr<float>(), e.shared_y, out.data_ptr(), e.T, e.k, e.H,
                             nullptr, nullptr, errors.has_value() ? errors->data_ptr<int>() : nullptr, 1, 0,
                             current_stream()));
}

// The epilogue behind the closing half of the barrier the megakernel opened (peer_flags[rank] is
// this rank's barrier buffer).
void moe_epilogue_wait(const Tensor& comb, const Tensor& probs, const std::optional<Tensor>& shared_y, Tensor& out,
                       const Tensor& state, Tensor& errors, std::vector<int64_t> peer_flags, int64_t rank,
                       double timeout_s) {
  const EpilogueArgs e = epilogue_args(comb, probs, shared_y, out);
  check_cuda(state, "state", at::kInt);
  check_cuda(errors, "errors", at::kInt);
  const mok::PeerPtrs flags = peers(peer_flags, "peer_flags");
  TORCH_CHECK(rank >= 0 && rank < static_cast<int64_t>(peer_flags.size()), "megatron_mok: bad rank");
  c10::cuda::CUDAGuard guard(out.device());
  check(mok::launch_epilogue(comb.data_ptr(), probs.data_ptr<float>(), e.shared_y, out.data_ptr(), e.T, e.k, e.H,
                             static_cast<const int*>(flags.p[rank]), state.data_ptr<int>(), errors.data_ptr<int>(),
                             static_cast<int>(peer_flags.size()), timeout_ns_of(timeout_s), current_stream()));
}

void megakernel(const Tensor& x, const Tensor& fc1, const Tensor& fc2, const std::optional<Tensor>& shared_fc1,
                const std::optional<Tensor>& shared_fc2, const Tensor& row_src_rank, const Tensor& row_src_slot,
                const Tensor& expert_counts, const Tensor& expert_offsets, Tensor& x_routed, Tensor& act,
                const std::optional<Tensor>& h, Tensor& y_routed, Tensor& shared_act,
                const std::optional<Tensor>& shared_h, Tensor& shared_y, Tensor& counters, Tensor& state,
                Tensor& errors, std::vector<int64_t> peer_x, std::vector<int64_t> peer_comb,
                std::vector<int64_t> peer_flags, int64_t rank, int64_t topk, int64_t num_comm, int64_t num_compute,
                int64_t minibatch_rows, double timeout_s) {
  for (auto* t : {&x, &fc1, &fc2}) check_cuda(*t, "megakernel input", at::kBFloat16);
  for (auto* t : {&act, &y_routed}) check_cuda(*t, "megakernel output", at::kBFloat16);
  for (auto* t : {&row_src_rank, &row_src_slot, &expert_counts, &expert_offsets}) check_cuda(*t, "schedule tensor", at::kInt);
  for (auto* t : {&counters, &state, &errors}) check_cuda(*t, "megakernel state", at::kInt);
  TORCH_CHECK(x.dim() == 2 && fc1.dim() == 3 && fc2.dim() == 3, "megatron_mok: x [T, H], fc1 [nle, 2I, H], fc2 [nle, H, I]");
  const int64_t T = x.size(0), H = x.size(1), nle = fc1.size(0), I = fc1.size(1) / 2, cap = row_src_rank.numel();
  TORCH_CHECK(fc1.size(1) == 2 * I && fc1.size(2) == H && fc2.size(0) == nle && fc2.size(1) == H && fc2.size(2) == I,
              "megatron_mok: megakernel weight shapes");
  TORCH_CHECK(row_src_slot.numel() == cap && expert_counts.numel() == nle && expert_offsets.numel() == nle + 1,
              "megatron_mok: megakernel schedule shapes");
  check_cuda(x_routed, "x_routed", at::kBFloat16);
  TORCH_CHECK(x_routed.dim() == 2 && x_routed.size(0) == cap && x_routed.size(1) == H, "megatron_mok: x_routed [cap, H]");
  TORCH_CHECK(act.dim() == 2 && act.size(0) == cap && act.size(1) == I, "megatron_mok: act [cap, I]");
  TORCH_CHECK(y_routed.dim() == 2 && y_routed.size(0) == cap && y_routed.size(1) == H, "megatron_mok: y_routed [cap, H]");
  if (h.has_value()) {
    check_cuda(*h, "h", at::kBFloat16);
    TORCH_CHECK(h->dim() == 2 && h->size(0) == cap && h->size(1) == 2 * I, "megatron_mok: h [cap, 2I]");
  }
  TORCH_CHECK(counters.numel() >= mok::megakernel_counter_ints(static_cast<int>(cap), static_cast<int>(T), static_cast<int>(nle)),
              "megatron_mok: megakernel counters too small");
  TORCH_CHECK(shared_fc1.has_value() == shared_fc2.has_value(), "megatron_mok: shared_fc1 / shared_fc2 go together");
  int64_t Is = 0;
  if (shared_fc1.has_value()) {
    check_cuda(*shared_fc1, "shared_fc1", at::kBFloat16);
    check_cuda(*shared_fc2, "shared_fc2", at::kBFloat16);
    check_cuda(shared_act, "shared_act", at::kBFloat16);
    check_cuda(shared_y, "shared_y", at::kBFloat16);
    Is = shared_fc1->size(0) / 2;
    TORCH_CHECK(shared_fc1->dim() == 2 && shared_fc1->size(0) == 2 * Is && shared_fc1->size(1) == H &&
                    shared_fc2->dim() == 2 && shared_fc2->size(0) == H && shared_fc2->size(1) == Is,
                "megatron_mok: shared weights [2Is, H], [H, Is]");
    TORCH_CHECK(shared_act.dim() == 2 && shared_act.size(0) == T && shared_act.size(1) == Is,
                "megatron_mok: shared_act [T, Is]");
    TORCH_CHECK(shared_y.dim() == 2 && shared_y.size(0) == T && shared_y.size(1) == H, "megatron_mok: shared_y [T, H]");
    if (shared_h.has_value()) {
      check_cuda(*shared_h, "shared_h", at::kBFloat16);
      TORCH_CHECK(shared_h->dim() == 2 && shared_h->size(0) == T && shared_h->size(1) == 2 * Is,
                  "megatron_mok: shared_h [T, 2Is]");
    }
  }
  TORCH_CHECK(peer_x.size() == peer_comb.size() && peer_x.size() == peer_flags.size(),
              "megatron_mok: peer lists differ in length");
  mok::MegaArgs a{};
  a.x = x.data_ptr();
  a.fc1 = fc1.data_ptr();
  a.fc2 = fc2.data_ptr();
  a.shared_fc1 = shared_fc1.has_value() ? shared_fc1->data_ptr() : nullptr;
  a.shared_fc2 = shared_fc2.has_value() ? shared_fc2->data_ptr() : nullptr;
  a.row_src_rank = row_src_rank.data_ptr<int>();
  a.row_src_slot = row_src_slot.data_ptr<int>();
  a.expert_counts = expert_counts.data_ptr<int>();
  a.expert_offsets = expert_offsets.data_ptr<int>();
  a.x_routed = x_routed.data_ptr();
  a.act = act.data_ptr();
  a.h = h.has_value() ? h->data_ptr() : nullptr;
  a.y_routed = y_routed.data_ptr();
  a.shared_act = shared_fc1.has_value() ? shared_act.data_ptr() : nullptr;
  a.shared_h = shared_fc1.has_value() && shared_h.has_value() ? shared_h->data_ptr() : nullptr;
  a.shared_y = shared_fc1.has_value() ? shared_y.data_ptr() : nullptr;
  a.counters = counters.data_ptr<int>();
  a.state = state.data_ptr<int>();
  a.errors = errors.data_ptr<int>();
  a.x_bufs = peers(peer_x, "peer_x");
  a.comb_bufs = peers(peer_comb, "peer_comb");
  a.flags = peers(peer_flags, "peer_flags");
  a.T = static_cast<int>(T);
  a.H = static_cast<int>(H);
  a.I = static_cast<int>(I);
  a.Is = static_cast<int>(Is);
  a.k = static_cast<int>(topk);
  a.nle = static_cast<int>(nle);
  a.capacity = static_cast<int>(cap);
  a.rank = static_cast<int>(rank);
  a.ep = static_cast<int>(peer_x.size());
  a.num_comm = static_cast<int>(num_comm);
  a.num_compute = static_cast<int>(num_compute);
  a.minibatch_rows = static_cast<int>(minibatch_rows);
  a.timeout_ns = timeout_ns_of(timeout_s);
  c10::cuda::CUDAGuard guard(x.device());
  check(mok::launch_megakernel(a, current_stream()));
}

// Profiling switch: while enabled, every megakernel launch stamps its tasks into `records`
// (int64 [n, 8], see set_megakernel_timeline); the tensor must outlive the launches.
void megakernel_timeline(Tensor& records, bool enable) {
  if (!enable) {
    mok::set_megakernel_timeline(nullptr, 0);
    return;
  }
  check_cuda(records, "timeline records", at::kLong);
  TORCH_CHECK(records.dim() == 2 && records.size(1) == 8 && records.size(0) > 1024,
              "megatron_mok: timeline records must be int64 [n > 1024, 8] (the last 1024 rows: dispatching CTAs)");
  mok::set_megakernel_timeline(reinterpret_cast<long long*>(records.data_ptr<int64_t>()), records.size(0));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatron_mok, m) {
  m.def(
      "dispatch(Tensor row_src_rank, Tensor row_src_slot, Tensor expert_offsets, Tensor(a!) x_routed, int[] peer_x, "
      "int topk, int num_ctas) -> ()");
  m.def(
      "dispatch_e4m3(Tensor row_src_rank, Tensor row_src_slot, Tensor expert_offsets, Tensor(a!) q_routed, "
      "Tensor(b!) scale_t, int[] peer_q, int[] peer_s, int scale_pitch, int topk, int num_ctas) -> ()");
  m.def(
      "combine(Tensor y, Tensor row_src_rank, Tensor row_src_slot, Tensor expert_offsets, Tensor(a!) state, "
      "int[] peer_comb, int num_ctas) -> ()");
  m.def("moe_epilogue(Tensor comb, Tensor probs, Tensor? shared_y, Tensor(a!) out, Tensor(b!)? errors=None) -> ()");
  m.def(
      "moe_epilogue_wait(Tensor comb, Tensor probs, Tensor? shared_y, Tensor(a!) out, Tensor state, Tensor(b!) errors, "
      "int[] peer_flags, int rank, float timeout_s) -> ()");
  m.def(
      "megakernel(Tensor x, Tensor fc1, Tensor fc2, Tensor? shared_fc1, Tensor? shared_fc2, Tensor row_src_rank, "
      "Tensor row_src_slot, Tensor expert_counts, Tensor expert_offsets, Tensor(a!) x_routed, Tensor(b!) act, "
      "Tensor(i!)? h, Tensor(c!) y_routed, Tensor(d!) shared_act, Tensor(j!)? shared_h, Tensor(e!) shared_y, "
      "Tensor(f!) counters, Tensor(g!) state, Tensor(h!) errors, int[] peer_x, int[] peer_comb, int[] peer_flags, int rank, int topk, int num_comm, "
      "int num_compute, int minibatch_rows, float timeout_s) -> ()");
  m.def("megakernel_timeline(Tensor(a!) records, bool enable) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("dispatch", &dispatch);
  m.impl("dispatch_e4m3", &dispatch_e4m3);
  m.impl("combine", &combine);
  m.impl("moe_epilogue", &moe_epilogue);
  m.impl("moe_epilogue_wait", &moe_epilogue_wait);
  m.impl("megakernel", &megakernel);
  m.impl("megakernel_timeline", &megakernel_timeline);
}
