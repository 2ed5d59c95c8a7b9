// The bf16 entry points of Backend: validated once here, as backend.cc
// validates the fp32 ones, then handed to the implementation. Kept in their
// own file so that the fp32 entry points stay as they were.
#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "kernels/arg_checks.h"
#include "kernels/backend.h"
#include "kernels/status_macros.h"

namespace plateau {
namespace {

absl::Status NoBf16(absl::string_view op, const Backend& b) {
  return absl::UnimplementedError(absl::StrCat(op, ": the ", BackendKindName(b.kind()),
                                               " backend has no bf16 kernels"));
}

}  // namespace

absl::Status ValidateGemmBf16(const GemmBf16Args& g) {
  constexpr absl::string_view op = "gemm_bf16";
  if ((g.c == nullptr) == (g.c_fp32 == nullptr) && g.m > 0 && g.n > 0) {
    return ArgError(op, "exactly one of c (bf16) and c_fp32 must be set");
  }
  // The shape and stride rules are GemmArgs' (element strides, whatever the
  // element size): checked by ValidateGemm on the same fields, its message
  // renamed to this op.
  GemmArgs shape;
  shape.trans_a = g.trans_a;
  shape.trans_b = g.trans_b;
  shape.m = g.m;
  shape.n = g.n;
  shape.k = g.k;
  shape.alpha = g.alpha;
  shape.a = reinterpret_cast<const float*>(g.a);
  shape.lda = g.lda;
  shape.b = reinterpret_cast<const float*>(g.b);
  shape.ldb = g.ldb;
  shape.beta = g.beta;
  shape.c = g.c != nullptr ? reinterpret_cast<float*>(g.c) : g.c_fp32;
  shape.ldc = g.ldc;
  const absl::Status st = ValidateGemm(shape);
  if (st.ok()) return st;
  absl::string_view what = st.message();
  if (absl::ConsumePrefix(&what, "gemm: ")) return ArgError(op, what);
  return st;
}

absl::Status Backend::GemmBf16(Stream& stream, const GemmBf16Args& args) {
  PLATEAU_RETURN_IF_ERROR(ValidateGemmBf16(args));
  if (args.m == 0 || args.n == 0) return absl::OkStatus();
  return DoGemmBf16(stream, args);
}

absl::Status Backend::ConvertToBf16(Stream& s, Bf16* out, const float* x, int64_t n) {
  constexpr absl::string_view op = "convert_to_bf16";
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "out", out, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "x", x, n));
  return n == 0 ? absl::OkStatus() : DoConvertToBf16(s, out, x, n);
}

absl::Status Backend::ConvertToFloat(Stream& s, float* out, const Bf16* x, int64_t n) {
  constexpr absl::string_view op = "convert_to_float";
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "out", out, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "x", x, n));
  return n == 0 ? absl::OkStatus() : DoConvertToFloat(s, out, x, n);
}

absl::Status Backend::SwiGluForwardBf16(Stream& s, Bf16* out, const Bf16* gate, const Bf16* up,
                                        int64_t n) {
  constexpr absl::string_view op = "swiglu_forward_bf16";
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "out", out, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "gate", gate, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "up", up, n));
  return n == 0 ? absl::OkStatus() : DoSwiGluForwardBf16(s, out, gate, up, n);
}

absl::Status Backend::SwiGluBackwardBf16(Stream& s, Bf16* dgate, Bf16* dup, const Bf16* dout,
                                         const Bf16* gate, const Bf16* up, int64_t n) {
  constexpr absl::string_view op = "swiglu_backward_bf16";
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "dgate", dgate, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "dup", dup, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "dout", dout, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "gate", gate, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "up", up, n));
  return n == 0 ? absl::OkStatus() : DoSwiGluBackwardBf16(s, dgate, dup, dout, gate, up, n);
}

absl::Status Backend::RmsNormForwardBf16(Stream& s, Bf16* out, float* rstd, const Bf16* x,
                                         const Bf16* weight, int64_t rows, int64_t cols,
                                         float eps) {
  constexpr absl::string_view op = "rmsnorm_forward_bf16";
  PLATEAU_RETURN_IF_ERROR(CheckRows(op, rows, cols));
  if (!(eps > 0.0f)) return ArgError(op, absl::StrCat("eps must be > 0, got ", eps));
  if (rows == 0) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "out", out, rows * cols));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "rstd", rstd, rows));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "x", x, rows * cols));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "weight", weight, cols));
  return DoRmsNormForwardBf16(s, out, rstd, x, weight, rows, cols, eps);
}

absl::Status Backend::RmsNormBackwardBf16(Stream& s, Bf16* dx, Bf16* dweight, const Bf16* dout,
                                          const Bf16* x, const Bf16* weight, const float* rstd,
                                          int64_t rows, int64_t cols) {
  constexpr absl::string_view op = "rmsnorm_backward_bf16";
  PLATEAU_RETURN_IF_ERROR(CheckRows(op, rows, cols));
  if (rows == 0) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "dx", dx, rows * cols));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "dweight", dweight, cols));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "dout", dout, rows * cols));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "x", x, rows * cols));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "weight", weight, cols));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "rstd", rstd, rows));
  return DoRmsNormBackwardBf16(s, dx, dweight, dout, x, weight, rstd, rows, cols);
}

absl::Status Backend::AdamWBf16(Stream& s, float* master, const Bf16* grad, float* m, float* v,
                                Bf16* working, int64_t n, const AdamWArgs& args) {
  constexpr absl::string_view op = "adamw_bf16";
  PLATEAU_RETURN_IF_ERROR(ValidateAdamW(args));
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "master", master, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "grad", grad, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "m", m, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "v", v, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "working", working, n));
  return n == 0 ? absl::OkStatus() : DoAdamWBf16(s, master, grad, m, v, working, n, args);
}

absl::Status Backend::FillBf16(Stream& s, Bf16* x, int64_t n, float value) {
  constexpr absl::string_view op = "fill_bf16";
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "x", x, n));
  return n == 0 ? absl::OkStatus() : DoFillBf16(s, x, n, value);
}

absl::Status Backend::AddBf16(Stream& s, Bf16* out, const Bf16* a, const Bf16* b, int64_t n) {
  constexpr absl::string_view op = "add_bf16";
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "out", out, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "a", a, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "b", b, n));
  return n == 0 ? absl::OkStatus() : DoAddBf16(s, out, a, b, n);
}

absl::Status Backend::SumSquaresBf16(Stream& s, float* out, const Bf16* x, int64_t n) {
  constexpr absl::string_view op = "sum_squares_bf16";
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "out", out, 1));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "x", x, n));
  // n == 0 still writes out[0] = 0, as SumSquares does.
  return DoSumSquaresBf16(s, out, x, n);
}

absl::Status Backend::SumRowsBf16(Stream& s, Bf16* out, const Bf16* x, int64_t rows, int64_t n, int64_t ld) {
  constexpr absl::string_view op = "sum_rows_bf16";
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "rows", rows));
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "n", n));
  if (ld < n) return ArgError(op, absl::StrCat("ld = ", ld, " is less than n = ", n));
  if (n == 0) return absl::OkStatus();
  const int64_t span = (rows - 1) * ld + n;  // elements of x read
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "out", out, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "x", x, span));
  if (out < x + span && x < out + n) return ArgError(op, "out overlaps x");
  return DoSumRowsBf16(s, out, x, rows, n, ld);
}

absl::Status Backend::AddRowsBf16(Stream& s, Bf16* out, const Bf16* x, absl::Span<const int32_t> rows, int64_t ld,
                                  int64_t n) {
  constexpr absl::string_view op = "add_rows_bf16";
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "n", n));
  if (ld < n) return ArgError(op, absl::StrCat("ld = ", ld, " is less than n = ", n));
  if (n == 0 || rows.empty()) return absl::OkStatus();
  int32_t last = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    if (rows[r] < 0) return ArgError(op, absl::StrCat("rows[", r, "] = ", rows[r], " is negative"));
    last = std::max(last, rows[r]);
  }
  const int64_t span = last * ld + n;  // elements of x read, from x on
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "out", out, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "x", x, span));
  for (int32_t r : rows) {
    const Bf16* row = x + r * ld;
    if (out < row + n && row < out + n) return ArgError(op, absl::StrCat("out overlaps row ", r, " of x"));
  }
  for (size_t first = 0; first < rows.size(); first += kBf16AddRowsPerCall) {
    const size_t count = std::min<size_t>(kBf16AddRowsPerCall, rows.size() - first);
    PLATEAU_RETURN_IF_ERROR(DoAddRowsBf16(s, out, x, rows.subspan(first, count), ld, n));
  }
  return absl::OkStatus();
}

// Defaults for a backend without bf16 kernels.
absl::Status Backend::DoFillBf16(Stream&, Bf16*, int64_t, float) {
  return NoBf16("fill_bf16", *this);
}
absl::Status Backend::DoAddBf16(Stream&, Bf16*, const Bf16*, const Bf16*, int64_t) {
  return NoBf16("add_bf16", *this);
}
absl::Status Backend::DoSumSquaresBf16(Stream&, float*, const Bf16*, int64_t) {
  return NoBf16("sum_squares_bf16", *this);
}
absl::Status Backend::DoSumRowsBf16(Stream&, Bf16*, const Bf16*, int64_t, int64_t, int64_t) {
  return NoBf16("sum_rows_bf16", *this);
}
absl::Status Backend::DoAddRowsBf16(Stream&, Bf16*, const Bf16*, absl::Span<const int32_t>, int64_t, int64_t) {
  return NoBf16("add_rows_bf16", *this);
}
absl::Status Backend::DoGemmBf16(Stream&, const GemmBf16Args&) { return NoBf16("gemm_bf16", *this); }
absl::Status Backend::DoConvertToBf16(Stream&, Bf16*, const float*, int64_t) {
  return NoBf16("convert_to_bf16", *this);
}
absl::Status Backend::DoConvertToFloat(Stream&, float*, const Bf16*, int64_t) {
  return NoBf16("convert_to_float", *this);
}
absl::Status Backend::DoSwiGluForwardBf16(Stream&, Bf16*, const Bf16*, const Bf16*, int64_t) {
  return NoBf16("swiglu_forward_bf16", *this);
}
absl::Status Backend::DoSwiGluBackwardBf16(Stream&, Bf16*, Bf16*, const Bf16*, const Bf16*,
                                           const Bf16*, int64_t) {
  return NoBf16("swiglu_backward_bf16", *this);
}
absl::Status Backend::DoRmsNormForwardBf16(Stream&, Bf16*, float*, const Bf16*, const Bf16*,
                                           int64_t, int64_t, float) {
  return NoBf16("rmsnorm_forward_bf16", *this);
}
absl::Status Backend::DoRmsNormBackwardBf16(Stream&, Bf16*, Bf16*, const Bf16*, const Bf16*,
                                            const Bf16*, const float*, int64_t, int64_t) {
  return NoBf16("rmsnorm_backward_bf16", *this);
}
absl::Status Backend::DoAdamWBf16(Stream&, float*, const Bf16*, float*, float*, Bf16*, int64_t,
                                  const AdamWArgs&) {
  return NoBf16("adamw_bf16", *this);
}

}  // namespace plateau
