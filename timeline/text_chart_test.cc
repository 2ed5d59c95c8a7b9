// The terminal chart of a known timeline, row by row: the bars' letters
// and lengths, the '+' of a transient, the bound ruler, the plan total and
// the cap, and the cap noted as off scale when it is far above the data.
#include "timeline/text_chart.h"

#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "timeline/timeline_testing.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

std::vector<std::string> Lines(const std::string& text) { return absl::StrSplit(text, '\n'); }

// Rank 0's device chart at 40 columns: the cap (4000 B) is on scale, so
// one column is 100 bytes.
TEST(TerminalChartTest, RowsAtOneHundredBytesAColumn) {
  auto charts = MemoryCharts(ExampleTimeline(), 0);
  ASSERT_TRUE(charts.ok()) << charts.status();
  const std::string text = TerminalChart((*charts)[0], 40);
  const std::vector<std::string> lines = Lines(text);
  ASSERT_GE(lines.size(), 8u) << text;
  EXPECT_EQ(lines[0], "job-7, rank 0, step 100: device memory");
  EXPECT_EQ(lines[1], "plan total 2.93 KiB; device cap 3.91 KiB; 3 rows");
  // Bound ruler: weights at 1000, grads 2000, dispatch 2600, activations 3000; the cap at 4000.
  std::string ruler(41, ' ');
  ruler[10] = 'W';
  ruler[20] = 'G';
  ruler[26] = 'D';
  ruler[30] = 'A';
  ruler[40] = '!';
  EXPECT_EQ(lines[3], "bound      " + ruler);
  // Marks in the empty part: ':' bounds, '|' plan total (on activations' bound), '!' cap.
  std::string empty(41, ' ');
  empty[10] = ':';  // under the bars in these rows
  empty[20] = ':';  // just right of the grads: the stack sits exactly on it
  empty[26] = ':';
  empty[30] = '|';
  empty[40] = '!';
  std::string embedding = empty;
  for (int i = 0; i < 10; ++i) embedding[i] = 'W';
  for (int i = 10; i < 20; ++i) embedding[i] = 'G';
  EXPECT_EQ(lines[4], "embedding  " + embedding + " 1.95 KiB");
  // forward 0: 300 B of activations at the end, 2800 B at the peak (a dispatch buffer).
  std::string forward = embedding;
  for (int i = 20; i < 23; ++i) forward[i] = 'A';
  for (int i = 23; i < 28; ++i) forward[i] = '+';
  EXPECT_EQ(lines[5], "forward 0  " + forward + " 2.25 KiB (peak 2.73 KiB)");
  std::string optimizer = embedding;
  for (int i = 20; i < 23; ++i) optimizer[i] = '+';
  EXPECT_EQ(lines[6], "optimizer  " + optimizer + " 1.95 KiB (peak 2.25 KiB)");
  EXPECT_EQ(lines[7], "legend:");
  EXPECT_EQ(lines[8], "  W weights (bound 1000 B)");
  EXPECT_EQ(lines[10], "  D dispatch (bound 600 B)");
  EXPECT_THAT(lines[12], HasSubstr("! cap"));
}

TEST(TerminalChartTest, AFarCapIsOffScale) {
  v1::GetMemoryTimelineResponse r = ExampleTimeline();
  r.mutable_ranks(0)->set_device_cap_bytes(int64_t{256} << 20);
  auto charts = MemoryCharts(r, 0);
  ASSERT_TRUE(charts.ok());
  const std::string text = TerminalChart((*charts)[0], 30);
  EXPECT_THAT(text, HasSubstr("device cap 256.00 MiB (off scale: 89478.5x the chart)"));
  const std::vector<std::string> lines = Lines(text);
  // Scaled to the data (3000 B = 30 columns): the plan total ends the rows.
  EXPECT_EQ(lines[4].substr(11), std::string(10, 'W') + std::string(10, 'G') + ":     :   | 1.95 KiB");
  EXPECT_EQ(text.find('!'), std::string::npos);
}

// Two bounds in one column: the ruler names the larger one.
TEST(TerminalChartTest, TheRulerNamesTheLargerOfTwoBoundsInAColumn) {
  v1::GetMemoryTimelineResponse r = ExampleTimeline(false);
  v1::LiveSetBytes* tiny = r.mutable_plan()->add_live_sets();
  tiny->set_live_set("workspace");  // 3000 + 10 bytes: activations' column at 100 B a column
  tiny->set_bytes(10);
  auto charts = MemoryCharts(r, 0);
  ASSERT_TRUE(charts.ok());
  const std::vector<std::string> lines = Lines(TerminalChart((*charts)[0], 40));
  EXPECT_EQ(lines[3][11 + 30], 'A');
  EXPECT_EQ(lines[3].find('S'), std::string::npos);
}

TEST(TerminalChartTest, HostChart) {
  auto charts = MemoryCharts(ExampleTimeline(), 0);
  ASSERT_TRUE(charts.ok());
  ASSERT_EQ(charts->size(), 2u);
  const std::string text = TerminalChart((*charts)[1], 20);
  EXPECT_THAT(text, HasSubstr("host memory"));
  EXPECT_THAT(text, HasSubstr("host cap none"));
  EXPECT_THAT(text, HasSubstr(std::string(20, 'O') + "| 1.95 KiB"));
}

}  // namespace
}  // namespace plateau
