// The what-if table as plateauctl prints it, from the demo job's real plan.
#include "client/plan_table.h"

#include <iostream>

#include "absl/strings/str_format.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/job_spec.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

TEST(PlanTableTest, PrintsEveryRowWithItsNMaxAndTheSettings) {
  auto plan = PlanJob(DemoJobSpec(2, 10));
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::string table = FormatWhatIf(*plan);
  std::cout << table;  // the example in docs/SERVICE.md
  EXPECT_THAT(table, HasSubstr("under a 256.00 MiB device (host uncapped)"));
  for (const v1::WhatIfRow& r : plan->what_if()) {
    EXPECT_THAT(table, HasSubstr(absl::StrFormat("  %-22s %9d %11d", r.schedules(), r.n_max().batch().batch(),
                                                 r.n_max().batch().tokens_per_rank())));
  }
  EXPECT_THAT(table, HasSubstr(absl::StrFormat("  %-22s %9d", "as specified", plan->n_max().batch().batch())));
  EXPECT_THAT(table, HasSubstr("with pipelined_llep chunk_tokens=128 min_piece=32 (the spec's)"));
  EXPECT_THAT(table, HasSubstr("as specified, one step more: batch: at layout.batch "));
}

TEST(PlanTableTest, NothingWithoutNMax) {
  v1::MemoryPlan plan;
  EXPECT_EQ(FormatWhatIf(plan), "");
}

}  // namespace
}  // namespace plateau
