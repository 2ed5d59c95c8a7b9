#include "worker/telemetry_batch.h"

#include <string>

#include "gtest/gtest.h"

namespace plateau {
namespace {

TEST(SplitTelemetryTest, ManyMegabytesBecomeBatchesUnderTheLimitInOrder) {
  v1::TelemetryRequest all;
  all.set_worker_id("worker-7");
  for (int i = 0; i < 2000; ++i) {
    v1::TelemetryRequest::Step* s = all.add_steps();
    s->set_job_id("job-1");
    s->mutable_telemetry()->set_step(i);
  }
  for (int i = 0; i < 200; ++i) {  // 200 lines of 64 KiB: 12.5 MiB
    v1::LogEntry* l = all.add_logs();
    l->set_job_id("job-1");
    l->set_index(i);
    l->set_line(std::string(65536, 'a' + i % 26));
  }
  ASSERT_GT(all.ByteSizeLong(), size_t{12} << 20);
  const std::vector<v1::TelemetryRequest> batches = SplitTelemetry(all);
  ASSERT_GT(batches.size(), 20u);
  int64_t next_step = 0, next_log = 0;
  for (const v1::TelemetryRequest& b : batches) {
    EXPECT_LE(b.ByteSizeLong(), kMaxTelemetryBatchBytes);
    EXPECT_EQ(b.worker_id(), "worker-7");
    EXPECT_GT(b.steps_size() + b.logs_size(), 0);
    for (const auto& s : b.steps()) EXPECT_EQ(s.telemetry().step(), next_step++);
    for (const auto& l : b.logs()) {
      EXPECT_EQ(l.index(), next_log);
      EXPECT_EQ(l.line(), all.logs(next_log).line());
      ++next_log;
    }
  }
  EXPECT_EQ(next_step, 2000);
  EXPECT_EQ(next_log, 200);
}

TEST(SplitTelemetryTest, SmallOutboxIsOneRequestAndEmptyIsNone) {
  v1::TelemetryRequest all;
  all.set_worker_id("w");
  EXPECT_TRUE(SplitTelemetry(all).empty());
  all.add_logs()->set_line("hello");
  all.add_steps()->set_job_id("job-1");
  const auto batches = SplitTelemetry(all);
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0].SerializeAsString(), all.SerializeAsString());
}

TEST(SplitTelemetryTest, AnEntryOverTheLimitGoesAlone) {
  v1::TelemetryRequest all;
  all.add_logs()->set_line("a");
  all.add_logs()->set_line(std::string(2000, 'x'));
  all.add_logs()->set_line("b");
  const auto batches = SplitTelemetry(all, 1000);
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[1].logs(0).line().size(), 2000u);
  EXPECT_LE(batches[0].ByteSizeLong(), 1000u);
  EXPECT_LE(batches[2].ByteSizeLong(), 1000u);
}

}  // namespace
}  // namespace plateau
