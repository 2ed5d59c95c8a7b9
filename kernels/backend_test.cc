// The CPU backend end to end through the Backend interface: every primitive
// against a naive double-precision reference (backward ops also against
// central finite differences), argument checks, copies and events across
// streams, the device arena's cap, and Backend::Create's refusals.
//
// Tolerances are stated per test. u = 2^-24 is fp32's unit roundoff; most
// bounds are a small multiple of u times the magnitude the result is computed
// from (not the result itself), so that cancellation does not make a correct
// fp32 result look wrong, while a wrong index, a missed element or a wrong
// formula is off by far more.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/testing/device_side.h"
#include "kernels/cpu_backend.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

constexpr double kU = 1.0 / (1 << 24);  // fp32 unit roundoff
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<float> RandomVector(int64_t n, uint32_t seed, float lo = -1.0f,
                                float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// |got[i] - want[i]| <= tol[i] for every i; NaN never passes. On failure
// reports how many elements are off and the worst one.
::testing::AssertionResult AllClose(const std::vector<float>& got,
                                    const std::vector<double>& want,
                                    const std::vector<double>& tol) {
  if (got.size() != want.size() || got.size() != tol.size()) {
    return ::testing::AssertionFailure()
           << "sizes differ: got " << got.size() << ", want " << want.size()
           << ", tol " << tol.size();
  }
  int64_t bad = 0, worst = -1;
  double worst_ratio = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    double err = std::abs(static_cast<double>(got[i]) - want[i]);
    bool ok = err <= tol[i];  // false for NaN
    if (!ok) {
      ++bad;
      double ratio = std::isnan(err) ? INFINITY : err / tol[i];
      if (worst < 0 || ratio > worst_ratio) {
        worst_ratio = ratio;
        worst = static_cast<int64_t>(i);
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << got.size() << " elements off; worst [" << worst
         << "]: got " << got[worst] << ", want " << want[worst] << ", tol "
         << tol[worst];
}

::testing::AssertionResult AllClose(const std::vector<float>& got,
                                    const std::vector<double>& want,
                                    double tol) {
  return AllClose(got, want, std::vector<double>(want.size(), tol));
}

std::vector<double> ToDouble(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// One CPU backend and a compute stream (kernels/testing/device_side.h): the
// tests use only the Backend interface.
class BackendTest : public ::testing::Test, public DeviceSide {
 protected:
  void SetUp() override {
    BackendOptions options;
    options.kind = BackendKind::kCpu;
    options.device_memory_bytes = int64_t{1} << 30;
    auto backend = Backend::Create(options);
    ASSERT_TRUE(backend.ok()) << backend.status();
    absl::Status s = Init(std::move(*backend));
    ASSERT_TRUE(s.ok()) << s;
  }
  // Every test's queued work completes without a sticky stream error.
  void TearDown() override {
    if (ready()) {
      EXPECT_TRUE(s().Synchronize().ok());
    }
  }
};

// ---------------------------------------------------------------------------
// GEMM

struct GemmShape {
  bool ta, tb;
  int64_t m, n, k;
  int64_t pad_a, pad_b, pad_c;  // extra columns in each row stride
};

// C = alpha op(A) op(B) + beta C in double, with the same strided storage.
// Also returns, per element, |alpha| sum_k |a b| + |beta c|: the magnitude
// the fp32 result is computed from.
void ReferenceGemm(const GemmArgs& g, const std::vector<float>& c0,
                   std::vector<double>* c, std::vector<double>* mag) {
  c->assign(c0.begin(), c0.end());
  mag->assign(c0.size(), 0.0);
  for (int64_t i = 0; i < g.m; ++i) {
    for (int64_t j = 0; j < g.n; ++j) {
      double acc = 0.0, abs_acc = 0.0;
      for (int64_t p = 0; p < g.k; ++p) {
        double a = g.trans_a ? g.a[p * g.lda + i] : g.a[i * g.lda + p];
        double bv = g.trans_b ? g.b[j * g.ldb + p] : g.b[p * g.ldb + j];
        acc += a * bv;
        abs_acc += std::abs(a * bv);
      }
      double old = c0[i * g.ldc + j];
      double beta_term = g.beta == 0.0f ? 0.0 : g.beta * old;
      (*c)[i * g.ldc + j] = g.alpha * acc + beta_term;
      (*mag)[i * g.ldc + j] =
          std::abs(g.alpha) * abs_acc + std::abs(beta_term);
    }
  }
}

class GemmTest : public BackendTest,
                 public ::testing::WithParamInterface<GemmShape> {};

// Every transpose combination, row strides wider than the rows, beta != 0.
// Tolerance: |c - ref| <= 2 k u (|alpha| sum |a b| + |beta c|), the
// classical fp32 dot-product bound; elements of C's padding must keep their
// sentinel exactly.
TEST_P(GemmTest, MatchesDoubleReference) {
  const GemmShape sh = GetParam();
  const int64_t a_rows = sh.ta ? sh.k : sh.m, a_cols = sh.ta ? sh.m : sh.k;
  const int64_t b_rows = sh.tb ? sh.n : sh.k, b_cols = sh.tb ? sh.k : sh.n;
  const int64_t lda = a_cols + sh.pad_a, ldb = b_cols + sh.pad_b,
                ldc = sh.n + sh.pad_c;
  std::vector<float> a = RandomVector(a_rows * lda, 1);
  std::vector<float> bm = RandomVector(b_rows * ldb, 2);
  std::vector<float> c0 = RandomVector(sh.m * ldc, 3);
  constexpr float kSentinel = 12345.0f;
  for (int64_t i = 0; i < sh.m; ++i) {
    for (int64_t j = sh.n; j < ldc; ++j) c0[i * ldc + j] = kSentinel;
  }

  GemmArgs g;
  g.trans_a = sh.ta;
  g.trans_b = sh.tb;
  g.m = sh.m;
  g.n = sh.n;
  g.k = sh.k;
  g.alpha = -1.25f;
  g.beta = 0.75f;
  g.lda = lda;
  g.ldb = ldb;
  g.ldc = ldc;
  // Reference on host copies with the same strides.
  GemmArgs host = g;
  host.a = a.data();
  host.b = bm.data();
  std::vector<double> want, mag;
  ReferenceGemm(host, c0, &want, &mag);

  g.a = Upload(a);
  g.b = Upload(bm);
  float* c = Upload(c0);
  g.c = c;
  ASSERT_TRUE(b().Gemm(s(), g).ok());
  std::vector<float> got = Download(c, sh.m * ldc);

  std::vector<double> tol(mag.size());
  for (size_t i = 0; i < mag.size(); ++i) {
    tol[i] = 2.0 * sh.k * kU * mag[i];
  }
  for (int64_t i = 0; i < sh.m; ++i) {
    for (int64_t j = sh.n; j < ldc; ++j) tol[i * ldc + j] = 0.0;
  }
  EXPECT_TRUE(AllClose(got, want, tol))
      << "trans_a=" << sh.ta << " trans_b=" << sh.tb << " m=" << sh.m
      << " n=" << sh.n << " k=" << sh.k;
}

INSTANTIATE_TEST_SUITE_P(
    AllTransposes, GemmTest,
    ::testing::Values(GemmShape{false, false, 37, 29, 53, 3, 5, 7},
                      GemmShape{true, false, 37, 29, 53, 3, 5, 7},
                      GemmShape{false, true, 37, 29, 53, 3, 5, 7},
                      GemmShape{true, true, 37, 29, 53, 3, 5, 7},
                      // Large enough for OpenBLAS's threaded kernels.
                      GemmShape{false, false, 150, 130, 170, 1, 2, 3},
                      GemmShape{true, true, 150, 130, 170, 4, 0, 1},
                      GemmShape{false, true, 1, 257, 64, 0, 1, 0},
                      GemmShape{true, false, 257, 1, 64, 1, 0, 2}));

// beta == 0 means C is not read (BLAS semantics): NaNs in C must not leak.
TEST_F(BackendTest, GemmBetaZeroIgnoresOldC) {
  const int64_t m = 9, n = 11, k = 5;
  std::vector<float> a = RandomVector(m * k, 4), bm = RandomVector(k * n, 5);
  GemmArgs g;
  g.m = m;
  g.n = n;
  g.k = k;
  g.lda = k;
  g.ldb = n;
  g.ldc = n;
  g.alpha = 1.0f;
  g.beta = 0.0f;
  GemmArgs host = g;
  host.a = a.data();
  host.b = bm.data();
  std::vector<float> c0(m * n, 0.0f);
  std::vector<double> want, mag;
  ReferenceGemm(host, c0, &want, &mag);
  g.a = Upload(a);
  g.b = Upload(bm);
  g.c = Poisoned(m * n);
  ASSERT_TRUE(b().Gemm(s(), g).ok());
  std::vector<double> tol(mag.size());
  for (size_t i = 0; i < mag.size(); ++i) tol[i] = 2.0 * k * kU * mag[i];
  EXPECT_TRUE(AllClose(Download(g.c, m * n), want, tol));
}

// k == 0: the product is empty, so C = beta * C (and A, B may be null).
TEST_F(BackendTest, GemmEmptyProductScalesC) {
  const int64_t m = 4, n = 6, ldc = 8;
  std::vector<float> c0 = RandomVector(m * ldc, 6);
  GemmArgs g;
  g.m = m;
  g.n = n;
  g.k = 0;
  g.ldc = ldc;
  g.beta = -0.5f;
  g.c = Upload(c0);
  ASSERT_TRUE(b().Gemm(s(), g).ok());
  std::vector<double> want = ToDouble(c0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) want[i * ldc + j] *= -0.5;
  }
  // One multiplication by a power of two: exact.
  EXPECT_TRUE(AllClose(Download(g.c, m * ldc), want, 0.0));

  // With beta == 0 too, C is not read: NaNs become zeros.
  g.beta = 0.0f;
  g.c = Poisoned(m * ldc);
  ASSERT_TRUE(b().Gemm(s(), g).ok());
  std::vector<float> got = Download(g.c, m * ldc);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) EXPECT_EQ(got[i * ldc + j], 0.0f);
    for (int64_t j = n; j < ldc; ++j) EXPECT_TRUE(std::isnan(got[i * ldc + j]));
  }

  // beta == 1 leaves C bit for bit (NaN and -0 included).
  std::vector<float> c1 = RandomVector(m * ldc, 7);
  c1[0] = std::numeric_limits<float>::quiet_NaN();
  c1[1] = -0.0f;
  g.beta = 1.0f;
  g.c = Upload(c1);
  ASSERT_TRUE(b().Gemm(s(), g).ok());
  got = Download(g.c, m * ldc);
  EXPECT_EQ(std::memcmp(got.data(), c1.data(), c1.size() * sizeof(float)), 0);

  // A C of many blocks (the pool's split of its rows): every row scaled.
  const int64_t big_m = 300, big_n = 700;
  std::vector<float> c2 = RandomVector(big_m * big_n, 8);
  GemmArgs big;
  big.m = big_m;
  big.n = big_n;
  big.k = 0;
  big.ldc = big_n;
  big.beta = -0.5f;
  big.c = Upload(c2);
  ASSERT_TRUE(b().Gemm(s(), big).ok());
  got = Download(big.c, big_m * big_n);
  for (size_t i = 0; i < c2.size(); ++i) ASSERT_EQ(got[i], -0.5f * c2[i]) << i;
}

// GroupedGemm on the CPU is the CUDA grouped GEMM's twin: the same sgemm
// calls in order, so every C is bitwise what Gemm gives (and, through Gemm,
// within the double reference's bound), an empty entry (m = 0) is skipped,
// and a k = 0 entry scales C.
TEST_F(BackendTest, GroupedGemmIsTheSingleGemmsInOrder) {
  const int64_t H = 24, F = 40;
  const std::vector<int64_t> rows = {7, 0, 33, 1, 33};
  std::vector<GemmArgs> gemms;
  std::vector<float*> outs;
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t n = rows[i];
    float* x = Upload(RandomVector(std::max<int64_t>(n * H, 1), 10 + i));
    float* w = Upload(RandomVector(H * F, 20 + i));
    float* y = Upload(RandomVector(std::max<int64_t>(n * F, 1), 30 + i));
    float* dw = Upload(RandomVector(H * F, 40 + i));
    gemms.push_back({false, false, n, F, H, 1.0f, x, H, w, F, 0.0f, y, F});
    gemms.push_back({true, false, H, F, n, 0.5f, x, H, y, F, 1.0f, dw, F});  // after y
    outs.push_back(y);
    outs.push_back(dw);
    sizes.push_back(std::max<int64_t>(n * F, 1));
    sizes.push_back(H * F);
  }
  // The dW entries read the y the forward entries write: not independent,
  // so run them as two grouped calls (the runner's order), then the same
  // GEMMs one by one on copies of the starting values.
  std::vector<std::vector<float>> start;
  for (size_t i = 0; i < outs.size(); ++i) start.push_back(Download(outs[i], sizes[i]));
  std::vector<GemmArgs> first, second;
  for (size_t i = 0; i < gemms.size(); ++i) (i % 2 == 0 ? first : second).push_back(gemms[i]);
  ASSERT_TRUE(b().GroupedGemm(s(), first).ok());
  ASSERT_TRUE(b().GroupedGemm(s(), second).ok());
  std::vector<std::vector<float>> grouped;
  for (size_t i = 0; i < outs.size(); ++i) grouped.push_back(Download(outs[i], sizes[i]));
  for (size_t i = 0; i < outs.size(); ++i) {
    ASSERT_TRUE(b().Copy(s(), outs[i], start[i].data(), start[i].size() * sizeof(float)).ok());
  }
  for (const std::vector<GemmArgs>* call : {&first, &second}) {
    for (const GemmArgs& g : *call) ASSERT_TRUE(b().Gemm(s(), g).ok());
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    const std::vector<float> single = Download(outs[i], sizes[i]);
    EXPECT_EQ(0, std::memcmp(single.data(), grouped[i].data(), single.size() * sizeof(float)))
        << "output " << i;
  }
  // The empty group's dW (k = 0, beta 1) is its start, untouched.
  EXPECT_EQ(grouped[3], start[3]);
  EXPECT_TRUE(b().GroupedGemm(s(), {}).ok());
}

TEST_F(BackendTest, GroupedGemmRefusesBadEntriesAndOverlaps) {
  float* a = Upload(RandomVector(64, 1));
  float* bm = Upload(RandomVector(64, 2));
  float* c = Poisoned(64);
  const GemmArgs ok = {false, false, 4, 4, 4, 1.0f, a, 4, bm, 4, 0.0f, c, 4};
  GemmArgs bad = ok;
  bad.lda = 2;
  GemmArgs other = ok;
  other.c = c + 16;
  absl::Status st = b().GroupedGemm(s(), {ok, other, bad});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("gemms[2]"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("lda"));
  // Two outputs overlapping by one row.
  GemmArgs overlap = ok;
  overlap.c = c + 12;
  st = b().GroupedGemm(s(), {ok, overlap});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("gemms[0].c and gemms[1].c overlap"));
  // One entry's output is another's input.
  GemmArgs reads = other;
  reads.a = c;
  st = b().GroupedGemm(s(), {ok, reads});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("gemms[0].c overlaps an input of gemms[1]"));
  // Disjoint outputs, shared inputs: fine.
  EXPECT_TRUE(b().GroupedGemm(s(), {ok, other}).ok());
}

// Two streams running GEMMs at once (OpenBLAS is entered from two threads):
// both results must still be right.
TEST_F(BackendTest, ConcurrentGemmsOnTwoStreams) {
  auto other = b().CreateStream("compute2");
  ASSERT_TRUE(other.ok());
  const int64_t m = 192, n = 160, k = 224;
  std::vector<float> a1 = RandomVector(m * k, 7), b1 = RandomVector(k * n, 8);
  std::vector<float> a2 = RandomVector(m * k, 9), b2 = RandomVector(k * n, 10);
  std::vector<float> zero(m * n, 0.0f);
  auto make = [&](const std::vector<float>& a, const std::vector<float>& bm) {
    GemmArgs g;
    g.m = m;
    g.n = n;
    g.k = k;
    g.lda = k;
    g.ldb = n;
    g.ldc = n;
    g.a = a.data();
    g.b = bm.data();
    return g;
  };
  GemmArgs h1 = make(a1, b1), h2 = make(a2, b2);
  std::vector<double> want1, mag1, want2, mag2;
  ReferenceGemm(h1, zero, &want1, &mag1);
  ReferenceGemm(h2, zero, &want2, &mag2);
  GemmArgs g1 = h1, g2 = h2;
  g1.a = Upload(a1);
  g1.b = Upload(b1);
  g1.c = Poisoned(m * n);
  g2.a = Upload(a2);
  g2.b = Upload(b2);
  g2.c = Poisoned(m * n);
  for (int rep = 0; rep < 5; ++rep) {
    ASSERT_TRUE(b().Gemm(s(), g1).ok());
    ASSERT_TRUE(b().Gemm(**other, g2).ok());
  }
  ASSERT_TRUE((*other)->Synchronize().ok());
  std::vector<double> tol1(mag1.size()), tol2(mag2.size());
  for (size_t i = 0; i < tol1.size(); ++i) {
    tol1[i] = 2.0 * k * kU * mag1[i];
    tol2[i] = 2.0 * k * kU * mag2[i];
  }
  EXPECT_TRUE(AllClose(Download(g1.c, m * n), want1, tol1));
  EXPECT_TRUE(AllClose(Download(g2.c, m * n), want2, tol2));
}

// ---------------------------------------------------------------------------
// Elementwise

// Fill, Scale, Add and Mul are one correctly rounded fp32 operation per
// element, so they must equal the double result rounded to fp32 exactly.
TEST_F(BackendTest, FillScaleAddMulAreCorrectlyRounded) {
  for (int64_t n : {1, 7, 1000, 65537}) {
    SCOPED_TRACE(absl::StrCat("n=", n));
    std::vector<float> x = RandomVector(n, 11, -3.0f, 3.0f);
    std::vector<float> y = RandomVector(n, 12, -3.0f, 3.0f);

    float* f = Poisoned(n);
    ASSERT_TRUE(b().Fill(s(), f, n, -2.5f).ok());
    EXPECT_TRUE(AllClose(Download(f, n), std::vector<double>(n, -2.5), 0.0));

    float* d = Upload(x);
    ASSERT_TRUE(b().Scale(s(), d, n, 0.3f).ok());
    std::vector<double> want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = static_cast<float>(double{x[i]} * 0.3f);
    EXPECT_TRUE(AllClose(Download(d, n), want, 0.0));

    float* dx = Upload(x);
    float* dy = Upload(y);
    float* out = Poisoned(n);
    ASSERT_TRUE(b().Add(s(), out, dx, dy, n).ok());
    for (int64_t i = 0; i < n; ++i) want[i] = static_cast<float>(double{x[i]} + y[i]);
    EXPECT_TRUE(AllClose(Download(out, n), want, 0.0));

    ASSERT_TRUE(b().Mul(s(), out, dx, dy, n).ok());
    for (int64_t i = 0; i < n; ++i) want[i] = static_cast<float>(double{x[i]} * y[i]);
    EXPECT_TRUE(AllClose(Download(out, n), want, 0.0));
  }
}

// out may alias a, b or both.
TEST_F(BackendTest, AddAndMulAllowAliasing) {
  const int64_t n = 777;
  std::vector<float> x = RandomVector(n, 13), y = RandomVector(n, 14);
  std::vector<double> want(n);

  float* a = Upload(x);
  float* c = Upload(y);
  ASSERT_TRUE(b().Add(s(), a, a, c, n).ok());  // a = a + c
  for (int64_t i = 0; i < n; ++i) want[i] = static_cast<float>(double{x[i]} + y[i]);
  EXPECT_TRUE(AllClose(Download(a, n), want, 0.0));

  a = Upload(x);
  ASSERT_TRUE(b().Mul(s(), c, a, c, n).ok());  // c = a * c
  for (int64_t i = 0; i < n; ++i) want[i] = static_cast<float>(double{x[i]} * y[i]);
  EXPECT_TRUE(AllClose(Download(c, n), want, 0.0));

  a = Upload(x);
  ASSERT_TRUE(b().Mul(s(), a, a, a, n).ok());  // a = a * a
  for (int64_t i = 0; i < n; ++i) want[i] = static_cast<float>(double{x[i]} * x[i]);
  EXPECT_TRUE(AllClose(Download(a, n), want, 0.0));

  a = Upload(x);
  ASSERT_TRUE(b().Add(s(), a, a, a, n).ok());  // a = 2a, exact
  for (int64_t i = 0; i < n; ++i) want[i] = 2.0 * x[i];
  EXPECT_TRUE(AllClose(Download(a, n), want, 0.0));
}

// y += alpha x: two roundings (one if contracted to an FMA), so
// |y - ref| <= 2u (|y0| + |alpha x|).
TEST_F(BackendTest, Axpy) {
  const int64_t n = 4099;
  const float alpha = -0.7f;
  std::vector<float> x = RandomVector(n, 15, -5, 5), y = RandomVector(n, 16);
  float* dy = Upload(y);
  ASSERT_TRUE(b().Axpy(s(), dy, Upload(x), n, alpha).ok());
  std::vector<double> want(n), tol(n);
  for (int64_t i = 0; i < n; ++i) {
    want[i] = double{y[i]} + double{alpha} * x[i];
    tol[i] = 2 * kU * (std::abs(y[i]) + std::abs(double{alpha} * x[i]));
  }
  EXPECT_TRUE(AllClose(Download(dy, n), want, tol));
}

// ---------------------------------------------------------------------------
// SwiGLU

double SiluD(double g) { return g / (1.0 + std::exp(-g)); }
double SigmoidD(double g) { return 1.0 / (1.0 + std::exp(-g)); }

// Gate values across the range, including saturated ones where exp(-g)
// overflows fp32: the outputs must stay finite and right.
std::vector<float> GateValues(int64_t n, uint32_t seed) {
  std::vector<float> g = RandomVector(n, seed, -6.0f, 6.0f);
  const float extremes[] = {-1000.0f, -100.0f, -88.5f, -20.0f, 0.0f,
                            20.0f,    88.5f,   100.0f, 1000.0f};
  for (int i = 0; i < 9 && i < n; ++i) g[i] = extremes[i];
  return g;
}

// Tolerance: 8u times the magnitude of the factors (fp32 exp is within a
// couple of ulps; a few multiplications follow), plus 1e-37 absolute: below
// FLT_MIN (1.2e-38) fp32 keeps no relative precision, and silu(-100) =
// -3.7e-42 may come out as 0 when exp(100) overflows to inf.
TEST_F(BackendTest, SwiGluForwardAndBackwardMatchDoubleReference) {
  for (int64_t n : {1, 9, 1000, 4097}) {
    SCOPED_TRACE(absl::StrCat("n=", n));
    std::vector<float> gate = GateValues(n, 17), up = RandomVector(n, 18, -3, 3),
                       dout = RandomVector(n, 19);
    float* dg = Upload(gate);
    float* du = Upload(up);
    float* dd = Upload(dout);
    float* out = Poisoned(n);
    float* dgate = Poisoned(n);
    float* dup = Poisoned(n);
    ASSERT_TRUE(b().SwiGluForward(s(), out, dg, du, n).ok());
    ASSERT_TRUE(b().SwiGluBackward(s(), dgate, dup, dd, dg, du, n).ok());

    std::vector<double> want_out(n), want_dgate(n), want_dup(n), tol_out(n),
        tol_dgate(n), tol_dup(n);
    for (int64_t i = 0; i < n; ++i) {
      double g = gate[i], u = up[i], d = dout[i], sg = SigmoidD(g);
      want_out[i] = SiluD(g) * u;
      want_dup[i] = d * SiluD(g);
      want_dgate[i] = d * u * sg * (1.0 + g * (1.0 - sg));
      tol_out[i] = 8 * kU * std::abs(SiluD(g) * u) + 1e-37;
      tol_dup[i] = 8 * kU * std::abs(d * SiluD(g)) + 1e-37;
      // silu' = s (1 + g (1 - s)). s is known to about an ulp, and g (1 - s)
      // turns that into an absolute error of ~|g| s u, so the magnitude is
      // s (1 + |g|), not the (possibly cancelling) value itself.
      tol_dgate[i] = 8 * kU * std::abs(d * u) * sg * (1.0 + std::abs(g)) + 1e-37;
    }
    EXPECT_TRUE(AllClose(Download(out, n), want_out, tol_out));
    EXPECT_TRUE(AllClose(Download(dgate, n), want_dgate, tol_dgate));
    EXPECT_TRUE(AllClose(Download(dup, n), want_dup, tol_dup));
  }
}

// The backward against central differences of the double forward
// L = sum_i dout_i silu(gate_i) up_i, step h = 1e-4 (error O(h^2) ~ 1e-8).
// Tolerance 1e-5 (1 + |fd|): the backend's fp32 result is good to ~1e-6.
TEST_F(BackendTest, SwiGluBackwardMatchesFiniteDifferences) {
  const int64_t n = 257;
  std::vector<float> gate = RandomVector(n, 20, -5, 5),
                     up = RandomVector(n, 21, -2, 2),
                     dout = RandomVector(n, 22);
  float* dgate = Poisoned(n);
  float* dup = Poisoned(n);
  ASSERT_TRUE(b().SwiGluBackward(s(), dgate, dup, Upload(dout), Upload(gate),
                                 Upload(up), n)
                  .ok());
  const double h = 1e-4;
  std::vector<double> fd_gate(n), fd_up(n), tol_gate(n), tol_up(n);
  for (int64_t i = 0; i < n; ++i) {
    double g = gate[i], u = up[i], d = dout[i];
    fd_gate[i] = d * (SiluD(g + h) * u - SiluD(g - h) * u) / (2 * h);
    fd_up[i] = d * (SiluD(g) * (u + h) - SiluD(g) * (u - h)) / (2 * h);
    tol_gate[i] = 1e-5 * (1 + std::abs(fd_gate[i]));
    tol_up[i] = 1e-5 * (1 + std::abs(fd_up[i]));
  }
  EXPECT_TRUE(AllClose(Download(dgate, n), fd_gate, tol_gate));
  EXPECT_TRUE(AllClose(Download(dup, n), fd_up, tol_up));
}

// ---------------------------------------------------------------------------
// RMSNorm

struct RmsRef {
  std::vector<double> out, rstd;
};

RmsRef RmsNormForwardD(const std::vector<double>& x,
                       const std::vector<double>& w, int64_t rows,
                       int64_t cols, double eps) {
  RmsRef r;
  r.out.resize(rows * cols);
  r.rstd.resize(rows);
  for (int64_t i = 0; i < rows; ++i) {
    double ss = 0;
    for (int64_t c = 0; c < cols; ++c) ss += x[i * cols + c] * x[i * cols + c];
    r.rstd[i] = 1.0 / std::sqrt(ss / cols + eps);
    for (int64_t c = 0; c < cols; ++c) {
      r.out[i * cols + c] = x[i * cols + c] * r.rstd[i] * w[c];
    }
  }
  return r;
}

struct RmsShape {
  int64_t rows, cols;
};

class RmsNormTest : public BackendTest,
                    public ::testing::WithParamInterface<RmsShape> {};

// Forward: out within 4u |out| (+ the rstd error), rstd within 4u.
// Backward (analytic, in double): dx within 1e-5 times the magnitude of its
// two terms r|dout w| + |x| r^3/cols sum|dout w x|; dweight within 1e-5 of
// sum_r |dout x rstd| on top of its initial value (it accumulates).
TEST_P(RmsNormTest, ForwardAndBackwardMatchDoubleReference) {
  const auto [rows, cols] = GetParam();
  const float eps = 1e-5f;
  std::vector<float> x = RandomVector(rows * cols, 23, -2, 2),
                     w = RandomVector(cols, 24, 0.5, 1.5),
                     dout = RandomVector(rows * cols, 25),
                     dw0 = RandomVector(cols, 26);
  float* dxin = Upload(x);
  float* dwt = Upload(w);
  float* out = Poisoned(rows * cols);
  float* rstd = Poisoned(rows);
  ASSERT_TRUE(b().RmsNormForward(s(), out, rstd, dxin, dwt, rows, cols, eps).ok());
  float* dx = Poisoned(rows * cols);
  float* dweight = Upload(dw0);
  ASSERT_TRUE(b().RmsNormBackward(s(), dx, dweight, Upload(dout), dxin, dwt,
                                  rstd, rows, cols)
                  .ok());

  std::vector<double> xd = ToDouble(x), wd = ToDouble(w);
  RmsRef ref = RmsNormForwardD(xd, wd, rows, cols, eps);
  std::vector<double> tol_out(rows * cols), tol_rstd(rows);
  for (int64_t i = 0; i < rows * cols; ++i) tol_out[i] = 4 * kU * std::abs(ref.out[i]);
  for (int64_t i = 0; i < rows; ++i) tol_rstd[i] = 4 * kU * ref.rstd[i];
  EXPECT_TRUE(AllClose(Download(out, rows * cols), ref.out, tol_out));
  EXPECT_TRUE(AllClose(Download(rstd, rows), ref.rstd, tol_rstd));

  std::vector<double> want_dx(rows * cols), tol_dx(rows * cols);
  std::vector<double> want_dw = ToDouble(dw0), tol_dw(cols);
  for (int64_t c = 0; c < cols; ++c) tol_dw[c] = 2 * kU * std::abs(dw0[c]);
  for (int64_t i = 0; i < rows; ++i) {
    const double r = ref.rstd[i];
    double dot = 0, abs_dot = 0;
    for (int64_t c = 0; c < cols; ++c) {
      double t = double{dout[i * cols + c]} * wd[c] * xd[i * cols + c];
      dot += t;
      abs_dot += std::abs(t);
    }
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t k = i * cols + c;
      const double dw = dout[k] * wd[c];
      want_dx[k] = r * dw - xd[k] * r * r * r * dot / cols;
      tol_dx[k] = 1e-5 * (r * std::abs(dw) +
                          std::abs(xd[k]) * r * r * r * abs_dot / cols);
      want_dw[c] += dout[k] * xd[k] * r;
      tol_dw[c] += 1e-5 * std::abs(dout[k] * xd[k] * r);
    }
  }
  EXPECT_TRUE(AllClose(Download(dx, rows * cols), want_dx, tol_dx));
  EXPECT_TRUE(AllClose(Download(dweight, cols), want_dw, tol_dw));
}

INSTANTIATE_TEST_SUITE_P(Shapes, RmsNormTest,
                         ::testing::Values(RmsShape{1, 1}, RmsShape{3, 1000},
                                           RmsShape{1000, 3},
                                           RmsShape{17, 4096},
                                           RmsShape{64, 257}));

// out may alias x.
TEST_F(BackendTest, RmsNormForwardInPlace) {
  const int64_t rows = 5, cols = 33;
  std::vector<float> x = RandomVector(rows * cols, 27),
                     w = RandomVector(cols, 28);
  float* xin = Upload(x);
  float* rstd = Poisoned(rows);
  ASSERT_TRUE(b().RmsNormForward(s(), xin, rstd, xin, Upload(w), rows, cols,
                                 1e-6f)
                  .ok());
  RmsRef ref = RmsNormForwardD(ToDouble(x), ToDouble(w), rows, cols, 1e-6);
  std::vector<double> tol(rows * cols);
  for (size_t i = 0; i < tol.size(); ++i) tol[i] = 4 * kU * std::abs(ref.out[i]);
  EXPECT_TRUE(AllClose(Download(xin, rows * cols), ref.out, tol));
}

// The backward against central differences (h = 1e-5) of the double forward
// L = sum dout * rmsnorm(x, w), for every element of x and of w. The backend
// accumulates into dweight, so it starts from dw0 and gets dw0 + dL/dw.
// Tolerance 1e-5 (1 + |fd|).
TEST_F(BackendTest, RmsNormBackwardMatchesFiniteDifferences) {
  const int64_t rows = 4, cols = 9;
  const double eps = 1e-5;
  std::vector<float> x = RandomVector(rows * cols, 29, -2, 2),
                     w = RandomVector(cols, 30, 0.5, 1.5),
                     dout = RandomVector(rows * cols, 31),
                     dw0 = RandomVector(cols, 32);
  float* dxin = Upload(x);
  float* dwt = Upload(w);
  float* out = Poisoned(rows * cols);
  float* rstd = Poisoned(rows);
  ASSERT_TRUE(b().RmsNormForward(s(), out, rstd, dxin, dwt, rows, cols,
                                 static_cast<float>(eps))
                  .ok());
  float* dx = Poisoned(rows * cols);
  float* dweight = Upload(dw0);
  ASSERT_TRUE(b().RmsNormBackward(s(), dx, dweight, Upload(dout), dxin, dwt,
                                  rstd, rows, cols)
                  .ok());

  std::vector<double> xd = ToDouble(x), wd = ToDouble(w);
  auto loss = [&](const std::vector<double>& xv, const std::vector<double>& wv) {
    RmsRef r = RmsNormForwardD(xv, wv, rows, cols, static_cast<float>(eps));
    double l = 0;
    for (int64_t i = 0; i < rows * cols; ++i) l += dout[i] * r.out[i];
    return l;
  };
  const double h = 1e-5;
  std::vector<double> fd_x(rows * cols), fd_w(cols);
  for (int64_t i = 0; i < rows * cols; ++i) {
    std::vector<double> p = xd, m = xd;
    p[i] += h;
    m[i] -= h;
    fd_x[i] = (loss(p, wd) - loss(m, wd)) / (2 * h);
  }
  for (int64_t c = 0; c < cols; ++c) {
    std::vector<double> p = wd, m = wd;
    p[c] += h;
    m[c] -= h;
    fd_w[c] = dw0[c] + (loss(xd, p) - loss(xd, m)) / (2 * h);
  }
  std::vector<double> tol_x(rows * cols), tol_w(cols);
  for (size_t i = 0; i < tol_x.size(); ++i) tol_x[i] = 1e-5 * (1 + std::abs(fd_x[i]));
  for (size_t i = 0; i < tol_w.size(); ++i) tol_w[i] = 1e-5 * (1 + std::abs(fd_w[i]));
  EXPECT_TRUE(AllClose(Download(dx, rows * cols), fd_x, tol_x));
  EXPECT_TRUE(AllClose(Download(dweight, cols), fd_w, tol_w));
}

// ---------------------------------------------------------------------------
// Softmax and log-sum-exp

// Softmax and log-sum-exp rows in double. Also returns the tolerances used
// throughout: softmax within u (|x - max| + 4) y + 1e-30 (fp32 rounds
// x - max with an absolute error up to u |x - max|, which exp turns into that
// relative error; a few more roundings follow), log-sum-exp within
// 4u (|lse| + 1).
void SoftmaxLseD(const std::vector<float>& x, int64_t rows, int64_t cols,
                 std::vector<double>* y, std::vector<double>* lse,
                 std::vector<double>* tol_y, std::vector<double>* tol_lse) {
  y->resize(rows * cols);
  lse->resize(rows);
  tol_y->resize(rows * cols);
  tol_lse->resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double mx = -INFINITY;
    for (int64_t c = 0; c < cols; ++c) mx = std::max(mx, double{x[r * cols + c]});
    double sum = 0;
    for (int64_t c = 0; c < cols; ++c) sum += std::exp(x[r * cols + c] - mx);
    for (int64_t c = 0; c < cols; ++c) {
      const double d = x[r * cols + c] - mx;
      (*y)[r * cols + c] = std::exp(d) / sum;
      (*tol_y)[r * cols + c] = kU * (std::abs(d) + 4) * (*y)[r * cols + c] + 1e-30;
    }
    (*lse)[r] = mx + std::log(sum);
    (*tol_lse)[r] = 4 * kU * (std::abs((*lse)[r]) + 1);
  }
}

class RowsTest : public BackendTest,
                 public ::testing::WithParamInterface<RmsShape> {};

// Tolerances as stated at SoftmaxLseD. Some rows get one large element, so
// the row maximum is far from the rest.
TEST_P(RowsTest, SoftmaxAndLogSumExpMatchDoubleReference) {
  const auto [rows, cols] = GetParam();
  std::vector<float> x = RandomVector(rows * cols, 33, -10, 10);
  for (int64_t r = 0; r < rows; ++r) x[r * cols] += 30.0f * (r % 3);
  std::vector<double> want_y, want_lse, tol_y, tol_lse;
  SoftmaxLseD(x, rows, cols, &want_y, &want_lse, &tol_y, &tol_lse);

  float* dx = Upload(x);
  float* y = Poisoned(rows * cols);
  float* lse = Poisoned(rows);
  ASSERT_TRUE(b().SoftmaxRows(s(), y, dx, rows, cols).ok());
  ASSERT_TRUE(b().LogSumExpRows(s(), lse, dx, rows, cols).ok());
  std::vector<float> got_y = Download(y, rows * cols);
  EXPECT_TRUE(AllClose(got_y, want_y, tol_y));
  EXPECT_TRUE(AllClose(Download(lse, rows), want_lse, tol_lse));

  // In place: y aliases x.
  ASSERT_TRUE(b().SoftmaxRows(s(), dx, dx, rows, cols).ok());
  EXPECT_TRUE(AllClose(Download(dx, rows * cols), want_y, tol_y));
}

INSTANTIATE_TEST_SUITE_P(Shapes, RowsTest,
                         ::testing::Values(RmsShape{1, 1}, RmsShape{3, 1000},
                                           RmsShape{1000, 3},
                                           RmsShape{17, 4096},
                                           RmsShape{5, 100003}));

// Values far outside exp's fp32 range: exp(1e30) or exp(88.8) overflow, so an
// implementation that does not subtract the row maximum returns inf or NaN.
TEST_F(BackendTest, SoftmaxAndLogSumExpStayFiniteAtExtremes) {
  const int64_t rows = 7, cols = 4;
  const float big = 1e30f, huge = 3e38f;
  std::vector<float> x = {
      big,  -big,  0,    5,      //
      -big, -big,  -big, -big,   //
      88,   89,    90,   -big,   //
      -100, -101,  -big, -big,   //
      huge, -huge, 0,    0,      //
      0,    0,     0,    0,      //
      big,  big,   -big, big,    //
  };
  std::vector<double> want_y, want_lse, tol_y, tol_lse;
  SoftmaxLseD(x, rows, cols, &want_y, &want_lse, &tol_y, &tol_lse);
  // Spot-check the reference itself on rows with known answers.
  ASSERT_DOUBLE_EQ(want_lse[0], double{big});
  ASSERT_NEAR(want_lse[2], 90.40760596444438, 1e-12);
  ASSERT_NEAR(want_lse[5], std::log(4.0), 1e-15);

  float* dx = Upload(x);
  float* y = Poisoned(rows * cols);
  float* lse = Poisoned(rows);
  ASSERT_TRUE(b().SoftmaxRows(s(), y, dx, rows, cols).ok());
  ASSERT_TRUE(b().LogSumExpRows(s(), lse, dx, rows, cols).ok());
  EXPECT_TRUE(AllClose(Download(y, rows * cols), want_y, tol_y));
  EXPECT_TRUE(AllClose(Download(lse, rows), want_lse, tol_lse));
}

// ---------------------------------------------------------------------------
// Reductions

// Random data: |out - ref| <= u |ref| + 1e-12 sum |x| (the backend sums in
// double, so only the final rounding to fp32 shows).
TEST_F(BackendTest, SumAndSumSquaresMatchDoubleReference) {
  for (int64_t n : {0, 1, 7, 1000, (1 << 20) + 3}) {
    SCOPED_TRACE(absl::StrCat("n=", n));
    std::vector<float> x = RandomVector(n, 34, -1, 3);
    double sum = 0, sq = 0, abs_sum = 0;
    for (float v : x) {
      sum += v;
      sq += double{v} * v;
      abs_sum += std::abs(v);
    }
    float* dx = n > 0 ? Upload(x) : nullptr;
    float* out = Poisoned(2);
    ASSERT_TRUE(b().Sum(s(), out, dx, n).ok());
    ASSERT_TRUE(b().SumSquares(s(), out + 1, dx, n).ok());
    std::vector<double> tol = {kU * std::abs(sum) + 1e-12 * abs_sum,
                               kU * sq + 1e-12 * sq};
    EXPECT_TRUE(AllClose(Download(out, 2), {sum, sq}, tol));
  }
}

// Integer data whose sums are exact in double: the result must be the exact
// sum rounded once to fp32, so a skipped or repeated element shows.
TEST_F(BackendTest, SumAndSumSquaresAreExactOnIntegers) {
  const int64_t n = 3000001;
  std::vector<float> x(n);
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = static_cast<float>(i % 1000) - 400.0f;
    sum += x[i];
    sq += double{x[i]} * x[i];
  }
  float* out = Poisoned(2);
  float* dx = Upload(x);
  ASSERT_TRUE(b().Sum(s(), out, dx, n).ok());
  ASSERT_TRUE(b().SumSquares(s(), out + 1, dx, n).ok());
  std::vector<float> got = Download(out, 2);
  EXPECT_EQ(got[0], static_cast<float>(sum));
  EXPECT_EQ(got[1], static_cast<float>(sq));
}

// ---------------------------------------------------------------------------
// AdamW

struct AdamWState {
  std::vector<double> p, m, v;
};

// torch.optim.AdamW (foreach=False, amsgrad=False, maximize=False) for one
// step, written out in double from the PyTorch documentation's algorithm.
void TorchAdamWStepD(AdamWState* st, const std::vector<float>& grad,
                     const AdamWArgs& a) {
  const double lr = a.lr, b1 = a.beta1, b2 = a.beta2, eps = a.eps,
               wd = a.weight_decay, t = static_cast<double>(a.step);
  const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
  for (size_t i = 0; i < st->p.size(); ++i) {
    double g = double{grad[i]} * a.grad_scale;
    st->p[i] *= 1 - lr * wd;
    st->m[i] = b1 * st->m[i] + (1 - b1) * g;
    st->v[i] = b2 * st->v[i] + (1 - b2) * g * g;
    st->p[i] -= lr / bc1 * st->m[i] / (std::sqrt(st->v[i]) / std::sqrt(bc2) + eps);
  }
}

// Ten steps with fresh gradients each step; after every step param, m and v
// are compared with the double reference. Tolerances: m within
// 4u (|m| + max|g|), v within 8u |v| + tiny, param within
// 4u t |p| + 1e-4 lr (fp32 rounding of p each step, plus the update's own
// fp32 error of a few ulps of lr).
TEST_F(BackendTest, AdamWMatchesTorchFormulaOverSeveralSteps) {
  const int64_t n = 5003;
  AdamWArgs args;
  args.lr = 3e-3f;
  args.beta1 = 0.9f;
  args.beta2 = 0.95f;
  args.eps = 1e-8f;
  args.weight_decay = 0.1f;
  args.grad_scale = 0.5f;
  std::vector<float> p0 = RandomVector(n, 35, -1, 1);
  AdamWState ref{ToDouble(p0), std::vector<double>(n, 0.0),
                 std::vector<double>(n, 0.0)};
  float* param = Upload(p0);
  float* m = Upload(std::vector<float>(n, 0.0f));
  float* v = Upload(std::vector<float>(n, 0.0f));
  double max_g = 0;
  for (int64_t t = 1; t <= 10; ++t) {
    SCOPED_TRACE(absl::StrCat("step ", t));
    std::vector<float> grad = RandomVector(n, 100 + t, -2, 2);
    grad[0] = 0.0f;  // a zero gradient: only weight decay moves it
    grad[1] = 1e-6f;  // tiny: eps matters
    for (float g : grad) max_g = std::max(max_g, std::abs(double{g}) * args.grad_scale);
    args.step = t;
    ASSERT_TRUE(b().AdamW(s(), param, Upload(grad), m, v, n, args).ok());
    TorchAdamWStepD(&ref, grad, args);
    std::vector<double> tol_p(n), tol_m(n), tol_v(n);
    for (int64_t i = 0; i < n; ++i) {
      tol_p[i] = 4 * kU * t * std::abs(ref.p[i]) + 1e-4 * args.lr;
      tol_m[i] = 4 * kU * (std::abs(ref.m[i]) + max_g);
      tol_v[i] = 8 * kU * ref.v[i] + 1e-30;
    }
    EXPECT_TRUE(AllClose(Download(param, n), ref.p, tol_p));
    EXPECT_TRUE(AllClose(Download(m, n), ref.m, tol_m));
    EXPECT_TRUE(AllClose(Download(v, n), ref.v, tol_v));
  }
}

// A property of AdamW that does not depend on the formula as written: on the
// first step from m = v = 0, without weight decay, the bias corrections undo
// (1 - beta), so each parameter moves by lr * g / (|g| + eps), about lr
// against the gradient's sign whatever its size.
TEST_F(BackendTest, AdamWFirstStepMovesByLearningRate) {
  const int64_t n = 64;
  AdamWArgs args;
  args.lr = 0.01f;
  args.weight_decay = 0.0f;
  args.step = 1;
  std::vector<float> p0 = RandomVector(n, 36), grad = RandomVector(n, 37, -50, 50);
  float* param = Upload(p0);
  ASSERT_TRUE(b().AdamW(s(), param, Upload(grad),
                        Upload(std::vector<float>(n, 0.0f)),
                        Upload(std::vector<float>(n, 0.0f)), n, args)
                  .ok());
  std::vector<double> want(n), tol(n);
  for (int64_t i = 0; i < n; ++i) {
    want[i] = p0[i] - 0.01 * grad[i] / (std::abs(grad[i]) + 1e-8);
    tol[i] = 1e-6;
  }
  EXPECT_TRUE(AllClose(Download(param, n), want, tol));
}

// ---------------------------------------------------------------------------
// Determinism: the same inputs give the same bits, run to run.

TEST_F(BackendTest, ReductionsAndNormsAreBitwiseReproducible) {
  const int64_t rows = 64, cols = 1000, n = rows * cols;
  std::vector<float> x = RandomVector(n, 38), w = RandomVector(cols, 39),
                     dout = RandomVector(n, 40);
  float* dx = Upload(x);
  float* dw = Upload(w);
  float* dd = Upload(dout);
  auto run = [&]() {
    float* out = Poisoned(n);
    float* rstd = Poisoned(rows);
    float* gx = Poisoned(n);
    float* gw = Upload(std::vector<float>(cols, 0.0f));
    float* sums = Poisoned(3);
    EXPECT_TRUE(b().RmsNormForward(s(), out, rstd, dx, dw, rows, cols, 1e-5f).ok());
    EXPECT_TRUE(b().RmsNormBackward(s(), gx, gw, dd, dx, dw, rstd, rows, cols).ok());
    EXPECT_TRUE(b().Sum(s(), sums, dx, n).ok());
    EXPECT_TRUE(b().SumSquares(s(), sums + 1, dx, n).ok());
    EXPECT_TRUE(b().LogSumExpRows(s(), sums + 2, dx, 1, n).ok());
    std::vector<float> all = Download(gx, n);
    for (float v : Download(gw, cols)) all.push_back(v);
    for (float v : Download(sums, 3)) all.push_back(v);
    return all;
  };
  std::vector<float> first = run(), second = run();
  ASSERT_EQ(first.size(), second.size());
  EXPECT_EQ(std::memcmp(first.data(), second.data(), first.size() * sizeof(float)), 0);
}

// ---------------------------------------------------------------------------
// Argument checks: INVALID_ARGUMENT naming the argument, nothing enqueued.

TEST_F(BackendTest, InvalidArgumentsNameTheArgumentAndEnqueueNothing) {
  const int64_t n = 16;
  const std::vector<float> sentinel = RandomVector(n, 41);
  float* x = Upload(sentinel);
  float* y = Upload(sentinel);
  float* z = Upload(sentinel);
  float* q = Upload(sentinel);
  Stream& st = s();
  Backend& be = b();
  auto gemm = [&](auto mutate) {
    GemmArgs g;
    g.m = g.n = g.k = 4;
    g.a = x;
    g.b = y;
    g.c = z;
    g.lda = g.ldb = g.ldc = 4;
    mutate(g);
    return be.Gemm(st, g);
  };
  auto adamw = [&](auto mutate) {
    AdamWArgs a;
    mutate(a);
    return be.AdamW(st, x, y, z, q, n, a);
  };
  struct Case {
    std::string what;
    std::function<absl::Status()> call;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"copy dst", [&] { return be.Copy(st, nullptr, x, 8); }, "copy: dst is null"},
      {"copy overlap", [&] { return be.Copy(st, x + 1, x, 16); }, "copy: src and dst ranges overlap"},
      {"gemm m", [&] { return gemm([](GemmArgs& g) { g.m = -1; }); }, "gemm: m must be >= 0"},
      {"gemm k", [&] { return gemm([](GemmArgs& g) { g.k = -2; }); }, "gemm: k must be >= 0"},
      {"gemm lda", [&] { return gemm([](GemmArgs& g) { g.lda = 3; }); }, "gemm: lda = 3"},
      {"gemm lda trans", [&] { return gemm([](GemmArgs& g) { g.trans_a = true; g.m = 5; g.lda = 4; }); }, "gemm: lda = 4"},
      {"gemm ldb", [&] { return gemm([](GemmArgs& g) { g.trans_b = true; g.k = 5; g.lda = 5; g.ldb = 4; }); }, "gemm: ldb = 4"},
      {"gemm ldc", [&] { return gemm([](GemmArgs& g) { g.ldc = 2; }); }, "gemm: ldc = 2"},
      {"gemm ld 32 bits", [&] { return gemm([](GemmArgs& g) { g.ldb = int64_t{1} << 31; }); }, "gemm: lda, ldb and ldc must each fit in 32 bits"},
      {"gemm a", [&] { return gemm([](GemmArgs& g) { g.a = nullptr; }); }, "gemm: a is null"},
      {"gemm c", [&] { return gemm([](GemmArgs& g) { g.c = nullptr; }); }, "gemm: c is null"},
      {"gemm alpha", [&] { return gemm([](GemmArgs& g) { g.alpha = kNaN; }); }, "gemm: alpha and beta must be finite"},
      {"fill n", [&] { return be.Fill(st, x, -1, 0.0f); }, "fill: n must be >= 0"},
      {"fill x", [&] { return be.Fill(st, nullptr, n, 0.0f); }, "fill: x is null"},
      {"scale x", [&] { return be.Scale(st, nullptr, n, 2.0f); }, "scale: x is null"},
      {"axpy y", [&] { return be.Axpy(st, nullptr, x, n, 2.0f); }, "axpy: y is null"},
      {"axpy x", [&] { return be.Axpy(st, y, nullptr, n, 2.0f); }, "axpy: x is null"},
      {"add b", [&] { return be.Add(st, z, x, nullptr, n); }, "add: b is null"},
      {"mul out", [&] { return be.Mul(st, nullptr, x, y, n); }, "mul: out is null"},
      {"mul n", [&] { return be.Mul(st, z, x, y, -5); }, "mul: n must be >= 0"},
      {"swiglu up", [&] { return be.SwiGluForward(st, z, x, nullptr, n); }, "swiglu_forward: up is null"},
      {"swiglu dup", [&] { return be.SwiGluBackward(st, z, nullptr, x, y, q, n); }, "swiglu_backward: dup is null"},
      {"rmsnorm eps", [&] { return be.RmsNormForward(st, z, q, x, y, 2, 8, 0.0f); }, "rmsnorm_forward: eps must be > 0"},
      {"rmsnorm rows", [&] { return be.RmsNormForward(st, z, q, x, y, -1, 8, 1e-5f); }, "rmsnorm_forward: rows must be >= 0"},
      {"rmsnorm cols", [&] { return be.RmsNormForward(st, z, q, x, y, 2, 0, 1e-5f); }, "rmsnorm_forward: cols must be > 0"},
      {"rmsnorm weight", [&] { return be.RmsNormForward(st, z, q, x, nullptr, 2, 8, 1e-5f); }, "rmsnorm_forward: weight is null"},
      {"rmsnorm_bwd rstd", [&] { return be.RmsNormBackward(st, z, q, x, y, x, nullptr, 2, 8); }, "rmsnorm_backward: rstd is null"},
      {"rmsnorm_bwd dweight", [&] { return be.RmsNormBackward(st, z, nullptr, x, y, x, q, 2, 8); }, "rmsnorm_backward: dweight is null"},
      {"softmax cols", [&] { return be.SoftmaxRows(st, z, x, 4, 0); }, "softmax_rows: cols must be > 0"},
      {"softmax y", [&] { return be.SoftmaxRows(st, nullptr, x, 4, 4); }, "softmax_rows: y is null"},
      {"lse out", [&] { return be.LogSumExpRows(st, nullptr, x, 4, 4); }, "logsumexp_rows: out is null"},
      {"sum out", [&] { return be.Sum(st, nullptr, x, n); }, "sum: out is null"},
      {"sum_squares n", [&] { return be.SumSquares(st, z, x, -3); }, "sum_squares: n must be >= 0"},
      {"adamw lr", [&] { return adamw([](AdamWArgs& a) { a.lr = -1.0f; }); }, "adamw: lr must be finite and >= 0"},
      {"adamw beta1", [&] { return adamw([](AdamWArgs& a) { a.beta1 = 1.0f; }); }, "adamw: beta1 must be in [0, 1)"},
      {"adamw beta2", [&] { return adamw([](AdamWArgs& a) { a.beta2 = -0.1f; }); }, "adamw: beta2 must be in [0, 1)"},
      {"adamw eps", [&] { return adamw([](AdamWArgs& a) { a.eps = 0.0f; }); }, "adamw: eps must be > 0"},
      {"adamw weight_decay", [&] { return adamw([](AdamWArgs& a) { a.weight_decay = kNaN; }); }, "adamw: weight_decay must be finite"},
      {"adamw step", [&] { return adamw([](AdamWArgs& a) { a.step = 0; }); }, "adamw: step must be >= 1"},
      {"adamw grad_scale", [&] { return adamw([](AdamWArgs& a) { a.grad_scale = INFINITY; }); }, "adamw: grad_scale must be finite"},
      {"adamw m", [&] { return be.AdamW(st, x, y, nullptr, q, n, AdamWArgs{}); }, "adamw: m is null"},
  };
  for (const Case& c : cases) {
    absl::Status status = c.call();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument)
        << c.what << ": " << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message)) << c.what;
  }
  // Nothing ran: every buffer still holds its sentinel and the stream is
  // healthy.
  ASSERT_TRUE(s().Synchronize().ok());
  const std::vector<double> want = ToDouble(sentinel);
  for (float* p : {x, y, z, q}) EXPECT_TRUE(AllClose(Download(p, n), want, 0.0));
}

// A stream from elsewhere (here a bare implementation of the interface) is
// refused before anything runs.
TEST_F(BackendTest, ForeignStreamIsRefused) {
  class ForeignStream final : public Stream {
   public:
    const std::string& name() const override { return name_; }
    absl::Status Record(Event&) override { return absl::OkStatus(); }
    absl::Status Wait(Event&) override { return absl::OkStatus(); }
    absl::Status Synchronize() override { return absl::OkStatus(); }

   private:
    std::string name_ = "foreign";
  } foreign;
  std::vector<float> sentinel = RandomVector(8, 42);
  float* x = Upload(sentinel);
  absl::Status status = b().Fill(foreign, x, 8, 0.0f);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("'foreign'"));
  EXPECT_TRUE(AllClose(Download(x, 8), ToDouble(sentinel), 0.0));
}

// ---------------------------------------------------------------------------
// Copies, streams and events

// device -> host -> device through a copy stream while a compute stream
// works, ordered only by events. A "blocker" stream runs a long GEMM first
// and the copy stream waits for it, so if any Wait were ignored the compute
// stream would read the destination long before the data arrived.
TEST_F(BackendTest, CopiesThroughCopyStreamOrderedByEvents) {
  auto copy = b().CreateStream("copy");
  auto blocker = b().CreateStream("blocker");
  ASSERT_TRUE(copy.ok() && blocker.ok());
  auto ev_blocked = b().CreateEvent(), ev_h2d = b().CreateEvent(),
       ev_scaled = b().CreateEvent(), ev_back = b().CreateEvent();
  ASSERT_TRUE(ev_blocked.ok() && ev_h2d.ok() && ev_scaled.ok() && ev_back.ok());

  const int64_t n = int64_t{4} << 20;  // 16 MiB
  const size_t bytes = n * sizeof(float);
  auto host_in = b().host().Allocate(LiveSet::kCheckpoints, bytes);
  auto host_out = b().host().Allocate(LiveSet::kCheckpoints, bytes);
  auto dev_a = b().device().Allocate(LiveSet::kCheckpoints, bytes);
  auto dev_b = b().device().Allocate(LiveSet::kCheckpoints, bytes);
  ASSERT_TRUE(host_in.ok() && host_out.ok() && dev_a.ok() && dev_b.ok());
  double sum_in = 0;
  for (int64_t i = 0; i < n; ++i) {
    host_in->as<float>()[i] = static_cast<float>(i % 4096) * 0.5f;
    host_out->as<float>()[i] = kNaN;
    sum_in += host_in->as<float>()[i];
  }

  // The blocker: ~1.5 GFLOP, tens to hundreds of milliseconds here.
  const int64_t gm = 1024;
  std::vector<float> ga = RandomVector(gm * gm, 43);
  float* a = Upload(ga);
  float* c = Poisoned(gm * gm);
  GemmArgs g;
  g.m = g.n = g.k = gm;
  g.a = g.b = a;
  g.c = c;
  g.lda = g.ldb = g.ldc = gm;
  ASSERT_TRUE(b().Gemm(**blocker, g).ok());
  ASSERT_TRUE((*blocker)->Record(**ev_blocked).ok());

  float* sums = Poisoned(2);
  Stream& cp = **copy;
  ASSERT_TRUE(cp.Wait(**ev_blocked).ok());
  ASSERT_TRUE(b().Copy(cp, dev_a->data(), host_in->data(), bytes).ok());  // h->d
  ASSERT_TRUE(cp.Record(**ev_h2d).ok());
  ASSERT_TRUE(s().Wait(**ev_h2d).ok());
  ASSERT_TRUE(b().Scale(s(), dev_a->as<float>(), n, 2.0f).ok());
  ASSERT_TRUE(s().Record(**ev_scaled).ok());
  ASSERT_TRUE(cp.Wait(**ev_scaled).ok());
  ASSERT_TRUE(b().Copy(cp, host_out->data(), dev_a->data(), bytes).ok());  // d->h
  ASSERT_TRUE(b().Copy(cp, dev_b->data(), host_out->data(), bytes).ok());  // h->d
  ASSERT_TRUE(cp.Record(**ev_back).ok());
  ASSERT_TRUE(s().Wait(**ev_back).ok());
  ASSERT_TRUE(b().Sum(s(), sums, dev_b->as<float>(), n).ok());

  ASSERT_TRUE(s().Synchronize().ok());
  ASSERT_TRUE(cp.Synchronize().ok());
  EXPECT_TRUE((*ev_back)->Done());
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (host_out->as<float>()[i] != 2.0f * host_in->as<float>()[i]) ++wrong;
    if (dev_b->as<float>()[i] != 2.0f * host_in->as<float>()[i]) ++wrong;
  }
  EXPECT_EQ(wrong, 0);
  // Halves and small integers: the sum is exact in double.
  EXPECT_EQ(Download(sums, 1)[0], static_cast<float>(2 * sum_in));
  ASSERT_TRUE((*blocker)->Synchronize().ok());
}

// The copy stream really runs beside the compute stream: a small copy
// enqueued after a long GEMM on another stream finishes while the GEMM is
// still running.
TEST_F(BackendTest, CopyStreamOverlapsCompute) {
  auto copy = b().CreateStream("copy");
  auto ev_gemm = b().CreateEvent(), ev_copy = b().CreateEvent();
  ASSERT_TRUE(copy.ok() && ev_gemm.ok() && ev_copy.ok());
  const int64_t gm = 2048;  // ~17 GFLOP: well over 100 ms on this machine
  std::vector<float> ga = RandomVector(gm * gm, 44);
  float* a = Upload(ga);
  float* c = Poisoned(gm * gm);
  GemmArgs g;
  g.m = g.n = g.k = gm;
  g.a = g.b = a;
  g.c = c;
  g.lda = g.ldb = g.ldc = gm;

  const size_t bytes = size_t{1} << 20;
  auto host = b().host().Allocate(LiveSet::kCheckpoints, bytes);
  auto dev = b().device().Allocate(LiveSet::kCheckpoints, bytes);
  ASSERT_TRUE(host.ok() && dev.ok());
  std::memset(host->data(), 0x5a, bytes);

  ASSERT_TRUE(b().Gemm(s(), g).ok());
  ASSERT_TRUE(s().Record(**ev_gemm).ok());
  ASSERT_TRUE(b().Copy(**copy, dev->data(), host->data(), bytes).ok());
  ASSERT_TRUE((*copy)->Record(**ev_copy).ok());
  ASSERT_TRUE((*ev_copy)->Synchronize().ok());
  EXPECT_FALSE((*ev_gemm)->Done())
      << "the copy finished only after the GEMM: the streams did not overlap";
  ASSERT_TRUE((*ev_gemm)->Synchronize().ok());
  EXPECT_TRUE((*ev_gemm)->Done());
  EXPECT_EQ(std::memcmp(dev->data(), host->data(), bytes), 0);
}

// ---------------------------------------------------------------------------
// Memory caps and Create

// The device arena's size is BackendOptions.device_memory_bytes: going over it
// is RESOURCE_EXHAUSTED naming the live set that asked and what is live.
TEST(BackendCreateTest, DeviceArenaCapIsEnforced) {
  BackendOptions options;
  options.device_memory_bytes = 1 << 20;
  options.host_memory_bytes = 1 << 19;
  auto backend = Backend::Create(options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  Backend& b = **backend;
  EXPECT_EQ(b.device().cap_bytes(), 1 << 20);

  auto weights = b.device().Allocate(LiveSet::kWeights, 700 * 1024);
  ASSERT_TRUE(weights.ok()) << weights.status();
  auto acts = b.device().Allocate(LiveSet::kActivations, 400 * 1024);
  EXPECT_EQ(acts.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string msg(acts.status().message());
  EXPECT_THAT(msg, HasSubstr("live set 'activations' asked for 409600 bytes"));
  EXPECT_THAT(msg, HasSubstr("weights=716800"));
  EXPECT_THAT(msg, HasSubstr("cap"));

  // Room is back once the weights go, and the arena is usable memory.
  weights->Release();
  acts = b.device().Allocate(LiveSet::kActivations, 400 * 1024);
  ASSERT_TRUE(acts.ok()) << acts.status();
  auto stream = b.CreateStream("compute");
  ASSERT_TRUE(stream.ok());
  const int64_t n = 400 * 1024 / sizeof(float) - 1;
  float* x = acts->as<float>();
  ASSERT_TRUE(b.Fill(**stream, x, n, 0.25f).ok());
  ASSERT_TRUE(b.Sum(**stream, x + n, x, n).ok());
  ASSERT_TRUE((*stream)->Synchronize().ok());
  EXPECT_EQ(x[n], 0.25f * n);
  EXPECT_EQ(b.device().tracker().peak(LiveSet::kWeights), 700 * 1024);

  // The host space has its own cap.
  auto pinned = b.host().Allocate(LiveSet::kCheckpoints, (1 << 19) + 1);
  EXPECT_EQ(pinned.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(pinned.status().message()), HasSubstr("'checkpoints'"));
}

TEST(BackendCreateTest, CpuBackendNeedsADeviceArenaSize) {
  BackendOptions options;
  options.kind = BackendKind::kCpu;
  options.device_memory_bytes = 0;
  auto direct = CreateCpuBackend(options);
  EXPECT_EQ(direct.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(direct.status().message()),
              HasSubstr("device_memory_bytes"));
  auto via_create = Backend::Create(options);
  EXPECT_EQ(via_create.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(via_create.status().message()),
              HasSubstr("device_memory_bytes"));

  options.device_memory_bytes = -5;
  auto negative = Backend::Create(options);
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(negative.status().message()),
              HasSubstr("device_memory_bytes: must be >= 0, got -5"));

  options.device_memory_bytes = 1 << 20;
  options.host_memory_bytes = -1;
  auto host = Backend::Create(options);
  EXPECT_EQ(host.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(host.status().message()), HasSubstr("host_memory_bytes"));
}

TEST(BackendCreateTest, CudaIsRefusedWithoutTheCudaBuild) {
  BackendOptions options;
  options.kind = BackendKind::kCuda;
  auto backend = Backend::Create(options);
#ifndef PLATEAU_WITH_CUDA
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(backend.status().message()), HasSubstr("--config=cuda"));
#else
  // Built with CUDA: either a GPU is visible, or the refusal says there is
  // none (never a crash).
  if (!backend.ok()) {
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition)
        << backend.status();
  } else {
    EXPECT_EQ((*backend)->kind(), BackendKind::kCuda);
  }
#endif
}

TEST(BackendCreateTest, DescribeNamesTheBackend) {
  BackendOptions options;
  options.device_memory_bytes = 1 << 20;
  auto backend = Backend::Create(options);
  ASSERT_TRUE(backend.ok());
  EXPECT_EQ((*backend)->kind(), BackendKind::kCpu);
  EXPECT_THAT((*backend)->Describe(), HasSubstr("cpu"));
  EXPECT_THAT((*backend)->Describe(), HasSubstr("1048576 bytes"));
}

}  // namespace
}  // namespace plateau
