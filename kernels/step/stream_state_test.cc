// The streamed checkpoint (TrainingStep::StreamState, LoadStreamedState)
// against its baseline beside it (GatherState, LoadState): the same values
// bit for bit, each exactly once; a failing sink fails its rank and keeps
// the world in step; and the host memory the stream takes, measured by
// counting this binary's heap, stays under StreamStateHostBytes while the
// baseline's exceeds it.
#include <mutex>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/step/step.h"
#include "kernels/testing/compare.h"
#include "kernels/testing/heap_counter.h"
#include "kernels/testing/local_world.h"
#include "kernels/testing/rank_slice.h"
#include "kernels/testing/tiny_model.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

void RunRanks(int P, const std::function<void(int, Backend&, Communicator&)>& fn) {
  absl::Status s = RunLocalWorld(P, int64_t{256} << 20, FreshStoreDir("stream"),
                                 [&](int r, Backend& be, Communicator& world) {
                                   fn(r, be, world);
                                   return absl::OkStatus();
                                 });
  ASSERT_TRUE(s.ok()) << s;
}

struct Case {
  int ranks;
  Precision precision;
  bool ring_dtp;  // the lm_head vocabulary-sharded (owned), not dense
  OptimizerPlacementOptions::Kind optimizer;
};

std::string Name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return absl::StrCat("P", c.ranks, c.precision == Precision::kBf16Mixed ? "Bf16" : "Fp32",
                      c.ring_dtp ? "RingDtp" : "Dense",
                      c.optimizer == OptimizerPlacementOptions::Kind::kDevice ? "DeviceAdamW" : "OffloadStream");
}

// V = 37 spreads unevenly over 2 and 4 vocabulary shards (padding rows).
StepOptions Options(const Case& c, const ModelConfig& m) {
  StepOptions o;
  o.model = m;
  o.layout = {c.ranks, 2};
  o.seed = 3;
  o.precision = c.precision;
  if (c.ring_dtp) o.projection.kind = ProjectionOptions::Kind::kRingDtp;
  o.optimizer_placement.kind = c.optimizer;
  o.optimizer_placement.bucket_params = 1000;
  return o;
}

ModelConfig StreamModel() {
  ModelConfig m = TinyModel();
  m.vocab_size = 37;
  return m;
}

class StreamStateTest : public ::testing::TestWithParam<Case> {};

// After two steps (moments that are not zero), every rank streams with a
// sink on rank 0 alone: the values received fill the full state, each
// exactly once, and equal GatherState's bit for bit; the other ranks'
// sinks are never called. Then a fresh step loads the streamed state
// (LoadStreamedState, each rank reading its own runs) and ends a third
// step with the state of the same three steps taken straight.
TEST_P(StreamStateTest, StreamedIsTheGatheredStateBitForBitAndResumes) {
  const Case c = GetParam();
  const ModelConfig m = StreamModel();
  const StepOptions o = Options(c, m);
  const int64_t B = o.layout.batch;
  const GlobalBatch g1 = MakeBatch(m, B, 1), g2 = MakeBatch(m, B, 2), g3 = MakeBatch(m, B, 3);
  ModelState gathered, streamed, resumed, straight;
  std::vector<std::vector<std::vector<int>>> seen(3);  // [family][weight][value]: times received
  RunRanks(c.ranks, [&](int r, Backend& be, Communicator& world) {
    auto slice = [&](const GlobalBatch& g, std::vector<int32_t>* tok, std::vector<int32_t>* tgt) {
      *tok = RankSlice(g.tokens, B, m.seq_len, r, c.ranks);
      *tgt = RankSlice(g.targets, B, m.seq_len, r, c.ranks);
    };
    std::vector<int32_t> tok, tgt;
    {
      auto step = TrainingStep::Create(o, be, world);
      ASSERT_TRUE(step.ok()) << step.status();
      for (const GlobalBatch* g : {&g1, &g2}) {
        slice(*g, &tok, &tgt);
        ASSERT_TRUE((*step)->Step(tok, tgt).ok());
      }
      auto state = (*step)->GatherState();
      ASSERT_TRUE(state.ok()) << state.status();
      int calls = 0;
      ModelState got;
      for (auto* fam : {&got.weights, &got.m, &got.v}) {
        for (const WeightSpec& w : (*step)->layout().weights()) fam->emplace_back(w.numel(), 0.0f);
      }
      std::vector<std::vector<std::vector<int>>> counts(3);
      for (auto& fam : counts) {
        for (const WeightSpec& w : (*step)->layout().weights()) fam.emplace_back(w.numel(), 0);
      }
      const StateSink sink = [&](StateFamily f, int weight, int64_t offset, const float* values, int64_t n) {
        ++calls;
        std::vector<float>& t = got.family(f)[weight];
        for (int64_t i = 0; i < n; ++i) {
          t[offset + i] = values[i];
          ++counts[static_cast<int>(f)][weight][offset + i];
        }
        return absl::OkStatus();
      };
      const absl::Status s = (*step)->StreamState(r == 0 ? &sink : nullptr);
      ASSERT_TRUE(s.ok()) << s;
      if (r != 0) return;  // no sink: it gathered only
      EXPECT_GT(calls, 0);
      got.step = (*step)->step();
      gathered = std::move(*state);
      streamed = std::move(got);
      seen = std::move(counts);
    }
  });
  ASSERT_FALSE(HasFailure());
  for (size_t f = 0; f < seen.size(); ++f) {
    for (size_t w = 0; w < seen[f].size(); ++w) {
      for (size_t i = 0; i < seen[f][w].size(); ++i) {
        ASSERT_EQ(seen[f][w][i], 1) << "family " << f << ", " << ParamLayout(m, c.ranks).weights()[w].name << "["
                                    << i << "]";
      }
    }
  }
  EXPECT_EQ(streamed.step, 2);
  EXPECT_TRUE(SameBits(streamed.weights, gathered.weights)) << "weights differ";
  EXPECT_TRUE(SameBits(streamed.m, gathered.m)) << "m differs";
  EXPECT_TRUE(SameBits(streamed.v, gathered.v)) << "v differs";

  // Resume from the streamed state (every rank reads its runs from rank
  // 0's copy), against three steps straight.
  RunRanks(c.ranks, [&](int r, Backend& be, Communicator& world) {
    std::vector<int32_t> tok, tgt;
    auto take = [&](TrainingStep& step, const GlobalBatch& g) {
      tok = RankSlice(g.tokens, B, m.seq_len, r, c.ranks);
      tgt = RankSlice(g.targets, B, m.seq_len, r, c.ranks);
      ASSERT_TRUE(step.Step(tok, tgt).ok());
    };
    {
      auto step = TrainingStep::Create(o, be, world);
      ASSERT_TRUE(step.ok()) << step.status();
      const absl::Status loaded = (*step)->LoadStreamedState(
          streamed.step, [&](StateFamily f, int weight, int64_t offset, float* values, int64_t n) {
            std::copy_n(streamed.family(f)[weight].data() + offset, n, values);
            return absl::OkStatus();
          });
      ASSERT_TRUE(loaded.ok()) << loaded;
      take(**step, g3);
      auto state = (*step)->GatherState();
      ASSERT_TRUE(state.ok());
      if (r == 0) resumed = std::move(*state);
    }
    {
      auto step = TrainingStep::Create(o, be, world);
      ASSERT_TRUE(step.ok());
      for (const GlobalBatch* g : {&g1, &g2, &g3}) take(**step, *g);
      auto state = (*step)->GatherState();
      ASSERT_TRUE(state.ok());
      if (r == 0) straight = std::move(*state);
    }
  });
  EXPECT_EQ(resumed.step, 3);
  EXPECT_TRUE(SameBits(resumed.weights, straight.weights)) << "weights differ after the resume";
  EXPECT_TRUE(SameBits(resumed.m, straight.m)) << "m differs after the resume";
  EXPECT_TRUE(SameBits(resumed.v, straight.v)) << "v differs after the resume";
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, StreamStateTest,
    ::testing::Values(Case{1, Precision::kFp32, false, OptimizerPlacementOptions::Kind::kDevice},
                      Case{2, Precision::kFp32, false, OptimizerPlacementOptions::Kind::kDevice},
                      Case{2, Precision::kBf16Mixed, true, OptimizerPlacementOptions::Kind::kDevice},
                      Case{4, Precision::kFp32, true, OptimizerPlacementOptions::Kind::kOffloadStream},
                      Case{4, Precision::kBf16Mixed, false, OptimizerPlacementOptions::Kind::kOffloadStream}),
    Name);

// A sink that fails part way (a full disk) fails its own rank with its
// error once the gathers end; the others finish theirs, and the world is
// still in step: a GatherState after it agrees on every rank.
TEST(StreamStateErrorTest, AFailingSinkFailsItsRankAndTheWorldStaysInStep) {
  const int P = 2;
  const ModelConfig m = StreamModel();
  const StepOptions o = Options(Case{P, Precision::kFp32, false, OptimizerPlacementOptions::Kind::kDevice}, m);
  std::vector<absl::Status> streamed(P);
  std::vector<ModelState> after(P);
  std::vector<int> calls(P, 0);
  RunRanks(P, [&](int r, Backend& be, Communicator& world) {
    auto step = TrainingStep::Create(o, be, world);
    ASSERT_TRUE(step.ok()) << step.status();
    const StateSink sink = [&](StateFamily, int, int64_t, const float*, int64_t) {
      return ++calls[r] == 3 ? absl::ResourceExhaustedError("disk full") : absl::OkStatus();
    };
    streamed[r] = (*step)->StreamState(&sink);
    auto state = (*step)->GatherState();
    ASSERT_TRUE(state.ok()) << state.status();
    after[r] = std::move(*state);
  });
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(streamed[r].code(), absl::StatusCode::kResourceExhausted) << "rank " << r;
    EXPECT_THAT(streamed[r].message(), HasSubstr("disk full"));
    EXPECT_EQ(calls[r], 3) << "rank " << r << ": the sink was called after it failed";
    EXPECT_TRUE(SameBits(after[r].weights, after[0].weights)) << "rank " << r;
  }
}

// The host memory of a streamed save, measured: all P ranks' heap in use
// above what it was before, at its most, against the sum of the ranks'
// StreamStateHostBytes (rank 0 with a sink, the others without) plus 64 KiB
// for the gathers' own bookkeeping (Gloo's, std::function's). The baseline
// GatherState, measured the same way, holds the full state on every rank
// and exceeds that bound, so the measurement can tell them apart. The same
// for a streamed load against LoadStreamedStateHostBytes. The model is
// large enough (0.4 M parameters) that the state dwarfs the bookkeeping.
TEST(StreamStateMemoryTest, StreamedSaveAndLoadHoldTheHostAtTheirBound) {
  if (!HeapIsCounted()) GTEST_SKIP() << "the heap is not counted in this build (AddressSanitizer's allocator)";
  const int P = 4;
  ModelConfig m = StreamModel();
  m.hidden = 64;
  m.expert_ffn = 96;
  m.experts = 8;
  m.vocab_size = 500;
  const StepOptions o = Options(Case{P, Precision::kFp32, false, OptimizerPlacementOptions::Kind::kDevice}, m);
  HeapWindow window(P);
  int64_t bound_save = 0, bound_load = 0, full_state = 0;
  int64_t streamed = 0, gathered = 0, loaded = 0;
  std::mutex mu;
  RunRanks(P, [&](int r, Backend& be, Communicator& world) {
    auto step = TrainingStep::Create(o, be, world);
    ASSERT_TRUE(step.ok()) << step.status();
    {
      std::lock_guard<std::mutex> lock(mu);
      bound_save += (*step)->StreamStateHostBytes(/*with_sink=*/r == 0);
      bound_load += (*step)->LoadStreamedStateHostBytes();
      if (r == 0) {
        for (const WeightSpec& w : (*step)->layout().weights()) full_state += 3 * 4 * w.numel();
      }
    }
    // A sink that keeps nothing (as a file does), and a source of zeros.
    const StateSink sink = [](StateFamily, int, int64_t, const float*, int64_t) { return absl::OkStatus(); };
    window.Begin();
    const absl::Status s = (*step)->StreamState(r == 0 ? &sink : nullptr);
    const int64_t streamed_r = window.End();  // the same on every rank
    if (r == 0) streamed = streamed_r;
    EXPECT_TRUE(s.ok()) << s;

    window.Begin();
    const absl::Status l = (*step)->LoadStreamedState(0, [](StateFamily, int, int64_t, float* values, int64_t n) {
      std::fill(values, values + n, 0.0f);
      return absl::OkStatus();
    });
    const int64_t loaded_r = window.End();
    if (r == 0) loaded = loaded_r;
    EXPECT_TRUE(l.ok()) << l;

    window.Begin();
    auto state = (*step)->GatherState();
    const int64_t gathered_r = window.End();  // every rank's full state alive at once, as in a real gather
    if (r == 0) gathered = gathered_r;
    EXPECT_TRUE(state.ok()) << state.status();
  });
  ASSERT_FALSE(window.broken()) << "a rank never reached a meeting";
  const int64_t slack = 64 << 10;
  std::printf("heap above the start: streamed save %lld B (bound %lld), load %lld B (bound %lld), "
              "GatherState %lld B; full state %lld B per rank\n",
              static_cast<long long>(streamed), static_cast<long long>(bound_save), static_cast<long long>(loaded),
              static_cast<long long>(bound_load), static_cast<long long>(gathered),
              static_cast<long long>(full_state));
  EXPECT_LE(streamed, bound_save + slack);
  EXPECT_LE(loaded, bound_load + slack);
  EXPECT_GT(gathered, bound_save + slack);
  EXPECT_GE(gathered, P * full_state);
  // The bound itself is well under the full state on every rank.
  EXPECT_LT(bound_save, P * full_state / 2);
}

}  // namespace
}  // namespace plateau
