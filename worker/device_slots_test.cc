#include "worker/device_slots.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(DeviceSlotsTest, LowestFreeSlotsFirst) {
  EXPECT_THAT(*FreeDeviceSlots(4, {}, 2), ElementsAre(0, 1));
  // A second job on the same worker gets the GPUs the first does not hold.
  EXPECT_THAT(*FreeDeviceSlots(4, {0, 1}, 2), ElementsAre(2, 3));
  // A finished job's slots are reused, lowest first.
  EXPECT_THAT(*FreeDeviceSlots(4, {2, 0}, 2), ElementsAre(1, 3));
  EXPECT_THAT(*FreeDeviceSlots(1, {}, 1), ElementsAre(0));
  EXPECT_TRUE(FreeDeviceSlots(3, {0, 1, 2}, 0)->empty());
}

TEST(DeviceSlotsTest, NotEnoughFreeSlotsIsAnErrorNamingTheHeldOnes) {
  auto s = FreeDeviceSlots(2, {1}, 2);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.status().message(), HasSubstr("only 1 of 2 are free (held: 1)"));
}

TEST(DeviceSlotsTest, VisibleDevicesFollowTheAgentsOwnList) {
  EXPECT_EQ(*RankVisibleDevices(std::nullopt, 3), "3");
  EXPECT_EQ(*RankVisibleDevices(std::string(), 1), "1");  // set but empty: every GPU
  EXPECT_EQ(*RankVisibleDevices(std::string("4,5,6"), 0), "4");
  EXPECT_EQ(*RankVisibleDevices(std::string("4, 5,6"), 1), "5");
  EXPECT_EQ(*RankVisibleDevices(std::string("GPU-8f2a,GPU-11c0"), 1), "GPU-11c0");  // UUIDs pass through
  auto s = RankVisibleDevices(std::string("4,5"), 2);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("CUDA_VISIBLE_DEVICES='4,5' names 2"));
}

TEST(DeviceSlotsTest, EnvironmentEntryReplacedOrAppended) {
  EXPECT_THAT(WithVisibleDevices({"A=1", "CUDA_VISIBLE_DEVICES=0,1", "B=2"}, "1"),
              ElementsAre("A=1", "CUDA_VISIBLE_DEVICES=1", "B=2"));
  EXPECT_THAT(WithVisibleDevices({"A=1"}, "GPU-x"), ElementsAre("A=1", "CUDA_VISIBLE_DEVICES=GPU-x"));
  // A name that only starts like it is another variable.
  EXPECT_THAT(WithVisibleDevices({"CUDA_VISIBLE_DEVICES_X=3"}, "2"),
              ElementsAre("CUDA_VISIBLE_DEVICES_X=3", "CUDA_VISIBLE_DEVICES=2"));
}

// A CUDA rank's (and the agent's memory probe's) environment: the slot's GPU
// from the agent's own list, and eager module loading unless the operator
// chose otherwise.
TEST(DeviceSlotsTest, ACudaRanksEnvironmentNamesItsGpuAndLoadsEagerly) {
  std::string visible;
  auto env = CudaRankEnvironment({"A=1", "CUDA_VISIBLE_DEVICES=4,5"}, 1, &visible);
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(visible, "5");
  EXPECT_THAT(*env, ElementsAre("A=1", "CUDA_VISIBLE_DEVICES=5", "CUDA_MODULE_LOADING=EAGER"));
  env = CudaRankEnvironment({"CUDA_MODULE_LOADING=LAZY"}, 2, &visible);  // no list: the slot itself
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(visible, "2");
  EXPECT_THAT(*env, ElementsAre("CUDA_MODULE_LOADING=LAZY", "CUDA_VISIBLE_DEVICES=2"));
  env = CudaRankEnvironment({"CUDA_VISIBLE_DEVICES="}, 0, &visible);  // set but empty: every GPU
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(visible, "0");
  env = CudaRankEnvironment({"CUDA_VISIBLE_DEVICES=4,5"}, 2, &visible);
  EXPECT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(env.status().message(), HasSubstr("slot 2 has no GPU"));
}

// The environment as the agent hands it to posix_spawn reaches a real child
// process: what the rank's CUDA runtime will read.
TEST(DeviceSlotsTest, ASpawnedProcessSeesOnlyItsSlot) {
  std::vector<std::string> env =
      WithVisibleDevices({"PATH=/usr/bin:/bin", "CUDA_VISIBLE_DEVICES=0,1,2,3"}, *RankVisibleDevices("6,7", 1));
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_addclose(&fa, fds[0]);
  std::string sh = "/bin/sh", c = "-c", script = "printf '%s' \"$CUDA_VISIBLE_DEVICES\"";
  char* argv[] = {sh.data(), c.data(), script.data(), nullptr};
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, "/bin/sh", &fa, nullptr, argv, envp.data()), 0);
  posix_spawn_file_actions_destroy(&fa);
  close(fds[1]);
  std::string got;
  char buf[64];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) got.append(buf, n);
  close(fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(got, "7");
}

}  // namespace
}  // namespace plateau
