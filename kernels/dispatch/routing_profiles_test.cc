#include "kernels/dispatch/routing_profiles.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
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

// Whether each token is hot: every route in [0, g) (g >= k; a cold token
// lands wholly in a hot set of 4 of 16 with probability 1 / 1820).
std::vector<char> HotTokens(const Routes& r, int64_t g, int64_t k) {
  std::vector<char> hot(r.chosen.size() / k);
  for (size_t t = 0; t < hot.size(); ++t) {
    hot[t] = std::all_of(&r.chosen[t * k], &r.chosen[t * k] + k, [&](int32_t e) { return e < g; });
  }
  return hot;
}
int64_t LongestRun(const std::vector<char>& hot) {
  int64_t best = 0, run = 0;
  for (char h : hot) best = std::max(best, run = h ? run + 1 : 0);
  return best;
}

// "h%/g@b": the same share of hot tokens, in b runs. A strided chunk
// (tokens j, j+K, ...) takes about h% hot tokens from every run; a
// contiguous chunk inside a run is all hot. That is what makes the two
// chunk memberships differ.
TEST(RoutingProfilesTest, HotBlocksAreContiguousRuns) {
  const int64_t hot = kN / 2;
  for (int64_t b : {1, 2, 4}) {
    const RoutingProfile p = HotBlockRouting(50, 4, b);
    EXPECT_EQ(p.Name(), absl::StrCat("50%/4@", b));
    const Routes r = Make(p);
    ExpectWellFormed(r, kN, kK);
    const std::vector<char> is_hot = HotTokens(r, 4, kK);
    const int64_t n_hot = std::count(is_hot.begin(), is_hot.end(), 1);
    EXPECT_GE(n_hot, hot) << p.Name();
    EXPECT_LE(n_hot, hot + 3) << p.Name();
    EXPECT_GE(LongestRun(is_hot), hot / b) << p.Name();
    // The same bytes again; other bytes on another rank.
    EXPECT_EQ(Make(p).chosen, r.chosen);
    EXPECT_NE(Make(p, 7, 1).chosen, r.chosen);
  }
  // Scattered hot tokens make short runs only.
  EXPECT_LT(LongestRun(HotTokens(Make(HotRouting(50, 4)), 4, kK)), 25);

  // K = 8 chunks of 50 tokens, two runs of 100 hot tokens: every strided
  // chunk takes 25 +- 2 hot tokens (12 or 13 of each run), and some
  // contiguous chunk lies inside a run: all 50 hot.
  const std::vector<char> is_hot = HotTokens(Make(HotBlockRouting(50, 4, 2)), 4, kK);
  const int64_t K = 8;
  int64_t fullest_contiguous = 0;
  for (int64_t j = 0; j < K; ++j) {
    int64_t strided = 0, contiguous = 0;
    for (int64_t t = j; t < kN; t += K) strided += is_hot[t];
    for (int64_t t = j * kN / K; t < (j + 1) * kN / K; ++t) contiguous += is_hot[t];
    EXPECT_NEAR(strided, 25, 2) << "chunk " << j;
    fullest_contiguous = std::max(fullest_contiguous, contiguous);
  }
  EXPECT_EQ(fullest_contiguous, 50);
  // One run of all the tokens at 100%, and no hot token at 0 tokens.
  EXPECT_EQ(LongestRun(HotTokens(Make(HotBlockRouting(100, 4, 3)), 4, kK)), kN);
  EXPECT_TRUE(Make(HotBlockRouting(50, 4, 4), 1, 0, 0).chosen.empty());
  ExpectWellFormed(Make(HotBlockRouting(50, 4, 9), 1, 0, 5), 5, kK);  // more runs than hot tokens
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
      {HotBlockRouting(50, 4, -1), kE, kK, 8, "routing.hot_blocks"},
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
