#include "server/worker_registry.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

v1::WorkerCapabilities Cpu(int devices) {
  v1::WorkerCapabilities c;
  c.set_backend(v1::BACKEND_CPU);
  c.set_devices(devices);
  c.set_device_memory_bytes(1 << 30);
  c.set_rank_address("127.0.0.1");
  return c;
}

const absl::Time kT0 = absl::FromUnixSeconds(1000);

TEST(WorkerRegistryTest, IdsAreFreshUnlessFreeOrExpected) {
  WorkerRegistry reg(absl::Seconds(2), absl::Seconds(10));
  bool expected = true;
  EXPECT_EQ(reg.Attach("", Cpu(1), kT0, &expected).id, "worker-1");
  EXPECT_FALSE(expected);
  // A worker asking for an id nobody holds keeps it; later ids go above it.
  EXPECT_EQ(reg.Attach("worker-7", Cpu(1), kT0, &expected).id, "worker-7");
  EXPECT_FALSE(expected);
  EXPECT_EQ(reg.Attach("", Cpu(1), kT0, &expected).id, "worker-8");
  // An id held by an attached worker of another node, or not of the form
  // worker-N, is not given out.
  v1::WorkerCapabilities elsewhere = Cpu(1);
  elsewhere.set_rank_address("10.0.0.2");
  EXPECT_EQ(reg.Attach("worker-7", elsewhere, kT0, &expected).id, "worker-9");
  EXPECT_EQ(reg.Attach("node-a", Cpu(1), kT0, &expected).id, "worker-10");
  // The same agent (name and rank address) restarted keeps its id; its
  // devices in use and queued work start over (the caller re-attaches).
  bool restarted = false;
  reg.at("worker-7").used_devices = 1;
  Worker& again = reg.Attach("worker-7", Cpu(1), kT0 + absl::Seconds(1), &expected, &restarted);
  EXPECT_EQ(again.id, "worker-7");
  EXPECT_TRUE(expected);
  EXPECT_TRUE(restarted);
  EXPECT_EQ(again.used_devices, 0);
  EXPECT_EQ(again.last_heartbeat, kT0 + absl::Seconds(1));
}

TEST(WorkerRegistryTest, SilentWorkersExpireAfterTheWorkerTimeout) {
  WorkerRegistry reg(absl::Seconds(2), absl::Seconds(10));
  bool expected = false;
  Worker& a = reg.Attach("", Cpu(2), kT0, &expected);
  Worker& b = reg.Attach("", Cpu(2), kT0, &expected);
  EXPECT_THAT(reg.Expired(kT0 + absl::Seconds(2)), IsEmpty());  // lost only once past it
  reg.Beat(b, kT0 + absl::Seconds(1.5));
  EXPECT_EQ(b.expires, kT0 + absl::Seconds(3.5));
  EXPECT_THAT(reg.Expired(kT0 + absl::Seconds(2.5)), ElementsAre(a.id));
  // Still registered until removed; Remove says why.
  EXPECT_NE(reg.Find("worker-1"), nullptr);
  EXPECT_EQ(reg.Remove("worker-1", kT0 + absl::Seconds(2.5)), "sent no heartbeat for 2.5 s");
  EXPECT_EQ(reg.Find("worker-1"), nullptr);
  EXPECT_EQ(reg.FindAttached("worker-1"), nullptr);
  EXPECT_THAT(reg.Expired(kT0 + absl::Seconds(2.5)), IsEmpty());
  EXPECT_THAT(reg.Expired(kT0 + absl::Seconds(4)), ElementsAre("worker-2"));
}

// After a restart: a worker a live attempt was placed on gets
// reattach_timeout to register again; until then it is known but not
// attached (no work, no requests), and if it does not come back it is lost
// saying so.
TEST(WorkerRegistryTest, ExpectedWorkersReattachOrExpireAfterTheReattachTimeout) {
  WorkerRegistry reg(absl::Seconds(2), absl::Seconds(10));
  reg.Expect("worker-3", kT0);
  reg.Expect("worker-5", kT0);
  EXPECT_NE(reg.Find("worker-3"), nullptr);
  EXPECT_EQ(reg.FindAttached("worker-3"), nullptr);
  EXPECT_THAT(reg.Slots(), IsEmpty());
  EXPECT_THAT(reg.Expired(kT0 + absl::Seconds(9)), IsEmpty());

  bool expected = false;
  Worker& w = reg.Attach("worker-3", Cpu(4), kT0 + absl::Seconds(1), &expected);
  EXPECT_TRUE(expected);
  EXPECT_EQ(w.id, "worker-3");
  EXPECT_EQ(reg.FindAttached("worker-3"), &w);
  // A new worker never takes an id from before the restart.
  EXPECT_EQ(reg.Attach("", Cpu(1), kT0, &expected).id, "worker-6");
  EXPECT_FALSE(expected);

  EXPECT_THAT(reg.Expired(kT0 + absl::Seconds(10.5)), ElementsAre("worker-3", "worker-5", "worker-6"));
  EXPECT_THAT(reg.Remove("worker-5", kT0 + absl::Seconds(10.5)),
              HasSubstr("did not register again within 10s of the coordinator's restart"));
}

TEST(WorkerRegistryTest, SlotsAreTheAttachedWorkersFreeDevices) {
  WorkerRegistry reg(absl::Seconds(2), absl::Seconds(10));
  bool expected = false;
  reg.Attach("", Cpu(4), kT0, &expected).used_devices = 3;
  reg.Expect("worker-9", kT0);
  const std::vector<WorkerSlots> slots = reg.Slots();
  ASSERT_EQ(slots.size(), 1u);
  EXPECT_EQ(slots[0].id, "worker-1");
  EXPECT_EQ(slots[0].free_devices, 1);
}

TEST(WorkerRegistryTest, CapabilitiesNameTheField) {
  v1::WorkerCapabilities c = Cpu(1);
  EXPECT_TRUE(WorkerRegistry::CheckCapabilities(c).ok());
  c.set_devices(0);
  EXPECT_THAT(std::string(WorkerRegistry::CheckCapabilities(c).message()), HasSubstr("capabilities.devices"));
  c = Cpu(1);
  c.clear_rank_address();
  EXPECT_THAT(std::string(WorkerRegistry::CheckCapabilities(c).message()), HasSubstr("capabilities.rank_address"));
  c = Cpu(1);
  c.set_backend(v1::BACKEND_UNSPECIFIED);
  EXPECT_THAT(std::string(WorkerRegistry::CheckCapabilities(c).message()), HasSubstr("capabilities.backend"));
  // Each memory field by its own name (a negative host memory was named
  // device_memory_bytes).
  c = Cpu(1);
  c.set_host_memory_bytes(-1);
  EXPECT_THAT(std::string(WorkerRegistry::CheckCapabilities(c).message()),
              HasSubstr("capabilities.host_memory_bytes: expected >= 0, got -1"));
  c = Cpu(1);
  c.set_device_memory_bytes(-1);
  EXPECT_THAT(std::string(WorkerRegistry::CheckCapabilities(c).message()),
              HasSubstr("capabilities.device_memory_bytes: expected >= 0, got -1"));
  // The name and address are printed in the log and by plateauctl: no
  // control characters (a newline forged a log line), bounded.
  for (const std::string& bad : {std::string("evil\n[coordinator] job-9 FAILED"), std::string("esc\x1b[2J"),
                                 std::string("c1 \xc2\x9b"), std::string(2000, 'n')}) {
    c = Cpu(1);
    c.set_name(bad);
    EXPECT_THAT(std::string(WorkerRegistry::CheckCapabilities(c).message()), HasSubstr("capabilities.name: expected"));
    c = Cpu(1);
    c.set_rank_address(bad);
    EXPECT_THAT(std::string(WorkerRegistry::CheckCapabilities(c).message()),
                HasSubstr("capabilities.rank_address: expected"));
  }
  c = Cpu(1);
  c.set_name("node-7.example.org (rack 3, GPU 0-7)");
  EXPECT_TRUE(WorkerRegistry::CheckCapabilities(c).ok());
}

// An id asked for near INT64_MAX was kept, and the next fresh id's
// increment overflowed: such an id gets a fresh number instead.
TEST(WorkerRegistryTest, AHugeAskedIdIsNotKept) {
  WorkerRegistry reg(absl::Seconds(2), absl::Seconds(10));
  bool expected = true;
  EXPECT_EQ(reg.Attach("worker-9223372036854775806", Cpu(1), kT0, &expected).id, "worker-1");
  EXPECT_EQ(reg.Attach("", Cpu(1), kT0, &expected).id, "worker-2");
  reg.Expect("worker-9223372036854775807", kT0);
  EXPECT_EQ(reg.Attach("", Cpu(1), kT0, &expected).id, "worker-3");
}

TEST(WorkerRegistryTest, TheLeaseEndsBeforeEitherTimeoutCanReplaceAJob) {
  // The fencing rule's order: lease < worker timeout and < re-attach timeout,
  // with a quarter of the shorter left for the agent to freeze its ranks.
  for (auto [timeout, reattach] : {std::pair<absl::Duration, absl::Duration>{absl::Seconds(2), absl::Seconds(10)},
                                   {absl::Seconds(10), absl::Seconds(10)},
                                   {absl::Seconds(30), absl::Seconds(8)},
                                   {absl::Milliseconds(1000), absl::Seconds(10)}}) {
    WorkerRegistry reg(timeout, reattach);
    const absl::Duration shorter = std::min(timeout, reattach);
    EXPECT_LT(reg.lease(), timeout);
    EXPECT_LT(reg.lease(), reattach);
    EXPECT_EQ(reg.lease(), shorter * 3 / 4);
    EXPECT_GE(shorter - reg.lease(), shorter / 4);
  }
}

}  // namespace
}  // namespace plateau
