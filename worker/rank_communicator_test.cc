#include "worker/rank_communicator.h"

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/job_spec.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

// The rank's world communicator by the spec's backend (Gloo on cpu, NCCL on
// cuda), on both with the job's progress timeout (never under 60 s)
// bounding the rendezvous and each collective.
TEST(RankCommunicatorTest, ByBackendWithTheTimeoutFromTheSpec) {
  v1::JobSpec gloo = DemoJobSpec(2, 10);
  auto cpu = ToCommunicatorOptions(gloo);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(cpu->backend, BackendKind::kCpu);
  EXPECT_EQ(cpu->size, 2);
  // Not Gloo's own 60 s: rank 0 committing a checkpoint for more than a
  // minute would fail every other rank waiting in its next collective.
  EXPECT_EQ(cpu->timeout, absl::Seconds(600));
  gloo.set_progress_timeout_s(1800);
  EXPECT_EQ(ToCommunicatorOptions(gloo)->timeout, absl::Seconds(1800));
  gloo.set_progress_timeout_s(5);
  EXPECT_EQ(ToCommunicatorOptions(gloo)->timeout, absl::Seconds(60));

  v1::JobSpec cuda = DemoJobSpec(2, 10);
  cuda.set_backend(v1::BACKEND_CUDA);
  cuda.set_device_memory_bytes(0);
  auto nccl = ToCommunicatorOptions(cuda);
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  EXPECT_EQ(nccl->backend, BackendKind::kCuda);
  EXPECT_EQ(nccl->size, 2);
  EXPECT_EQ(nccl->timeout, absl::Seconds(600));  // unset: the coordinator's default
  cuda.set_progress_timeout_s(1800);
  EXPECT_EQ(ToCommunicatorOptions(cuda)->timeout, absl::Seconds(1800));
  cuda.set_progress_timeout_s(5);  // a rendezvous needs more on a busy node
  EXPECT_EQ(ToCommunicatorOptions(cuda)->timeout, absl::Seconds(60));
  cuda.set_progress_timeout_s(-1);
  EXPECT_THAT(ToCommunicatorOptions(cuda).status().message(), HasSubstr("progress_timeout_s"));

  v1::JobSpec bad = DemoJobSpec(2, 10);
  bad.set_backend(static_cast<v1::Backend>(42));
  EXPECT_THAT(ToCommunicatorOptions(bad).status().message(), HasSubstr("backend"));
  EXPECT_EQ(ToCommunicatorOptions(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace plateau
