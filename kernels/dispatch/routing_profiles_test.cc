#include "kernels/dispatch/routing_profiles.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kE = 16, kK = 4, kN = 400;

Routes Make(const RoutingProfile& p, uint64_t seed = 7, int rank = 0, int64_t n = kN,
            int64_t k = kK) {
  absl::StatusOr<Routes> r = MakeRoutes(p, kE, k, n, seed, rank);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : Routes{};
}

// The properties every profile has: k distinct in-range experts per token,
// positive gates summing to 1.
void ExpectWellFormed(const Routes& r, int64_t n, int64_t k) {
  ASSERT_EQ(r.chosen.size(), static_cast<size_t>(n * k));
  ASSERT_EQ(r.gates.size(), static_cast<size_t>(n * k));
  for (int64_t t = 0; t < n; ++t) {
    std::set<int32_t> distinct(&r.chosen[t * k], &r.chosen[t * k] + k);
    EXPECT_EQ(distinct.size(), static_cast<size_t>(k)) << "token " << t;
    EXPECT_GE(*distinct.begin(), 0);
    EXPECT_LT(*distinct.rbegin(), kE);
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      EXPECT_GT(r.gates[t * k + j], 0.0f);
      sum += r.gates[t * k + j];
    }
    EXPECT_NEAR(sum, 1.0, 1e-6);
  }
}

// Tokens whose every route lands in the hot set [0, g), and tokens that
// route to all g hot experts (the g < k case).
int64_t AllHot(const Routes& r, int64_t g, int64_t k) {
  int64_t n = 0;
  for (size_t t = 0; t * k < r.chosen.size(); ++t) {
    n += std::all_of(&r.chosen[t * k], &r.chosen[t * k] + k, [&](int32_t e) { return e < g; });
  }
  return n;
}
int64_t ContainsAllOfHotSet(const Routes& r, int64_t g, int64_t k) {
  int64_t n = 0;
  for (size_t t = 0; t * k < r.chosen.size(); ++t) {
    const int32_t* c = &r.chosen[t * k];
    n += std::count_if(c, c + k, [&](int32_t e) { return e < g; }) == g;
  }
  return n;
}

TEST(RoutingProfilesTest, SameSeedAndRankGiveTheSameBytes) {
  for (const RoutingProfile& p : {BalancedRouting(), HotRouting(50, 4), HotRouting(100, 1)}) {
    const Routes a = Make(p, 11, 3), b = Make(p, 11, 3);
    ASSERT_EQ(a.chosen, b.chosen) << p.Name();
    ASSERT_EQ(0, std::memcmp(a.gates.data(), b.gates.data(), a.gates.size() * sizeof(float)))
        << p.Name();
    // Another rank or another seed draws other routes.
    EXPECT_NE(a.chosen, Make(p, 11, 4).chosen) << p.Name();
    EXPECT_NE(a.gates, Make(p, 12, 3).gates) << p.Name();
  }
}

TEST(RoutingProfilesTest, BalancedSpreadsRoutesOverEveryExpert) {
  const Routes r = Make(BalancedRouting());
  ExpectWellFormed(r, kN, kK);
  std::vector<int64_t> load(kE, 0);
  for (int32_t e : r.chosen) ++load[e];
  // Mean 100 per expert; a uniform draw stays well inside [50, 150].
  for (int64_t e = 0; e < kE; ++e) {
    EXPECT_GT(load[e], 50) << e;
    EXPECT_LT(load[e], 150) << e;
  }
}

TEST(RoutingProfilesTest, HotTokensRouteToTheHotSet) {
  struct Case {
    double h;
    int64_t g;
  };
  for (const Case& c : {Case{50, 4}, Case{80, 16}, Case{25, 8}, Case{100, 4}}) {
    const RoutingProfile p = HotRouting(c.h, c.g);
    const Routes r = Make(p);
    ExpectWellFormed(r, kN, kK);
    const int64_t hot = std::llround(c.h * kN / 100.0);
    if (c.g == kE) {
      EXPECT_EQ(AllHot(r, c.g, kK), kN) << p.Name();
    } else {
      // At least the hot tokens; a cold token lands wholly in [0, g) rarely.
      EXPECT_GE(AllHot(r, c.g, kK), hot) << p.Name();
      EXPECT_LT(AllHot(r, c.g, kK), hot + (kN - hot) / 10 + 5) << p.Name();
    }
  }
  EXPECT_EQ(AllHot(Make(HotRouting(100, 4)), 4, kK), kN);
}

// g < k: a hot token takes all g hot experts and k - g others.
TEST(RoutingProfilesTest, AHotSetSmallerThanKIsTakenWhole) {
  for (int64_t g : {1, 3}) {
    const Routes r = Make(HotRouting(100, g));
    ExpectWellFormed(r, kN, kK);
    EXPECT_EQ(ContainsAllOfHotSet(r, g, kK), kN) << g;
    // The hot experts are not always the first choice.
    int64_t first_hot = 0;
    for (int64_t t = 0; t < kN; ++t) first_hot += r.chosen[t * kK] < g;
    EXPECT_LT(first_hot, kN) << g;
  }
  // 50%/1: exactly the hot half routes to expert 0... plus the cold tokens
  // that happen to draw it.
  const Routes half = Make(HotRouting(50, 1));
  EXPECT_GE(ContainsAllOfHotSet(half, 1, kK), kN / 2);
}

TEST(RoutingProfilesTest, SkewRisesWithHAndFallsWithG) {
  auto max_share = [](const Routes& r) {
    std::vector<int64_t> load(kE, 0);
    for (int32_t e : r.chosen) ++load[e];
    return *std::max_element(load.begin(), load.end());
  };
  EXPECT_LT(max_share(Make(BalancedRouting())), max_share(Make(HotRouting(50, 4))));
  EXPECT_LT(max_share(Make(HotRouting(50, 4))), max_share(Make(HotRouting(80, 4))));
  EXPECT_LT(max_share(Make(HotRouting(80, 16))), max_share(Make(HotRouting(80, 4))));
  EXPECT_EQ(max_share(Make(HotRouting(100, 1))), kN);
}

TEST(RoutingProfilesTest, EdgeShapes) {
  EXPECT_TRUE(Make(HotRouting(50, 4), 1, 0, 0).chosen.empty());
  ExpectWellFormed(Make(BalancedRouting(), 1, 0, 3, kE), 3, kE);  // k = E: every expert
  ExpectWellFormed(Make(HotRouting(100, 2), 1, 0, 5, 1), 5, 1);
  EXPECT_EQ(HotRouting(50, 4).Name(), "50%/4");
  EXPECT_EQ(HotRouting(100, 1).Name(), "100%/1");
  EXPECT_EQ(BalancedRouting().Name(), "balanced");
}

TEST(RoutingProfilesTest, BadProfilesNameTheField) {
  struct Case {
    RoutingProfile p;
    int64_t experts, k, tokens;
    const char* field;
  };
  const Case cases[] = {
      {HotRouting(-1, 4), kE, kK, 8, "routing.hot_percent"},
      {HotRouting(101, 4), kE, kK, 8, "routing.hot_percent"},
      {HotRouting(std::nan(""), 4), kE, kK, 8, "routing.hot_percent"},
      {HotRouting(50, 0), kE, kK, 8, "routing.hot_experts"},
      {HotRouting(50, kE + 1), kE, kK, 8, "routing.hot_experts"},
      {BalancedRouting(), kE, 0, 8, "model.top_k"},
      {BalancedRouting(), kE, kE + 1, 8, "model.top_k"},
      {BalancedRouting(), 0, 1, 8, "model.experts"},
      {BalancedRouting(), kE, kK, -1, "tokens"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<Routes> r = MakeRoutes(c.p, c.experts, c.k, c.tokens, 1, 0);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(r.status().message(), HasSubstr(c.field));
  }
}

}  // namespace
}  // namespace plateau
