// torch op registrations of the mok kernels (namespace megatron_mok). The only file that includes
// torch headers; the kernels themselves live in csrc/kernels/*.cu behind csrc/kernels/launch.h.
//
// Symmetric peer buffers arrive as int[] lists of addresses (one per rank, rank order) taken from
// torch symmetric memory handles on the Python side; they are passed to the kernels by value.
#include <Python.h>

#include <cstdio>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/launch.h"

namespace {

using at::Tensor;

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void check(const char* msg) { TORCH_CHECK(msg == nullptr, msg); }

// Messages that carry numbers are formatted by snprintf and handed to TORCH_CHECK as one C string:
// the GPU machines' toolchain links libstdc++ statically into the extension, and formatting an
// integer through TORCH_CHECK's iostream there segfaults (string-only messages do not).
template <class... Args>
std::string format(const char* f, Args... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, f, args...);
  return std::string(buf);
}
#define MOK_CHECK(cond, ...) TORCH_CHECK(cond, format(__VA_ARGS__).c_str())

void check_cuda(const Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), "megatron_mok: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dtype, "megatron_mok: ", name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(t.is_contiguous(), "megatron_mok: ", name, " must be contiguous");
}

mok::PeerPtrs peers(const std::vector<int64_t>& ptrs, const char* name) {
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

uint64_t timeout_ns_of(double timeout_s) {
  TORCH_CHECK(timeout_s > 0, "megatron_mok: timeouts must be positive");
  const double ns = timeout_s * 1e9;
  return ns > 1.8e19 ? UINT64_MAX : static_cast<uint64_t>(ns);
}

void barrier(Tensor& state, Tensor& errors, std::vector<int64_t> peer_flags, int64_t rank, double timeout_s,
             int64_t bump_gather) {
  check_cuda(state, "state", at::kInt);
  check_cuda(errors, "errors", at::kInt);
  c10::cuda::CUDAGuard guard(state.device());
  check(mok::launch_barrier(peers(peer_flags, "peer_flags"), state.data_ptr<int>(), errors.data_ptr<int>(),
                            static_cast<int>(rank), static_cast<int>(peer_flags.size()), timeout_ns_of(timeout_s),
                            static_cast<int>(bump_gather), current_stream()));
}

void barrier_open(Tensor& state, std::vector<int64_t> peer_flags, int64_t rank) {
  check_cuda(state, "state", at::kInt);
  c10::cuda::CUDAGuard guard(state.device());
  check(mok::launch_barrier_open(peers(peer_flags, "peer_flags"), state.data_ptr<int>(), static_cast<int>(rank),
                                 static_cast<int>(peer_flags.size()), current_stream()));
}

// dst (this rank's symmetric buffer) <- src, then a barrier (one launch).
void publish_barrier(const Tensor& src, Tensor& dst, Tensor& state, Tensor& errors, std::vector<int64_t> peer_flags,
                     int64_t rank, double timeout_s) {
  TORCH_CHECK(src.is_cuda() && src.is_contiguous() && dst.is_cuda() && dst.is_contiguous(),
              "megatron_mok: publish_barrier src/dst must be contiguous CUDA tensors");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type() && src.numel() == dst.numel(),
              "megatron_mok: publish_barrier src and dst differ in dtype or size");
  check_cuda(state, "state", at::kInt);
  check_cuda(errors, "errors", at::kInt);
  c10::cuda::CUDAGuard guard(src.device());
  check(mok::launch_publish_barrier(src.data_ptr(), dst.data_ptr(), static_cast<int64_t>(src.nbytes()),
                                    peers(peer_flags, "peer_flags"), state.data_ptr<int>(), errors.data_ptr<int>(),
                                    static_cast<int>(rank), static_cast<int>(peer_flags.size()),
                                    timeout_ns_of(timeout_s), current_stream()));
}

// Routing all-gather (peer stores into every rank's routing buffer), barrier, and the schedule: one
// launch. routing_buf: this rank's [2, ep, T, k] buffer (peer_bufs[rank] maps the same memory).
void build_schedule(const Tensor& top_experts, Tensor& routing_buf, Tensor& state, Tensor& errors, Tensor& top_all,
                    Tensor& row_src_rank, Tensor& row_src_slot, Tensor& expert_counts, Tensor& expert_offsets,
                    Tensor& scratch, std::vector<int64_t> peer_bufs, std::vector<int64_t> peer_flags, int64_t rank,
                    int64_t num_experts, double timeout_s) {
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
                             static_cast<int>(row_src_rank.numel()), timeout_ns_of(timeout_s), current_stream()));
}

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

// The remote tokens routed to this rank, each pulled once: rows_out [ep, T, ...] (and scales_out)
// row (src, t) <- peer_rows[src] row t for src != rank if t has a local expert (launch_pull_tokens).
void pull_tokens(const Tensor& top_all, int64_t rank, int64_t nle, std::vector<int64_t> peer_rows, Tensor& rows_out,
                 std::vector<int64_t> peer_scales, const std::optional<Tensor>& scales_out, int64_t num_ctas) {
  check_cuda(top_all, "top_all", at::kInt);
  TORCH_CHECK(top_all.dim() == 3, "megatron_mok: pull_tokens top_all must be [ep, T, k]");
  const int64_t ep = top_all.size(0), T = top_all.size(1), k = top_all.size(2);
  using ll = long long;
  auto row_bytes = [&](const Tensor& t, const char* name) {
    MOK_CHECK(t.is_cuda() && t.is_contiguous() && t.dim() >= 3 && t.size(0) == ep && t.size(1) == T,
              "megatron_mok: pull_tokens %s must be a contiguous CUDA tensor [ep = %lld, T = %lld, ...]", name, ll(ep),
              ll(T));
    return t.numel() / (ep * T) * t.element_size();
  };
  const int64_t rb = row_bytes(rows_out, "rows_out");
  const int64_t sb = scales_out.has_value() ? row_bytes(*scales_out, "scales_out") : 0;
  MOK_CHECK(static_cast<int64_t>(peer_rows.size()) == ep && (!scales_out || static_cast<int64_t>(peer_scales.size()) == ep),
            "megatron_mok: pull_tokens needs one peer address per rank (ep = %lld)", ll(ep));
  MOK_CHECK(rank >= 0 && rank < ep && nle > 0, "megatron_mok: pull_tokens rank %lld of %lld ranks, %lld local experts",
            ll(rank), ll(ep), ll(nle));
  c10::cuda::CUDAGuard guard(rows_out.device());
  check(mok::launch_pull_tokens(top_all.data_ptr<int>(), static_cast<int>(T), static_cast<int>(k), static_cast<int>(ep),
                                static_cast<int>(rank), static_cast<int>(nle), peers(peer_rows, "peer_rows"),
                                rows_out.data_ptr(), static_cast<int>(rb),
                                scales_out ? peers(peer_scales, "peer_scales") : mok::PeerPtrs{},
                                scales_out ? scales_out->data_ptr() : nullptr, static_cast<int>(sb),
                                static_cast<int>(num_ctas), current_stream()));
}

void grouped_gemm(const Tensor& a, const Tensor& b, const std::optional<Tensor>& seg_offsets,
                  const std::optional<Tensor>& seg_counts, Tensor& out, const std::optional<Tensor>& pre_out,
                  bool swiglu, int64_t num_ctas) {
  check_cuda(a, "a", at::kBFloat16);
  check_cuda(b, "b", at::kBFloat16);
  check_cuda(out, "out", at::kBFloat16);
  TORCH_CHECK(a.dim() == 2 && out.dim() == 2 && out.size(0) == a.size(0), "megatron_mok: gemm a [M, K], out [M, N]");
  TORCH_CHECK(b.dim() == 2 || b.dim() == 3, "megatron_mok: gemm b must be [rows, K] or [nseg, rows, K]");
  const int64_t K = a.size(1), N = out.size(1);
  TORCH_CHECK(b.size(-1) == K, "megatron_mok: gemm K mismatch");
  const int64_t b_rows = b.size(-2);
  const int nseg = b.dim() == 3 ? static_cast<int>(b.size(0)) : 1;
  TORCH_CHECK(b_rows == (swiglu ? 2 * N : N), "megatron_mok: gemm b rows must be ", swiglu ? "2 N" : "N");
  const int* seg = nullptr;
  if (seg_offsets.has_value()) {
    check_cuda(*seg_offsets, "seg_offsets", at::kInt);
    TORCH_CHECK(seg_offsets->numel() == nseg + 1, "megatron_mok: seg_offsets must have nseg + 1 entries");
    seg = seg_offsets->data_ptr<int>();
  } else {
    TORCH_CHECK(nseg == 1, "megatron_mok: several segments need seg_offsets");
  }
  const int* counts = nullptr;
  if (seg_counts.has_value()) {
    check_cuda(*seg_counts, "seg_counts", at::kInt);
    TORCH_CHECK(seg && seg_counts->numel() == nseg, "megatron_mok: seg_counts needs seg_offsets and nseg entries");
    counts = seg_counts->data_ptr<int>();
  }
  void* pre = nullptr;
  if (pre_out.has_value()) {
    TORCH_CHECK(swiglu, "megatron_mok: gemm pre_out needs swiglu");
    check_cuda(*pre_out, "pre_out", at::kBFloat16);
    TORCH_CHECK(pre_out->dim() == 2 && pre_out->size(0) == a.size(0) && pre_out->size(1) == 2 * N,
                "megatron_mok: gemm pre_out must be [M, 2 N]");
    pre = pre_out->data_ptr();
  }
  c10::cuda::CUDAGuard guard(a.device());
  check(mok::launch_grouped_gemm(swiglu, a.data_ptr(), a.size(0), static_cast<int>(K), b.data_ptr(),
                                 static_cast<int>(b_rows), seg, counts, nseg, out.data_ptr(), pre,
                                 static_cast<int>(N), static_cast<int>(num_ctas), current_stream()));
}

// Weight tiles of the e4m3 GEMM per expert: 128 rows, or (swiglu) 64 gate rows with the same up rows.
int64_t e4m3_weight_tiles(int64_t n, bool swiglu) { return swiglu ? (n + 63) / 64 : (n + 127) / 128; }

// Block-scaled e4m3 routed GEMM: x8 [rows, K] with x_scale [K / 128, ld >= rows] (quantize_rows_e4m3),
// w8 [nseg, swiglu ? 2 N : N, K] with w_scale [nseg, weight tiles, K / 128] (fp8.quantize_weight).
// h (the backward's down-projection dgrad, plain weights): out = dh [rows, 2 N], the SwiGLU backward
// of the products with the forward's pre-activations h [rows, 2 N].
void expert_gemm_fp8(const Tensor& x8, const Tensor& x_scale, const Tensor& w8, const Tensor& w_scale,
                     const Tensor& seg_offsets, const Tensor& seg_counts, Tensor& out,
                     const std::optional<Tensor>& pre_out, bool swiglu, int64_t num_ctas,
                     const std::optional<Tensor>& h, const std::optional<Tensor>& push_rank,
                     const std::optional<Tensor>& push_slot, std::vector<int64_t> push_peers,
                     const std::optional<Tensor>& dh_q, const std::optional<Tensor>& dh_q_scale) {
  check_cuda(x8, "x8", at::kFloat8_e4m3fn);
  check_cuda(w8, "w8", at::kFloat8_e4m3fn);
  check_cuda(x_scale, "x_scale", at::kFloat);
  check_cuda(w_scale, "w_scale", at::kFloat);
  check_cuda(out, "out", at::kBFloat16);
  check_cuda(seg_offsets, "seg_offsets", at::kInt);
  check_cuda(seg_counts, "seg_counts", at::kInt);
  TORCH_CHECK(x8.dim() == 2 && out.dim() == 2 && out.size(0) == x8.size(0),
              "megatron_mok: expert_gemm_fp8 x8 [rows, K], out [rows, N]");
  TORCH_CHECK(w8.dim() == 3, "megatron_mok: expert_gemm_fp8 w8 must be [nseg, rows, K]");
  const int64_t K = x8.size(1), N = h.has_value() ? out.size(1) / 2 : out.size(1), nseg = w8.size(0);
  TORCH_CHECK(w8.size(2) == K, "megatron_mok: expert_gemm_fp8 K mismatch between x8 and w8");
  TORCH_CHECK(w8.size(1) == (swiglu ? 2 * N : N), "megatron_mok: expert_gemm_fp8 w8 rows must be ",
              swiglu ? "2 N" : "N");
  TORCH_CHECK(K % 128 == 0, "megatron_mok: expert_gemm_fp8 K must be a multiple of 128");
  const int64_t nkb = K / 128, tiles = e4m3_weight_tiles(N, swiglu);
  TORCH_CHECK(x_scale.dim() == 2 && x_scale.size(0) == nkb && x_scale.size(1) >= x8.size(0),
              "megatron_mok: expert_gemm_fp8 x_scale must be [K / 128, ld >= rows] (quantize_rows_e4m3)");
  TORCH_CHECK(w_scale.dim() == 3 && w_scale.size(0) == nseg && w_scale.size(1) == tiles && w_scale.size(2) == nkb,
              "megatron_mok: expert_gemm_fp8 w_scale must be [nseg, weight tiles, K / 128] (fp8.quantize_weight)");
  TORCH_CHECK(seg_offsets.numel() == nseg + 1 && seg_counts.numel() == nseg,
              "megatron_mok: expert_gemm_fp8 needs nseg + 1 offsets and nseg counts");
  void* pre = nullptr;
  if (pre_out.has_value()) {
    TORCH_CHECK(swiglu, "megatron_mok: expert_gemm_fp8 pre_out needs swiglu");
    check_cuda(*pre_out, "pre_out", at::kBFloat16);
    TORCH_CHECK(pre_out->dim() == 2 && pre_out->size(0) == x8.size(0) && pre_out->size(1) == 2 * N,
                "megatron_mok: expert_gemm_fp8 pre_out must be [rows, 2 N]");
    pre = pre_out->data_ptr();
  }
  const void* hp = nullptr;
  if (h.has_value()) {
    TORCH_CHECK(!swiglu && !pre_out.has_value(), "megatron_mok: expert_gemm_fp8 h (SwiGLU backward) needs plain weights");
    check_cuda(*h, "h", at::kBFloat16);
    TORCH_CHECK(out.size(1) % 2 == 0 && h->sizes() == out.sizes(),
                "megatron_mok: expert_gemm_fp8 with h: h and out (dh) must both be [rows, 2 N]");
    hp = h->data_ptr();
  }
  TORCH_CHECK(push_rank.has_value() == push_slot.has_value() && push_rank.has_value() == !push_peers.empty(),
              "megatron_mok: expert_gemm_fp8 push_rank, push_slot and push_peers go together");
  mok::PeerPtrs bufs{};
  if (push_rank.has_value()) {
    TORCH_CHECK(!swiglu && !h.has_value(), "megatron_mok: expert_gemm_fp8 pushes rows of the plain (down) GEMM only");
    check_cuda(*push_rank, "push_rank", at::kInt);
    check_cuda(*push_slot, "push_slot", at::kInt);
    TORCH_CHECK(push_rank->numel() == x8.size(0) && push_slot->numel() == x8.size(0),
                "megatron_mok: expert_gemm_fp8 push_rank and push_slot need one entry per row");
    bufs = peers(push_peers, "push_peers");
  }
  TORCH_CHECK(dh_q.has_value() == dh_q_scale.has_value(), "megatron_mok: expert_gemm_fp8 dh_q and dh_q_scale go together");
  if (dh_q.has_value()) {
    TORCH_CHECK(h.has_value(), "megatron_mok: expert_gemm_fp8 dh_q (dh's e4m3 copy) needs h (the SwiGLU backward)");
    check_cuda(*dh_q, "dh_q", at::kFloat8_e4m3fn);
    TORCH_CHECK(dh_q->sizes() == out.sizes(), "megatron_mok: expert_gemm_fp8 dh_q must be [rows, 2 N] like out (dh)");
    check_cuda(*dh_q_scale, "dh_q_scale", at::kFloat);
    MOK_CHECK(dh_q_scale->dim() == 2 && dh_q_scale->size(0) == 2 * N / 128 && dh_q_scale->size(1) >= x8.size(0) &&
                  dh_q_scale->size(1) % 4 == 0,
              "megatron_mok: expert_gemm_fp8 dh_q_scale must be [2 N / 128 = %lld, ld >= rows = %lld], ld a multiple of 4",
              static_cast<long long>(2 * N / 128), static_cast<long long>(x8.size(0)));
  }
  c10::cuda::CUDAGuard guard(x8.device());
  // the launch's task counter: from the caching allocator on this stream, so no other launch in
  // flight shares it (a CUDA graph keeps it in its pool)
  const Tensor tickets = at::empty({1}, x8.options().dtype(at::kInt));
  check(mok::launch_expert_gemm_fp8(swiglu, x8.data_ptr(), x8.size(0), static_cast<int>(K), x_scale.data_ptr<float>(),
                                    static_cast<int>(x_scale.size(1)), w8.data_ptr(), w_scale.data_ptr<float>(),
                                    static_cast<int>(nseg), seg_offsets.data_ptr<int>(), seg_counts.data_ptr<int>(),
                                    out.data_ptr(), pre, static_cast<int>(N), hp,
                                    push_rank.has_value() ? push_rank->data_ptr<int>() : nullptr,
                                    push_slot.has_value() ? push_slot->data_ptr<int>() : nullptr,
                                    push_rank.has_value() ? &bufs : nullptr,
                                    dh_q.has_value() ? dh_q->data_ptr() : nullptr,
                                    dh_q.has_value() ? dh_q_scale->data_ptr<float>() : nullptr,
                                    dh_q.has_value() ? dh_q_scale->size(1) : 0, tickets.data_ptr<int>(),
                                    static_cast<int>(num_ctas), current_stream()));
}

// The scales of rows x 128-column blocks: [K / 128, ld >= rows] (the GEMM's; scale_rows false) or
// [rows' >= rows, pitch >= K / 128] (one row per token, the dispatch's; scale_rows true).
std::pair<int64_t, int64_t> scale_strides(const Tensor& scale, int64_t rows, int64_t nkb, bool scale_rows,
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

const int* rows_end_ptr(const std::optional<Tensor>& rows_end, const char* op) {
  if (!rows_end.has_value()) return nullptr;
  MOK_CHECK(rows_end->is_cuda() && rows_end->scalar_type() == at::kInt && rows_end->numel() == 1,
            "megatron_mok: %s rows_end must be one int32 on the device", op);
  return rows_end->data_ptr<int>();
}

// What both row (de)quantizers check: bf16 rows x and their e4m3 twin q of one shape [rows, K], K a
// multiple of 128, the scales (scale_strides) and the optional row bound. `pair` names the two
// operands in the op's order.
struct RowBlocks {
  int64_t K;
  std::pair<int64_t, int64_t> strides;
  const int* end;
};

RowBlocks row_blocks(const Tensor& x, const Tensor& q, const Tensor& scale, const std::optional<Tensor>& rows_end,
                     bool scale_rows, const char* op, const char* pair) {
  check_cuda(x, "x", at::kBFloat16);
  check_cuda(q, "q", at::kFloat8_e4m3fn);
  MOK_CHECK(x.dim() == 2 && q.sizes() == x.sizes(), "megatron_mok: %s %s must be [rows, K]", op, pair);
  const int64_t K = x.size(1);
  MOK_CHECK(K % 128 == 0, "megatron_mok: %s K must be a multiple of 128", op);
  return {K, scale_strides(scale, x.size(0), K / 128, scale_rows, op), rows_end_ptr(rows_end, op)};
}

void quantize_rows_e4m3(const Tensor& x, Tensor& q, Tensor& scale, const std::optional<Tensor>& rows_end,
                        bool scale_rows, bool gate_up_pairs) {
  const RowBlocks b = row_blocks(x, q, scale, rows_end, scale_rows, "quantize_rows_e4m3", "x and q");
  c10::cuda::CUDAGuard guard(x.device());
  check(mok::launch_quantize_rows_e4m3(x.data_ptr(), x.size(0), static_cast<int>(b.K), q.data_ptr(),
                                       scale.data_ptr<float>(), b.strides.first, b.strides.second, b.end,
                                       gate_up_pairs, current_stream()));
}

void dequantize_rows_e4m3(const Tensor& q, const Tensor& scale, Tensor& x, const std::optional<Tensor>& rows_end,
                          bool scale_rows) {
  const RowBlocks b = row_blocks(x, q, scale, rows_end, scale_rows, "dequantize_rows_e4m3", "q and x");
  c10::cuda::CUDAGuard guard(q.device());
  check(mok::launch_dequantize_rows_e4m3(q.data_ptr(), scale.data_ptr<float>(), b.strides.first, b.strides.second,
                                         x.data_ptr(), q.size(0), static_cast<int>(b.K), b.end, current_stream()));
}

// q_t / scale_t (optional): the transposed copy [nseg, K, tiles * 128] with scale_t [nseg, K / 128, tiles].
void quantize_weight_e4m3(const Tensor& w, Tensor& q, Tensor& scale, bool swiglu, const std::optional<Tensor>& q_t,
                          const std::optional<Tensor>& scale_t) {
  check_cuda(w, "w", at::kBFloat16);
  check_cuda(q, "q", at::kFloat8_e4m3fn);
  check_cuda(scale, "scale", at::kFloat);
  TORCH_CHECK(w.dim() == 3 && q.sizes() == w.sizes(), "megatron_mok: quantize_weight_e4m3 w and q must be [nseg, rows, K]");
  const int64_t rows = w.size(1), K = w.size(2);
  TORCH_CHECK(K % 128 == 0, "megatron_mok: quantize_weight_e4m3 K must be a multiple of 128");
  TORCH_CHECK(!swiglu || rows % 2 == 0, "megatron_mok: quantize_weight_e4m3 swiglu rows hold [gate; up] (even)");
  const int64_t tiles = e4m3_weight_tiles(swiglu ? rows / 2 : rows, swiglu);
  TORCH_CHECK(scale.dim() == 3 && scale.size(0) == w.size(0) && scale.size(1) == tiles && scale.size(2) == K / 128,
              "megatron_mok: quantize_weight_e4m3 scale must be [nseg, tiles, K / 128]");
  TORCH_CHECK(q_t.has_value() == scale_t.has_value(), "megatron_mok: quantize_weight_e4m3 q_t and scale_t go together");
  void* qt = nullptr;
  float* st = nullptr;
  if (q_t.has_value()) {
    check_cuda(*q_t, "q_t", at::kFloat8_e4m3fn);
    check_cuda(*scale_t, "scale_t", at::kFloat);
    TORCH_CHECK(q_t->dim() == 3 && q_t->size(0) == w.size(0) && q_t->size(1) == K && q_t->size(2) == tiles * 128,
                "megatron_mok: quantize_weight_e4m3 q_t must be [nseg, K, tiles * 128]");
    TORCH_CHECK(scale_t->dim() == 3 && scale_t->size(0) == w.size(0) && scale_t->size(1) == K / 128 &&
                    scale_t->size(2) == tiles,
                "megatron_mok: quantize_weight_e4m3 scale_t must be [nseg, K / 128, tiles]");
    qt = q_t->data_ptr();
    st = scale_t->data_ptr<float>();
  }
  c10::cuda::CUDAGuard guard(w.device());
  check(mok::launch_quantize_weight_e4m3(w.data_ptr(), static_cast<int>(w.size(0)), static_cast<int>(rows),
                                         static_cast<int>(K), swiglu, q.data_ptr(), scale.data_ptr<float>(), qt, st,
                                         current_stream()));
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
                int64_t minibatch_rows, double timeout_s, std::vector<Tensor> fp8, std::vector<int64_t> peer_xs,
                int64_t xs_pitch) {
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
  if (fp8.empty()) {
    check_cuda(x_routed, "x_routed", at::kBFloat16);
    TORCH_CHECK(x_routed.dim() == 2 && x_routed.size(0) == cap && x_routed.size(1) == H,
                "megatron_mok: x_routed [cap, H]");
  } else {
    TORCH_CHECK(fp8.size() == 9,
                "megatron_mok: megakernel fp8 takes [fc1_q, fc1_scale, fc2_q, fc2_scale, x8_routed, x8_scale, act8, "
                "act8_scale, shared_seg], got ", fp8.size(), " tensors");
    TORCH_CHECK(H % 128 == 0 && I % 128 == 0, "megatron_mok: the fp8 megakernel needs H and I multiples of 128, got ",
                H, ", ", I);
    const char* names[8] = {"fc1_q", "fc1_scale", "fc2_q", "fc2_scale", "x8_routed", "x8_scale", "act8", "act8_scale"};
    const std::vector<int64_t> shapes[8] = {{nle, 2 * I, H}, {nle, I / 64, H / 128}, {nle, H, I}, {nle, H / 128, I / 128},
                                            {cap, H},        {H / 128, cap},         {cap, I},    {I / 128, cap}};
    for (int i = 0; i < 8; ++i) {
      check_cuda(fp8[i], names[i], i % 2 == 0 ? at::kFloat8_e4m3fn : at::kFloat);
      TORCH_CHECK(fp8[i].sizes().vec() == shapes[i], "megatron_mok: megakernel ", names[i], " has shape ",
                  fp8[i].sizes(), ", expected ", at::IntArrayRef(shapes[i]));
    }
    check_cuda(fp8[8], "shared_seg", at::kInt);
    TORCH_CHECK(fp8[8].numel() == 3, "megatron_mok: shared_seg holds [0, T, T]");
    TORCH_CHECK(peer_xs.size() == peer_x.size(), "megatron_mok: peer_xs and peer_x differ in length");
    MOK_CHECK(xs_pitch >= H / 128, "megatron_mok: xs_pitch %lld is below H / 128 = %lld",
              static_cast<long long>(xs_pitch), static_cast<long long>(H / 128));
  }
  TORCH_CHECK(act.dim() == 2 && act.size(0) == cap && act.size(1) == I, "megatron_mok: act [cap, I]");
  TORCH_CHECK(y_routed.dim() == 2 && y_routed.size(0) == cap && y_routed.size(1) == H, "megatron_mok: y_routed [cap, H]");
  if (h.has_value()) {
    check_cuda(*h, "h", at::kBFloat16);
    TORCH_CHECK(h->dim() == 2 && h->size(0) == cap && h->size(1) == 2 * I, "megatron_mok: h [cap, 2I]");
  }
  TORCH_CHECK(counters.numel() >= mok::megakernel_counter_ints(static_cast<int>(cap), static_cast<int>(T),
                                                               fp8.empty() ? 0 : static_cast<int>(I / 128)),
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
  a.x_routed = fp8.empty() ? x_routed.data_ptr() : nullptr;
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
  if (!fp8.empty()) {
    a.fc1_q = fp8[0].data_ptr();
    a.fc1_scale = fp8[1].data_ptr<float>();
    a.fc2_q = fp8[2].data_ptr();
    a.fc2_scale = fp8[3].data_ptr<float>();
    a.x8_routed = fp8[4].data_ptr();
    a.x8_scale = fp8[5].data_ptr<float>();
    a.act8 = fp8[6].data_ptr();
    a.act8_scale = fp8[7].data_ptr<float>();
    a.xs_bufs = peers(peer_xs, "peer_xs");
    a.xs_pitch = static_cast<int>(xs_pitch);
    a.shared_seg = fp8[8].data_ptr<int>();
  }
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

// ---- backward -----------------------------------------------------------------------------------

// Optional row map of the tight layout: int32 [rows] on the device, or nullptr.
const int* tight_rows(const std::optional<Tensor>& trow, int64_t rows, const char* op) {
  if (!trow.has_value()) return nullptr;
  check_cuda(*trow, "trow", at::kInt);
  MOK_CHECK(trow->numel() == rows, "megatron_mok: %s trow must have %lld entries", op, static_cast<long long>(rows));
  return trow->data_ptr<int>();
}

// toffs [nle + 1], trow [capacity] of the tight layout from the padded schedule (one launch).
void bwd_tight_map(const Tensor& expert_counts, const Tensor& expert_offsets, Tensor& toffs, Tensor& trow,
                   int64_t align) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&expert_counts, &expert_offsets, &toffs, &trow})
    check_cuda(*t, "tight map tensor", at::kInt);
  const int64_t nle = expert_counts.numel();
  TORCH_CHECK(expert_offsets.numel() == nle + 1 && toffs.numel() == nle + 1,
              "megatron_mok: bwd_tight_map offsets must have nle + 1 entries");
  c10::cuda::CUDAGuard guard(trow.device());
  check(mok::launch_bwd_tight_map(expert_counts.data_ptr<int>(), expert_offsets.data_ptr<int>(), static_cast<int>(nle),
                                  static_cast<int>(trow.numel()), static_cast<int>(align), toffs.data_ptr<int>(),
                                  trow.data_ptr<int>(), current_stream()));
}

// dst[t] = src[trow[t]] for t < toffs[-1] (device value); trow[t] < 0 -> a zero row.
void gather_rows(const Tensor& src, Tensor& dst, const Tensor& trow, const Tensor& toffs, int64_t num_ctas) {
  check_cuda(src, "src", at::kBFloat16);
  check_cuda(dst, "dst", at::kBFloat16);
  check_cuda(toffs, "toffs", at::kInt);
  TORCH_CHECK(src.dim() == 2 && dst.dim() == 2 && src.size(1) == dst.size(1), "megatron_mok: gather_rows src, dst [rows, C]");
  TORCH_CHECK(toffs.numel() >= 2, "megatron_mok: gather_rows toffs must have nle + 1 entries");
  const int* map = tight_rows(trow, dst.size(0), "gather_rows");
  TORCH_CHECK(dst.size(0) <= src.size(0), "megatron_mok: gather_rows dst has more rows than src");
  c10::cuda::CUDAGuard guard(dst.device());
  check(mok::launch_gather_rows(src.data_ptr(), dst.data_ptr(), dst.size(1) * dst.element_size(), map,
                                toffs.data_ptr<int>(), static_cast<int>(toffs.numel() - 1),
                                static_cast<int>(dst.size(0)), static_cast<int>(num_ctas), current_stream()));
}

void bwd_publish(const Tensor& grad_out, Tensor& g_dst, const Tensor& probs, Tensor& p_dst, Tensor& state,
                 Tensor& errors, std::vector<int64_t> peer_flags, int64_t rank, double timeout_s) {
  check_cuda(grad_out, "grad_out", at::kBFloat16);
  check_cuda(g_dst, "grad_out buffer", at::kBFloat16);
  check_cuda(probs, "probs", at::kFloat);
  check_cuda(p_dst, "probs buffer", at::kFloat);
  check_cuda(state, "state", at::kInt);
  check_cuda(errors, "errors", at::kInt);
  TORCH_CHECK(grad_out.numel() == g_dst.numel() && probs.numel() == p_dst.numel(),
              "megatron_mok: bwd_publish buffers differ in size");
  c10::cuda::CUDAGuard guard(grad_out.device());
  check(mok::launch_bwd_publish(grad_out.data_ptr(), g_dst.data_ptr(), static_cast<int64_t>(grad_out.nbytes()),
                                probs.data_ptr(), p_dst.data_ptr(), static_cast<int64_t>(probs.nbytes()),
                                peers(peer_flags, "peer_flags"), state.data_ptr<int>(), errors.data_ptr<int>(),
                                static_cast<int>(rank), static_cast<int>(peer_flags.size()), timeout_ns_of(timeout_s),
                                current_stream()));
}

void bwd_pull(const Tensor& row_src_rank, const Tensor& row_src_slot, const Tensor& expert_offsets,
              const Tensor& y_routed, Tensor& dy, std::vector<int64_t> peer_g, std::vector<int64_t> peer_p,
              std::vector<int64_t> peer_dw, int64_t topk, int64_t num_ctas, const std::optional<Tensor>& trow,
              const std::optional<Tensor>& q, const std::optional<Tensor>& q_scale) {
  for (auto* t : {&row_src_rank, &row_src_slot, &expert_offsets}) check_cuda(*t, "schedule tensor", at::kInt);
  check_cuda(y_routed, "y_routed", at::kBFloat16);
  check_cuda(dy, "dy", at::kBFloat16);
  TORCH_CHECK(dy.dim() == 2 && dy.size(0) == row_src_rank.numel() && y_routed.sizes() == dy.sizes(),
              "megatron_mok: dy and y_routed must be [capacity, H]");
  const int* map = tight_rows(trow, dy.size(0), "bwd_pull");
  TORCH_CHECK(peer_g.size() == peer_p.size() && peer_g.size() == peer_dw.size(),
              "megatron_mok: peer lists differ in length");
  TORCH_CHECK(q.has_value() == q_scale.has_value(), "megatron_mok: bwd_pull q and q_scale go together");
  void* qp = nullptr;
  float* sp = nullptr;
  int64_t ld = 0;
  if (q.has_value()) {  // dy quantized on the way (the fp8 dgrad)
    check_cuda(*q, "q", at::kFloat8_e4m3fn);
    TORCH_CHECK(!trow.has_value() && q->sizes() == dy.sizes() && dy.size(1) % 128 == 0,
                "megatron_mok: bwd_pull q must be [capacity, H] (H a multiple of 128, padded rows)");
    scale_strides(*q_scale, dy.size(0), dy.size(1) / 128, false, "bwd_pull");  // [H / 128, ld >= rows]
    sp = q_scale->data_ptr<float>();
    qp = q->data_ptr();
    ld = q_scale->size(1);
  }
  c10::cuda::CUDAGuard guard(dy.device());
  check(mok::launch_bwd_pull(row_src_rank.data_ptr<int>(), row_src_slot.data_ptr<int>(), expert_offsets.data_ptr<int>(),
                             static_cast<int>(expert_offsets.numel() - 1), static_cast<int>(row_src_rank.numel()),
                             peers(peer_g, "peer_g"), peers(peer_p, "peer_p"), peers(peer_dw, "peer_dw"),
                             y_routed.data_ptr(), dy.data_ptr(), static_cast<int>(dy.size(1)), static_cast<int>(topk),
                             map, static_cast<int>(num_ctas), current_stream(), qp, sp, ld));
}

void swiglu_backward(const Tensor& h, const Tensor& da, Tensor& dh, const std::optional<Tensor>& seg_offsets,
                     const std::optional<Tensor>& trow) {
  check_cuda(h, "h", at::kBFloat16);
  check_cuda(da, "da", at::kBFloat16);
  check_cuda(dh, "dh", at::kBFloat16);
  TORCH_CHECK(h.dim() == 2 && da.dim() == 2 && h.sizes() == dh.sizes() && h.size(0) == da.size(0) &&
                  h.size(1) == 2 * da.size(1),
              "megatron_mok: swiglu_backward h, dh [rows, 2I], da [rows, I]");
  const int* seg = nullptr;
  int nseg = 0;
  if (seg_offsets.has_value()) {
    check_cuda(*seg_offsets, "seg_offsets", at::kInt);
    seg = seg_offsets->data_ptr<int>();
    nseg = static_cast<int>(seg_offsets->numel() - 1);
  }
  const int* map = tight_rows(trow, dh.size(0), "swiglu_backward");
  TORCH_CHECK(map == nullptr || seg != nullptr, "megatron_mok: swiglu_backward trow needs seg_offsets");
  c10::cuda::CUDAGuard guard(h.device());
  check(mok::launch_swiglu_backward(h.data_ptr(), da.data_ptr(), dh.data_ptr(), h.size(0), static_cast<int>(da.size(1)),
                                    seg, nseg, map, current_stream()));
}

// The routed dgrad on the expert-major GEMM: out = dy @ w[e] per segment; with h, out = dh (the
// SwiGLU backward fused into the epilogue).
void expert_dgrad(const Tensor& dy, const Tensor& w, const Tensor& seg_offsets, const Tensor& seg_counts, Tensor& out,
                  const std::optional<Tensor>& h, const std::optional<Tensor>& trow, int64_t num_ctas) {
  check_cuda(dy, "dy", at::kBFloat16);
  check_cuda(w, "w", at::kBFloat16);
  check_cuda(out, "out", at::kBFloat16);
  check_cuda(seg_offsets, "seg_offsets", at::kInt);
  check_cuda(seg_counts, "seg_counts", at::kInt);
  TORCH_CHECK(dy.dim() == 2 && w.dim() == 3 && out.dim() == 2,
              "megatron_mok: expert_dgrad needs dy [rows, K], w [nseg, K, M], out [rows, M] (or [rows, 2 M] with h)");
  const int64_t K = dy.size(1), nseg = w.size(0), M = w.size(2);
  using ll = long long;
  MOK_CHECK(w.size(1) == K, "megatron_mok: expert_dgrad w must be [nseg, K, M] with K = dy.size(1) = %lld, got [%lld, %lld, %lld]",
            ll(K), ll(nseg), ll(w.size(1)), ll(M));
  MOK_CHECK(seg_offsets.numel() == nseg + 1 && seg_counts.numel() == nseg,
            "megatron_mok: expert_dgrad needs nseg + 1 seg_offsets and nseg seg_counts (nseg = %lld)", ll(nseg));
  const int64_t out_cols = h.has_value() ? 2 * M : M;
  MOK_CHECK(out.size(0) == dy.size(0) && out.size(1) == out_cols, "megatron_mok: expert_dgrad out must be [%lld, %lld], got [%lld, %lld]",
            ll(dy.size(0)), ll(out_cols), ll(out.size(0)), ll(out.size(1)));
  const void* hp = nullptr;
  if (h.has_value()) {
    check_cuda(*h, "h", at::kBFloat16);
    MOK_CHECK(h->dim() == 2 && h->size(1) == 2 * M, "megatron_mok: expert_dgrad h must be [rows, 2 M = %lld], got %lld dims, %lld columns",
              ll(2 * M), ll(h->dim()), ll(h->size(-1)));
    hp = h->data_ptr();
  }
  const int* map = tight_rows(trow, out.size(0), "expert_dgrad");
  TORCH_CHECK(map == nullptr || hp != nullptr, "megatron_mok: expert_dgrad trow needs h");
  c10::cuda::CUDAGuard guard(dy.device());
  check(mok::launch_expert_dgrad(dy.data_ptr(), dy.size(0), static_cast<int>(K), w.data_ptr(), static_cast<int>(M),
                                 static_cast<int>(nseg), seg_offsets.data_ptr<int>(), seg_counts.data_ptr<int>(),
                                 out.data_ptr(), hp, map, static_cast<int>(num_ctas), current_stream()));
}

// Routed weight gradients on the expert-major ring: out[e] = a[rows of e]^T @ b[rows of e].
void expert_wgrad(const Tensor& a, const Tensor& a_offsets, const Tensor& b, const Tensor& b_offsets,
                  const Tensor& counts, Tensor& out, int64_t num_ctas) {
  check_cuda(a, "a", at::kBFloat16);
  check_cuda(b, "b", at::kBFloat16);
  check_cuda(out, "out", at::kBFloat16);
  for (auto* t : {&a_offsets, &b_offsets, &counts}) check_cuda(*t, "offsets / counts", at::kInt);
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 3,
              "megatron_mok: expert_wgrad needs a [rows, M], b [rows', N], out [nseg, M, N]");
  const int64_t nseg = out.size(0), M = a.size(1), N = b.size(1);
  using ll = long long;
  MOK_CHECK(out.size(1) == M && out.size(2) == N, "megatron_mok: expert_wgrad out must be [nseg, %lld, %lld], got [%lld, %lld, %lld]",
            ll(M), ll(N), ll(nseg), ll(out.size(1)), ll(out.size(2)));
  MOK_CHECK(a_offsets.numel() == nseg + 1 && b_offsets.numel() == nseg + 1 && counts.numel() == nseg,
            "megatron_mok: expert_wgrad needs nseg + 1 offsets in each layout and nseg counts (nseg = %lld)", ll(nseg));
  c10::cuda::CUDAGuard guard(a.device());
  check(mok::launch_expert_wgrad(a.data_ptr(), a.size(0), static_cast<int>(M), a_offsets.data_ptr<int>(), b.data_ptr(),
                                 b.size(0), static_cast<int>(N), b_offsets.data_ptr<int>(), counts.data_ptr<int>(),
                                 static_cast<int>(nseg), out.data_ptr(), static_cast<int>(num_ctas), current_stream()));
}

// x [rows, C] bf16, or e4m3 with its 128-column scales (x_scale, laid out as scale_rows says) ->
// q_t [C, ld >= rows] e4m3 and scale [nseg, C] fp32: each expert's columns of the transpose.
void quantize_columns_e4m3(const Tensor& x, const std::optional<Tensor>& x_scale, bool scale_rows,
                           const Tensor& offsets, const Tensor& counts, Tensor& q_t, Tensor& scale) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == 2, "megatron_mok: quantize_columns_e4m3 x must be a contiguous CUDA [rows, C]");
  const bool e4m3_in = x.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(e4m3_in || x.scalar_type() == at::kBFloat16, "megatron_mok: quantize_columns_e4m3 x must be bf16 or e4m3");
  TORCH_CHECK(e4m3_in == x_scale.has_value(), "megatron_mok: quantize_columns_e4m3 takes x_scale exactly when x is e4m3");
  check_cuda(q_t, "q_t", at::kFloat8_e4m3fn);
  check_cuda(scale, "scale", at::kFloat);
  for (auto* t : {&offsets, &counts}) check_cuda(*t, "offsets / counts", at::kInt);
  const int64_t rows = x.size(0), C = x.size(1), nseg = counts.numel();
  using ll = long long;
  MOK_CHECK(offsets.numel() == nseg + 1, "megatron_mok: quantize_columns_e4m3 needs nseg + 1 offsets (nseg = %lld)", ll(nseg));
  MOK_CHECK(q_t.dim() == 2 && q_t.size(0) == C && q_t.size(1) >= rows,
            "megatron_mok: quantize_columns_e4m3 q_t must be [%lld, >= %lld]", ll(C), ll(rows));
  MOK_CHECK(scale.dim() == 2 && scale.size(0) == nseg && scale.size(1) == C,
            "megatron_mok: quantize_columns_e4m3 scale must be [%lld, %lld]", ll(nseg), ll(C));
  std::pair<int64_t, int64_t> sl{0, 0};
  if (e4m3_in) {
    MOK_CHECK(C % 128 == 0, "megatron_mok: quantize_columns_e4m3 e4m3 rows need C a multiple of 128, got %lld", ll(C));
    sl = scale_strides(*x_scale, rows, C / 128, scale_rows, "quantize_columns_e4m3");
  }
  c10::cuda::CUDAGuard guard(x.device());
  check(mok::launch_quantize_columns_e4m3(x.data_ptr(), e4m3_in, e4m3_in ? x_scale->data_ptr<float>() : nullptr,
                                          sl.first, sl.second, rows, static_cast<int>(C), offsets.data_ptr<int>(),
                                          counts.data_ptr<int>(), static_cast<int>(nseg), q_t.data_ptr(),
                                          q_t.stride(0), scale.data_ptr<float>(), current_stream()));
}

// out[e] = (a_t[:, rows of e] @ b_t[:, rows of e]^T) * a_scale[e][:, None] * b_scale[e][None, :]
void expert_wgrad_fp8(const Tensor& a_t, const Tensor& a_scale, const Tensor& b_t, const Tensor& b_scale,
                      const Tensor& offsets, const Tensor& counts, Tensor& out, int64_t num_ctas) {
  for (auto* t : {&a_t, &b_t}) TORCH_CHECK(t->dim() == 2 && t->stride(1) == 1, "megatron_mok: expert_wgrad_fp8 operands must be [rows, ld] with unit column stride");
  TORCH_CHECK(a_t.is_cuda() && a_t.scalar_type() == at::kFloat8_e4m3fn && b_t.is_cuda() &&
                  b_t.scalar_type() == at::kFloat8_e4m3fn,
              "megatron_mok: expert_wgrad_fp8 a_t and b_t must be e4m3 CUDA tensors (quantize_columns_e4m3)");
  check_cuda(a_scale, "a_scale", at::kFloat);
  check_cuda(b_scale, "b_scale", at::kFloat);
  check_cuda(out, "out", at::kBFloat16);
  for (auto* t : {&offsets, &counts}) check_cuda(*t, "offsets / counts", at::kInt);
  const int64_t nseg = out.size(0), M = a_t.size(0), N = b_t.size(0);
  using ll = long long;
  MOK_CHECK(out.dim() == 3 && out.size(1) == M && out.size(2) == N,
            "megatron_mok: expert_wgrad_fp8 out must be [nseg, %lld, %lld]", ll(M), ll(N));
  MOK_CHECK(a_t.stride(0) == b_t.stride(0) && a_t.size(1) == b_t.size(1),
            "megatron_mok: expert_wgrad_fp8 a_t and b_t must share one token layout (got pitches %lld and %lld)",
            ll(a_t.stride(0)), ll(b_t.stride(0)));
  MOK_CHECK(a_scale.dim() == 2 && a_scale.size(0) == nseg && a_scale.size(1) == M && b_scale.dim() == 2 &&
                b_scale.size(0) == nseg && b_scale.size(1) == N,
            "megatron_mok: expert_wgrad_fp8 scales must be [nseg, M] and [nseg, N] (nseg = %lld)", ll(nseg));
  MOK_CHECK(offsets.numel() == nseg + 1 && counts.numel() == nseg,
            "megatron_mok: expert_wgrad_fp8 needs nseg + 1 offsets and nseg counts (nseg = %lld)", ll(nseg));
  c10::cuda::CUDAGuard guard(a_t.device());
  check(mok::launch_expert_wgrad_fp8(a_t.data_ptr(), static_cast<int>(M), a_scale.data_ptr<float>(), b_t.data_ptr(),
                                     static_cast<int>(N), b_scale.data_ptr<float>(), a_t.stride(0),
                                     offsets.data_ptr<int>(), counts.data_ptr<int>(), static_cast<int>(nseg),
                                     out.data_ptr(), static_cast<int>(num_ctas), current_stream()));
}

void zero_empty_segments(Tensor& t, const Tensor& seg_counts) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.dim() >= 1, "megatron_mok: zero_empty_segments needs a contiguous CUDA tensor");
  check_cuda(seg_counts, "seg_counts", at::kInt);
  TORCH_CHECK(seg_counts.numel() == t.size(0), "megatron_mok: one count per slab");
  c10::cuda::CUDAGuard guard(t.device());
  const int64_t per = t.size(0) ? static_cast<int64_t>(t.nbytes()) / t.size(0) : 0;
  check(mok::launch_zero_empty_segments(t.data_ptr(), per, seg_counts.data_ptr<int>(), static_cast<int>(t.size(0)),
                                        current_stream()));
}

void bwd_push(const Tensor& rows, const Tensor& row_src_rank, const Tensor& row_src_slot, const Tensor& expert_offsets,
              Tensor& state, std::vector<int64_t> peer_slots, std::vector<int64_t> peer_flags, int64_t rank,
              int64_t num_ctas, const std::optional<Tensor>& trow) {
  check_cuda(rows, "rows", at::kBFloat16);
  for (auto* t : {&row_src_rank, &row_src_slot, &expert_offsets}) check_cuda(*t, "schedule tensor", at::kInt);
  check_cuda(state, "state", at::kInt);
  TORCH_CHECK(rows.dim() == 2 && rows.size(0) == row_src_rank.numel(), "megatron_mok: rows must be [capacity, H]");
  TORCH_CHECK(peer_slots.size() == peer_flags.size(), "megatron_mok: peer lists differ in length");
  const int* map = tight_rows(trow, rows.size(0), "bwd_push");
  c10::cuda::CUDAGuard guard(rows.device());
  check(mok::launch_bwd_push(rows.data_ptr(), row_src_rank.data_ptr<int>(), row_src_slot.data_ptr<int>(),
                             expert_offsets.data_ptr<int>(), static_cast<int>(expert_offsets.numel() - 1),
                             static_cast<int>(row_src_rank.numel()), peers(peer_slots, "peer_slots"),
                             static_cast<int>(rows.size(1)), peers(peer_flags, "peer_flags"), state.data_ptr<int>(),
                             static_cast<int>(rank), static_cast<int>(peer_flags.size()), map,
                             static_cast<int>(num_ctas), current_stream()));
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

// The persistent backward megakernel; the shared-expert tensors are all given or all None.
void bwd_megakernel(const Tensor& grad_out, const Tensor& x, const Tensor& fc1, const Tensor& fc2,
                    const std::optional<Tensor>& shared_fc1, const std::optional<Tensor>& shared_fc2,
                    const Tensor& row_src_rank, const Tensor& row_src_slot, const Tensor& expert_counts,
                    const Tensor& expert_offsets, const std::optional<Tensor>& shared_seg, const Tensor& x_routed,
                    const Tensor& act, const Tensor& h, const Tensor& y_routed,
                    const std::optional<Tensor>& shared_act, const std::optional<Tensor>& shared_h, Tensor& dy,
                    Tensor& dh, Tensor& dx_rows, Tensor& dfc1, Tensor& dfc2, const std::optional<Tensor>& dhs,
                    const std::optional<Tensor>& shared_dx, const std::optional<Tensor>& dsfc1,
                    const std::optional<Tensor>& dsfc2, Tensor& counters, Tensor& state, Tensor& errors,
                    std::vector<int64_t> peer_g, std::vector<int64_t> peer_p, std::vector<int64_t> peer_dw,
                    std::vector<int64_t> peer_slots, std::vector<int64_t> peer_flags, int64_t rank, int64_t topk,
                    int64_t num_comm, int64_t num_compute, int64_t minibatch_rows, double timeout_s) {
  using ll = long long;
  for (auto* t : {&grad_out, &x, &fc1, &fc2, &x_routed, &act, &h, &y_routed}) check_cuda(*t, "bwd_megakernel input", at::kBFloat16);
  for (auto* t : {&dy, &dh, &dx_rows, &dfc1, &dfc2}) check_cuda(*t, "bwd_megakernel output", at::kBFloat16);
  for (auto* t : {&row_src_rank, &row_src_slot, &expert_counts, &expert_offsets}) check_cuda(*t, "schedule tensor", at::kInt);
  for (auto* t : {&counters, &state, &errors}) check_cuda(*t, "bwd_megakernel state", at::kInt);
  TORCH_CHECK(x.dim() == 2 && fc1.dim() == 3 && fc2.dim() == 3, "megatron_mok: x [T, H], fc1 [nle, 2I, H], fc2 [nle, H, I]");
  const int64_t T = x.size(0), H = x.size(1), nle = fc1.size(0), I = fc1.size(1) / 2, cap = row_src_rank.numel();
  MOK_CHECK(grad_out.sizes() == x.sizes(), "megatron_mok: bwd_megakernel grad_out must be [T, H] = [%lld, %lld]", ll(T), ll(H));
  MOK_CHECK(fc1.size(1) == 2 * I && fc1.size(2) == H && fc2.size(0) == nle && fc2.size(1) == H && fc2.size(2) == I,
            "megatron_mok: bwd_megakernel weights must be fc1 [nle, 2I, H], fc2 [nle, H, I] with H = %lld", ll(H));
  TORCH_CHECK(row_src_slot.numel() == cap && expert_counts.numel() == nle && expert_offsets.numel() == nle + 1,
              "megatron_mok: bwd_megakernel schedule shapes");
  const auto rows_of = [](const Tensor& t, int64_t r, int64_t c) { return t.dim() == 2 && t.size(0) == r && t.size(1) == c; };
  for (auto [t, c, name] : {std::tuple{&x_routed, H, "x_routed"}, {&act, I, "act"}, {&h, 2 * I, "h"},
                            {&y_routed, H, "y_routed"}, {&dy, H, "dy"}, {&dh, 2 * I, "dh"}, {&dx_rows, H, "dx_rows"}})
    MOK_CHECK(rows_of(*t, cap, c), "megatron_mok: bwd_megakernel %s must be [capacity, %lld] = [%lld, %lld]", name, ll(c),
              ll(cap), ll(c));
  TORCH_CHECK(dfc1.sizes() == fc1.sizes() && dfc2.sizes() == fc2.sizes(), "megatron_mok: dfc1 / dfc2 take the weights' shapes");
  MOK_CHECK(counters.numel() >= mok::bwd_megakernel_counter_ints(static_cast<int>(cap), static_cast<int>(T)),
            "megatron_mok: bwd_megakernel counters need %lld ints",
            ll(mok::bwd_megakernel_counter_ints(static_cast<int>(cap), static_cast<int>(T))));
  const bool shared = shared_fc1.has_value();
  for (const auto* t : {&shared_fc2, &shared_seg, &shared_act, &shared_h, &dhs, &shared_dx, &dsfc1, &dsfc2})
    TORCH_CHECK(t->has_value() == shared, "megatron_mok: bwd_megakernel's shared-expert tensors are all given or all None");
  int64_t Is = 0;
  if (shared) {
    Is = shared_fc1->size(0) / 2;
    for (const auto* t : {&shared_fc1, &shared_fc2, &shared_act, &shared_h}) check_cuda(**t, "shared-expert input", at::kBFloat16);
    for (const auto* t : {&dhs, &shared_dx, &dsfc1, &dsfc2}) check_cuda(**t, "shared-expert output", at::kBFloat16);
    check_cuda(*shared_seg, "shared_seg", at::kInt);
    TORCH_CHECK(shared_seg->numel() == 3, "megatron_mok: shared_seg must be {0, T, T}");
    MOK_CHECK(rows_of(*shared_fc1, 2 * Is, H) && rows_of(*shared_fc2, H, Is),
              "megatron_mok: shared weights must be [2Is, H], [H, Is] with H = %lld", ll(H));
    MOK_CHECK(rows_of(*shared_act, T, Is) && rows_of(*shared_h, T, 2 * Is) && rows_of(*dhs, T, 2 * Is) &&
                  rows_of(*shared_dx, T, H) && dsfc1->sizes() == shared_fc1->sizes() &&
                  dsfc2->sizes() == shared_fc2->sizes(),
              "megatron_mok: bwd_megakernel shared tensors: act [T, Is], h and dhs [T, 2Is], dx [T, H], grads as "
              "the weights (T = %lld, Is = %lld)", ll(T), ll(Is));
  }
  const size_t ep = peer_flags.size();
  TORCH_CHECK(peer_g.size() == ep && peer_p.size() == ep && peer_dw.size() == ep && peer_slots.size() == ep,
              "megatron_mok: peer lists differ in length");
  const auto ptr = [](const std::optional<Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; };
  mok::BwdMegaArgs a{};
  a.g = grad_out.data_ptr();
  a.x = x.data_ptr();
  a.fc1 = fc1.data_ptr();
  a.fc2 = fc2.data_ptr();
  a.shared_fc1 = ptr(shared_fc1);
  a.shared_fc2 = ptr(shared_fc2);
  a.row_src_rank = row_src_rank.data_ptr<int>();
  a.row_src_slot = row_src_slot.data_ptr<int>();
  a.expert_counts = expert_counts.data_ptr<int>();
  a.expert_offsets = expert_offsets.data_ptr<int>();
  a.shared_seg = shared ? shared_seg->data_ptr<int>() : nullptr;
  a.x_routed = x_routed.data_ptr();
  a.act = act.data_ptr();
  a.h = h.data_ptr();
  a.y_routed = y_routed.data_ptr();
  a.shared_act = ptr(shared_act);
  a.shared_h = ptr(shared_h);
  a.dy = dy.data_ptr();
  a.dh = dh.data_ptr();
  a.dx_rows = dx_rows.data_ptr();
  a.dfc1 = dfc1.data_ptr();
  a.dfc2 = dfc2.data_ptr();
  a.dhs = ptr(dhs);
  a.shared_dx = ptr(shared_dx);
  a.dsfc1 = ptr(dsfc1);
  a.dsfc2 = ptr(dsfc2);
  a.counters = counters.data_ptr<int>();
  a.state = state.data_ptr<int>();
  a.errors = errors.data_ptr<int>();
  a.g_bufs = peers(peer_g, "peer_g");
  a.p_bufs = peers(peer_p, "peer_p");
  a.dw_bufs = peers(peer_dw, "peer_dw");
  a.slot_bufs = peers(peer_slots, "peer_slots");
  a.flags = peers(peer_flags, "peer_flags");
  a.T = static_cast<int>(T);
  a.H = static_cast<int>(H);
  a.I = static_cast<int>(I);
  a.Is = static_cast<int>(Is);
  a.k = static_cast<int>(topk);
  a.nle = static_cast<int>(nle);
  a.capacity = static_cast<int>(cap);
  a.rank = static_cast<int>(rank);
  a.ep = static_cast<int>(ep);
  a.num_comm = static_cast<int>(num_comm);
  a.num_compute = static_cast<int>(num_compute);
  a.minibatch_rows = static_cast<int>(minibatch_rows);
  a.timeout_ns = timeout_ns_of(timeout_s);
  c10::cuda::CUDAGuard guard(x.device());
  check(mok::launch_bwd_megakernel(a, current_stream()));
}

}  // namespace

TORCH_LIBRARY(megatron_mok, m) {
  m.def(
      "publish_barrier(Tensor src, Tensor(a!) dst, Tensor(b!) state, Tensor(c!) errors, int[] peer_flags, int rank, "
      "float timeout_s) -> ()");
  m.def("barrier(Tensor(a!) state, Tensor(b!) errors, int[] peer_flags, int rank, float timeout_s, int bump_gather) -> ()");
  m.def("barrier_open(Tensor(a!) state, int[] peer_flags, int rank) -> ()");
  m.def(
      "build_schedule(Tensor top_experts, Tensor(a!) routing_buf, Tensor(b!) state, Tensor(c!) errors, "
      "Tensor(d!) top_all, Tensor(e!) row_src_rank, Tensor(f!) row_src_slot, Tensor(g!) expert_counts, "
      "Tensor(h!) expert_offsets, Tensor(i!) scratch, int[] peer_bufs, int[] peer_flags, int rank, int num_experts, "
      "float timeout_s) -> ()");
  m.def(
      "dispatch(Tensor row_src_rank, Tensor row_src_slot, Tensor expert_offsets, Tensor(a!) x_routed, int[] peer_x, "
      "int topk, int num_ctas) -> ()");
  m.def(
      "dispatch_e4m3(Tensor row_src_rank, Tensor row_src_slot, Tensor expert_offsets, Tensor(a!) q_routed, "
      "Tensor(b!) scale_t, int[] peer_q, int[] peer_s, int scale_pitch, int topk, int num_ctas) -> ()");
  m.def(
      "pull_tokens(Tensor top_all, int rank, int nle, int[] peer_rows, Tensor(a!) rows_out, int[] peer_scales, "
      "Tensor(b!)? scales_out, int num_ctas) -> ()");
  m.def(
      "grouped_gemm(Tensor a, Tensor b, Tensor? seg_offsets, Tensor? seg_counts, Tensor(a!) out, Tensor(b!)? pre_out, "
      "bool swiglu, int num_ctas) -> ()");
  m.def(
      "expert_gemm_fp8(Tensor x8, Tensor x_scale, Tensor w8, Tensor w_scale, Tensor seg_offsets, Tensor seg_counts, "
      "Tensor(a!) out, Tensor(b!)? pre_out, bool swiglu, int num_ctas=0, Tensor? h=None, Tensor? push_rank=None, "
      "Tensor? push_slot=None, int[] push_peers=[], Tensor(c!)? dh_q=None, Tensor(d!)? dh_q_scale=None) -> ()");
  m.def(
      "quantize_rows_e4m3(Tensor x, Tensor(a!) q, Tensor(b!) scale, Tensor? rows_end=None, bool scale_rows=False, "
      "bool gate_up_pairs=False) -> ()");
  m.def("dequantize_rows_e4m3(Tensor q, Tensor scale, Tensor(a!) x, Tensor? rows_end=None, bool scale_rows=False) -> ()");
  m.def(
      "quantize_weight_e4m3(Tensor w, Tensor(a!) q, Tensor(b!) scale, bool swiglu, Tensor(c!)? q_t=None, "
      "Tensor(d!)? scale_t=None) -> ()");
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
      "int num_compute, int minibatch_rows, float timeout_s, Tensor(k!)[] fp8, int[] peer_xs, int xs_pitch) -> ()");
  m.def("megakernel_timeline(Tensor(a!) records, bool enable) -> ()");
  m.def(
      "bwd_publish(Tensor grad_out, Tensor(a!) g_dst, Tensor probs, Tensor(b!) p_dst, Tensor(c!) state, "
      "Tensor(d!) errors, int[] peer_flags, int rank, float timeout_s) -> ()");
  m.def(
      "bwd_pull(Tensor row_src_rank, Tensor row_src_slot, Tensor expert_offsets, Tensor y_routed, Tensor(a!) dy, "
      "int[] peer_g, int[] peer_p, int[] peer_dw, int topk, int num_ctas, Tensor? trow=None, Tensor(b!)? q=None, "
      "Tensor(c!)? q_scale=None) -> ()");
  m.def("bwd_tight_map(Tensor expert_counts, Tensor expert_offsets, Tensor(a!) toffs, Tensor(b!) trow, int align) -> ()");
  m.def("gather_rows(Tensor src, Tensor(a!) dst, Tensor trow, Tensor toffs, int num_ctas) -> ()");
  m.def("swiglu_backward(Tensor h, Tensor da, Tensor(a!) dh, Tensor? seg_offsets, Tensor? trow=None) -> ()");
  m.def(
      "expert_dgrad(Tensor dy, Tensor w, Tensor seg_offsets, Tensor seg_counts, Tensor(a!) out, Tensor? h=None, "
      "Tensor? trow=None, int num_ctas=0) -> ()");
  m.def(
      "expert_wgrad(Tensor a, Tensor a_offsets, Tensor b, Tensor b_offsets, Tensor counts, Tensor(a!) out, "
      "int num_ctas=0) -> ()");
  m.def(
      "quantize_columns_e4m3(Tensor x, Tensor? x_scale, bool scale_rows, Tensor offsets, Tensor counts, "
      "Tensor(a!) q_t, Tensor(b!) scale) -> ()");
  m.def(
      "expert_wgrad_fp8(Tensor a_t, Tensor a_scale, Tensor b_t, Tensor b_scale, Tensor offsets, Tensor counts, "
      "Tensor(a!) out, int num_ctas=0) -> ()");
  m.def("zero_empty_segments(Tensor(a!) t, Tensor seg_counts) -> ()");
  m.def(
      "bwd_push(Tensor rows, Tensor row_src_rank, Tensor row_src_slot, Tensor expert_offsets, Tensor(a!) state, "
      "int[] peer_slots, int[] peer_flags, int rank, int num_ctas, Tensor? trow=None) -> ()");
  m.def(
      "bwd_epilogue_wait(Tensor slots, Tensor dw_slots, Tensor? shared_dx, Tensor(a!) dx, Tensor(b!) dprobs, "
      "Tensor state, Tensor(c!) errors, int[] peer_flags, int rank, float timeout_s) -> ()");
  m.def(
      "bwd_megakernel(Tensor grad_out, Tensor x, Tensor fc1, Tensor fc2, Tensor? shared_fc1, Tensor? shared_fc2, "
      "Tensor row_src_rank, Tensor row_src_slot, Tensor expert_counts, Tensor expert_offsets, Tensor? shared_seg, "
      "Tensor x_routed, Tensor act, Tensor h, Tensor y_routed, Tensor? shared_act, Tensor? shared_h, Tensor(a!) dy, "
      "Tensor(b!) dh, Tensor(c!) dx_rows, Tensor(d!) dfc1, Tensor(e!) dfc2, Tensor(f!)? dhs, Tensor(g!)? shared_dx, "
      "Tensor(h!)? dsfc1, Tensor(i!)? dsfc2, Tensor(j!) counters, Tensor(k!) state, Tensor(l!) errors, int[] peer_g, "
      "int[] peer_p, int[] peer_dw, int[] peer_slots, int[] peer_flags, int rank, int topk, int num_comm, "
      "int num_compute, int minibatch_rows, float timeout_s) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("publish_barrier", &publish_barrier);
  m.impl("barrier", &barrier);
  m.impl("barrier_open", &barrier_open);
  m.impl("build_schedule", &build_schedule);
  m.impl("dispatch", &dispatch);
  m.impl("dispatch_e4m3", &dispatch_e4m3);
  m.impl("pull_tokens", &pull_tokens);
  m.impl("grouped_gemm", &grouped_gemm);
  m.impl("expert_gemm_fp8", &expert_gemm_fp8);
  m.impl("quantize_rows_e4m3", &quantize_rows_e4m3);
  m.impl("dequantize_rows_e4m3", &dequantize_rows_e4m3);
  m.impl("quantize_weight_e4m3", &quantize_weight_e4m3);
  m.impl("quantize_columns_e4m3", &quantize_columns_e4m3);
  m.impl("expert_wgrad_fp8", &expert_wgrad_fp8);
  m.impl("combine", &combine);
  m.impl("moe_epilogue", &moe_epilogue);
  m.impl("moe_epilogue_wait", &moe_epilogue_wait);
  m.impl("megakernel", &megakernel);
  m.impl("megakernel_timeline", &megakernel_timeline);
  m.impl("bwd_publish", &bwd_publish);
  m.impl("bwd_pull", &bwd_pull);
  m.impl("bwd_tight_map", &bwd_tight_map);
  m.impl("gather_rows", &gather_rows);
  m.impl("swiglu_backward", &swiglu_backward);
  m.impl("expert_dgrad", &expert_dgrad);
  m.impl("expert_wgrad", &expert_wgrad);
  m.impl("zero_empty_segments", &zero_empty_segments);
  m.impl("bwd_push", &bwd_push);
  m.impl("bwd_epilogue_wait", &bwd_epilogue_wait);
  m.impl("bwd_megakernel", &bwd_megakernel);
}

// `import megatron_mok._C` loads this library (and with it the registrations above); the module
// itself is empty.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
