// The service end to end, with real processes over loopback: a coordinator
// (real SQLite in a temporary directory, real /metrics over HTTP), a worker
// agent spawning real rank processes, driven through the gRPC API and
// plateauctl. Ports are chosen by the OS and read from --ready_file.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "worker/job_spec.h"

extern char** environ;

namespace plateau {
namespace {

using ::testing::HasSubstr;

// Generous: a loaded 2-core machine runs these alongside other tests.
constexpr absl::Duration kDeadline = absl::Seconds(120);

std::string TempDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(tmp ? tmp : "/tmp", "/", name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Polls `ready` until it holds or the deadline passes.
bool WaitFor(const std::function<bool()>& ready, absl::Duration deadline = kDeadline) {
  const absl::Time end = absl::Now() + deadline;
  while (absl::Now() < end) {
    if (ready()) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return ready();
}

// A child process in its own process group, output to files; stopped (the
// whole group) when destroyed.
class Process {
 public:
  Process(const std::vector<std::string>& args, const std::string& log_prefix) : log_(log_prefix) {
    std::vector<std::string> a = args;
    std::vector<char*> argv;
    for (std::string& s : a) argv.push_back(s.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, (log_ + ".out").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&fa, 2, (log_ + ".err").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attr, 0);
    int rc = posix_spawn(&pid_, argv[0], &fa, &attr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    if (rc != 0) pid_ = 0;
  }
  ~Process() { Stop(); }
  pid_t pid() const { return pid_; }
  std::string out() const { return ReadFile(log_ + ".out"); }
  std::string err() const { return ReadFile(log_ + ".err"); }
  // SIGTERM, then SIGKILL after 20 s; returns the wait status.
  int Stop(int sig = SIGTERM) {
    if (pid_ == 0) return status_;
    kill(-pid_, sig);
    const absl::Time end = absl::Now() + absl::Seconds(20);
    while (waitpid(pid_, &status_, WNOHANG) == 0) {
      if (absl::Now() > end) {
        kill(-pid_, SIGKILL);
        waitpid(pid_, &status_, 0);
        break;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    kill(-pid_, SIGKILL);  // anything left in its group
    pid_ = 0;
    return status_;
  }

 private:
  std::string log_;
  pid_t pid_ = 0;
  int status_ = 0;
};

// Runs a command to completion; returns its exit code and output.
struct Ran {
  int code = -1;
  std::string out, err;
};
Ran RunCommand(const std::vector<std::string>& args, const std::string& log_prefix) {
  Process p(args, log_prefix);
  int status = 0;
  const absl::Time end = absl::Now() + kDeadline;
  while (waitpid(p.pid(), &status, WNOHANG) == 0 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(20));
  Ran r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = p.out();
  r.err = p.err();
  return r;
}

// An HTTP GET of /metrics over a plain socket: what Prometheus does.
std::string Scrape(const std::string& address) {
  std::vector<std::string> hp = absl::StrSplit(address, ':');
  int port = 0;
  if (hp.size() != 2 || !absl::SimpleAtoi(hp[1], &port)) return "";
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, hp[0].c_str(), &sa.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return "";
  }
  const std::string req = absl::StrCat("GET /metrics HTTP/1.0\r\nHost: ", address, "\r\n\r\n");
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return "";
  }
  std::string resp;
  char buf[65536];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) resp.append(buf, static_cast<size_t>(n));
  close(fd);
  return resp;
}

// The value of the sample `name{labels}` (labels in the exposition's order:
// prometheus-cpp sorts them by name), or NaN when absent.
double Sample(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StartsWith(line, series + " ")) {
      double v = 0;
      if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
    }
  }
  return NAN;
}

// Pids of the rank processes of `job` in the process table.
std::vector<pid_t> RankPids(const std::string& job) {
  std::vector<pid_t> pids;
  DIR* d = opendir("/proc");
  if (d == nullptr) return pids;
  while (dirent* e = readdir(d)) {
    pid_t pid = 0;
    if (!absl::SimpleAtoi(e->d_name, &pid)) continue;
    std::string cmd = ReadFile(absl::StrCat("/proc/", pid, "/cmdline"));
    std::vector<std::string> args = absl::StrSplit(cmd, '\0');
    bool rank = false, mine = false;
    for (const std::string& a : args) {
      rank = rank || absl::EndsWith(a, "plateau_rank");
      mine = mine || a == "--job_id=" + job;
    }
    if (rank && mine) pids.push_back(pid);
  }
  closedir(d);
  return pids;
}

// A small job: the demo's model on a tiny batch.
v1::JobSpec TinyJob(int64_t steps) {
  v1::JobSpec s = DemoJobSpec(2, steps);
  s.set_name("tiny");
  s.mutable_layout()->set_batch(4);
  return s;
}

class Cluster {
 public:
  explicit Cluster(const std::string& name, bool with_worker = true, double worker_timeout_s = 10)
      : dir_(TempDir(name)) {
    coordinator_ = std::make_unique<Process>(
        std::vector<std::string>{"server/plateau_coordinator", "--state_dir=" + dir_ + "/state",
                                 "--listen=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
                                 "--ready_file=" + dir_ + "/ready",
                                 absl::StrCat("--worker_timeout_s=", worker_timeout_s), "--heartbeat_ms=200"},
        dir_ + "/coordinator");
    ready_ = WaitFor([&] { return std::filesystem::exists(dir_ + "/ready"); });
    if (!ready_) return;
    for (absl::string_view line : absl::StrSplit(ReadFile(dir_ + "/ready"), '\n')) {
      if (absl::StartsWith(line, "api=")) api_ = std::string(line.substr(4));
      if (absl::StartsWith(line, "metrics=")) metrics_ = std::string(line.substr(8));
    }
    client_ = std::make_unique<Client>(api_);
    if (with_worker) StartWorker();
  }

  void StartWorker() {
    worker_ = std::make_unique<Process>(
        std::vector<std::string>{"worker/plateau_worker", "--coordinator=" + api_, "--devices=2",
                                 "--rank_binary=worker/plateau_rank", "--work_dir=" + dir_ + "/work",
                                 "--grace_s=3", "--device_peak_flops=1e11"},
        dir_ + "/worker");
  }

  bool ready() const { return ready_ && !api_.empty() && !metrics_.empty(); }
  Client& client() { return *client_; }
  const std::string& api() const { return api_; }
  const std::string& metrics() const { return metrics_; }
  const std::string& dir() const { return dir_; }
  Process* worker() { return worker_.get(); }
  std::string Logs() const {
    return absl::StrCat("--- coordinator:\n", coordinator_->out(), coordinator_->err(), "--- worker:\n",
                        worker_ ? worker_->out() + worker_->err() : "");
  }

  // Waits for the job's final state.
  v1::Job WaitDone(const std::string& id) {
    v1::Job job;
    WaitFor([&] {
      auto j = client_->GetJob(id);
      if (j.ok()) job = *j;
      return j.ok() && (job.state() == v1::SUCCEEDED || job.state() == v1::FAILED || job.state() == v1::CANCELLED);
    });
    return job;
  }

  // Watches until rank 0 reported step `step`.
  bool WaitStep(const std::string& id, int64_t step) {
    bool reached = false;
    client_->WatchJob(id, 0, [&](const v1::JobEvent& e) {
      reached = e.has_step() && e.step().step() >= step;
      return !reached;
    }).IgnoreError();
    return reached;
  }

 private:
  std::string dir_, api_, metrics_;
  bool ready_ = false;
  std::unique_ptr<Process> coordinator_, worker_;
  std::unique_ptr<Client> client_;
};

TEST(ServiceTest, SubmitRunSucceedsWithTelemetryInWatchAndMetrics) {
  Cluster c("succeed");
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(6), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  EXPECT_EQ(id, "job-1");
  EXPECT_EQ(sub->plan().live_sets_size(), 8);

  std::vector<v1::JobEvent> events;
  absl::Status s = c.client().WatchJob(id, 0, [&](const v1::JobEvent& e) {
    events.push_back(e);
    return true;
  });
  ASSERT_TRUE(s.ok()) << s << c.Logs();
  std::vector<v1::JobState> states;
  std::map<int, std::vector<int64_t>> steps;  // per rank
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i].index(), static_cast<int64_t>(i));
    if (events[i].has_state_change()) states.push_back(events[i].state_change().state());
    if (events[i].has_step()) {
      const v1::StepTelemetry& t = events[i].step();
      steps[t.rank()].push_back(t.step());
      EXPECT_GT(t.loss(), 0);
      EXPECT_EQ(t.tokens(), 4 * 32);
      EXPECT_GT(t.model_flops(), 0);
      EXPECT_GT(t.seconds(), 0);
      EXPECT_EQ(t.peak_size(), 8);
      EXPECT_GT(t.peak(0).bytes(), 0) << "weights peak";
    }
  }
  ASSERT_FALSE(states.empty());
  EXPECT_EQ(states.front(), v1::PENDING);
  EXPECT_EQ(states.back(), v1::SUCCEEDED) << c.Logs();
  EXPECT_THAT(states, ::testing::Contains(v1::RUNNING));
  EXPECT_EQ(steps[0], (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(steps[1], (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));

  // Resuming from an index replays exactly the rest.
  std::vector<v1::JobEvent> rest;
  ASSERT_TRUE(c.client().WatchJob(id, 5, [&](const v1::JobEvent& e) {
    rest.push_back(e);
    return true;
  }).ok());
  ASSERT_EQ(rest.size(), events.size() - 5);
  EXPECT_EQ(rest[0].SerializeAsString(), events[5].SerializeAsString());

  auto job = c.client().GetJob(id);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->state(), v1::SUCCEEDED);
  EXPECT_EQ(job->progress().step(), 6);
  EXPECT_GT(job->progress().tokens_per_second(), 0);
  EXPECT_EQ(job->event_count(), static_cast<int64_t>(events.size()));

  std::string logs;
  ASSERT_TRUE(c.client().GetJobLogs(id, false, 0, [&](const v1::LogEntry& l) {
    logs += absl::StrCat(l.rank(), " ", l.line(), "\n");
    return true;
  }).ok());
  EXPECT_THAT(logs, HasSubstr("0 finished 6 steps"));
  EXPECT_THAT(logs, HasSubstr("1 finished 6 steps"));

  const std::string m = Scrape(c.metrics());
  ASSERT_THAT(m, HasSubstr("200 OK"));
  EXPECT_EQ(Sample(m, "plateau_job_step{job=\"job-1\",rank=\"0\"}"), 6);
  EXPECT_EQ(Sample(m, "plateau_job_step{job=\"job-1\",rank=\"1\"}"), 6);
  // Each rank counts its half of the global batch.
  EXPECT_EQ(Sample(m, "plateau_job_tokens_total{job=\"job-1\",rank=\"0\"}"), 6 * 4 * 32 / 2);
  EXPECT_GT(Sample(m, "plateau_job_model_flops_total{job=\"job-1\",rank=\"0\"}"), 0);
  EXPECT_GT(Sample(m, "plateau_job_loss{job=\"job-1\",rank=\"0\"}"), 0);
  EXPECT_EQ(Sample(m, "plateau_job_step_duration_seconds_count{job=\"job-1\",rank=\"0\"}"), 6);
  EXPECT_GT(Sample(m, "plateau_job_peak_bytes{job=\"job-1\",live_set=\"weights\",rank=\"0\"}"), 0);
  EXPECT_GT(Sample(m, "plateau_job_peak_bytes{job=\"job-1\",live_set=\"dispatch\",rank=\"1\"}"), 0);
  EXPECT_EQ(Sample(m, "plateau_job_planned_bytes{job=\"job-1\",live_set=\"weights\",rank=\"0\"}"),
            sub->plan().live_sets(0).bytes());
  EXPECT_GT(Sample(m, "plateau_job_mfu_ratio{job=\"job-1\",rank=\"0\"}"), 0);
  EXPECT_EQ(Sample(m, "plateau_job_state{job=\"job-1\",state=\"SUCCEEDED\"}"), 1);
  EXPECT_EQ(Sample(m, "plateau_job_state{job=\"job-1\",state=\"RUNNING\"}"), 0);
  EXPECT_GT(Sample(m, "plateau_worker_last_heartbeat_timestamp_seconds{worker=\"worker-1\"}"), 1.7e9);
  EXPECT_TRUE(RankPids(id).empty());
}

TEST(ServiceTest, CancelMidRunLeavesNoRankProcess) {
  Cluster c("cancel");
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(1000000), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  ASSERT_TRUE(c.WaitStep(id, 2)) << c.Logs();
  const std::vector<pid_t> pids = RankPids(id);
  ASSERT_EQ(pids.size(), 2u) << "the check below must be able to fail";
  auto cancelled = c.client().CancelJob(id);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::CANCELLING);
  const v1::Job job = c.WaitDone(id);
  EXPECT_EQ(job.state(), v1::CANCELLED) << job.DebugString() << c.Logs();
  EXPECT_FALSE(job.has_failure());
  // CANCELLED means no rank process is left: checked from the process table.
  EXPECT_TRUE(RankPids(id).empty());
  for (pid_t p : pids) EXPECT_NE(kill(p, 0), 0) << "pid " << p << " still exists";
  // SIGTERM stopped them (not the SIGKILL after the grace period).
  std::string logs;
  ASSERT_TRUE(c.client().GetJobLogs(id, false, 0, [&](const v1::LogEntry& l) {
    logs += l.line() + "\n";
    return true;
  }).ok());
  for (pid_t p : pids) EXPECT_THAT(logs, HasSubstr("(pid " + std::to_string(p) + ") killed by signal 15"));
  // A second cancel is refused: the job is final.
  EXPECT_EQ(c.client().CancelJob(id).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ServiceTest, KilledRankFailsTheJobWithItsSignal) {
  Cluster c("crash");
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(1000000), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  ASSERT_TRUE(c.WaitStep(id, 2)) << c.Logs();
  pid_t rank1 = 0;
  for (pid_t p : RankPids(id)) {
    if (absl::StrContains(ReadFile(absl::StrCat("/proc/", p, "/cmdline")), std::string("--rank=1\0", 9))) rank1 = p;
  }
  ASSERT_NE(rank1, 0);
  ASSERT_EQ(kill(rank1, SIGKILL), 0);
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::FAILED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.failure().kind(), v1::Failure::RANK_CRASHED) << job.failure().DebugString();
  EXPECT_EQ(job.failure().rank(), 1);
  EXPECT_EQ(job.failure().signal(), SIGKILL);
  EXPECT_THAT(job.state_reason(), HasSubstr("signal 9"));
  EXPECT_TRUE(RankPids(id).empty());
}

TEST(ServiceTest, CrashedAttemptRestartsWhenRestartsAreLeft) {
  Cluster c("restart");
  ASSERT_TRUE(c.ready()) << c.Logs();
  v1::JobSpec spec = TinyJob(300);
  spec.set_max_restarts(1);
  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  ASSERT_TRUE(c.WaitStep(id, 2)) << c.Logs();
  const std::vector<pid_t> first = RankPids(id);
  ASSERT_EQ(first.size(), 2u);
  ASSERT_EQ(kill(first[0], SIGKILL), 0);
  const v1::Job job = c.WaitDone(id);
  EXPECT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.attempt(), 1);
  std::vector<v1::JobState> states;
  ASSERT_TRUE(c.client().WatchJob(id, 0, [&](const v1::JobEvent& e) {
    if (e.has_state_change()) states.push_back(e.state_change().state());
    return true;
  }).ok());
  EXPECT_THAT(states, ::testing::Contains(v1::RESTARTING));
  EXPECT_EQ(std::count(states.begin(), states.end(), v1::RUNNING), 2);
}

TEST(ServiceTest, RankExitCodeAndMessageReachTheJob) {
  Cluster c("exitcode");
  ASSERT_TRUE(c.ready()) << c.Logs();
  v1::JobSpec spec = TinyJob(5);
  spec.mutable_model()->set_vocab_size(256);
  spec.mutable_data()->mutable_text()->set_path("/nonexistent/plateau-test.txt");
  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const v1::Job job = c.WaitDone(sub->job().id());
  ASSERT_EQ(job.state(), v1::FAILED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.failure().kind(), v1::Failure::INVALID);
  EXPECT_EQ(job.failure().exit_code(), 4);
  EXPECT_EQ(job.failure().signal(), 0);
  EXPECT_THAT(job.failure().message(), HasSubstr("/nonexistent/plateau-test.txt"));
}

TEST(ServiceTest, JobOverTheDeviceCapFailsNamingTheLiveSet) {
  Cluster c("oom");
  ASSERT_TRUE(c.ready()) << c.Logs();
  v1::JobSpec spec = TinyJob(5);
  auto plan = c.client().PlanJob(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  int64_t dispatch = 0;
  for (const auto& ls : plan->plan().live_sets()) {
    if (ls.live_set() == "dispatch") dispatch = ls.bytes();
  }
  // Holds the launch-sized state but only a quarter of the routes.
  spec.set_device_memory_bytes(plan->plan().total_bytes() - dispatch + dispatch / 4);
  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  EXPECT_FALSE(sub->plan().fits());
  const v1::Job job = c.WaitDone(sub->job().id());
  ASSERT_EQ(job.state(), v1::FAILED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.failure().kind(), v1::Failure::OUT_OF_MEMORY) << job.failure().DebugString();
  EXPECT_EQ(job.failure().live_set(), "dispatch");
  EXPECT_EQ(job.failure().exit_code(), 3);
  EXPECT_THAT(job.state_reason(), HasSubstr("live set 'dispatch'"));
}

TEST(ServiceTest, ValidateOnlyCreatesNothingAndBadSpecsNameTheField) {
  Cluster c("validate", /*with_worker=*/false);
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto v = c.client().SubmitJob(TinyJob(5), /*validate_only=*/true);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_FALSE(v->has_job());
  EXPECT_EQ(v->plan().live_sets_size(), 8);
  const std::vector<std::pair<std::string, std::function<void(v1::JobSpec&)>>> bad = {
      {"model.heads", [](v1::JobSpec& s) { s.mutable_model()->set_heads(3); }},
      {"layout.nodes", [](v1::JobSpec& s) { s.mutable_layout()->set_nodes(5); }},
      {"optimizer.lr", [](v1::JobSpec& s) { s.mutable_optimizer()->set_lr(-1); }},
      {"data.recall.pairs", [](v1::JobSpec& s) { s.mutable_data()->mutable_recall()->set_pairs(0); }},
      {"steps", [](v1::JobSpec& s) { s.set_steps(0); }},
      {"backend", [](v1::JobSpec& s) { s.clear_backend(); }},
  };
  for (bool validate_only : {true, false}) {
    for (const auto& [field, mutate] : bad) {
      v1::JobSpec s = TinyJob(5);
      mutate(s);
      auto r = c.client().SubmitJob(s, validate_only);
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << field << ": " << r.status();
      EXPECT_THAT(r.status().message(), HasSubstr(field + ":"));
    }
  }
  v1::JobSpec small = TinyJob(5);
  small.set_device_memory_bytes(1 << 16);
  auto r = c.client().SubmitJob(small, false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("device_memory_bytes"));
  EXPECT_THAT(r.status().message(), HasSubstr("weights="));
  auto list = c.client().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->jobs_size(), 0) << "nothing may have been created";
  EXPECT_EQ(c.client().GetJob("job-1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c.client().GetJob("banana").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ServiceTest, ListJobsPagesAndFiltersOverMoreThanOnePage) {
  Cluster c("list", /*with_worker=*/false);
  ASSERT_TRUE(c.ready()) << c.Logs();
  std::vector<std::string> ids;
  for (int i = 0; i < 7; ++i) {
    auto sub = c.client().SubmitJob(TinyJob(5), false);
    ASSERT_TRUE(sub.ok()) << sub.status();
    ids.push_back(sub->job().id());
  }
  for (int i : {1, 3, 5}) {
    auto j = c.client().CancelJob(ids[i]);
    ASSERT_TRUE(j.ok());
    EXPECT_EQ(j->state(), v1::CANCELLED);
  }
  auto pending = c.client().GetJob(ids[0]);
  ASSERT_TRUE(pending.ok());
  EXPECT_EQ(pending->state(), v1::PENDING);
  EXPECT_THAT(pending->state_reason(), HasSubstr("no worker is registered"));

  auto all_pages = [&](int page_size, std::vector<v1::JobState> states, std::vector<int>* sizes) {
    std::vector<std::string> got;
    v1::ListJobsRequest req;
    req.set_page_size(page_size);
    for (auto s : states) req.add_states(s);
    do {
      auto page = c.client().ListJobs(req);
      EXPECT_TRUE(page.ok()) << page.status();
      if (!page.ok()) break;
      sizes->push_back(page->jobs_size());
      for (const auto& j : page->jobs()) {
        got.push_back(j.id());
        if (!states.empty()) {
          EXPECT_EQ(j.state(), states[0]);
        }
      }
      req.set_page_token(page->next_page_token());
    } while (!req.page_token().empty());
    return got;
  };
  std::vector<int> sizes;
  EXPECT_EQ(all_pages(3, {}, &sizes), ids);
  EXPECT_EQ(sizes, (std::vector<int>{3, 3, 1}));
  sizes.clear();
  EXPECT_EQ(all_pages(2, {v1::CANCELLED}, &sizes), (std::vector<std::string>{ids[1], ids[3], ids[5]}));
  EXPECT_EQ(sizes, (std::vector<int>{2, 1}));
  sizes.clear();
  EXPECT_EQ(all_pages(0, {v1::PENDING}, &sizes), (std::vector<std::string>{ids[0], ids[2], ids[4], ids[6]}));
  EXPECT_EQ(sizes, (std::vector<int>{4}));

  v1::ListJobsRequest bad;
  bad.set_page_token("not-a-token");
  EXPECT_THAT(c.client().ListJobs(bad).status().message(), HasSubstr("page_token"));
  bad.Clear();
  bad.set_page_size(5000);
  EXPECT_EQ(c.client().ListJobs(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ServiceTest, LostWorkerFailsItsJob) {
  Cluster c("lost", /*with_worker=*/true, /*worker_timeout_s=*/2);
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(1000000), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  ASSERT_TRUE(c.WaitStep(id, 1)) << c.Logs();
  c.worker()->Stop(SIGKILL);  // the agent and (by its group) nothing else...
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::FAILED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.failure().kind(), v1::Failure::WORKER_LOST);
  EXPECT_THAT(job.state_reason(), HasSubstr("worker-1"));
  // ...while its ranks die with it (parent-death signal).
  EXPECT_TRUE(WaitFor([&] { return RankPids(id).empty(); }, absl::Seconds(30)));
}

TEST(ServiceTest, PlateauctlSubmitWaitJsonAndErrors) {
  Cluster c("cli");
  ASSERT_TRUE(c.ready()) << c.Logs();
  const std::string spec_path = c.dir() + "/job.txtpb";
  {
    std::string text;
    google::protobuf::TextFormat::PrintToString(TinyJob(4), &text);
    std::ofstream(spec_path) << text;
  }
  const std::string ctl = "client/plateauctl";
  const std::string coord = "--coordinator=" + c.api();
  Ran r = RunCommand({ctl, coord, "submit", spec_path, "--wait"}, c.dir() + "/submit");
  EXPECT_EQ(r.code, 0) << r.out << r.err << c.Logs();
  EXPECT_THAT(r.out, HasSubstr("memory plan per rank"));
  EXPECT_THAT(r.out, HasSubstr("step     4/4"));
  EXPECT_THAT(r.out, HasSubstr("summary: job-1 SUCCEEDED"));
  EXPECT_THAT(r.out, HasSubstr("dispatch"));

  r = RunCommand({ctl, coord, "--output=json", "get", "job-1"}, c.dir() + "/get");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("\"state\":\"SUCCEEDED\""));

  r = RunCommand({ctl, coord, "submit", spec_path, "--validate-only"}, c.dir() + "/validate");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("nothing was created"));
  r = RunCommand({ctl, coord, "--output=json", "list"}, c.dir() + "/list");
  EXPECT_EQ(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("job-1"));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("job-2")));

  std::ofstream(c.dir() + "/bad.txtpb") << "model { heads: 3 hidden: 64 }\nlayout { ranks: }\n";
  r = RunCommand({ctl, coord, "submit", c.dir() + "/bad.txtpb"}, c.dir() + "/bad");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("bad.txtpb:2:"));
  {
    v1::JobSpec s = TinyJob(4);
    s.mutable_model()->set_heads(3);
    std::string text;
    google::protobuf::TextFormat::PrintToString(s, &text);
    std::ofstream(c.dir() + "/invalid.txtpb") << text;
  }
  r = RunCommand({ctl, coord, "submit", c.dir() + "/invalid.txtpb"}, c.dir() + "/invalid");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("INVALID_ARGUMENT: model.heads:"));

  // A coordinator that is not there: a clear message and its own exit code.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(sa);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  const std::string dead = absl::StrCat("127.0.0.1:", ntohs(sa.sin_port));
  close(fd);
  r = RunCommand({ctl, "--coordinator=" + dead, "list"}, c.dir() + "/dead");
  EXPECT_EQ(r.code, 4);
  EXPECT_THAT(r.err, HasSubstr("cannot reach the coordinator at " + dead));
}

}  // namespace
}  // namespace plateau
