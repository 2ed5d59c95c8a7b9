// The composed step with LLEP and PipelinedLLEP as its expert dispatch
// against the baseline step (standard EP), at P = 2 and 4, under the
// router's own (learned) routing and under routing skewed as far as it goes
// (router weights zero: every token picks experts 0..k-1, all on rank 0):
// the loss and every gradient agree to fp32 rounding (the helpers' GEMMs
// and the chunked sums of expert-weight gradients round differently), every
// live set's measured peak is within the plan on every rank, and
// PipelinedLLEP's dispatch peak is its launch-sized bound, which does not
// grow with the skew.
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/budget/budget.h"
#include "kernels/status_macros.h"
#include "kernels/step/step.h"
#include "kernels/step/step_testing.h"
#include "kernels/testing/counting_communicator.h"
#include "kernels/testing/local_world.h"
#include "kernels/testing/rank_slice.h"
#include "kernels/testing/tiny_model.h"

namespace plateau {
namespace {

ModelConfig TestModel() {
  ModelConfig m = TinyModel();
  m.experts = 8;  // E/P = 2 >= k at P = 4
  return m;
}

constexpr int64_t kBatch = 4;

DispatchOptions Dispatch(DispatchOptions::Kind kind) {
  DispatchOptions d;
  d.kind = kind;
  d.llep.min_piece = 2;  // small enough that borrowing happens at these sizes
  d.pipelined.balance = d.llep;
  d.pipelined.chunk_tokens = 5;  // K = ceil(32 / 5) = 7 chunks per layer at P = 2
  return d;
}

struct Outcome {
  double loss = 0;
  std::vector<std::vector<float>> grads;
  std::vector<MemoryStats> device, host;
};

// The tests' batch (seeded) and step options.
struct Batch {
  std::vector<int32_t> tokens, targets;
};
Batch TestBatch() {
  const ModelConfig m = TestModel();
  std::mt19937 rng(9);
  Batch b{std::vector<int32_t>(kBatch * m.seq_len), std::vector<int32_t>(kBatch * m.seq_len)};
  for (auto& t : b.tokens) t = static_cast<int32_t>(rng() % m.vocab_size);
  for (auto& t : b.targets) t = static_cast<int32_t>(rng() % m.vocab_size);
  return b;
}
StepOptions TestOptions(int P, const DispatchOptions& dispatch) {
  StepOptions o;
  o.model = TestModel();
  o.layout = {P, kBatch};
  o.seed = 4;
  o.dispatch = dispatch;
  return o;
}

Outcome RunStep(int P, const DispatchOptions& dispatch, bool skewed) {
  const ModelConfig m = TestModel();
  const Batch batch = TestBatch();
  const std::vector<int32_t>& tokens = batch.tokens;
  const std::vector<int32_t>& targets = batch.targets;
  Outcome out;
  out.device.resize(P);
  out.host.resize(P);
  const absl::Status s = RunLocalWorld(P, 64 << 20, FreshStoreDir("dispatch"), [&](int r, Backend& be,
                                                                                    Communicator& world) {
    PLATEAU_ASSIGN_OR_RETURN(auto step, TrainingStep::Create(TestOptions(P, dispatch), be, world));
    if (skewed) PLATEAU_RETURN_IF_ERROR(SkewRouting(*step, m));
    const std::vector<int32_t> tok = RankSlice(tokens, kBatch, m.seq_len, r, P);
    const std::vector<int32_t> tgt = RankSlice(targets, kBatch, m.seq_len, r, P);
    PLATEAU_ASSIGN_OR_RETURN(StepStats st, step->ForwardBackward(tok, tgt));
    PLATEAU_ASSIGN_OR_RETURN(auto grads, step->GatherGrads());
    out.device[r] = st.device;
    out.host[r] = st.host;
    if (r == 0) {
      out.loss = st.loss;
      out.grads = std::move(grads);
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

MemoryPlan PlanOf(int P, const DispatchOptions& d) { return PlanMemory(TestOptions(P, d)).value(); }

void ExpectClose(const Outcome& got, const Outcome& want, const std::string& what) {
  EXPECT_NEAR(got.loss, want.loss, 1e-6 * std::abs(want.loss)) << what;
  const std::vector<WeightSpec> specs = ModelWeights(TestModel());
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t t = 0; t < want.grads.size(); ++t) {
    float scale = 0;
    for (float x : want.grads[t]) scale = std::max(scale, std::abs(x));
    for (size_t i = 0; i < want.grads[t].size(); ++i) {
      ASSERT_NEAR(got.grads[t][i], want.grads[t][i], 1e-5f * scale + 1e-9f)
          << what << ": " << specs[t].name << "[" << i << "]";
    }
  }
}

class StepDispatch : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(StepDispatch, LlepAndPipelinedLlepMatchStandardEpWithinThePlan) {
  const auto [P, skewed] = GetParam();
  using Kind = DispatchOptions::Kind;
  const Outcome base = RunStep(P, Dispatch(Kind::kStandardEp), skewed);
  for (Kind kind : {Kind::kLlep, Kind::kPipelinedLlep}) {
    const std::string what = absl::StrCat(kind == Kind::kLlep ? "llep" : "pipelined_llep", " P=", P,
                                          skewed ? " skewed" : " learned");
    const DispatchOptions d = Dispatch(kind);
    const Outcome got = RunStep(P, d, skewed);
    ExpectClose(got, base, what);
    const MemoryPlan plan = PlanOf(P, d);
    for (int r = 0; r < P; ++r) {
      for (int i = 0; i < kNumLiveSets; ++i) {
        const char* name = LiveSetName(static_cast<LiveSet>(i)).data();
        EXPECT_LE(got.device[r].peak[i], plan.bytes[i]) << what << " rank " << r << " device " << name;
        EXPECT_LE(got.host[r].peak[i], plan.host_bytes[i]) << what << " rank " << r << " host " << name;
      }
      if (kind == Kind::kPipelinedLlep) {
        // Launch-sized: its bound, whatever the routing.
        EXPECT_EQ(got.device[r].peak_of(LiveSet::kDispatch), plan.bytes[static_cast<int>(LiveSet::kDispatch)])
            << what << " rank " << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(RanksAndRouting, StepDispatch,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Bool()));

// Rank 0's collectives in one ForwardBackward, by kind (after Create).
CountingCommunicator::Counts PassCollectives(int P, const DispatchOptions& dispatch) {
  const ModelConfig m = TestModel();
  const Batch batch = TestBatch();
  const std::vector<int32_t>& tokens = batch.tokens;
  const std::vector<int32_t>& targets = batch.targets;
  CountingCommunicator::Counts counts;
  const absl::Status s = RunLocalWorld(P, 64 << 20, FreshStoreDir("dispatch_counts"), [&](int r, Backend& be,
                                                                                           Communicator& world) {
    CountingCommunicator::Table table;
    CountingCommunicator counting(world, &table);
    PLATEAU_ASSIGN_OR_RETURN(auto step, TrainingStep::Create(TestOptions(P, dispatch), be, counting));
    const CountingCommunicator::Counts before = table.Read();
    PLATEAU_RETURN_IF_ERROR(step->ForwardBackward(RankSlice(tokens, kBatch, m.seq_len, r, P),
                                                  RankSlice(targets, kBatch, m.seq_len, r, P))
                                .status());
    if (r == 0) {
      counts = table.Read();
      for (const auto& [op, n] : before) counts[op] -= n;
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
  return counts;
}

// The step names each layer to its dispatch (SetLayer) before the forward
// and the recompute, so PipelinedLLEP's recompute plans from the counts its
// forward kept: over standard EP's pass, the pipelined pass adds the
// forward's plan collectives only, one all-gather of the counts per layer
// (and with K > 1 chunks one all-reduce of the group's N), not two.
TEST(StepDispatchTest, PipelinedLlepsRecomputeGathersNoCounts) {
  using Kind = DispatchOptions::Kind;
  const int64_t L = TestModel().layers;
  for (int P : {2, 4}) {
    for (bool one_chunk : {true, false}) {
      SCOPED_TRACE(absl::StrCat("P = ", P, one_chunk ? ", one chunk" : ", K > 1 chunks"));
      DispatchOptions pipelined = Dispatch(Kind::kPipelinedLlep);
      if (one_chunk) pipelined.pipelined.chunk_tokens = 1 << 20;
      const CountingCommunicator::Counts base = PassCollectives(P, Dispatch(Kind::kStandardEp));
      const CountingCommunicator::Counts got = PassCollectives(P, pipelined);
      auto n = [](const CountingCommunicator::Counts& c, const char* op) {
        auto it = c.find(op);
        return it == c.end() ? int64_t{0} : it->second;
      };
      EXPECT_EQ(n(got, "all_gather") - n(base, "all_gather"), L) << "one count gather per layer (the forward's)";
      EXPECT_EQ(n(got, "all_reduce") - n(base, "all_reduce"), one_chunk ? 0 : L);
    }
  }
}

TEST(StepDispatchTest, BadOptionsNameTheSpecField) {
  StepOptions o;
  o.model = TestModel();
  o.layout = {2, kBatch};
  o.dispatch = Dispatch(DispatchOptions::Kind::kPipelinedLlep);
  o.dispatch.pipelined.chunk_tokens = 0;
  EXPECT_NE(PlanMemory(o).status().message().find("schedule.pipelined_llep.chunk_tokens"), absl::string_view::npos)
      << PlanMemory(o).status();
  o.dispatch = Dispatch(DispatchOptions::Kind::kLlep);
  o.dispatch.llep.alpha = -1;
  EXPECT_NE(PlanMemory(o).status().message().find("schedule.llep.alpha"), absl::string_view::npos)
      << PlanMemory(o).status();
}

}  // namespace
}  // namespace plateau
