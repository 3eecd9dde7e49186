// torch ops of the e4m3 quantizers (csrc/kernels/quant/quantize.cu): token rows, their inverse,
// weights and the weight gradients' column-wise operands.
#include "bindings/common.h"

namespace {

using namespace mok_bindings;

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatron_mok, m) {
  m.def(
      "quantize_rows_e4m3(Tensor x, Tensor(a!) q, Tensor(b!) scale, Tensor? rows_end=None, bool scale_rows=False, "
      "bool gate_up_pairs=False) -> ()");
  m.def("dequantize_rows_e4m3(Tensor q, Tensor scale, Tensor(a!) x, Tensor? rows_end=None, bool scale_rows=False) -> ()");
  m.def(
      "quantize_weight_e4m3(Tensor w, Tensor(a!) q, Tensor(b!) scale, bool swiglu, Tensor(c!)? q_t=None, "
      "Tensor(d!)? scale_t=None) -> ()");
  m.def(
      "quantize_columns_e4m3(Tensor x, Tensor? x_scale, bool scale_rows, Tensor offsets, Tensor counts, "
      "Tensor(a!) q_t, Tensor(b!) scale) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("quantize_rows_e4m3", &quantize_rows_e4m3);
  m.impl("dequantize_rows_e4m3", &dequantize_rows_e4m3);
  m.impl("quantize_weight_e4m3", &quantize_weight_e4m3);
  m.impl("quantize_columns_e4m3", &quantize_columns_e4m3);
}
