#include "bench/context_ladder.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace plateau {
namespace bench {
namespace {

// Attention-dominated, as at long contexts: FLOPs = n^2.
double Square(int64_t n) { return static_cast<double>(n) * n; }

TEST(ContextLadderTest, FirstContextIsAMultipleOfTheQuantumAndAtMostNMax) {
  EXPECT_EQ(FirstContext({100000, 1024, 4}, 16384), 16384);
  EXPECT_EQ(FirstContext({100000, 1024, 4}, 17000), 16384);
  EXPECT_EQ(FirstContext({100000, 1024, 4}, 10), 1024);   // at least one quantum
  EXPECT_EQ(FirstContext({5000, 1024, 4}, 16384), 5000);  // n_max below the start
  EXPECT_EQ(FirstContext({700, 1024, 4}, 16384), 700);    // n_max below one quantum
}

TEST(ContextLadderTest, EachRungAtMostGrowthTimesTheLastRungsFlops) {
  const LadderLimits l{1 << 20, 1024, 4};
  // Time is no limit: the FLOPs cap is (2x the context for n^2).
  EXPECT_EQ(NextContext(l, 16384, 1.0, 1e30, 0, Square), 32768);
  const LadderLimits l9{1 << 20, 1024, 9};
  EXPECT_EQ(NextContext(l9, 16384, 1.0, 1e30, 0, Square), 49152);
}

TEST(ContextLadderTest, TheLongestContextWhoseStepFitsTheTimeLeft) {
  const LadderLimits l{1 << 20, 1024, 4};
  // At 1e9 FLOP/s with 600 s left and 2 s of overhead, the longest n with
  // 2 + n^2 / 1e9 <= 600 is sqrt(5.98e11) = 773,304, which rounds down to
  // 755 x 1024; the growth cap (2x the context from 500,000) does not bind.
  const int64_t next = NextContext(l, 500000, 1e9, 600, 2, Square);
  EXPECT_EQ(next, 773120);
  EXPECT_LE(2 + Square(next) / 1e9, 600);
  EXPECT_GT(2 + Square(next + 1024) / 1e9, 600);
}

TEST(ContextLadderTest, TheTighterOfTheTwoLimitsWins) {
  const LadderLimits l{1 << 20, 1024, 4};
  // From 16,384 the FLOPs cap allows 32,768 (n^2); at 1 FLOP/s the time
  // allows sqrt(left).
  EXPECT_EQ(NextContext(l, 16384, 1.0, 40000.0 * 40000.0, 0, Square), 32768);  // FLOPs bind
  EXPECT_EQ(NextContext(l, 16384, 1.0, 20000.0 * 20000.0, 0, Square), 19456);  // time binds
}

TEST(ContextLadderTest, NMaxIsReachedEvenWhenNotAMultipleOfTheQuantum) {
  const LadderLimits l{40000, 1024, 4};
  EXPECT_EQ(NextContext(l, 32768, 1.0, 1e30, 0, Square), 40000);
  // Already there: no rung after it.
  EXPECT_EQ(NextContext(l, 40000, 1.0, 1e30, 0, Square), 0);
}

TEST(ContextLadderTest, NoRungWhenNoLongerContextFitsTheTime) {
  const LadderLimits l{1 << 20, 1024, 4};
  // One quantum more takes (17408^2 = 3.03e8) / 1e8 = 3.03 s; 3 s are left.
  EXPECT_EQ(NextContext(l, 16384, 1e8, 3.0, 0, Square), 0);
  // The overhead alone uses up the time.
  EXPECT_EQ(NextContext(l, 16384, 1e12, 5.0, 5.0, Square), 0);
  // A rate that is not positive (a step that took no time to measure) ends it.
  EXPECT_EQ(NextContext(l, 16384, 0.0, 1e30, 0, Square), 0);
}

TEST(ContextLadderTest, TheClimbEndsAtNMaxWithinItsTime) {
  // A run of the ladder against a machine whose rate grows with the
  // context (as attention's does): it reaches n_max, every rung predicted
  // within the time left, each longer than the last.
  const LadderLimits l{1 << 20, 1024, 4};
  auto rate = [](int64_t n) { return 1e14 * (1.0 - 4096.0 / (n + 4096.0)); };
  double left = 1000;
  int64_t n = FirstContext(l, 16384);
  int rungs = 1;
  for (;;) {
    left -= Square(n) * 1e3 / rate(n) + 1;  // a step (1e3 n^2 FLOPs) and a second's overhead
    const int64_t next =
        NextContext(l, n, rate(n), left, 1, [](int64_t m) { return Square(m) * 1e3; });
    if (next == 0) break;
    EXPECT_GT(next, n);
    n = next;
    ++rungs;
  }
  EXPECT_EQ(n, 1 << 20);
  EXPECT_EQ(rungs, 7);  // 16K, 32K, ..., 1M
}

TEST(ContextLadderTest, AClimbAtAConstantRateEndsWithinItsTimeBelowNMax) {
  // A rate that does not change: each prediction is exact, so the climb
  // spends at most its time and stops where the next rung would not fit.
  const LadderLimits l{1 << 20, 1024, 4};
  const double rate = 1e12;
  auto flops = [](int64_t m) { return Square(m) * 1e3; };
  double left = 200;
  int64_t n = FirstContext(l, 16384);
  for (;;) {
    left -= flops(n) / rate + 1;
    ASSERT_GE(left, 0) << "rung " << n << " overran";
    const int64_t next = NextContext(l, n, rate, left, 1, flops);
    if (next == 0) break;
    n = next;
  }
  // 1M would take 1,100 s: the climb stops below it, and no longer context
  // would have fitted what was left.
  EXPECT_LT(n, 1 << 20);
  EXPECT_GT(1 + flops(n + 1024) / rate, left);
}

}  // namespace
}  // namespace bench
}  // namespace plateau
