// The rank's report of a memory timeline: every phase and live set as the
// recorder holds it, and the largest report a recorder can make (every
// phase slot used, byte counts of 2^62) still fits one RankOutput JSON line
// the agent reads whole.
#include "worker/memory_timeline_proto.h"

#include <string>

#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "plateau/v1/worker.pb.h"
#include "worker/rank_protocol.h"

namespace plateau {
namespace {

TEST(MemoryTimelineProtoTest, EveryPhaseAndLiveSet) {
  MemoryTracker device, host;
  MemoryTimelineRecorder r(device, host);
  device.Add(LiveSet::kWeights, 4096);
  r.Begin();
  device.Add(LiveSet::kDispatch, 100);
  device.Sub(LiveSet::kDispatch, 100);
  host.Add(LiveSet::kCheckpoints, 7);
  r.EndPhase(StepPhase::kForward, 0);
  r.EndPhase(StepPhase::kOptimizer, 0);
  const v1::MemoryTimeline t = MemoryTimelineToProto(r, 3, 42, 1, 1 << 20, 0);
  EXPECT_EQ(t.rank(), 3);
  EXPECT_EQ(t.step(), 42);
  EXPECT_EQ(t.attempt(), 1);
  EXPECT_EQ(t.device_cap_bytes(), 1 << 20);
  EXPECT_EQ(t.phases_seen(), 2);
  ASSERT_EQ(t.live_sets_size(), kNumLiveSets);
  EXPECT_EQ(t.live_sets(4), "dispatch");
  ASSERT_EQ(t.phases_size(), 2);
  const v1::MemoryTimelinePhase& f = t.phases(0);
  EXPECT_EQ(f.name(), "forward 0");
  EXPECT_EQ(f.merged(), 1);
  ASSERT_EQ(f.device_bytes_size(), kNumLiveSets);
  ASSERT_EQ(f.host_peak_bytes_size(), kNumLiveSets);
  EXPECT_EQ(f.device_bytes(0), 4096);
  EXPECT_EQ(f.device_bytes(4), 0);
  EXPECT_EQ(f.device_peak_bytes(4), 100);
  EXPECT_EQ(f.device_peak_total_bytes(), 4196);
  EXPECT_EQ(f.host_bytes(3), 7);
  EXPECT_EQ(f.host_peak_total_bytes(), 7);
  EXPECT_EQ(t.phases(1).name(), "optimizer");
  EXPECT_EQ(t.phases(1).device_peak_total_bytes(), 4096);
}

TEST(MemoryTimelineProtoTest, TheLargestReportFitsOneRankOutputLine) {
  MemoryTracker device, host;
  MemoryTimelineRecorder r(device, host);
  r.Begin();
  // Every set at 2^62 / 16 bytes on both spaces: 19-digit totals.
  for (int i = 0; i < kNumLiveSets; ++i) {
    device.Add(static_cast<LiveSet>(i), int64_t{1} << 58);
    host.Add(static_cast<LiveSet>(i), int64_t{1} << 58);
  }
  // Twice the phases it keeps: every slot used by a merged pair, with the
  // longest names it makes.
  const int64_t phases = 2 * static_cast<int64_t>(r.max_phases());
  for (int64_t b = 0; b < phases; ++b) r.EndPhase(StepPhase::kOptimizerBucket, int64_t{1} << 62 | b);
  ASSERT_EQ(r.phases().size(), r.max_phases());
  v1::RankOutput out;
  v1::StepTelemetry* step = out.mutable_step();
  step->set_rank(1000);
  step->set_step(int64_t{1} << 40);
  *step->mutable_memory_timeline() = MemoryTimelineToProto(r, 1000, int64_t{1} << 40, 100, int64_t{1} << 62,
                                                           int64_t{1} << 62);
  for (int i = 0; i < kNumLiveSets; ++i) {
    v1::LiveSetBytes* ls = step->add_peak();
    ls->set_live_set("activations");
    ls->set_bytes(int64_t{1} << 62);
    *step->add_host_peak() = *ls;
  }
  std::string json;
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = false;
  ASSERT_TRUE(google::protobuf::util::MessageToJsonString(out, &json, opts).ok());
  EXPECT_LT(json.size() + 1, kMaxRankOutputLineBytes) << "a full timeline is " << json.size() << " bytes";
  EXPECT_GT(json.size(), kMaxRankOutputLineBytes / 4) << "the test no longer fills the recorder";
}

}  // namespace
}  // namespace plateau
