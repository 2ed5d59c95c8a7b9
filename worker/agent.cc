#include "worker/agent.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"
#include "worker/telemetry_batch.h"

extern char** environ;

namespace plateau {
namespace {

void Now(google::protobuf::Timestamp* t) {
  const int64_t ns = absl::ToUnixNanos(absl::Now());
  t->set_seconds(ns / 1000000000);
  t->set_nanos(static_cast<int32_t>(ns % 1000000000));
}

bool GroupAlive(pid_t pgid) { return kill(-pgid, 0) == 0 || errno == EPERM; }

}  // namespace

Agent::Agent(AgentOptions options) : options_(std::move(options)) {
  stub_ = v1::WorkerService::NewStub(
      options_.channel ? options_.channel
                       : grpc::CreateChannel(options_.coordinator, grpc::InsecureChannelCredentials()));
}

Agent::~Agent() { Reap(); }

std::unique_ptr<grpc::ClientContext> Agent::Context(absl::Duration timeout) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
  return ctx;
}

absl::Status Agent::RegisterNow() {
  v1::RegisterRequest req;
  *req.mutable_capabilities() = options_.capabilities;
  v1::RegisterResponse resp;
  auto ctx = Context(absl::Seconds(5));
  grpc::Status s = stub_->Register(ctx.get(), req, &resp);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("cannot register with the coordinator at ", options_.coordinator, ": ",
                                     s.error_message()));
  }
  worker_id_ = resp.worker_id();
  if (resp.heartbeat_interval_ms() > 0) heartbeat_interval_ = absl::Milliseconds(resp.heartbeat_interval_ms());
  std::printf("plateau_worker: registered as %s with the coordinator at %s (%s, %d device(s))\n",
              worker_id_.c_str(), options_.coordinator.c_str(),
              options_.capabilities.backend() == v1::BACKEND_CUDA ? "cuda" : "cpu",
              options_.capabilities.devices());
  std::fflush(stdout);
  return absl::OkStatus();
}

absl::Status Agent::Run() {
  std::error_code ec;
  std::filesystem::create_directories(options_.work_dir, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("work_dir: ", options_.work_dir, ": ", ec.message()));
  // Register, retrying while the coordinator starts.
  while (!stop_.load()) {
    absl::Status s = RegisterNow();
    if (s.ok()) break;
    if (s.code() != absl::StatusCode::kUnavailable && s.code() != absl::StatusCode::kDeadlineExceeded) return s;
    if (reachable_) std::fprintf(stderr, "plateau_worker: %s; retrying\n", std::string(s.message()).c_str());
    reachable_ = false;
    absl::SleepFor(absl::Milliseconds(500));
  }
  std::thread sender([this] {
    while (!stop_.load()) {
      absl::SleepFor(absl::Milliseconds(200));
      Flush();
    }
  });
  absl::Time next_heartbeat = absl::Now();
  while (!stop_.load()) {
    if (absl::Now() >= next_heartbeat) {
      HeartbeatOnce();
      next_heartbeat = absl::Now() + heartbeat_interval_;
    }
    KillOverdue();
    Reap();
    absl::SleepFor(absl::Milliseconds(50));
  }
  // Stop everything this agent started, and wait until it is gone.
  {
    absl::MutexLock lock(&mu_);
    for (auto& [key, job] : jobs_) StopJob(*job, "the worker agent is shutting down");
  }
  while (true) {
    KillOverdue();
    Reap();
    absl::MutexLock lock(&mu_);
    if (jobs_.empty()) break;
    mu_.Unlock();
    absl::SleepFor(absl::Milliseconds(50));
    mu_.Lock();
  }
  sender.join();
  Flush();
  return absl::OkStatus();
}

void Agent::HeartbeatOnce() {
  v1::HeartbeatRequest req;
  req.set_worker_id(worker_id_);
  {
    absl::MutexLock lock(&mu_);
    for (auto& [key, job] : jobs_) {
      v1::RunningJob* r = req.add_running();
      r->set_job_id(job->job_id);
      r->set_attempt(job->attempt);
    }
  }
  v1::HeartbeatResponse resp;
  auto ctx = Context(absl::Seconds(5));
  grpc::Status s = stub_->Heartbeat(ctx.get(), req, &resp);
  if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
    // The coordinator dropped this worker (lost, or restarted): its jobs
    // here are no longer anyone's; stop them and register afresh.
    std::fprintf(stderr, "plateau_worker: %s\n", s.error_message().c_str());
    {
      absl::MutexLock lock(&mu_);
      for (auto& [key, job] : jobs_) StopJob(*job, "the coordinator no longer knows this worker");
    }
    RegisterNow().IgnoreError();
    return;
  }
  if (!s.ok()) {
    if (reachable_) {
      std::fprintf(stderr, "plateau_worker: heartbeat to %s failed: %s; retrying\n",
                   options_.coordinator.c_str(), s.error_message().c_str());
    }
    reachable_ = false;
    return;
  }
  reachable_ = true;
  for (const v1::Assignment& a : resp.assignments()) Start(a);
  absl::MutexLock lock(&mu_);
  for (const v1::Cancellation& c : resp.cancellations()) {
    auto it = jobs_.find(absl::StrCat(c.job_id(), "/", c.attempt()));
    if (it != jobs_.end()) StopJob(*it->second, "cancelled by the coordinator");
  }
}

void Agent::Log(const std::string& job_id, int attempt, int rank, const std::string& stream,
                const std::string& line) {
  absl::MutexLock lock(&out_mu_);
  v1::LogEntry* l = outbox_.add_logs();
  l->set_job_id(job_id);
  l->set_attempt(attempt);
  l->set_rank(rank);
  l->set_stream(stream);
  l->set_line(line);
  Now(l->mutable_time());
}

void Agent::Flush() {
  absl::MutexLock send(&send_mu_);
  v1::TelemetryRequest req;
  {
    absl::MutexLock lock(&out_mu_);
    if (outbox_.steps_size() == 0 && outbox_.logs_size() == 0) return;
    req.Swap(&outbox_);
  }
  req.set_worker_id(worker_id_);
  // In batches well under the coordinator's --max_request_bytes.
  for (const v1::TelemetryRequest& batch : SplitTelemetry(std::move(req))) {
    grpc::Status s;
    for (int tries = 0; tries < 20 && !worker_id_.empty(); ++tries) {
      v1::TelemetryResponse resp;
      auto ctx = Context(absl::Seconds(5));
      s = stub_->ReportTelemetry(ctx.get(), batch, &resp);
      if (s.ok() || s.error_code() != grpc::StatusCode::UNAVAILABLE) break;
      absl::SleepFor(absl::Milliseconds(250));
    }
    // Still unreachable: drop the rest too rather than wait this long again per batch.
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE) return;
  }
}

void Agent::Start(const v1::Assignment& a) {
  auto job = std::make_unique<JobRun>();
  job->job_id = a.job_id();
  job->attempt = a.attempt();
  const std::string key = absl::StrCat(a.job_id(), "/", a.attempt());
  const std::string spec_file = absl::StrCat(options_.work_dir, "/", a.job_id(), ".attempt-", a.attempt(), ".spec");
  {
    std::ofstream out(spec_file, std::ios::binary | std::ios::trunc);
    out << a.spec().SerializeAsString();
  }
  JobRun* j = job.get();
  {
    absl::MutexLock lock(&mu_);
    jobs_[key] = std::move(job);
  }
  for (int i = 0; i < a.ranks_size(); ++i) {
    const int r = a.ranks(i);
    auto rank = std::make_unique<Rank>();
    rank->rank = r;
    std::vector<std::string> args = {options_.rank_binary,
                                     absl::StrCat("--coordinator=", options_.coordinator),
                                     absl::StrCat("--job_id=", a.job_id()),
                                     absl::StrCat("--attempt=", a.attempt()),
                                     absl::StrCat("--rank=", r),
                                     absl::StrCat("--spec_file=", spec_file),
                                     absl::StrCat("--kv_prefix=", a.kv_prefix()),
                                     absl::StrCat("--hostname=", options_.capabilities.rank_address()),
                                     absl::StrCat("--device_index=", i),
                                     absl::StrCat("--token_file=", options_.token_file),
                                     absl::StrCat("--tls_ca_file=", options_.tls_ca_file)};
    std::vector<char*> argv;
    for (std::string& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    int out[2], err[2];
    bool piped = pipe2(out, O_CLOEXEC) == 0;
    if (piped && pipe2(err, O_CLOEXEC) != 0) {
      close(out[0]);
      close(out[1]);
      piped = false;
    }
    pid_t pid = 0;
    int rc = piped ? 0 : errno;
    if (piped) {
      posix_spawn_file_actions_t fa;
      posix_spawn_file_actions_init(&fa);
      posix_spawn_file_actions_adddup2(&fa, out[1], 1);
      posix_spawn_file_actions_adddup2(&fa, err[1], 2);
      posix_spawnattr_t attr;
      posix_spawnattr_init(&attr);
      // Its own process group; default signal handling and an empty mask
      // (the agent blocks SIGINT/SIGTERM for its sigwait thread, and a
      // spawned child would otherwise inherit that and ignore SIGTERM).
      posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
      posix_spawnattr_setpgroup(&attr, 0);
      sigset_t none, defaults;
      sigemptyset(&none);
      posix_spawnattr_setsigmask(&attr, &none);
      sigemptyset(&defaults);
      sigaddset(&defaults, SIGINT);
      sigaddset(&defaults, SIGTERM);
      sigaddset(&defaults, SIGPIPE);
      posix_spawnattr_setsigdefault(&attr, &defaults);
      rc = posix_spawn(&pid, options_.rank_binary.c_str(), &fa, &attr, argv.data(), environ);
      posix_spawn_file_actions_destroy(&fa);
      posix_spawnattr_destroy(&attr);
      close(out[1]);
      close(err[1]);
    }
    v1::RankStatusRequest report;
    report.set_worker_id(worker_id_);
    report.set_job_id(a.job_id());
    report.set_attempt(a.attempt());
    report.set_rank(r);
    Rank* rp = rank.get();
    if (rc != 0) {
      if (piped) {
        close(out[0]);
        close(err[0]);
      }
      const std::string msg = absl::StrCat("cannot start ", options_.rank_binary, ": ", strerror(rc));
      Log(a.job_id(), a.attempt(), r, "agent", msg);
      rp->exited = true;
      Flush();
      v1::RankExited* e = report.mutable_exited();
      e->set_exit_code(127);
      e->set_message(msg);
      e->set_process_group_empty(true);
      absl::MutexLock lock(&mu_);
      j->ranks.push_back(std::move(rank));
      StopJob(*j, "a rank could not be started");
    } else {
      rp->pid = pid;
      Log(a.job_id(), a.attempt(), r, "agent",
          absl::StrCat("started rank ", r, " as pid ", pid, " (process group ", pid, ")"));
      rp->readers.emplace_back([this, j, rp, fd = out[0]] { ReadPipe(j, rp, fd, true); });
      rp->readers.emplace_back([this, j, rp, fd = err[0]] { ReadPipe(j, rp, fd, false); });
      report.mutable_started()->set_pid(pid);
      absl::MutexLock lock(&mu_);
      j->ranks.push_back(std::move(rank));
      rp->waiter = std::thread([this, j, rp] { Wait(j, rp); });
    }
    v1::RankStatusResponse resp;
    auto ctx = Context(absl::Seconds(5));
    stub_->ReportRankStatus(ctx.get(), report, &resp);
  }
}

void Agent::ReadPipe(JobRun* job, Rank* rank, int fd, bool is_stdout) {
  std::string buf, line;
  char chunk[4096];
  auto handle = [&](const std::string& l) {
    if (is_stdout && !l.empty() && l[0] == '{') {
      v1::RankOutput out;
      if (google::protobuf::util::JsonStringToMessage(l, &out).ok()) {
        if (out.has_step()) {
          absl::MutexLock lock(&out_mu_);
          v1::TelemetryRequest::Step* s = outbox_.add_steps();
          s->set_job_id(job->job_id);
          *s->mutable_telemetry() = out.step();
          return;
        }
        if (out.has_error()) {
          absl::MutexLock lock(&mu_);
          rank->last_error = out.error();
          return;
        }
      }
    }
    Log(job->job_id, job->attempt, rank->rank, is_stdout ? "stdout" : "stderr", l);
  };
  while (true) {
    ssize_t n = read(fd, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    buf.append(chunk, static_cast<size_t>(n));
    size_t start = 0, nl;
    while ((nl = buf.find('\n', start)) != std::string::npos) {
      handle(buf.substr(start, nl - start));
      start = nl + 1;
    }
    buf.erase(0, start);
    if (buf.size() > 65536) {  // an endless line: cut it
      handle(buf);
      buf.clear();
    }
  }
  if (!buf.empty()) handle(buf);
  close(fd);
}

void Agent::Wait(JobRun* job, Rank* rank) {
  int status = 0;
  while (waitpid(rank->pid, &status, 0) < 0 && errno == EINTR) {
  }
  // The rank is gone; anything it left in its process group goes too, so
  // that "exited" means no process of the rank is left.
  if (GroupAlive(rank->pid)) {
    kill(-rank->pid, SIGKILL);
    for (int i = 0; i < 200 && GroupAlive(rank->pid); ++i) absl::SleepFor(absl::Milliseconds(10));
  }
  for (std::thread& t : rank->readers) t.join();
  v1::RankStatusRequest report;
  report.set_worker_id(worker_id_);
  report.set_job_id(job->job_id);
  report.set_attempt(job->attempt);
  report.set_rank(rank->rank);
  v1::RankExited* e = report.mutable_exited();
  bool failed;
  std::string how;
  {
    absl::MutexLock lock(&mu_);
    if (WIFSIGNALED(status)) {
      e->set_signal(WTERMSIG(status));
      how = absl::StrCat("killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
    } else {
      e->set_exit_code(WEXITSTATUS(status));
      how = absl::StrCat("exited with code ", WEXITSTATUS(status));
    }
    e->set_message(rank->last_error.message());
    e->set_error_code(rank->last_error.code());
    e->set_live_set(rank->last_error.live_set());
    e->set_process_group_empty(!GroupAlive(rank->pid));
    e->set_stopped_by_agent(rank->stop_sent);
    failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  Log(job->job_id, job->attempt, rank->rank, "agent", absl::StrCat("rank ", rank->rank, " (pid ", rank->pid, ") ", how));
  Flush();  // its telemetry and logs before its exit
  v1::RankStatusResponse resp;
  for (int tries = 0; tries < 20; ++tries) {
    auto ctx = Context(absl::Seconds(5));
    grpc::Status s = stub_->ReportRankStatus(ctx.get(), report, &resp);
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE) break;
    absl::SleepFor(absl::Milliseconds(250));
  }
  absl::MutexLock lock(&mu_);
  rank->exited = true;
  if (failed && !job->stopping) StopJob(*job, absl::StrCat("rank ", rank->rank, " ", how));
}

void Agent::StopJob(JobRun& job, const std::string& why) {
  if (job.stopping) return;
  job.stopping = true;
  job.kill_at = absl::Now() + options_.grace;
  for (auto& r : job.ranks) {
    if (r->exited || r->pid == 0) continue;
    r->stop_sent = true;
    kill(-r->pid, SIGTERM);
  }
  Log(job.job_id, job.attempt, -1, "agent",
      absl::StrCat("stopping the job's ranks (", why, "): SIGTERM, SIGKILL after ",
                   absl::FormatDuration(options_.grace)));
}

void Agent::KillOverdue() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  for (auto& [key, job] : jobs_) {
    if (!job->stopping || now < job->kill_at) continue;
    for (auto& r : job->ranks) {
      if (!r->exited && r->pid != 0 && GroupAlive(r->pid)) kill(-r->pid, SIGKILL);
    }
  }
}

void Agent::Reap() {
  std::vector<std::unique_ptr<JobRun>> done;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      bool all = !it->second->ranks.empty();
      for (auto& r : it->second->ranks) all = all && r->exited;
      if (all) {
        done.push_back(std::move(it->second));
        it = jobs_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& job : done) {
    for (auto& r : job->ranks) {
      if (r->waiter.joinable()) r->waiter.join();
    }
    std::error_code ec;
    std::filesystem::remove(absl::StrCat(options_.work_dir, "/", job->job_id, ".attempt-", job->attempt, ".spec"), ec);
  }
}

}  // namespace plateau
