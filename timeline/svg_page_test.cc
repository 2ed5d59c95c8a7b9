// The memory timeline page from a known timeline: self-contained (no
// script, no external resource), every live set's bands and every bound
// drawn and named, the transient of a phase, the bounds stacked in order
// with the cap above them, the host chart only when there are host bytes,
// links to the other ranks, and text escaped.
#include "timeline/svg_page.h"

#include <map>
#include <regex>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "timeline/timeline_testing.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// The y of each <line class="bound" data-live-set=...> of the first chart.
std::map<std::string, double> BoundYs(const std::string& svg) {
  std::map<std::string, double> out;
  const std::regex line("<line class=\"bound\" data-live-set=\"([a-z]+)\"[^>]* y1=\"([0-9.]+)\"");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), line); it != std::sregex_iterator(); ++it) {
    double y = 0;
    EXPECT_TRUE(absl::SimpleAtod((*it)[2].str(), &y));
    out[(*it)[1].str()] = y;
  }
  return out;
}

double CapY(const std::string& svg) {
  std::smatch m;
  const std::regex cap("<line class=\"cap\"[^>]* y1=\"([0-9.]+)\"");
  EXPECT_TRUE(std::regex_search(svg, m, cap));
  double y = 0;
  EXPECT_TRUE(absl::SimpleAtod(m[1].str(), &y));
  return y;
}

TEST(SvgPageTest, SelfContainedWithEveryLiveSetAndBound) {
  auto page = MemoryTimelinePage(ExampleTimeline(), 0);
  ASSERT_TRUE(page.ok()) << page.status();
  const std::string& html = *page;
  EXPECT_TRUE(absl::StartsWith(html, "<!DOCTYPE html>"));
  EXPECT_THAT(html, Not(HasSubstr("<script")));
  EXPECT_THAT(html, Not(HasSubstr("src=")));
  EXPECT_THAT(html, Not(HasSubstr("url(")));
  EXPECT_THAT(html, Not(HasSubstr("@import")));
  EXPECT_THAT(html, Not(HasSubstr("href=\"http")));
  // The only URL is the SVG namespace, which is a name, not a request.
  EXPECT_EQ(Count(html, "http"), Count(html, "http://www.w3.org/2000/svg"));
  EXPECT_EQ(Count(html, "<svg class=\"memory-chart\" data-space=\"device\""), 1);
  EXPECT_EQ(Count(html, "<svg class=\"memory-chart\" data-space=\"host\""), 1);
  // Bands: weights and grads in all 3 phases of the device chart; activations
  // once; optimizer 3 times on the host chart.
  EXPECT_EQ(Count(html, "class=\"band\" data-live-set=\"weights\""), 3);
  EXPECT_EQ(Count(html, "class=\"band\" data-live-set=\"grads\""), 3);
  EXPECT_EQ(Count(html, "class=\"band\" data-live-set=\"activations\""), 1);
  EXPECT_EQ(Count(html, "class=\"band\" data-live-set=\"optimizer\""), 3);
  EXPECT_EQ(Count(html, "class=\"band\" data-live-set=\"dispatch\""), 0);  // never held at a boundary
  // Every bound of the plan, device and host.
  for (const char* set : {"weights", "grads", "dispatch", "activations", "optimizer"}) {
    EXPECT_EQ(Count(html, absl::StrCat("class=\"bound\" data-live-set=\"", set, "\"")), 1) << set;
  }
  EXPECT_EQ(Count(html, "class=\"bound\""), 5);
  // The transients: dispatch in forward 0, activations in the optimizer phase.
  EXPECT_EQ(Count(html, "class=\"transient\""), 2);
  EXPECT_THAT(html, HasSubstr("class=\"transient\" data-live-set=\"dispatch\" data-phase=\"1\""));
  EXPECT_THAT(html, HasSubstr("class=\"transient\" data-live-set=\"activations\" data-phase=\"2\""));
  EXPECT_THAT(html, HasSubstr("peak 2.73 KiB inside the phase"));
  EXPECT_EQ(Count(html, "class=\"plan-total\""), 2);
  EXPECT_EQ(Count(html, "class=\"cap\""), 1);  // the host is uncapped
  EXPECT_THAT(html, HasSubstr("class=\"cap\" data-bytes=\"4000\" data-on-scale=\"true\""));
  EXPECT_THAT(html, HasSubstr("<a href=\"?rank=1\">1</a>"));
  EXPECT_THAT(html, HasSubstr("Step 100 (attempt 0)"));
  EXPECT_THAT(html, HasSubstr("2023-11-14 22:13:20 UTC"));
  // Ticks at round binary units: 0 to 3 KiB under the 3.91 KiB cap.
  for (const char* tick : {">0 B<", ">1.00 KiB<", ">2.00 KiB<", ">3.00 KiB<"}) EXPECT_THAT(html, HasSubstr(tick));
}

TEST(SvgPageTest, BoundsStackUpwardUnderTheCap) {
  auto charts = MemoryCharts(ExampleTimeline(), 0);
  ASSERT_TRUE(charts.ok());
  const std::string svg = MemoryChartSvg((*charts)[0]);
  const std::map<std::string, double> y = BoundYs(svg);
  ASSERT_EQ(y.size(), 4u);
  // SVG y grows downward: each stacked bound above the one before.
  EXPECT_GT(y.at("weights"), y.at("grads"));
  EXPECT_GT(y.at("grads"), y.at("dispatch"));
  EXPECT_GT(y.at("dispatch"), y.at("activations"));
  EXPECT_GT(y.at("activations"), CapY(svg));
  // Linear in bytes: weights (1000) and grads (2000) as far apart as grads and 0.
  const std::regex axis("<line x1=\"[0-9.]+\" x2=\"[0-9.]+\" y1=\"[0-9.]+\" y2=\"([0-9.]+)\"");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(svg, m, axis));
  double bottom = 0;
  ASSERT_TRUE(absl::SimpleAtod(m[1].str(), &bottom));
  EXPECT_NEAR(bottom - y.at("weights"), y.at("weights") - y.at("grads"), 0.11);
}

TEST(SvgPageTest, AFarCapIsDrawnOffScaleAtTheTop) {
  v1::GetMemoryTimelineResponse r = ExampleTimeline(false);
  r.mutable_ranks(0)->set_device_cap_bytes(int64_t{1} << 30);
  auto page = MemoryTimelinePage(r, 0);
  ASSERT_TRUE(page.ok());
  EXPECT_THAT(*page, HasSubstr("data-on-scale=\"false\""));
  EXPECT_THAT(*page, HasSubstr("device cap 1.00 GiB (off scale"));
  EXPECT_EQ(Count(*page, "data-space=\"host\""), 0);
  auto charts = MemoryCharts(r, 0);
  ASSERT_TRUE(charts.ok());
  const std::string svg = MemoryChartSvg((*charts)[0]);
  EXPECT_GT(BoundYs(svg).at("activations"), CapY(svg));
}

TEST(SvgPageTest, TextIsEscaped) {
  v1::GetMemoryTimelineResponse r = ExampleTimeline();
  r.mutable_ranks(0)->mutable_phases(0)->set_name("<i>\"x\" & 'y'</i>");
  auto page = MemoryTimelinePage(r, 0);
  ASSERT_TRUE(page.ok());
  EXPECT_THAT(*page, Not(HasSubstr("<i>")));
  EXPECT_THAT(*page, HasSubstr("&lt;i&gt;&quot;x&quot; &amp; &#39;y&#39;&lt;/i&gt;"));
  EXPECT_EQ(HtmlEscape("a<b"), "a&lt;b");
  EXPECT_THAT(MessagePage("t<", "m&"), HasSubstr("<p>m&amp;</p>"));
}

TEST(SvgPageTest, UnknownRank) {
  auto page = MemoryTimelinePage(ExampleTimeline(), 3);
  EXPECT_EQ(page.status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace plateau
