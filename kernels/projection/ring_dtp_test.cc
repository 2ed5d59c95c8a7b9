#include "kernels/projection/ring_dtp.h"

#include <cmath>
#include <cstring>
#include <iostream>
#include <random>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/model/config.h"
#include "kernels/projection/dense_projection.h"
#include "kernels/status_macros.h"
#include "kernels/testing/bf16_testing.h"
#include "kernels/testing/counting_communicator.h"
#include "kernels/testing/local_world.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

// One global problem: P batches X_p [N, H] with targets, and W [V, H].
struct Problem {
  int64_t P, N, H, V;
  std::vector<std::vector<float>> x;
  std::vector<std::vector<int32_t>> y;
  std::vector<float> w;
};

Problem Make(int64_t P, int64_t N, int64_t H, int64_t V, float scale, uint64_t seed) {
  Problem pr{P, N, H, V, {}, {}, {}};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  pr.w.resize(V * H);
  for (auto& e : pr.w) e = n(rng) * scale;
  for (int64_t p = 0; p < P; ++p) {
    std::vector<float> x(N * H);
    for (auto& e : x) e = n(rng);
    std::vector<int32_t> y(N);
    for (int64_t i = 0; i < N; ++i) {
      y[i] = i % 7 == 3 ? kIgnoreIndex : static_cast<int32_t>(rng() % V);
    }
    pr.x.push_back(std::move(x));
    pr.y.push_back(std::move(y));
  }
  return pr;
}

// The dense definition in double: mean loss over every rank's valid tokens,
// dX per rank, dW over the whole vocabulary.
struct Want {
  double loss = 0;
  std::vector<std::vector<double>> dx;
  std::vector<double> dw;
};

Want Dense(const Problem& pr) {
  Want w;
  int64_t valid = 0;
  for (const auto& y : pr.y) for (int32_t t : y) valid += t != kIgnoreIndex;
  w.dw.assign(pr.V * pr.H, 0.0);
  for (int64_t p = 0; p < pr.P; ++p) {
    std::vector<double> dx(pr.N * pr.H, 0.0);
    for (int64_t i = 0; i < pr.N; ++i) {
      if (pr.y[p][i] == kIgnoreIndex) continue;
      std::vector<double> lg(pr.V);
      double mx = -INFINITY;
      for (int64_t v = 0; v < pr.V; ++v) {
        double acc = 0;
        for (int64_t h = 0; h < pr.H; ++h) acc += double(pr.x[p][i * pr.H + h]) * pr.w[v * pr.H + h];
        lg[v] = acc;
        mx = std::max(mx, acc);
      }
      double sum = 0;
      for (double l : lg) sum += std::exp(l - mx);
      const double lse = mx + std::log(sum);
      w.loss += (lse - lg[pr.y[p][i]]) / valid;
      for (int64_t v = 0; v < pr.V; ++v) {
        const double d = (std::exp(lg[v] - lse) - (v == pr.y[p][i])) / valid;
        for (int64_t h = 0; h < pr.H; ++h) {
          dx[i * pr.H + h] += d * pr.w[v * pr.H + h];
          w.dw[v * pr.H + h] += d * pr.x[p][i * pr.H + h];
        }
      }
    }
    w.dx.push_back(std::move(dx));
  }
  return w;
}

struct Got {
  double loss = 0;
  std::vector<std::vector<float>> dx;
  std::vector<float> dw;  // whole vocabulary, assembled from the shards
  int64_t peak = 0, bound = 0;
};

// `send_recvs`, when given, gets how many send/recvs rank 0 issued.
Got RunRing(const Problem& pr, int64_t strip, RingDtpMode mode, int64_t chunk_rows = 0,
            int64_t* send_recvs = nullptr) {
  Got got;
  got.dx.resize(pr.P);
  got.dw.assign(pr.V * pr.H, 0.0f);
  std::vector<int64_t> peaks(pr.P);
  absl::Status st = RunLocalWorld(
      static_cast<int>(pr.P), 64 << 20, FreshStoreDir("ringdtp"),
      [&](int p, Backend& be, Communicator& inner) -> absl::Status {
        CountingCommunicator::Table table;
        CountingCommunicator world(inner, &table);
        auto compute = be.CreateStream("compute");
        auto comm = be.CreateStream("comm");
        auto kernels = ModelKernels::Create(be);
        if (!compute.ok() || !comm.ok() || !kernels.ok()) return absl::InternalError("setup");
        RingDtpConfig c{pr.N, pr.H, pr.V, strip, mode, /*row_tile=*/10,  // 24 rows: 10+10+4
                        chunk_rows};
        auto ring = RingDtp::Create(c, be, **kernels, world, **compute, **comm);
        if (!ring.ok()) return ring.status();
        const int64_t begin = VocabShardBegin(pr.V, pr.P, p);
        const int64_t rows = VocabShardBegin(pr.V, pr.P, p + 1) - begin;
        // Inputs in the device space, as the step holds them.
        auto x = be.device().Allocate(LiveSet::kActivations, pr.N * pr.H * 4);
        auto y = be.device().Allocate(LiveSet::kActivations, pr.N * 4);
        auto w = be.device().Allocate(LiveSet::kWeights, rows * pr.H * 4);
        auto dx = be.device().Allocate(LiveSet::kActivations, pr.N * pr.H * 4);
        auto dw = be.device().Allocate(LiveSet::kGrads, rows * pr.H * 4);
        auto stats = be.device().Allocate(LiveSet::kWorkspace, 2 * sizeof(double));
        std::copy(pr.x[p].begin(), pr.x[p].end(), x->as<float>());
        std::copy(pr.y[p].begin(), pr.y[p].end(), y->as<int32_t>());
        std::copy_n(&pr.w[begin * pr.H], rows * pr.H, w->as<float>());
        std::fill_n(dw->as<float>(), rows * pr.H, 0.0f);
        double* s = stats->as<double>();
        s[0] = s[1] = 0;
        be.device().tracker().ResetPeaks();
        const int64_t before = be.device().tracker().current(LiveSet::kProjection);
        PLATEAU_RETURN_IF_ERROR((*ring)->Forward(x->as<float>(), w->as<float>(), y->as<int32_t>(), s));
        PLATEAU_RETURN_IF_ERROR((*compute)->Synchronize());
        // The global mean needs every rank's sum and count.
        PLATEAU_RETURN_IF_ERROR(world.AllReduce(**comm, s, s, 2, DataType::kFloat64, ReduceOp::kSum));
        PLATEAU_RETURN_IF_ERROR((*comm)->Synchronize());
        const float scale = static_cast<float>(1.0 / s[1]);
        PLATEAU_RETURN_IF_ERROR((*ring)->Backward(x->as<float>(), w->as<float>(), y->as<int32_t>(),
                                                  scale, dx->as<float>(), dw->as<float>()));
        PLATEAU_RETURN_IF_ERROR((*compute)->Synchronize());
        PLATEAU_RETURN_IF_ERROR((*comm)->Synchronize());
        peaks[p] = be.device().tracker().peak(LiveSet::kProjection);
        if (before != be.device().tracker().peak(LiveSet::kProjection) && p == 0) {
          // Nothing beyond Create()'s buffers may appear in the live set.
          return absl::InternalError("the projection live set grew after Create()");
        }
        got.dx[p].assign(dx->as<float>(), dx->as<float>() + pr.N * pr.H);
        std::copy_n(dw->as<float>(), rows * pr.H, &got.dw[begin * pr.H]);
        if (p == 0) got.loss = s[0] / s[1];
        got.bound = RingDtp::BoundBytes(c, pr.P);
        if (p == 0 && send_recvs != nullptr) *send_recvs = table.Read()["send_recv"];
        return absl::OkStatus();
      });
  EXPECT_TRUE(st.ok()) << st;
  got.peak = *std::max_element(peaks.begin(), peaks.end());
  return got;
}

double MaxAbs(const std::vector<double>& v) {
  double m = 0;
  for (double e : v) m = std::max(m, std::abs(e));
  return m;
}

void ExpectMatches(const Got& got, const Want& want, const Problem& pr) {
  EXPECT_NEAR(got.loss, want.loss, 1e-5 * std::abs(want.loss));
  for (int64_t p = 0; p < pr.P; ++p) {
    const double tol = 1e-4 * MaxAbs(want.dx[p]) + 1e-9;
    for (size_t i = 0; i < want.dx[p].size(); ++i) {
      ASSERT_NEAR(got.dx[p][i], want.dx[p][i], tol) << "dx rank " << p << " [" << i << "]";
    }
  }
  const double tol = 1e-4 * MaxAbs(want.dw) + 1e-9;
  for (size_t i = 0; i < want.dw.size(); ++i) {
    ASSERT_NEAR(got.dw[i], want.dw[i], tol) << "dw[" << i << "] (vocab row " << i / pr.H << ")";
  }
}

using Params = std::tuple<int, RingDtpMode, int>;  // ranks, mode, strip
class RingDtpTest : public ::testing::TestWithParam<Params> {};

// Loss, dX and dW equal the dense definition, with V = 53 split unevenly
// (14/13/13/13 on 4 ranks), strips that do and do not divide the shards,
// and ignored tokens; the projection live set's peak is the bound exactly.
TEST_P(RingDtpTest, MatchesTheDenseProjection) {
  const auto [P, mode, strip] = GetParam();
  const Problem pr = Make(P, 24, 16, 53, 0.5f, 17 + P);
  const Want want = Dense(pr);
  const Got got = RunRing(pr, strip, mode);
  ExpectMatches(got, want, pr);
  EXPECT_GT(got.peak, 0);
  // Every buffer is allocated at Create() and the bound is their sum: equal,
  // so an over-counted bound fails as well as an under-counted one.
  EXPECT_EQ(got.peak, got.bound);
}

INSTANTIATE_TEST_SUITE_P(
    All, RingDtpTest,
    ::testing::Combine(::testing::Values(1, 2, 4),
                       ::testing::Values(RingDtpMode::kActivations, RingDtpMode::kWeights),
                       ::testing::Values(5, 16, 64)),
    [](const ::testing::TestParamInfo<Params>& i) {
      return absl::StrCat("P", std::get<0>(i.param), "_",
                          RingDtpModeName(std::get<1>(i.param)), "_S", std::get<2>(i.param));
    });

// Skewed targets: every target in one rank's vocabulary shard (the others'
// shards give only the log-sum-exp's terms), and one rank whose tokens are
// all ignored (it sends and receives its share of the ring with nothing to
// count). Both modes, whole and chunked: the same values as the dense
// definition, the peak the bound.
TEST(RingDtpTest, SkewedTargetsAndAnAllIgnoredRankMatch) {
  const int64_t P = 4, V = 53;
  Problem pr = Make(P, 24, 16, V, 0.5f, 90);
  const int64_t begin = VocabShardBegin(V, P, 2), end = VocabShardBegin(V, P, 3);
  std::mt19937_64 rng(91);
  for (int64_t p = 0; p < P; ++p) {
    for (int32_t& t : pr.y[p]) {
      t = p == 1 ? kIgnoreIndex : static_cast<int32_t>(begin + rng() % (end - begin));
    }
  }
  const Want want = Dense(pr);
  for (RingDtpMode mode : {RingDtpMode::kActivations, RingDtpMode::kWeights}) {
    for (int64_t chunk_rows : {int64_t{0}, int64_t{9}}) {
      if (mode == RingDtpMode::kWeights && chunk_rows != 0) continue;  // chunking is activation mode's
      SCOPED_TRACE(absl::StrCat(RingDtpModeName(mode), " chunk_rows ", chunk_rows));
      const Got got = RunRing(pr, 5, mode, chunk_rows);
      ExpectMatches(got, want, pr);
      EXPECT_EQ(got.peak, got.bound);
      for (float v : got.dx[1]) ASSERT_EQ(v, 0.0f) << "the all-ignored rank's dX";
    }
  }
}

// The batch circulating in chunks (activation mode): 24 rows as 9 + 9 + 6,
// each a full ring; same values, smaller bound.
TEST(RingDtpTest, ChunkedPassesMatchAndShrinkTheBound) {
  for (int P : {1, 2, 4}) {
    const Problem pr = Make(P, 24, 16, 53, 0.5f, 40 + P);
    const Want want = Dense(pr);
    const Got got = RunRing(pr, 16, RingDtpMode::kActivations, /*chunk_rows=*/9);
    ExpectMatches(got, want, pr);
    EXPECT_EQ(got.peak, got.bound);
  }
  const RingDtpConfig whole{4096, 1024, 50000, 1024, RingDtpMode::kActivations, 1024, 0};
  RingDtpConfig halves = whole;
  halves.chunk_rows = 2048;
  EXPECT_LT(RingDtp::BoundBytes(halves, 4), RingDtp::BoundBytes(whole, 4) * 6 / 10);
}

// A hop's cost at small N is its round trip: activation mode sends the
// travelling batch (X, targets and, backward, log-sum-exp) as one message,
// so a pass takes 2P - 1 send/recvs each way (P - 1 batch hops, P state or
// accumulator hops), not 3P - 2 forward and 4P - 3 backward as with X,
// targets and log-sum-exp sent apart. Weight mode: P - 1 forward, 2P - 1
// backward. Per pass: 24 rows in chunks of 9 are three rings.
TEST(RingDtpTest, SendRecvsPerPass) {
  for (int P : {1, 2, 4}) {
    const Problem pr = Make(P, 24, 16, 53, 0.5f, 60 + P);
    const Want want = Dense(pr);
    int64_t act = -1, chunked = -1, weights = -1;
    ExpectMatches(RunRing(pr, 16, RingDtpMode::kActivations, 0, &act), want, pr);
    ExpectMatches(RunRing(pr, 16, RingDtpMode::kActivations, 9, &chunked), want, pr);
    ExpectMatches(RunRing(pr, 16, RingDtpMode::kWeights, 0, &weights), want, pr);
    const int64_t ring = P > 1 ? 2 * P - 1 : 0;
    EXPECT_EQ(act, 2 * ring) << "P = " << P;
    EXPECT_EQ(chunked, 3 * 2 * ring) << "P = " << P;
    EXPECT_EQ(weights, P > 1 ? (P - 1) + (2 * P - 1) : 0) << "P = " << P;
  }
}

TEST(RingDtpTest, ExtremeLogitsNeitherOverflowNorLoseExactness) {
  // Logits in the thousands: exp would overflow without the running max.
  const Problem pr = Make(2, 16, 8, 40, 400.0f, 5);
  const Want want = Dense(pr);
  for (RingDtpMode mode : {RingDtpMode::kActivations, RingDtpMode::kWeights}) {
    const Got got = RunRing(pr, 7, mode);
    ASSERT_TRUE(std::isfinite(got.loss));
    ExpectMatches(got, want, pr);
  }
}

// bf16 mixed: Ring-DTP on bf16 X and W (the problem's values rounded to
// bf16 first), with strip tiles of `row_tile` rows. dx and dw as floats;
// dw starts at `dw0` ([V, H], rounded to bf16) when given, else 0.
Got RunRingBf16(const Problem& pr, int64_t strip, RingDtpMode mode, int64_t row_tile, int64_t chunk_rows = 0,
                const std::vector<float>* dw0 = nullptr) {
  Got got;
  got.dx.resize(pr.P);
  got.dw.assign(pr.V * pr.H, 0.0f);
  std::vector<int64_t> peaks(pr.P);
  absl::Status st = RunLocalWorld(
      static_cast<int>(pr.P), 64 << 20, FreshStoreDir("ringdtp_bf16"),
      [&](int p, Backend& be, Communicator& world) -> absl::Status {
        PLATEAU_ASSIGN_OR_RETURN(auto compute, be.CreateStream("compute"));
        PLATEAU_ASSIGN_OR_RETURN(auto comm, be.CreateStream("comm"));
        PLATEAU_ASSIGN_OR_RETURN(auto kernels, ModelKernels::Create(be));
        const RingDtpConfig c{pr.N, pr.H, pr.V, strip, mode, row_tile, chunk_rows};
        PLATEAU_ASSIGN_OR_RETURN(auto ring,
                                 RingDtp::Create(c, be, *kernels, world, *compute, *comm, kBf16MixedElements));
        const int64_t begin = VocabShardBegin(pr.V, pr.P, p);
        const int64_t rows = VocabShardBegin(pr.V, pr.P, p + 1) - begin;
        PLATEAU_ASSIGN_OR_RETURN(Buffer x, be.device().Allocate(LiveSet::kActivations, pr.N * pr.H * 2));
        PLATEAU_ASSIGN_OR_RETURN(Buffer y, be.device().Allocate(LiveSet::kActivations, pr.N * 4));
        PLATEAU_ASSIGN_OR_RETURN(Buffer w, be.device().Allocate(LiveSet::kWeights, rows * pr.H * 2));
        PLATEAU_ASSIGN_OR_RETURN(Buffer dx, be.device().Allocate(LiveSet::kActivations, pr.N * pr.H * 2));
        PLATEAU_ASSIGN_OR_RETURN(Buffer dw, be.device().Allocate(LiveSet::kGrads, rows * pr.H * 2));
        PLATEAU_ASSIGN_OR_RETURN(Buffer stats, be.device().Allocate(LiveSet::kWorkspace, 2 * sizeof(double)));
        for (int64_t i = 0; i < pr.N * pr.H; ++i) x.as<Bf16>()[i] = FloatToBf16(pr.x[p][i]);
        std::copy(pr.y[p].begin(), pr.y[p].end(), y.as<int32_t>());
        for (int64_t i = 0; i < rows * pr.H; ++i) w.as<Bf16>()[i] = FloatToBf16(pr.w[begin * pr.H + i]);
        for (int64_t i = 0; i < rows * pr.H; ++i) {
          dw.as<Bf16>()[i] = dw0 == nullptr ? Bf16{} : FloatToBf16((*dw0)[begin * pr.H + i]);
        }
        double* s = stats.as<double>();
        s[0] = s[1] = 0;
        be.device().tracker().ResetPeaks();
        PLATEAU_RETURN_IF_ERROR(ring->Forward(x.as<Bf16>(), w.as<Bf16>(), y.as<int32_t>(), s));
        PLATEAU_RETURN_IF_ERROR(compute->Synchronize());
        PLATEAU_RETURN_IF_ERROR(world.AllReduce(*comm, s, s, 2, DataType::kFloat64, ReduceOp::kSum));
        PLATEAU_RETURN_IF_ERROR(comm->Synchronize());
        const float scale = static_cast<float>(1.0 / s[1]);
        PLATEAU_RETURN_IF_ERROR(
            ring->Backward(x.as<Bf16>(), w.as<Bf16>(), y.as<int32_t>(), scale, dx.as<Bf16>(), dw.as<Bf16>()));
        PLATEAU_RETURN_IF_ERROR(compute->Synchronize());
        PLATEAU_RETURN_IF_ERROR(comm->Synchronize());
        peaks[p] = be.device().tracker().peak(LiveSet::kProjection);
        for (int64_t i = 0; i < pr.N * pr.H; ++i) got.dx[p].push_back(Bf16ToFloat(dx.as<Bf16>()[i]));
        for (int64_t i = 0; i < rows * pr.H; ++i) got.dw[begin * pr.H + i] = Bf16ToFloat(dw.as<Bf16>()[i]);
        if (p == 0) got.loss = s[0] / s[1];
        got.bound = RingDtpBoundBytes(c, pr.P, kBf16MixedElements);
        return absl::OkStatus();
      });
  EXPECT_TRUE(st.ok()) << st;
  got.peak = *std::max_element(peaks.begin(), peaks.end());
  return got;
}

// Under bf16 the gradients accumulate in fp32 (the travelling dX or dW, and
// the home one) and round once. Here with one-column strips and one-row
// tiles, every token the same row and target, so that dX sums 2 x 32 strip
// terms and dW 2 x 64 tile terms, each group alike, which a bf16 sum rounded
// per GEMM stalls on. The reference (double) rounds what the schedule's
// arithmetic rounds before any sum, as the dense bf16 projection does too:
// each logit and each delta to bf16. Both modes must then equal it within
// 2^-7 of the sum of the terms' magnitudes (a delta rounded the other way
// by the schedule's fp32 log-sum-exp: one bf16 unit; the result's
// rounding). Rounded per GEMM and per hop they were off by 12% of it (dW)
// and 1.5% (dX); now 0.37% and 0.08%. The fp32 accumulators are in the bound, which the peak meets.
TEST(RingDtpTest, Bf16GradientsAccumulateInFp32) {
  // P = 1 (one meeting: weight mode's dW in a slot), 2 and 3 (the slots'
  // rotation); activation mode also in passes of 9 rows (the home dW summed
  // over passes, rounded once at the end).
  struct Case {
    int64_t P;
    RingDtpMode mode;
    int64_t chunk_rows;
  };
  for (const Case& k :
       {Case{1, RingDtpMode::kActivations, 0}, Case{1, RingDtpMode::kWeights, 0}, Case{2, RingDtpMode::kActivations, 0},
        Case{2, RingDtpMode::kWeights, 0}, Case{3, RingDtpMode::kActivations, 0}, Case{3, RingDtpMode::kWeights, 0},
        Case{2, RingDtpMode::kActivations, 9}, Case{3, RingDtpMode::kActivations, 9}}) {
    SCOPED_TRACE(testing::Message() << "P = " << k.P << ", " << RingDtpModeName(k.mode) << ", chunk_rows "
                                    << k.chunk_rows);
    Problem pr = Make(k.P, 64, 8, 64, 0.5f, 91);
    for (int64_t p = 0; p < pr.P; ++p) {
      for (int64_t i = 0; i < pr.N; ++i) {
        std::copy_n(pr.x[0].begin(), pr.H, pr.x[p].begin() + i * pr.H);
        pr.y[p][i] = 5;
      }
    }
    for (float& v : pr.w) v = RoundToBf16(v);
    for (auto& x : pr.x) {
      for (float& v : x) v = RoundToBf16(v);
    }
    const double scale = 1.0 / static_cast<double>(pr.P * pr.N);  // every token counts
    std::vector<double> dw(pr.V * pr.H, 0.0), dw_abs(pr.V * pr.H, 0.0);
    std::vector<std::vector<double>> dx(pr.P, std::vector<double>(pr.N * pr.H, 0.0)), dx_abs = dx;
    for (int64_t p = 0; p < pr.P; ++p) {
      for (int64_t i = 0; i < pr.N; ++i) {
        std::vector<double> lg(pr.V, 0.0);
        for (int64_t v = 0; v < pr.V; ++v) {
          double acc = 0;
          for (int64_t h = 0; h < pr.H; ++h) acc += double(pr.x[p][i * pr.H + h]) * pr.w[v * pr.H + h];
          lg[v] = RoundToBf16(static_cast<float>(acc));
        }
        const double mx = *std::max_element(lg.begin(), lg.end());
        double sum = 0;
        for (double l : lg) sum += std::exp(l - mx);
        const double lse = mx + std::log(sum);
        for (int64_t v = 0; v < pr.V; ++v) {
          const double d = RoundToBf16(static_cast<float>(scale * (std::exp(lg[v] - lse) - (v == pr.y[p][i]))));
          for (int64_t h = 0; h < pr.H; ++h) {
            dx[p][i * pr.H + h] += d * pr.w[v * pr.H + h];
            dx_abs[p][i * pr.H + h] += std::abs(d * pr.w[v * pr.H + h]);
            dw[v * pr.H + h] += d * pr.x[p][i * pr.H + h];
            dw_abs[v * pr.H + h] += std::abs(d * pr.x[p][i * pr.H + h]);
          }
        }
      }
    }
    const double u = std::ldexp(1.0, -7);
    const Got got = RunRingBf16(pr, /*strip=*/1, k.mode, /*row_tile=*/1, k.chunk_rows);
    double worst_dw = 0, worst_dx = 0;
    for (size_t i = 0; i < dw.size(); ++i) {
      worst_dw = std::max(worst_dw, std::abs(got.dw[i] - dw[i]) / (dw_abs[i] + 1e-30));
    }
    for (int64_t p = 0; p < pr.P; ++p) {
      for (size_t i = 0; i < dx[p].size(); ++i) {
        worst_dx = std::max(worst_dx, std::abs(got.dx[p][i] - dx[p][i]) / (dx_abs[p][i] + 1e-30));
      }
    }
    std::cout << "P = " << k.P << ", " << RingDtpModeName(k.mode) << ", chunk_rows " << k.chunk_rows
              << ": |error| / sum |terms|: dX " << worst_dx << ", dW " << worst_dw << "\n";
    EXPECT_LE(worst_dw, u);
    EXPECT_LE(worst_dx, u);
    EXPECT_EQ(got.peak, got.bound);
  }
}

// The same bits, every one (loss, dX and dW as bf16 loaded into floats).
bool SameBits(const Got& a, const Got& b) {
  auto same = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0);
  };
  if (std::memcmp(&a.loss, &b.loss, sizeof(double)) != 0 || !same(a.dw, b.dw) || a.dx.size() != b.dx.size()) {
    return false;
  }
  for (size_t p = 0; p < a.dx.size(); ++p) {
    if (!same(a.dx[p], b.dx[p])) return false;
  }
  return true;
}

// bf16 on varied inputs: each rank its own rows and targets, ignored
// tokens among them (every 7th), V = 53 in uneven shards (27/26 at P = 2,
// 14/13/13/13 at P = 4), strips of 5 columns (each shard ends in a partial
// strip), tiles of 7 rows (24 rows: 7+7+7+3; in passes of 9 rows: 7+2,
// 7+2, 6), dW starting from nonzero values (it is added to). Activation
// mode whole and in passes of 9 rows, and weight mode.
//
// Loss, against the exact (double) loss of the same bf16 inputs. The
// schedule's only rounding on the loss's path is each logit's, once, of its
// fp32 GEMM: |logit - z_v| <= a_v = u |z_v| + (1 + u) (H + 3) 2^-24
// sum_h |x_h w_vh| (u = 2^-8; the GEMM bound of docs/RUNTIME.md). A
// token's loss lse - z_t moves by at most max_v a_v (log-sum-exp is
// 1-Lipschitz in the largest coordinate) plus a_t, plus the fp32 online
// log-sum-exp and subtraction: s sums V terms exp(l - m) and rescales once
// per strip (each exp within 1 ulp, each operation one fp32 rounding):
// (2V + 4 strips + 8) 2^-24 relative, generously; log, the add of m and
// the subtraction 2^-24 of |log s|, |lse| and |lse - t|. The bound is the
// mean of that over the valid tokens.
//
// Loss, against the double reference that rounds each logit as the
// schedule stores it (rn of the exact dot product): the schedule's logit
// is the reference's except where a bf16 rounding boundary lies within
// the GEMM's fp32 error of the dot product (StoreBf16: then within its
// dev, about one unit), so a token's loss is within max_v dev_v + dev_t
// plus the fp32 log-sum-exp above: mostly that fp32 term alone, a bound
// thousands of times tighter, which sees a strip or a tile that the
// forward leaves out.
//
// dX and dW, against the double reference that rounds what the schedule
// rounds before any sum (each logit and delta to bf16) and sums in double:
// within 2^-7 of the sum of the terms' magnitudes (dW's start included),
// Bf16GradientsAccumulateInFp32's bound. Run to run: the same bits.
TEST(RingDtpTest, Bf16VariedInputsWithinBoundsOfDouble) {
  struct Case {
    int64_t P;
    RingDtpMode mode;
    int64_t chunk_rows;
  };
  const int64_t strip = 5, row_tile = 7;
  const double u = kBf16UnitRoundoff, f = std::ldexp(1.0, -24);
  for (const Case& k : {Case{2, RingDtpMode::kActivations, 0}, Case{2, RingDtpMode::kActivations, 9},
                        Case{2, RingDtpMode::kWeights, 0}, Case{4, RingDtpMode::kActivations, 0},
                        Case{4, RingDtpMode::kActivations, 9}, Case{4, RingDtpMode::kWeights, 0}}) {
    SCOPED_TRACE(testing::Message() << "P = " << k.P << ", " << RingDtpModeName(k.mode) << ", chunk_rows "
                                    << k.chunk_rows);
    Problem pr = Make(k.P, 24, 16, 53, 0.5f, 300 + k.P);
    for (float& v : pr.w) v = RoundToBf16(v);
    for (auto& x : pr.x) {
      for (float& v : x) v = RoundToBf16(v);
    }
    std::vector<float> dw0(pr.V * pr.H);
    std::mt19937_64 rng(400 + k.P);
    std::normal_distribution<float> normal(0.0f, 0.01f);
    for (float& v : dw0) v = RoundToBf16(normal(rng));
    int64_t valid = 0, strips = 0;
    for (const auto& y : pr.y) {
      for (int32_t t : y) valid += t != kIgnoreIndex;
    }
    for (int64_t p = 0; p < pr.P; ++p) {
      strips += (VocabShardBegin(pr.V, pr.P, p + 1) - VocabShardBegin(pr.V, pr.P, p) + strip - 1) / strip;
    }
    ASSERT_LT(valid, pr.P * pr.N) << "ignored tokens";
    const float scale = static_cast<float>(1.0 / static_cast<double>(valid));  // as the caller passes it
    // The exact loss and its bound; the stored-logit loss and its bound;
    // the dX / dW reference and their terms.
    double loss = 0, loss_bound = 0, stored_loss = 0, stored_bound = 0;
    std::vector<double> dw(dw0.begin(), dw0.end()), dw_abs(pr.V * pr.H);
    for (size_t i = 0; i < dw0.size(); ++i) dw_abs[i] = std::abs(dw0[i]);
    std::vector<std::vector<double>> dx(pr.P, std::vector<double>(pr.N * pr.H, 0.0)), dx_abs = dx;
    for (int64_t p = 0; p < pr.P; ++p) {
      for (int64_t i = 0; i < pr.N; ++i) {
        const int32_t y = pr.y[p][i];
        if (y == kIgnoreIndex) continue;
        std::vector<double> z(pr.V), a(pr.V), lg(pr.V), dev(pr.V);
        for (int64_t v = 0; v < pr.V; ++v) {
          double acc = 0, mag = 0;
          for (int64_t h = 0; h < pr.H; ++h) {
            acc += double(pr.x[p][i * pr.H + h]) * pr.w[v * pr.H + h];
            mag += std::abs(double(pr.x[p][i * pr.H + h]) * pr.w[v * pr.H + h]);
          }
          z[v] = acc;
          a[v] = u * std::abs(acc) + (1 + u) * (pr.H + 3) * f * mag;
          const StoredBf16 stored = StoreBf16(acc, (pr.H + 3) * f * mag);
          lg[v] = stored.value;
          dev[v] = stored.dev();
        }
        const double zmax = *std::max_element(z.begin(), z.end());
        double zsum = 0;
        for (double e : z) zsum += std::exp(e - zmax);
        const double zlse = zmax + std::log(zsum);
        // The fp32 online log-sum-exp and the subtraction.
        auto fp32_lse = [&](double sum, double lse, double t) {
          return (2 * pr.V + 4 * strips + 8) * f * 1.01 +
                 f * (std::abs(std::log(sum)) + std::abs(lse) + std::abs(lse - t)) + 1e-12;
        };
        loss += (zlse - z[y]) / valid;
        loss_bound += (*std::max_element(a.begin(), a.end()) + a[y] + fp32_lse(zsum, zlse, z[y])) / valid;
        // What the schedule rounds: the logits and the deltas.
        const double mx = *std::max_element(lg.begin(), lg.end());
        double sum = 0;
        for (double l : lg) sum += std::exp(l - mx);
        const double lse = mx + std::log(sum);
        stored_loss += (lse - lg[y]) / valid;
        stored_bound += (*std::max_element(dev.begin(), dev.end()) + dev[y] + fp32_lse(sum, lse, lg[y])) / valid;
        for (int64_t v = 0; v < pr.V; ++v) {
          const double d = RoundToBf16(static_cast<float>(scale * (std::exp(lg[v] - lse) - (v == y))));
          for (int64_t h = 0; h < pr.H; ++h) {
            dx[p][i * pr.H + h] += d * pr.w[v * pr.H + h];
            dx_abs[p][i * pr.H + h] += std::abs(d * pr.w[v * pr.H + h]);
            dw[v * pr.H + h] += d * pr.x[p][i * pr.H + h];
            dw_abs[v * pr.H + h] += std::abs(d * pr.x[p][i * pr.H + h]);
          }
        }
      }
    }
    const Got got = RunRingBf16(pr, strip, k.mode, row_tile, k.chunk_rows, &dw0);
    if (HasFailure()) return;
    // The worst element of each, relative to its terms' magnitudes.
    double worst_dw = 0, worst_dx = 0;
    std::string at_dw, at_dx;
    for (size_t i = 0; i < dw.size(); ++i) {
      const double e = std::abs(got.dw[i] - dw[i]) / (dw_abs[i] + 1e-30);
      if (e > worst_dw) {
        worst_dw = e;
        at_dw = absl::StrCat("dw[", i, "] (vocabulary row ", i / pr.H, "): ", got.dw[i], ", reference ", dw[i]);
      }
    }
    for (int64_t p = 0; p < pr.P; ++p) {
      for (size_t i = 0; i < dx[p].size(); ++i) {
        const double e = std::abs(got.dx[p][i] - dx[p][i]) / (dx_abs[p][i] + 1e-30);
        if (e > worst_dx) {
          worst_dx = e;
          at_dx = absl::StrCat("dx of rank ", p, " [", i, "] (row ", i / pr.H, "): ", got.dx[p][i], ", reference ",
                               dx[p][i]);
        }
      }
    }
    std::cout << "P = " << k.P << ", " << RingDtpModeName(k.mode) << ", chunk_rows " << k.chunk_rows << ": loss "
              << got.loss << ", exact " << loss << ", |error| " << std::abs(got.loss - loss) << " (bound " << loss_bound
              << "), stored-logit reference " << stored_loss << ", |error| " << std::abs(got.loss - stored_loss)
              << " (bound " << stored_bound << "); |error| / sum |terms|: dX " << worst_dx << ", dW " << worst_dw
              << " (bound " << 2 * u << ")\n";
    EXPECT_LE(std::abs(got.loss - loss), loss_bound) << "loss " << got.loss << ", exact " << loss;
    EXPECT_LE(std::abs(got.loss - stored_loss), stored_bound)
        << "loss " << got.loss << ", with the logits rounded as stored " << stored_loss;
    // The logits were rounded as stored: the loss lies nearer the
    // stored-logit reference than the exact one (an fp32 fold of unrounded
    // logits lies within fp32 reach of `loss` instead).
    EXPECT_LT(std::abs(got.loss - stored_loss), std::abs(got.loss - loss))
        << "the logits were not rounded to bf16 as stored";
    EXPECT_LE(worst_dw, 2 * u) << at_dw;
    EXPECT_LE(worst_dx, 2 * u) << at_dx;
    EXPECT_EQ(got.peak, got.bound);
    EXPECT_TRUE(SameBits(got, RunRingBf16(pr, strip, k.mode, row_tile, k.chunk_rows, &dw0))) << "run to run";
  }
}

TEST(RingDtpTest, SameBitsRunToRun) {
  const Problem pr = Make(4, 20, 8, 37, 1.0f, 9);
  for (RingDtpMode mode : {RingDtpMode::kActivations, RingDtpMode::kWeights}) {
    const Got a = RunRing(pr, 6, mode);
    const Got b = RunRing(pr, 6, mode);
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_EQ(a.dx, b.dx);
    EXPECT_EQ(a.dw, b.dw);
  }
}

TEST(RingDtpTest, BoundStaysFlatInNWhileDenseGrowsWithNTimesV) {
  // Weight mode: 16x more tokens grow the bound only through the per-token
  // state (a few floats per token); the dense logits grow 16x.
  const int64_t H = 64, V = 32000, S = 256, P = 4;
  const int64_t small = RingDtp::BoundBytes({2048, H, V, S, RingDtpMode::kWeights}, P);
  const int64_t large = RingDtp::BoundBytes({32768, H, V, S, RingDtpMode::kWeights}, P);
  EXPECT_LT(large, small * 12 / 10);
  EXPECT_GT(DenseProjection::BoundBytes(16384, V), 15 * DenseProjection::BoundBytes(1024, V));
  EXPECT_EQ(RingDtp::ChooseMode(2048, V, P), RingDtpMode::kActivations);
  EXPECT_EQ(RingDtp::ChooseMode(32768, V, P), RingDtpMode::kWeights);
}

// A strip never spans two shards: a strip setting past the largest shard
// (ceil(V / P) rows) sizes the tile as that shard, not as V. The
// parameterised test holds the allocation to this bound with S = 64 > 14.
TEST(RingDtpTest, AStripWiderThanAShardCostsOnlyTheShard) {
  for (RingDtpMode mode : {RingDtpMode::kActivations, RingDtpMode::kWeights}) {
    const int64_t N = 4096, H = 64, V = 32000, P = 4, shard = 8000;
    const int64_t at_shard = RingDtp::BoundBytes({N, H, V, shard, mode}, P);
    EXPECT_EQ(RingDtp::BoundBytes({N, H, V, V, mode}, P), at_shard);
    EXPECT_EQ(RingDtp::BoundBytes({N, H, V, 2 * V, mode}, P), at_shard);
    // One column narrower is one column of the 2048-row tile less.
    EXPECT_EQ(at_shard - RingDtp::BoundBytes({N, H, V, shard - 1, mode}, P), 2048 * 4);
  }
}

TEST(RingDtpTest, BadConfigurationsAreRefusedByField) {
  absl::Status st = RunLocalWorld(1, 1 << 20, FreshStoreDir("ringbad"),
                                  [&](int, Backend& be, Communicator& world) -> absl::Status {
    auto s1 = be.CreateStream("a");
    auto s2 = be.CreateStream("b");
    auto k = ModelKernels::Create(be);
    auto r = RingDtp::Create({8, 4, 10, 0, RingDtpMode::kActivations, 16}, be, **k, world, **s1, **s2);
    EXPECT_THAT(r.status().message(), HasSubstr("ring_dtp.strip"));
    r = RingDtp::Create({8, 4, 1, 4, RingDtpMode::kActivations, 16}, be, **k, world, **s1, **s2);
    EXPECT_THAT(r.status().message(), HasSubstr("ring_dtp.vocab"));
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

TEST(VocabShardTest, UnevenShardsTileTheVocabulary) {
  EXPECT_EQ(VocabShardBegin(53, 4, 0), 0);
  EXPECT_EQ(VocabShardBegin(53, 4, 1), 14);
  EXPECT_EQ(VocabShardBegin(53, 4, 2), 27);
  EXPECT_EQ(VocabShardBegin(53, 4, 4), 53);
}

}  // namespace
}  // namespace plateau
