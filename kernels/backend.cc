#include "kernels/backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/arg_checks.h"
#include "kernels/status_macros.h"

namespace plateau {

absl::string_view BackendKindName(BackendKind kind) {
  return kind == BackendKind::kCpu ? "cpu" : "cuda";
}

absl::StatusOr<BackendKind> ParseBackendKind(absl::string_view name) {
  if (name == "cpu") return BackendKind::kCpu;
  if (name == "cuda") return BackendKind::kCuda;
  return absl::InvalidArgumentError(
      absl::StrCat("backend: unknown '", name, "'; expected cpu or cuda"));
}

// ---------------------------------------------------------------------------
// Argument checks, shared by every backend.

absl::Status ValidateGemm(const GemmArgs& g) {
  constexpr absl::string_view op = "gemm";
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "m", g.m));
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "n", g.n));
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "k", g.k));
  constexpr int64_t kMax = 0x7fffffff;  // BLAS takes int dimensions
  if (g.m > kMax || g.n > kMax || g.k > kMax) {
    return ArgError(op, "m, n and k must each fit in 32 bits");
  }
  if (g.lda > kMax || g.ldb > kMax || g.ldc > kMax) {
    return ArgError(op, "lda, ldb and ldc must each fit in 32 bits");
  }
  // Stored shapes (row-major): A is m x k (k x m transposed), B is k x n
  // (n x k transposed), C is m x n.
  const int64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
  const int64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
  auto check_ld = [&](absl::string_view name, int64_t ld, int64_t rows,
                      int64_t cols, absl::string_view mat) -> absl::Status {
    if (rows > 0 && ld < std::max<int64_t>(1, cols)) {
      return ArgError(op, absl::StrCat(name, " = ", ld, " is less than the ", cols,
                                  " columns of ", mat, " (", rows, " x ", cols,
                                  ", row-major)"));
    }
    return absl::OkStatus();
  };
  const bool product = g.m > 0 && g.n > 0 && g.k > 0;
  if (product) {
    PLATEAU_RETURN_IF_ERROR(check_ld("lda", g.lda, a_rows, a_cols, "A"));
    PLATEAU_RETURN_IF_ERROR(check_ld("ldb", g.ldb, b_rows, b_cols, "B"));
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "a", g.a, g.m * g.k));
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "b", g.b, g.k * g.n));
  }
  PLATEAU_RETURN_IF_ERROR(check_ld("ldc", g.ldc, g.m, g.n, "C"));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "c", g.c, g.m * g.n));
  if (!std::isfinite(g.alpha) || !std::isfinite(g.beta)) {
    return ArgError(op, "alpha and beta must be finite");
  }
  return absl::OkStatus();
}

absl::Status ValidateAdamW(const AdamWArgs& a) {
  constexpr absl::string_view op = "adamw";
  if (!(a.lr >= 0.0f) || !std::isfinite(a.lr)) {
    return ArgError(op, absl::StrCat("lr must be finite and >= 0, got ", a.lr));
  }
  if (!(a.beta1 >= 0.0f && a.beta1 < 1.0f)) {
    return ArgError(op, absl::StrCat("beta1 must be in [0, 1), got ", a.beta1));
  }
  if (!(a.beta2 >= 0.0f && a.beta2 < 1.0f)) {
    return ArgError(op, absl::StrCat("beta2 must be in [0, 1), got ", a.beta2));
  }
  if (!(a.eps > 0.0f)) {
    return ArgError(op, absl::StrCat("eps must be > 0, got ", a.eps));
  }
  if (!(a.weight_decay >= 0.0f) || !std::isfinite(a.weight_decay)) {
    return ArgError(op, absl::StrCat("weight_decay must be finite and >= 0, got ",
                                a.weight_decay));
  }
  if (a.step < 1) {
    return ArgError(op, absl::StrCat("step must be >= 1 (1-based), got ", a.step));
  }
  if (!std::isfinite(a.grad_scale)) {
    return ArgError(op, "grad_scale must be finite");
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Public entry points: validate once, then hand to the implementation.

absl::Status Backend::Copy(Stream& stream, void* dst, const void* src,
                           size_t bytes) {
  const int64_t n = static_cast<int64_t>(bytes);
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("copy", "dst", dst, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("copy", "src", src, n));
  const char* d = static_cast<const char*>(dst);
  const char* s = static_cast<const char*>(src);
  if (bytes > 0 && d < s + bytes && s < d + bytes) {
    return ArgError("copy", "src and dst ranges overlap");
  }
  if (bytes == 0) return absl::OkStatus();
  return DoCopy(stream, dst, src, bytes);
}

absl::Status Backend::Gemm(Stream& stream, const GemmArgs& args) {
  PLATEAU_RETURN_IF_ERROR(ValidateGemm(args));
  if (args.m == 0 || args.n == 0) return absl::OkStatus();
  return DoGemm(stream, args);
}

namespace {

// [begin, end) of the floats a row-major matrix of rows x cols at row stride
// ld touches; empty when it has no element.
struct Extent {
  uintptr_t begin = 0, end = 0;
  size_t gemm = 0;
};
Extent ExtentOf(const void* p, int64_t rows, int64_t cols, int64_t ld, size_t gemm,
                size_t element_bytes = sizeof(float)) {
  if (rows <= 0 || cols <= 0) return {0, 0, gemm};
  const uintptr_t b = reinterpret_cast<uintptr_t>(p);
  return {b, b + static_cast<uintptr_t>(((rows - 1) * ld + cols) * element_bytes), gemm};
}

// The outputs, sorted, must be disjoint, and no input may overlap another
// entry's output (an entry's own A or B against its C is Gemm's rule, not
// checked there either). Shared by the fp32 and bf16 grouped GEMMs.
absl::Status CheckGroupedOverlaps(absl::string_view op, std::vector<Extent> outputs,
                                  const std::vector<Extent>& inputs) {
  std::sort(outputs.begin(), outputs.end(),
            [](const Extent& x, const Extent& y) { return x.begin < y.begin; });
  for (size_t j = 1; j < outputs.size(); ++j) {
    if (outputs[j].begin < outputs[j - 1].end) {
      return ArgError(op, absl::StrCat("gemms[", outputs[j - 1].gemm, "].c and gemms[",
                                       outputs[j].gemm, "].c overlap"));
    }
  }
  for (const Extent& in : inputs) {
    // The first output ending after the input begins, and those after it
    // while they begin before the input ends.
    auto it = std::upper_bound(outputs.begin(), outputs.end(), in.begin,
                               [](uintptr_t v, const Extent& o) { return v < o.end; });
    for (; it != outputs.end() && it->begin < in.end; ++it) {
      if (it->gemm != in.gemm) {
        return ArgError(op, absl::StrCat("gemms[", it->gemm, "].c overlaps an input of gemms[",
                                         in.gemm, "]"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Backend::GroupedGemm(Stream& stream, absl::Span<const GemmArgs> gemms) {
  std::vector<Extent> outputs, inputs;
  std::vector<GemmArgs> work;
  for (size_t i = 0; i < gemms.size(); ++i) {
    const GemmArgs& g = gemms[i];
    if (absl::Status st = ValidateGemm(g); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("grouped gemm: gemms[", i, "]: ", st.message()));
    }
    if (g.m == 0 || g.n == 0) continue;
    outputs.push_back(ExtentOf(g.c, g.m, g.n, g.ldc, i));
    if (g.k > 0) {
      inputs.push_back(ExtentOf(g.a, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda, i));
      inputs.push_back(ExtentOf(g.b, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb, i));
    }
    work.push_back(g);
  }
  PLATEAU_RETURN_IF_ERROR(CheckGroupedOverlaps("grouped gemm", std::move(outputs), inputs));
  if (work.empty()) return absl::OkStatus();
  return DoGroupedGemm(stream, work);
}

// bf16 (backend.h): validated as GroupedGemm, with 2-byte A and B and a C of
// its own type.
absl::Status Backend::GroupedGemmBf16(Stream& stream, absl::Span<const GemmBf16Args> gemms) {
  std::vector<Extent> outputs, inputs;
  std::vector<GemmBf16Args> work;
  for (size_t i = 0; i < gemms.size(); ++i) {
    const GemmBf16Args& g = gemms[i];
    if (absl::Status st = ValidateGemmBf16(g); !st.ok()) {
      return absl::Status(st.code(),
                          absl::StrCat("grouped gemm_bf16: gemms[", i, "]: ", st.message()));
    }
    if (g.m == 0 || g.n == 0) continue;
    outputs.push_back(g.c != nullptr ? ExtentOf(g.c, g.m, g.n, g.ldc, i, sizeof(Bf16))
                                     : ExtentOf(g.c_fp32, g.m, g.n, g.ldc, i, sizeof(float)));
    if (g.k > 0) {
      inputs.push_back(ExtentOf(g.a, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda, i,
                                sizeof(Bf16)));
      inputs.push_back(ExtentOf(g.b, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb, i,
                                sizeof(Bf16)));
    }
    work.push_back(g);
  }
  PLATEAU_RETURN_IF_ERROR(CheckGroupedOverlaps("grouped gemm_bf16", std::move(outputs), inputs));
  if (work.empty()) return absl::OkStatus();
  return DoGroupedGemmBf16(stream, work);
}

absl::Status Backend::DoGroupedGemmBf16(Stream& stream, absl::Span<const GemmBf16Args> gemms) {
  for (const GemmBf16Args& g : gemms) PLATEAU_RETURN_IF_ERROR(DoGemmBf16(stream, g));
  return absl::OkStatus();
}

absl::Status Backend::DoGroupedGemm(Stream& stream, absl::Span<const GemmArgs> gemms) {
  for (const GemmArgs& g : gemms) PLATEAU_RETURN_IF_ERROR(DoGemm(stream, g));
  return absl::OkStatus();
}

absl::Status Backend::Fill(Stream& s, float* x, int64_t n, float value) {
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative("fill", "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("fill", "x", x, n));
  return n == 0 ? absl::OkStatus() : DoFill(s, x, n, value);
}

absl::Status Backend::Scale(Stream& s, float* x, int64_t n, float alpha) {
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative("scale", "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("scale", "x", x, n));
  return n == 0 ? absl::OkStatus() : DoScale(s, x, n, alpha);
}

absl::Status Backend::Axpy(Stream& s, float* y, const float* x, int64_t n,
                           float alpha) {
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative("axpy", "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("axpy", "y", y, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("axpy", "x", x, n));
  return n == 0 ? absl::OkStatus() : DoAxpy(s, y, x, n, alpha);
}

absl::Status Backend::Add(Stream& s, float* out, const float* a,
                          const float* b, int64_t n) {
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative("add", "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("add", "out", out, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("add", "a", a, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("add", "b", b, n));
  return n == 0 ? absl::OkStatus() : DoAdd(s, out, a, b, n);
}

absl::Status Backend::Mul(Stream& s, float* out, const float* a,
                          const float* b, int64_t n) {
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative("mul", "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("mul", "out", out, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("mul", "a", a, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("mul", "b", b, n));
  return n == 0 ? absl::OkStatus() : DoMul(s, out, a, b, n);
}

absl::Status Backend::SwiGluForward(Stream& s, float* out, const float* gate,
                                    const float* up, int64_t n) {
  constexpr absl::string_view op = "swiglu_forward";
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "out", out, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "gate", gate, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "up", up, n));
  return n == 0 ? absl::OkStatus() : DoSwiGluForward(s, out, gate, up, n);
}

absl::Status Backend::SwiGluBackward(Stream& s, float* dgate, float* dup,
                                     const float* dout, const float* gate,
                                     const float* up, int64_t n) {
  constexpr absl::string_view op = "swiglu_backward";
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "dgate", dgate, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "dup", dup, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "dout", dout, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "gate", gate, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "up", up, n));
  return n == 0 ? absl::OkStatus()
                : DoSwiGluBackward(s, dgate, dup, dout, gate, up, n);
}

absl::Status Backend::RmsNormForward(Stream& s, float* out, float* rstd,
                                     const float* x, const float* weight,
                                     int64_t rows, int64_t cols, float eps) {
  constexpr absl::string_view op = "rmsnorm_forward";
  PLATEAU_RETURN_IF_ERROR(CheckRows(op, rows, cols));
  if (!(eps > 0.0f)) return ArgError(op, absl::StrCat("eps must be > 0, got ", eps));
  if (rows == 0) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "out", out, rows * cols));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "rstd", rstd, rows));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "x", x, rows * cols));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "weight", weight, cols));
  return DoRmsNormForward(s, out, rstd, x, weight, rows, cols, eps);
}

absl::Status Backend::RmsNormBackward(Stream& s, float* dx, float* dweight,
                                      const float* dout, const float* x,
                                      const float* weight, const float* rstd,
                                      int64_t rows, int64_t cols) {
  constexpr absl::string_view op = "rmsnorm_backward";
  PLATEAU_RETURN_IF_ERROR(CheckRows(op, rows, cols));
  if (rows == 0) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "dx", dx, rows * cols));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "dweight", dweight, cols));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "dout", dout, rows * cols));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "x", x, rows * cols));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "weight", weight, cols));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "rstd", rstd, rows));
  return DoRmsNormBackward(s, dx, dweight, dout, x, weight, rstd, rows, cols);
}

absl::Status Backend::SoftmaxRows(Stream& s, float* y, const float* x,
                                  int64_t rows, int64_t cols) {
  constexpr absl::string_view op = "softmax_rows";
  PLATEAU_RETURN_IF_ERROR(CheckRows(op, rows, cols));
  if (rows == 0) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "y", y, rows * cols));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "x", x, rows * cols));
  return DoSoftmaxRows(s, y, x, rows, cols);
}

absl::Status Backend::LogSumExpRows(Stream& s, float* out, const float* x,
                                    int64_t rows, int64_t cols) {
  constexpr absl::string_view op = "logsumexp_rows";
  PLATEAU_RETURN_IF_ERROR(CheckRows(op, rows, cols));
  if (rows == 0) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "out", out, rows));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "x", x, rows * cols));
  return DoLogSumExpRows(s, out, x, rows, cols);
}

absl::Status Backend::Sum(Stream& s, float* out, const float* x, int64_t n) {
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative("sum", "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("sum", "out", out, 1));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("sum", "x", x, n));
  return DoSum(s, out, x, n);
}

absl::Status Backend::SumSquares(Stream& s, float* out, const float* x,
                                 int64_t n) {
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative("sum_squares", "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("sum_squares", "out", out, 1));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("sum_squares", "x", x, n));
  return DoSumSquares(s, out, x, n);
}

absl::Status Backend::AdamW(Stream& s, float* param, const float* grad,
                            float* m, float* v, int64_t n,
                            const AdamWArgs& args) {
  constexpr absl::string_view op = "adamw";
  PLATEAU_RETURN_IF_ERROR(ValidateAdamW(args));
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "n", n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "param", param, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "grad", grad, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "m", m, n));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "v", v, n));
  return n == 0 ? absl::OkStatus() : DoAdamW(s, param, grad, m, v, n, args);
}

}  // namespace plateau
