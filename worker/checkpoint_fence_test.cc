#include "worker/checkpoint_fence.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

std::string Dir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string d = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/fence-", getpid(), "-", name);
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void Put(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// What the trainer does: write aside, commit.
absl::Status Save(const std::string& dir, const std::string& job, int attempt, int step, const std::string& text) {
  const std::string partial = PartialCheckpointPath(dir, job, attempt, step);
  Put(partial, text);
  return CommitCheckpoint(dir, job, attempt, partial, absl::StrCat(dir, "/step-", step, ".safetensors"));
}

TEST(CheckpointFenceTest, AStaleAttemptCanNeverReplaceTheNewAttemptsCheckpoint) {
  const std::string dir = Dir("stale");
  const std::string step10 = dir + "/step-10.safetensors";
  ASSERT_TRUE(ClaimCheckpointDir(dir, "job-3", 0).ok());
  ASSERT_TRUE(Save(dir, "job-3", 0, 10, "attempt 0").ok());
  EXPECT_EQ(Read(step10), "attempt 0");

  // Attempt 1 starts (its worker was declared lost: attempt 0 may still run).
  ASSERT_TRUE(ClaimCheckpointDir(dir, "job-3", 1).ok());
  ASSERT_TRUE(Save(dir, "job-3", 1, 10, "attempt 1").ok());
  // Attempt 0's late write of the same step is refused and leaves nothing.
  absl::Status late = Save(dir, "job-3", 0, 10, "attempt 0, late");
  EXPECT_EQ(late.code(), absl::StatusCode::kAborted) << late;
  EXPECT_THAT(late.message(), HasSubstr("job-3 attempt 1"));
  EXPECT_EQ(Read(step10), "attempt 1");
  EXPECT_FALSE(std::filesystem::exists(PartialCheckpointPath(dir, "job-3", 0, 10)));
  // Nor can it write a step the new attempt has not reached.
  EXPECT_EQ(Save(dir, "job-3", 0, 20, "attempt 0").code(), absl::StatusCode::kAborted);
  EXPECT_FALSE(std::filesystem::exists(dir + "/step-20.safetensors"));
  // Nor claim the directory back (a rank of attempt 0 starting late).
  absl::Status claim = ClaimCheckpointDir(dir, "job-3", 0);
  EXPECT_EQ(claim.code(), absl::StatusCode::kAborted) << claim;
  auto fence = ReadCheckpointFence(dir);
  ASSERT_TRUE(fence.ok()) << fence.status();
  EXPECT_EQ(fence->job, "job-3");
  EXPECT_EQ(fence->attempt, 1);
  // The holder's own claims repeat (every rank claims).
  EXPECT_TRUE(ClaimCheckpointDir(dir, "job-3", 1).ok());
}

TEST(CheckpointFenceTest, AClaimRemovesOlderAttemptsPartialFiles) {
  const std::string dir = Dir("partials");
  ASSERT_TRUE(ClaimCheckpointDir(dir, "job-1", 0).ok());
  Put(PartialCheckpointPath(dir, "job-1", 0, 30), "torn");  // attempt 0 was cut off mid-write
  ASSERT_TRUE(ClaimCheckpointDir(dir, "job-1", 1).ok());
  EXPECT_FALSE(std::filesystem::exists(PartialCheckpointPath(dir, "job-1", 0, 30)));
}

// Two jobs on one directory, both at attempt 0: the refused job's commit
// removed the other's partial file of the same name (then the other's
// commit failed), or renamed it under the other's step. Each writes a name
// of its own, and the new holder's claim removes the old one's partials.
TEST(CheckpointFenceTest, TwoJobsAtTheSameAttemptNeverTouchEachOthersPartialFile) {
  const std::string dir = Dir("two_jobs");
  ASSERT_TRUE(ClaimCheckpointDir(dir, "job-1", 0).ok());
  Put(PartialCheckpointPath(dir, "job-1", 0, 7), "job-1, cut off");
  ASSERT_TRUE(ClaimCheckpointDir(dir, "job-2", 0).ok());
  EXPECT_FALSE(std::filesystem::exists(PartialCheckpointPath(dir, "job-1", 0, 7)));
  const std::string partial = PartialCheckpointPath(dir, "job-2", 0, 5);
  EXPECT_NE(partial, PartialCheckpointPath(dir, "job-1", 0, 5));
  Put(partial, "job-2's");
  // job-1 still runs and commits the same step: refused, and only its own
  // file goes.
  EXPECT_EQ(Save(dir, "job-1", 0, 5, "job-1's").code(), absl::StatusCode::kAborted);
  EXPECT_EQ(Read(partial), "job-2's");
  EXPECT_TRUE(CommitCheckpoint(dir, "job-2", 0, partial, dir + "/step-5.safetensors").ok());
  EXPECT_EQ(Read(dir + "/step-5.safetensors"), "job-2's");
}

TEST(CheckpointFenceTest, AJobThatIsNoFileNamePartIsRefused) {
  const std::string dir = Dir("bad_job");
  for (const std::string job : {"", "a/b", "..", "job 1", "job\n"}) {
    EXPECT_EQ(ClaimCheckpointDir(dir, job, 0).code(), absl::StatusCode::kInvalidArgument) << job;
  }
  EXPECT_TRUE(ClaimCheckpointDir(dir, "job-12_a.b", 0).ok());
}

TEST(CheckpointFenceTest, AnotherJobTakesTheDirectoryOver) {
  // A new job reusing a directory resumes from it; the old job's writes stop.
  const std::string dir = Dir("takeover");
  ASSERT_TRUE(ClaimCheckpointDir(dir, "job-1", 2).ok());
  ASSERT_TRUE(ClaimCheckpointDir(dir, "job-2", 0).ok());
  EXPECT_EQ(Save(dir, "job-1", 2, 5, "old job").code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(Save(dir, "job-2", 0, 5, "new job").ok());
}

TEST(CheckpointFenceTest, ACorruptFenceIsAnErrorNotAnOpenDoor) {
  const std::string dir = Dir("corrupt");
  Put(dir + "/.plateau-fence", "garbage");
  EXPECT_EQ(ClaimCheckpointDir(dir, "job-1", 0).code(), absl::StatusCode::kDataLoss);
}

TEST(CheckpointFenceTest, NoCommitOfAnotherProcessLandsAfterTheClaimReturns) {
  // Another process (the old attempt's rank 0) commits as fast as it can
  // while this one claims: the lock makes check-and-rename atomic against
  // the claim, so the file never changes after ClaimCheckpointDir returns.
  const std::string dir = Dir("race");
  ASSERT_TRUE(ClaimCheckpointDir(dir, "job-7", 0).ok());
  ASSERT_TRUE(Save(dir, "job-7", 0, 1, "attempt 0 write 0").ok());
  // The child says when it has committed once, then commits on.
  int committed[2];
  ASSERT_EQ(pipe(committed), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(committed[0]);
    for (int i = 1;; ++i) {
      if (!Save(dir, "job-7", 0, 1, absl::StrCat("attempt 0 write ", i)).ok()) _exit(i > 1 ? 0 : 2);
      if (i == 1 && write(committed[1], "c", 1) != 1) _exit(3);
    }
  }
  close(committed[1]);
  char byte = 0;
  EXPECT_EQ(read(committed[0], &byte, 1), 1) << "the other process never committed";
  close(committed[0]);
  ASSERT_TRUE(ClaimCheckpointDir(dir, "job-7", 1).ok());
  const std::string at_claim = Read(dir + "/step-1.safetensors");
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the other process never committed before the claim";
  EXPECT_EQ(Read(dir + "/step-1.safetensors"), at_claim);
  EXPECT_THAT(at_claim, HasSubstr("attempt 0 write "));
}

// A process that holds the fence's lock and never lets go (a rank frozen by
// its agent in the middle of a commit) makes a claim fail UNAVAILABLE after
// its wait, naming the directory, instead of hanging the new attempt.
TEST(CheckpointFenceTest, AFenceHeldByAStoppedProcessFailsTheClaimAfterItsWait) {
  const std::string dir = Dir("held");
  ASSERT_TRUE(ClaimCheckpointDir(dir, "job-7", 0).ok());
  int locked[2];
  ASSERT_EQ(pipe(locked), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(locked[0]);
    const int fd = open((dir + "/.plateau-fence").c_str(), O_RDWR | O_CLOEXEC);
    struct flock lk = {};
    lk.l_type = F_WRLCK;
    lk.l_whence = SEEK_SET;
    if (fd < 0 || fcntl(fd, F_OFD_SETLK, &lk) != 0) _exit(2);
    if (write(locked[1], "l", 1) != 1) _exit(3);
    raise(SIGSTOP);
    _exit(0);
  }
  close(locked[1]);
  char byte = 0;
  ASSERT_EQ(read(locked[0], &byte, 1), 1) << "the other process never took the lock";
  close(locked[0]);
  const absl::Time t0 = absl::Now();
  const absl::Status claim = ClaimCheckpointDir(dir, "job-7", 1, absl::Milliseconds(300));
  const absl::Duration took = absl::Now() - t0;
  EXPECT_EQ(claim.code(), absl::StatusCode::kUnavailable) << claim;
  EXPECT_THAT(claim.message(), HasSubstr("checkpoint.directory=" + dir +
                                         ": its fence (.plateau-fence) has been "
                                         "locked by another process for 300ms"));
  EXPECT_GE(took, absl::Milliseconds(300));
  EXPECT_LT(took, absl::Seconds(5));
  // Once it is gone, the claim goes through.
  kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(ClaimCheckpointDir(dir, "job-7", 1, absl::Milliseconds(300)).ok());
  EXPECT_EQ(ReadCheckpointFence(dir)->attempt, 1);
}

}  // namespace
}  // namespace plateau
