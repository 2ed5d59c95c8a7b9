#include "worker/agent.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/connection.h"
#include "google/protobuf/util/json_util.h"
#include "proto/timestamps.h"
#include "proto/utf8.h"
#include "worker/assignment.h"
#include "worker/device_slots.h"
#include "worker/rank_protocol.h"

extern char** environ;

namespace plateau {
namespace {

bool GroupAlive(pid_t pgid) { return kill(-pgid, 0) == 0 || errno == EPERM; }

// Where the agent keeps the id the coordinator gave it, so that a restarted
// agent registers under the same id (one row in `plateauctl workers`, one
// heartbeat series) instead of as a new worker.
std::string IdFile(const std::string& work_dir) { return work_dir + "/worker_id"; }

std::string ReadId(const std::string& work_dir) {
  std::ifstream in(IdFile(work_dir));
  std::string id;
  std::getline(in, id);
  return id;
}

// Written to a temporary file and renamed: a crash leaves the old id or the
// new one, never half of one.
void WriteId(const std::string& work_dir, const std::string& id) {
  const std::string tmp = IdFile(work_dir) + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << id << "\n";
    if (!out) {
      std::fprintf(stderr, "plateau_worker: cannot write %s: the next start registers as a new worker\n",
                   tmp.c_str());
      return;
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, IdFile(work_dir), ec);
  if (ec) std::fprintf(stderr, "plateau_worker: cannot write %s: %s\n", IdFile(work_dir).c_str(), ec.message().c_str());
}

}  // namespace

Agent::Agent(AgentOptions options) : options_(std::move(options)) {
  channel_ = options_.channel
                 ? options_.channel
                 : grpc::CreateChannel(options_.coordinator, grpc::InsecureChannelCredentials());
  stub_ = v1::WorkerService::NewStub(channel_);
}

namespace {
const char* ChannelStateName(grpc_connectivity_state state) {
  switch (state) {
    case GRPC_CHANNEL_IDLE:
      return "idle";
    case GRPC_CHANNEL_CONNECTING:
      return "connecting";
    case GRPC_CHANNEL_READY:
      return "ready";
    case GRPC_CHANNEL_TRANSIENT_FAILURE:
      return "transient failure";
    case GRPC_CHANNEL_SHUTDOWN:
      return "shut down";
  }
  return "unknown";
}
}  // namespace

Agent::SpawnThread::SpawnThread() : thread_([this] { Loop(); }) {}

Agent::SpawnThread::~SpawnThread() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void Agent::SpawnThread::Run(const std::function<void()>& f) {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](SpawnThread* t) ABSL_NO_THREAD_SAFETY_ANALYSIS { return t->task_ == nullptr; }, this));
  task_ = &f;
  std::pair<SpawnThread*, int64_t> mine{this, ++issued_};
  mu_.Await(absl::Condition(
      +[](std::pair<SpawnThread*, int64_t>* w)
           ABSL_NO_THREAD_SAFETY_ANALYSIS { return w->first->finished_ >= w->second; },
      &mine));
}

void Agent::SpawnThread::Loop() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    mu_.Await(absl::Condition(
        +[](SpawnThread* t) ABSL_NO_THREAD_SAFETY_ANALYSIS { return t->task_ != nullptr || t->stop_; }, this));
    if (task_ == nullptr) return;  // stopping, nothing left to run
    (*task_)();
    task_ = nullptr;
    ++finished_;
  }
}

Agent::~Agent() {
  // Run() has stopped every rank; their waiters end with them, whether or
  // not their exit reached the coordinator.
  std::map<std::string, std::unique_ptr<JobRun>> jobs;
  {
    absl::MutexLock lock(&mu_);
    jobs.swap(jobs_);
  }
  for (auto& [key, job] : jobs) {
    for (auto& r : job->ranks) {
      if (r->waiter.joinable()) r->waiter.join();
    }
  }
}

std::unique_ptr<grpc::ClientContext> Agent::Context(absl::Duration timeout) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
  return ctx;
}

std::string Agent::worker_id() {
  absl::MutexLock lock(&id_mu_);
  return worker_id_;
}

void Agent::RunningJobs(google::protobuf::RepeatedPtrField<v1::RunningJob>* out) {
  absl::MutexLock lock(&mu_);
  for (auto& [key, job] : jobs_) {
    v1::RunningJob* r = out->Add();
    r->set_job_id(job->job_id);
    r->set_attempt(job->attempt);
    for (auto& rank : job->ranks) {
      if (!rank->exit_acked) r->add_ranks(rank->rank);
    }
  }
}

absl::Status Agent::RegisterNow(bool again) {
  v1::RegisterRequest req;
  *req.mutable_capabilities() = options_.capabilities;
  if (again) {
    req.set_worker_id(worker_id());
    RunningJobs(req.mutable_running());
  } else {
    // A fresh start asks for the id of its previous run, if any, and says
    // it is one (RegisterRequest.agent_started).
    req.set_worker_id(ReadId(options_.work_dir));
    req.set_agent_started(true);
  }
  v1::RegisterResponse resp;
  auto ctx = Context(absl::Seconds(5));
  const int64_t sent = MonotonicNanos();
  grpc::Status s = stub_->Register(ctx.get(), req, &resp);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("cannot register with the coordinator at ", options_.coordinator, ": ",
                                     s.error_message()));
  }
  {
    absl::MutexLock lock(&id_mu_);
    worker_id_ = resp.worker_id();
  }
  if (resp.worker_id() != req.worker_id()) WriteId(options_.work_dir, resp.worker_id());
  if (resp.heartbeat_interval_ms() > 0) heartbeat_interval_ = absl::Milliseconds(resp.heartbeat_interval_ms());
  std::printf("plateau_worker: %s as %s with the coordinator at %s (%s, %d device(s), %d job(s) running)\n",
              again || resp.worker_id() == req.worker_id() ? "registered again" : "registered",
              resp.worker_id().c_str(), options_.coordinator.c_str(),
              options_.capabilities.backend() == v1::BACKEND_CUDA ? "cuda" : "cpu",
              options_.capabilities.devices(), req.running_size());
  std::fflush(stdout);
  absl::MutexLock lock(&mu_);
  ApplyCancellations(resp.cancellations(), "the coordinator did not re-attach it");
  RenewLease(sent);
  return absl::OkStatus();
}

void Agent::ApplyCancellations(const google::protobuf::RepeatedPtrField<v1::Cancellation>& cancellations,
                               const std::string& why) {
  for (const v1::Cancellation& c : cancellations) {
    auto it = jobs_.find(absl::StrCat(c.job_id(), "/", c.attempt()));
    if (it != jobs_.end()) StopJob(*it->second, why);
  }
}

void Agent::RenewLease(int64_t sent) {
  if (lease_ > absl::ZeroDuration()) lease_until_ = sent + absl::ToInt64Nanoseconds(lease_);
  for (auto& [key, job] : jobs_) {
    if (job->stopping) continue;  // StopJob took its ranks off the lease
    for (auto& r : job->ranks) {
      if (r->lease != nullptr) r->lease->SetEnd(lease_until_);
    }
  }
}

void Agent::Fence() {
  absl::MutexLock lock(&mu_);
  const int64_t now = MonotonicNanos();
  const bool lapsed = now > lease_until_;
  // Ranks that stopped themselves while this agent did not answer (frozen,
  // or too slow to fence them): the lease holds again, so they resume. Sent
  // again on every pass while the mark stays, so a SIGCONT that beat the
  // rank's own SIGSTOP is repeated.
  for (auto& [key, job] : jobs_) {
    if (lapsed || job->frozen || job->stopping) continue;
    for (auto& r : job->ranks) {
      if (r->exited || r->pid == 0 || r->lease == nullptr) continue;
      const bool stopped = r->lease->self_stopped();
      if (stopped) kill(-r->pid, SIGCONT);
      if (stopped && r->exiting_at >= 0) r->exiting_at = now;  // its teardown resumes now
      if (stopped && !r->self_stop_logged) {
        Log(job->job_id, job->attempt, r->rank, "agent",
            absl::StrCat("rank ", r->rank, " had stopped itself (its lease lapsed while this agent did not answer); "
                         "the lease holds again: it resumes (SIGCONT)"));
      }
      r->self_stop_logged = stopped;
    }
  }
  for (auto& [key, job] : jobs_) {
    if (lapsed == job->frozen) continue;
    if (!lapsed && job->stopping) continue;  // a frozen job being stopped stays frozen until killed
    job->frozen = lapsed;
    for (auto& r : job->ranks) {
      if (!r->exited && r->pid != 0) kill(-r->pid, lapsed ? SIGSTOP : SIGCONT);
      if (!lapsed && r->exiting_at >= 0) r->exiting_at = now;  // its teardown resumes now
    }
    Log(job->job_id, job->attempt, -1, "agent",
        lapsed ? absl::StrCat("fenced: no answer from the coordinator for ",
                              absl::FormatDuration(absl::Trunc(absl::Nanoseconds(now - lease_until_) + lease_, absl::Milliseconds(1))),
                              " (lease ", absl::FormatDuration(lease_),
                              "); the job's ranks are frozen (SIGSTOP) until it answers")
               : std::string("the coordinator answers again and kept the attempt: the ranks resume (SIGCONT)"));
  }
}

absl::Status Agent::Run() {
  std::error_code ec;
  std::filesystem::create_directories(options_.work_dir, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("work_dir: ", options_.work_dir, ": ", ec.message()));
  // Spec files an earlier agent of this work dir left when it was killed
  // (Reap removes them as jobs end): their ranks died with it.
  for (const auto& entry : std::filesystem::directory_iterator(options_.work_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (absl::StrContains(name, ".attempt-") && absl::EndsWith(name, ".spec")) {
      std::filesystem::remove(entry.path(), ec);
    }
  }
  // Register, retrying while the coordinator starts: said at once, then
  // every minute while it lasts (an agent pointed at the wrong address
  // would otherwise wait in silence).
  bool registered = false;
  const absl::Time first_try = absl::Now();
  absl::Time said_at = absl::InfinitePast();
  while (!stop_.load()) {
    absl::Status s = RegisterNow(/*again=*/false);
    if (s.ok()) {
      registered = true;
      break;
    }
    if (s.code() != absl::StatusCode::kUnavailable && s.code() != absl::StatusCode::kDeadlineExceeded) return s;
    const absl::Time now = absl::Now();
    if (now - said_at >= absl::Minutes(1)) {
      std::fprintf(stderr, "plateau_worker: %s; retrying%s\n", std::string(s.message()).c_str(),
                   said_at == absl::InfinitePast()
                       ? ""
                       : absl::StrFormat(" (for %.0f s)", absl::ToDoubleSeconds(now - first_try)).c_str());
      said_at = now;
    }
    PauseBeforeRetry(*channel_, absl::Milliseconds(500));
  }
  if (!registered) {
    // Stopped (SIGTERM) before any answer: nothing was placed here, so
    // there is nothing to tell the coordinator or to stop. A heartbeat
    // would only fail and read as if this worker had been registered.
    std::fprintf(stderr, "plateau_worker: stopped before it registered with the coordinator at %s\n",
                 options_.coordinator.c_str());
    return absl::OkStatus();
  }
  std::thread sender([this] {
    while (!stop_.load()) {
      absl::SleepFor(absl::Milliseconds(200));
      Flush();
    }
  });
  // Heartbeats on their own thread: nothing the agent does (spawning,
  // reaping, a slow report) may delay them into a "worker lost".
  std::thread heartbeat([this] { HeartbeatLoop(); });
  while (!stop_.load()) {
    Fence();
    KillOverdue();
    Reap();
    absl::SleepFor(absl::Milliseconds(50));
  }
  // The heartbeat thread says the worker is leaving before any rank is
  // stopped, so that the coordinator fails their attempts as left by this
  // worker (not as the ranks' crash their stop would look like) and places
  // nothing more here; after that it starts nothing.
  while (!heartbeat_stopping_.load()) absl::SleepFor(absl::Milliseconds(10));
  // Stop everything this agent started, and wait until it is gone.
  {
    absl::MutexLock lock(&mu_);
    for (auto& [key, job] : jobs_) StopJob(*job, "the worker agent is shutting down");
  }
  sender.join();
  // Exit reports are sent for at most a few seconds more: a coordinator
  // that is gone must not keep the agent from exiting.
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  while (true) {
    KillOverdue();
    Flush();
    Reap();
    absl::MutexLock lock(&mu_);
    bool exited = true;
    for (auto& [key, job] : jobs_) {
      for (auto& r : job->ranks) exited = exited && r->exited;
    }
    if (jobs_.empty() || (exited && absl::Now() > give_up)) break;
    mu_.Unlock();
    absl::SleepFor(absl::Milliseconds(50));
    mu_.Lock();
  }
  ranks_gone_.store(true);
  heartbeat.join();
  return absl::OkStatus();
}

void Agent::HeartbeatLoop() {
  bool early = false;  // the last heartbeat went before its time
  while (!stop_.load()) {
    const absl::Time next = absl::Now() + heartbeat_interval_;
    HeartbeatOnce();
    const bool may_go_early = !early;
    early = false;
    while (!stop_.load() && absl::Now() < next) {
      if (reachable_) {
        absl::SleepFor(absl::Milliseconds(20));
        continue;
      }
      // Failing: heartbeat the moment the channel connects again, so that a
      // restarted coordinator hears from this worker within its re-attach
      // window (client/connection.h says why a sleep would not do). Early
      // at most every other heartbeat: a peer that accepts and drops every
      // connection must not make this a busy loop.
      if (PauseBeforeRetry(*channel_, std::min(next - absl::Now(), absl::Milliseconds(100))) &&
          may_go_early) {
        early = true;
        break;
      }
    }
  }
  // Shutting down: the coordinator hears it first (one try, as any
  // heartbeat), then the heartbeats go on, saying so, while Run stops the
  // ranks: the worker is not expired, nor its lease lapsed, while they exit.
  HeartbeatOnce(/*leaving=*/true);
  heartbeat_stopping_.store(true);
  while (!ranks_gone_.load()) {
    const absl::Time next = absl::Now() + heartbeat_interval_;
    while (!ranks_gone_.load() && absl::Now() < next) absl::SleepFor(absl::Milliseconds(20));
    if (!ranks_gone_.load()) HeartbeatOnce(/*leaving=*/true);
  }
}

void Agent::Answered() {
  if (!reachable_) {
    std::fprintf(stderr, "plateau_worker: the coordinator at %s answers again after %.1f s\n",
                 options_.coordinator.c_str(), absl::ToDoubleSeconds(absl::Now() - failing_since_));
  }
  reachable_ = true;
}

void Agent::HeartbeatOnce(bool leaving) {
  v1::HeartbeatRequest req;
  req.set_worker_id(worker_id());
  req.set_leaving(leaving);
  req.set_beat(++beats_);
  RunningJobs(req.mutable_running());
  v1::HeartbeatResponse resp;
  auto ctx = Context(absl::Seconds(5));
  const int64_t sent = MonotonicNanos();
  grpc::Status s = stub_->Heartbeat(ctx.get(), req, &resp);
  if (s.error_code() == grpc::StatusCode::NOT_FOUND && leaving) return;  // gone already: nothing to tell
  if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
    // The coordinator does not know this worker (it restarted, or declared
    // it lost): register again with what still runs here.
    std::fprintf(stderr, "plateau_worker: %s\n", s.error_message().c_str());
    absl::Status r = RegisterNow(/*again=*/true);
    if (!r.ok()) {
      std::fprintf(stderr, "plateau_worker: %s\n", std::string(r.message()).c_str());
    } else {
      Answered();
    }
    return;
  }
  if (!s.ok()) {
    // Said once, then every 10 s while it lasts, with the channel's state:
    // how long heartbeats fail decides whether a restarted coordinator
    // re-attaches this worker's jobs.
    const absl::Time now = absl::Now();
    if (reachable_) failing_since_ = now;
    if (reachable_ || now - failing_said_ >= absl::Seconds(10)) {
      std::fprintf(
          stderr, "plateau_worker: heartbeat to %s failing for %.1f s (channel %s): %s; retrying\n",
          options_.coordinator.c_str(), absl::ToDoubleSeconds(now - failing_since_),
          ChannelStateName(channel_->GetState(false)), s.error_message().c_str());
      failing_said_ = now;
    }
    reachable_ = false;
    return;
  }
  Answered();
  // Cancellations before the renewal: a frozen attempt the coordinator
  // voided must be killed, never resumed by the renewed lease.
  {
    absl::MutexLock lock(&mu_);
    ApplyCancellations(resp.cancellations(), "cancelled by the coordinator");
    if (resp.lease_ms() > 0) lease_ = absl::Milliseconds(resp.lease_ms());
    RenewLease(sent);
  }
  // A leaving worker starts nothing. The coordinator places nothing on it
  // once it has heard, and withdraws what it had not yet delivered when it
  // fails the attempts there (StopRanks), so no answer to a leaving
  // heartbeat holds an assignment (coordinator_test
  // AnAssignmentNotYetCollectedByALeavingWorkerFailsItsAttemptAtOnce).
  if (!leaving) {
    for (const v1::Assignment& a : resp.assignments()) Start(a);
  }
  // Again for attempts this answer both started and cancelled.
  absl::MutexLock lock(&mu_);
  ApplyCancellations(resp.cancellations(), "cancelled by the coordinator");
}

namespace {
// A batch closes at this size, far below any request limit of the
// coordinator; the queue holds at most kMaxQueued bytes of telemetry and
// logs (status reports always fit) while the coordinator is away.
constexpr size_t kBatchBytes = 256 << 10;
constexpr size_t kMaxQueued = 256 << 20;
}  // namespace

void Agent::CloseBatch() {
  if (batch_.telemetry.steps_size() == 0 && batch_.telemetry.logs_size() == 0) return;
  batch_.telemetry.set_sender(sender_);
  batch_.telemetry.set_batch(++batches_);
  queued_bytes_ += batch_.bytes;
  queue_.push_back(std::move(batch_));
  batch_ = Report();
}

void Agent::Log(const std::string& job_id, int attempt, int rank, const std::string& stream,
                const std::string& line) {
  absl::MutexLock lock(&out_mu_);
  if (queued_bytes_ > kMaxQueued) {
    ++dropped_lines_;
    return;
  }
  if (dropped_lines_ > 0) {
    v1::LogEntry* d = batch_.telemetry.add_logs();
    d->set_job_id(job_id);
    d->set_attempt(attempt);
    d->set_rank(-1);
    d->set_stream("agent");
    d->set_line(absl::StrCat(dropped_lines_, " log line(s) of this worker's jobs were dropped: the coordinator "
                             "was unreachable and the agent's queue was full"));
    dropped_lines_ = 0;
  }
  v1::LogEntry* l = batch_.telemetry.add_logs();
  l->set_job_id(job_id);
  l->set_attempt(attempt);
  l->set_rank(rank);
  l->set_stream(stream);
  // Repaired here, where the batch is sized: U+FFFD is 3 bytes for each bad
  // one, and a line grown past the cut would make a batch larger than the
  // coordinator's --max_request_bytes allows (proto/utf8.h).
  if (IsValidUtf8(line)) {
    l->set_line(line);
  } else {
    const std::string fixed = ToValidUtf8(line);
    l->set_line(std::string(Utf8Prefix(fixed, kMaxRankOutputLineBytes)));
  }
  Now(l->mutable_time());
  batch_.bytes += l->line().size() + 64;
  if (batch_.bytes > kBatchBytes) CloseBatch();
}

void Agent::QueueStatus(v1::RankStatusRequest status, Rank* rank) {
  absl::MutexLock lock(&out_mu_);
  CloseBatch();
  Report r;
  r.is_status = true;
  r.status = std::move(status);
  r.rank = rank;
  queue_.push_back(std::move(r));
}

void Agent::Flush() {
  absl::MutexLock send(&send_mu_);
  {
    absl::MutexLock lock(&out_mu_);
    CloseBatch();
  }
  const std::string id = worker_id();
  while (!id.empty()) {
    Report r;
    {
      absl::MutexLock lock(&out_mu_);
      if (queue_.empty()) return;
      r = queue_.front();  // a copy: it stays queued until delivered
    }
    grpc::Status s;
    auto ctx = Context(absl::Seconds(5));
    if (r.is_status) {
      r.status.set_worker_id(id);
      v1::RankStatusResponse resp;
      s = stub_->ReportRankStatus(ctx.get(), r.status, &resp);
    } else {
      r.telemetry.set_worker_id(id);
      v1::TelemetryResponse resp;
      s = stub_->ReportTelemetry(ctx.get(), r.telemetry, &resp);
    }
    // Kept for later: the coordinator is away, slow, or does not know this
    // worker yet (the heartbeat thread registers it again).
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE || s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
        s.error_code() == grpc::StatusCode::NOT_FOUND) {
      return;
    }
    if (!s.ok()) {
      std::fprintf(stderr, "plateau_worker: the coordinator refused a report (gRPC code %d, dropped): %s\n",
                   static_cast<int>(s.error_code()), s.error_message().c_str());
    }
    {
      absl::MutexLock lock(&out_mu_);
      if (!r.is_status) queued_bytes_ -= std::min(queued_bytes_, queue_.front().bytes);
      queue_.pop_front();
    }
    // Never out_mu_ then mu_: StopJob logs under mu_.
    if (r.rank != nullptr && r.status.has_exited()) {
      absl::MutexLock jobs(&mu_);
      r.rank->exit_acked = true;
    }
  }
}

void Agent::Start(const v1::Assignment& a) {
  const std::string key = absl::StrCat(a.job_id(), "/", a.attempt());
  {
    // The coordinator sends an assignment again when it cannot tell that
    // it arrived (the answer that carried it may have been lost); one that
    // did arrive is running here and is not started twice.
    absl::MutexLock lock(&mu_);
    if (jobs_.count(key)) return;
  }
  auto job = std::make_unique<JobRun>();
  job->job_id = a.job_id();
  job->attempt = a.attempt();
  // The job id names a file here: checked before anything is written (an
  // assignment this agent cannot trust starts no rank, each reported).
  absl::Status spec_written = CheckAssignment(a);
  // The coordinator's (or whoever poses as it) fault: the job fails
  // INVALID, not restarted. (Its paths are checked by the rank itself,
  // against the --allowed_paths passed on.)
  const bool refused = !spec_written.ok();
  const std::string spec_file = absl::StrCat(options_.work_dir, "/", a.job_id(), ".attempt-", a.attempt(), ".spec");
  // A spec that could not be written whole (a full work disk) starts no
  // rank: a truncated one could parse with its last fields missing.
  if (spec_written.ok()) {
    job->spec_file = spec_file;  // a path of ours: removed when the attempt ends
    std::ofstream out(spec_file, std::ios::binary | std::ios::trunc);
    out << a.spec().SerializeAsString();
    out.close();
    if (!out) {
      spec_written =
          absl::UnavailableError(absl::StrCat("cannot write the job's spec to ", spec_file, ": ", strerror(errno)));
    }
  }
  JobRun* j = job.get();
  absl::StatusOr<std::vector<int>> slots;
  {
    absl::MutexLock lock(&mu_);
    // Chosen before any rank starts; Start runs on the heartbeat thread
    // only, so no other assignment takes these slots meanwhile.
    slots = FreeDeviceSlots(options_.capabilities.devices(), SlotsInUse(), a.ranks_size());
    jobs_[key] = std::move(job);
  }
  const bool cuda = options_.capabilities.backend() == v1::BACKEND_CUDA;
  const std::vector<std::string> base_env = ProcessEnvironment();
  for (int i = 0; i < a.ranks_size(); ++i) {
    const int r = a.ranks(i);
    auto rank = std::make_unique<Rank>();
    rank->rank = r;
    // The rank's device: its slot's GPU as the only one it sees (CUDA), or
    // the slot number (CPU, where the backend ignores it).
    absl::Status device_ok = spec_written.ok() ? slots.status() : spec_written;
    int device_index = 0;
    std::string visible_devices;
    std::vector<std::string> env = base_env;
    if (device_ok.ok()) {
      rank->slot = (*slots)[i];
      if (cuda) {
        absl::StatusOr<std::vector<std::string>> cuda_env = CudaRankEnvironment(base_env, rank->slot, &visible_devices);
        device_ok = cuda_env.status();
        if (cuda_env.ok()) env = *std::move(cuda_env);
      } else {
        device_index = rank->slot;
      }
    }
    std::vector<std::string> args = {
        options_.rank_binary,
        absl::StrCat("--coordinator=", options_.coordinator),
        absl::StrCat("--job_id=", a.job_id()),
        absl::StrCat("--attempt=", a.attempt()),
        absl::StrCat("--rank=", r),
        absl::StrCat("--spec_file=", spec_file),
        absl::StrCat("--kv_prefix=", a.kv_prefix()),
        absl::StrCat("--hostname=", options_.capabilities.rank_address()),
        absl::StrCat("--device_index=", device_index),
        absl::StrCat("--device_peak_flops=", options_.capabilities.device_peak_flops()),
        absl::StrCat("--device_peak_bf16_flops=", options_.capabilities.device_peak_bf16_flops())};
    for (std::string& arg : ConnectionFileArgs(options_.files)) args.push_back(std::move(arg));
    if (!options_.allowed_paths.empty()) {
      args.push_back(absl::StrCat("--allowed_paths=", absl::StrJoin(options_.allowed_paths, ",")));
    }
    // The lease's page, as descriptor kRankLeaseFd in the rank.
    if (absl::StatusOr<std::unique_ptr<RankLease>> lease = RankLease::Create(); lease.ok()) {
      rank->lease = std::move(*lease);
      absl::MutexLock lock(&mu_);
      rank->lease->SetEnd(lease_until_);
      args.push_back(absl::StrCat("--lease_fd=", kRankLeaseFd));
    } else {
      Log(a.job_id(), a.attempt(), r, "agent",
          absl::StrCat("rank ", r, " gets no lease of its own (", lease.status().message(),
                       "): only this agent can freeze it"));
    }
    std::vector<char*> argv;
    for (std::string& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    std::vector<char*> envp;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    int out[2], err[2];
    bool piped = device_ok.ok() && pipe2(out, O_CLOEXEC) == 0;
    if (piped && pipe2(err, O_CLOEXEC) != 0) {
      close(out[0]);
      close(out[1]);
      piped = false;
    }
    pid_t pid = 0;
    int rc = piped ? 0 : device_ok.ok() ? errno : EINVAL;
    if (piped) {
      posix_spawn_file_actions_t fa;
      posix_spawn_file_actions_init(&fa);
      posix_spawn_file_actions_adddup2(&fa, out[1], 1);
      posix_spawn_file_actions_adddup2(&fa, err[1], 2);
      if (rank->lease != nullptr) posix_spawn_file_actions_adddup2(&fa, rank->lease->fd(), kRankLeaseFd);
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
      spawner_.Run([&] { rc = posix_spawn(&pid, options_.rank_binary.c_str(), &fa, &attr, argv.data(), envp.data()); });
      posix_spawn_file_actions_destroy(&fa);
      posix_spawnattr_destroy(&attr);
      close(out[1]);
      close(err[1]);
    }
    v1::RankStatusRequest report;
    report.set_job_id(a.job_id());
    report.set_attempt(a.attempt());
    report.set_rank(r);
    Rank* rp = rank.get();
    if (rc != 0) {
      if (piped) {
        close(out[0]);
        close(err[0]);
      }
      const std::string msg = device_ok.ok()
                                  ? absl::StrCat("cannot start ", options_.rank_binary, ": ", strerror(rc))
                                  : absl::StrCat("cannot start rank ", r, ": ", device_ok.message());
      Log(a.job_id(), a.attempt(), r, "agent", msg);
      rp->exited = true;
      v1::RankExited* e = report.mutable_exited();
      // An assignment this agent refused is the job's fault: INVALID, not
      // a crash to restart. Anything else (a full disk, its own devices)
      // may pass.
      e->set_exit_code(refused ? kRankExitInvalidJob : 127);
      e->set_message(msg);
      e->set_process_group_empty(true);
      QueueStatus(report, rp);
      absl::MutexLock lock(&mu_);
      j->ranks.push_back(std::move(rank));
      StopJob(*j, "a rank could not be started");
    } else {
      rp->pid = pid;
      Log(a.job_id(), a.attempt(), r, "agent",
          absl::StrCat("started rank ", r, " as pid ", pid, " (process group ", pid, ") on device slot ", rp->slot,
                       cuda ? absl::StrCat(" (CUDA_VISIBLE_DEVICES=", visible_devices, ")") : ""));
      rp->readers.emplace_back([this, j, rp, fd = out[0]] { ReadPipe(j, rp, fd, true); });
      rp->readers.emplace_back([this, j, rp, fd = err[0]] { ReadPipe(j, rp, fd, false); });
      report.mutable_started()->set_pid(pid);
      // Queued before the waiter exists, so that "started" precedes "exited".
      QueueStatus(report, nullptr);
      absl::MutexLock lock(&mu_);
      // A renewal since the page was made did not reach this rank yet.
      if (rp->lease != nullptr) rp->lease->SetEnd(lease_until_);
      j->ranks.push_back(std::move(rank));
      if (j->stopping) {
        // StopJob ran while this rank was being spawned (an earlier rank
        // could not start): stopped as it would have stopped it.
        rp->stop_sent = true;
        if (rp->lease != nullptr) rp->lease->SetEnd(RankLease::kNever);
        kill(-pid, SIGTERM);
      }
      rp->waiter = std::thread([this, j, rp] { Wait(j, rp); });
    }
  }
  absl::MutexLock lock(&mu_);
  j->starting = false;
}

std::vector<int> Agent::SlotsInUse() {
  std::vector<int> in_use;
  for (auto& [key, job] : jobs_) {
    for (auto& r : job->ranks) {
      if (!r->exited && r->slot >= 0) in_use.push_back(r->slot);
    }
  }
  return in_use;
}

void Agent::ReadPipe(JobRun* job, Rank* rank, int fd, bool is_stdout) {
  std::string buf, line;
  char chunk[4096];
  auto handle = [&](const std::string& l) {
    if (is_stdout && !l.empty() && l[0] == '{') {
      v1::RankOutput out;
      if (google::protobuf::util::JsonStringToMessage(l, &out).ok()) {
        // Once, as it arrives (log lines are repaired in Log): a string
        // here that is not UTF-8 (an error naming a Latin-1 path) would
        // make the coordinator refuse the whole report it ends up in.
        MakeStringsValidUtf8(out);
        if (out.has_step()) {
          absl::MutexLock lock(&out_mu_);
          v1::TelemetryRequest::Step* s = batch_.telemetry.add_steps();
          s->set_job_id(job->job_id);
          *s->mutable_telemetry() = out.step();
          batch_.bytes += l.size();
          if (batch_.bytes > kBatchBytes) CloseBatch();
          return;
        }
        if (out.has_error()) {
          absl::MutexLock lock(&mu_);
          rank->last_error = out.error();
          return;
        }
        if (out.has_exiting()) {
          absl::MutexLock lock(&mu_);
          if (rank->exiting_at < 0) {
            rank->exiting_at = MonotonicNanos();
            rank->exiting_code = out.exiting().exit_code();
          }
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
    if (buf.size() > kMaxRankOutputLineBytes) {  // an endless line: cut it
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
  report.set_job_id(job->job_id);
  report.set_attempt(job->attempt);
  report.set_rank(rank->rank);
  v1::RankExited* e = report.mutable_exited();
  bool failed;
  std::string how;
  {
    absl::MutexLock lock(&mu_);
    // Killed by this agent (its teardown overran, or the job was stopped)
    // after it said its exit code: its work was over, so it counts as
    // having exited with that code, not as stopped; an error it reported
    // (an out-of-memory, say) is not lost to the stop. A signal from
    // anywhere else (a crash in its teardown) stays a signal.
    const int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    const bool teardown_kill = rank->exiting_at >= 0 && ((rank->killed_in_teardown && sig == SIGKILL) ||
                                                         (rank->stop_sent && (sig == SIGTERM || sig == SIGKILL)));
    if (teardown_kill) {
      e->set_signal(sig);
      e->set_exit_code(rank->exiting_code);
      e->set_killed_in_teardown(true);
      how = absl::StrCat(
          "said it was exiting with code ", rank->exiting_code, " and was killed in its teardown (signal ", sig, ", ",
          rank->killed_in_teardown
              ? absl::StrCat("not finished within --teardown_s=", absl::ToDoubleSeconds(options_.teardown))
              : std::string("the job was being stopped"),
          ")");
    } else if (sig != 0) {
      e->set_signal(sig);
      how = absl::StrCat("killed by signal ", sig, " (", strsignal(sig), ")");
    } else {
      e->set_exit_code(WEXITSTATUS(status));
      how = absl::StrCat("exited with code ", WEXITSTATUS(status));
    }
    // A rank stopped without an error of its own says why it was stopped
    // ("rank 1 was stopped by its agent: the worker agent is shutting down").
    const bool stopped = rank->stop_sent && !teardown_kill;
    e->set_message(stopped && rank->last_error.message().empty() ? job->stop_reason : rank->last_error.message());
    e->set_error_code(rank->last_error.code());
    e->set_live_set(rank->last_error.live_set());
    if (rank->last_error.has_out_of_memory()) {
      *e->mutable_out_of_memory() = rank->last_error.out_of_memory();
    }
    e->set_process_group_empty(!GroupAlive(rank->pid));
    e->set_stopped_by_agent(stopped);
    failed =
        teardown_kill ? rank->exiting_code != 0 : !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  Log(job->job_id, job->attempt, rank->rank, "agent", absl::StrCat("rank ", rank->rank, " (pid ", rank->pid, ") ", how));
  // Exited (its device slot free) before the coordinator can hear of it:
  // once it has, it may place the next job here at once, and that job's
  // ranks must find the slot free.
  {
    absl::MutexLock lock(&mu_);
    rank->exited = true;
  }
  // After its telemetry and logs; acknowledged (and the job forgotten) only
  // once the coordinator has it.
  QueueStatus(report, rank);
  absl::MutexLock lock(&mu_);
  if (failed && !job->stopping) StopJob(*job, absl::StrCat("rank ", rank->rank, " ", how));
}

void Agent::StopJob(JobRun& job, const std::string& why) {
  if (job.stopping) return;
  // Every rank has exited (a stop that crossed the last exit report):
  // nothing to stop, nothing to log.
  if (!job.ranks.empty() && !job.starting &&
      std::all_of(job.ranks.begin(), job.ranks.end(), [](const auto& r) { return r->exited; })) {
    return;
  }
  job.stopping = true;
  job.stop_reason = why;
  // Off the lease before any signal: a rank continued to see its SIGTERM
  // must not stop itself again for a lease that no longer concerns it.
  for (auto& r : job.ranks) {
    if (r->lease != nullptr) r->lease->SetEnd(RankLease::kNever);
  }
  if (job.frozen) {
    // Fenced, and its attempt is void now: no grace, it must not resume
    // even for a moment (it could finish a checkpoint write).
    job.kill_at = absl::Now();
    for (auto& r : job.ranks) {
      if (!r->exited && r->pid != 0) {
        r->stop_sent = true;
        kill(-r->pid, SIGKILL);
      }
    }
    Log(job.job_id, job.attempt, -1, "agent",
        absl::StrCat("killing the job's frozen ranks (", why, "): SIGKILL"));
    return;
  }
  job.kill_at = absl::Now() + options_.grace;
  for (auto& r : job.ranks) {
    if (r->exited || r->pid == 0) continue;
    r->stop_sent = true;
    kill(-r->pid, SIGTERM);
    kill(-r->pid, SIGCONT);  // a stopped (SIGSTOP) rank must see the SIGTERM too
  }
  Log(job.job_id, job.attempt, -1, "agent",
      absl::StrCat("stopping the job's ranks (", why, "): SIGTERM, SIGKILL after ",
                   absl::FormatDuration(options_.grace)));
}

void Agent::KillOverdue() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  const int64_t mono = MonotonicNanos();
  const int64_t teardown = absl::ToInt64Nanoseconds(options_.teardown);
  for (auto& [key, job] : jobs_) {
    // A stopped rank cannot tear down: a frozen job's ranks are not killed
    // here, and Fence restarts the clock of each rank it resumes.
    for (auto& r : job->ranks) {
      if (r->exited || r->pid == 0 || r->killed_in_teardown || job->frozen) continue;
      if (r->exiting_at < 0 || mono - r->exiting_at < teardown) continue;
      r->killed_in_teardown = true;
      kill(-r->pid, SIGKILL);
      Log(job->job_id, job->attempt, r->rank, "agent",
          absl::StrCat("rank ", r->rank, " said it was exiting with code ", r->exiting_code, " ",
                       absl::FormatDuration(absl::Trunc(absl::Nanoseconds(mono - r->exiting_at),
                                                        absl::Milliseconds(1))),
                       " ago and is still tearing down (--teardown_s=",
                       absl::ToDoubleSeconds(options_.teardown),
                       "): SIGKILL; its exit is reported with that code"));
    }
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
      bool all = !it->second->starting && !it->second->ranks.empty();
      for (auto& r : it->second->ranks) all = all && r->exited && r->exit_acked;
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
    if (!job->spec_file.empty()) std::filesystem::remove(job->spec_file, ec);
  }
}

}  // namespace plateau
