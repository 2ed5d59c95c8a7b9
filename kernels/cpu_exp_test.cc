#include "kernels/cpu_exp.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace plateau::cpu {
namespace {

// Distance in units in the last place between two finite floats of one sign.
int64_t UlpDistance(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  return std::llabs(static_cast<int64_t>(ia) - ib);
}

// Points over [-104, 89] plus the range's edges: the
// scalar Exp and the 8-lane path within 2 ulps of the correctly rounded exp
// (double std::exp rounded once) where that is a normal float, within two
// subnormal steps below, and bitwise equal to each other.
TEST(CpuExpTest, WithinTwoUlpsOfStdExpOverTheRange) {
  // ~9.7M evenly spaced points, then both signs of 2^-k (small |x|).
  std::vector<float> xs;
  for (int64_t i = 0; i <= 9650000; ++i) xs.push_back(static_cast<float>(-104.0 + 2e-5 * i));
  for (int k = 0; k < 120; ++k) {
    xs.push_back(std::ldexp(1.0f, -k));
    xs.push_back(-std::ldexp(1.0f, -k));
  }
  for (float e : {-87.33654f, -87.3f, 88.72f, 88.7228f, 0.0f, -0.0f, 1e-8f, -1e-8f}) xs.push_back(e);
  std::vector<float> y(xs.size());
  ExpShiftScale(xs.data(), 0.0f, 1.0f, y.data(), static_cast<int64_t>(xs.size()));
  int64_t max_ulps = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const float want = static_cast<float>(std::exp(static_cast<double>(xs[i])));
    const float got = Exp(xs[i]);
    ASSERT_EQ(std::memcmp(&got, &y[i], 4), 0) << "lanes and scalar differ at x = " << xs[i];
    if (want >= std::numeric_limits<float>::min() && std::isfinite(want)) {
      max_ulps = std::max(max_ulps, UlpDistance(got, want));
      ASSERT_LE(UlpDistance(got, want), 2) << "x = " << xs[i] << " got " << got << " want " << want;
    } else if (std::isfinite(want)) {
      ASSERT_LE(std::fabs(got - want), 2 * std::numeric_limits<float>::denorm_min()) << "x = " << xs[i];
    } else {
      ASSERT_TRUE(std::isinf(got)) << "x = " << xs[i];
    }
  }
  std::printf("max error vs correctly rounded exp: %lld ulps over %zu points\n",
              static_cast<long long>(max_ulps), xs.size());
}

TEST(CpuExpTest, EdgeValues) {
  EXPECT_EQ(Exp(-INFINITY), 0.0f);
  EXPECT_EQ(Exp(-200.0f), 0.0f);
  EXPECT_TRUE(std::isinf(Exp(89.0f)));
  EXPECT_TRUE(std::isinf(Exp(INFINITY)));
  EXPECT_TRUE(std::isnan(Exp(NAN)));
  EXPECT_EQ(Exp(0.0f), 1.0f);
  float in[9] = {-INFINITY, NAN, INFINITY, 0.0f, 1.0f, -1.0f, 2.0f, -2.0f, 3.0f}, out[9];
  ExpShiftScale(in, 0.0f, 1.0f, out, 9);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_TRUE(std::isnan(out[1]));
  EXPECT_TRUE(std::isinf(out[2]));
  EXPECT_EQ(out[3], 1.0f);
}

// The sum is the same whatever the alignment of the groups of 8: it depends
// on n only, and the stored values equal the scalar Exp.
TEST(CpuExpTest, ExpShiftSumMatchesScalarLanes) {
  for (int64_t n : {1, 7, 8, 9, 31, 100}) {
    std::vector<float> x(n), y(n);
    for (int64_t i = 0; i < n; ++i) x[i] = std::sin(0.7f * i) * 5.0f;
    const float sum = ExpShiftSum(x.data(), 1.5f, y.data(), n);
    float lanes[8] = {};
    for (int64_t i = 0; i < n; ++i) {
      const float e = Exp(x[i] - 1.5f);
      ASSERT_EQ(e, y[i]);
      lanes[i < n / 8 * 8 ? i % 8 : i - n / 8 * 8] += e;
    }
    const float want = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) +
                       ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    EXPECT_EQ(sum, want) << n;
    EXPECT_EQ(ExpShiftSumOnly(x.data(), 1.5f, n), sum) << n;
  }
}

}  // namespace
}  // namespace plateau::cpu
