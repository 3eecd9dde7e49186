// torch ops of the GEMMs (csrc/kernels/gemm/): the grouped GEMM (token-major or, with real-row
// counts, expert-major), the block-scaled e4m3 expert GEMM, the backward's dgrad and the weight
// gradients (bf16 and e4m3).
#include "bindings/common.h"

namespace {

using namespace mok_bindings;

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

// The SwiGLU backward's tensors of a down-projection dgrad (mok::SwiGLUBackward): h [rows', 2 M]
// bf16, row_w [rows] fp32, act [rows, M] bf16, dot [rows, >= ceil(M / 64)] fp32; the last three
// optional and only with h.
mok::SwiGLUBackward swiglu_backward(const char* op, const std::optional<Tensor>& h,
                                    const std::optional<Tensor>& row_w, const std::optional<Tensor>& act,
                                    const std::optional<Tensor>& dot, int64_t rows, int64_t M) {
  using ll = long long;
  mok::SwiGLUBackward b;
  MOK_CHECK(h.has_value() || (!row_w.has_value() && !act.has_value() && !dot.has_value()),
            "megatron_mok: %s row_w, act and dot go with h (the SwiGLU backward)", op);
  if (!h.has_value()) return b;
  check_cuda(*h, "h", at::kBFloat16);
  MOK_CHECK(h->dim() == 2 && h->size(1) == 2 * M, "megatron_mok: %s h must be [rows, 2 M = %lld], got %lld dims, %lld columns",
            op, ll(2 * M), ll(h->dim()), ll(h->size(-1)));
  b.h = h->data_ptr();
  if (row_w.has_value()) {
    check_cuda(*row_w, "row_w", at::kFloat);
    MOK_CHECK(row_w->numel() == rows, "megatron_mok: %s row_w must hold one weight per row (%lld), got %lld", op, ll(rows),
              ll(row_w->numel()));
    b.row_w = row_w->data_ptr<float>();
  }
  if (act.has_value()) {
    check_cuda(*act, "act", at::kBFloat16);
    MOK_CHECK(act->dim() == 2 && act->size(0) == rows && act->size(1) == M, "megatron_mok: %s act must be [%lld, %lld]", op,
              ll(rows), ll(M));
    b.act = act->data_ptr();
  }
  if (dot.has_value()) {
    check_cuda(*dot, "dot", at::kFloat);
    MOK_CHECK(dot->dim() == 2 && dot->size(0) == rows && dot->size(1) >= (M + 63) / 64,
              "megatron_mok: %s dot must be [%lld, >= %lld]", op, ll(rows), ll((M + 63) / 64));
    b.dot = dot->data_ptr<float>();
    b.dot_ld = static_cast<int>(dot->size(1));
  }
  return b;
}

// Block-scaled e4m3 routed GEMM: x8 [rows, K] with x_scale [K / 128, ld >= rows] (quantize_rows_e4m3),
// w8 [nseg, swiglu ? 2 N : N, K] with w_scale [nseg, weight tiles, K / 128] (fp8.quantize_weight).
// h (the backward's down-projection dgrad, plain weights): out = dh [rows, 2 N], the SwiGLU backward
// (swiglu_backward: h, row_w, act, dot).
void expert_gemm_fp8(const Tensor& x8, const Tensor& x_scale, const Tensor& w8, const Tensor& w_scale,
                     const Tensor& seg_offsets, const Tensor& seg_counts, Tensor& out,
                     const std::optional<Tensor>& pre_out, bool swiglu, int64_t num_ctas,
                     const std::optional<Tensor>& h, const std::optional<Tensor>& push_rank,
                     const std::optional<Tensor>& push_slot, std::vector<int64_t> push_peers,
                     const std::optional<Tensor>& dh_q, const std::optional<Tensor>& dh_q_scale,
                     const std::optional<Tensor>& row_w, const std::optional<Tensor>& act,
                     const std::optional<Tensor>& dot) {
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
  if (h.has_value()) {
    TORCH_CHECK(!swiglu && !pre_out.has_value(), "megatron_mok: expert_gemm_fp8 h (SwiGLU backward) needs plain weights");
    TORCH_CHECK(out.size(1) % 2 == 0 && h->sizes() == out.sizes(),
                "megatron_mok: expert_gemm_fp8 with h: h and out (dh) must both be [rows, 2 N]");
  }
  const mok::SwiGLUBackward bwd = swiglu_backward("expert_gemm_fp8", h, row_w, act, dot, x8.size(0), N);
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
                                    out.data_ptr(), pre, static_cast<int>(N), bwd,
                                    push_rank.has_value() ? push_rank->data_ptr<int>() : nullptr,
                                    push_slot.has_value() ? push_slot->data_ptr<int>() : nullptr,
                                    push_rank.has_value() ? &bufs : nullptr,
                                    dh_q.has_value() ? dh_q->data_ptr() : nullptr,
                                    dh_q.has_value() ? dh_q_scale->data_ptr<float>() : nullptr,
                                    dh_q.has_value() ? dh_q_scale->size(1) : 0, tickets.data_ptr<int>(),
                                    static_cast<int>(num_ctas), current_stream()));
}

// The routed dgrad on the expert-major GEMM: out = dy @ w[e] per segment; with h, out = dh (the
// SwiGLU backward fused into the epilogue).
void expert_dgrad(const Tensor& dy, const Tensor& w, const Tensor& seg_offsets, const Tensor& seg_counts, Tensor& out,
                  const std::optional<Tensor>& h, int64_t num_ctas, const std::optional<Tensor>& row_w,
                  const std::optional<Tensor>& act, const std::optional<Tensor>& dot) {
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
  const mok::SwiGLUBackward bwd = swiglu_backward("expert_dgrad", h, row_w, act, dot, dy.size(0), M);
  c10::cuda::CUDAGuard guard(dy.device());
  check(mok::launch_expert_dgrad(dy.data_ptr(), dy.size(0), static_cast<int>(K), w.data_ptr(), static_cast<int>(M),
                                 static_cast<int>(nseg), seg_offsets.data_ptr<int>(), seg_counts.data_ptr<int>(),
                                 out.data_ptr(), bwd, static_cast<int>(num_ctas), current_stream()));
}

// A weight gradient's out: bf16 (written) or fp32 (added into, e.g. Megatron's main_grad); true for fp32.
bool check_wgrad_out(const Tensor& out, const char* op) {
  TORCH_CHECK(out.is_cuda() && out.is_contiguous(), "megatron_mok: ", op, " out must be a contiguous CUDA tensor");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat, "megatron_mok: ", op,
              " out has dtype ", out.scalar_type(), ", expected bfloat16 (written) or float32 (added into)");
  return out.scalar_type() == at::kFloat;
}

// Routed weight gradients on the expert-major ring: out[e] = a[rows of e]^T @ b[rows of e].
void expert_wgrad(const Tensor& a, const Tensor& a_offsets, const Tensor& b, const Tensor& b_offsets,
                  const Tensor& counts, Tensor& out, int64_t num_ctas) {
  check_cuda(a, "a", at::kBFloat16);
  check_cuda(b, "b", at::kBFloat16);
  const bool out_f32 = check_wgrad_out(out, "expert_wgrad");
  for (auto* t : {&a_offsets, &b_offsets, &counts}) check_cuda(*t, "offsets / counts", at::kInt);
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 3,
              "megatron_mok: expert_wgrad needs a [rows, M], b [rows', N], out [nseg, M, N]");
  const int64_t nseg = out.size(0), M = a.size(1), N = b.size(1);
  using ll = long long;
  MOK_CHECK(out.size(1) == M && out.size(2) == N, "megatron_mok: expert_wgrad out must be [nseg, %lld, %lld], got [%lld, %lld, %lld]",
            ll(M), ll(N), ll(nseg), ll(out.size(1)), ll(out.size(2)));
  // parts: offsets [nparts, nseg + 1] and counts [nparts, nseg] (1-D: one part)
  const int64_t nparts = counts.numel() / std::max<int64_t>(nseg, 1);
  MOK_CHECK(nparts >= 1 && counts.numel() == nparts * nseg && a_offsets.numel() == nparts * (nseg + 1) &&
                b_offsets.numel() == nparts * (nseg + 1),
            "megatron_mok: expert_wgrad needs nseg + 1 offsets in each layout and nseg counts per part (nseg = %lld; "
            "got %lld and %lld offsets, %lld counts)", ll(nseg), ll(a_offsets.numel()), ll(b_offsets.numel()),
            ll(counts.numel()));
  for (auto* t : {&a_offsets, &b_offsets, &counts})
    TORCH_CHECK(t->is_contiguous(), "megatron_mok: expert_wgrad offsets and counts must be contiguous");
  c10::cuda::CUDAGuard guard(a.device());
  check(mok::launch_expert_wgrad(a.data_ptr(), a.size(0), static_cast<int>(M), a_offsets.data_ptr<int>(), b.data_ptr(),
                                 b.size(0), static_cast<int>(N), b_offsets.data_ptr<int>(), counts.data_ptr<int>(),
                                 static_cast<int>(nseg), static_cast<int>(nparts), out.data_ptr(), out_f32,
                                 static_cast<int>(num_ctas), current_stream()));
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
  const bool out_f32 = check_wgrad_out(out, "expert_wgrad_fp8");
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
                                     out.data_ptr(), out_f32, static_cast<int>(num_ctas), current_stream()));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatron_mok, m) {
  m.def(
      "grouped_gemm(Tensor a, Tensor b, Tensor? seg_offsets, Tensor? seg_counts, Tensor(a!) out, Tensor(b!)? pre_out, "
      "bool swiglu, int num_ctas) -> ()");
  m.def(
      "expert_gemm_fp8(Tensor x8, Tensor x_scale, Tensor w8, Tensor w_scale, Tensor seg_offsets, Tensor seg_counts, "
      "Tensor(a!) out, Tensor(b!)? pre_out, bool swiglu, int num_ctas=0, Tensor? h=None, Tensor? push_rank=None, "
      "Tensor? push_slot=None, int[] push_peers=[], Tensor(c!)? dh_q=None, Tensor(d!)? dh_q_scale=None, "
      "Tensor? row_w=None, Tensor(e!)? act=None, Tensor(f!)? dot=None) -> ()");
  m.def(
      "expert_dgrad(Tensor dy, Tensor w, Tensor seg_offsets, Tensor seg_counts, Tensor(a!) out, Tensor? h=None, "
      "int num_ctas=0, Tensor? row_w=None, Tensor(b!)? act=None, Tensor(c!)? dot=None) -> ()");
  m.def(
      "expert_wgrad(Tensor a, Tensor a_offsets, Tensor b, Tensor b_offsets, Tensor counts, Tensor(a!) out, "
      "int num_ctas=0) -> ()");
  m.def(
      "expert_wgrad_fp8(Tensor a_t, Tensor a_scale, Tensor b_t, Tensor b_scale, Tensor offsets, Tensor counts, "
      "Tensor(a!) out, int num_ctas=0) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("grouped_gemm", &grouped_gemm);
  m.impl("expert_gemm_fp8", &expert_gemm_fp8);
  m.impl("expert_dgrad", &expert_dgrad);
  m.impl("expert_wgrad", &expert_wgrad);
  m.impl("expert_wgrad_fp8", &expert_wgrad_fp8);
}
