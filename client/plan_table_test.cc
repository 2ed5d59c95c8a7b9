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
  EXPECT_THAT(table, HasSubstr("with pipelined_llep chunk_tokens=128 min_piece=32 max_borrowed=no cap (the spec's)"));
  // The demo's bucket is `auto`: chosen again at each N, shown at each answer.
  EXPECT_THAT(table, HasSubstr("with offload_stream_adamw bucket_params=auto staging_slots=2 (the spec's)"));
  EXPECT_THAT(table, HasSubstr(absl::StrCat("as specified, `auto` at N_max: batch: "
                                            "schedule.offload_stream_adamw.bucket_params=",
                                            plan->n_max().batch().auto_settings(0).value())));
  EXPECT_THAT(table, HasSubstr("as specified, one step more: batch: at layout.batch "));
}

TEST(PlanTableTest, NothingWithoutNMax) {
  v1::MemoryPlan plan;
  EXPECT_EQ(FormatWhatIf(plan), "");
}

TEST(PlanTableTest, AutoSettingsShowTheValueWhyAndTheCurves) {
  v1::JobSpec spec = DemoJobSpec(2, 10);
  spec.mutable_schedule()->mutable_pipelined_llep()->clear_chunk_tokens();
  spec.mutable_schedule()->mutable_pipelined_llep()->set_chunk_tokens_auto(true);
  auto plan = PlanJob(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->auto_settings_size(), 2);  // and the demo's bucket
  const std::string text = FormatAutoSettings(*plan);
  std::cout << text;
  EXPECT_THAT(text, HasSubstr("curves the default cpu curve"));
  EXPECT_THAT(text, HasSubstr(absl::StrFormat("  %-44s = %-12d K = ", "schedule.pipelined_llep.chunk_tokens",
                                              plan->auto_settings(0).value())));
  EXPECT_THAT(text, HasSubstr(plan->auto_settings(0).why()));
  v1::JobSpec fixed = DemoJobSpec(2, 10);
  fixed.mutable_schedule()->mutable_offload_stream_adamw()->clear_bucket_params_auto();
  EXPECT_EQ(FormatAutoSettings(*PlanJob(fixed)), "");
}

}  // namespace
}  // namespace plateau
