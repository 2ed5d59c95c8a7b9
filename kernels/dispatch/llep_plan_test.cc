// The backend-free half of LLEP and PipelinedLLEP: option validation, the
// least-loaded assignment (by hand on small cases, by invariant on random
// ones), the per-rank plans (simulated on the host: every route reaches a
// group of its own expert), the chunk membership, and the bounds (the
// borrowed-expert bound over random loads; Eq. 1; flat in N).
#include "kernels/dispatch/llep_plan.h"

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/model/step_options.h"
#include "kernels/dispatch/routing_profiles.h"
#include "kernels/model/config.h"
#include "kernels/testing/tiny_model.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

LlepOptions Opts(double alpha, int64_t min_piece, double lambda = 1.0,
                 int64_t max_borrowed = 0) {
  LlepOptions o;
  o.alpha = alpha;
  o.min_piece = min_piece;
  o.lambda = lambda;
  o.max_borrowed = max_borrowed;
  return o;
}

ModelConfig Model(int64_t experts, int64_t k = 2) {
  ModelConfig m = TinyModel();
  m.experts = experts;
  m.top_k = k;
  return m;
}

// ---------------------------------------------------------------------------
// Validation.

TEST(LlepPlanTest, BadOptionsNameTheFieldAsTyped) {
  EXPECT_TRUE(ValidateLlepOptions(LlepOptions{}).ok());
  EXPECT_TRUE(ValidatePipelinedLlepOptions(PipelinedLlepOptions{}).ok());
  struct Case {
    LlepOptions o;
    const char* field;
  };
  const Case cases[] = {
      {Opts(0.0, 1), "alpha"},          {Opts(-1.0, 1), "alpha"},
      {Opts(std::nan(""), 1), "alpha"}, {Opts(INFINITY, 1), "alpha"},
      {Opts(1.0, 0), "min_piece"},      {Opts(1.0, -5), "min_piece"},
      {Opts(1.0, 1, 0.5), "lambda"},    {Opts(1.0, 1, std::nan("")), "lambda"},
      {Opts(1.0, 1, 1.0, -1), "max_borrowed"},
  };
  for (const Case& c : cases) {
    absl::Status st = ValidateLlepOptions(c.o);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(st.message(), HasSubstr(absl::StrCat("schedule.llep.", c.field)));
    PipelinedLlepOptions p;
    p.balance = c.o;
    st = ValidatePipelinedLlepOptions(p);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(st.message(), HasSubstr(absl::StrCat("schedule.pipelined_llep.", c.field)));
  }
  for (int64_t c : {0, -3}) {
    PipelinedLlepOptions p;
    p.chunk_tokens = c;
    absl::Status st = ValidatePipelinedLlepOptions(p);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("schedule.pipelined_llep.chunk_tokens"));
  }
  PipelinedLlepOptions p;
  p.membership = static_cast<ChunkMembership>(7);
  EXPECT_THAT(ValidatePipelinedLlepOptions(p).message(),
              HasSubstr("schedule.pipelined_llep.membership"));
}

TEST(LlepPlanTest, ShapeChecksNameTheField) {
  EXPECT_TRUE(ValidateLlepShape(Model(8), 4).ok());
  EXPECT_THAT(ValidateLlepShape(Model(8), 3).message(), HasSubstr("model.experts"));
  EXPECT_THAT(ValidateLlepShape(Model(2), 4).message(), HasSubstr("model.experts"));
  EXPECT_THAT(ValidateLlepShape(Model(8, 9), 2).message(), HasSubstr("model.top_k"));
  EXPECT_THAT(ValidateLlepShape(Model(8), 0).message(), HasSubstr("layout.ranks"));
}

// ---------------------------------------------------------------------------
// The assignment.

// Pieces of every expert tile [0, load) in order; rank_rows is what they add
// up to per rank; helper pieces have >= min_piece routes.
void ExpectWellFormed(const LlepAssignment& a, const std::vector<int64_t>& loads, int64_t P,
                      int64_t min_piece) {
  const int64_t E = static_cast<int64_t>(loads.size()), Ep = E / P;
  ASSERT_EQ(a.pieces.size(), loads.size());
  std::vector<int64_t> rows(P, 0);
  for (int64_t e = 0; e < E; ++e) {
    int64_t at = 0;
    for (const LlepPiece& q : a.pieces[e]) {
      EXPECT_EQ(q.begin, at) << "expert " << e;
      EXPECT_GT(q.end, q.begin) << "expert " << e;
      if (q.rank != e / Ep) {
        EXPECT_GE(q.end - q.begin, min_piece) << "expert " << e;
      }
      rows[q.rank] += q.end - q.begin;
      at = q.end;
    }
    EXPECT_EQ(at, loads[e]) << "expert " << e;
  }
  EXPECT_EQ(rows, a.rank_rows);
}

std::vector<std::vector<int64_t>> Pieces(const LlepAssignment& a, int64_t e) {
  std::vector<std::vector<int64_t>> out;
  for (const LlepPiece& q : a.pieces[e]) out.push_back({q.rank, q.begin, q.end});
  return out;
}

// The reference's example shape: one hot expert; its home keeps C, the
// overflow goes to the least effectively loaded rank, whose own experts
// then fit beside it.
TEST(LlepPlanTest, TheHomeKeepsItsCapacityAndTheOverflowGoesToTheLeastLoaded) {
  const std::vector<int64_t> loads = {100, 0, 10, 10};  // P = 2: {0, 1} on rank 0
  const LlepAssignment a = AssignLlep(loads, 2, Opts(1.0, 1));
  ExpectWellFormed(a, loads, 2, 1);
  EXPECT_TRUE(a.balanced);
  EXPECT_EQ(a.capacity, 60);
  EXPECT_EQ(Pieces(a, 0), (std::vector<std::vector<int64_t>>{{0, 0, 60}, {1, 60, 100}}));
  EXPECT_EQ(Pieces(a, 2), (std::vector<std::vector<int64_t>>{{1, 0, 10}}));
  EXPECT_EQ(a.rank_rows, (std::vector<int64_t>{60, 60}));
  // An overflow smaller than min_piece stays home.
  const LlepAssignment big = AssignLlep(loads, 2, Opts(1.0, 41));
  ExpectWellFormed(big, loads, 2, 41);
  EXPECT_EQ(Pieces(big, 0), (std::vector<std::vector<int64_t>>{{0, 0, 100}}));
  const LlepAssignment fits = AssignLlep(loads, 2, Opts(1.0, 40));
  EXPECT_EQ(Pieces(fits, 0), (std::vector<std::vector<int64_t>>{{0, 0, 60}, {1, 60, 100}}));
}

// A finite alpha too large for int64 capacity means "never spill": every
// expert stays home (its conversion used to be undefined, and gave 1).
TEST(LlepPlanTest, AHugeAlphaKeepsEveryExpertHome) {
  const std::vector<int64_t> loads = {100, 0, 10, 10};
  const LlepAssignment a = AssignLlep(loads, 2, Opts(1e300, 1));
  ExpectWellFormed(a, loads, 2, 1);
  EXPECT_EQ(a.capacity, int64_t{1} << 62);
  EXPECT_EQ(Pieces(a, 0), (std::vector<std::vector<int64_t>>{{0, 0, 100}}));
  EXPECT_EQ(a.rank_rows, (std::vector<int64_t>{100, 20}));
}

// A piece that would leave a remainder below min_piece takes it along.
TEST(LlepPlanTest, NoRemainderSmallerThanAPieceIsLeft) {
  const std::vector<int64_t> loads = {90, 0, 0};  // P = 3, one expert each
  const LlepAssignment a = AssignLlep(loads, 3, Opts(0.9, 20));
  ExpectWellFormed(a, loads, 3, 20);
  EXPECT_EQ(a.capacity, 27);
  EXPECT_EQ(Pieces(a, 0),
            (std::vector<std::vector<int64_t>>{{0, 0, 27}, {1, 27, 54}, {2, 54, 90}}));
  // With pieces of 1 the last helper stops at its capacity... and the rest
  // is forced onto the least-loaded helper (every one is full).
  const LlepAssignment b = AssignLlep(loads, 3, Opts(0.9, 1));
  ExpectWellFormed(b, loads, 3, 1);
  EXPECT_EQ(Pieces(b, 0), (std::vector<std::vector<int64_t>>{
                              {0, 0, 27}, {1, 27, 54}, {2, 54, 81}, {1, 81, 90}}));
}

// alpha < 1: capacities do not cover the routes; what no helper has room for
// goes to the least effectively loaded one.
TEST(LlepPlanTest, OverflowWithoutRoomIsForcedOntoTheLeastLoaded) {
  const std::vector<int64_t> loads = {100, 50};  // P = 2, one expert each
  const LlepAssignment a = AssignLlep(loads, 2, Opts(0.5, 1));
  ExpectWellFormed(a, loads, 2, 1);
  EXPECT_EQ(a.capacity, 37);
  // Expert 0 keeps 37; rank 1's effective load is already 50 (its own
  // expert, pending), so the 63 left are forced onto it. Expert 1's home is
  // then over capacity: all 50 go to rank 0.
  EXPECT_EQ(Pieces(a, 0), (std::vector<std::vector<int64_t>>{{0, 0, 37}, {1, 37, 100}}));
  EXPECT_EQ(Pieces(a, 1), (std::vector<std::vector<int64_t>>{{0, 0, 50}}));
  EXPECT_EQ(a.rank_rows, (std::vector<int64_t>{87, 63}));
}

TEST(LlepPlanTest, BelowLambdaOrOnOneRankItIsPlainExpertParallelism) {
  const std::vector<int64_t> loads = {30, 30, 45, 15};  // ranks 60 / 60: balanced
  struct Case {
    std::vector<int64_t> loads;
    int64_t P;
    double lambda;
  };
  const std::vector<Case> cases = {{loads, 2, 1.0},
                                   {{100, 0, 10, 10}, 2, 1.7},  // max / mean = 100 / 60 < 1.7
                                   {{100, 0, 10, 10}, 1, 1.0},
                                   {{0, 0, 0, 0}, 2, 1.0}};
  for (const Case& c : cases) {
    const LlepAssignment a = AssignLlep(c.loads, c.P, Opts(1.0, 1, c.lambda));
    ExpectWellFormed(a, c.loads, c.P, 1);
    for (size_t e = 0; e < c.loads.size(); ++e) {
      for (const LlepPiece& q : a.pieces[e]) {
        EXPECT_EQ(q.rank, static_cast<int64_t>(e) / (4 / c.P));
      }
    }
  }
  EXPECT_FALSE(AssignLlep(std::vector<int64_t>{100, 0, 10, 10}, 2, Opts(1.0, 1, 1.7)).balanced);
  EXPECT_TRUE(AssignLlep(std::vector<int64_t>{100, 0, 10, 10}, 2, Opts(1.0, 1, 1.6)).balanced);
  EXPECT_TRUE(AssignLlep(loads, 2, Opts(1.0, 1)).balanced);  // ran; moved nothing
}

// Equal loads: lower expert id first; equal effective loads: lower rank.
TEST(LlepPlanTest, TiesAreBrokenByIdAndRank) {
  const std::vector<int64_t> loads = {40, 40, 0, 0, 0, 0};  // P = 3, two experts each
  const LlepAssignment a = AssignLlep(loads, 3, Opts(1.0, 1));
  ExpectWellFormed(a, loads, 3, 1);
  EXPECT_EQ(a.capacity, 26);
  // Expert 0 goes first. Its home's effective load is expert 1's pending 40,
  // over C: all 40 move, to rank 1 (tied with rank 2 at 0) up to C, the
  // rest to rank 2.
  EXPECT_EQ(Pieces(a, 0), (std::vector<std::vector<int64_t>>{{1, 0, 26}, {2, 26, 40}}));
  // Expert 1: home keeps C; rank 2 (14) has 12 free; the last 2 are forced
  // onto rank 1 (26, tied with rank 2 at 26).
  EXPECT_EQ(Pieces(a, 1),
            (std::vector<std::vector<int64_t>>{{0, 0, 26}, {2, 26, 38}, {1, 38, 40}}));
}

// Random loads, skewed and not, with and without max_borrowed: the
// invariants, and the bounds on borrowed and lent experts that size
// PipelinedLLEP's slots (each attained somewhere, so none is loose).
TEST(LlepPlanTest, BorrowedAndLentExpertsStayWithinTheirBounds) {
  std::mt19937_64 rng(17);
  int64_t cases = 0;
  std::map<int64_t, int64_t> reached, lent_reached;  // by max_borrowed
  for (int64_t cap : {0, 1, 2, 3}) {
    for (int64_t P : {2, 4, 8}) {
      for (int64_t E : {P, 2 * P, 4 * P, int64_t{32}}) {
        if (E % P != 0) continue;
        const int64_t Ep = E / P;
        for (int64_t m : {1, 2, 5, 16}) {
          for (int trial = 0; trial < 30; ++trial) {
            std::vector<int64_t> loads(E);
            const int64_t hot = rng() % E;
            for (int64_t e = 0; e < E; ++e) {
              loads[e] = rng() % 20 + (trial % 3 == 0 ? 0 : (e <= hot ? rng() % 200 : 0));
            }
            const double alpha = 0.5 + (rng() % 8) * 0.25;
            const LlepOptions o = Opts(alpha, m, 1.0, cap);
            const LlepAssignment a = AssignLlep(loads, P, o);
            ExpectWellFormed(a, loads, P, m);
            const int64_t T = std::accumulate(loads.begin(), loads.end(), int64_t{0});
            const ModelConfig model = Model(E);
            const int64_t bmax = LlepMaxBorrowed(model, P, T, o);
            const int64_t lmax = LlepMaxLent(model, P, T, o);
            if (cap > 0) {
              EXPECT_LE(bmax, cap);
              EXPECT_LE(lmax, cap * (P - 1));
            }
            for (int64_t r = 0; r < P; ++r) {
              std::set<int64_t> borrowed;
              std::set<std::pair<int64_t, int64_t>> lent;
              for (int64_t e = 0; e < E; ++e) {
                for (const LlepPiece& q : a.pieces[e]) {
                  if (q.rank == r && e / Ep != r) borrowed.insert(e);
                  if (e / Ep == r && q.rank != r) lent.insert({q.rank, e});
                }
              }
              EXPECT_LE(static_cast<int64_t>(borrowed.size()), bmax);
              EXPECT_LE(static_cast<int64_t>(lent.size()), lmax);
              reached[cap] += static_cast<int64_t>(borrowed.size()) == bmax && bmax > 0;
              lent_reached[cap] += static_cast<int64_t>(lent.size()) == lmax && lmax > 0;
            }
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 2000);
  for (int64_t cap : {0, 1, 2, 3}) {
    EXPECT_GT(reached[cap], 0) << "max_borrowed " << cap
                               << ": the borrowed bound is never attained: is it the tightest?";
  }
  for (int64_t cap : {1, 2}) {
    EXPECT_GT(lent_reached[cap], 0) << "max_borrowed " << cap
                                    << ": the lent bound is never attained";
  }
}

// max_borrowed by hand: the helper that is full of borrowed experts is
// passed over for the next one, and an expert that no rank may borrow stays
// home whole, over capacity.
TEST(LlepPlanTest, MaxBorrowedPassesOverAFullHelperAndKeepsTheRestHome) {
  // P = 3, one expert each, two hot ones. Uncapped, rank 2 borrows both
  // overflows.
  const std::vector<int64_t> hot2 = {90, 60, 0};
  const LlepAssignment wide = AssignLlep(hot2, 3, Opts(1.0, 1));
  ExpectWellFormed(wide, hot2, 3, 1);
  EXPECT_EQ(wide.capacity, 50);
  EXPECT_EQ(Pieces(wide, 0), (std::vector<std::vector<int64_t>>{{0, 0, 50}, {2, 50, 90}}));
  EXPECT_EQ(Pieces(wide, 1), (std::vector<std::vector<int64_t>>{{1, 0, 50}, {2, 50, 60}}));
  // Capped at 1: rank 2 is full after expert 0, so expert 1's overflow is
  // forced onto rank 0 (over its capacity, but free to borrow).
  const LlepAssignment capped = AssignLlep(hot2, 3, Opts(1.0, 1, 1.0, 1));
  ExpectWellFormed(capped, hot2, 3, 1);
  EXPECT_EQ(Pieces(capped, 0), Pieces(wide, 0));
  EXPECT_EQ(Pieces(capped, 1), (std::vector<std::vector<int64_t>>{{1, 0, 50}, {0, 50, 60}}));
  // A cap of 2 is no cap here.
  const LlepAssignment two = AssignLlep(hot2, 3, Opts(1.0, 1, 1.0, 2));
  EXPECT_EQ(Pieces(two, 1), Pieces(wide, 1));

  // P = 2, three hot experts on rank 0 (C = 150). Uncapped: expert 0 goes
  // to rank 1 whole (its home is full of pending work), expert 1 is split.
  const std::vector<int64_t> three = {100, 100, 100, 0, 0, 0};
  const LlepAssignment split = AssignLlep(three, 2, Opts(1.0, 1));
  ExpectWellFormed(split, three, 2, 1);
  EXPECT_EQ(split.capacity, 150);
  EXPECT_EQ(Pieces(split, 0), (std::vector<std::vector<int64_t>>{{1, 0, 100}}));
  EXPECT_EQ(Pieces(split, 1), (std::vector<std::vector<int64_t>>{{0, 0, 50}, {1, 50, 100}}));
  EXPECT_EQ(split.rank_rows, (std::vector<int64_t>{150, 150}));
  // Capped at 1: once rank 1 borrows expert 0, no rank may borrow another
  // of rank 0's: they stay home whole, over capacity.
  const LlepAssignment home = AssignLlep(three, 2, Opts(1.0, 1, 1.0, 1));
  ExpectWellFormed(home, three, 2, 1);
  EXPECT_EQ(Pieces(home, 0), (std::vector<std::vector<int64_t>>{{1, 0, 100}}));
  EXPECT_EQ(Pieces(home, 1), (std::vector<std::vector<int64_t>>{{0, 0, 100}}));
  EXPECT_EQ(Pieces(home, 2), (std::vector<std::vector<int64_t>>{{0, 0, 100}}));
  EXPECT_EQ(home.rank_rows, (std::vector<int64_t>{200, 100}));
}

// ---------------------------------------------------------------------------
// Per-rank plans, simulated: each rank's sends land at the right receivers,
// in the right expert groups.

struct World {
  ModelConfig m;
  int64_t P;
  std::vector<std::vector<int32_t>> chosen;  // per rank, [N*k]
  std::vector<std::vector<int32_t>> tokens;  // per rank, the chunk's token rows
  std::vector<int64_t> counts;               // [P*E]
  LlepAssignment a;
  std::vector<LlepRankPlan> plans;
};

World Plan(const ModelConfig& m, const std::vector<int64_t>& n, const RoutingProfile& profile,
           const LlepOptions& o, int64_t chunks = 1, int64_t chunk = 0,
           ChunkMembership membership = ChunkMembership::kStrided) {
  World w{m, static_cast<int64_t>(n.size()), {}, {}, {}, {}, {}};
  const int64_t E = m.experts, K = m.top_k;
  w.counts.assign(w.P * E, 0);
  for (int64_t p = 0; p < w.P; ++p) {
    absl::StatusOr<Routes> r = MakeRoutes(profile, E, K, n[p], 99, static_cast<int>(p));
    EXPECT_TRUE(r.ok());
    w.chosen.push_back(r->chosen);
    w.tokens.push_back(ChunkTokenRows(n[p], chunks, chunk, membership));
    for (int32_t t : w.tokens[p]) {
      for (int64_t j = 0; j < K; ++j) ++w.counts[p * E + w.chosen[p][t * K + j]];
    }
  }
  std::vector<int64_t> loads(E, 0);
  for (int64_t p = 0; p < w.P; ++p) {
    for (int64_t e = 0; e < E; ++e) loads[e] += w.counts[p * E + e];
  }
  w.a = AssignLlep(loads, w.P, o);
  for (int64_t p = 0; p < w.P; ++p) {
    absl::StatusOr<LlepRankPlan> plan = PlanLlepRank(w.a, w.counts, static_cast<int>(p), w.P, m,
                                                     w.chosen[p], n[p], w.tokens[p]);
    EXPECT_TRUE(plan.ok()) << plan.status();
    w.plans.push_back(*plan);
  }
  return w;
}

void ExpectConsistent(const World& w) {
  const int64_t P = w.P, E = w.m.experts, K = w.m.top_k, Ep = E / P;
  for (int64_t s = 0; s < P; ++s) {
    for (int64_t d = 0; d < P; ++d) {
      EXPECT_EQ(w.plans[s].send_rows[d], w.plans[d].recv_rows[s]) << s << " -> " << d;
      EXPECT_EQ(w.plans[s].lent_to[d], w.plans[d].borrowed_from[s]) << s << " -> " << d;
    }
    EXPECT_EQ(w.plans[s].transfers, w.plans[0].transfers);
  }
  int64_t moved = 0;
  for (int64_t d = 0; d < P; ++d) {
    const LlepRankPlan& p = w.plans[d];
    // What arrives at d, in received order: source-major, each source's
    // block at its send offset for d.
    std::vector<std::pair<int64_t, int32_t>> recv;  // (source, route id)
    for (int64_t s = 0; s < P; ++s) {
      const LlepRankPlan& q = w.plans[s];
      int64_t off = 0;
      for (int64_t x = 0; x < d; ++x) off += q.send_rows[x];
      for (int64_t i = 0; i < q.send_rows[d]; ++i) recv.push_back({s, q.route_at_pos[off + i]});
    }
    ASSERT_EQ(static_cast<int64_t>(recv.size()), p.rows());
    EXPECT_EQ(p.rows(), w.a.rank_rows[d]);
    // perm is a permutation with inverse inv_perm; each group's rows route
    // to its expert.
    std::vector<int32_t> sorted(p.perm);
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < p.rows(); ++i) {
      ASSERT_EQ(sorted[i], i);
      EXPECT_EQ(p.inv_perm[p.perm[i]], i);
    }
    int64_t row = 0;
    std::set<int32_t> borrowed(p.borrowed.begin(), p.borrowed.end());
    for (const LlepGroup& g : p.groups) {
      EXPECT_EQ(g.local >= 0, g.expert / Ep == d);
      if (g.borrowed >= 0) {
        EXPECT_EQ(p.borrowed[g.borrowed], g.expert);
        ++moved;
      }
      for (int64_t i = 0; i < g.rows; ++i, ++row) {
        const auto [s, route] = recv[p.perm[row]];
        EXPECT_EQ(w.chosen[s][route], g.expert) << "rank " << d << " row " << row;
      }
      borrowed.erase(g.expert);
    }
    EXPECT_TRUE(borrowed.empty()) << "a borrowed expert without rows at rank " << d;
    EXPECT_EQ(row, p.rows());
    // The sender's indices: route_pos and route_at_pos are inverse; rows of u.
    for (int64_t i = 0; i < p.tokens; ++i) {
      for (int64_t j = 0; j < K; ++j) {
        const int64_t pos = p.route_pos[i * K + j];
        EXPECT_EQ(p.route_at_pos[pos], w.tokens[d][i] * K + j);
        EXPECT_EQ(p.send_index[pos], w.tokens[d][i]);
        if (p.first_token < 0) {
          EXPECT_EQ(p.chunk_routes[i * K + j], w.tokens[d][i] * K + j);
        }
      }
    }
    if (p.first_token < 0) {
      EXPECT_EQ(p.token_rows, w.tokens[d]);
    }
  }
  EXPECT_EQ(moved > 0, w.plans[0].transfers);
}

TEST(LlepPlanTest, EveryRouteReachesAGroupOfItsExpert) {
  const ModelConfig m = Model(8);
  for (int64_t P : {1, 2, 4}) {
    for (const RoutingProfile& profile :
         {BalancedRouting(), HotRouting(50, 4), HotRouting(80, 2), HotRouting(100, 1)}) {
      SCOPED_TRACE(absl::StrCat("P = ", P, ", ", profile.Name()));
      std::vector<int64_t> n;
      for (int64_t p = 0; p < P; ++p) n.push_back(20 + 7 * p);
      const World w = Plan(m, n, profile, Opts(1.0, 3));
      ExpectConsistent(w);
      if (P > 1 && profile.hot_percent == 100.0) {
        EXPECT_TRUE(w.plans[0].transfers);
      }
      // Strided and contiguous chunks of the same layer.
      for (ChunkMembership mem : {ChunkMembership::kStrided, ChunkMembership::kContiguous}) {
        for (int64_t j : {0, 2}) ExpectConsistent(Plan(m, n, profile, Opts(1.0, 3), 3, j, mem));
      }
    }
  }
  // A rank without tokens, and one that is sent nothing (plain EP, routes
  // avoid rank 1's experts).
  const World w = Plan(m, {0, 12}, HotRouting(100, 4), Opts(1.0, 1, 100.0));
  ExpectConsistent(w);
  EXPECT_EQ(w.plans[0].routes(), 0);
  EXPECT_EQ(w.plans[1].rows(), 0);
}

// A plan made without its index vectors (PipelinedLLEP's Forward and
// Backward, which run from the staged words) is the full plan less those
// vectors: the same sizes, exchanges, groups and transfers, in strided
// chunks (the token view) and whole layers alike.
TEST(LlepPlanTest, APlanWithoutIndexVectorsIsTheRestOfTheFullPlan) {
  const ModelConfig m = Model(8);
  for (int64_t chunks : {1, 3}) {
    const World w = Plan(m, {20, 27, 34, 41}, HotRouting(80, 2), Opts(1.0, 3), chunks, chunks - 1);
    for (int p = 0; p < 4; ++p) {
      SCOPED_TRACE(absl::StrCat("K = ", chunks, ", rank ", p));
      absl::StatusOr<LlepRankPlan> bare =
          PlanLlepRank(w.a, w.counts, p, 4, m, w.chosen[p], 20 + 7 * p, w.tokens[p], /*index_vectors=*/false);
      ASSERT_TRUE(bare.ok()) << bare.status();
      const LlepRankPlan& full = w.plans[p];
      ASSERT_GT(full.routes(), 0);
      EXPECT_EQ(bare->routes(), full.routes());
      EXPECT_EQ(bare->rows(), full.rows());
      EXPECT_EQ(bare->tokens, full.tokens);
      EXPECT_EQ(bare->first_token, full.first_token);
      EXPECT_EQ(bare->send_rows, full.send_rows);
      EXPECT_EQ(bare->recv_rows, full.recv_rows);
      ASSERT_EQ(bare->groups.size(), full.groups.size());
      for (size_t g = 0; g < full.groups.size(); ++g) {
        EXPECT_EQ(bare->groups[g].expert, full.groups[g].expert);
        EXPECT_EQ(bare->groups[g].rows, full.groups[g].rows);
        EXPECT_EQ(bare->groups[g].local, full.groups[g].local);
        EXPECT_EQ(bare->groups[g].borrowed, full.groups[g].borrowed);
      }
      EXPECT_EQ(bare->borrowed, full.borrowed);
      EXPECT_EQ(bare->borrowed_from, full.borrowed_from);
      EXPECT_EQ(bare->lent, full.lent);
      EXPECT_EQ(bare->lent_to, full.lent_to);
      EXPECT_EQ(bare->transfers, full.transfers);
      EXPECT_EQ(LlepChunkSizesOf(*bare).token_view, LlepChunkSizesOf(full).token_view);
      for (const std::vector<int32_t>* v : {&bare->send_index, &bare->route_at_pos, &bare->route_pos, &bare->perm,
                                            &bare->inv_perm, &bare->token_rows, &bare->chunk_routes}) {
        EXPECT_TRUE(v->empty());
      }
    }
  }
}

TEST(LlepPlanTest, OwnCountsThatDisagreeWithTheRoutesAreInternal) {
  const ModelConfig m = Model(4);
  World w = Plan(m, {5, 5}, BalancedRouting(), Opts(1.0, 1));
  std::vector<int64_t> counts = w.counts;
  // Rank 0's count of one expert off by one (the total kept).
  const int64_t e = w.chosen[0][0], other = (e + 1) % 4;
  --counts[e];
  ++counts[other];
  std::vector<int64_t> loads(4, 0);
  for (int64_t i = 0; i < 8; ++i) loads[i % 4] += counts[i];
  const LlepAssignment a = AssignLlep(loads, 2, Opts(1.0, 1));
  absl::StatusOr<LlepRankPlan> plan = PlanLlepRank(a, counts, 0, 2, m, w.chosen[0], 5, w.tokens[0]);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInternal);
  std::vector<int32_t> bad = w.chosen[0];
  bad[3] = 4;
  plan = PlanLlepRank(w.a, w.counts, 0, 2, m, bad, 5, w.tokens[0]);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(plan.status().message(), HasSubstr("expert 4"));
}

// ---------------------------------------------------------------------------
// Chunks.

TEST(LlepPlanTest, ChunksPartitionTheTokensWithinTheCap) {
  EXPECT_EQ(PipelinedLlepChunks(0, 4), 0);
  EXPECT_EQ(PipelinedLlepChunks(1, 4), 1);
  EXPECT_EQ(PipelinedLlepChunks(4, 4), 1);
  EXPECT_EQ(PipelinedLlepChunks(5, 4), 2);
  // A spec may ask for any positive chunk_tokens: no overflow to 0 chunks.
  EXPECT_EQ(PipelinedLlepChunks(64, INT64_MAX), 1);
  EXPECT_EQ(PipelinedLlepChunks(INT64_MAX, INT64_MAX), 1);
  EXPECT_EQ(PipelinedLlepChunks(INT64_MAX, 1), INT64_MAX);
  for (int64_t c : {1, 3, 7}) {
    for (int64_t max_n : {1, 10, 23}) {
      const int64_t K = PipelinedLlepChunks(max_n, c);
      for (int64_t N = 0; N <= max_n; ++N) {
        std::vector<int64_t> sizes[2];
        for (ChunkMembership mem : {ChunkMembership::kStrided, ChunkMembership::kContiguous}) {
          std::vector<int32_t> all;
          for (int64_t j = 0; j < K; ++j) {
            const std::vector<int32_t> rows = ChunkTokenRows(N, K, j, mem);
            EXPECT_LE(static_cast<int64_t>(rows.size()), std::min(c, (N + K - 1) / K));
            for (size_t i = 0; i < rows.size(); ++i) {
              if (mem == ChunkMembership::kStrided) {
                EXPECT_EQ(rows[i], j + static_cast<int64_t>(i) * K);
              } else if (i > 0) {
                EXPECT_EQ(rows[i], rows[i - 1] + 1);
              }
            }
            all.insert(all.end(), rows.begin(), rows.end());
            sizes[mem == ChunkMembership::kStrided].push_back(static_cast<int64_t>(rows.size()));
          }
          std::sort(all.begin(), all.end());
          std::vector<int32_t> want(N);
          std::iota(want.begin(), want.end(), 0);
          EXPECT_EQ(all, want) << "N = " << N << ", K = " << K;
        }
        // The same chunk sizes, in another order.
        std::sort(sizes[0].begin(), sizes[0].end());
        std::sort(sizes[1].begin(), sizes[1].end());
        EXPECT_EQ(sizes[0], sizes[1]);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Bounds.

// The list, element by element, against the formula written out here.
TEST(LlepPlanTest, ChunkBuffersAreTheDocumentedList) {
  const ModelConfig m = Model(8);
  const int64_t H = m.hidden, F = m.expert_ffn;
  for (bool view : {false, true}) {
    LlepChunkSizes s{5, 10, 31, 2, 3, view};
    const int64_t ints = 3 * 10 + 2 * 31 + (view ? 5 + 10 : 0);
    const int64_t floats = 10 + (view ? 20 : 0) + 10 * H + 3 * 31 * H + 5 * 31 * F +
                           (view ? 5 * H : 0) + (2 * 2 + 3) * 3 * H * F;
    EXPECT_EQ(DispatchBufferBytes(LlepChunkBuffers(m, s)), 4 * ints + 4 * floats);
    EXPECT_EQ(LlepIndexLayoutOf(s).total, ints);
    EXPECT_EQ(LlepPeakBytes(m, 4, s), 4 * ints + 4 * floats + 8 * (8 + 4 * 8));
  }
}

TEST(LlepPlanTest, PipelinedSlotsFollowEquationOne) {
  const ModelConfig m = Model(16, 4);
  PipelinedLlepOptions o;
  o.chunk_tokens = 32;
  o.balance.min_piece = 16;
  for (int64_t P : {2, 4, 8}) {
    const LlepChunkSizes s = PipelinedLlepSlotSizes(m, P, 1 << 20, o);
    EXPECT_EQ(s.rows, P * 32 * 4);  // receiver rows <= P c k
    EXPECT_EQ(s.routes, 32 * 4);
    EXPECT_EQ(s.borrowed, std::min(16 - 16 / P, P * 32 * 4 / 16));
    EXPECT_EQ(s.lent, std::min(16 / P * (P - 1), P * 32 * 4 / 16));
    // At small N the slots follow c_eff = N.
    EXPECT_EQ(PipelinedLlepSlotSizes(m, P, 10, o).rows, P * 10 * 4);
  }
}

// The bound does not grow with N except by the per-chunk counts (8 (P+1) E
// bytes a chunk); LLEP's worst case grows linearly.
TEST(LlepPlanTest, ThePipelinedBoundIsFlatInN) {
  const ModelConfig m = Model(16, 4);
  PipelinedLlepOptions o;
  o.chunk_tokens = 64;
  o.balance.min_piece = 8;
  const int64_t P = 4;
  const int64_t b1 = PipelinedLlepBoundBytes(m, P, 64 * 10, o);
  const int64_t b2 = PipelinedLlepBoundBytes(m, P, 64 * 1000, o);
  EXPECT_EQ(b2 - b1, 8 * (P + 1) * m.experts * (1000 - 10));
  EXPECT_LT(b2, LlepWorstCasePeakBytes(m, P, 64 * 1000, o.balance) / 50);
  EXPECT_LT(PipelinedLlepBoundBytes(m, P, 4096, o), LlepWorstCasePeakBytes(m, P, 4096, o.balance));
  // Halving c roughly halves the bound (the terms in P c k dominate).
  PipelinedLlepOptions half = o;
  half.chunk_tokens = 32;
  EXPECT_LT(PipelinedLlepBoundBytes(m, P, 4096, half), PipelinedLlepBoundBytes(m, P, 4096, o));
  EXPECT_EQ(PipelinedLlepHostIndexWords(m, P, 4096, o),
            64 * LlepIndexLayoutOf(PipelinedLlepSlotSizes(m, P, 4096, o)).total);
  // The counts kept per layer for the recompute: K and [P][K_max][E].
  EXPECT_EQ(PipelinedLlepKeptCountWords(m, P, 4096, o), m.layers * (1 + P * 64 * m.experts));
  EXPECT_EQ(PipelinedLlepKeptCountWords(m, P, 64, o), m.layers * (1 + P * m.experts));
  // The planner's arrays: the routes [N k] int32; the counts [P + 1][K][E]
  // and one chunk's [P + 1][E] int64. Linear in N, like the staging.
  EXPECT_EQ(PipelinedLlepPlanningBytes(m, P, 4096, o),
            4096 * m.top_k * 4 + ((P + 1) * 64 * m.experts + (P + 1) * m.experts) * 8);
  EXPECT_EQ(PipelinedLlepHostBytes(m, P, 4096, o),
            4 * (PipelinedLlepHostIndexWords(m, P, 4096, o) + PipelinedLlepKeptCountWords(m, P, 4096, o)) +
                PipelinedLlepPlanningBytes(m, P, 4096, o));
  EXPECT_EQ(PipelinedLlepBoundBytes(m, P, 0, o), 8);  // nothing but the N exchange
}

// max_borrowed sizes the borrowed-weight terms (2 x 3HF floats per borrowed
// expert, 3HF per lent pair) for B = max_borrowed instead of the worst case:
// the bound falls by exactly those terms, and 0 is the uncapped bound.
TEST(LlepPlanTest, MaxBorrowedShrinksTheBoundByTheBorrowedWeights) {
  const ModelConfig m = Model(16, 4);
  const int64_t P = 4, X = 3 * m.hidden * m.expert_ffn * 4;  // bytes per expert's weights
  PipelinedLlepOptions o;
  o.chunk_tokens = 64;
  o.balance.min_piece = 8;
  const LlepChunkSizes worst = PipelinedLlepSlotSizes(m, P, 4096, o);
  EXPECT_EQ(worst.borrowed, 12);  // min(E - E_p, P c k / m) = min(12, 128)
  EXPECT_EQ(worst.lent, 12);      // min(E_p (P - 1), 128)
  const int64_t uncapped = PipelinedLlepBoundBytes(m, P, 4096, o);
  for (int64_t cap : {1, 2, 4, 12, 20}) {
    PipelinedLlepOptions c = o;
    c.balance.max_borrowed = cap;
    const LlepChunkSizes s = PipelinedLlepSlotSizes(m, P, 4096, c);
    EXPECT_EQ(s.borrowed, std::min<int64_t>(cap, 12)) << cap;
    EXPECT_EQ(s.lent, std::min<int64_t>(cap, 4) * (P - 1)) << cap;
    EXPECT_EQ(s.rows, worst.rows);
    EXPECT_EQ(PipelinedLlepBoundBytes(m, P, 4096, c),
              uncapped - (2 * (worst.borrowed - s.borrowed) + (worst.lent - s.lent)) * X)
        << cap;
    // LLEP's worst case shrinks by the same terms.
    const LlepChunkSizes lw = LlepWorstCaseSizes(m, P, 4096, o.balance);
    const LlepChunkSizes lc = LlepWorstCaseSizes(m, P, 4096, c.balance);
    EXPECT_EQ(LlepWorstCasePeakBytes(m, P, 4096, c.balance),
              LlepWorstCasePeakBytes(m, P, 4096, o.balance) -
                  (2 * (lw.borrowed - lc.borrowed) + (lw.lent - lc.lent)) * X)
        << cap;
  }
}

// Hot tokens in runs ("h%/g@b") are where chunk membership matters: with
// nothing moved (plain EP inside each chunk, as when min_piece is large
// against a chunk's overflow), contiguous chunks that fall inside runs send
// the hot experts' rank far more rows than strided ones, which take a share
// of every run. Scattered hot tokens look the same either way.
TEST(LlepPlanTest, ContiguousChunksConcentrateHotRuns) {
  const ModelConfig m = Model(16, 4);
  const std::vector<int64_t> n(4, 400);
  const int64_t K = 8;
  auto most_rows = [&](const RoutingProfile& profile, ChunkMembership membership) {
    int64_t most = 0;
    for (int64_t j = 0; j < K; ++j) {
      const World w = Plan(m, n, profile, Opts(1.0, 1, 1e9), K, j, membership);
      for (const LlepRankPlan& p : w.plans) most = std::max(most, p.rows());
    }
    return most;
  };
  const int64_t strided = most_rows(HotBlockRouting(50, 4, 2), ChunkMembership::kStrided);
  const int64_t contiguous = most_rows(HotBlockRouting(50, 4, 2), ChunkMembership::kContiguous);
  const int64_t scattered_s = most_rows(HotRouting(50, 4), ChunkMembership::kStrided);
  const int64_t scattered_c = most_rows(HotRouting(50, 4), ChunkMembership::kContiguous);
  // Strided: each source's chunk has 25 +- 2 hot tokens (100 routes to rank
  // 0) and 25 cold ones (about 25 routes there): about 500 of P c k = 800.
  EXPECT_NEAR(strided, 500, 40);
  EXPECT_GT(contiguous, strided * 5 / 4);
  EXPECT_NEAR(scattered_c, scattered_s, scattered_s / 10);
  std::cout << "P = 4, c = 50, k = 4, rank 0's most rows in a chunk of P c k = 800: 50%/4@2 "
            << strided << " strided, " << contiguous << " contiguous; 50%/4 " << scattered_s
            << " strided, " << scattered_c << " contiguous\n";
}

// Over a skew sweep of chunked layers, every chunk's realized sizes fit the
// slots (the runtime's Fits check is then never hit).
TEST(LlepPlanTest, RealizedChunksFitTheSlots) {
  const ModelConfig m = Model(8);
  PipelinedLlepOptions o;
  o.chunk_tokens = 6;
  o.balance = Opts(1.0, 2);
  for (int64_t P : {2, 4}) {
    for (const RoutingProfile& profile :
         {BalancedRouting(), HotRouting(50, 4), HotRouting(80, 2), HotRouting(100, 1)}) {
      std::vector<int64_t> n;
      for (int64_t p = 0; p < P; ++p) n.push_back(40 - 9 * p);
      const int64_t K = PipelinedLlepChunks(40, o.chunk_tokens);
      const LlepChunkSizes slot = PipelinedLlepSlotSizes(m, P, 40, o);
      for (int64_t j = 0; j < K; ++j) {
        const World w = Plan(m, n, profile, o.balance, K, j);
        for (const LlepRankPlan& p : w.plans) {
          const LlepChunkSizes s = LlepChunkSizesOf(p);
          EXPECT_LE(s.tokens, slot.tokens);
          EXPECT_LE(s.routes, slot.routes);
          EXPECT_LE(s.rows, slot.rows);
          EXPECT_LE(s.borrowed, slot.borrowed);
          EXPECT_LE(s.lent, slot.lent);
        }
      }
    }
  }
}

}  // namespace
}  // namespace plateau
