// One job across worker agents on different hosts, for real: each agent
// (and the ranks it spawns) in a network namespace of its own with its own
// address (tests/netns.h), the coordinator on a link of the test's own
// namespace. The ranks' Gloo collectives cross the namespaces.
//
//  - The job's losses across two hosts equal, to the bit, the same job's on
//    one host: the ranks, their data and the collectives' algorithms are the
//    same (the reduce-scatter and all-reduce of DESIGN.md add the same
//    numbers in the same order); only the transport under Gloo differs, and
//    it moves bytes unchanged. So the tolerance is zero.
//  - A partition (the link of the host of rank 0, which writes the
//    checkpoints, goes down; no process is killed): the agent's lease lapses
//    and its ranks freeze before the coordinator declares the worker lost;
//    the job restarts from its checkpoint on the two other hosts; the old
//    attempt writes no checkpoint after the new one claimed the directory;
//    when the link returns, the agent is told its attempt is void and its
//    ranks are killed (docs/SERVICE.md "Partitions and fencing").
//
// Needs CAP_NET_ADMIN (root, as CI runs): skipped, saying so, without it.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster.h"
#include "tests/netns.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;
using namespace testing_cluster;  // NOLINT: the harness is this file's vocabulary

// step -> loss rank 0 reported in `attempt`.
std::map<int64_t, double> Losses(const std::vector<v1::JobEvent>& events, int attempt) {
  std::map<int64_t, double> out;
  for (const v1::JobEvent& e : events) {
    // One event per step of the whole job (the global batch's loss).
    if (e.has_job_step() && e.job_step().attempt() == attempt) out[e.job_step().step()] = e.job_step().loss();
  }
  return out;
}

absl::Time TimeOf(const google::protobuf::Timestamp& t) {
  return absl::FromUnixSeconds(t.seconds()) + absl::Nanoseconds(t.nanos());
}

// Established TCP connections seen from inside the namespace of `pid`, as
// "local remote" IPv4 pairs ("10.1.2.11:40000 10.1.2.12:38211").
std::vector<std::string> Connections(pid_t pid) {
  std::vector<std::string> out;
  auto addr = [](const std::string& hex) {
    std::vector<std::string> p = absl::StrSplit(hex, ':');
    unsigned ip = 0, port = 0;
    if (p.size() != 2 || !absl::SimpleHexAtoi(p[0], &ip) || !absl::SimpleHexAtoi(p[1], &port)) return std::string();
    return absl::StrCat(ip & 0xff, ".", (ip >> 8) & 0xff, ".", (ip >> 16) & 0xff, ".", ip >> 24, ":", port);
  };
  bool header = true;
  for (absl::string_view line : absl::StrSplit(ReadFile(absl::StrCat("/proc/", pid, "/net/tcp")), '\n')) {
    if (header) {
      header = false;
      continue;
    }
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.size() > 3 && f[3] == "01") out.push_back(absl::StrCat(addr(f[1]), " ", addr(f[2])));
  }
  return out;
}

// The worker id an agent registered as ("worker-2"), from its output.
std::string WorkerId(Process* agent) {
  const std::string out = agent->out();
  const size_t at = out.find("registered as ");
  if (at == std::string::npos) return "";
  const size_t start = at + 14;
  return out.substr(start, out.find(' ', start) - start);
}

// The network, or the reason there is none. Only a machine that may not
// make network namespaces (no CAP_NET_ADMIN: not root, or a container
// without it) skips the test (*skip); any other failure to build the
// network is the test's own and fails it (a missing `ip`: deploy/
// install-deps.sh installs it; a bad subnet or link).
std::unique_ptr<TestNetwork> MakeNetwork(int hosts, const std::string& name, std::string* why, bool* skip) {
  auto net = TestNetwork::Create(hosts, TempDir(name + "-net"));
  if (!net.ok()) {
    *skip = net.status().code() == absl::StatusCode::kPermissionDenied;
    *why = absl::StrCat("cannot make the test network (", net.status().ToString(), ")",
                        *skip ? "; this test needs root (CAP_NET_ADMIN), as CI has" : "");
    return nullptr;
  }
  return std::move(*net);
}

ClusterOptions OnNetwork(const TestNetwork& net) {
  ClusterOptions o;
  o.listen = net.hub_address() + ":0";
  o.with_worker = false;
  // No token on a network only this test's namespaces reach.
  o.coordinator_flags = {"--insecure_listen_any"};
  return o;
}

// Agent i in host i's namespace: its ranks listen on the host's address.
Process* StartAgent(Cluster& c, const TestNetwork& net, int i, int devices) {
  return c.StartWorker({absl::StrCat("--rank_address=", net.host_address(i)), absl::StrCat("--devices=", devices)},
                       [&net, i](const std::vector<std::string>& args) { return net.InHost(i, args); });
}

TEST(MultiNodeTest, LossesAcrossTwoHostsEqualOneHostsToTheBit) {
  std::string why;
  bool skip = false;
  auto net = MakeNetwork(3, "equal", &why, &skip);
  if (net == nullptr && skip) GTEST_SKIP() << why;
  ASSERT_NE(net, nullptr) << why;
  Cluster c("equal", OnNetwork(*net));
  ASSERT_TRUE(c.ready()) << c.Logs();
  // Hosts 0 and 1 have one slot each; host 2 has two, the only one a
  // one-node two-rank job fits.
  for (int i : {0, 1}) StartAgent(c, *net, i, 1);
  StartAgent(c, *net, 2, 2);
  ASSERT_TRUE(WaitFor([&] {
    for (int i = 0; i < 3; ++i) {
      if (WorkerId(c.worker(i)).empty()) return false;
    }
    return true;
  })) << c.Logs();
  // Long enough that the one-node job still holds host 2 when the
  // two-node job is placed.
  constexpr int64_t kSteps = 60;
  v1::JobSpec one = TinyJob(kSteps);
  one.mutable_layout()->set_nodes(1);
  v1::JobSpec two = TinyJob(kSteps);
  two.mutable_layout()->set_nodes(2);
  auto a = c.client().SubmitJob(one, false);
  ASSERT_TRUE(a.ok()) << a.status();
  // Running on host 2 (two slots), so that the two-node job can only take
  // hosts 0 and 1.
  ASSERT_TRUE(c.WaitStep(a->job().id(), 1)) << c.Logs();
  auto b = c.client().SubmitJob(two, false);
  ASSERT_TRUE(b.ok()) << b.status();
  const std::string id = b->job().id();
  ASSERT_TRUE(c.WaitStep(id, 1)) << c.Logs();

  auto placed = c.client().GetJob(id);
  ASSERT_TRUE(placed.ok()) << placed.status();
  ASSERT_EQ(placed->placement_size(), 2) << placed->DebugString();
  std::set<std::string> workers;
  for (const v1::Placement& p : placed->placement()) workers.insert(p.worker_id());
  EXPECT_EQ(workers, (std::set<std::string>{WorkerId(c.worker(0)), WorkerId(c.worker(1))}));
  // The collectives cross the namespaces: a rank's connections, seen from
  // inside its host, include one to the other host's address.
  const pid_t rank0 = c.RankPid(id, 0), rank1 = c.RankPid(id, 1);
  ASSERT_NE(rank0, 0);
  ASSERT_NE(rank1, 0);
  bool crossing = false;
  for (pid_t p : {rank0, rank1}) {
    for (const std::string& conn : Connections(p)) {
      const bool zero_one = absl::StrContains(conn, net->host_address(0) + ":") &&
                            absl::StrContains(conn, net->host_address(1) + ":");
      crossing = crossing || zero_one;
    }
  }
  EXPECT_TRUE(crossing) << "no TCP connection between " << net->host_address(0) << " and "
                        << net->host_address(1);

  ASSERT_EQ(c.WaitDone(a->job().id()).state(), v1::SUCCEEDED) << c.Logs();
  ASSERT_EQ(c.WaitDone(id).state(), v1::SUCCEEDED) << c.Logs();
  const std::map<int64_t, double> on_one = Losses(c.AllEvents(a->job().id()), 0);
  const std::map<int64_t, double> on_two = Losses(c.AllEvents(id), 0);
  ASSERT_EQ(on_one.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(on_two.size(), static_cast<size_t>(kSteps));
  for (int64_t s = 1; s <= kSteps; ++s) {
    ASSERT_GT(on_one.at(s), 0);
    EXPECT_EQ(on_one.at(s), on_two.at(s)) << "step " << s;  // bitwise
  }
  EXPECT_TRUE(c.RankPids(a->job().id()).empty());
  EXPECT_TRUE(c.RankPids(id).empty());
}

TEST(MultiNodeTest, APartitionedHostIsFencedAndTheJobRestartsOnTheOthers) {
  std::string why;
  bool skip = false;
  auto net = MakeNetwork(3, "partition", &why, &skip);
  if (net == nullptr && skip) GTEST_SKIP() << why;
  ASSERT_NE(net, nullptr) << why;
  ClusterOptions o = OnNetwork(*net);
  // Lease 3 s (3/4 of the worker timeout): frozen a second before lost.
  o.heartbeat_ms = 200;
  o.worker_timeout_s = 4;
  Cluster c("partition", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  for (int i = 0; i < 3; ++i) StartAgent(c, *net, i, 1);
  ASSERT_TRUE(WaitFor([&] {
    for (int i = 0; i < 3; ++i) {
      if (WorkerId(c.worker(i)).empty()) return false;
    }
    return true;
  })) << c.Logs();
  constexpr int64_t kSteps = 400;
  v1::JobSpec spec = TinyJob(kSteps);
  spec.mutable_layout()->set_nodes(2);
  const std::string ckpt = c.dir() + "/ckpt";
  spec.mutable_checkpoint()->set_directory(ckpt);
  spec.mutable_checkpoint()->set_every(5);
  spec.set_max_restarts(1);
  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  ASSERT_TRUE(c.WaitStep(id, 12)) << c.Logs();

  // The host of rank 0 (the rank that writes checkpoints) is cut off.
  auto placed = c.client().GetJob(id);
  ASSERT_TRUE(placed.ok()) << placed.status();
  std::string victim_id;
  for (const v1::Placement& p : placed->placement()) {
    if (std::find(p.ranks().begin(), p.ranks().end(), 0) != p.ranks().end()) victim_id = p.worker_id();
  }
  int victim = -1;
  for (int i = 0; i < 3; ++i) {
    if (WorkerId(c.worker(i)) == victim_id) victim = i;
  }
  ASSERT_GE(victim, 0) << placed->DebugString();
  const pid_t old_rank0 = c.RankPid(id, 0);
  ASSERT_NE(old_rank0, 0);
  ASSERT_TRUE(net->Cut(victim).ok());
  const absl::Time cut = absl::Now();

  // Frozen by its own agent's lapsed lease, not killed, and no process was
  // signalled by the test.
  absl::Time frozen = absl::InfiniteFuture();
  ASSERT_TRUE(WaitFor(
      [&] {
        if (ProcState(old_rank0) != 'T') return false;
        frozen = absl::Now();
        return true;
      },
      absl::Seconds(30)))
      << "rank 0 on the cut-off host is still in state " << ProcState(old_rank0) << "\n" << c.Logs();
  std::printf("link cut -> rank 0 frozen after %s (lease 3 s)\n", absl::FormatDuration(frozen - cut).c_str());
  // The checkpoint attempt 1 must resume from: the newest on disk now that
  // rank 0, the rank that writes them, is frozen (attempt 1 starts only
  // once the worker is lost, a second after the freeze, and checkpoints 5
  // steps later).
  const int64_t newest_at_freeze = NewestCheckpointIn(ckpt);

  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.attempt(), 1);
  const std::vector<v1::JobEvent> events = c.AllEvents(id);
  absl::Time restarted = absl::InfiniteFuture();
  for (const v1::JobEvent& e : events) {
    if (e.has_state_change() && e.state_change().state() == v1::RESTARTING) {
      EXPECT_EQ(e.state_change().failure().kind(), v1::Failure::WORKER_LOST) << e.DebugString();
      EXPECT_EQ(e.state_change().failure().worker_id(), victim_id);
      restarted = std::min(restarted, TimeOf(e.time()));
    }
  }
  ASSERT_NE(restarted, absl::InfiniteFuture());
  // The order the fencing rests on: frozen before the coordinator gave up
  // on the worker (and so before the next attempt could start).
  EXPECT_LT(frozen, restarted) << "frozen " << absl::FormatDuration(frozen - cut) << " after the cut, restarted after "
                               << absl::FormatDuration(restarted - cut);
  EXPECT_EQ(ProcState(old_rank0), 'T') << "the old rank 0 is no longer frozen while its host is cut off";

  // Attempt 1 ran on the two other hosts, from a checkpoint of attempt 0,
  // and recomputed its steps to the bit.
  const std::map<int64_t, double> first = Losses(events, 0), second = Losses(events, 1);
  ASSERT_FALSE(second.empty());
  const int64_t resumed_at = second.begin()->first - 1;
  EXPECT_EQ(resumed_at, newest_at_freeze)
      << "attempt 1 did not resume from attempt 0's newest checkpoint";
  EXPECT_GE(resumed_at, 10);
  // Attempt 0 may have checkpointed steps the coordinator never heard of:
  // rank 0 writes step S's checkpoint after step S, and the cut swallows the
  // reports its agent had not yet sent (it batches them for 200 ms). Then the
  // two attempts may share no step and there is nothing to compare here
  // (fault_test's restart test compares a restart's losses).
  ASSERT_FALSE(first.empty());
  int compared = 0, overlap = 0;
  for (const auto& [step, loss] : first) overlap += step > resumed_at;
  for (const auto& [step, loss] : second) {
    if (first.count(step)) {
      EXPECT_EQ(first.at(step), loss) << "step " << step;
      ++compared;
    }
  }
  EXPECT_EQ(compared, overlap) << "attempt 1 did not recompute every step attempt 0 reported past its checkpoint";
  std::printf("attempt 1 resumed at step %lld and recomputed %d steps of attempt 0 to the bit\n",
              static_cast<long long>(resumed_at), compared);
  EXPECT_EQ(second.rbegin()->first, kSteps);
  for (int i = 0; i < 3; ++i) {
    if (i == victim) continue;
    EXPECT_THAT(c.worker(i)->out() + c.worker(i)->err(), ::testing::Not(HasSubstr("fenced")));
  }
  // The directory belongs to attempt 1; its files are what it wrote.
  EXPECT_EQ(ReadFile(ckpt + "/.plateau-fence"), absl::StrCat(id, " 1\n"));
  std::map<std::string, std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(ckpt)) {
    files[e.path().filename().string()] = ReadFile(e.path().string());
  }
  EXPECT_TRUE(files.count(absl::StrCat("step-", std::string(8 - std::to_string(kSteps).size(), '0'), kSteps,
                                       ".safetensors")))
      << "no final checkpoint";

  // The link returns: the agent registers again, is told its attempt is
  // void, and its frozen ranks are killed; nothing of attempt 0 is left.
  ASSERT_TRUE(net->Restore(victim).ok());
  EXPECT_TRUE(WaitFor([&] { return ProcState(old_rank0) == 0; }, absl::Seconds(90)))
      << "the old rank 0 survived the link's return\n" << c.Logs();
  EXPECT_TRUE(WaitFor([&] { return c.RankPids(id).empty(); }, absl::Seconds(30))) << c.Logs();
  const std::string agent = c.worker(victim)->out() + c.worker(victim)->err();
  EXPECT_THAT(agent, HasSubstr(absl::StrCat("registered again as ", victim_id)));
  // Its job log says what happened to it (sent once the link was back).
  std::string logs;
  EXPECT_TRUE(WaitFor([&] {
    logs.clear();
    c.client()
        .GetJobLogs(id, false, 0,
                    [&](const v1::LogEntry& l) {
                      absl::StrAppend(&logs, l.attempt(), " ", l.rank(), " ", l.stream(), " ", l.line(), "\n");
                      return true;
                    })
        .IgnoreError();
    return absl::StrContains(logs, "killing the job's frozen ranks");
  }, absl::Seconds(30))) << logs;
  EXPECT_THAT(logs, HasSubstr("0 -1 agent fenced: no answer from the coordinator for"));
  EXPECT_THAT(logs, HasSubstr("0 -1 agent killing the job's frozen ranks (the coordinator did not re-attach it)"));
  // No file of the old attempt appeared or changed after it came back.
  std::map<std::string, std::string> after;
  for (const auto& e : std::filesystem::directory_iterator(ckpt)) {
    after[e.path().filename().string()] = ReadFile(e.path().string());
  }
  EXPECT_TRUE(after == files) << "the checkpoint directory changed after the old attempt's host came back";
  for (const auto& [name, bytes] : after) EXPECT_FALSE(absl::StartsWith(name, ".partial-")) << name;
}

}  // namespace
}  // namespace plateau
