// DenseProjection on its own: the loss sum and count, dz and dW against a
// double reference of mean cross-entropy with ignored targets, including
// logits in the thousands (the log-sum-exp must be the stable one); the
// kProjection live set is exactly BoundBytes from Create on; same bits run
// to run.
//
// Tolerances: fp32 rounding at these shapes (H <= 16, V <= 53): the loss
// within 1e-5 relative, gradients within 1e-4 of the largest magnitude of
// the quantity compared.
#include "kernels/projection/dense_projection.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/model/config.h"
#include "kernels/model/model_kernels.h"
#include "kernels/status_macros.h"
#include "kernels/testing/compare.h"
#include "kernels/testing/local_world.h"

namespace plateau {
namespace {

// z [N, H], targets [N] (every 7th ignored),
// W [V, H], and the dW the backward accumulates into.
struct Problem {
  int64_t N, H, V;
  std::vector<float> z, w, dw0;
  std::vector<int32_t> y;
};

Problem Make(int64_t N, int64_t H, int64_t V, float scale, uint64_t seed) {
  Problem pr{N, H, V, {}, {}, {}, {}};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  pr.z.resize(N * H);
  for (float& e : pr.z) e = n(rng);
  pr.w.resize(V * H);
  for (float& e : pr.w) e = n(rng) * scale;
  pr.dw0.resize(V * H);
  for (float& e : pr.dw0) e = n(rng) * 0.1f;
  pr.y.resize(N);
  for (int64_t i = 0; i < N; ++i) {
    pr.y[i] = i % 7 == 3 ? kIgnoreIndex : static_cast<int32_t>(rng() % V);
  }
  return pr;
}

// The definition in double: loss_sum over valid rows, their count, and with
// scale = 1 / count the gradients of the mean loss (dW on top of dw0).
struct Want {
  double loss_sum = 0;
  int64_t valid = 0;
  std::vector<double> dz, dw;
};

Want Reference(const Problem& pr) {
  Want w;
  for (int32_t t : pr.y) w.valid += t != kIgnoreIndex;
  w.dz.assign(pr.N * pr.H, 0.0);
  w.dw.assign(pr.dw0.begin(), pr.dw0.end());
  for (int64_t i = 0; i < pr.N; ++i) {
    if (pr.y[i] == kIgnoreIndex) continue;
    std::vector<double> lg(pr.V);
    double mx = -INFINITY;
    for (int64_t v = 0; v < pr.V; ++v) {
      double acc = 0;
      for (int64_t h = 0; h < pr.H; ++h) acc += double(pr.z[i * pr.H + h]) * pr.w[v * pr.H + h];
      lg[v] = acc;
      mx = std::max(mx, acc);
    }
    double sum = 0;
    for (double l : lg) sum += std::exp(l - mx);
    const double lse = mx + std::log(sum);
    w.loss_sum += lse - lg[pr.y[i]];
    for (int64_t v = 0; v < pr.V; ++v) {
      const double d = (std::exp(lg[v] - lse) - (v == pr.y[i])) / w.valid;
      for (int64_t h = 0; h < pr.H; ++h) {
        w.dz[i * pr.H + h] += d * pr.w[v * pr.H + h];
        w.dw[v * pr.H + h] += d * pr.z[i * pr.H + h];
      }
    }
  }
  return w;
}

struct Got {
  double stats[2] = {0, 0};  // as returned, starting from kStats0
  std::vector<float> dz, dw;
  int64_t before = -1, after_create = -1, peak = -1, after = -1;  // kProjection bytes
};

// Forward adds to the stats it is given.
constexpr double kStats0[2] = {1.5, 2.0};

template <typename T>
absl::StatusOr<Buffer> Upload(Backend& be, LiveSet set, const std::vector<T>& host) {
  PLATEAU_ASSIGN_OR_RETURN(Buffer b, be.device().Allocate(set, host.size() * sizeof(T)));
  std::memcpy(b.data(), host.data(), host.size() * sizeof(T));  // CPU device memory
  return b;
}

Got RunDense(const Problem& pr, float scale) {
  Got got;
  absl::Status st = RunLocalWorld(
      1, 16 << 20, FreshStoreDir("dense_projection"),
      [&](int, Backend& be, Communicator&) -> absl::Status {
        PLATEAU_ASSIGN_OR_RETURN(auto s, be.CreateStream("compute"));
        PLATEAU_ASSIGN_OR_RETURN(auto kernels, ModelKernels::Create(be));
        PLATEAU_ASSIGN_OR_RETURN(Buffer z, Upload(be, LiveSet::kActivations, pr.z));
        PLATEAU_ASSIGN_OR_RETURN(Buffer y, Upload(be, LiveSet::kActivations, pr.y));
        PLATEAU_ASSIGN_OR_RETURN(Buffer w, Upload(be, LiveSet::kWeights, pr.w));
        PLATEAU_ASSIGN_OR_RETURN(Buffer dw, Upload(be, LiveSet::kGrads, pr.dw0));
        PLATEAU_ASSIGN_OR_RETURN(
            Buffer dz, Upload(be, LiveSet::kActivations,
                              std::vector<float>(pr.N * pr.H, std::numeric_limits<float>::quiet_NaN())));
        PLATEAU_ASSIGN_OR_RETURN(Buffer stats, Upload(be, LiveSet::kWorkspace,
                                                      std::vector<double>(kStats0, kStats0 + 2)));
        MemoryTracker& tracker = be.device().tracker();
        tracker.ResetPeaks();
        got.before = tracker.current(LiveSet::kProjection);
        PLATEAU_ASSIGN_OR_RETURN(auto proj, DenseProjection::Create(be, *kernels, *s, pr.N, pr.H, pr.V));
        got.after_create = tracker.current(LiveSet::kProjection);
        PLATEAU_RETURN_IF_ERROR(
            proj->Forward(z.as<float>(), w.as<float>(), y.as<int32_t>(), stats.as<double>()));
        PLATEAU_RETURN_IF_ERROR(proj->Backward(z.as<float>(), w.as<float>(), y.as<int32_t>(),
                                               scale, dz.as<float>(), dw.as<float>()));
        PLATEAU_RETURN_IF_ERROR(s->Synchronize());
        got.peak = tracker.peak(LiveSet::kProjection);
        got.after = tracker.current(LiveSet::kProjection);
        std::copy_n(stats.as<double>(), 2, got.stats);
        got.dz.assign(dz.as<float>(), dz.as<float>() + pr.N * pr.H);
        got.dw.assign(dw.as<float>(), dw.as<float>() + pr.V * pr.H);
        return absl::OkStatus();
      });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

void ExpectMatches(const Problem& pr, const Got& got, const Want& want) {
  // The count is exact; the sum is fp32 row losses accumulated in double.
  EXPECT_EQ(got.stats[1] - kStats0[1], static_cast<double>(want.valid));
  EXPECT_NEAR(got.stats[0] - kStats0[0], want.loss_sum, 1e-5 * std::abs(want.loss_sum));
  ExpectNearRelMax(got.dz, want.dz, 1e-4, "dz", pr.H);
  ExpectNearRelMax(got.dw, want.dw, 1e-4, "dw (by vocabulary row)", pr.H);
  // The live set is the bound from Create on, and nothing more.
  const int64_t bound = DenseProjection::BoundBytes(pr.N, pr.V);
  EXPECT_EQ(got.before, 0);
  EXPECT_EQ(got.after_create, bound);
  EXPECT_EQ(got.peak, bound);
  EXPECT_EQ(got.after, bound);
}

struct Shape {
  int64_t N, H, V;
  float scale;  // of W: 400 puts the logits in the thousands
};
void PrintTo(const Shape& s, std::ostream* os) {
  *os << "N=" << s.N << " H=" << s.H << " V=" << s.V << " scale=" << s.scale;
}

class DenseProjectionTest : public ::testing::TestWithParam<Shape> {};

TEST_P(DenseProjectionTest, MatchesTheMeanCrossEntropy) {
  const Shape sh = GetParam();
  const Problem pr = Make(sh.N, sh.H, sh.V, sh.scale, 11 + sh.N + sh.V);
  const Want want = Reference(pr);
  ASSERT_GT(want.valid, 0);
  const Got got = RunDense(pr, static_cast<float>(1.0 / want.valid));
  ASSERT_TRUE(std::isfinite(got.stats[0]));
  ExpectMatches(pr, got, want);
}

INSTANTIATE_TEST_SUITE_P(
    All, DenseProjectionTest,
    ::testing::Values(Shape{24, 16, 53, 0.5f}, Shape{16, 8, 40, 400.0f}, Shape{1, 4, 7, 1.0f},
                      Shape{13, 16, 32, 2000.0f}),
    [](const ::testing::TestParamInfo<Shape>& i) {
      return absl::StrCat("N", i.param.N, "_H", i.param.H, "_V", i.param.V, "_scale",
                          static_cast<int>(i.param.scale));
    });

TEST(DenseProjectionTest, ExtremeLogitsReallyAreInTheThousands) {
  // Guards the case above: with W scaled by 400 the largest |logit| is far
  // past where exp overflows in fp32 (about 88).
  const Problem pr = Make(16, 8, 40, 400.0f, 11 + 16 + 40);
  double mx = 0;
  for (int64_t i = 0; i < pr.N; ++i) {
    for (int64_t v = 0; v < pr.V; ++v) {
      double acc = 0;
      for (int64_t h = 0; h < pr.H; ++h) acc += double(pr.z[i * pr.H + h]) * pr.w[v * pr.H + h];
      mx = std::max(mx, std::abs(acc));
    }
  }
  EXPECT_GT(mx, 1000.0);
}

// A batch whose every target is ignored (all padding): nothing is counted
// or summed, and with the scale 0 the step passes then (no valid token to
// average over) dz is all zeros (the NaN pre-fill shows a row left
// unwritten) and dW is exactly what it was.
TEST(DenseProjectionTest, AllTargetsIgnoredCountNothingAndChangeNoGradient) {
  Problem pr = Make(12, 8, 20, 1.0f, 5);
  std::fill(pr.y.begin(), pr.y.end(), kIgnoreIndex);
  ASSERT_EQ(Reference(pr).valid, 0);
  const Got got = RunDense(pr, 0.0f);
  EXPECT_EQ(got.stats[0], kStats0[0]);
  EXPECT_EQ(got.stats[1], kStats0[1]);
  ASSERT_EQ(got.dz.size(), static_cast<size_t>(pr.N * pr.H));
  for (size_t i = 0; i < got.dz.size(); ++i) ASSERT_EQ(got.dz[i], 0.0f) << "dz[" << i << "]";
  ASSERT_EQ(got.dw.size(), pr.dw0.size());
  EXPECT_EQ(std::memcmp(got.dw.data(), pr.dw0.data(), pr.dw0.size() * sizeof(float)), 0);
}

TEST(DenseProjectionTest, SameBitsRunToRun) {
  const Problem pr = Make(24, 16, 53, 3.0f, 9);
  const float scale = static_cast<float>(1.0 / Reference(pr).valid);
  const Got a = RunDense(pr, scale);
  const Got b = RunDense(pr, scale);
  EXPECT_EQ(a.stats[0], b.stats[0]);
  EXPECT_EQ(a.stats[1], b.stats[1]);
  EXPECT_EQ(a.dz, b.dz);
  EXPECT_EQ(a.dw, b.dw);
}

}  // namespace
}  // namespace plateau
