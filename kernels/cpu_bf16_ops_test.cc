// The CPU emulation of bf16 mixed precision, op by op, through the Backend
// interface:
// - against a double reference computed from the same bf16 inputs (loaded
//   exactly), within a stated bound: the fp32 work's own error (k + 2 units
//   of 2^-24 per GEMM sum, a few for the elementwise formulas) plus one bf16
//   rounding of the result (at most 2^-8 relative: bf16 keeps 8 significant
//   bits);
// - bitwise against the fp32 twin of cpu_ops.h run on the loaded inputs and
//   rounded once per stored element (the rounding points the CUDA bf16
//   kernels share);
// - the same bits run to run.
#include "kernels/cpu_bf16_ops.h"

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/cpu_ops.h"
#include "kernels/testing/device_side.h"
#include "kernels/testing/bf16_testing.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

constexpr double kBf16Unit = kBf16UnitRoundoff;  // 2^-8

std::unique_ptr<Backend> CpuBackend() {
  BackendOptions o;
  o.kind = BackendKind::kCpu;
  o.device_memory_bytes = 64 << 20;
  auto b = Backend::Create(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

class CpuBf16OpsTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(dev_.Init(CpuBackend()).ok()); }
  DeviceSide dev_;
};

struct GemmCase {
  int64_t m, n, k;
  bool ta, tb;
  float alpha, beta;
};

// A packed stored matrix with a padded row stride (ld = cols + 3), so that a
// kernel that ignores the stride reads the padding.
struct Stored {
  int64_t rows, cols, ld;
  std::vector<Bf16> v;
  Bf16 At(int64_t r, int64_t c) const { return v[r * ld + c]; }
};
Stored MakeStored(int64_t rows, int64_t cols, uint32_t seed) {
  Stored s{rows, cols, cols + 3, RandomBf16(rows * (cols + 3), seed)};
  return s;
}

TEST_F(CpuBf16OpsTest, GemmIsWithinFp32AccumulationAndOneRoundingOfADoubleReference) {
  const GemmCase cases[] = {
      {7, 5, 3, false, false, 1.0f, 0.0f},   {33, 17, 64, false, true, 1.0f, 0.0f},
      {16, 40, 29, true, false, 0.5f, 1.0f}, {9, 11, 200, true, true, -2.0f, 0.25f},
      {4, 6, 0, false, false, 1.0f, 0.5f},   // k = 0: C = beta C
  };
  uint32_t seed = 1;
  for (const GemmCase& t : cases) {
    for (bool bf16_out : {true, false}) {
      SCOPED_TRACE(::testing::Message() << t.m << "x" << t.n << "x" << t.k << " ta=" << t.ta
                                        << " tb=" << t.tb << " beta=" << t.beta
                                        << (bf16_out ? " bf16 C" : " fp32 C"));
      const Stored a = MakeStored(t.ta ? t.k : t.m, t.ta ? t.m : t.k, seed++);
      const Stored b = MakeStored(t.tb ? t.n : t.k, t.tb ? t.k : t.n, seed++);
      const int64_t ldc = t.n + 2;
      const std::vector<Bf16> c0 = RandomBf16(t.m * ldc, seed++);
      std::vector<float> c0f = Loaded(c0);
      GemmBf16Args g;
      g.trans_a = t.ta;
      g.trans_b = t.tb;
      g.m = t.m;
      g.n = t.n;
      g.k = t.k;
      g.alpha = t.alpha;
      g.beta = t.beta;
      g.a = dev_.UploadBf16(a.v);
      g.lda = a.ld;
      g.b = dev_.UploadBf16(b.v);
      g.ldb = b.ld;
      g.ldc = ldc;
      if (bf16_out) {
        g.c = dev_.UploadBf16(c0);
      } else {
        g.c_fp32 = dev_.Upload(c0f);
      }
      ASSERT_TRUE(dev_.b().GemmBf16(dev_.s(), g).ok());
      const std::vector<float> out = bf16_out ? Loaded(dev_.DownloadBf16(g.c, t.m * ldc))
                                              : dev_.Download(g.c_fp32, t.m * ldc);
      double worst = 0;
      for (int64_t i = 0; i < t.m; ++i) {
        for (int64_t j = 0; j < t.n; ++j) {
          double sum = 0, mag = 0;
          for (int64_t p = 0; p < t.k; ++p) {
            const double x = Bf16ToFloat(t.ta ? a.At(p, i) : a.At(i, p));
            const double y = Bf16ToFloat(t.tb ? b.At(j, p) : b.At(p, j));
            sum += x * y;
            mag += std::fabs(x * y);
          }
          const double c = c0f[i * ldc + j];
          const double ref = t.alpha * sum + t.beta * c;
          const double s = std::fabs(t.alpha) * mag + std::fabs(t.beta * c);
          const double acc_err = (t.k + 3) * kFp32Unit * s;
          const double bound = bf16_out ? kBf16Unit * (std::fabs(ref) + acc_err) + acc_err : acc_err;
          const double err = std::fabs(out[i * ldc + j] - ref);
          ASSERT_LE(err, bound) << "C[" << i << "," << j << "] = " << out[i * ldc + j]
                                << ", reference " << ref;
          worst = std::max(worst, err);
        }
        // The padding of each C row is not written.
        for (int64_t j = t.n; j < ldc; ++j) {
          ASSERT_EQ(out[i * ldc + j], c0f[i * ldc + j]) << "padding C[" << i << "," << j << "]";
        }
      }
    }
  }
}

TEST_F(CpuBf16OpsTest, GemmIsTheFp32GemmOfTheLoadedInputsRoundedOnceAndRepeatsBitwise) {
  const int64_t m = 37, n = 23, k = 51;
  const std::vector<Bf16> a = RandomBf16(m * k, 11), b = RandomBf16(n * k, 12),
                          c0 = RandomBf16(m * n, 13);
  GemmBf16Args g;
  g.trans_b = true;
  g.m = m;
  g.n = n;
  g.k = k;
  g.alpha = 0.75f;
  g.beta = 1.0f;
  g.a = dev_.UploadBf16(a);
  g.lda = k;
  g.b = dev_.UploadBf16(b);
  g.ldb = k;
  g.ldc = n;
  std::vector<std::vector<uint16_t>> runs;
  for (int r = 0; r < 2; ++r) {
    g.c = dev_.UploadBf16(c0);
    ASSERT_TRUE(dev_.b().GemmBf16(dev_.s(), g).ok());
    runs.push_back(Bits(dev_.DownloadBf16(g.c, m * n)));
  }
  EXPECT_EQ(runs[0], runs[1]);
  // The fp32 twin: sgemm on the loaded inputs (beta 0), then the epilogue
  // alpha-scaled sum + beta C in fp32 and one rounding.
  const std::vector<float> af = Loaded(a), bf = Loaded(b), cf = Loaded(c0);
  std::vector<float> acc(m * n);
  GemmArgs f;
  f.trans_b = true;
  f.m = m;
  f.n = n;
  f.k = k;
  f.alpha = g.alpha;
  f.a = af.data();
  f.lda = k;
  f.b = bf.data();
  f.ldb = k;
  f.beta = 0.0f;
  f.c = acc.data();
  f.ldc = n;
  cpu::Gemm(f);
  std::vector<float> want(m * n);
  for (int64_t i = 0; i < m * n; ++i) want[i] = acc[i] + g.beta * cf[i];
  EXPECT_EQ(runs[0], Bits(Rounded(want)));
}

// The expert groups' GEMMs: each C bitwise what GemmBf16 gives for the
// entry alone; overlapping outputs are refused naming the entries.
TEST_F(CpuBf16OpsTest, GroupedGemmIsEachGemmAndChecksOverlaps) {
  const int64_t H = 24, F = 40;
  const int64_t rows[] = {5, 0, 17, 3};
  std::vector<GemmBf16Args> gemms;
  std::vector<std::pair<Bf16*, int64_t>> outs;
  uint32_t seed = 70;
  for (int64_t r : rows) {
    GemmBf16Args g;
    g.m = r;
    g.n = F;
    g.k = H;
    g.a = dev_.UploadBf16(RandomBf16(std::max<int64_t>(r * H, 1), seed++));
    g.lda = H;
    g.b = dev_.UploadBf16(RandomBf16(H * F, seed++));
    g.ldb = F;
    g.c = dev_.PoisonedBf16(std::max<int64_t>(r * F, 1));
    g.ldc = F;
    gemms.push_back(g);
    outs.push_back({g.c, r * F});
  }
  ASSERT_TRUE(dev_.b().GroupedGemmBf16(dev_.s(), gemms).ok());
  std::vector<std::vector<uint16_t>> grouped;
  for (const auto& [p, n] : outs) grouped.push_back(Bits(dev_.DownloadBf16(p, n)));
  for (size_t i = 0; i < gemms.size(); ++i) {
    GemmBf16Args g = gemms[i];
    g.c = dev_.PoisonedBf16(std::max<int64_t>(outs[i].second, 1));
    ASSERT_TRUE(dev_.b().GemmBf16(dev_.s(), g).ok());
    EXPECT_EQ(grouped[i], Bits(dev_.DownloadBf16(g.c, outs[i].second))) << "gemms[" << i << "]";
  }
  gemms[3].c = gemms[0].c + 1;
  EXPECT_THAT(dev_.b().GroupedGemmBf16(dev_.s(), gemms).message(),
              HasSubstr("grouped gemm_bf16: gemms[0].c and gemms[3].c overlap"));
  gemms[3].c = const_cast<Bf16*>(gemms[2].a);
  EXPECT_THAT(dev_.b().GroupedGemmBf16(dev_.s(), gemms).message(),
              HasSubstr("grouped gemm_bf16: gemms[3].c overlaps an input of gemms[2]"));
  gemms[3].lda = 1;
  EXPECT_THAT(dev_.b().GroupedGemmBf16(dev_.s(), gemms).message(),
              HasSubstr("grouped gemm_bf16: gemms[3]: gemm_bf16: lda = 1"));
}

TEST_F(CpuBf16OpsTest, GemmArgumentsAreCheckedNamingTheField) {
  Bf16 x[4] = {};
  float y[4] = {};
  GemmBf16Args g;
  g.m = g.n = g.k = 2;
  g.a = g.b = x;
  g.lda = g.ldb = g.ldc = 2;
  g.c = x + 2;
  g.c_fp32 = y;
  EXPECT_THAT(dev_.b().GemmBf16(dev_.s(), g).message(), HasSubstr("gemm_bf16: exactly one of c"));
  g.c_fp32 = nullptr;
  g.c = nullptr;
  EXPECT_THAT(dev_.b().GemmBf16(dev_.s(), g).message(), HasSubstr("gemm_bf16: exactly one of c"));
  g.c = x + 2;
  g.lda = 1;
  const absl::Status st = dev_.b().GemmBf16(dev_.s(), g);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("gemm_bf16: lda = 1 is less than the 2 columns of A"));
}

TEST_F(CpuBf16OpsTest, ConversionsRoundToNearestEvenAndLoadExactly) {
  std::vector<float> x = {1.0f, 1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -3.3f, 0.0f, 1e-40f, 3e38f};
  const int64_t n = static_cast<int64_t>(x.size());
  Bf16* b = dev_.PoisonedBf16(n);
  ASSERT_TRUE(dev_.b().ConvertToBf16(dev_.s(), b, dev_.Upload(x), n).ok());
  const std::vector<Bf16> got = dev_.DownloadBf16(b, n);
  EXPECT_EQ(Bits(got), Bits(Rounded(x)));
  float* back = dev_.Poisoned(n);
  ASSERT_TRUE(dev_.b().ConvertToFloat(dev_.s(), back, b, n).ok());
  EXPECT_EQ(dev_.Download(back, n), Loaded(got));
  EXPECT_THAT(dev_.b().ConvertToBf16(dev_.s(), nullptr, x.data(), 3).message(),
              HasSubstr("convert_to_bf16: out is null"));
}

// Fill stores rn(value); Add is rn(a + b) of the loaded values (a single
// fp32 addition, exact for most pairs, so within one bf16 rounding, 2^-8
// relative, of the double sum) and may write over an input; SumSquares is
// the fp32 twin's double-block reduction of the loaded values (no rounding
// to bf16), within n 2^-24 of a double sum of squares.
TEST_F(CpuBf16OpsTest, FillAddAndSumSquaresOnLoadedValues) {
  const int64_t n = 70001;  // more than one task of 2^16 elements
  const std::vector<Bf16> a = RandomBf16(n, 41), b = RandomBf16(n, 42, 0.01f);
  Bf16* f = dev_.PoisonedBf16(n);
  ASSERT_TRUE(dev_.b().FillBf16(dev_.s(), f, n, 1.0f + 1.0f / 512).ok());  // a tie: to even
  for (const Bf16& x : dev_.DownloadBf16(f, n)) ASSERT_EQ(x.bits, FloatToBf16(1.0f).bits);
  Bf16* da = dev_.UploadBf16(a);
  Bf16* out = dev_.PoisonedBf16(n);
  ASSERT_TRUE(dev_.b().AddBf16(dev_.s(), out, da, dev_.UploadBf16(b), n).ok());
  const std::vector<float> af = Loaded(a), bf = Loaded(b);
  std::vector<float> sum(n);
  for (int64_t i = 0; i < n; ++i) sum[i] = af[i] + bf[i];
  const std::vector<Bf16> got = dev_.DownloadBf16(out, n);
  EXPECT_EQ(Bits(got), Bits(Rounded(sum)));
  for (int64_t i = 0; i < n; ++i) {
    const double ref = double{af[i]} + bf[i];
    ASSERT_LE(std::fabs(Bf16ToFloat(got[i]) - ref), kBf16UnitRoundoff * std::fabs(ref) * 1.0001) << i;
  }
  // In place: out aliases a.
  ASSERT_TRUE(dev_.b().AddBf16(dev_.s(), da, da, dev_.UploadBf16(b), n).ok());
  EXPECT_EQ(Bits(dev_.DownloadBf16(da, n)), Bits(got));
  float* sq = dev_.Poisoned(1);
  ASSERT_TRUE(dev_.b().SumSquaresBf16(dev_.s(), sq, dev_.UploadBf16(a), n).ok());
  float want = 0.0f;
  cpu::SumSquares(&want, af.data(), n);
  const float got_sq = dev_.Download(sq, 1)[0];
  EXPECT_EQ(got_sq, want);
  double ref = 0;
  for (float x : af) ref += double{x} * x;
  EXPECT_LE(std::fabs(got_sq - ref), 2.0 / (1 << 24) * ref);  // one fp32 rounding of a double sum
  EXPECT_THAT(dev_.b().AddBf16(dev_.s(), out, nullptr, out, 3).message(),
              HasSubstr("add_bf16: a is null"));
  EXPECT_THAT(dev_.b().SumSquaresBf16(dev_.s(), nullptr, out, 3).message(),
              HasSubstr("sum_squares_bf16: out is null"));
}

// SumRows is rn(((x_0 + x_1) + ...) + x_{rows-1}), fp32 adds of the loaded
// rows in row order at a row stride ld > n (the padding is never read),
// rounded once: within one bf16 rounding of the exact sum when the fp32 sum
// is exact (alike terms of one magnitude); one row is itself. Arguments
// are checked: rows >= 1, ld >= n, out apart from x.
TEST_F(CpuBf16OpsTest, SumRowsIsTheRowOrderFp32SumRoundedOnce) {
  const int64_t n = 70001, ld = n + 3;  // more than one task of 2^16 elements
  for (int64_t rows : {int64_t{1}, int64_t{2}, int64_t{7}}) {
    std::vector<Bf16> x = RandomBf16(rows * ld, 50 + rows);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = n; i < ld; ++i) x[r * ld + i] = Bf16{0x7FC1};  // NaN: never read
    }
    Bf16* out = dev_.PoisonedBf16(n);
    ASSERT_TRUE(dev_.b().SumRowsBf16(dev_.s(), out, dev_.UploadBf16(x), rows, n, ld).ok());
    const std::vector<Bf16> got = dev_.DownloadBf16(out, n);
    std::vector<float> sum(n);
    for (int64_t i = 0; i < n; ++i) {
      float acc = Bf16ToFloat(x[i]);
      for (int64_t r = 1; r < rows; ++r) acc += Bf16ToFloat(x[r * ld + i]);
      sum[i] = acc;
    }
    EXPECT_EQ(Bits(got), Bits(Rounded(sum))) << rows << " rows";
    if (rows == 1) {
      EXPECT_EQ(Bits(got), Bits(std::vector<Bf16>(x.begin(), x.begin() + n)));
    }
  }
  // Alike terms (one sign, mantissa in [1, 2) at 2^-3): the 7-term fp32
  // sum is exact, so the result is the exact sum rounded once.
  const int64_t rows = 7;
  std::vector<Bf16> x(rows * n);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> m(1.0f, 2.0f);
  for (Bf16& v : x) v = FloatToBf16(0.125f * m(rng));
  Bf16* out = dev_.PoisonedBf16(n);
  ASSERT_TRUE(dev_.b().SumRowsBf16(dev_.s(), out, dev_.UploadBf16(x), rows, n, n).ok());
  const std::vector<Bf16> got = dev_.DownloadBf16(out, n);
  for (int64_t i = 0; i < n; ++i) {
    double exact = 0;
    for (int64_t r = 0; r < rows; ++r) exact += Bf16ToFloat(x[r * n + i]);
    ASSERT_LE(std::fabs(Bf16ToFloat(got[i]) - exact), kBf16Unit * exact) << i;
  }
  Bf16* d = dev_.UploadBf16(x);
  EXPECT_THAT(dev_.b().SumRowsBf16(dev_.s(), out, d, 0, n, n).message(),
              HasSubstr("sum_rows_bf16: rows must be >= 1, got 0"));
  EXPECT_THAT(dev_.b().SumRowsBf16(dev_.s(), out, d, 2, n, n - 1).message(),
              HasSubstr("sum_rows_bf16: ld = 70000 is less than n = 70001"));
  EXPECT_THAT(dev_.b().SumRowsBf16(dev_.s(), d + n, d, 2, n, n).message(), HasSubstr("sum_rows_bf16: out overlaps x"));
  EXPECT_THAT(dev_.b().SumRowsBf16(dev_.s(), out, nullptr, 2, n, n).message(), HasSubstr("sum_rows_bf16: x is null"));
}

// AddRows is rn(((out + x_{rows[0]}) + ...) + x_{rows[r-1]}): out's loaded
// value, then the listed rows of x (any order, repeats allowed) in list
// order, fp32 adds, one rounding; the rows between are never read. A list
// longer than Backend::kBf16AddRowsPerCall rounds once per group of that
// many. Equal terms show what it is for: out = 1 plus 63 rows of 1 + 2^-7
// is 64 + 63 2^-7 = 64.49..., rounded once to 64.5; added one rounding at a
// time, each 1 + 2^-7 is lost below the unit of the growing sum (from 2 on,
// the add rounds to even), giving 64. Arguments are checked.
TEST_F(CpuBf16OpsTest, AddRowsIsOutPlusTheListedRowsInFp32RoundedOnce) {
  const int64_t n = 70001, ld = n + 3, rows_in_x = 9;
  std::vector<Bf16> x = RandomBf16(rows_in_x * ld, 61);
  for (int64_t r = 0; r < rows_in_x; ++r) {
    for (int64_t i = n; i < ld; ++i) x[r * ld + i] = Bf16{0x7FC1};  // NaN: never read
  }
  for (int64_t i = 0; i < n; ++i) x[4 * ld + i] = Bf16{0x7FC1};  // row 4 is never listed
  const std::vector<Bf16> start = RandomBf16(n, 62);
  const Bf16* dx = dev_.UploadBf16(x);
  for (const std::vector<int32_t>& list :
       {std::vector<int32_t>{}, std::vector<int32_t>{8}, std::vector<int32_t>{0, 5, 2, 8, 3, 5}}) {
    Bf16* out = dev_.UploadBf16(start);
    ASSERT_TRUE(dev_.b().AddRowsBf16(dev_.s(), out, dx, list, ld, n).ok());
    const std::vector<Bf16> got = dev_.DownloadBf16(out, n);
    std::vector<float> sum(n);
    for (int64_t i = 0; i < n; ++i) {
      float acc = Bf16ToFloat(start[i]);
      for (int32_t r : list) acc += Bf16ToFloat(x[r * ld + i]);
      sum[i] = acc;
    }
    EXPECT_EQ(Bits(got), Bits(Rounded(sum))) << list.size() << " rows";
  }

  // Equal terms, and a list longer than one call.
  const int64_t m = 5, k = Backend::kBf16AddRowsPerCall;
  const std::vector<Bf16> ones(m, FloatToBf16(1.0f));
  const std::vector<Bf16> terms(m, FloatToBf16(1.0f + 0x1p-7f));
  Bf16* out = dev_.UploadBf16(ones);
  const Bf16* term = dev_.UploadBf16(terms);
  ASSERT_TRUE(dev_.b().AddRowsBf16(dev_.s(), out, term, std::vector<int32_t>(k - 1, 0), m, m).ok());
  for (Bf16 v : dev_.DownloadBf16(out, m)) EXPECT_EQ(Bf16ToFloat(v), 64.5f);
  float one_at_a_time = 1.0f;
  for (int64_t r = 0; r < k - 1; ++r) one_at_a_time = RoundToBf16(one_at_a_time + (1.0f + 0x1p-7f));
  EXPECT_EQ(one_at_a_time, 64.0f) << "the stall the one rounding avoids";
  // k + 2 rows: the first k in one fp32 sum (1 + 64 (1 + 2^-7) = 65.5, which
  // bf16 holds), then the last two (67.515625, rounded to 67.5).
  out = dev_.UploadBf16(ones);
  ASSERT_TRUE(dev_.b().AddRowsBf16(dev_.s(), out, term, std::vector<int32_t>(k + 2, 0), m, m).ok());
  float grouped = RoundToBf16(1.0f + static_cast<float>(k) * (1.0f + 0x1p-7f));
  grouped = RoundToBf16(grouped + 2 * (1.0f + 0x1p-7f));
  for (Bf16 v : dev_.DownloadBf16(out, m)) EXPECT_EQ(Bf16ToFloat(v), grouped);

  Bf16* o = dev_.PoisonedBf16(n);
  const std::vector<int32_t> one{1};
  EXPECT_THAT(dev_.b().AddRowsBf16(dev_.s(), o, dx, one, n - 1, n).message(),
              HasSubstr("add_rows_bf16: ld = 70000 is less than n = 70001"));
  EXPECT_THAT(dev_.b().AddRowsBf16(dev_.s(), o, dx, std::vector<int32_t>{2, -1}, ld, n).message(),
              HasSubstr("add_rows_bf16: rows[1] = -1 is negative"));
  EXPECT_THAT(dev_.b().AddRowsBf16(dev_.s(), const_cast<Bf16*>(dx) + ld + 2, dx, one, ld, n).message(),
              HasSubstr("add_rows_bf16: out overlaps row 1 of x"));
  EXPECT_THAT(dev_.b().AddRowsBf16(dev_.s(), o, nullptr, one, ld, n).message(), HasSubstr("add_rows_bf16: x is null"));
  EXPECT_THAT(dev_.b().AddRowsBf16(dev_.s(), nullptr, dx, one, ld, n).message(),
              HasSubstr("add_rows_bf16: out is null"));
}

TEST_F(CpuBf16OpsTest, SwiGluWithinBoundsOfDoubleAndBitwiseTheRoundedFp32Twin) {
  const int64_t n = 1003;  // not a multiple of the 8 lanes: the tail too
  const std::vector<Bf16> gate = RandomBf16(n, 21, 3.0f), up = RandomBf16(n, 22),
                          dout = RandomBf16(n, 23);
  const Bf16 *dg = dev_.UploadBf16(gate), *du = dev_.UploadBf16(up), *dd = dev_.UploadBf16(dout);
  Bf16* out = dev_.PoisonedBf16(n);
  Bf16* dgate = dev_.PoisonedBf16(n);
  Bf16* dup = dev_.PoisonedBf16(n);
  ASSERT_TRUE(dev_.b().SwiGluForwardBf16(dev_.s(), out, dg, du, n).ok());
  ASSERT_TRUE(dev_.b().SwiGluBackwardBf16(dev_.s(), dgate, dup, dd, dg, du, n).ok());
  const std::vector<Bf16> o = dev_.DownloadBf16(out, n), dgo = dev_.DownloadBf16(dgate, n),
                          duo = dev_.DownloadBf16(dup, n);
  const std::vector<float> g = Loaded(gate), u = Loaded(up), d = Loaded(dout);
  for (int64_t i = 0; i < n; ++i) {
    const double s = 1.0 / (1.0 + std::exp(-static_cast<double>(g[i])));
    const double ref_o = g[i] * s * u[i];
    const double ref_dg = d[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
    const double ref_du = d[i] * g[i] * s;
    // exp within 1 ulp and three to five fp32 roundings: 16 units covers
    // them; dgate's 1 + g (1 - s) loses up to |g| units of 1 - s absolutely.
    ASSERT_LE(std::fabs(Bf16ToFloat(o[i]) - ref_o), (kBf16Unit + 16 * kFp32Unit) * std::fabs(ref_o))
        << i;
    ASSERT_LE(std::fabs(Bf16ToFloat(dgo[i]) - ref_dg),
              kBf16Unit * std::fabs(ref_dg) +
                  32 * kFp32Unit * std::fabs(d[i] * u[i]) * (1.0 + std::fabs(g[i])))
        << i;
    ASSERT_LE(std::fabs(Bf16ToFloat(duo[i]) - ref_du),
              (kBf16Unit + 16 * kFp32Unit) * std::fabs(ref_du))
        << i;
  }
  std::vector<float> fo(n), fdg(n), fdu(n);
  cpu::SwiGluForward(fo.data(), g.data(), u.data(), n);
  cpu::SwiGluBackward(fdg.data(), fdu.data(), d.data(), g.data(), u.data(), n);
  EXPECT_EQ(Bits(o), Bits(Rounded(fo)));
  EXPECT_EQ(Bits(dgo), Bits(Rounded(fdg)));
  EXPECT_EQ(Bits(duo), Bits(Rounded(fdu)));
}

TEST_F(CpuBf16OpsTest, RmsNormWithinBoundsOfDoubleAndBitwiseTheRoundedFp32Twin) {
  const int64_t rows = 37, cols = 70;  // 70 columns: a full and a partial column task
  const float eps = 1e-5f;
  const std::vector<Bf16> x = RandomBf16(rows * cols, 31, 2.0f), w = RandomBf16(cols, 32),
                          dout = RandomBf16(rows * cols, 33), dw0 = RandomBf16(cols, 34, 0.1f);
  const Bf16 *dx_in = dev_.UploadBf16(x), *dw_in = dev_.UploadBf16(w),
             *dd = dev_.UploadBf16(dout);
  Bf16* out = dev_.PoisonedBf16(rows * cols);
  float* rstd = dev_.Poisoned(rows);
  ASSERT_TRUE(dev_.b().RmsNormForwardBf16(dev_.s(), out, rstd, dx_in, dw_in, rows, cols, eps).ok());
  Bf16* dx = dev_.PoisonedBf16(rows * cols);
  Bf16* dweight = dev_.UploadBf16(dw0);
  ASSERT_TRUE(
      dev_.b().RmsNormBackwardBf16(dev_.s(), dx, dweight, dd, dx_in, dw_in, rstd, rows, cols).ok());
  const std::vector<Bf16> o = dev_.DownloadBf16(out, rows * cols),
                          dxo = dev_.DownloadBf16(dx, rows * cols),
                          dwo = dev_.DownloadBf16(dweight, cols);
  const std::vector<float> r = dev_.Download(rstd, rows);
  const std::vector<float> xf = Loaded(x), wf = Loaded(w), df = Loaded(dout), dw0f = Loaded(dw0);
  std::vector<double> ref_dw(cols), mag_dw(cols);
  for (int64_t c = 0; c < cols; ++c) ref_dw[c] = mag_dw[c] = std::fabs(dw0f[c]);
  for (int64_t c = 0; c < cols; ++c) ref_dw[c] = dw0f[c];
  for (int64_t i = 0; i < rows; ++i) {
    double ss = 0;
    for (int64_t c = 0; c < cols; ++c) ss += static_cast<double>(xf[i * cols + c]) * xf[i * cols + c];
    const double ref_r = 1.0 / std::sqrt(ss / cols + eps);
    // rstd: a double sum and one fp32 rounding (2 units for the sqrt/div).
    ASSERT_LE(std::fabs(r[i] - ref_r), 2 * kFp32Unit * ref_r) << "rstd[" << i << "]";
    // The backward uses the rstd it is given (r[i]), as the kernel does.
    const double rs = r[i];
    double dot = 0, dot_mag = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const double t = static_cast<double>(df[i * cols + c]) * wf[c] * xf[i * cols + c];
      dot += t;
      dot_mag += std::fabs(t);
    }
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t e = i * cols + c;
      const double ref_o = xf[e] * ref_r * wf[c];
      ASSERT_LE(std::fabs(Bf16ToFloat(o[e]) - ref_o), (kBf16Unit + 8 * kFp32Unit) * std::fabs(ref_o))
          << "out[" << e << "]";
      const double term1 = rs * df[e] * wf[c], term2 = xf[e] * dot * rs * rs * rs / cols;
      const double ref_dx = term1 - term2;
      const double mag = std::fabs(term1) + std::fabs(xf[e]) * dot_mag * rs * rs * rs / cols;
      ASSERT_LE(std::fabs(Bf16ToFloat(dxo[e]) - ref_dx), kBf16Unit * std::fabs(ref_dx) + 16 * kFp32Unit * mag)
          << "dx[" << e << "]";
      ref_dw[c] += static_cast<double>(df[e]) * xf[e] * rs;
      mag_dw[c] += std::fabs(static_cast<double>(df[e]) * xf[e] * rs);
    }
  }
  for (int64_t c = 0; c < cols; ++c) {
    ASSERT_LE(std::fabs(Bf16ToFloat(dwo[c]) - ref_dw[c]),
              kBf16Unit * std::fabs(ref_dw[c]) + 4 * kFp32Unit * mag_dw[c])
        << "dweight[" << c << "]";
  }
  // The fp32 twin on the loaded inputs, rounded once.
  std::vector<float> fo(rows * cols), fr(rows), fdx(rows * cols), fdw = dw0f;
  cpu::RmsNormForward(fo.data(), fr.data(), xf.data(), wf.data(), rows, cols, eps);
  cpu::RmsNormBackward(fdx.data(), fdw.data(), df.data(), xf.data(), wf.data(), fr.data(), rows, cols);
  EXPECT_EQ(r, fr);
  EXPECT_EQ(Bits(o), Bits(Rounded(fo)));
  EXPECT_EQ(Bits(dxo), Bits(Rounded(fdx)));
  EXPECT_EQ(Bits(dwo), Bits(Rounded(fdw)));
}

TEST_F(CpuBf16OpsTest, RmsNormForwardMayWriteOverItsInput) {
  const int64_t rows = 5, cols = 9;
  const std::vector<Bf16> x = RandomBf16(rows * cols, 41), w = RandomBf16(cols, 42);
  Bf16* io = dev_.UploadBf16(x);
  Bf16* sep = dev_.PoisonedBf16(rows * cols);
  float* rstd = dev_.Poisoned(rows);
  const Bf16* wd = dev_.UploadBf16(w);
  ASSERT_TRUE(dev_.b().RmsNormForwardBf16(dev_.s(), sep, rstd, io, wd, rows, cols, 1e-5f).ok());
  ASSERT_TRUE(dev_.b().RmsNormForwardBf16(dev_.s(), io, rstd, io, wd, rows, cols, 1e-5f).ok());
  EXPECT_EQ(Bits(dev_.DownloadBf16(io, rows * cols)), Bits(dev_.DownloadBf16(sep, rows * cols)));
}

// Three steps: the master is exactly the fp32 AdamW on the loaded gradient
// (cpu_ops.h's AdamW, tested against torch's formula in backend_test), the
// moments too, and the working copy is one rounding of the updated master.
// A step smaller than half a bf16 unit leaves the working weight unchanged
// but is kept by the master: the reason the master stays fp32.
TEST_F(CpuBf16OpsTest, AdamWStepsTheFp32MasterAndRoundsTheWorkingCopyOnce) {
  const int64_t n = 1001;
  AdamWArgs args;
  args.lr = 1e-3f;
  args.weight_decay = 0.1f;
  args.grad_scale = 0.5f;
  std::vector<float> master0(n);
  {
    std::mt19937 rng(51);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (float& x : master0) x = dist(rng);
  }
  float* master = dev_.Upload(master0);
  float* m = dev_.Upload(std::vector<float>(n, 0.0f));
  float* v = dev_.Upload(std::vector<float>(n, 0.0f));
  Bf16* working = dev_.PoisonedBf16(n);
  std::vector<float> want_p = master0, want_m(n, 0.0f), want_v(n, 0.0f);
  for (int64_t t = 1; t <= 3; ++t) {
    SCOPED_TRACE(::testing::Message() << "step " << t);
    args.step = t;
    const std::vector<Bf16> grad = RandomBf16(n, 60 + t);
    ASSERT_TRUE(dev_.b().AdamWBf16(dev_.s(), master, dev_.UploadBf16(grad), m, v, working, n, args).ok());
    const std::vector<float> gf = Loaded(grad);
    cpu::AdamW(want_p.data(), gf.data(), want_m.data(), want_v.data(), n, args);
    EXPECT_EQ(dev_.Download(master, n), want_p);
    EXPECT_EQ(dev_.Download(m, n), want_m);
    EXPECT_EQ(dev_.Download(v, n), want_v);
    EXPECT_EQ(Bits(dev_.DownloadBf16(working, n)), Bits(Rounded(want_p)));
  }
  // After three steps of ~lr each, the master moved by ~3e-3 relative to
  // values of size ~1: some weights' working copies did not move at all.
  int64_t unmoved = 0;
  const std::vector<Bf16> w = dev_.DownloadBf16(working, n);
  for (int64_t i = 0; i < n; ++i) unmoved += w[i].bits == FloatToBf16(master0[i]).bits;
  EXPECT_GT(unmoved, 0);
  EXPECT_THAT(dev_.b().AdamWBf16(dev_.s(), master, nullptr, m, v, working, n, args).message(),
              HasSubstr("adamw_bf16: grad is null"));
}

}  // namespace
}  // namespace plateau
