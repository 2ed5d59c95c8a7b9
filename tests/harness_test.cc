// The test harness's processes (tests/cluster.h), in a binary of its own:
// the test forks, and a fork of a process with other threads (gRPC's, in
// service_test) may deadlock on their locks before it execs.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/cluster.h"

namespace plateau {
namespace {

using namespace testing_cluster;  // NOLINT: the harness is this file's vocabulary

// A test killed at its timeout (or crashed) runs no destructor: its
// children, each in a process group of its own, trained on for ever and
// redialled ports later tests got. They die with the test's process.
TEST(HarnessTest, ChildrenDieWithTheTestProcess) {
  const std::string dir = TempDir("orphans");
  int pids[2];
  ASSERT_EQ(pipe(pids), 0);
  const pid_t test = fork();
  ASSERT_GE(test, 0);
  if (test == 0) {  // the "test": starts a child, says its pid, dies at once
    close(pids[0]);
    auto* child = new Process({"/bin/sleep", "600"}, dir + "/sleep");
    const pid_t pid = child->pid();
    (void)!write(pids[1], &pid, sizeof(pid));
    _exit(0);
  }
  close(pids[1]);
  pid_t child = 0;
  ASSERT_EQ(read(pids[0], &child, sizeof(child)), static_cast<ssize_t>(sizeof(child)));
  close(pids[0]);
  ASSERT_GT(child, 0);
  int status = 0;
  ASSERT_EQ(waitpid(test, &status, 0), test);
  // Its parent gone, the child is reparented (to init or a subreaper) and
  // killed; a zombie until that reaps it counts as gone.
  const absl::Time end = absl::Now() + absl::Seconds(30);
  while (kill(child, 0) == 0 && ProcState(child) != 'Z' && absl::Now() < end) absl::SleepFor(absl::Milliseconds(20));
  const bool gone = kill(child, 0) != 0 || ProcState(child) == 'Z';
  if (!gone) kill(child, SIGKILL);
  EXPECT_TRUE(gone) << "pid " << child << " outlived the process that started it";
}

}  // namespace
}  // namespace plateau
