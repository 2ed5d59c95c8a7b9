// The Gloo communicator across real processes on loopback: the test starts P
// copies of its own binary as ranks (an environment variable names the
// rank), which rendezvous through a FileStore and run the conformance suite
// (kernels/comm_conformance.h), each checking its results against its own
// local computation and exiting non-zero on any mismatch. The parent only
// asserts that every rank exited 0, and kills them all if they overrun.
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/comm_conformance.h"
#include "kernels/communicator.h"
#include "kernels/cpu_stream.h"
#include "kernels/kv_store.h"

extern char** environ;

namespace plateau {
namespace {

constexpr char kRankEnv[] = "PLATEAU_COMM_TEST_RANK";
constexpr char kSizeEnv[] = "PLATEAU_COMM_TEST_SIZE";
constexpr char kDirEnv[] = "PLATEAU_COMM_TEST_STORE";
constexpr char kParentEnv[] = "PLATEAU_COMM_TEST_PARENT";
// For the harness's own tests: a rank's seed, small counts only, a
// collective timeout in ms, or a rank that exits at once / hangs.
constexpr char kSeedEnv[] = "PLATEAU_COMM_TEST_SEED";
constexpr char kSmallEnv[] = "PLATEAU_COMM_TEST_SMALL";
constexpr char kTimeoutEnv[] = "PLATEAU_COMM_TEST_TIMEOUT_MS";
constexpr char kExitEnv[] = "PLATEAU_COMM_TEST_EXIT_AT_ONCE";
constexpr char kHangEnv[] = "PLATEAU_COMM_TEST_HANG";

// How long a rank may take, all collectives included, before the parent
// kills every rank; each collective's own timeout is shorter.
constexpr absl::Duration kRankDeadline = absl::Seconds(90);
constexpr absl::Duration kCollectiveTimeout = absl::Seconds(30);

int GetEnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  int out;
  return (v != nullptr && absl::SimpleAtoi(v, &out)) ? out : fallback;
}

// --- The rank (child) ------------------------------------------------------

int RankMain() {
  const int rank = GetEnvInt(kRankEnv, -1);
  const int size = GetEnvInt(kSizeEnv, -1);
  const char* dir = std::getenv(kDirEnv);
  const std::string who = absl::StrCat("rank ", rank, "/", size, " (pid ",
                                       ::getpid(), "): ");
  // Die with the parent, so a killed test leaves no rank behind.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != GetEnvInt(kParentEnv, -1)) return 3;
  if (dir == nullptr || rank < 0 || size < 1) {
    std::cerr << who << "bad environment\n";
    return 2;
  }
  if (GetEnvInt(kExitEnv, 0) != 0) return 0;
  if (GetEnvInt(kHangEnv, 0) != 0) {
    for (;;) ::pause();
  }
  auto store = FileStore::Create(dir);
  if (!store.ok()) {
    std::cerr << who << store.status() << "\n";
    return 2;
  }
  CommunicatorOptions options;
  options.backend = BackendKind::kCpu;
  options.rank = rank;
  options.size = size;
  options.store = std::shared_ptr<KeyValueStore>(std::move(store).value());
  options.prefix = "multiprocess/attempt0";
  options.hostname = "127.0.0.1";
  options.timeout = absl::Milliseconds(GetEnvInt(
      kTimeoutEnv, absl::ToInt64Milliseconds(kCollectiveTimeout)));
  CpuStream stream("comm");
  auto comm = CreateCommunicator(options);
  if (!comm.ok()) {
    std::cerr << who << comm.status() << "\n";
    return 2;
  }
  conformance::HostMemory memory;
  conformance::ConformanceOptions suite;
  suite.seed = GetEnvInt(kSeedEnv, 11);
  suite.large = GetEnvInt(kSmallEnv, 0) == 0;
  const std::vector<std::string> failures =
      conformance::RunConformance(**comm, stream, memory, suite);
  constexpr size_t kShown = 10;
  for (size_t i = 0; i < failures.size() && i < kShown; ++i) {
    std::cerr << who << failures[i] << "\n";
  }
  if (failures.size() > kShown) {
    std::cerr << who << "... and " << failures.size() - kShown
              << " more failed checks\n";
  }
  if (!failures.empty()) return 1;
  std::cerr << who << "all collectives matched\n";
  return 0;
}

// --- The parent --------------------------------------------------------------

std::string SelfPath() {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  buf[n] = '\0';
  return buf;
}

struct Child {
  int rank;
  pid_t pid;
  bool done = false;
  bool killed = false;
  int status = 0;
};

// Starts `size` ranks (rank r with the extra environment extra(r)) and waits
// up to `deadline` for them; returns one line per rank that did not exit 0
// (empty when all passed).
std::vector<std::string> RunRanks(
    int size,
    const std::function<std::vector<std::string>(int)>& extra =
        [](int) { return std::vector<std::string>{}; },
    absl::Duration deadline_after = kRankDeadline) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp",
                                       "/comm_mp_", size, "_", ::getpid());
  std::filesystem::remove_all(dir);
  const std::string self = SelfPath();
  std::vector<std::string> problems;
  if (self.empty()) return {"cannot read /proc/self/exe"};

  std::vector<Child> children;
  for (int r = 0; r < size; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.push_back(*e);
    env.push_back(absl::StrCat(kRankEnv, "=", r));
    env.push_back(absl::StrCat(kSizeEnv, "=", size));
    env.push_back(absl::StrCat(kDirEnv, "=", dir));
    env.push_back(absl::StrCat(kParentEnv, "=", ::getpid()));
    for (std::string& e : extra(r)) env.push_back(std::move(e));
    std::vector<char*> envp;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string arg0 = self;
    char* argv[] = {arg0.data(), nullptr};
    pid_t pid;
    int err = ::posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv,
                            envp.data());
    if (err != 0) {
      problems.push_back(absl::StrCat("spawning rank ", r, ": ",
                                      std::strerror(err)));
      break;
    }
    children.push_back({r, pid});
  }

  // Reap until every rank has exited or the deadline passes; then kill the
  // rest, so nothing hangs and nothing is left behind.
  const absl::Time deadline = absl::Now() + deadline_after;
  size_t running = children.size();
  while (running > 0 && absl::Now() < deadline) {
    for (Child& c : children) {
      if (c.done) continue;
      pid_t got = ::waitpid(c.pid, &c.status, WNOHANG);
      if (got == c.pid) {
        c.done = true;
        --running;
      }
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  for (Child& c : children) {
    if (c.done) continue;
    ::kill(c.pid, SIGKILL);
    ::waitpid(c.pid, &c.status, 0);
    c.done = true;
    c.killed = true;
    problems.push_back(absl::StrCat("rank ", c.rank, " (pid ", c.pid,
                                    ") still running after ",
                                    absl::FormatDuration(deadline_after),
                                    "; killed"));
  }
  for (const Child& c : children) {
    if (c.killed) continue;  // reported above
    if (WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0) continue;
    if (WIFEXITED(c.status)) {
      problems.push_back(absl::StrCat("rank ", c.rank, " exited with ",
                                      WEXITSTATUS(c.status),
                                      " (its stderr is above)"));
    } else if (WIFSIGNALED(c.status)) {
      problems.push_back(absl::StrCat("rank ", c.rank, " died of signal ",
                                      WTERMSIG(c.status)));
    }
  }
  if (static_cast<int>(children.size()) != size && problems.empty()) {
    problems.push_back("not every rank was started");
  }
  return problems;
}

TEST(CommMultiprocessTest, TwoRanks) {
  for (const std::string& p : RunRanks(2)) ADD_FAILURE() << p;
}

TEST(CommMultiprocessTest, FourRanks) {
  for (const std::string& p : RunRanks(4)) ADD_FAILURE() << p;
}

// --- The harness itself: failures are reported, never hidden or hung -------

// Rank 1 uses other inputs than rank 0 expects (and vice versa): both ranks'
// checks must catch it and exit 1.
TEST(CommMultiprocessTest, MismatchedResultsFailTheRanks) {
  auto problems = RunRanks(2, [](int r) {
    return std::vector<std::string>{absl::StrCat(kSeedEnv, "=", 20 + r),
                                    absl::StrCat(kSmallEnv, "=1")};
  });
  EXPECT_THAT(problems, ::testing::UnorderedElementsAre(
                            ::testing::HasSubstr("rank 0 exited with 1"),
                            ::testing::HasSubstr("rank 1 exited with 1")));
}

// Rank 1 exits before the rendezvous: rank 0 times out (exit 2), no hang.
TEST(CommMultiprocessTest, AMissingRankTimesOutTheOthers) {
  const absl::Time start = absl::Now();
  auto problems = RunRanks(2, [](int r) {
    std::vector<std::string> env = {absl::StrCat(kTimeoutEnv, "=500")};
    if (r == 1) env.push_back(absl::StrCat(kExitEnv, "=1"));
    return env;
  });
  EXPECT_THAT(problems, ::testing::ElementsAre(
                            ::testing::HasSubstr("rank 0 exited with 2")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

// A rank that hangs is killed at the deadline and reported.
TEST(CommMultiprocessTest, AHangingRankIsKilled) {
  const absl::Time start = absl::Now();
  auto problems = RunRanks(
      1, [](int) { return std::vector<std::string>{absl::StrCat(kHangEnv, "=1")}; },
      absl::Milliseconds(500));
  EXPECT_THAT(problems,
              ::testing::ElementsAre(::testing::AllOf(
                  ::testing::HasSubstr("rank 0 (pid"),
                  ::testing::HasSubstr("still running after 500ms; killed"))));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

}  // namespace
}  // namespace plateau

int main(int argc, char** argv) {
  if (std::getenv(plateau::kRankEnv) != nullptr) return plateau::RankMain();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
