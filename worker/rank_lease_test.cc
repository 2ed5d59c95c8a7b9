#include "worker/rank_lease.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

// A child that watches `fd` as a rank does (no grace, 5 ms polls) and exits
// 7 once its watchdog has stopped and been resumed; 1 if it is never
// stopped within 20 s.
pid_t WatchingChild(int fd) {
  const pid_t pid = fork();
  if (pid != 0) return pid;
  auto lease = RankLease::Attach(fd);
  if (!lease.ok()) _exit(2);
  std::atomic<bool> resumed{false};
  (*lease)->Watch(absl::ZeroDuration(), absl::Milliseconds(5), [&](absl::Duration, int64_t) { resumed.store(true); });
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (!resumed.load() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  _exit(resumed.load() ? 7 : 1);
}

// Waits until `pid` stops (true) or exits (false).
bool WaitStopped(pid_t pid) {
  int status = 0;
  return waitpid(pid, &status, WUNTRACED) == pid && WIFSTOPPED(status) && WSTOPSIG(status) == SIGSTOP;
}

int ExitCode(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

// While the lease holds the rank runs on; once its end has passed it stops
// itself and says so on the page; the agent's SIGCONT resumes it, and the
// mark is cleared.
TEST(RankLeaseTest, ARankStopsItselfWhenTheLeaseLapsesAndResumesOnSigcont) {
  auto lease = RankLease::Create();
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ((*lease)->end(), RankLease::kNever);
  const int64_t set = MonotonicNanos();
  (*lease)->SetEnd(set + int64_t{300'000'000});  // 300 ms from now
  const pid_t child = WatchingChild((*lease)->fd());
  ASSERT_GT(child, 0);
  ASSERT_TRUE(WaitStopped(child)) << "the rank did not stop itself";
  EXPECT_GE(MonotonicNanos() - set, int64_t{300'000'000}) << "stopped before the lease's end";
  EXPECT_TRUE((*lease)->self_stopped());
  (*lease)->SetEnd(RankLease::kNever);  // renewed, as the agent does before its SIGCONT
  ASSERT_EQ(kill(child, SIGCONT), 0);
  EXPECT_EQ(ExitCode(child), 7);
  EXPECT_FALSE((*lease)->self_stopped());
}

// A descriptor that is not a lease's page is an error naming the flag: a
// closed one, and an empty file (whose page would fault on the first load).
TEST(RankLeaseTest, AttachingSomethingElseFails) {
  auto lease = RankLease::Attach(999);
  ASSERT_FALSE(lease.ok());
  EXPECT_NE(std::string(lease.status().message()).find("--lease_fd=999"), std::string::npos)
      << lease.status();
  FILE* empty = std::tmpfile();
  ASSERT_NE(empty, nullptr);
  lease = RankLease::Attach(fileno(empty));
  ASSERT_FALSE(lease.ok());
  EXPECT_NE(std::string(lease.status().message()).find("is not a lease page"), std::string::npos)
      << lease.status();
  std::fclose(empty);
}

}  // namespace
}  // namespace plateau
