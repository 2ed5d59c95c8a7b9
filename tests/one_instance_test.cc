// One process per role where two would silently split the service: a
// second coordinator on a running one's --state_dir or --listen port, and a
// second worker agent on a running one's --work_dir, are refused at start
// (exit 2, naming the flag, the directory or address, and the holder), as
// are addresses that gRPC would take modulo 65536 and a --rank_address the
// ranks could not listen on. Real processes: a running cluster, and the
// binaries started beside it. Also what a worker checks at start beside
// them: its GPUs' memory, and its ranks' parent.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;
using namespace testing_cluster;  // NOLINT: the harness is this file's vocabulary

TEST(OneInstanceTest, ASecondCoordinatorOnTheSameStateOrPortIsRefused) {
  Cluster c("one-coordinator");
  ASSERT_TRUE(c.ready()) << c.Logs();
  const std::string state = c.dir() + "/state";
  Ran r = RunCommand({"server/plateau_coordinator", "--state_dir=" + state, "--listen=127.0.0.1:0",
                      "--metrics_address=127.0.0.1:0"},
                     c.dir() + "/second-state");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err,
              HasSubstr(absl::StrCat("--state_dir=", state, ": in use by another coordinator (pid ",
                                     c.coordinator()->pid(), ", ", state, "/.lock)")));
  // gRPC's default SO_REUSEPORT would let it bind beside the first, and the
  // kernel would split clients and heartbeats between the two.
  r = RunCommand({"server/plateau_coordinator", "--state_dir=" + c.dir() + "/other-state",
                  "--listen=" + c.api(), "--metrics_address=127.0.0.1:0"},
                 c.dir() + "/second-port");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("--listen=" + c.api() + ": cannot listen there (in use"));
  // Found before anything is created, and before gRPC logs its own lines
  // about it (chttp2_server.cc ... errno:98) ahead of ours.
  EXPECT_FALSE(absl::StrContains(r.err, "chttp2_server")) << r.err;
  EXPECT_FALSE(std::filesystem::exists(c.dir() + "/other-state")) << "created for a coordinator that did not start";
  // The same state and the same port (a coordinator started twice): the
  // holder's pid is named, not only the port.
  r = RunCommand(
      {"server/plateau_coordinator", "--state_dir=" + state, "--listen=" + c.api(), "--metrics_address=127.0.0.1:0"},
      c.dir() + "/second-both");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("in use by another coordinator (pid ", c.coordinator()->pid())));
  r = RunCommand({"server/plateau_coordinator", "--state_dir=" + c.dir() + "/wrapped",
                  "--listen=127.0.0.1:99999", "--metrics_address=127.0.0.1:0"},
                 c.dir() + "/wrapped");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(
      r.err,
      HasSubstr(
          "--listen=127.0.0.1:99999: expected HOST:PORT (or [IPV6]:PORT) with a port 0-65535"));
  // The first one still serves, alone.
  auto list = c.client().ListJobs(v1::ListJobsRequest());
  EXPECT_TRUE(list.ok()) << list.status();
  EXPECT_TRUE(c.coordinator()->Running());
}

// An agent of cluster `c` with `flags` besides (no calibration: quick).
std::vector<std::string> AgentArgs(Cluster& c, std::vector<std::string> flags) {
  std::vector<std::string> args = {"worker/plateau_worker", "--coordinator=" + c.api(),
                                   "--rank_binary=worker/plateau_rank", "--calibrate=false"};
  args.insert(args.end(), flags.begin(), flags.end());
  return args;
}

TEST(OneInstanceTest, ASecondAgentOnTheSameWorkDirAndBadAddressesAreRefused) {
  Cluster c("one-agent");
  ASSERT_TRUE(c.ready()) << c.Logs();
  ASSERT_TRUE(WaitFor([&] {
    return absl::StrContains(c.worker()->out(), "registered as worker-1");
  })) << c.Logs();
  const std::string work = c.dir() + "/work-0";
  auto with = [&](std::vector<std::string> flags) { return AgentArgs(c, std::move(flags)); };
  Ran r = RunCommand(with({"--work_dir=" + work}), c.dir() + "/second-agent");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("--work_dir=", work, ": in use by another worker agent (pid ",
                                            c.worker()->pid(), ", ", work, "/.lock)")));
  r = RunCommand(
      with({"--work_dir=" + c.dir() + "/unresolvable", "--rank_address=no-such-host.invalid"}),
      c.dir() + "/unresolvable");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("--rank_address=no-such-host.invalid: cannot resolve it"));
  // 192.0.2.1 (TEST-NET-1) is no interface's address here.
  r = RunCommand(with({"--work_dir=" + c.dir() + "/foreign", "--rank_address=192.0.2.1"}),
                 c.dir() + "/foreign");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("--rank_address=192.0.2.1: not an address of this host"));
  r = RunCommand({"worker/plateau_worker", "--coordinator=127.0.0.1:99553",
                  "--work_dir=" + c.dir() + "/wrapped", "--rank_binary=worker/plateau_rank",
                  "--calibrate=false"},
                 c.dir() + "/wrapped-agent");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("--coordinator=127.0.0.1:99553: expected HOST:PORT"));
  r = RunCommand({"client/plateauctl", "--coordinator=127.0.0.1:99553", "list"},
                 c.dir() + "/wrapped-ctl");
  EXPECT_NE(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("--coordinator=127.0.0.1:99553: expected HOST:PORT"));
  // The first agent is still the only worker.
  auto workers = c.client().ListWorkers();
  ASSERT_TRUE(workers.ok()) << workers.status();
  EXPECT_EQ(workers->workers_size(), 1);
}

TEST(OneInstanceTest, AnAgentsWorkDirIsItsOwn) {
  ClusterOptions o;
  o.with_worker = false;
  Cluster c("own-work-dir", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto with = [&](std::vector<std::string> flags) { return AgentArgs(c, std::move(flags)); };
  Ran r;
  // A link, or another user's directory (a predictable /tmp name made by
  // someone else first): refused before anything is written there (the
  // agent's job specs are what its ranks run). One of the agent's own that
  // others can write (umask 002, an emptyDir's 0777) is closed, said once.
  const std::string open_dir = c.dir() + "/world-writable";
  std::filesystem::create_directories(open_dir);
  std::filesystem::permissions(open_dir, std::filesystem::perms::all);
  Process* opened = c.StartWorker({"--work_dir=" + open_dir});
  EXPECT_TRUE(WaitFor([&] { return absl::StrContains(opened->out(), "registered as worker-") || !opened->Running(); }))
      << c.Logs();
  EXPECT_THAT(opened->out(),
              HasSubstr("--work_dir=" + open_dir + " was writable by group or others (mode 0777): now 0755"));
  EXPECT_EQ(std::filesystem::status(open_dir).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_all | std::filesystem::perms::group_read |
                std::filesystem::perms::group_exec | std::filesystem::perms::others_read |
                std::filesystem::perms::others_exec);
  opened->Stop();
  const std::string link = c.dir() + "/linked-work";
  std::filesystem::create_directories(c.dir() + "/link-target");
  std::filesystem::create_directory_symlink(c.dir() + "/link-target", link);
  r = RunCommand(with({"--work_dir=" + link}), c.dir() + "/linked-agent");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("--work_dir=" + link + ": is a symbolic link"));
  // Only root can give a directory away, and not inside a user namespace
  // (bazel's sandbox maps no other uid): said where it cannot run.
  const std::string theirs = c.dir() + "/someone-elses";
  std::filesystem::create_directories(theirs);
  if (chown(theirs.c_str(), 65534, 65534) != 0) {
    std::printf("not run here: another user's work dir (chown to 65534: %s)\n", strerror(errno));
  } else {
    r = RunCommand(with({"--work_dir=" + theirs}), c.dir() + "/someone-elses-agent");
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr("--work_dir=" + theirs + ": owned by uid 65534, not this agent's (0)"));
  }
}

// An agent stopped while it still retries its first registration (the
// coordinator never answered) says so and exits 0: it sends no heartbeat,
// whose "failing" line read as if it had once been registered.
TEST(OneInstanceTest, AnAgentStoppedBeforeItRegisteredSaysSoAndSendsNoHeartbeat) {
  const std::string dir = TempDir("never_registered");
  const RefusedAddress refused;
  ASSERT_FALSE(refused.address().empty());
  Process agent({"worker/plateau_worker", "--coordinator=" + refused.address(), "--work_dir=" + dir + "/work",
                 "--rank_binary=worker/plateau_rank", "--calibrate=false"},
                dir + "/agent");
  ASSERT_TRUE(agent.spawn_error().empty()) << agent.spawn_error();
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (!absl::StrContains(agent.err(), "cannot register") && agent.Running() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_THAT(agent.err(), HasSubstr("cannot register with the coordinator at " + refused.address()));
  const int status = agent.Stop(SIGTERM);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << agent.err();
  EXPECT_THAT(agent.err(), HasSubstr("stopped before it registered with the coordinator at " + refused.address()));
  EXPECT_THAT(agent.err(), ::testing::Not(HasSubstr("heartbeat"))) << agent.err();
}

// A slot count the coordinator would refuse at registration (as
// capabilities.devices) is refused at start, naming the flag.
TEST(OneInstanceTest, ASlotCountPastTheCoordinatorsLimitNamesTheFlag) {
  const std::string dir = TempDir("devices");
  Ran r = RunCommand(
      {"worker/plateau_worker", "--coordinator=127.0.0.1:1", "--devices=100000000",
       "--work_dir=" + dir + "/work", "--rank_binary=worker/plateau_rank", "--calibrate=false"},
      dir + "/agent");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("--devices: expected an integer from 1 to 4096, got '100000000'"));
}

// A CUDA worker's `auto` device memory is read from its GPUs at start; one
// that cannot read them (here: no CUDA in this build, or fewer GPUs than
// slots) says so and how to go on, rather than offering a made-up size.
TEST(OneInstanceTest, ACudaWorkerThatCannotReadItsGpusSaysSoAtStart) {
  const std::string dir = TempDir("cuda_auto");
  Ran r = RunCommand({"worker/plateau_worker", "--coordinator=127.0.0.1:1", "--backend=cuda", "--devices=4096",
                      "--work_dir=" + dir + "/work", "--rank_binary=worker/plateau_rank", "--calibrate=false"},
                     dir + "/agent");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("--device_memory_bytes=auto: cannot read the"));
  EXPECT_THAT(r.err, HasSubstr("give --devices at most the GPUs this worker may use, or --device_memory_bytes as "
                               "a number"));
}

// An agent that fails to start leaves no temporary work dir behind (the
// default --work_dir, made with mkdtemp under $TMPDIR): not after the GPUs'
// memory could not be read, nor after the coordinator's CA could not.
TEST(OneInstanceTest, AFailedStartLeavesNoTemporaryWorkDir) {
  const std::string dir = TempDir("failed_start");
  const std::string tmp = dir + "/tmp";
  std::filesystem::create_directories(tmp);
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"--backend=cuda", "--devices=4096"},
        std::vector<std::string>{"--backend=cpu", "--tls_ca_file=" + dir + "/no-such-ca.pem"}}) {
    std::vector<std::string> args = {"/usr/bin/env",
                                     "TMPDIR=" + tmp,
                                     "worker/plateau_worker",
                                     "--coordinator=127.0.0.1:1",
                                     "--rank_binary=worker/plateau_rank",
                                     "--calibrate=false"};
    args.insert(args.end(), flags.begin(), flags.end());
    Ran r = RunCommand(args, dir + "/agent");
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_TRUE(std::filesystem::is_empty(tmp))
        << flags[0] << " " << flags[1] << ": left " << std::filesystem::directory_iterator(tmp)->path();
  }
}

// A rank trusts the pid its agent said (PLATEAU_AGENT_PID), not pid 1: in a
// container the agent is often pid 1 itself, and every rank and
// calibration of it exited at once, as if orphaned. Here this test is the
// rank's parent (env execs in place).
TEST(OneInstanceTest, ARankChecksItsParentByTheAgentsPid) {
  const std::string dir = TempDir("agent_pid");
  // Its parent is the agent: on to the command line, which lacks --rank.
  Ran r =
      RunCommand({"/usr/bin/env", absl::StrCat("PLATEAU_AGENT_PID=", getpid()), "worker/plateau_rank"}, dir + "/mine");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("--rank, --coordinator, --spec_file and --kv_prefix are required"));
  // Its parent is not the agent that started it: that agent died and this
  // process took the orphan; it stops before doing anything.
  r = RunCommand({"/usr/bin/env", absl::StrCat("PLATEAU_AGENT_PID=", getpid() + 1), "worker/plateau_rank"},
                 dir + "/other");
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("plateau_rank: my parent is pid ", getpid(),
                                            ", not the agent that started me (pid ", getpid() + 1, ")")));
}

// The agent as pid 1 of its own pid namespace, as in a container whose
// first process it is: it calibrates and runs a job to the end. (Before,
// each plateau_rank it started saw parent pid 1 and exited: no
// calibration, and every job's ranks failed at once.)
TEST(OneInstanceTest, AnAgentThatIsPidOneRunsItsRanks) {
  // As root (CI) a pid namespace needs nothing more; elsewhere a user
  // namespace may allow one.
  const std::string probe_dir = TempDir("unshare");
  std::vector<std::string> unshare = {"/usr/bin/unshare", "--pid", "--fork"};
  Ran can = RunCommand({unshare[0], unshare[1], unshare[2], "/bin/true"}, probe_dir + "/root");
  if (can.code != 0) {
    unshare = {"/usr/bin/unshare", "--user", "--map-root-user", "--pid", "--fork"};
    can = RunCommand({unshare[0], unshare[1], unshare[2], unshare[3], unshare[4], "/bin/true"}, probe_dir + "/user");
  }
  if (can.code != 0) GTEST_SKIP() << "no pid namespace here (unshare --pid: " << can.err << ")";
  ClusterOptions options;
  options.with_worker = false;
  Cluster c("pid_one", options);
  ASSERT_TRUE(c.ready()) << c.Logs();
  Process* w = c.StartWorker({"--calibrate=true"}, [&unshare](const std::vector<std::string>& args) {
    std::vector<std::string> wrapped = unshare;
    wrapped.insert(wrapped.end(), args.begin(), args.end());
    return wrapped;
  });
  auto sub = c.client().SubmitJob(TinyJob(3), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const v1::Job job = c.WaitDone(sub->job().id());
  EXPECT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString() << c.Logs();
  EXPECT_THAT(w->out(), HasSubstr("plateau_worker: calibration ")) << w->out() << w->err();
  EXPECT_THAT(w->err(), ::testing::Not(HasSubstr("no calibration"))) << w->err();
}

}  // namespace
}  // namespace plateau
