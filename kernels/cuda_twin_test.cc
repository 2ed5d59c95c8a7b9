// The CUDA backend against its CPU twin: every primitive runs on both
// backends, through the Backend interface, on the same random inputs at
// several shapes (odd sizes, one row, one column, more rows than a grid,
// wider rows than a block), and the results are compared with stated
// tolerances. Also: pinned-host <-> device copies, stream/event ordering,
// the device space's cap and cudaMalloc's refusal, determinism (two runs give
// the same bits) and launches from two threads onto one stream.
//
// Without a CUDA backend (the default build, or no GPU) every test skips and
// says why.
//
// Tolerances: u = 2^-24. The CPU side was checked against double references
// in backend_test.cc; here each bound is about twice the one used there
// (each side may be off by it, in opposite directions), except where both
// sides must round the same exact value the same way (Fill, Scale, Add, Mul:
// bitwise equal).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/phase_clock.h"
#include "kernels/testing/device_side.h"

#ifdef PLATEAU_WITH_CUDA
#include "kernels/cuda/stream_errors.h"
#endif

namespace plateau {
namespace {

using ::testing::HasSubstr;

constexpr double kU = 1.0 / (1 << 24);
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<float> RandomVector(int64_t n, uint32_t seed, float lo = -1.0f,
                                float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// |cuda[i] - cpu[i]| <= tol[i] for every i; NaN never passes.
::testing::AssertionResult Agree(const std::vector<float>& cuda,
                                 const std::vector<float>& cpu,
                                 const std::vector<double>& tol) {
  if (cuda.size() != cpu.size() || cpu.size() != tol.size()) {
    return ::testing::AssertionFailure() << "sizes differ";
  }
  int64_t bad = 0, worst = -1;
  double worst_ratio = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double err = std::abs(double{cuda[i]} - double{cpu[i]});
    if (!(err <= tol[i])) {
      ++bad;
      const double ratio = std::isnan(err) ? INFINITY : err / tol[i];
      if (worst < 0 || ratio > worst_ratio) {
        worst_ratio = ratio;
        worst = static_cast<int64_t>(i);
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << cpu.size() << " elements disagree; worst ["
         << worst << "]: cuda " << cuda[worst] << ", cpu " << cpu[worst]
         << ", tol " << tol[worst];
}

::testing::AssertionResult BitwiseEqual(const std::vector<float>& a,
                                        const std::vector<float>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes";
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      return ::testing::AssertionFailure()
             << "first difference at [" << i << "]: " << a[i] << " vs " << b[i];
    }
  }
  return ::testing::AssertionSuccess();
}

// One backend with its stream (kernels/testing/device_side.h).
using Side = DeviceSide;

absl::StatusOr<std::unique_ptr<Backend>> MakeCuda(int64_t device_cap = 0) {
  BackendOptions options;
  options.kind = BackendKind::kCuda;
  options.device_memory_bytes = device_cap;
  return Backend::Create(options);
}

class CudaTwinTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cuda = MakeCuda();
    if (!cuda.ok() && NoCudaHere(cuda.status())) {
      GTEST_SKIP() << "no CUDA backend here: " << cuda.status();
    }
    ASSERT_TRUE(cuda.ok()) << "a GPU is visible but the CUDA backend failed: "
                           << cuda.status();
    BackendOptions options;
    options.device_memory_bytes = int64_t{3} << 30;
    auto cpu = Backend::Create(options);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    Init(cpu_, std::move(*cpu));
    Init(cuda_, std::move(*cuda));
  }

  static void Init(Side& side, std::unique_ptr<Backend> backend) {
    absl::Status s = side.Init(std::move(backend));
    ASSERT_TRUE(s.ok()) << s;
  }

  // Runs `op` on both sides; it returns the outputs to compare.
  template <typename Op>
  void RunBoth(Op op, std::vector<float>* cpu_out,
               std::vector<float>* cuda_out) {
    *cpu_out = op(cpu_);
    *cuda_out = op(cuda_);
  }

  // A GEMM on the CUDA side that keeps a stream busy for tens of
  // milliseconds (8192^3, ~1.1 TFLOP in fp32), on buffers of its own.
  // A GEMM that keeps a GPU busy for tens of milliseconds (on the emulation,
  // where a query finds queued work pending anyway, a small one).
  GemmArgs BusyGemm(uint32_t seed) {
    const int64_t gm = kCudaEmulated ? 256 : 8192;
    GemmArgs g;
    g.m = g.n = g.k = gm;
    g.a = g.b = cuda_.Upload(RandomVector(gm * gm, seed));
    g.c = cuda_.Poisoned(gm * gm);
    g.lda = g.ldb = g.ldc = gm;
    return g;
  }

  Side cpu_, cuda_;
};

// ---------------------------------------------------------------------------
// GEMM

struct GemmCase {
  bool ta, tb;
  int64_t m, n, k, pad;
  float beta;
};

class CudaGemmTest : public CudaTwinTest,
                     public ::testing::WithParamInterface<GemmCase> {};

// Tolerance 4 k u (|alpha| sum|a b| + |beta c|): twice the classical fp32
// bound, since each side is within it of the exact result. TF32 (10-bit
// mantissas) would be off by ~1e-3 of that magnitude and fail.
TEST_P(CudaGemmTest, MatchesCpu) {
  const GemmCase gc = GetParam();
  const int64_t a_rows = gc.ta ? gc.k : gc.m, a_cols = gc.ta ? gc.m : gc.k;
  const int64_t b_rows = gc.tb ? gc.n : gc.k, b_cols = gc.tb ? gc.k : gc.n;
  const int64_t lda = a_cols + gc.pad, ldb = b_cols + 2 * gc.pad,
                ldc = gc.n + 3 * gc.pad;
  const std::vector<float> a = RandomVector(std::max<int64_t>(a_rows * lda, 1), 1),
                           bm = RandomVector(std::max<int64_t>(b_rows * ldb, 1), 2),
                           c0 = RandomVector(gc.m * ldc, 3);
  GemmArgs g;
  g.trans_a = gc.ta;
  g.trans_b = gc.tb;
  g.m = gc.m;
  g.n = gc.n;
  g.k = gc.k;
  g.alpha = 1.5f;
  g.beta = gc.beta;
  g.lda = std::max<int64_t>(lda, 1);
  g.ldb = std::max<int64_t>(ldb, 1);
  g.ldc = ldc;
  auto run = [&](Side& side) {
    GemmArgs d = g;
    d.a = side.Upload(a);
    d.b = side.Upload(bm);
    // beta == 0: C must not be read, so start from NaNs.
    float* c = gc.beta == 0.0f ? side.Poisoned(gc.m * ldc) : side.Upload(c0);
    d.c = c;
    EXPECT_TRUE(side.b().Gemm(side.s(), d).ok());
    return side.Download(c, gc.m * ldc);
  };
  std::vector<float> cpu, cuda;
  RunBoth(run, &cpu, &cuda);

  std::vector<double> tol(cpu.size(), 0.0);
  for (int64_t i = 0; i < gc.m; ++i) {
    for (int64_t j = 0; j < gc.n; ++j) {
      double mag = 0;
      for (int64_t p = 0; p < gc.k; ++p) {
        const double av = gc.ta ? a[p * lda + i] : a[i * lda + p];
        const double bv = gc.tb ? bm[j * ldb + p] : bm[p * ldb + j];
        mag += std::abs(av * bv);
      }
      mag = std::abs(g.alpha) * mag +
            (gc.beta == 0.0f ? 0.0 : std::abs(gc.beta * c0[i * ldc + j]));
      tol[i * ldc + j] = 4.0 * std::max<int64_t>(gc.k, 1) * kU * mag;
    }
    // Padding columns: the untouched NaN or sentinel must match exactly
    // (NaN never compares equal, so compare those separately below).
    for (int64_t j = gc.n; j < ldc; ++j) tol[i * ldc + j] = 0.0;
  }
  if (gc.beta == 0.0f) {
    for (int64_t i = 0; i < gc.m; ++i) {
      for (int64_t j = gc.n; j < ldc; ++j) {
        EXPECT_TRUE(std::isnan(cuda[i * ldc + j])) << "padding written";
        cpu[i * ldc + j] = cuda[i * ldc + j] = 0.0f;
      }
    }
  }
  EXPECT_TRUE(Agree(cuda, cpu, tol));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaGemmTest,
    ::testing::Values(GemmCase{false, false, 37, 29, 53, 3, 0.75f},
                      GemmCase{true, false, 37, 29, 53, 3, 0.75f},
                      GemmCase{false, true, 37, 29, 53, 3, 0.75f},
                      GemmCase{true, true, 37, 29, 53, 3, 0.75f},
                      GemmCase{false, false, 3, 1000, 17, 0, 0.0f},
                      GemmCase{true, false, 1000, 3, 17, 1, 0.0f},
                      GemmCase{false, true, 17, 4096, 64, 0, -1.0f},
                      GemmCase{true, true, 257, 129, 300, 5, 0.5f},
                      GemmCase{false, false, 512, 512, 512, 0, 0.0f},
                      GemmCase{false, false, 6, 5, 0, 2, -0.5f},  // k == 0
                      GemmCase{false, false, 6, 5, 0, 2, 0.0f}));

// ---------------------------------------------------------------------------
// Grouped GEMM (the expert compute of a dispatch chunk)

// The GEMMs of one expert-compute step over `rows[g]` rows per expert
// group (some empty), in the shapes the dispatch runs: the forward
// projection x W (rows x H times H x F), the weight gradient x^T dY
// accumulated (beta 1), and the input gradient dY W^T; consecutive groups of
// equal rows (which cuBLAS takes as one group), and k = 0 entries.
struct GroupedProblem {
  std::vector<GemmArgs> gemms;  // pointers as offsets into `in` / `out`
  std::vector<float> in, out0;
  std::vector<double> tol;      // per element of out, 4 k u (magnitude)
};
GroupedProblem MakeGroupedProblem(const std::vector<int64_t>& rows, int64_t H,
                                  int64_t F, uint32_t seed) {
  GroupedProblem pr;
  int64_t in_at = 0, out_at = 0;
  auto take_in = [&](int64_t n) {
    const int64_t at = in_at;
    in_at += n;
    return at;
  };
  auto take_out = [&](int64_t n) {
    const int64_t at = out_at;
    out_at += n;
    return at;
  };
  // Offsets stand in for pointers until a side places the buffers.
  auto off = [](int64_t at) { return reinterpret_cast<float*>(at * sizeof(float)); };
  // By kind, as the dispatch enqueues them: every group's forward
  // projection, then every weight gradient, then every input gradient.
  std::vector<GemmArgs> fwd, dw, dx;
  for (int64_t n : rows) {
    const int64_t x = take_in(std::max<int64_t>(n * H, 1)), w = take_in(H * F),
                  dy = take_in(std::max<int64_t>(n * F, 1));
    // [n, F] = x [n, H] W [H, F]
    fwd.push_back({false, false, n, F, H, 1.0f, off(x), H, off(w), F, 0.0f,
                   off(take_out(std::max<int64_t>(n * F, 1))), F});
    // [H, F] += x^T dY: k = n, 0 for an empty group (C = 1 C)
    dw.push_back({true, false, H, F, n, 1.0f, off(x), H, off(dy), F, 1.0f,
                  off(take_out(H * F)), F});
    // [n, H] = 0.5 dY [n, F] W^T
    dx.push_back({false, true, n, H, F, 0.5f, off(dy), F, off(w), F, 0.0f,
                  off(take_out(std::max<int64_t>(n * H, 1))), H});
  }
  for (const std::vector<GemmArgs>* kind : {&fwd, &dw, &dx}) {
    pr.gemms.insert(pr.gemms.end(), kind->begin(), kind->end());
  }
  pr.in = RandomVector(in_at, seed);
  pr.out0 = RandomVector(out_at, seed + 1);
  pr.tol.assign(out_at, 0.0);
  auto at = [](const float* p) { return reinterpret_cast<uintptr_t>(p) / sizeof(float); };
  for (const GemmArgs& g : pr.gemms) {
    for (int64_t i = 0; i < g.m; ++i) {
      for (int64_t j = 0; j < g.n; ++j) {
        double mag = 0;
        for (int64_t p = 0; p < g.k; ++p) {
          const double av = pr.in[at(g.a) + (g.trans_a ? p * g.lda + i : i * g.lda + p)];
          const double bv = pr.in[at(g.b) + (g.trans_b ? j * g.ldb + p : p * g.ldb + j)];
          mag += std::abs(av * bv);
        }
        const int64_t c = at(g.c) + i * g.ldc + j;
        mag = std::abs(g.alpha) * mag + std::abs(g.beta * pr.out0[c]);
        pr.tol[c] = 4.0 * std::max<int64_t>(g.k, 1) * kU * mag;
      }
    }
  }
  return pr;
}

// The problem's GEMMs with real pointers on `side`: grouped (one call) or
// one Gemm each; returns every output.
std::vector<float> RunGrouped(Side& side, const GroupedProblem& pr, bool grouped) {
  float* in = side.Upload(pr.in);
  float* out = side.Upload(pr.out0);
  std::vector<GemmArgs> gemms = pr.gemms;
  auto place = [](const float* off, float* base) {
    return base + reinterpret_cast<uintptr_t>(off) / sizeof(float);
  };
  for (GemmArgs& g : gemms) {
    g.a = place(g.a, in);
    g.b = place(g.b, in);
    g.c = place(g.c, out);
  }
  if (grouped) {
    EXPECT_TRUE(side.b().GroupedGemm(side.s(), gemms).ok());
  } else {
    for (const GemmArgs& g : gemms) EXPECT_TRUE(side.b().Gemm(side.s(), g).ok());
  }
  return side.Download(out, static_cast<int64_t>(pr.out0.size()));
}

// Expert groups of uneven rows (one empty, runs of equal rows), and more
// GEMMs than one cuBLAS call takes (1024): against the CPU twin, against
// cuBLAS's single GEMMs, and the same bits twice.
TEST_F(CudaTwinTest, GroupedGemmMatchesCpuAndSingleGemms) {
  const std::vector<std::vector<int64_t>> cases = {
      {37, 0, 1, 128, 128, 5, 64, 3, 200},
      std::vector<int64_t>(400, 3),  // 1200 GEMMs: two cuBLAS calls
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("case ", i));
    const GroupedProblem pr = MakeGroupedProblem(cases[i], 48, 80, 60 + i);
    const std::vector<float> cpu = RunGrouped(cpu_, pr, true);
    const std::vector<float> cuda = RunGrouped(cuda_, pr, true);
    EXPECT_TRUE(Agree(cuda, cpu, pr.tol));
    EXPECT_TRUE(Agree(cuda, RunGrouped(cuda_, pr, false), pr.tol));
    EXPECT_TRUE(BitwiseEqual(cuda, RunGrouped(cuda_, pr, true)));
    // The CPU twin is the single GEMMs in order.
    EXPECT_TRUE(BitwiseEqual(cpu, RunGrouped(cpu_, pr, false)));
  }
}

// ---------------------------------------------------------------------------
// Elementwise

class CudaElementwiseTest : public CudaTwinTest,
                            public ::testing::WithParamInterface<int64_t> {};

// Fill, Scale, Add and Mul are one IEEE operation per element: bitwise
// equal, including with out aliasing an input. Axpy may or may not be fused
// into an FMA on either side: within 4u (|y| + |alpha x|).
TEST_P(CudaElementwiseTest, MatchesCpu) {
  const int64_t n = GetParam();
  const std::vector<float> x = RandomVector(n, 4, -3, 3),
                           y = RandomVector(n, 5, -3, 3);
  auto run = [&](Side& side) {
    float* f = side.Poisoned(n);
    float* dx = side.Upload(x);
    float* dy = side.Upload(y);
    float* sum = side.Poisoned(n);
    float* prod = side.Poisoned(n);
    float* alias = side.Upload(x);
    float* axpy = side.Upload(y);
    EXPECT_TRUE(side.b().Fill(side.s(), f, n, 0.1f).ok());
    EXPECT_TRUE(side.b().Add(side.s(), sum, dx, dy, n).ok());
    EXPECT_TRUE(side.b().Mul(side.s(), prod, dx, dy, n).ok());
    EXPECT_TRUE(side.b().Mul(side.s(), alias, alias, dy, n).ok());
    EXPECT_TRUE(side.b().Scale(side.s(), alias, n, -0.37f).ok());
    EXPECT_TRUE(side.b().Add(side.s(), alias, alias, alias, n).ok());
    EXPECT_TRUE(side.b().Axpy(side.s(), axpy, dx, n, 0.77f).ok());
    return side.DownloadAll(
        {{f, n}, {sum, n}, {prod, n}, {alias, n}, {axpy, n}});
  };
  std::vector<float> cpu, cuda;
  RunBoth(run, &cpu, &cuda);
  ASSERT_EQ(cpu.size(), 5 * static_cast<size_t>(n));
  const std::vector<float> exact_cpu(cpu.begin(), cpu.begin() + 4 * n),
      exact_cuda(cuda.begin(), cuda.begin() + 4 * n);
  EXPECT_TRUE(BitwiseEqual(exact_cuda, exact_cpu));
  std::vector<double> tol(n);
  for (int64_t i = 0; i < n; ++i) {
    tol[i] = 4 * kU * (std::abs(y[i]) + std::abs(0.77 * x[i]));
  }
  EXPECT_TRUE(Agree(std::vector<float>(cuda.begin() + 4 * n, cuda.end()),
                    std::vector<float>(cpu.begin() + 4 * n, cpu.end()), tol));
}

// More than one sweep of the largest grid: 2^24 + 3 elements on a GPU
// (2^16 blocks of 256 threads); the emulation's grids stop at 2^8 blocks
// (kernels/cuda/cuda_device_utils.cuh), so 2^16 + 3 does the same there.
constexpr int64_t kPastTheGrid = kCudaEmulated ? (int64_t{1} << 16) + 3 : (int64_t{1} << 24) + 3;
INSTANTIATE_TEST_SUITE_P(Sizes, CudaElementwiseTest,
                         ::testing::Values(1, 7, 1000, 65537, kPastTheGrid));

double SigmoidD(double g) { return 1.0 / (1.0 + std::exp(-g)); }

// SwiGLU: within 24u of the magnitude of the factors (CUDA's expf is within
// 2 ulps, glibc's within 1, and a few roundings follow on each side; for
// dgate the magnitude is s (1 + |g|), see backend_test.cc), plus 1e-37 (below
// FLT_MIN fp32 keeps no relative precision). Gate values include saturated
// ones (exp(-g) overflows fp32).
TEST_P(CudaElementwiseTest, SwiGluMatchesCpu) {
  const int64_t n = GetParam();
  std::vector<float> gate = RandomVector(n, 6, -8, 8);
  const float extremes[] = {-1000.0f, -100.0f, -88.5f, 0.0f, 88.5f, 1000.0f};
  for (int i = 0; i < 6 && i < n; ++i) gate[i] = extremes[i];
  const std::vector<float> up = RandomVector(n, 7, -3, 3),
                           dout = RandomVector(n, 8);
  auto run = [&](Side& side) {
    float* dg = side.Upload(gate);
    float* du = side.Upload(up);
    float* out = side.Poisoned(n);
    float* dgate = side.Poisoned(n);
    float* dup = side.Poisoned(n);
    EXPECT_TRUE(side.b().SwiGluForward(side.s(), out, dg, du, n).ok());
    EXPECT_TRUE(side.b()
                    .SwiGluBackward(side.s(), dgate, dup, side.Upload(dout),
                                    dg, du, n)
                    .ok());
    return side.DownloadAll({{out, n}, {dgate, n}, {dup, n}});
  };
  std::vector<float> cpu, cuda;
  RunBoth(run, &cpu, &cuda);
  std::vector<double> tol(3 * n);
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i], s = SigmoidD(g), u = up[i], d = dout[i];
    tol[i] = 24 * kU * std::abs(g * s * u) + 1e-37;
    tol[n + i] = 24 * kU * std::abs(d * u) * s * (1 + std::abs(g)) + 1e-37;
    tol[2 * n + i] = 24 * kU * std::abs(d * g * s) + 1e-37;
  }
  EXPECT_TRUE(Agree(cuda, cpu, tol));
}

// ---------------------------------------------------------------------------
// Row-wise

struct RowShape {
  int64_t rows, cols;
};

class CudaRowsTest : public CudaTwinTest,
                     public ::testing::WithParamInterface<RowShape> {};

// RMSNorm forward: out within 8u |out|, rstd within 8u. Backward: dx within
// 2e-5 of r|dout w| + |x| r^3/cols sum|dout w x|; dweight (accumulated onto
// dw0) within 2e-5 sum_r |dout x r| + 4u |dw0|.
TEST_P(CudaRowsTest, RmsNormMatchesCpu) {
  const auto [rows, cols] = GetParam();
  const std::vector<float> x = RandomVector(rows * cols, 9, -2, 2),
                           w = RandomVector(cols, 10, 0.5, 1.5),
                           dout = RandomVector(rows * cols, 11),
                           dw0 = RandomVector(cols, 12);
  auto run = [&](Side& side) {
    float* dxin = side.Upload(x);
    float* dw = side.Upload(w);
    float* out = side.Poisoned(rows * cols);
    float* rstd = side.Poisoned(rows);
    float* dx = side.Poisoned(rows * cols);
    float* dweight = side.Upload(dw0);
    EXPECT_TRUE(side.b()
                    .RmsNormForward(side.s(), out, rstd, dxin, dw, rows, cols,
                                    1e-5f)
                    .ok());
    EXPECT_TRUE(side.b()
                    .RmsNormBackward(side.s(), dx, dweight, side.Upload(dout),
                                     dxin, dw, rstd, rows, cols)
                    .ok());
    return side.DownloadAll(
        {{out, rows * cols}, {rstd, rows}, {dx, rows * cols}, {dweight, cols}});
  };
  std::vector<float> cpu, cuda;
  RunBoth(run, &cpu, &cuda);
  ASSERT_EQ(cpu.size(), static_cast<size_t>(2 * rows * cols + rows + cols));
  const float* rstd = cpu.data() + rows * cols;
  std::vector<double> tol(cpu.size());
  for (int64_t i = 0; i < rows * cols; ++i) tol[i] = 8 * kU * std::abs(cpu[i]);
  for (int64_t r = 0; r < rows; ++r) tol[rows * cols + r] = 8 * kU * rstd[r];
  double* tol_dx = tol.data() + rows * cols + rows;
  double* tol_dw = tol_dx + rows * cols;
  for (int64_t c = 0; c < cols; ++c) tol_dw[c] = 4 * kU * std::abs(dw0[c]);
  for (int64_t r = 0; r < rows; ++r) {
    const double rs = rstd[r];
    double abs_dot = 0;
    for (int64_t c = 0; c < cols; ++c) {
      abs_dot += std::abs(double{dout[r * cols + c]} * w[c] * x[r * cols + c]);
    }
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t k = r * cols + c;
      tol_dx[k] = 2e-5 * (rs * std::abs(double{dout[k]} * w[c]) +
                          std::abs(x[k]) * rs * rs * rs * abs_dot / cols);
      tol_dw[c] += 2e-5 * std::abs(double{dout[k]} * x[k] * rs);
    }
  }
  EXPECT_TRUE(Agree(cuda, cpu, tol));
}

// Softmax within 4u (|x - max| + 4) y + 1e-30 (CUDA's expf is within 2
// ulps, glibc's within 1; x - max is the same fp32 operation on both sides);
// log-sum-exp within 8u (|lse| + 1). Also in place (y aliasing x).
TEST_P(CudaRowsTest, SoftmaxAndLogSumExpMatchCpu) {
  const auto [rows, cols] = GetParam();
  std::vector<float> x = RandomVector(rows * cols, 13, -10, 10);
  for (int64_t r = 0; r < rows; ++r) x[r * cols] += 40.0f * (r % 3);
  auto run = [&](Side& side) {
    float* dx = side.Upload(x);
    float* y = side.Poisoned(rows * cols);
    float* lse = side.Poisoned(rows);
    EXPECT_TRUE(side.b().SoftmaxRows(side.s(), y, dx, rows, cols).ok());
    EXPECT_TRUE(side.b().LogSumExpRows(side.s(), lse, dx, rows, cols).ok());
    EXPECT_TRUE(side.b().SoftmaxRows(side.s(), dx, dx, rows, cols).ok());
    return side.DownloadAll({{y, rows * cols}, {lse, rows}, {dx, rows * cols}});
  };
  std::vector<float> cpu, cuda;
  RunBoth(run, &cpu, &cuda);
  std::vector<double> tol(cpu.size());
  for (int64_t r = 0; r < rows; ++r) {
    float mx = -INFINITY;
    for (int64_t c = 0; c < cols; ++c) mx = std::max(mx, x[r * cols + c]);
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t k = r * cols + c;
      tol[k] = 4 * kU * (std::abs(double{x[k]} - mx) + 4) * cpu[k] + 1e-30;
      tol[rows * cols + rows + k] = tol[k];
    }
    tol[rows * cols + r] = 8 * kU * (std::abs(cpu[rows * cols + r]) + 1);
  }
  EXPECT_TRUE(Agree(cuda, cpu, tol));
}

// 2 x 600000: wider than the dweight scratch holds (one pass, no partials);
// 40000 x 8: the most row chunks; 70000 x 2: more rows than the row grid.
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaRowsTest,
    ::testing::Values(RowShape{1, 1}, RowShape{3, 1000}, RowShape{1000, 3},
                      RowShape{17, 4096}, RowShape{64, 257},
                      RowShape{2, 600000}, RowShape{kCudaEmulated ? 4000 : 40000, 8},
                      // More rows than blocks: 2^16 on a GPU, 2^8 emulated.
                      RowShape{kCudaEmulated ? 300 : 70000, 2}));

// Values far outside exp's fp32 range stay finite and agree.
TEST_F(CudaTwinTest, SoftmaxAndLogSumExpAtExtremes) {
  const float big = 1e30f, huge = 3e38f;
  const std::vector<float> x = {big,  -big,  0,    5,    -big, -big,
                                -big, -big,  88,   89,   90,   -big,
                                huge, -huge, 0,    0,    -100, -101,
                                -big, -big};
  const int64_t rows = 5, cols = 4;
  auto run = [&](Side& side) {
    float* dx = side.Upload(x);
    float* y = side.Poisoned(rows * cols);
    float* lse = side.Poisoned(rows);
    EXPECT_TRUE(side.b().SoftmaxRows(side.s(), y, dx, rows, cols).ok());
    EXPECT_TRUE(side.b().LogSumExpRows(side.s(), lse, dx, rows, cols).ok());
    return side.DownloadAll({{y, rows * cols}, {lse, rows}});
  };
  std::vector<float> cpu, cuda;
  RunBoth(run, &cpu, &cuda);
  // Tolerances as in SoftmaxAndLogSumExpMatchCpu.
  std::vector<double> tol(cpu.size());
  for (int64_t r = 0; r < rows; ++r) {
    float mx = -INFINITY;
    for (int64_t c = 0; c < cols; ++c) mx = std::max(mx, x[r * cols + c]);
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t k = r * cols + c;
      tol[k] = 4 * kU * (std::abs(double{x[k]} - mx) + 4) * cpu[k] + 1e-30;
    }
    tol[rows * cols + r] = 8 * kU * (std::abs(cpu[rows * cols + r]) + 1);
  }
  EXPECT_TRUE(Agree(cuda, cpu, tol));
  for (float v : cuda) EXPECT_TRUE(std::isfinite(v));
}

// ---------------------------------------------------------------------------
// Reductions and AdamW

class CudaReduceTest : public CudaTwinTest,
                       public ::testing::WithParamInterface<int64_t> {};

// Both sides sum in double and round once: within 2u |result| (one ulp) +
// 1e-12 sum|x|.
TEST_P(CudaReduceTest, SumAndSumSquaresMatchCpu) {
  const int64_t n = GetParam();
  const std::vector<float> x = RandomVector(n, 14, -1, 3);
  auto run = [&](Side& side) {
    float* dx = n > 0 ? side.Upload(x) : nullptr;
    float* out = side.Poisoned(2);
    EXPECT_TRUE(side.b().Sum(side.s(), out, dx, n).ok());
    EXPECT_TRUE(side.b().SumSquares(side.s(), out + 1, dx, n).ok());
    return side.Download(out, 2);
  };
  std::vector<float> cpu, cuda;
  RunBoth(run, &cpu, &cuda);
  double abs_sum = 0, sq = 0;
  for (float v : x) {
    abs_sum += std::abs(v);
    sq += double{v} * v;
  }
  EXPECT_TRUE(Agree(cuda, cpu,
                    {2 * kU * std::abs(cpu[0]) + 1e-12 * abs_sum,
                     2 * kU * std::abs(cpu[1]) + 1e-12 * sq}));
}

// 10^7 + 1: more than the largest reduction grid takes in one sweep.
INSTANTIATE_TEST_SUITE_P(Sizes, CudaReduceTest,
                         ::testing::Values(0, 1, 7, 1000, (1 << 20) + 3,
                                           10000001));

// Ten steps, fresh gradients each; the same scalars go to both kernels, so
// only FMA contraction differs: param within 8u t |p| + 2e-4 lr, m within
// 8u (|m| + max|g|), v within 16u |v| + 1e-30.
TEST_F(CudaTwinTest, AdamWMatchesCpuOverSeveralSteps) {
  const int64_t n = 100003;
  AdamWArgs args;
  args.lr = 2e-3f;
  args.beta2 = 0.95f;
  args.weight_decay = 0.1f;
  args.grad_scale = 0.25f;
  const std::vector<float> p0 = RandomVector(n, 15);
  float* param[2];
  float* m[2];
  float* v[2];
  Side* sides[2] = {&cpu_, &cuda_};
  for (int i = 0; i < 2; ++i) {
    param[i] = sides[i]->Upload(p0);
    m[i] = sides[i]->Upload(std::vector<float>(n, 0.0f));
    v[i] = sides[i]->Upload(std::vector<float>(n, 0.0f));
  }
  double max_g = 0;
  for (int64_t t = 1; t <= 10; ++t) {
    SCOPED_TRACE(absl::StrCat("step ", t));
    const std::vector<float> grad = RandomVector(n, 100 + t, -3, 3);
    for (float g : grad) max_g = std::max(max_g, std::abs(g * 0.25));
    args.step = t;
    std::vector<float> got[2];
    for (int i = 0; i < 2; ++i) {
      Side& side = *sides[i];
      ASSERT_TRUE(side.b()
                      .AdamW(side.s(), param[i], side.Upload(grad), m[i], v[i],
                             n, args)
                      .ok());
      got[i] = side.DownloadAll({{param[i], n}, {m[i], n}, {v[i], n}});
    }
    std::vector<double> tol(3 * n);
    for (int64_t j = 0; j < n; ++j) {
      tol[j] = 8 * kU * t * std::abs(got[0][j]) + 2e-4 * args.lr;
      tol[n + j] = 8 * kU * (std::abs(got[0][n + j]) + max_g);
      tol[2 * n + j] = 16 * kU * got[0][2 * n + j] + 1e-30;
    }
    EXPECT_TRUE(Agree(got[1], got[0], tol));
  }
}

// ---------------------------------------------------------------------------
// Determinism: two runs on the GPU give the same bits.

TEST_F(CudaTwinTest, ReductionsNormsAndGemmAreBitwiseReproducible) {
  const int64_t rows = kCudaEmulated ? 4000 : 40000, cols = 64, n = rows * cols;
  const std::vector<float> x = RandomVector(n, 16), w = RandomVector(cols, 17),
                           dout = RandomVector(n, 18);
  Side& g = cuda_;
  float* dx = g.Upload(x);
  float* dw = g.Upload(w);
  float* dd = g.Upload(dout);
  auto run = [&]() {
    float* rstd = g.Poisoned(rows);
    float* out = g.Poisoned(n);
    float* gx = g.Poisoned(n);
    float* gw = g.Upload(std::vector<float>(cols, 0.0f));
    float* sums = g.Poisoned(2);
    float* lse = g.Poisoned(rows);
    float* c = g.Poisoned(cols * cols);
    GemmArgs ga;
    ga.trans_a = true;  // dW-shaped: x^T dout, a long inner dimension
    ga.m = ga.n = cols;
    ga.k = rows;
    ga.a = dx;
    ga.lda = cols;
    ga.b = dd;
    ga.ldb = cols;
    ga.c = c;
    ga.ldc = cols;
    EXPECT_TRUE(g.b().RmsNormForward(g.s(), out, rstd, dx, dw, rows, cols, 1e-5f).ok());
    EXPECT_TRUE(g.b().RmsNormBackward(g.s(), gx, gw, dd, dx, dw, rstd, rows, cols).ok());
    EXPECT_TRUE(g.b().Sum(g.s(), sums, dx, n).ok());
    EXPECT_TRUE(g.b().SumSquares(g.s(), sums + 1, dx, n).ok());
    EXPECT_TRUE(g.b().LogSumExpRows(g.s(), lse, dx, rows, cols).ok());
    EXPECT_TRUE(g.b().Gemm(g.s(), ga).ok());
    return g.DownloadAll({{out, n},
                          {gx, n},
                          {gw, cols},
                          {sums, 2},
                          {lse, rows},
                          {c, cols * cols}});
  };
  const std::vector<float> first = run(), second = run();
  EXPECT_TRUE(BitwiseEqual(first, second));
}

// Two host threads enqueue onto one stream at once: RmsNormBackward (whose
// two dweight kernels share the stream's scratch) and Sum (which uses the
// same scratch). Launches onto a stream are serialised, so neither can land
// between the other's kernels; the results equal a one-thread run.
TEST_F(CudaTwinTest, TwoThreadsOnOneStream) {
  const int64_t rows = 4096, cols = 512, n = rows * cols;
  const std::vector<float> x = RandomVector(n, 19), w = RandomVector(cols, 20),
                           dout = RandomVector(n, 21);
  Side& g = cuda_;
  float* dx = g.Upload(x);
  float* dw = g.Upload(w);
  float* dd = g.Upload(dout);
  float* rstd = g.Poisoned(rows);
  float* out = g.Poisoned(n);
  ASSERT_TRUE(g.b().RmsNormForward(g.s(), out, rstd, dx, dw, rows, cols, 1e-5f).ok());
  constexpr int kReps = kCudaEmulated ? 8 : 50;
  float* gx = g.Poisoned(n);
  std::vector<float*> gws, sums;
  for (int i = 0; i < kReps; ++i) {
    gws.push_back(g.Upload(std::vector<float>(cols, 0.0f)));
    sums.push_back(g.Poisoned(1));
  }
  std::atomic<bool> ok{true};
  std::thread norms([&] {
    for (int i = 0; i < kReps; ++i) {
      ok = ok && g.b().RmsNormBackward(g.s(), gx, gws[i], dd, dx, dw, rstd,
                                       rows, cols).ok();
    }
  });
  std::thread reduce([&] {
    for (int i = 0; i < kReps; ++i) {
      ok = ok && g.b().Sum(g.s(), sums[i], dd, n).ok();
    }
  });
  norms.join();
  reduce.join();
  ASSERT_TRUE(ok);
  const std::vector<float> gw0 = g.Download(gws[0], cols);
  const std::vector<float> s0 = g.Download(sums[0], 1);
  for (int i = 1; i < kReps; ++i) {
    EXPECT_TRUE(BitwiseEqual(g.Download(gws[i], cols), gw0)) << "rep " << i;
    EXPECT_TRUE(BitwiseEqual(g.Download(sums[i], 1), s0)) << "rep " << i;
  }
}

// ---------------------------------------------------------------------------
// Copies, streams and events on the GPU

// Pinned host -> device -> device -> pinned host, odd sizes, bitwise; and
// pageable host memory as a source and destination too.
TEST_F(CudaTwinTest, PinnedHostDeviceCopiesRoundTrip) {
  Backend& b = cuda_.b();
  Stream& s = cuda_.s();
  for (size_t bytes : {size_t{1}, size_t{1000003}, size_t{64} << 20}) {
    SCOPED_TRACE(absl::StrCat("bytes=", bytes));
    auto src = b.host().Allocate(LiveSet::kCheckpoints, bytes);
    auto dst = b.host().Allocate(LiveSet::kCheckpoints, bytes);
    auto d1 = b.device().Allocate(LiveSet::kCheckpoints, bytes);
    auto d2 = b.device().Allocate(LiveSet::kCheckpoints, bytes);
    ASSERT_TRUE(src.ok() && dst.ok() && d1.ok() && d2.ok());
    std::mt19937 rng(static_cast<uint32_t>(bytes));
    for (size_t i = 0; i < bytes; ++i) {
      src->as<unsigned char>()[i] = static_cast<unsigned char>(rng());
    }
    std::memset(dst->data(), 0, bytes);
    ASSERT_TRUE(b.Copy(s, d1->data(), src->data(), bytes).ok());
    ASSERT_TRUE(b.Copy(s, d2->data(), d1->data(), bytes).ok());
    ASSERT_TRUE(b.Copy(s, dst->data(), d2->data(), bytes).ok());
    ASSERT_TRUE(s.Synchronize().ok());
    EXPECT_EQ(std::memcmp(src->data(), dst->data(), bytes), 0);

    std::vector<unsigned char> pageable(bytes, 0);
    ASSERT_TRUE(b.Copy(s, pageable.data(), d1->data(), bytes).ok());
    ASSERT_TRUE(s.Synchronize().ok());
    EXPECT_EQ(std::memcmp(src->data(), pageable.data(), bytes), 0);
  }
  EXPECT_NE(s.native_handle(), nullptr);
}

// h->d on a copy stream, compute, d->h, all ordered by events only. The copy
// stream first waits for a long GEMM on a third stream, so an ignored Wait
// would let the compute stream scale the buffer before the data arrived.
// Meanwhile a small copy on a fourth stream finishes while that GEMM still
// runs: the streams overlap.
TEST_F(CudaTwinTest, StreamsOrderedByEventsAndOverlapping) {
  Backend& b = cuda_.b();
  auto copy = b.CreateStream("copy");
  auto blocker = b.CreateStream("blocker");
  auto side = b.CreateStream("side");
  ASSERT_TRUE(copy.ok() && blocker.ok() && side.ok());
  auto ev_blocked = b.CreateEvent(), ev_h2d = b.CreateEvent(),
       ev_scaled = b.CreateEvent(), ev_side = b.CreateEvent();
  ASSERT_TRUE(ev_blocked.ok() && ev_h2d.ok() && ev_scaled.ok() && ev_side.ok());

  const GemmArgs g = BusyGemm(22);

  const int64_t n = int64_t{64} << 20;  // 256 MiB
  const size_t bytes = n * sizeof(float);
  auto host_in = b.host().Allocate(LiveSet::kCheckpoints, bytes);
  auto host_out = b.host().Allocate(LiveSet::kCheckpoints, bytes);
  auto dev = b.device().Allocate(LiveSet::kCheckpoints, bytes);
  auto small_h = b.host().Allocate(LiveSet::kCheckpoints, 4096);
  auto small_d = b.device().Allocate(LiveSet::kCheckpoints, 4096);
  ASSERT_TRUE(host_in.ok() && host_out.ok() && dev.ok() && small_h.ok() &&
              small_d.ok());
  for (int64_t i = 0; i < n; ++i) {
    host_in->as<float>()[i] = static_cast<float>(i % 1000) * 0.25f;
    host_out->as<float>()[i] = kNaN;
  }

  ASSERT_TRUE(b.Gemm(**blocker, g).ok());
  ASSERT_TRUE((*blocker)->Record(**ev_blocked).ok());
  ASSERT_TRUE((*copy)->Wait(**ev_blocked).ok());
  ASSERT_TRUE(b.Copy(**copy, dev->data(), host_in->data(), bytes).ok());
  ASSERT_TRUE((*copy)->Record(**ev_h2d).ok());
  ASSERT_TRUE(cuda_.s().Wait(**ev_h2d).ok());
  ASSERT_TRUE(b.Scale(cuda_.s(), dev->as<float>(), n, 2.0f).ok());
  ASSERT_TRUE(cuda_.s().Record(**ev_scaled).ok());
  ASSERT_TRUE((*copy)->Wait(**ev_scaled).ok());
  ASSERT_TRUE(b.Copy(**copy, host_out->data(), dev->data(), bytes).ok());

  ASSERT_TRUE(b.Copy(**side, small_d->data(), small_h->data(), 4096).ok());
  ASSERT_TRUE((*side)->Record(**ev_side).ok());
  ASSERT_TRUE((*ev_side)->Synchronize().ok());
  EXPECT_FALSE((*ev_blocked)->Done())
      << "a small copy on another stream waited for the GEMM";

  ASSERT_TRUE((*copy)->Synchronize().ok());
  EXPECT_TRUE((*ev_blocked)->Done() && (*ev_h2d)->Done() &&
              (*ev_scaled)->Done());
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (host_out->as<float>()[i] != 2.0f * host_in->as<float>()[i]) ++wrong;
  }
  EXPECT_EQ(wrong, 0);
  ASSERT_TRUE((*blocker)->Synchronize().ok());
}

// The phase clock (kernels/phase_clock.h) on CUDA's timing events: a phase
// whose stream runs a GEMM takes time on the device although the host
// issued it at once, the phases fit inside the host's span, and events made
// without timing are refused with a status.
TEST_F(CudaTwinTest, ThePhaseClockTimesAPhaseWhereItsStreamRunsIt) {
  Backend& b = cuda_.b();
  auto busy = b.CreateStream("busy");
  auto idle = b.CreateStream("idle");
  ASSERT_TRUE(busy.ok() && idle.ok());
  const GemmArgs g = BusyGemm(31);
  auto clock = PhaseClock::Create(b, {busy->get(), idle->get()}, /*boundaries=*/2);
  ASSERT_TRUE(clock.ok()) << clock.status();

  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE((*clock)->Start().ok());
  (*clock)->EndPhase(StepPhase::kEmbedding, 0);
  ASSERT_TRUE(b.Gemm(**busy, g).ok());
  (*clock)->EndPhase(StepPhase::kForward, 0);
  auto phases = (*clock)->Read();
  const double host_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(phases.ok()) << phases.status();
  ASSERT_EQ(phases->size(), 2u);
  EXPECT_EQ((*phases)[1].kind, StepPhase::kForward);
  EXPECT_GE((*phases)[0].seconds, 0.0);
  EXPECT_GT((*phases)[1].seconds, 0.0) << "the GEMM's phase";
  EXPECT_LE((*phases)[0].seconds + (*phases)[1].seconds, host_s);

  auto plain = b.CreateEvent();
  auto timed = b.CreateTimingEvent();
  ASSERT_TRUE(plain.ok() && timed.ok());
  ASSERT_TRUE((*busy)->Record(**plain).ok());
  ASSERT_TRUE((*busy)->Record(**timed).ok());
  ASSERT_TRUE((*busy)->Synchronize().ok());
  EXPECT_EQ((*timed)->SecondsSince(**plain).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*plain)->SecondsSince(**timed).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*timed)->SecondsSince(**timed).ok());
  // A later kernel launch sees no error left behind.
  ASSERT_TRUE(b.Gemm(**busy, g).ok());
  EXPECT_TRUE((*busy)->Synchronize().ok());
}

// backend.h: with the caller's own (pageable) memory on either side, a copy
// is complete when Copy returns — visible to every stream, not only to its
// own. A stream busy with a GEMM (tens of milliseconds) copies a
// std::vector in; another stream, with no event between them, reads the
// buffer back at once. cudaMemcpyAsync alone returns once the vector is
// staged and lands the bytes after the GEMM: the reader then saw the poison
// (the race PipelinedLLEP's plan had, a count copied in on the compute
// stream and all-reduced on the communication stream).
TEST_F(CudaTwinTest, PageableCopiesAreCompleteForEveryStreamWhenCopyReturns) {
  Backend& b = cuda_.b();
  auto busy = b.CreateStream("busy");
  auto other = b.CreateStream("other");
  ASSERT_TRUE(busy.ok() && other.ok());
  const GemmArgs g = BusyGemm(23);
  const std::vector<float> in = RandomVector(1024, 24);
  float* dev = cuda_.Poisoned(1024);
  ASSERT_TRUE(b.Gemm(**busy, g).ok());
  ASSERT_TRUE(b.Copy(**busy, dev, in.data(), in.size() * sizeof(float)).ok());
  std::vector<float> out(in.size(), 0.0f);
  ASSERT_TRUE(b.Copy(**other, out.data(), dev, out.size() * sizeof(float)).ok());
  EXPECT_EQ(out, in);
  ASSERT_TRUE((*busy)->Synchronize().ok());
}

// A stream or event of the other backend is refused, naming it.
TEST_F(CudaTwinTest, ForeignStreamsAndEventsAreRefused) {
  float* x = cuda_.Poisoned(4);
  absl::Status s = cuda_.b().Fill(cpu_.s(), x, 4, 1.0f);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("does not belong to the CUDA backend"));
  auto cpu_event = cpu_.b().CreateEvent();
  ASSERT_TRUE(cpu_event.ok());
  s = cuda_.s().Record(**cpu_event);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("needs a CUDA event"));
  EXPECT_THAT(cuda_.b().Describe(), HasSubstr("cuda ("));
}

// ---------------------------------------------------------------------------
// Device memory

// The cap: the device space refuses past BackendOptions.device_memory_bytes
// and names the live set that asked and what is live. The streams'
// workspaces are outside it (the headroom beside the plan, cuda_backend.h):
// with two streams made, the whole cap is still there for planned buffers.
TEST_F(CudaTwinTest, DeviceCapIsEnforcedAndTheWorkspacesAreOutsideIt) {
  auto capped = MakeCuda(int64_t{256} << 20);
  ASSERT_TRUE(capped.ok()) << capped.status();
  Backend& b = **capped;
  auto stream = b.CreateStream("compute");  // takes its workspace
  ASSERT_TRUE(stream.ok()) << stream.status();
  auto comm = b.CreateStream("comm");
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ(b.device().tracker().current(LiveSet::kWorkspace), 0);
  auto weights = b.device().Allocate(LiveSet::kWeights, 200 << 20);
  ASSERT_TRUE(weights.ok()) << weights.status();
  auto acts = b.device().Allocate(LiveSet::kActivations, 56 << 20);  // the rest, exactly
  ASSERT_TRUE(acts.ok()) << acts.status();
  auto more = b.device().Allocate(LiveSet::kActivations, 1 << 20);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string msg(more.status().message());
  EXPECT_THAT(msg, HasSubstr("live set 'activations' asked for 1048576 bytes"));
  EXPECT_THAT(msg, HasSubstr("weights=209715200"));
  acts->Release();
  more = b.device().Allocate(LiveSet::kActivations, 1 << 20);
  EXPECT_TRUE(more.ok()) << more.status();
  more->Release();
  weights->Release();
  // The stream computes with its workspace: a GEMM through cuBLAS, ones
  // times ones, k = 64.
  const int64_t n = 64;
  auto x = b.device().Allocate(LiveSet::kWorkspace, 3 * n * n * sizeof(float));
  ASSERT_TRUE(x.ok());
  float* ones = x->as<float>();
  GemmArgs g;
  g.m = g.n = g.k = n;
  g.a = g.b = ones;
  g.c = ones + 2 * n * n;
  g.lda = g.ldb = g.ldc = n;
  ASSERT_TRUE(b.Fill(**stream, ones, 2 * n * n, 1.0f).ok());
  ASSERT_TRUE(b.Gemm(**stream, g).ok());
  std::vector<float> c(n * n, 0.0f);
  ASSERT_TRUE(b.Copy(**stream, c.data(), g.c, c.size() * sizeof(float)).ok());
  EXPECT_EQ(c.front(), 64.0f);
  EXPECT_EQ(c.back(), 64.0f);
  x->Release();
  comm->reset();
  stream->reset();
}

// A copy stream (SCO's, OffloadStreamAdamW's two) copies and orders by
// events, and takes no cuBLAS workspace (32 MiB on Hopper, in no plan) as
// a compute stream does; a GEMM or a reduction on it is refused, naming it.
TEST_F(CudaTwinTest, ACopyStreamTakesNoWorkspaceAndRefusesCompute) {
  Backend& b = cuda_.b();
  const auto reserved = [&]() -> int64_t {
    absl::StatusOr<DeviceView> v = b.QueryDevice();
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? v->pool_reserved_bytes : -1;
  };
  const int64_t before = reserved();
  auto copy = b.CreateStream("copy", StreamUse::kCopy);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(reserved(), before) << "a copy stream took device memory";
  auto compute = b.CreateStream("compute");
  ASSERT_TRUE(compute.ok()) << compute.status();
  EXPECT_GE(reserved(), before + (int64_t{4} << 20)) << "a compute stream's workspace";

  const int64_t n = 16;
  auto x = b.device().Allocate(LiveSet::kWorkspace, 4 * n * n * sizeof(float));
  ASSERT_TRUE(x.ok()) << x.status();
  float* d = x->as<float>();
  std::vector<float> ones(2 * n * n, 1.0f), back(2 * n * n, 0.0f);
  ASSERT_TRUE(b.Copy(**copy, d, ones.data(), ones.size() * sizeof(float)).ok());
  ASSERT_TRUE(b.Copy(**copy, back.data(), d, back.size() * sizeof(float)).ok());
  ASSERT_TRUE((*copy)->Synchronize().ok());
  EXPECT_EQ(back, ones);
  GemmArgs g;
  g.m = g.n = g.k = n;
  g.a = g.b = d;
  g.c = d + 2 * n * n;
  g.lda = g.ldb = g.ldc = n;
  const absl::Status gemm = b.Gemm(**copy, g);
  EXPECT_EQ(gemm.code(), absl::StatusCode::kFailedPrecondition) << gemm;
  EXPECT_THAT(std::string(gemm.message()), HasSubstr("stream 'copy': a copy stream (StreamUse::kCopy)"));
  // The refusal is the copy stream's error from then on (stream.h).
  EXPECT_EQ((*copy)->Synchronize().code(), absl::StatusCode::kFailedPrecondition);
  // The grouped GEMMs too, on fresh copy streams (a refusal is sticky), and
  // before they enqueue anything: their device pointer arrays live in the
  // workspace a copy stream lacks, so writing them first was a write to an
  // address near 0 (on a GPU a fault that ends the process's context).
  // Aligned, same-shape entries, so that they would take the grouped call.
  GemmArgs g2 = g;
  g2.c = d + 3 * n * n;  // outputs must not overlap
  const std::vector<GemmArgs> two = {g, g2};
  auto copy_grouped = b.CreateStream("copy-grouped", StreamUse::kCopy);
  ASSERT_TRUE(copy_grouped.ok()) << copy_grouped.status();
  const absl::Status grouped = b.GroupedGemm(**copy_grouped, two);
  EXPECT_EQ(grouped.code(), absl::StatusCode::kFailedPrecondition) << grouped;
  EXPECT_THAT(std::string(grouped.message()), HasSubstr("stream 'copy-grouped': a copy stream"));
  GemmBf16Args h;
  h.m = h.n = h.k = n;
  h.a = h.b = reinterpret_cast<const Bf16*>(d);
  h.c = reinterpret_cast<Bf16*>(d + 2 * n * n);
  h.lda = h.ldb = h.ldc = n;
  GemmBf16Args h2 = h;
  h2.c = reinterpret_cast<Bf16*>(d + 3 * n * n);
  const std::vector<GemmBf16Args> two_bf16 = {h, h2};
  auto copy_grouped_bf16 = b.CreateStream("copy-grouped-bf16", StreamUse::kCopy);
  ASSERT_TRUE(copy_grouped_bf16.ok()) << copy_grouped_bf16.status();
  const absl::Status grouped_bf16 = b.GroupedGemmBf16(**copy_grouped_bf16, two_bf16);
  EXPECT_EQ(grouped_bf16.code(), absl::StatusCode::kFailedPrecondition) << grouped_bf16;
  EXPECT_THAT(std::string(grouped_bf16.message()), HasSubstr("stream 'copy-grouped-bf16': a copy stream"));
  // The compute stream runs the same GEMM.
  ASSERT_TRUE(b.Gemm(**compute, g).ok());
  std::vector<float> c(n * n, 0.0f);
  ASSERT_TRUE(b.Copy(**compute, c.data(), g.c, c.size() * sizeof(float)).ok());
  EXPECT_EQ(c.front(), static_cast<float>(n));
  x->Release();
  copy->reset();
  copy_grouped->reset();
  copy_grouped_bf16->reset();
  compute->reset();
}

// Without a cap, the device pool itself refuses an impossible size: the
// error is RESOURCE_EXHAUSTED with the GPU's free bytes, and the backend
// still works afterwards (the failed call's error does not leak into later
// checks).
TEST_F(CudaTwinTest, CudaMallocRefusalIsReportedAndHarmless) {
  auto huge = cuda_.b().device().Allocate(LiveSet::kDispatch, size_t{1} << 50);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string msg(huge.status().message());
  EXPECT_THAT(msg, HasSubstr("live set 'dispatch'"));
  EXPECT_THAT(msg, HasSubstr("the device pool refused"));
  EXPECT_THAT(msg, HasSubstr("bytes free of"));

  const int64_t n = 1000;
  float* x = cuda_.Poisoned(n);
  float* out = cuda_.Poisoned(1);
  ASSERT_TRUE(cuda_.b().Fill(cuda_.s(), x, n, 0.5f).ok());
  ASSERT_TRUE(cuda_.b().Sum(cuda_.s(), out, x, n).ok());
  EXPECT_EQ(cuda_.Download(out, 1)[0], 500.0f);
}

#ifdef PLATEAU_WITH_CUDA
// Errors are sticky per stream (stream.h), whoever reports them: here the
// stream is failed the way the NCCL watchdog fails it. Later work on it is
// skipped, Synchronize returns the first error (not a later one), events
// recorded after the failure still complete, and other streams go on.
TEST_F(CudaTwinTest, AFailedStreamSkipsLaterWorkAndKeepsItsFirstError) {
  auto other = cuda_.b().CreateStream("other");
  ASSERT_TRUE(other.ok()) << other.status();
  const int64_t n = 256;
  float* x = cuda_.Poisoned(n);  // NaN, on the compute stream
  ASSERT_TRUE(cuda_.s().Synchronize().ok());
  const void* handle = (*other)->native_handle();
  ASSERT_NE(handle, nullptr);
  (void)FailCudaStream(handle, absl::DeadlineExceededError("first"));
  (void)FailCudaStream(handle, absl::InternalError("second"));
  EXPECT_TRUE(cuda_.b().Fill(**other, x, n, 1.0f).ok());  // skipped
  auto event = cuda_.b().CreateEvent();
  ASSERT_TRUE(event.ok()) << event.status();
  ASSERT_TRUE((*other)->Record(**event).ok());
  EXPECT_TRUE((*event)->Synchronize().ok());
  absl::Status s = (*other)->Synchronize();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(s.message(), "first");
  const std::vector<float> got = cuda_.Download(x, n);
  EXPECT_TRUE(std::isnan(got[0]) && std::isnan(got[n - 1]))
      << "the skipped Fill ran";
  other->reset();  // its handle is forgotten; a new stream starts clean
  auto fresh = cuda_.b().CreateStream("fresh");
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_TRUE((*fresh)->Synchronize().ok());
}
#endif  // PLATEAU_WITH_CUDA

// Releases are stream-ordered, not synchronising: a buffer released while
// queued GEMMs still read it must not be handed to a new allocation that
// another stream overwrites at once. The release returns without waiting;
// the product must still be exact (bitwise the product computed alone).
TEST_F(CudaTwinTest, AReleasedBufferIsNotReusedUnderQueuedWork) {
  const int64_t n = kCudaEmulated ? 256 : 2048;
  const size_t bytes = n * n * sizeof(float);
  auto other = cuda_.b().CreateStream("other");
  ASSERT_TRUE(other.ok()) << other.status();
  const float* a = cuda_.Upload(RandomVector(n * n, 71));
  const float* w = cuda_.Upload(RandomVector(n * n, 72));
  float* c = cuda_.Poisoned(n * n);
  GemmArgs g;
  g.m = g.n = g.k = n;
  g.lda = g.ldb = g.ldc = n;
  g.b = w;
  g.c = c;
  g.a = a;
  ASSERT_TRUE(cuda_.b().Gemm(cuda_.s(), g).ok());
  const std::vector<float> want = cuda_.Download(c, n * n);

  auto x = cuda_.b().device().Allocate(LiveSet::kActivations, bytes);
  ASSERT_TRUE(x.ok()) << x.status();
  ASSERT_TRUE(cuda_.b().Copy(cuda_.s(), x->data(), a, bytes).ok());
  g.a = x->as<float>();
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(cuda_.b().Gemm(cuda_.s(), g).ok());
  x->Release();  // the GEMMs above are still queued
  auto z = cuda_.b().device().Allocate(LiveSet::kActivations, bytes);
  ASSERT_TRUE(z.ok()) << z.status();
  ASSERT_TRUE(cuda_.b().Fill(**other, z->as<float>(), n * n, kNaN).ok());
  ASSERT_TRUE((*other)->Synchronize().ok());
  const std::vector<float> got = cuda_.Download(c, n * n);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), bytes), 0)
      << "the released buffer was overwritten under the GEMMs reading it";
  z->Release();
}

TEST_F(CudaTwinTest, BadDeviceIndexIsRefused) {
  BackendOptions options;
  options.kind = BackendKind::kCuda;
  options.device_index = 1000;
  auto b = Backend::Create(options);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("device_index"));
}

}  // namespace
}  // namespace plateau
