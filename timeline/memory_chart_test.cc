// The chart model from a known timeline: which live sets become series (in
// stacking order), their bytes, peaks and stacked bounds, the per-phase
// totals and peaks, the caps, the host chart only when there are host bytes,
// and the error for a rank without a timeline.
#include "timeline/memory_chart.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "timeline/timeline_testing.h"

namespace plateau {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(MemoryChartTest, DeviceSeriesStackInLiveSetOrderWithStackedBounds) {
  auto charts = MemoryCharts(ExampleTimeline(), 1);
  ASSERT_TRUE(charts.ok()) << charts.status();
  ASSERT_EQ(charts->size(), 2u);
  const MemoryChart& d = (*charts)[0];
  EXPECT_EQ(d.space, "device");
  EXPECT_EQ(d.title, "job-7, rank 1, step 100: device memory");
  EXPECT_THAT(d.phases, ElementsAre("embedding", "forward 0", "optimizer"));
  // Optimizer and the rest hold nothing on the device and have no bound: no series.
  ASSERT_EQ(d.series.size(), 4u);
  EXPECT_EQ(d.series[0].live_set, "weights");
  EXPECT_EQ(d.series[1].live_set, "grads");
  EXPECT_EQ(d.series[2].live_set, "dispatch");
  EXPECT_EQ(d.series[3].live_set, "activations");
  EXPECT_THAT(d.series[2].bytes, ElementsAre(0, 0, 0));
  EXPECT_THAT(d.series[2].peak, ElementsAre(0, 500, 0));
  EXPECT_THAT(d.series[3].bytes, ElementsAre(0, 300, 0));
  EXPECT_EQ(d.series[2].bound, 600);
  EXPECT_EQ(d.series[0].stacked_bound, 1000);
  EXPECT_EQ(d.series[1].stacked_bound, 2000);
  EXPECT_EQ(d.series[2].stacked_bound, 2600);
  EXPECT_EQ(d.series[3].stacked_bound, 3000);
  EXPECT_EQ(d.series[0].letter, 'W');
  EXPECT_EQ(d.series[2].letter, 'D');
  EXPECT_NE(d.series[0].color, d.series[1].color);
  EXPECT_THAT(d.total, ElementsAre(2000, 2300, 2000));
  EXPECT_THAT(d.total_peak, ElementsAre(2000, 2800, 2300));
  EXPECT_EQ(d.planned_total, 3000);
  EXPECT_EQ(d.cap, 4000);
  EXPECT_EQ(d.data_max(), 3000);
  const MemoryChart& h = (*charts)[1];
  EXPECT_EQ(h.space, "host");
  ASSERT_EQ(h.series.size(), 1u);
  EXPECT_EQ(h.series[0].live_set, "optimizer");
  EXPECT_EQ(h.series[0].bound, 2000);
  EXPECT_THAT(h.total, ElementsAre(2000, 2000, 2000));
  EXPECT_EQ(h.cap, 0);  // uncapped
}

TEST(MemoryChartTest, NoHostChartWithoutHostBytes) {
  auto charts = MemoryCharts(ExampleTimeline(false), 0);
  ASSERT_TRUE(charts.ok()) << charts.status();
  ASSERT_EQ(charts->size(), 1u);
  EXPECT_EQ((*charts)[0].space, "device");
}

TEST(MemoryChartTest, ASetOnlyThePlanNamesStillGetsItsBound) {
  v1::GetMemoryTimelineResponse r = ExampleTimeline(false);
  v1::LiveSetBytes* b = r.mutable_plan()->add_live_sets();
  b->set_live_set("workspace");
  b->set_bytes(64);
  auto charts = MemoryCharts(r, 0);
  ASSERT_TRUE(charts.ok());
  const MemoryChart& d = (*charts)[0];
  ASSERT_EQ(d.series.size(), 5u);
  EXPECT_EQ(d.series[4].live_set, "workspace");
  EXPECT_EQ(d.series[4].stacked_bound, 3064);
  EXPECT_THAT(d.series[4].bytes, ElementsAre(0, 0, 0));
}

TEST(MemoryChartTest, ARankWithoutATimelineIsNamed) {
  auto charts = MemoryCharts(ExampleTimeline(), 5);
  EXPECT_EQ(charts.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(charts.status().message(), HasSubstr("rank 5"));
  EXPECT_THAT(charts.status().message(), HasSubstr("ranks with one: 0, 1"));
}

TEST(MemoryChartTest, FormatBytes) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(int64_t{6868172}), "6.55 MiB");
  EXPECT_EQ(FormatBytes(int64_t{3} << 30), "3.00 GiB");
}

}  // namespace
}  // namespace plateau
