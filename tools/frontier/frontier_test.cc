// The frontier simulation: the architecture's counts and depths by hand,
// the all-on and all-off answers tight against the plan they come from, and
// docs/FRONTIER.md's generated table equal to a fresh computation (the
// test fails when the budget changes and the document was not
// regenerated: `bazel run //tools/frontier -- --doc=$PWD/docs/FRONTIER.md
// --png=$PWD/docs/frontier.png`).
#include "tools/frontier/frontier.h"

#include <fstream>
#include <sstream>

#include "client/chart/png.h"
#include "gtest/gtest.h"
#include "kernels/budget/budget.h"
#include "tools/frontier/frontier_doc.h"

namespace plateau {
namespace {

// gpt-oss-120b by hand: per layer, attention q [2880, 4096] + 4096 bias,
// k and v [2880, 512] + 512 each, o [4096, 2880] + 2880, 64 sinks =
// 26,550,144; router 2880 x 128 + 128 = 368,768; 128 experts of
// (2880 x 5760 + 5760) + (2880 x 2880 + 2880) = 3,186,155,520; two norms
// 5,760: 3,213,080,192 a layer. Outside the layers: embedding and
// unembedding 201,088 x 2880 each, the final norm 2880.
TEST(FrontierTest, PublishedCountsAndDepths) {
  EXPECT_EQ(PublishedParameters(1) - PublishedParameters(0), 3'213'080'192);
  EXPECT_EQ(PublishedParameters(0), 2 * 201'088 * 2880 + 2880);
  EXPECT_EQ(PublishedParameters(36), 116'829'156'672);
  EXPECT_EQ(DepthForParameters(241'000'000'000), 75);
  EXPECT_EQ(DepthForParameters(667'000'000'000), 207);
  for (int64_t layers : {1, 36, 75, 207, 1000}) EXPECT_EQ(DepthForParameters(PublishedParameters(layers)), layers);
  const ModelConfig m = FrontierModel(36);
  EXPECT_TRUE(ValidateModelConfig(m).ok()) << ValidateModelConfig(m);
  EXPECT_EQ(m.head_dim(), 64);
  EXPECT_EQ(m.hidden, 2880);
  EXPECT_EQ(m.vocab_size, 201'088);
  // Ours lacks the biases, the sinks and 4096 - 2880 of the attention
  // width: within 0.3% of the published count.
  EXPECT_NEAR(static_cast<double>(ParameterCount(m)) / PublishedParameters(36), 1.0, 0.003);
}

int64_t Device(const MemoryPlan& p, const FitCaps& caps) { return DeviceBytesAgainstCap(p, caps); }

// Each answer fits and one step more (P tokens of context) does not, under
// the options the frontier names: the all-on options here are the what-if
// table's (WhatIfNMax computed the answer), so this also checks that
// AllOnOptions is that row's stack.
TEST(FrontierTest, AnswersAreTightAgainstThePlan) {
  const auto rows = ComputeFrontier();
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 3u);
  FitCaps balanced = FrontierCaps();
  balanced.balanced_dispatch = true;
  for (const FrontierRow& r : *rows) {
    SCOPED_TRACE(r.scale.name);
    const int64_t P = r.scale.ranks;
    ASSERT_GT(r.all_on.seq_len, 0);
    EXPECT_EQ(r.all_on.batch, 1);
    EXPECT_EQ(r.all_on.limit, "device_memory_bytes");
    const MemoryPlan on = PlanMemory(AllOnOptions(r.scale, r.layers, r.all_on.seq_len).value()).value();
    const MemoryPlan on_next = PlanMemory(AllOnOptions(r.scale, r.layers, r.all_on.seq_len + P).value()).value();
    EXPECT_TRUE(Fits(on, FrontierCaps()));
    EXPECT_FALSE(Fits(on_next, FrontierCaps()));
    ASSERT_GT(r.all_off.seq_len, 0);
    EXPECT_EQ(r.all_off.batch, P);
    const MemoryPlan off = PlanMemory(AllOffOptions(r.scale, r.layers, r.all_off.seq_len)).value();
    const MemoryPlan off_next = PlanMemory(AllOffOptions(r.scale, r.layers, r.all_off.seq_len + P)).value();
    EXPECT_LE(Device(off, balanced), kH200UsableBytes);
    EXPECT_GT(Device(off_next, balanced), kH200UsableBytes);
    // The worst case guarantees less; device AdamW's 12 bytes a parameter
    // on the device leave less still.
    EXPECT_LT(r.all_off_worst_case.seq_len, r.all_off.seq_len);
    EXPECT_LT(r.all_off_device_adamw.seq_len, r.all_off.seq_len);
    // The stack reaches the paper's 1M at every scale.
    EXPECT_GE(r.all_on.seq_len, r.scale.paper_all_on);
    EXPECT_TRUE(Fits(r.all_on_at_paper, FrontierCaps()));
  }
}

TEST(FrontierTest, TheDocumentsTableIsTheSimulations) {
  std::ifstream in("docs/FRONTIER.md");
  ASSERT_TRUE(in) << "docs/FRONTIER.md missing from runfiles";
  std::stringstream doc;
  doc << in.rdbuf();
  const auto table = FrontierTableOf(doc.str());
  ASSERT_TRUE(table.ok()) << table.status();
  const auto rows = ComputeFrontier();
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(*table, FrontierTable(*rows))
      << "docs/FRONTIER.md's table has drifted from the budget; regenerate it with\n"
         "  bazel run //tools/frontier -- --doc=$PWD/docs/FRONTIER.md --png=$PWD/docs/frontier.png";
}

TEST(FrontierTest, ReplacingTheTableKeepsTheRestOfTheDocument) {
  const std::string doc = std::string("# T\nbefore\n") + kFrontierBegin + "old\n" + kFrontierEnd + "after\n";
  EXPECT_EQ(ReplaceFrontierTable(doc, "new\n").value(),
            std::string("# T\nbefore\n") + kFrontierBegin + "new\n" + kFrontierEnd + "after\n");
  EXPECT_EQ(FrontierTableOf("no markers").status().code(), absl::StatusCode::kNotFound);
}

// The chart draws every series: each colour of the legend appears inside
// the plot area, and its PNG is small and deterministic.
TEST(FrontierTest, ThePlotDrawsEverySeries) {
  const auto rows = ComputeFrontier();
  ASSERT_TRUE(rows.ok());
  const chart::Canvas c = FrontierPlot(*rows);
  EXPECT_EQ(c.width(), 960);
  EXPECT_EQ(c.height(), 600);
  for (chart::Rgb colour : {chart::Rgb{31, 90, 180}, chart::Rgb{200, 50, 40}, chart::Rgb{235, 140, 30}}) {
    int n = 0;
    for (int y = 64; y < 600 - 84; ++y) {
      for (int x = 96; x < 960 - 300; ++x) n += c.At(x, y) == colour;
    }
    EXPECT_GT(n, 200) << int(colour.r) << "," << int(colour.g) << "," << int(colour.b);
  }
  // docs/frontier.png lives in git: flat colours compress (about 20 KB,
  // against 1.7 MB of rows), and the same rows give the same bytes.
  const std::string png = chart::EncodePng(c);
  EXPECT_LT(png.size(), 600u * (1 + 960 * 3) / 50);
  EXPECT_EQ(chart::EncodePng(FrontierPlot(*rows)), png);
}

}  // namespace
}  // namespace plateau
