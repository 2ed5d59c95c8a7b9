// The recorder against a tracker driven by hand: phases come out in the
// order they ended, each entry's bytes are the tracker's at that boundary,
// a transient inside a phase shows in that phase's peak only, the step's
// own peaks are left alone, and past max_phases neighbours merge in pairs
// with the whole step still covered.
#include "kernels/memory_timeline.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace plateau {
namespace {

TEST(StepPhaseNameTest, NamesSayPhaseAndIndex) {
  EXPECT_EQ(StepPhaseName(StepPhase::kEmbedding, 0), "embedding");
  EXPECT_EQ(StepPhaseName(StepPhase::kForward, 3), "forward 3");
  EXPECT_EQ(StepPhaseName(StepPhase::kRecompute, 1), "recompute 1");
  EXPECT_EQ(StepPhaseName(StepPhase::kBackward, 0), "backward 0");
  EXPECT_EQ(StepPhaseName(StepPhase::kOptimizerBucket, 12), "optimizer bucket 12");
  EXPECT_EQ(StepPhaseName(StepPhase::kProjectionForward, 0), "projection forward");
}

TEST(MemoryTimelineRecorderTest, PhasesInOrderWithTheTrackersBytes) {
  MemoryTracker device, host;
  device.Add(LiveSet::kWeights, 1000);  // before Begin: the launch state
  host.Add(LiveSet::kOptimizer, 400);
  MemoryTimelineRecorder r(device, host);
  r.Begin();
  device.Add(LiveSet::kCheckpoints, 64);
  r.EndPhase(StepPhase::kEmbedding, 0);
  device.Add(LiveSet::kCheckpoints, 64);
  device.Add(LiveSet::kActivations, 32);
  r.EndPhase(StepPhase::kForward, 0);
  device.Sub(LiveSet::kCheckpoints, 64);
  host.Add(LiveSet::kCheckpoints, 64);
  r.EndPhase(StepPhase::kBackward, 0);

  ASSERT_EQ(r.phases().size(), 3u);
  EXPECT_EQ(r.phases_seen(), 3);
  EXPECT_EQ(r.phases()[0].name(), "embedding");
  EXPECT_EQ(r.phases()[1].name(), "forward 0");
  EXPECT_EQ(r.phases()[2].name(), "backward 0");
  const MemoryStats& e = r.phases()[0].device;
  EXPECT_EQ(e.current_of(LiveSet::kWeights), 1000);
  EXPECT_EQ(e.current_of(LiveSet::kCheckpoints), 64);
  EXPECT_EQ(e.total_current, 1064);
  const MemoryStats& f = r.phases()[1].device;
  EXPECT_EQ(f.current_of(LiveSet::kCheckpoints), 128);
  EXPECT_EQ(f.current_of(LiveSet::kActivations), 32);
  EXPECT_EQ(f.total_current, 1160);
  // The last entry is what the tracker holds now, on both spaces.
  const TimelinePhase& b = r.phases()[2];
  for (int i = 0; i < kNumLiveSets; ++i) {
    EXPECT_EQ(b.device.current[i], device.current(static_cast<LiveSet>(i))) << i;
    EXPECT_EQ(b.host.current[i], host.current(static_cast<LiveSet>(i))) << i;
  }
  EXPECT_EQ(b.host.current_of(LiveSet::kOptimizer), 400);
  EXPECT_EQ(b.host.current_of(LiveSet::kCheckpoints), 64);
  EXPECT_EQ(r.phases()[1].host.current_of(LiveSet::kCheckpoints), 0);
  // Backward's peak of checkpoints is where it started (128), not the 64 it ends at.
  EXPECT_EQ(b.device.peak_of(LiveSet::kCheckpoints), 128);
}

TEST(MemoryTimelineRecorderTest, TransientInsideAPhaseShowsInItsPeakOnly) {
  MemoryTracker device, host;
  device.Add(LiveSet::kWeights, 100);
  MemoryTimelineRecorder r(device, host);
  r.Begin();
  r.EndPhase(StepPhase::kForward, 0);
  device.Add(LiveSet::kDispatch, 5000);  // a dispatch buffer, freed in the same phase
  device.Sub(LiveSet::kDispatch, 5000);
  r.EndPhase(StepPhase::kForward, 1);
  r.EndPhase(StepPhase::kForward, 2);
  ASSERT_EQ(r.phases().size(), 3u);
  for (const TimelinePhase& p : r.phases()) EXPECT_EQ(p.device.current_of(LiveSet::kDispatch), 0) << p.name();
  EXPECT_EQ(r.phases()[0].device.peak_of(LiveSet::kDispatch), 0);
  EXPECT_EQ(r.phases()[1].device.peak_of(LiveSet::kDispatch), 5000);
  EXPECT_EQ(r.phases()[1].device.total_peak, 5100);
  EXPECT_EQ(r.phases()[2].device.peak_of(LiveSet::kDispatch), 0);
  EXPECT_EQ(r.phases()[2].device.total_peak, 100);
}

TEST(MemoryTimelineRecorderTest, LeavesTheStepsOwnPeaksAlone) {
  MemoryTracker device, host;
  device.ResetPeaks();  // the step's phase: the whole call
  MemoryTimelineRecorder r(device, host);
  r.Begin();
  device.Add(LiveSet::kDispatch, 700);
  device.Sub(LiveSet::kDispatch, 700);
  r.EndPhase(StepPhase::kForward, 0);
  r.EndPhase(StepPhase::kForward, 1);
  EXPECT_EQ(device.peak(LiveSet::kDispatch), 700);
  EXPECT_EQ(device.total_peak(), 700);
  EXPECT_EQ(r.phases()[1].device.total_peak, 0);
}

TEST(MemoryTimelineRecorderTest, BeginForgetsTheLastStep) {
  MemoryTracker device, host;
  MemoryTimelineRecorder r(device, host);
  r.Begin();
  device.Add(LiveSet::kWorkspace, 9);
  device.Sub(LiveSet::kWorkspace, 9);
  r.EndPhase(StepPhase::kGradNorm, 0);
  device.Add(LiveSet::kWorkspace, 11);  // between steps: not the next step's
  device.Sub(LiveSet::kWorkspace, 11);
  r.Begin();
  r.EndPhase(StepPhase::kGradNorm, 0);
  ASSERT_EQ(r.phases().size(), 1u);
  EXPECT_EQ(r.phases_seen(), 1);
  EXPECT_EQ(r.phases()[0].device.peak_of(LiveSet::kWorkspace), 0);
}

TEST(MemoryTimelineRecorderTest, MergesInPairsPastTheLimitAndCoversTheStep) {
  MemoryTracker device, host;
  MemoryTimelineRecorder r(device, host, 4);
  r.Begin();
  // Phase i allocates 10 (i + 1) bytes of activations for a moment and keeps
  // one more byte of checkpoints.
  for (int i = 0; i < 11; ++i) {
    device.Add(LiveSet::kActivations, 10 * (i + 1));
    device.Sub(LiveSet::kActivations, 10 * (i + 1));
    device.Add(LiveSet::kCheckpoints, 1);
    r.EndPhase(StepPhase::kOptimizerBucket, i);
    ASSERT_LE(r.phases().size(), 4u) << "after phase " << i;
  }
  // 4 full: pairs (stride 2); 8 phases fill it again: fours (stride 4).
  ASSERT_EQ(r.phases().size(), 3u);
  EXPECT_EQ(r.phases_seen(), 11);
  const std::vector<std::string> names = {"optimizer bucket 0 .. optimizer bucket 3",
                                          "optimizer bucket 4 .. optimizer bucket 7",
                                          "optimizer bucket 8 .. optimizer bucket 10"};
  const std::vector<int64_t> merged = {4, 4, 3}, peak = {40, 80, 110}, kept = {4, 8, 11};
  for (size_t e = 0; e < 3; ++e) {
    const TimelinePhase& p = r.phases()[e];
    EXPECT_EQ(p.name(), names[e]);
    EXPECT_EQ(p.merged, merged[e]) << e;
    EXPECT_EQ(p.device.peak_of(LiveSet::kActivations), peak[e]) << e;
    EXPECT_EQ(p.device.current_of(LiveSet::kCheckpoints), kept[e]) << e;
    EXPECT_EQ(p.device.current_of(LiveSet::kActivations), 0) << e;
  }
}

TEST(MemoryTimelineRecorderTest, OddLimitRoundsUpToEven) {
  MemoryTracker device, host;
  EXPECT_EQ(MemoryTimelineRecorder(device, host, 5).max_phases(), 6u);
  EXPECT_EQ(MemoryTimelineRecorder(device, host, 0).max_phases(), 2u);
}

}  // namespace
}  // namespace plateau
