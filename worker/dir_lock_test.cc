#include "worker/dir_lock.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

extern char** environ;

namespace plateau {
namespace {

using ::testing::HasSubstr;

std::string FreshDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir =
      absl::StrCat(tmp ? tmp : absl::StrCat("/tmp/dir-lock-", getpid()), "/", name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

TEST(DirLockTest, ASecondHolderIsRefusedNamingTheDirectoryAndTheHolder) {
  const std::string dir = FreshDir("second");
  auto first = DirLock::Acquire(dir, "--state_dir", "coordinator", "stop it first");
  ASSERT_TRUE(first.ok()) << first.status();
  // flock locks belong to the open file: a second open in this process
  // conflicts as another process's would.
  auto second = DirLock::Acquire(dir, "--state_dir", "coordinator", "stop it first");
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(second.status().message(),
            absl::StrCat("--state_dir=", dir, ": in use by another coordinator (pid ", getpid(),
                         ", ", dir, "/.lock): stop it first"));
  first->reset();
  EXPECT_TRUE(DirLock::Acquire(dir, "--state_dir", "coordinator", "").ok())
      << "released with its holder";
}

TEST(DirLockTest, AProcessSpawnedByTheHolderDoesNotKeepTheLock) {
  const std::string dir = FreshDir("spawned");
  auto held = DirLock::Acquire(dir, "--work_dir", "worker agent", "");
  ASSERT_TRUE(held.ok()) << held.status();
  pid_t child = 0;
  char sleep_path[] = "/bin/sleep";
  char seconds[] = "30";
  char* argv[] = {sleep_path, seconds, nullptr};
  ASSERT_EQ(posix_spawn(&child, sleep_path, nullptr, nullptr, argv, environ), 0);
  held->reset();
  // The child still runs; the lock went with its holder.
  auto again = DirLock::Acquire(dir, "--work_dir", "worker agent", "");
  EXPECT_TRUE(again.ok()) << again.status();
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
}

TEST(DirLockTest, AMissingDirectoryIsAnErrorNamingTheFile) {
  const std::string dir = FreshDir("missing") + "/not-there";
  auto lock = DirLock::Acquire(dir, "--state_dir", "coordinator", "");
  ASSERT_FALSE(lock.ok());
  EXPECT_THAT(std::string(lock.status().message()),
              HasSubstr(absl::StrCat("--state_dir=", dir, ": cannot open ", dir, "/.lock: ")));
}

}  // namespace
}  // namespace plateau
