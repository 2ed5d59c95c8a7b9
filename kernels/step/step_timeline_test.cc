// The memory timeline of a real step (kernels/memory_timeline.h through the
// step's PhaseRecorder hooks), at P = 2 on the CPU backend: the phases come
// in the documented order (kernels/phase_recorder.h), the last entry holds
// what the trackers hold after the step, the phases' peaks together are the
// step's own peaks per live set (the phases cut the step without gaps), a
// dispatch buffer freed inside each layer shows only as a phase peak,
// OffloadStreamAdamW marks its buckets, and recording changes neither the
// loss nor the step's reported peaks.
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/memory_timeline.h"
#include "kernels/status_macros.h"
#include "kernels/step/step.h"
#include "kernels/testing/local_world.h"
#include "kernels/testing/rank_slice.h"
#include "kernels/testing/tiny_model.h"

namespace plateau {
namespace {

constexpr int kRanks = 2;
constexpr int64_t kBatch = 2;

struct Recorded {
  std::vector<TimelinePhase> phases;
  StepStats with, without;  // the same step recorded, and not
  MemoryStats device_after, host_after;
  int64_t buckets = 0;
};

std::vector<Recorded> RecordStep(const StepOptions& base) {
  std::vector<Recorded> out(kRanks);
  const ModelConfig m = base.model;
  std::mt19937 rng(3);
  std::vector<int32_t> tokens(kBatch * m.seq_len), targets(kBatch * m.seq_len);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % m.vocab_size);
  for (auto& t : targets) t = static_cast<int32_t>(rng() % m.vocab_size);
  BackendOptions bo;
  bo.device_memory_bytes = 64 << 20;
  const absl::Status s = RunLocalWorld(kRanks, bo, FreshStoreDir("timeline"), [&](int r, Backend& be,
                                                                                   Communicator& world) {
    const std::vector<int32_t> tok = RankSlice(tokens, kBatch, m.seq_len, r, kRanks);
    const std::vector<int32_t> tgt = RankSlice(targets, kBatch, m.seq_len, r, kRanks);
    // Two identical steps from the same initial weights: one recorded.
    for (bool record : {false, true}) {
      PLATEAU_ASSIGN_OR_RETURN(auto step, TrainingStep::Create(base, be, world));
      MemoryTimelineRecorder recorder(be.device().tracker(), be.host().tracker());
      if (record) recorder.Begin();
      PLATEAU_ASSIGN_OR_RETURN(StepStats st, step->Step(tok, tgt, record ? &recorder : nullptr));
      if (!record) {
        out[r].without = st;
        continue;
      }
      out[r].with = st;
      out[r].phases = recorder.phases();
      out[r].device_after = be.device().tracker().Snapshot();
      out[r].host_after = be.host().tracker().Snapshot();
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

StepOptions Options() {
  StepOptions o;
  o.model = TinyModel();
  o.layout = {kRanks, kBatch};
  o.seed = 5;
  return o;
}

std::vector<std::string> ExpectedNames(int64_t layers, int64_t buckets) {
  std::vector<std::string> n = {"embedding"};
  for (int64_t l = 0; l < layers; ++l) n.push_back(absl::StrCat("forward ", l));
  n.push_back("projection forward");
  n.push_back("projection backward");
  for (int64_t l = layers - 1; l >= 0; --l) {
    n.push_back(absl::StrCat("recompute ", l));
    n.push_back(absl::StrCat("backward ", l));
  }
  n.push_back("grad reduce");
  n.push_back("grad norm");
  for (int64_t b = 0; b < buckets; ++b) n.push_back(absl::StrCat("optimizer bucket ", b));
  n.push_back("optimizer");
  return n;
}

void CheckCoversTheStep(const Recorded& r, int rank) {
  ASSERT_FALSE(r.phases.empty());
  // The last boundary is the state after the step.
  const TimelinePhase& last = r.phases.back();
  for (int i = 0; i < kNumLiveSets; ++i) {
    EXPECT_EQ(last.device.current[i], r.device_after.current[i]) << "rank " << rank << " set " << i;
    EXPECT_EQ(last.host.current[i], r.host_after.current[i]) << "rank " << rank << " set " << i;
  }
  // The phases cut the step without gaps: their peaks' maximum is the step's peak.
  MemoryStats most;
  for (const TimelinePhase& p : r.phases) {
    for (int i = 0; i < kNumLiveSets; ++i) {
      most.peak[i] = std::max(most.peak[i], p.device.peak[i]);
      most.current[i] = std::max(most.current[i], p.host.peak[i]);  // host peaks
      EXPECT_GE(p.device.peak[i], p.device.current[i]);
    }
    most.total_peak = std::max(most.total_peak, p.device.total_peak);
    most.total_current = std::max(most.total_current, p.host.total_peak);
  }
  for (int i = 0; i < kNumLiveSets; ++i) {
    EXPECT_EQ(most.peak[i], r.with.device.peak[i]) << "rank " << rank << " device set " << i;
    EXPECT_EQ(most.current[i], r.with.host.peak[i]) << "rank " << rank << " host set " << i;
  }
  EXPECT_EQ(most.total_peak, r.with.device.total_peak) << "rank " << rank;
  EXPECT_EQ(most.total_current, r.with.host.total_peak) << "rank " << rank;
  // Recording changes nothing the step reports.
  EXPECT_EQ(r.with.loss, r.without.loss) << "rank " << rank;
  EXPECT_EQ(r.with.device.total_peak, r.without.device.total_peak) << "rank " << rank;
  EXPECT_EQ(r.with.device.peak, r.without.device.peak) << "rank " << rank;
}

TEST(StepTimelineTest, StandardEpPhasesInOrderAndTheDispatchTransientShows) {
  const StepOptions o = Options();
  const std::vector<Recorded> ranks = RecordStep(o);
  const std::vector<std::string> names = ExpectedNames(o.model.layers, 0);
  for (int r = 0; r < kRanks; ++r) {
    const Recorded& rec = ranks[r];
    ASSERT_EQ(rec.phases.size(), names.size()) << "rank " << r;
    for (size_t i = 0; i < names.size(); ++i) {
      EXPECT_EQ(rec.phases[i].name(), names[i]) << "rank " << r;
      EXPECT_EQ(rec.phases[i].merged, 1);
    }
    CheckCoversTheStep(rec, r);
    // Standard EP allocates its dispatch buffers per layer (they follow the
    // routing) and frees them before the boundary: nothing at any forward
    // boundary, something inside every forward phase.
    for (int64_t l = 0; l < o.model.layers; ++l) {
      const TimelinePhase& f = rec.phases[1 + l];
      EXPECT_EQ(f.device.current_of(LiveSet::kDispatch), 0) << f.name();
      EXPECT_GT(f.device.peak_of(LiveSet::kDispatch), 0) << f.name();
      EXPECT_GT(f.device.total_peak, f.device.total_current) << f.name();
    }
    // Weights are launch-sized: the same at every boundary.
    for (const TimelinePhase& p : rec.phases) {
      EXPECT_EQ(p.device.current_of(LiveSet::kWeights), rec.device_after.current_of(LiveSet::kWeights));
    }
  }
}

TEST(StepTimelineTest, OffloadStreamAdamWMarksEachBucket) {
  StepOptions o = Options();
  o.optimizer_placement.kind = OptimizerPlacementOptions::Kind::kOffloadStream;
  o.optimizer_placement.bucket_params = 1000;  // a few buckets at this size
  o.optimizer_placement.staging_slots = 2;
  const std::vector<Recorded> ranks = RecordStep(o);
  for (int r = 0; r < kRanks; ++r) {
    const Recorded& rec = ranks[r];
    int64_t buckets = 0;
    for (const TimelinePhase& p : rec.phases) buckets += p.first.rfind("optimizer bucket ", 0) == 0;
    ASSERT_GE(buckets, 2) << "rank " << r;
    const std::vector<std::string> names = ExpectedNames(o.model.layers, buckets);
    ASSERT_EQ(rec.phases.size(), names.size()) << "rank " << r;
    for (size_t i = 0; i < names.size(); ++i) EXPECT_EQ(rec.phases[i].name(), names[i]) << "rank " << r;
    CheckCoversTheStep(rec, r);
    // The master and moments live on the host at every boundary.
    for (const TimelinePhase& p : rec.phases) EXPECT_GT(p.host.current_of(LiveSet::kOptimizer), 0) << p.name();
  }
}

}  // namespace
}  // namespace plateau
