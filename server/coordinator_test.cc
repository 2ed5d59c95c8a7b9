// The coordinator's fault handling in process, with a real SQLite store and
// the agent's side played by direct calls: the restart paths that an
// end-to-end test cannot hit at will (an assignment not yet delivered, a
// cancel in flight, a worker that never comes back, a worker running a job
// the coordinator no longer has), hang detection, and retried reports.
#include "server/coordinator.h"

#include <signal.h>
#include <sqlite3.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster.h"
#include "worker/auto_spec_testing.h"
#include "worker/job_spec.h"
#include "worker/rank_protocol.h"

namespace plateau {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// For the tests about a worker's expiry: lost after three missed
// heartbeats (interval 100 ms).
constexpr absl::Duration kShortWorkerTimeout = absl::Milliseconds(300);

// A heartbeat as the agent sends it: its count and what it runs.
static v1::HeartbeatRequest Beat(const std::string& worker, int64_t beat,
                                 const std::vector<std::string>& running_jobs = {}) {
  v1::HeartbeatRequest req;
  req.set_worker_id(worker);
  req.set_beat(beat);
  for (const std::string& job : running_jobs) {
    v1::RunningJob* r = req.add_running();
    r->set_job_id(job);
    r->set_attempt(0);
    r->add_ranks(0);
    r->add_ranks(1);
  }
  return req;
}

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TEST_TMPDIR");
    // Run by hand (no TEST_TMPDIR): a directory of this process's own.
    dir_ = (tmp ? std::string(tmp) : absl::StrCat("/tmp/plateau-test-", getpid())) + "/" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    // One metrics server for all tests.
    static Metrics* const metrics = [] {
      auto m = Metrics::Create("127.0.0.1:0");
      return m.ok() ? m->release() : nullptr;
    }();
    ASSERT_NE(metrics, nullptr);
    metrics_ = metrics;
    options_.heartbeat_interval = absl::Milliseconds(100);
    // The tests play the worker and do not heartbeat between their calls:
    // a worker stays registered unless a test that is about its expiry
    // sets a short timeout (kShortWorkerTimeout) and reopens.
    options_.worker_timeout = absl::Seconds(30);
    options_.reattach_timeout = absl::Milliseconds(600);
    options_.tick = absl::Milliseconds(20);
    options_.log = [this](const std::string& line) {
      absl::MutexLock lock(&said_mu_);
      said_.push_back(line);
    };
    Open();
  }

  // The coordinator's own log so far, one line per entry.
  std::string Said() {
    absl::MutexLock lock(&said_mu_);
    return absl::StrJoin(said_, "\n");
  }

  // (Re)starts the coordinator on the same database: a restart.
  void Open() {
    coordinator_.reset();
    store_.reset();
    auto s = JobStore::Open(dir_ + "/state.db");
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(*s);
    coordinator_ = std::make_unique<Coordinator>(store_.get(), metrics_, options_);
    ASSERT_TRUE(coordinator_->Start().ok());
  }

  Coordinator& c() { return *coordinator_; }

  // The database as a crash of the coordinator now would leave it: every
  // committed transaction, WAL included (SQLite's online backup, from a
  // connection of its own, reads what a reopened database would), into
  // the file `to`.
  void Snapshot(const std::string& to) {
    sqlite3* from = nullptr;
    sqlite3* into = nullptr;
    ASSERT_EQ(sqlite3_open((dir_ + "/state.db").c_str(), &from), SQLITE_OK);
    ASSERT_EQ(sqlite3_open(to.c_str(), &into), SQLITE_OK);
    sqlite3_busy_timeout(from, 10000);  // the coordinator's loop may be writing
    sqlite3_backup* b = sqlite3_backup_init(into, "main", from, "main");
    ASSERT_NE(b, nullptr) << sqlite3_errmsg(into);
    EXPECT_EQ(sqlite3_backup_step(b, -1), SQLITE_DONE) << sqlite3_errmsg(into);
    EXPECT_EQ(sqlite3_backup_finish(b), SQLITE_OK) << sqlite3_errmsg(into);
    sqlite3_close(into);
    sqlite3_close(from);
  }

  // A coordinator killed when `snapshot` was taken, restarted: this one
  // (which went on meanwhile) gone, the database put back as the snapshot
  // left it, and a coordinator started on it.
  void RestartFrom(const std::string& snapshot) {
    coordinator_.reset();
    store_.reset();
    for (const char* suffix : {"-wal", "-shm"}) std::filesystem::remove(dir_ + "/state.db" + suffix);
    std::filesystem::rename(snapshot, dir_ + "/state.db");
    Open();
  }

  // How many cancellations worker `w` gets when it registers again running
  // ranks 0 and 1 of `job`'s attempt 0.
  int CancellationsAtRegister(const std::string& w, const std::string& job) {
    v1::RunningJob running;
    running.set_job_id(job);
    running.set_attempt(0);
    running.add_ranks(0);
    running.add_ranks(1);
    v1::RegisterResponse r;
    Register(w, {running}, &r);
    return r.cancellations_size();
  }

  // agent_started: as a fresh agent process registers
  // (RegisterRequest.agent_started).
  std::string Register(const std::string& old_id = "", const std::vector<v1::RunningJob>& running = {},
                       v1::RegisterResponse* out = nullptr, bool agent_started = false) {
    v1::RegisterRequest req;
    req.set_agent_started(agent_started);
    req.mutable_capabilities()->set_backend(v1::BACKEND_CPU);
    req.mutable_capabilities()->set_devices(2);
    req.mutable_capabilities()->set_rank_address("127.0.0.1");
    req.set_worker_id(old_id);
    for (const auto& r : running) *req.add_running() = r;
    auto resp = c().Register(req);
    EXPECT_TRUE(resp.ok()) << resp.status();
    if (out != nullptr && resp.ok()) *out = *resp;
    return resp.ok() ? resp->worker_id() : "";
  }

  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const std::string& worker) {
    v1::HeartbeatRequest req;
    req.set_worker_id(worker);
    return c().Heartbeat(req);
  }

  // Submits `spec` and has the coordinator send its assignment to `worker`
  // in the answer to heartbeat `beat` (each test then has that answer
  // arrive or be lost): the job's id.
  std::string SendAssignment(const std::string& worker, int64_t beat, v1::JobSpec spec = DemoJobSpec(2, 5)) {
    const std::string job = Submit(std::move(spec));
    auto hb = c().Heartbeat(Beat(worker, beat));
    EXPECT_TRUE(hb.ok()) << hb.status();
    EXPECT_EQ(hb.ok() ? hb->assignments_size() : 0, 1);
    return job;
  }

  absl::Status Started(const std::string& worker, const std::string& job, int rank) {
    v1::RankStatusRequest r;
    r.set_worker_id(worker);
    r.set_job_id(job);
    r.set_rank(rank);
    r.mutable_started()->set_pid(1000 + rank);
    return c().ReportRankStatus(r);
  }

  absl::Status Exited(const std::string& worker, const std::string& job, int rank, int code, int signal = 0,
                      bool stopped = false) {
    v1::RankStatusRequest r;
    r.set_worker_id(worker);
    r.set_job_id(job);
    r.set_rank(rank);
    r.mutable_exited()->set_exit_code(code);
    r.mutable_exited()->set_signal(signal);
    r.mutable_exited()->set_stopped_by_agent(stopped);
    r.mutable_exited()->set_process_group_empty(true);
    return c().ReportRankStatus(r);
  }

  // What the agent reports for a rank it killed in a hung teardown after
  // the rank said it was exiting with `code` (worker/agent.h).
  absl::Status KilledInTeardown(const std::string& worker, const std::string& job, int rank, int code,
                                const std::string& error_code = "", const std::string& message = "") {
    v1::RankStatusRequest r;
    r.set_worker_id(worker);
    r.set_job_id(job);
    r.set_rank(rank);
    v1::RankExited* e = r.mutable_exited();
    e->set_exit_code(code);
    e->set_signal(SIGKILL);
    e->set_killed_in_teardown(true);
    e->set_error_code(error_code);
    e->set_message(message);
    e->set_process_group_empty(true);
    return c().ReportRankStatus(r);
  }

  std::string Submit(v1::JobSpec spec) {
    v1::SubmitJobRequest req;
    *req.mutable_spec() = std::move(spec);
    auto resp = c().SubmitJob(req);
    EXPECT_TRUE(resp.ok()) << resp.status();
    return resp.ok() ? resp->job().id() : "";
  }

  v1::Job Get(const std::string& id) {
    auto j = c().GetJob(id);
    EXPECT_TRUE(j.ok()) << j.status();
    return j.ok() ? *j : v1::Job();
  }

  // Waits (polling) until the job is in `state`.
  bool WaitState(const std::string& id, v1::JobState state, absl::Duration d = absl::Seconds(10)) {
    const absl::Time end = absl::Now() + d;
    while (absl::Now() < end) {
      if (Get(id).state() == state) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return Get(id).state() == state;
  }

  // A job submitted, run on a fresh worker and ended by both ranks exiting
  // OK: SUCCEEDED (the caller asserts it); with `reports` rank step reports
  // of attempt 5 stored (a delete of more than 20,000 rows goes in parts).
  std::string SucceededJob(int reports = 0) {
    const std::string job = Submit(DemoJobSpec(2, 5));
    const std::string w = RunningJob(job);
    EXPECT_TRUE(Exited(w, job, 0, kRankExitOk).ok());
    EXPECT_TRUE(Exited(w, job, 1, kRankExitOk).ok());
    std::vector<JobRankStep> many(reports);
    for (int i = 0; i < reports; ++i) {
      many[i].job_id = job;
      many[i].telemetry.set_attempt(5);
      many[i].telemetry.set_step(i + 1);
    }
    if (reports > 0) {
      EXPECT_TRUE(store_->PutRankSteps(many).ok());
    }
    return job;
  }

  // A job placed on a fresh worker with both ranks started: returns the
  // worker id.
  std::string RunningJob(const std::string& job) {
    const std::string w = Register();
    StartOn(w, job);
    return w;
  }

  // The job's assignment delivered to worker `w` by its next heartbeat and
  // both ranks started there: the job is RUNNING.
  void StartOn(const std::string& w, const std::string& job) {
    auto hb = Heartbeat(w);
    ASSERT_TRUE(hb.ok()) << hb.status();
    ASSERT_EQ(hb->assignments_size(), 1);
    ASSERT_TRUE(Started(w, job, 0).ok());
    ASSERT_TRUE(Started(w, job, 1).ok());
    ASSERT_EQ(Get(job).state(), v1::RUNNING);
  }

  // Rank 0's telemetry of `steps`, as an agent batches it.
  // Reports of `steps` from each of `ranks` (step by step).
  // One log line of `job`'s rank 0 (stdout) from `worker`, as an agent
  // sends it; the returned line (the batch's only) to change further.
  static v1::TelemetryRequest LogLine(const std::string& worker, const std::string& job, const std::string& text) {
    v1::TelemetryRequest t;
    t.set_worker_id(worker);
    v1::LogEntry* e = t.add_logs();
    e->set_job_id(job);
    e->set_rank(0);
    e->set_stream("stdout");
    e->set_line(text);
    return t;
  }

  static v1::TelemetryRequest Steps(const std::string& worker, const std::string& job,
                                    std::vector<int64_t> steps, double loss = 2.0,
                                    std::vector<int> ranks = {0, 1}, int attempt = 0) {
    v1::TelemetryRequest t;
    t.set_worker_id(worker);
    for (int64_t step : steps) {
      for (int rank : ranks) {
        v1::TelemetryRequest::Step* s = t.add_steps();
        s->set_job_id(job);
        s->mutable_telemetry()->set_rank(rank);
        s->mutable_telemetry()->set_attempt(attempt);
        s->mutable_telemetry()->set_step(step);
        s->mutable_telemetry()->set_loss(loss);
        s->mutable_telemetry()->set_tokens(128);
        s->mutable_telemetry()->set_seconds(0.1);
      }
    }
    return t;
  }

  // The steps of the job's step events, in index order.
  std::vector<int64_t> StepEvents(const std::string& id) {
    std::vector<int64_t> out;
    auto events = store_->ReadEvents(id, 0, 100000);
    EXPECT_TRUE(events.ok()) << events.status();
    if (!events.ok()) return out;
    for (size_t i = 0; i < events->size(); ++i) {
      EXPECT_EQ((*events)[i].index(), static_cast<int64_t>(i));
      if ((*events)[i].has_job_step()) out.push_back((*events)[i].job_step().step());
    }
    return out;
  }

  static v1::RunningJob Runs(const std::string& job, int attempt, std::vector<int> ranks) {
    v1::RunningJob r;
    r.set_job_id(job);
    r.set_attempt(attempt);
    for (int x : ranks) r.add_ranks(x);
    return r;
  }

  std::string dir_;
  CoordinatorOptions options_;
  absl::Mutex said_mu_;
  std::vector<std::string> said_ ABSL_GUARDED_BY(said_mu_);
  Metrics* metrics_ = nullptr;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<Coordinator> coordinator_;
};

// A new job's warm-up must end before its last step: a submit (and its
// validate_only, and PlanJob, which answers what a submit would) of
// warmup_steps == steps is refused naming the field and the range.
TEST_F(CoordinatorTest, ASubmitRefusesAWarmUpAsLongAsTheJobNamingTheField) {
  v1::JobSpec spec = DemoJobSpec(2, 5);
  spec.mutable_optimizer()->set_lr_decay(v1::OptimizerSpec::LR_DECAY_COSINE);
  spec.mutable_optimizer()->set_warmup_steps(5);
  const std::string want = "optimizer.warmup_steps: expected 0 to steps - 1 = 4";
  for (const bool validate_only : {false, true}) {
    v1::SubmitJobRequest req;
    *req.mutable_spec() = spec;
    req.set_validate_only(validate_only);
    req.set_request_id(validate_only ? "" : "warm-up-5");
    auto resp = c().SubmitJob(req);
    EXPECT_EQ(resp.status().code(), absl::StatusCode::kInvalidArgument) << resp.status();
    EXPECT_THAT(resp.status().message(), HasSubstr(want));
  }
  v1::PlanJobRequest plan;
  *plan.mutable_spec() = spec;
  EXPECT_EQ(c().PlanJob(plan).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c().PlanJob(plan).status().message(), HasSubstr(want));
  // One step shorter: step 5, the last, runs at lr.
  spec.mutable_optimizer()->set_warmup_steps(4);
  EXPECT_FALSE(Submit(spec).empty());
}

// optimizer.warmup_steps == steps was accepted until 2026-12-07. A job
// accepted then and still pending in the store (or restarting) when the
// coordinator is upgraded is placed as before: placement checks the spec
// again (with `auto` settings: on the worker's memory, then the context
// they are chosen again with), and a rule for new specs must not strand
// it. With it applied there, the `auto` job stayed PENDING ("the `auto`
// settings chosen again ... do not admit it: optimizer.warmup_steps").
TEST_F(CoordinatorTest, AJobStoredWithAWarmUpAsLongAsTheJobIsStillPlaced) {
  std::vector<std::string> jobs;
  for (const bool with_auto : {false, true}) {
    v1::JobSpec spec = DemoJobSpec(2, 5);
    spec.set_name(with_auto ? "auto" : "fixed");
    if (with_auto) spec = WithAllAuto(std::move(spec));
    spec.mutable_optimizer()->set_lr_decay(v1::OptimizerSpec::LR_DECAY_COSINE);
    // Planned as the submit of then planned it: the warm-up holds no
    // memory, so its plan is the one at W = steps - 1.
    spec.mutable_optimizer()->set_warmup_steps(4);
    absl::StatusOr<v1::MemoryPlan> plan = AdmitJob(spec);
    ASSERT_TRUE(plan.ok()) << plan.status();
    spec.mutable_optimizer()->set_warmup_steps(5);
    v1::Job job;
    *job.mutable_spec() = spec;
    *job.mutable_plan() = *plan;
    job.set_state(v1::PENDING);
    job.set_state_reason("waiting to be scheduled");
    job.mutable_progress()->set_total_steps(spec.steps());
    absl::StatusOr<v1::Job> stored = store_->CreateJob(job);
    ASSERT_TRUE(stored.ok()) << stored.status();
    jobs.push_back(stored->id());
  }
  Open();  // the upgraded coordinator restores them
  for (int i = 0; i < 2; ++i) {
    // A worker that says its memory: placement checks that some value of
    // the `auto` settings fits it (AutoFitsOnWorker).
    v1::RegisterRequest req;
    v1::WorkerCapabilities* caps = req.mutable_capabilities();
    caps->set_backend(v1::BACKEND_CPU);
    caps->set_devices(2);
    caps->set_device_memory_bytes(int64_t{1} << 30);
    caps->set_host_memory_bytes(int64_t{16} << 30);
    caps->set_rank_address("127.0.0.1");
    auto w = c().Register(req);
    ASSERT_TRUE(w.ok()) << w.status();
  }
  for (const std::string& id : jobs) {
    EXPECT_TRUE(WaitState(id, v1::SCHEDULED)) << Get(id).DebugString();
    const v1::Job j = Get(id);
    ASSERT_EQ(j.placement_size(), 1) << j.DebugString();
    EXPECT_EQ(j.spec().optimizer().warmup_steps(), 5);
  }
}

TEST_F(CoordinatorTest, RestartReattachesRunningRanksAndFinishesWithTheirExits) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  ASSERT_TRUE(Exited(w, job, 0, kRankExitOk).ok());  // one rank done before the restart
  Open();
  EXPECT_EQ(Get(job).state(), v1::RUNNING);
  EXPECT_EQ(Heartbeat(w).status().code(), absl::StatusCode::kNotFound) << "must register again";
  v1::RegisterResponse resp;
  EXPECT_EQ(Register(w, {Runs(job, 0, {1})}, &resp), w);
  EXPECT_EQ(resp.cancellations_size(), 0);
  // A retried report of the exit recorded before the restart changes nothing.
  ASSERT_TRUE(Exited(w, job, 0, kRankExitOk).ok());
  EXPECT_EQ(Get(job).state(), v1::RUNNING);
  ASSERT_TRUE(Exited(w, job, 1, kRankExitOk).ok());
  EXPECT_EQ(Get(job).state(), v1::SUCCEEDED);
  EXPECT_EQ(Get(job).attempt(), 0);
  // Its two device slots are free again: the next job is placed at once.
  EXPECT_EQ(Get(Submit(DemoJobSpec(2, 5))).state(), v1::SCHEDULED);
}

// Ranks stalled at the same step are named together: the coordinator
// cannot tell which of them stopped first (one stuck outside a collective
// holds the others in it), and it used to blame rank 0 alone.
TEST_F(CoordinatorTest, RanksStalledAtTheSameStepAreNamedTogether) {
  v1::JobSpec spec = DemoJobSpec(2, 5);
  spec.set_progress_timeout_s(1);
  const std::string job = Submit(spec);
  const std::string w = RunningJob(job);
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, job, {1}, 2.0, {0, 1})).ok());
  ASSERT_TRUE(testing_cluster::WaitFor(
      [&] {
        EXPECT_TRUE(Heartbeat(w).ok());
        return Get(job).has_failure();
      },
      absl::Seconds(5)))
      << Get(job).DebugString();
  const v1::Failure f = Get(job).failure();
  EXPECT_EQ(f.kind(), v1::Failure::RANK_HUNG);
  EXPECT_EQ(f.rank(), 0);
  EXPECT_THAT(f.message(), HasSubstr("ranks 0, 1 hung: no step progress for "));
  EXPECT_THAT(f.message(), HasSubstr("last step 1, all of them"));
}

// A rank its agent killed in a hung teardown counts as having exited with
// the code it said: one that had finished counts as finished, and a job a
// rank refused stays INVALID, not a crash to restart (the signal would
// have made it RANK_CRASHED, restarted while restarts are left).
TEST_F(CoordinatorTest, ARankKilledInItsTeardownCountsAsExitedWithTheCodeItSaid) {
  v1::JobSpec spec = DemoJobSpec(2, 5);
  spec.set_max_restarts(3);
  const std::string finished = Submit(spec);
  const std::string w = RunningJob(finished);
  ASSERT_TRUE(KilledInTeardown(w, finished, 0, kRankExitOk).ok());
  EXPECT_EQ(Get(finished).state(), v1::RUNNING);
  ASSERT_TRUE(KilledInTeardown(w, finished, 1, kRankExitOk).ok());
  EXPECT_EQ(Get(finished).state(), v1::SUCCEEDED) << Get(finished).DebugString();

  // The next job goes to the same worker, free again.
  const std::string refused = Submit(spec);
  ASSERT_NO_FATAL_FAILURE(StartOn(w, refused));
  ASSERT_TRUE(
      KilledInTeardown(w, refused, 1, kRankExitInvalidJob, "NOT_FOUND", "data.path: /no/such/file: not found").ok());
  const v1::Job j = Get(refused);
  EXPECT_EQ(j.failure().kind(), v1::Failure::INVALID) << j.DebugString();
  EXPECT_EQ(j.failure().exit_code(), kRankExitInvalidJob);
  EXPECT_EQ(j.failure().signal(), 0);
  EXPECT_THAT(j.failure().message(), HasSubstr("data.path: /no/such/file: not found"));
  EXPECT_THAT(j.failure().message(), HasSubstr("then its teardown hung: its agent killed it"));
  ASSERT_TRUE(Exited(w, refused, 0, 0, SIGTERM, true).ok());
  EXPECT_EQ(Get(refused).state(), v1::FAILED);
  EXPECT_EQ(Get(refused).attempt(), 0) << "restarted";
}

// An agent shutting down starts nothing: an assignment it has not collected
// when it says it is leaving is never sent, and its attempt fails as
// WORKER_LOST and restarts at once, not a worker timeout later when the
// silent worker is forgotten. The restart goes to another worker.
TEST_F(CoordinatorTest, AnAssignmentNotYetCollectedByALeavingWorkerFailsItsAttemptAtOnce) {
  v1::JobSpec spec = DemoJobSpec(2, 5);
  spec.set_max_restarts(1);
  const std::string w = Register();
  const std::string job = Submit(spec);
  ASSERT_EQ(Get(job).state(), v1::SCHEDULED) << "placed on " << w << ", not yet collected";
  v1::HeartbeatRequest leaving;
  leaving.set_worker_id(w);
  leaving.set_leaving(true);
  auto hb = c().Heartbeat(leaving);
  ASSERT_TRUE(hb.ok()) << hb.status();
  EXPECT_EQ(hb->assignments_size(), 0);
  v1::Job j = Get(job);
  EXPECT_EQ(j.state(), v1::PENDING) << j.DebugString();
  EXPECT_EQ(j.attempt(), 1);
  EXPECT_EQ(j.failure().kind(), v1::Failure::WORKER_LOST);
  EXPECT_THAT(j.failure().message(), HasSubstr("worker left: " + w + "'s agent is shutting down"));
  // Its later heartbeats get nothing either; a new worker takes the restart.
  hb = c().Heartbeat(leaving);
  ASSERT_TRUE(hb.ok()) << hb.status();
  EXPECT_EQ(hb->assignments_size(), 0);
  const std::string other = Register();
  ASSERT_NE(other, w);
  hb = Heartbeat(other);
  ASSERT_TRUE(hb.ok()) << hb.status();
  ASSERT_EQ(hb->assignments_size(), 1);
  EXPECT_EQ(hb->assignments(0).job_id(), job);
  EXPECT_EQ(hb->assignments(0).attempt(), 1);
  EXPECT_EQ(Get(job).state(), v1::SCHEDULED);
}

// An answer carrying an assignment can be lost (the agent stopped waiting
// for a coordinator slow on its store, a connection dropped). The next
// heartbeat does not list the attempt and no rank reported: the assignment
// is sent again, and again, until a heartbeat lists it; then never more.
// Before, it was dropped with the answer and the job stayed SCHEDULED for
// good.
TEST_F(CoordinatorTest, AnAssignmentWhoseAnswerWasLostIsSentAgain) {
  const std::string w = Register();
  const std::string job = SendAssignment(w, 1);  // lost on its way
  EXPECT_FALSE(Get(job).placement(0).delivered()) << "not known to have arrived";
  for (int64_t beat : {2, 3}) {
    auto hb = c().Heartbeat(Beat(w, beat));
    ASSERT_TRUE(hb.ok()) << hb.status();
    ASSERT_EQ(hb->assignments_size(), 1) << "heartbeat " << beat;
    EXPECT_EQ(hb->assignments(0).job_id(), job);
    EXPECT_EQ(hb->assignments(0).ranks_size(), 2);
  }
  EXPECT_THAT(Said(), HasSubstr(job + " attempt 0: the assignment sent to " + w + " did not arrive"));
  // Arrived with the third answer: listed from then on.
  for (int64_t beat : {4, 5}) {
    auto hb = c().Heartbeat(Beat(w, beat, {job}));
    ASSERT_TRUE(hb.ok()) << hb.status();
    EXPECT_EQ(hb->assignments_size(), 0) << "heartbeat " << beat;
  }
  EXPECT_TRUE(Get(job).placement(0).delivered());
  ASSERT_TRUE(Started(w, job, 0).ok());
  ASSERT_TRUE(Started(w, job, 1).ok());
  EXPECT_EQ(Get(job).state(), v1::RUNNING);
  // Acknowledged: a heartbeat that no longer lists it (its ranks exited
  // and were acknowledged) gets nothing again.
  auto hb = c().Heartbeat(Beat(w, 6));
  ASSERT_TRUE(hb.ok()) << hb.status();
  EXPECT_EQ(hb->assignments_size(), 0);
}

// A rank's status acknowledges its assignment as well as a heartbeat does:
// an attempt whose ranks all exited before the agent's next heartbeat
// (which then does not list it) is not sent again.
TEST_F(CoordinatorTest, ARanksStatusAcknowledgesItsAssignment) {
  v1::JobSpec spec = DemoJobSpec(2, 5);
  spec.set_max_restarts(1);
  const std::string w = Register();
  const std::string job = SendAssignment(w, 1, spec);
  ASSERT_TRUE(Exited(w, job, 0, 127).ok());  // could not start
  EXPECT_TRUE(Get(job).placement(0).delivered());
  ASSERT_TRUE(Exited(w, job, 1, 0, SIGTERM, /*stopped=*/true).ok());
  auto hb = c().Heartbeat(Beat(w, 2));
  ASSERT_TRUE(hb.ok()) << hb.status();
  // The restart (attempt 1) goes out; attempt 0 is not sent again.
  for (const v1::Assignment& a : hb->assignments()) EXPECT_EQ(a.attempt(), 1) << a.ShortDebugString();
}

// A heartbeat the agent sent before the answer that carried the
// assignment (held up in the coordinator, and answered after a later one)
// says nothing about whether it arrived: the attempt is neither sent again
// nor, once cancelled, taken for never started while its ranks may run.
// Cancel and delete as a client retrying after a lost answer meets them: a
// second cancel of a job it cancelled is answered OK with the job (it is
// CANCELLING, then CANCELLED), a cancel of a job that ended otherwise is
// FAILED_PRECONDITION, and a delete of a CANCELLING job says to wait.
TEST_F(CoordinatorTest, ARetriedCancelIsAnsweredOkAndADeleteWhileCancellingSaysToWait) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  ASSERT_TRUE(c().CancelJob(job).ok());
  absl::StatusOr<v1::Job> again = c().CancelJob(job);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->state(), v1::CANCELLING);
  const absl::Status early = c().DeleteJob(job);
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(early.message(), HasSubstr("wait for it to be CANCELLED"));
  ASSERT_TRUE(Exited(w, job, 0, kRankExitOk).ok());
  ASSERT_TRUE(Exited(w, job, 1, kRankExitOk).ok());
  ASSERT_EQ(Get(job).state(), v1::CANCELLED);
  again = c().CancelJob(job);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->state(), v1::CANCELLED);
  // A job that ended otherwise is no cancel's answer.
  const std::string done = Submit(DemoJobSpec(2, 5));
  StartOn(w, done);
  ASSERT_TRUE(Exited(w, done, 0, kRankExitOk).ok());
  ASSERT_TRUE(Exited(w, done, 1, kRankExitOk).ok());
  ASSERT_EQ(Get(done).state(), v1::SUCCEEDED);
  const absl::Status late = c().CancelJob(done).status();
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(late.message(), HasSubstr("is already SUCCEEDED; nothing to cancel"));
}

// A job cancelled while it waits to restart has run: its reason says so,
// with the attempt it waited for and the step it had reached, not "before
// it was scheduled" (which a job never placed still gets).
TEST_F(CoordinatorTest, ACancelWhileWaitingToRestartSaysTheJobHadRun) {
  v1::JobSpec spec = DemoJobSpec(2, 5);
  spec.set_max_restarts(2);
  const std::string job = Submit(spec);
  const std::string w = RunningJob(job);
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, job, {1, 2, 3})).ok());
  // A job of higher priority takes the slots the crash frees, so that the
  // restarted one stays PENDING.
  v1::JobSpec urgent = DemoJobSpec(2, 5);
  urgent.set_priority(10);
  const std::string other = Submit(urgent);
  ASSERT_TRUE(Exited(w, job, 0, 1).ok());
  ASSERT_TRUE(Exited(w, job, 1, 0, SIGTERM, /*stopped=*/true).ok());
  ASSERT_TRUE(testing_cluster::WaitFor([&] { return Get(other).state() == v1::SCHEDULED; }, absl::Seconds(10)));
  ASSERT_EQ(Get(job).state(), v1::PENDING);
  ASSERT_EQ(Get(job).attempt(), 1);
  auto cancelled = c().CancelJob(job, "CN=alice");
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::CANCELLED);
  EXPECT_EQ(cancelled->state_reason(),
            "cancelled by CN=alice while waiting to restart (attempt 1, last at step 3 of 5)");
  // One never placed was cancelled before it was scheduled.
  const std::string queued = Submit(DemoJobSpec(2, 5));
  auto never = c().CancelJob(queued, "CN=alice");
  ASSERT_TRUE(never.ok()) << never.status();
  EXPECT_EQ(never->state_reason(), "cancelled by CN=alice before it was scheduled");
}

TEST_F(CoordinatorTest, AHeartbeatOlderThanTheAssignmentSaysNothingAboutIt) {
  const std::string w = Register();
  const std::string job = SendAssignment(w, 7);
  ASSERT_TRUE(c().CancelJob(job).ok());
  EXPECT_EQ(Get(job).state(), v1::CANCELLING);
  auto hb = c().Heartbeat(Beat(w, 6));  // the agent's previous heartbeat, late
  ASSERT_TRUE(hb.ok()) << hb.status();
  EXPECT_EQ(hb->assignments_size(), 0);
  EXPECT_EQ(Get(job).state(), v1::CANCELLING) << "its ranks may be running";
  // The agent's next heartbeat lists it: the cancellation goes out again
  // (the first may have been lost too) until its ranks have exited.
  for (int64_t beat : {8, 9}) {
    hb = c().Heartbeat(Beat(w, beat, {job}));
    ASSERT_TRUE(hb.ok()) << hb.status();
    EXPECT_EQ(hb->assignments_size(), 0);
    ASSERT_EQ(hb->cancellations_size(), 1) << "heartbeat " << beat;
    EXPECT_EQ(hb->cancellations(0).job_id(), job);
  }
  EXPECT_EQ(Get(job).state(), v1::CANCELLING);
  ASSERT_TRUE(Exited(w, job, 0, 0, SIGTERM, /*stopped=*/true).ok());
  ASSERT_TRUE(Exited(w, job, 1, 0, SIGTERM, /*stopped=*/true).ok());
  EXPECT_EQ(Get(job).state(), v1::CANCELLED);
}

// An assignment lost on its way and then cancelled: the agent's next
// heartbeat does not list it, so its ranks never started, and the job is
// CANCELLED then, not left CANCELLING waiting for exits that never come.
TEST_F(CoordinatorTest, ALostAssignmentThenCancelledEndsAtTheNextHeartbeat) {
  const std::string w = Register();
  const std::string job = SendAssignment(w, 1);  // lost
  ASSERT_TRUE(c().CancelJob(job).ok());
  EXPECT_EQ(Get(job).state(), v1::CANCELLING);
  auto hb = c().Heartbeat(Beat(w, 2));
  ASSERT_TRUE(hb.ok()) << hb.status();
  EXPECT_EQ(hb->assignments_size(), 0) << "withdrawn, not sent again";
  EXPECT_EQ(Get(job).state(), v1::CANCELLED);
}

// The coordinator killed after sending an assignment and before anything
// acknowledged it: the restarted one sends it again to the worker that
// registers without it, rather than failing the attempt as RANK_CRASHED
// (with no restarts left, the job would have FAILED without ever running).
TEST_F(CoordinatorTest, AnAssignmentUnacknowledgedAtARestartIsSentAgain) {
  const std::string w = Register();
  const std::string job = SendAssignment(w, 1);  // lost with the coordinator
  Open();
  EXPECT_EQ(Register(w), w);
  auto hb = c().Heartbeat(Beat(w, 2));
  ASSERT_TRUE(hb.ok()) << hb.status();
  ASSERT_EQ(hb->assignments_size(), 1);
  EXPECT_EQ(hb->assignments(0).job_id(), job);
  v1::Job j = Get(job);
  EXPECT_EQ(j.state(), v1::SCHEDULED) << j.DebugString();
  EXPECT_FALSE(j.has_failure()) << j.DebugString();
}

// The coordinator killed after sending an assignment, with the job then
// cancelling: whether its ranks run is unknown until the worker registers.
// Listed there, they are stopped and the job waits for their exits; not
// listed, they never started and the job is CANCELLED then. (Counting them
// gone at the restart would end the job while they ran.)
TEST_F(CoordinatorTest, ACancelledUnacknowledgedAssignmentWaitsForItsWorkerAfterARestart) {
  const std::string w = Register();
  for (const bool listed : {true, false}) {
    SCOPED_TRACE(listed ? "listed" : "not listed");
    const std::string job = SendAssignment(w, 1);
    ASSERT_TRUE(c().CancelJob(job).ok());
    Open();
    EXPECT_EQ(Get(job).state(), v1::CANCELLING) << "its ranks may be running";
    ASSERT_EQ(Register(w, listed ? std::vector<v1::RunningJob>{Runs(job, 0, {0, 1})} : std::vector<v1::RunningJob>{}),
              w);
    if (!listed) {
      EXPECT_EQ(Get(job).state(), v1::CANCELLED);
      continue;
    }
    EXPECT_EQ(Get(job).state(), v1::CANCELLING);
    auto hb = c().Heartbeat(Beat(w, 2, {job}));
    ASSERT_TRUE(hb.ok()) << hb.status();
    ASSERT_EQ(hb->cancellations_size(), 1);
    EXPECT_EQ(hb->cancellations(0).job_id(), job);
    ASSERT_TRUE(Exited(w, job, 0, 0, SIGTERM, /*stopped=*/true).ok());
    ASSERT_TRUE(Exited(w, job, 1, 0, SIGTERM, /*stopped=*/true).ok());
    EXPECT_EQ(Get(job).state(), v1::CANCELLED);
  }
}

// An attempt the coordinator no longer has (its worker was lost, a
// restart voided it) that the agent still lists is told to stop at every
// heartbeat, not only in a registration's answer that may have been lost.
TEST_F(CoordinatorTest, AnAttemptTheCoordinatorDoesNotHaveIsStoppedAtEveryHeartbeat) {
  const std::string w = Register();
  for (int64_t beat : {1, 2}) {
    auto hb = c().Heartbeat(Beat(w, beat, {"job-42"}));
    ASSERT_TRUE(hb.ok()) << hb.status();
    ASSERT_EQ(hb->cancellations_size(), 1) << "heartbeat " << beat;
    EXPECT_EQ(hb->cancellations(0).job_id(), "job-42");
    EXPECT_EQ(hb->cancellations(0).attempt(), 0);
  }
}

// GetMemoryTimeline: NOT_FOUND for an unknown job; FAILED_PRECONDITION
// saying why for a job without one (none yet; off by its spec); once a rank
// reports one, the latest per rank with the job's plan, also after a restart.
TEST_F(CoordinatorTest, MemoryTimelineOfAJob) {
  auto unknown = c().GetMemoryTimeline("job-99");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(unknown.status().message(), HasSubstr("job-99"));
  EXPECT_EQ(c().GetMemoryTimeline("nine").status().code(), absl::StatusCode::kInvalidArgument);

  v1::JobSpec off_spec = DemoJobSpec(2, 5);
  off_spec.set_memory_timeline_every(0);
  const std::string off = Submit(off_spec);
  auto none = c().GetMemoryTimeline(off);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(none.status().message(), HasSubstr("memory_timeline_every: 0"));

  const std::string job = Submit(DemoJobSpec(2, 5));
  auto yet = c().GetMemoryTimeline(job);
  EXPECT_EQ(yet.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(yet.status().message(), HasSubstr("no memory timeline yet"));
  EXPECT_THAT(yet.status().message(), HasSubstr("every 100 steps"));

  // Cancel the first job so that the second is placed on the worker.
  ASSERT_TRUE(c().CancelJob(off).ok());
  // Cancelled before its first step: it will not record one, so no "yet".
  v1::JobSpec early_spec = DemoJobSpec(2, 5);
  const std::string early = Submit(early_spec);
  ASSERT_TRUE(c().CancelJob(early).ok());
  auto never = c().GetMemoryTimeline(early);
  EXPECT_EQ(never.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(never.status().message(),
              HasSubstr(early + " recorded no memory timeline (CANCELLED, step 0)"));
  const std::string w = RunningJob(job);
  v1::TelemetryRequest t = Steps(w, job, {1, 2});
  v1::MemoryTimeline* m = t.mutable_steps(0)->mutable_telemetry()->mutable_memory_timeline();
  m->add_live_sets("weights");
  v1::MemoryTimelinePhase* p = m->add_phases();
  p->set_name("embedding");
  p->add_device_bytes(123);
  ASSERT_TRUE(c().ReportTelemetry(t).ok());
  for (int restart = 0; restart < 2; ++restart) {
    auto got = c().GetMemoryTimeline(job);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->job_id(), job);
    ASSERT_EQ(got->ranks_size(), 1);
    EXPECT_EQ(got->ranks(0).rank(), 0);
    EXPECT_EQ(got->ranks(0).step(), 1);
    EXPECT_EQ(got->ranks(0).phases(0).name(), "embedding");
    EXPECT_EQ(got->ranks(0).phases(0).device_bytes(0), 123);
    EXPECT_EQ(got->plan().total_bytes(), Get(job).plan().total_bytes());
    EXPECT_GT(got->plan().live_sets_size(), 0);
    Open();  // the timeline is in the store, not only in memory
  }
}

// An assignment never acknowledged, to an agent that then registers as a
// new process (it restarted; with the coordinator restarting too, or not):
// where its ranks there had written rendezvous keys, they died with the old
// process, and ranks sent again would read those keys and dial the dead.
// The attempt restarts under fresh keys instead. Without such keys the
// assignment is sent again as before.
TEST_F(CoordinatorTest, AFreshAgentWhoseAttemptHadBegunToMeetRestartsItUnderFreshKeys) {
  for (const bool coordinator_restarts : {true, false}) {
    SCOPED_TRACE(coordinator_restarts ? "the coordinator restarted too" : "only the agent restarted");
    std::filesystem::remove(dir_ + "/state.db");
    Open();
    const std::string w = Register("", {}, nullptr, /*agent_started=*/true);
    v1::JobSpec spec = DemoJobSpec(2, 5);
    spec.set_max_restarts(1);
    const std::string job = SendAssignment(w, 1, spec);  // its answer arrived; no acknowledgement yet
    const std::string key = job + "/attempt-0/rank-0";
    ASSERT_TRUE(c().KvSet(key, "127.0.0.1:40001", /*rank=*/0).ok());  // a rank of it began to meet
    if (coordinator_restarts) Open();
    EXPECT_EQ(Register(w, {}, nullptr, /*agent_started=*/true), w);
    ASSERT_TRUE(testing_cluster::WaitFor([&] { return Get(job).attempt() == 1; }, absl::Seconds(10)))
        << Get(job).DebugString();
    EXPECT_EQ(c().KvGet(key, absl::ZeroDuration()).status().code(), absl::StatusCode::kNotFound)
        << "the old attempt's keys are gone with it";
    auto hb = c().Heartbeat(Beat(w, 1));
    ASSERT_TRUE(hb.ok()) << hb.status();
    ASSERT_EQ(hb->assignments_size(), 1);
    EXPECT_EQ(hb->assignments(0).attempt(), 1);
    EXPECT_EQ(hb->assignments(0).kv_prefix(), job + "/attempt-1");
    auto events = store_->ReadEvents(job, 0, 100);
    ASSERT_TRUE(events.ok()) << events.status();
    std::string said;
    for (const v1::JobEvent& e : *events) absl::StrAppend(&said, e.state_change().reason(), "\n");
    EXPECT_THAT(said, HasSubstr("as a new agent process, and its ranks there had begun to meet"));
  }
}

// Two nodes: the keys are the other node's rank's, which runs. The fresh
// agent's own ranks wrote none, so it is sent the attempt again.
TEST_F(CoordinatorTest, KeysOfAnotherNodesRanksDoNotStopAFreshAgentGettingItsAttemptAgain) {
  const std::string x = Register("", {}, nullptr, /*agent_started=*/true);
  const std::string y = Register("", {}, nullptr, /*agent_started=*/true);
  ASSERT_NE(x, y);
  v1::JobSpec spec = DemoJobSpec(2, 5);
  spec.mutable_layout()->set_nodes(2);
  const std::string job = Submit(spec);
  v1::Job j = Get(job);
  ASSERT_EQ(j.placement_size(), 2) << j.DebugString();
  // The node whose rank runs and meets, and the one whose agent restarts.
  const std::string runs = j.placement(0).worker_id(), fresh = j.placement(1).worker_id();
  const int running_rank = j.placement(0).ranks(0);
  ASSERT_TRUE(c().Heartbeat(Beat(runs, 1)).ok());
  ASSERT_TRUE(c().Heartbeat(Beat(fresh, 1)).ok());
  ASSERT_TRUE(Started(runs, job, running_rank).ok());
  ASSERT_TRUE(c().KvSet(job + "/attempt-0/world/rank_" + std::to_string(running_rank), "addr", running_rank).ok());
  EXPECT_EQ(Register(fresh, {}, nullptr, /*agent_started=*/true), fresh);
  auto hb = c().Heartbeat(Beat(fresh, 1));
  ASSERT_TRUE(hb.ok()) << hb.status();
  ASSERT_EQ(hb->assignments_size(), 1);
  EXPECT_EQ(hb->assignments(0).attempt(), 0);
  EXPECT_FALSE(Get(job).has_failure()) << Get(job).DebugString();
  // A rank outside the attempt is refused by name, and the coordinator's
  // own keys are not anyone's to write.
  EXPECT_THAT(c().KvSet(job + "/attempt-0/k", "v", 2).message(), HasSubstr("rank: 2 is not a rank of " + job));
  EXPECT_EQ(c().KvSet(job + "/attempt-0/.met/1", "").code(), absl::StatusCode::kFailedPrecondition);
}

// A rank that only reads (NCCL's non-root ranks read the unique id) has
// begun to meet too: its fresh agent restarts the attempt.
TEST_F(CoordinatorTest, AFreshAgentWhoseRankOnlyReadAKeyRestartsTheAttempt) {
  const std::string x = Register("", {}, nullptr, /*agent_started=*/true);
  const std::string y = Register("", {}, nullptr, /*agent_started=*/true);
  v1::JobSpec spec = DemoJobSpec(2, 5);
  spec.mutable_layout()->set_nodes(2);
  spec.set_max_restarts(1);
  const std::string job = Submit(spec);
  v1::Job j = Get(job);
  ASSERT_EQ(j.placement_size(), 2) << j.DebugString();
  const std::string runs = j.placement(0).worker_id(), fresh = j.placement(1).worker_id();
  const int root = j.placement(0).ranks(0), reader = j.placement(1).ranks(0);
  ASSERT_TRUE(c().Heartbeat(Beat(runs, 1)).ok());
  ASSERT_TRUE(c().Heartbeat(Beat(fresh, 1)).ok());
  const std::string id = job + "/attempt-0/world/nccl_unique_id";
  ASSERT_TRUE(c().KvSet(id, "id", root).ok());
  auto read = c().KvGet(id, absl::ZeroDuration(), reader);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(Register(fresh, {}, nullptr, /*agent_started=*/true), fresh);
  j = Get(job);
  ASSERT_TRUE(j.has_failure()) << j.DebugString();
  EXPECT_THAT(j.failure().message(), HasSubstr("had begun to meet"));
  // The running node is told to stop its rank; once it has, the attempt restarts.
  auto hb = c().Heartbeat(Beat(runs, 2));
  ASSERT_TRUE(hb.ok()) << hb.status();
  ASSERT_EQ(hb->cancellations_size(), 1);
  ASSERT_TRUE(Exited(runs, job, root, 143, 0, /*stopped=*/true).ok());
  ASSERT_TRUE(testing_cluster::WaitFor([&] { return Get(job).attempt() == 1; }, absl::Seconds(10)))
      << Get(job).DebugString();
  // A rank named on a key of no live attempt marks nothing and is no error.
  EXPECT_EQ(c().KvGet("job-99/attempt-0/x", absl::ZeroDuration(), 0).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CoordinatorTest, AFreshAgentWhoseAttemptHadNotBegunToMeetGetsItAgain) {
  const std::string w = Register("", {}, nullptr, /*agent_started=*/true);
  const std::string job = SendAssignment(w, 1);
  // A read that names no rank (not a rank's) counts no rank as met.
  EXPECT_EQ(c().KvGet(job + "/attempt-0/world/0", absl::ZeroDuration()).status().code(), absl::StatusCode::kNotFound);
  Open();
  EXPECT_EQ(Register(w, {}, nullptr, /*agent_started=*/true), w);
  auto hb = c().Heartbeat(Beat(w, 1));
  ASSERT_TRUE(hb.ok()) << hb.status();
  ASSERT_EQ(hb->assignments_size(), 1);
  EXPECT_EQ(hb->assignments(0).job_id(), job);
  EXPECT_EQ(hb->assignments(0).attempt(), 0);
  EXPECT_FALSE(Get(job).has_failure()) << Get(job).DebugString();
}

TEST_F(CoordinatorTest, RestartResendsAnAssignmentThatWasNeverDelivered) {
  const std::string w = Register();
  const std::string job = Submit(DemoJobSpec(2, 5));
  ASSERT_EQ(Get(job).state(), v1::SCHEDULED);  // placed, not yet heartbeaten out
  Open();
  EXPECT_EQ(Register(w, {}), w);
  auto hb = Heartbeat(w);
  ASSERT_TRUE(hb.ok()) << hb.status();
  ASSERT_EQ(hb->assignments_size(), 1);
  EXPECT_EQ(hb->assignments(0).job_id(), job);
  EXPECT_EQ(hb->assignments(0).kv_prefix(), job + "/attempt-0");
  ASSERT_TRUE(Started(w, job, 0).ok());
  ASSERT_TRUE(Started(w, job, 1).ok());
  EXPECT_EQ(Get(job).state(), v1::RUNNING);
}

TEST_F(CoordinatorTest, DeliveredRankMissingAfterRestartFailsTheAttempt) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  Open();
  v1::RegisterResponse resp;
  Register(w, {Runs(job, 0, {0})}, &resp);  // rank 1 vanished
  // The attempt is stopped: rank 0 gets a cancellation...
  auto hb = Heartbeat(w);
  ASSERT_TRUE(hb.ok());
  ASSERT_EQ(hb->cancellations_size(), 1);
  ASSERT_TRUE(Exited(w, job, 0, 0, /*signal=*/15, /*stopped=*/true).ok());
  const v1::Job j = Get(job);
  ASSERT_EQ(j.state(), v1::FAILED) << j.DebugString();
  EXPECT_EQ(j.failure().rank(), 1);
  EXPECT_THAT(j.failure().message(), HasSubstr("no longer running on " + w));
  EXPECT_EQ(Get(Submit(DemoJobSpec(2, 5))).state(), v1::SCHEDULED) << "device slots leaked";
}

TEST_F(CoordinatorTest, AttemptWhoseRanksAllVanishedEndsAtRegistrationAndFreesItsSlots) {
  v1::JobSpec spec = DemoJobSpec(2, 5);
  const std::string job = Submit(spec);
  const std::string w = RunningJob(job);
  Open();
  Register(w, {});  // runs nothing of it any more
  const v1::Job j = Get(job);
  ASSERT_EQ(j.state(), v1::FAILED) << j.DebugString();
  EXPECT_EQ(j.failure().kind(), v1::Failure::RANK_CRASHED);
  EXPECT_EQ(Get(Submit(DemoJobSpec(2, 5))).state(), v1::SCHEDULED) << "device slots leaked";
}

TEST_F(CoordinatorTest, CancelInFlightAcrossARestartEndsCancelled) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  ASSERT_TRUE(c().CancelJob(job).ok());
  ASSERT_EQ(Get(job).state(), v1::CANCELLING);
  Open();  // before the cancellation reached the worker
  Register(w, {Runs(job, 0, {0, 1})});
  auto hb = Heartbeat(w);
  ASSERT_TRUE(hb.ok());
  ASSERT_EQ(hb->cancellations_size(), 1);
  EXPECT_EQ(hb->cancellations(0).job_id(), job);
  ASSERT_TRUE(Exited(w, job, 0, 0, 15, true).ok());
  ASSERT_TRUE(Exited(w, job, 1, 0, 15, true).ok());
  EXPECT_EQ(Get(job).state(), v1::CANCELLED);
}

TEST_F(CoordinatorTest, WorkerThatDoesNotComeBackIsLostAfterTheReattachTimeout) {
  v1::JobSpec spec = DemoJobSpec(2, 5);
  spec.set_max_restarts(1);
  const std::string job = Submit(spec);
  RunningJob(job);
  const absl::Time restarted = absl::Now();  // before: the settling window opens inside Open()
  Open();
  // Restarted attempts wait for a worker: a new one takes it.
  ASSERT_TRUE(WaitState(job, v1::PENDING)) << Get(job).DebugString();
  EXPECT_GE(absl::Now() - restarted, options_.reattach_timeout);
  const v1::Job j = Get(job);
  EXPECT_EQ(j.attempt(), 1);
  EXPECT_EQ(j.failure().kind(), v1::Failure::WORKER_LOST);
  EXPECT_THAT(j.failure().message(), HasSubstr("did not register again within"));
}

// A lost worker counts in plateau_workers_lost_total, which the
// PlateauWorkerLost alert watches: its heartbeat series goes when it is lost
// (--worker_timeout_s, 10 s as shipped), so an alert on that series' age
// never saw a loss. A worker that heartbeats is not counted.
TEST_F(CoordinatorTest, ALostWorkerIsCountedAndItsHeartbeatSeriesGoes) {
  options_.worker_timeout = kShortWorkerTimeout;
  Open();
  const std::string address = absl::StrCat("127.0.0.1:", metrics_->port());
  const double before = testing_cluster::Sample(testing_cluster::Scrape(address), "plateau_workers_lost_total");
  ASSERT_FALSE(std::isnan(before)) << "no plateau_workers_lost_total series before any loss";
  const std::string w = Register();
  ASSERT_TRUE(Heartbeat(w).ok());
  const std::string heartbeat = "plateau_worker_last_heartbeat_timestamp_seconds{worker=\"" + w + "\"}";
  EXPECT_FALSE(std::isnan(testing_cluster::Sample(testing_cluster::Scrape(address), heartbeat)));
  EXPECT_EQ(testing_cluster::Sample(testing_cluster::Scrape(address), "plateau_workers_lost_total"), before);
  ASSERT_TRUE(testing_cluster::WaitFor([&] { return c().ListWorkers().workers_size() == 0; }, absl::Seconds(10)));
  const std::string scrape = testing_cluster::Scrape(address);
  EXPECT_EQ(testing_cluster::Sample(scrape, "plateau_workers_lost_total"), before + 1) << scrape;
  EXPECT_TRUE(std::isnan(testing_cluster::Sample(scrape, heartbeat))) << scrape;
  // One whose agent said it was leaving (a shutdown, a rollout) expires
  // as gone, not lost: the alert stays quiet.
  const std::string goes = Register();
  v1::HeartbeatRequest leaving;
  leaving.set_worker_id(goes);
  leaving.set_leaving(true);
  ASSERT_TRUE(c().Heartbeat(leaving).ok());
  ASSERT_TRUE(testing_cluster::WaitFor([&] { return c().ListWorkers().workers_size() == 0; }, absl::Seconds(10)));
  EXPECT_EQ(testing_cluster::Sample(testing_cluster::Scrape(address), "plateau_workers_lost_total"), before + 1);
}

// A worker killed under a 2-node job: its peer's rank exits with a
// connection error at once, long before the worker timeout. That exit is
// held, not published as the job's failure, until the silent worker is
// judged: lost, WORKER_LOST names it (it named the healthy worker for the
// whole worker timeout). The hold delays nothing else: the surviving
// ranks are told to stop at once.
TEST_F(CoordinatorTest, APeersCrashIsHeldWhileAWorkerOfTheAttemptIsSilentAndItsLossWins) {
  options_.worker_timeout = kShortWorkerTimeout;
  Open();
  v1::JobSpec spec = DemoJobSpec(2, 5);
  spec.mutable_layout()->set_nodes(2);
  spec.set_max_restarts(1);
  const std::string healthy = Register(), killed = Register();
  const std::string job = Submit(spec);
  const v1::Job placed = Get(job);
  ASSERT_EQ(placed.placement_size(), 2) << placed.DebugString();
  ASSERT_EQ(placed.placement(0).worker_id(), healthy);  // rank 0
  ASSERT_TRUE(Heartbeat(healthy).ok());
  ASSERT_TRUE(Heartbeat(killed).ok());
  ASSERT_TRUE(Started(healthy, job, 0).ok());
  ASSERT_TRUE(Started(killed, job, 1).ok());
  ASSERT_EQ(Get(job).state(), v1::RUNNING);
  // `killed` says no more; rank 0 sees "Connection reset by peer".
  ASSERT_TRUE(Exited(healthy, job, 0, 1).ok());
  v1::Job j = Get(job);
  // Recorded as held, naming whom it waits on: not yet the failure.
  EXPECT_EQ(j.failure().kind(), v1::Failure::RANK_CRASHED) << j.DebugString();
  EXPECT_THAT(j.failure_held_for(), ::testing::ElementsAre(killed));
  EXPECT_EQ(j.state(), v1::RUNNING);
  EXPECT_THAT(Said(), HasSubstr("held until " + killed + " is heard from or lost"));
  // A coordinator restart meanwhile keeps the hold (and stops the attempt):
  // the store has it. The healthy worker re-registers; `killed` never does.
  Open();
  EXPECT_THAT(Get(job).failure_held_for(), ::testing::ElementsAre(killed));
  Register(healthy, {});  // rank 0 exited and was reported
  ASSERT_TRUE(testing_cluster::WaitFor(
      [&] {
        EXPECT_TRUE(Heartbeat(healthy).ok());
        return Get(job).failure().kind() == v1::Failure::WORKER_LOST;
      },
      absl::Seconds(20)));
  j = Get(job);
  EXPECT_TRUE(j.failure_held_for().empty()) << j.DebugString();
  EXPECT_EQ(j.failure().kind(), v1::Failure::WORKER_LOST) << j.DebugString();
  EXPECT_EQ(j.failure().worker_id(), killed);
  EXPECT_EQ(j.attempt(), 1) << "restarted for the loss";
}

// The silent worker heartbeats again (it was only slow): the held crash
// stands. A cause (a signal, an out-of-memory) is never held.
TEST_F(CoordinatorTest, AHeldCrashStandsOnceTheOtherWorkerIsHeardFromAndASignalIsNotHeld) {
  v1::JobSpec spec = DemoJobSpec(2, 5);
  spec.mutable_layout()->set_nodes(2);
  const std::string w0 = Register(), w1 = Register();
  const std::string job = Submit(spec);
  const std::string killed = Submit(spec);
  ASSERT_TRUE(Heartbeat(w0).ok());
  ASSERT_TRUE(Heartbeat(w1).ok());
  for (const std::string& id : {job, killed}) {
    ASSERT_TRUE(Started(w0, id, 0).ok());
    ASSERT_TRUE(Started(w1, id, 1).ok());
    ASSERT_EQ(Get(id).state(), v1::RUNNING);
  }
  ASSERT_TRUE(Exited(w0, job, 0, 1).ok());
  EXPECT_THAT(Get(job).failure_held_for(), ::testing::ElementsAre(w1));
  ASSERT_TRUE(Heartbeat(w1).ok());
  v1::Job j = Get(job);
  ASSERT_TRUE(j.has_failure()) << j.DebugString();
  EXPECT_TRUE(j.failure_held_for().empty()) << "heard from: the failure stands";
  EXPECT_EQ(j.failure().kind(), v1::Failure::RANK_CRASHED);
  EXPECT_EQ(j.failure().rank(), 0);
  EXPECT_EQ(j.failure().worker_id(), w0);
  ASSERT_TRUE(Exited(w1, job, 1, 143, 0, /*stopped=*/true).ok());
  EXPECT_EQ(Get(job).state(), v1::FAILED);
  EXPECT_EQ(Get(job).failure().kind(), v1::Failure::RANK_CRASHED);

  ASSERT_TRUE(Exited(w0, killed, 0, 0, SIGKILL).ok());
  j = Get(killed);
  ASSERT_TRUE(j.has_failure()) << j.DebugString();
  EXPECT_EQ(j.failure().signal(), SIGKILL);
}

// The other worker is alive but its heartbeat still lists the attempt: its
// rank has exited (or is being stopped) and the report is on its way. The
// hold stays until that report, which may name the cause: here a signal,
// which replaces the held exit (the heartbeat used to let the held exit
// stand first, so `get` named the wrong rank until the report came). A
// heartbeat that no longer lists the attempt lets it stand.
TEST_F(CoordinatorTest, AHeartbeatStillListingTheAttemptKeepsTheHoldUntilItsRanksReport) {
  v1::JobSpec spec = DemoJobSpec(2, 5);
  spec.mutable_layout()->set_nodes(2);
  const std::string w0 = Register(), w1 = Register();
  const std::string job = Submit(spec), other = Submit(spec);
  ASSERT_TRUE(Heartbeat(w0).ok());
  ASSERT_TRUE(Heartbeat(w1).ok());
  for (const std::string& id : {job, other}) {
    ASSERT_TRUE(Started(w0, id, 0).ok());
    ASSERT_TRUE(Started(w1, id, 1).ok());
  }
  ASSERT_TRUE(Exited(w0, job, 0, 1).ok());
  ASSERT_TRUE(Exited(w0, other, 0, 1).ok());
  ASSERT_THAT(Get(job).failure_held_for(), ::testing::ElementsAre(w1));
  ASSERT_THAT(Get(other).failure_held_for(), ::testing::ElementsAre(w1));
  // w1 lists `job` (its rank's exit not yet acknowledged), not `other`.
  v1::HeartbeatRequest beat;
  beat.set_worker_id(w1);
  *beat.add_running() = Runs(job, 0, {1});
  ASSERT_TRUE(c().Heartbeat(beat).ok());
  EXPECT_THAT(Get(job).failure_held_for(), ::testing::ElementsAre(w1)) << "its report is on its way";
  EXPECT_TRUE(Get(other).failure_held_for().empty()) << "heard from, nothing of it pending: the crash stands";
  // The report: rank 1 was killed by a signal, the cause.
  ASSERT_TRUE(Exited(w1, job, 1, 0, SIGKILL).ok());
  const v1::Job j = Get(job);
  EXPECT_TRUE(j.failure_held_for().empty()) << j.DebugString();
  EXPECT_EQ(j.failure().signal(), SIGKILL) << j.DebugString();
  EXPECT_EQ(j.failure().worker_id(), w1) << j.DebugString();
}

// A hold kept across a coordinator restart ends as before it: the worker
// it waited on registers again, its rank still running, and once that
// rank's exit is reported (stopped) the crash stands.
TEST_F(CoordinatorTest, AHeldCrashSurvivesARestartAndStandsWhenItsWorkerReturns) {
  v1::JobSpec spec = DemoJobSpec(2, 5);
  spec.mutable_layout()->set_nodes(2);
  const std::string w0 = Register(), w1 = Register();
  const std::string job = Submit(spec);
  ASSERT_TRUE(Heartbeat(w0).ok());
  ASSERT_TRUE(Heartbeat(w1).ok());
  ASSERT_TRUE(Started(w0, job, 0).ok());
  ASSERT_TRUE(Started(w1, job, 1).ok());
  ASSERT_TRUE(Exited(w0, job, 0, 1).ok());
  ASSERT_THAT(Get(job).failure_held_for(), ::testing::ElementsAre(w1));
  Open();
  Register(w0, {});
  EXPECT_THAT(Get(job).failure_held_for(), ::testing::ElementsAre(w1)) << "still waiting on " << w1;
  // Back, but still running rank 1 of the attempt: its exit's report
  // settles the hold (as a heartbeat listing it would).
  Register(w1, {Runs(job, 0, {1})});
  EXPECT_THAT(Get(job).failure_held_for(), ::testing::ElementsAre(w1)) << "its rank's exit is to come";
  // The attempt is stopped (it was failing before the restart).
  auto hb = Heartbeat(w1);
  ASSERT_TRUE(hb.ok());
  ASSERT_EQ(hb->cancellations_size(), 1);
  ASSERT_TRUE(Exited(w1, job, 1, 143, 0, /*stopped=*/true).ok());
  const v1::Job j = Get(job);
  EXPECT_TRUE(j.failure_held_for().empty()) << j.DebugString();
  EXPECT_EQ(j.state(), v1::FAILED);
  EXPECT_EQ(j.failure().kind(), v1::Failure::RANK_CRASHED);
  EXPECT_EQ(j.failure().worker_id(), w0);
}

TEST_F(CoordinatorTest, JobsTheCoordinatorNoLongerHasAreCancelledAtRegistration) {
  options_.worker_timeout = kShortWorkerTimeout;
  Open();
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  // Silent past the worker timeout: lost, and the job failed without it.
  ASSERT_TRUE(WaitState(job, v1::FAILED));
  EXPECT_EQ(Get(job).failure().kind(), v1::Failure::WORKER_LOST);
  v1::RegisterResponse resp;
  EXPECT_EQ(Register(w, {Runs(job, 0, {0, 1}), Runs("job-77", 3, {0})}, &resp), w);
  ASSERT_EQ(resp.cancellations_size(), 2);
  EXPECT_EQ(resp.cancellations(0).job_id(), job);
  EXPECT_EQ(resp.cancellations(1).job_id(), "job-77");
}

TEST_F(CoordinatorTest, RankWithoutProgressIsReportedHungAndStopped) {
  v1::JobSpec spec = DemoJobSpec(2, 5);
  spec.set_progress_timeout_s(1);
  const std::string job = Submit(spec);
  const std::string w = RunningJob(job);
  // Rank 0 reports a step; rank 1 never does.
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, job, {1}, 2.0, {0})).ok());
  const absl::Time end = absl::Now() + absl::Seconds(5);
  bool cancelled = false;
  while (!cancelled && absl::Now() < end) {
    auto hb = Heartbeat(w);
    ASSERT_TRUE(hb.ok());
    cancelled = hb->cancellations_size() == 1;
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(cancelled) << Get(job).DebugString();
  EXPECT_EQ(Get(job).failure().kind(), v1::Failure::RANK_HUNG);
  EXPECT_EQ(Get(job).failure().rank(), 1);
  ASSERT_TRUE(Exited(w, job, 0, 0, 15, true).ok());
  ASSERT_TRUE(Exited(w, job, 1, 0, 9, true).ok());
  EXPECT_EQ(Get(job).state(), v1::FAILED);
  EXPECT_EQ(Get(job).failure().kind(), v1::Failure::RANK_HUNG);
  // The step rank 1 never reported ended with the attempt, over rank 0.
  auto events = store_->ReadEvents(job, 0, 100);
  ASSERT_TRUE(events.ok());
  int steps = 0;
  for (const v1::JobEvent& e : *events) {
    if (!e.has_job_step()) continue;
    ++steps;
    EXPECT_EQ(e.job_step().step(), 1);
    EXPECT_EQ(e.job_step().ranks_reported(), 1);
  }
  EXPECT_EQ(steps, 1);
  EXPECT_TRUE(events->back().has_state_change());
  EXPECT_EQ(events->back().state_change().state(), v1::FAILED);
}

TEST_F(CoordinatorTest, RetriedTelemetryIsCountedOnce) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  const int64_t before = *store_->EventCount(job);
  const v1::TelemetryRequest t = Steps(w, job, {1, 2});
  ASSERT_TRUE(c().ReportTelemetry(t).ok());
  ASSERT_TRUE(c().ReportTelemetry(t).ok());  // the reply was lost; sent again
  EXPECT_EQ(*store_->EventCount(job), before + 2);
  EXPECT_EQ(Get(job).progress().step(), 2);
}

// A rank's steps come from its own worker, within the job's steps: a
// report of step 2^62 from another worker was taken as the ranks' last, the
// real reports after it were dropped as old, and the job would have failed
// RANK_HUNG. A peak of no live set is dropped (it was a new series).
TEST_F(CoordinatorTest, TelemetryCountsOnlyTheRanksWorkerAndTheJobsSteps) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  const std::string stranger = Register();
  ASSERT_TRUE(c().ReportTelemetry(Steps(stranger, job, {int64_t{1} << 62})).ok());
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, job, {6})).ok());  // past steps = 5
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, job, {0})).ok());
  EXPECT_EQ(Get(job).progress().step(), 0);
  EXPECT_TRUE(StepEvents(job).empty());
  v1::TelemetryRequest real = Steps(w, job, {1});
  v1::LiveSetBytes* bogus = real.mutable_steps(0)->mutable_telemetry()->add_peak();
  bogus->set_live_set("made-up");
  bogus->set_bytes(1);
  ASSERT_TRUE(c().ReportTelemetry(real).ok());
  EXPECT_EQ(Get(job).progress().step(), 1);
  EXPECT_EQ(StepEvents(job), std::vector<int64_t>{1});
  auto steps = store_->ReadRankSteps(job, 0, 0, INT64_MAX);
  ASSERT_TRUE(steps.ok()) << steps.status();
  for (const auto& r : *steps) {
    for (const v1::LiveSetBytes& ls : r.peak()) EXPECT_NE(ls.live_set(), "made-up");
  }
}

// A stream of one job waits on that job's changes: with one counter for the
// whole coordinator, every open stream of every job woke (copying its job
// under the lock and reading SQLite) on each worker's telemetry batch.
TEST_F(CoordinatorTest, AJobsStreamSleepsThroughAnotherJobsChanges) {
  const std::string busy = Submit(DemoJobSpec(2, 50));
  const std::string w = RunningJob(busy);
  const std::string quiet = Submit(DemoJobSpec(2, 5));  // pending: the one worker is busy
  const Coordinator::ChangeStamp seen = c().JobVersion(quiet);
  absl::Duration slept;
  std::thread waiter([&] {
    const absl::Time start = absl::Now();
    c().WaitForJobChange(quiet, seen, absl::Seconds(2));
    slept = absl::Now() - start;
  });
  for (int64_t step = 1; step <= 20; ++step) {  // a step event of the busy job every 50 ms
    ASSERT_TRUE(c().ReportTelemetry(Steps(w, busy, {step})).ok());
    absl::SleepFor(absl::Milliseconds(50));
  }
  waiter.join();
  EXPECT_GE(slept, absl::Milliseconds(1900)) << "woken by another job's steps";
  EXPECT_EQ(c().JobVersion(quiet), seen);
  // Its own change wakes it (cancelled: its end), and the busy job's
  // stream wakes on its next step.
  std::thread cancel([&] {
    absl::SleepFor(absl::Milliseconds(100));
    EXPECT_TRUE(c().CancelJob(quiet).ok());
  });
  absl::Time start = absl::Now();
  EXPECT_FALSE(c().WaitForJobChange(quiet, seen, absl::Seconds(10)) == seen);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  cancel.join();
  const Coordinator::ChangeStamp busy_seen = c().JobVersion(busy);
  std::thread step([&] {
    absl::SleepFor(absl::Milliseconds(100));
    EXPECT_TRUE(c().ReportTelemetry(Steps(w, busy, {21})).ok());
  });
  start = absl::Now();
  EXPECT_FALSE(c().WaitForJobChange(busy, busy_seen, absl::Seconds(10)) == busy_seen);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  step.join();
}

// Log lines of a job that does not exist are dropped: one for an id not
// given out yet became the log of the job that later got it.
TEST_F(CoordinatorTest, LogLinesOfNoJobAreDropped) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  v1::TelemetryRequest t;
  t.set_worker_id(w);
  for (const std::string& id : {job, std::string("job-999")}) {
    v1::LogEntry* e = t.add_logs();
    e->set_job_id(id);
    e->set_rank(0);
    e->set_stream("stdout");
    e->set_line("from " + id);
  }
  const size_t before = store_->ReadLogs(job, 0, 1000)->size();
  ASSERT_TRUE(c().ReportTelemetry(t).ok());
  auto mine = store_->ReadLogs(job, before, 10);
  ASSERT_TRUE(mine.ok());
  ASSERT_EQ(mine->size(), 1u);
  EXPECT_EQ((*mine)[0].line(), "from " + job);
  auto none = store_->ReadLogs("job-999", 0, 10);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->empty());
}

// A line a worker sends is a line, whatever it carries: one with
// LogEntry.heartbeat set (a worker's bug, or a forged batch) is stored
// without it. Stored with it, every client that follows the log with
// heartbeats would skip a real line as a heartbeat.
TEST_F(CoordinatorTest, ALineAWorkerSendsIsStoredWithoutAHeartbeat) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  v1::TelemetryRequest t = LogLine(w, job, "a line");
  t.mutable_logs(0)->mutable_heartbeat();
  const size_t before = store_->ReadLogs(job, 0, 1000)->size();
  ASSERT_TRUE(c().ReportTelemetry(t).ok());
  auto stored = store_->ReadLogs(job, before, 10);
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_EQ(stored->size(), 1u);
  EXPECT_EQ((*stored)[0].line(), "a line");
  EXPECT_FALSE((*stored)[0].has_heartbeat()) << (*stored)[0].DebugString();
}

// A job's log lines are taken from the workers that hosted it only, while
// it runs and after its end: before, any worker-token holder could write
// into any job's log.
TEST_F(CoordinatorTest, LogLinesAreTakenOnlyFromTheWorkersThatHostedTheJob) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  const std::string other = Register();
  const auto line = [&](const std::string& worker, const std::string& text) {
    return c().ReportTelemetry(LogLine(worker, job, text));
  };
  const auto lines = [&] {
    std::vector<std::string> out;
    const absl::StatusOr<std::vector<v1::LogEntry>> read = store_->ReadLogs(job, 0, 1000);
    EXPECT_TRUE(read.ok()) << read.status();
    for (const v1::LogEntry& e : read.value_or(std::vector<v1::LogEntry>())) {
      if (e.stream() == "stdout") out.push_back(e.line());
    }
    return out;
  };
  ASSERT_TRUE(line(w, "from its worker").ok());
  ASSERT_TRUE(line(other, "forged while it runs").ok());
  ASSERT_TRUE(Exited(w, job, 0, kRankExitOk).ok());
  ASSERT_TRUE(Exited(w, job, 1, kRankExitOk).ok());
  ASSERT_EQ(Get(job).state(), v1::SUCCEEDED);
  EXPECT_THAT(Get(job).hosted_by(), ElementsAre(w));
  ASSERT_TRUE(line(w, "late, from its worker").ok());
  ASSERT_TRUE(line(other, "forged after its end").ok());
  EXPECT_THAT(lines(), ElementsAre("from its worker", "late, from its worker"));
}

// A job placed by a coordinator from before Job.hosted_by (its record has
// none) still takes its lines from the worker it runs on, after a restart:
// Restore takes its placement's workers as its hosts.
TEST_F(CoordinatorTest, AJobPlacedBeforeHostedByTakesItsWorkersLinesAfterARestart) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  v1::Job stored = *store_->GetJob(job);
  ASSERT_FALSE(stored.hosted_by().empty());
  stored.clear_hosted_by();  // as an older coordinator wrote it
  ASSERT_TRUE(store_->PutJob(stored).ok());
  Open();  // a restart reads it
  ASSERT_EQ(Register(w, {Runs(job, 0, {0, 1})}), w);
  ASSERT_EQ(Get(job).state(), v1::RUNNING);
  EXPECT_THAT(Get(job).hosted_by(), ElementsAre(w)) << "its placement's workers are its hosts";
  ASSERT_TRUE(c().ReportTelemetry(LogLine(w, job, "after the upgrade")).ok());
  bool found = false;
  const absl::StatusOr<std::vector<v1::LogEntry>> read = store_->ReadLogs(job, 0, 1000);
  ASSERT_TRUE(read.ok()) << read.status();
  for (const v1::LogEntry& l : *read) found = found || l.line() == "after the upgrade";
  EXPECT_TRUE(found) << "a running job's line from its own worker was dropped";
}

// Log lines carry no step to de-duplicate by: a numbered batch that arrives
// again (its answer lost, or held up past the agent's deadline and then
// stored) is dropped whole, in either order with the agent's next batch.
// Another agent process (another sender) starts its own count.
TEST_F(CoordinatorTest, ARetriedBatchOfLogLinesIsStoredOnce) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  const auto logs = [&] { return store_->ReadLogs(job, 0, 1000)->size(); };
  const size_t before = logs();
  const auto batch = [&](uint64_t sender, int64_t n, const std::string& line) {
    v1::TelemetryRequest t = LogLine(w, job, line);
    t.set_sender(sender);
    t.set_batch(n);
    return t;
  };
  ASSERT_TRUE(c().ReportTelemetry(batch(77, 1, "one")).ok());
  ASSERT_TRUE(c().ReportTelemetry(batch(77, 1, "one")).ok());  // the answer was lost
  ASSERT_TRUE(c().ReportTelemetry(batch(77, 2, "two")).ok());
  ASSERT_TRUE(c().ReportTelemetry(batch(77, 1, "one")).ok());  // a late copy of the first
  EXPECT_EQ(logs(), before + 2);
  ASSERT_TRUE(c().ReportTelemetry(batch(78, 1, "restarted agent")).ok());
  EXPECT_EQ(logs(), before + 3);
  auto read = store_->ReadLogs(job, before, 10);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 3u);
  EXPECT_EQ((*read)[0].line(), "one");
  EXPECT_EQ((*read)[1].line(), "two");
  EXPECT_EQ((*read)[2].line(), "restarted agent");
}

// An attempt's keys are bounded: every key stays in memory and in the
// store until the attempt ends, and any token holder may write under a
// live attempt's prefix. A new key past the bound is refused; a key set
// again still is replaced.
TEST_F(CoordinatorTest, AnAttemptsRendezvousKeysAreBounded) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  RunningJob(job);
  const int64_t max_keys = 1024 + 64 * 2;
  int64_t set = 0;
  absl::Status refused;
  while (refused.ok() && set < 2 * max_keys) {
    refused = c().KvSet(absl::StrCat(job, "/attempt-0/k", set), "v", 0);
    if (refused.ok()) ++set;
  }
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("an attempt of 2 ranks may hold 1152 keys"));
  EXPECT_EQ(set, max_keys - 1);  // and rank 0's mark, .met/0
  EXPECT_TRUE(c().KvSet(job + "/attempt-0/k0", "replaced", 0).ok());
  auto v = c().KvGet(job + "/attempt-0/k0", absl::ZeroDuration());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "replaced");
  // One big value counts by its bytes.
  const std::string other = Submit(DemoJobSpec(2, 5));
  RunningJob(other);
  const std::string mib(RendezvousStore::kMaxValue, 'x');
  int64_t big = 0;
  absl::Status full;
  while (full.ok() && big < 200) {
    full = c().KvSet(absl::StrCat(other, "/attempt-0/big", big), mib, 0);
    if (full.ok()) ++big;
  }
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_GE(big, 64);
  EXPECT_LT(big, 70);
}

TEST_F(CoordinatorTest, RendezvousKeysSurviveARestartAndLeaveWithTheirAttempt) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  ASSERT_TRUE(c().KvSet(job + "/attempt-0/rank-0", "addr0").ok());
  // Another live attempt's keys are its own; a key under no live attempt
  // is refused (it would stay for good).
  const std::string other = Submit(DemoJobSpec(2, 5));  // waits: the worker is busy
  ASSERT_TRUE(c().KvSet(other + "/attempt-0/rank-0", "x").ok());
  for (const std::string& key : std::vector<std::string>{
           "other/key", other + "/attempt-1/rank-0", "job-99/attempt-0/rank-0", job + "/attempt-0/",
           job + "/attempt-x/rank-0", job + "/attempt-00/rank-0", job + "/attempt-+0/rank-0"}) {
    const absl::Status refused = c().KvSet(key, "x");
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << key;
    EXPECT_THAT(refused.message(), HasSubstr("key: expected one under a live attempt's prefix")) << key;
  }
  Open();
  auto v = c().KvGet(job + "/attempt-0/rank-0", absl::ZeroDuration());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "addr0");
  Register(w, {Runs(job, 0, {0, 1})});
  ASSERT_TRUE(Exited(w, job, 0, kRankExitOk).ok());
  ASSERT_TRUE(Exited(w, job, 1, kRankExitOk).ok());
  ASSERT_EQ(Get(job).state(), v1::SUCCEEDED);
  EXPECT_EQ(c().KvGet(job + "/attempt-0/rank-0", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(c().KvGet(other + "/attempt-0/rank-0", absl::ZeroDuration()).ok());
  Open();
  EXPECT_EQ(c().KvGet(job + "/attempt-0/rank-0", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kNotFound);
}

// A write to the database that fails (here: another process holds it
// locked past the busy timeout, a real SQLITE_BUSY) is never ignored: the
// coordinator stops changing state, reports why (Health, /readyz), refuses
// every change, and a restart recovers the last state the database holds.
TEST_F(CoordinatorTest, AFailedStoreWriteFreezesTheCoordinatorUntilARestart) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  ASSERT_TRUE(c().Health().ok());
  const std::string key = job + "/attempt-0/world/0";
  ASSERT_TRUE(c().KvSet(key, "addr0", 0).ok());  // rank 0 has met
  sqlite3* other = nullptr;
  ASSERT_EQ(sqlite3_open((dir_ + "/state.db").c_str(), &other), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(other, "BEGIN EXCLUSIVE", nullptr, nullptr, nullptr), SQLITE_OK);
  // Rank 0 exits: recording it needs a write, which waits out the busy
  // timeout and fails.
  absl::Status s = Exited(w, job, 0, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("state database failed to record " + job));
  EXPECT_EQ(c().Health().code(), absl::StatusCode::kUnavailable);
  // /readyz says so too.
  const std::string readyz = testing_cluster::HttpGet(absl::StrCat("127.0.0.1:", metrics_->port()), "/readyz");
  EXPECT_THAT(readyz, HasSubstr(" 503 "));
  EXPECT_THAT(readyz, HasSubstr("state database failed"));
  ASSERT_EQ(sqlite3_exec(other, "COMMIT", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(other);
  // The database works again, but memory may be ahead of it: still frozen.
  EXPECT_EQ(Exited(w, job, 1, 0).code(), absl::StatusCode::kUnavailable);
  v1::SubmitJobRequest req;
  *req.mutable_spec() = DemoJobSpec(2, 5);
  EXPECT_EQ(c().SubmitJob(req).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Heartbeat(w).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(c().CancelJob(job).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(c().KvSet("k", "v").code(), absl::StatusCode::kUnavailable);
  // Reads go on where they write nothing: rank 0 is marked already; rank
  // 1's first read would need its mark written.
  auto read = c().KvGet(key, absl::ZeroDuration(), 0);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "addr0");
  EXPECT_EQ(c().KvGet(key, absl::ZeroDuration(), 1).status().code(), absl::StatusCode::kUnavailable);
  absl::SleepFor(absl::Milliseconds(500));  // ticks: no worker expiry, nothing changes
  EXPECT_EQ(Get(job).state(), v1::RUNNING);
  // A restart recovers from the database: the worker re-attaches with both
  // ranks' exits and the job ends.
  Open();
  EXPECT_TRUE(c().Health().ok());
  v1::RunningJob running;
  running.set_job_id(job);
  running.set_attempt(0);
  running.add_ranks(0);
  running.add_ranks(1);
  Register(w, {running});
  EXPECT_TRUE(Exited(w, job, 0, 0).ok());
  EXPECT_TRUE(Exited(w, job, 1, 0).ok());
  EXPECT_TRUE(WaitState(job, v1::SUCCEEDED)) << Get(job).DebugString();
}

// A corrupt record of one live job (here a rank's step report, read back
// to resume its steps) fails that job at the restart, STATE_CORRUPT, and
// the coordinator starts with the others: before, Start failed DATA_LOSS
// and the coordinator could not start at all (and a live job cannot be
// deleted to clear it).
TEST_F(CoordinatorTest, ACorruptRecordOfALiveJobFailsItAndTheRestartGoesOn) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  ASSERT_TRUE(c().KvSet(job + "/attempt-0/world/0", "addr0", 0).ok());  // rank 0 has met
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, job, {1}, 2.0, {0})).ok());  // rank 0 only: kept, not yet an event
  const std::string other = Submit(DemoJobSpec(2, 5));                  // waits: the worker is busy
  ASSERT_EQ(Get(other).state(), v1::PENDING);
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open((dir_ + "/state.db").c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db, ("UPDATE rank_steps SET telemetry = x'ffffffff' WHERE job = '" + job + "'").c_str(),
                         nullptr, nullptr, nullptr),
            SQLITE_OK);
  ASSERT_EQ(sqlite3_changes(db), 1);
  sqlite3_close(db);
  Open();  // ASSERTs that Start succeeds
  const v1::Job failed = Get(job);
  EXPECT_EQ(failed.state(), v1::FAILED) << failed.DebugString();
  EXPECT_EQ(failed.failure().kind(), v1::Failure::STATE_CORRUPT);
  EXPECT_THAT(failed.failure().message(),
              AllOf(HasSubstr("could not recover this job at its restart"), HasSubstr("corrupt")));
  EXPECT_EQ(failed.placement_size(), 0);
  EXPECT_EQ(c().KvGet(job + "/attempt-0/world/0", absl::ZeroDuration()).status().code(), absl::StatusCode::kNotFound)
      << "the failed attempt's rendezvous keys were kept";
  EXPECT_EQ(Get(other).state(), v1::PENDING);
  // Its worker, registering again with the ranks running, is told to stop them.
  EXPECT_EQ(CancellationsAtRegister(w, job), 1);
}

// A live job whose own row does not parse: replaced at the restart by a
// FAILED record saying so (its spec is lost), and the others recovered.
// Before, ListJobs failed its whole page DATA_LOSS and Start with it.
TEST_F(CoordinatorTest, ALiveJobWhoseRowDoesNotParseFailsAndTheRestartGoesOn) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  ASSERT_TRUE(c().KvSet(job + "/attempt-0/world/0", "addr0", 0).ok());  // rank 0 has met
  const std::string other = Submit(DemoJobSpec(2, 5));
  ASSERT_EQ(Get(other).state(), v1::PENDING);
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open((dir_ + "/state.db").c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db, "UPDATE jobs SET job = x'ffffffff' WHERE seq = 1", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(db);
  Open();  // ASSERTs that Start succeeds
  const v1::Job failed = Get(job);
  EXPECT_EQ(failed.state(), v1::FAILED) << failed.DebugString();
  EXPECT_EQ(failed.failure().kind(), v1::Failure::STATE_CORRUPT);
  EXPECT_THAT(failed.failure().message(), HasSubstr("does not parse"));
  EXPECT_EQ(c().KvGet(job + "/attempt-0/world/0", absl::ZeroDuration()).status().code(), absl::StatusCode::kNotFound)
      << "the replaced job's rendezvous keys were kept";
  EXPECT_EQ(Get(other).state(), v1::PENDING);
  // Its worker, registering again with the ranks running, is told to stop them.
  EXPECT_EQ(CancellationsAtRegister(w, job), 1);
  v1::ListJobsRequest list;
  auto listed = c().ListJobs(list);
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->jobs_size(), 2);
  // A finished job's row may be deleted as usual.
  EXPECT_TRUE(c().DeleteJob(job, "").ok());
}

// The FAILED record that replaces an unreadable row is a failure like any
// other to the metrics: plateau_job_failures_total counts it (the
// PlateauJobFailed alert) and the job's series leave after
// --metrics_retention_s. Before, its FAILED state series stayed until the
// next restart, and no counter moved.
TEST_F(CoordinatorTest, AJobWhoseRowDoesNotParseIsCountedAndItsSeriesLeaveAfterTheRetention) {
  options_.metrics_retention = absl::Milliseconds(300);
  Open();
  const std::string job = Submit(DemoJobSpec(2, 5));
  RunningJob(job);
  const std::string address = absl::StrCat("127.0.0.1:", metrics_->port());
  const std::string failures = "plateau_job_failures_total{reason=\"STATE_CORRUPT\"}";
  const double before = testing_cluster::Sample(testing_cluster::Scrape(address), failures);
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open((dir_ + "/state.db").c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db, ("UPDATE jobs SET job = x'ffffffff' WHERE seq = " + job.substr(job.find('-') + 1)).c_str(),
                         nullptr, nullptr, nullptr),
            SQLITE_OK);
  ASSERT_EQ(sqlite3_changes(db), 1);
  sqlite3_close(db);
  const absl::Time restarted = absl::Now();
  Open();  // ASSERTs that Start succeeds
  ASSERT_EQ(Get(job).state(), v1::FAILED);
  std::string scrape = testing_cluster::Scrape(address);
  EXPECT_EQ(testing_cluster::Sample(scrape, failures), before + 1) << scrape;
  ASSERT_TRUE(testing_cluster::WaitFor(
      [&] { return !absl::StrContains(testing_cluster::Scrape(address), "job_id=\"" + job + "\""); },
      absl::Seconds(10)))
      << "the unreadable job's series stayed: " << testing_cluster::Scrape(address);
  EXPECT_GE(absl::Now() - restarted, absl::Milliseconds(300));
}

// A submit whose write fails stores nothing: the client is told
// UNAVAILABLE, and a restarted coordinator has no job to run. (The job
// and its first event were two writes: the job stayed stored, PENDING, and
// ran after the restart; a retry without a request id made a second.)
TEST_F(CoordinatorTest, ASubmitThatFailsToBeStoredLeavesNoJob) {
  sqlite3* other = nullptr;
  ASSERT_EQ(sqlite3_open((dir_ + "/state.db").c_str(), &other), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(other,
                         "CREATE TRIGGER refuse BEFORE INSERT ON events BEGIN SELECT RAISE(ABORT, 'refused by the "
                         "test'); END",
                         nullptr, nullptr, nullptr),
            SQLITE_OK);
  v1::SubmitJobRequest req;
  *req.mutable_spec() = DemoJobSpec(2, 5);
  auto refused = c().SubmitJob(req);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  ASSERT_EQ(sqlite3_exec(other, "DROP TRIGGER refuse", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(other);
  Open();  // the restart a frozen coordinator asks for
  v1::ListJobsRequest list;
  auto listed = c().ListJobs(list);
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->jobs_size(), 0) << listed->DebugString();
}

// One event per step of the whole job; a restarted coordinator neither
// loses the steps some ranks had reported nor writes a step event twice.
// mu_ is held across store writes, and a write waiting on a busy database
// holds it for as long (up to SQLite's 5 s busy timeout, far past the worker
// timeout). A heartbeat that arrived meanwhile shows the worker alive: the
// coordinator's own stall must not declare it lost. (Without the in-flight
// count this fails whenever the tick takes the lock before the heartbeat.)
TEST_F(CoordinatorTest, AHeartbeatWaitingOnASlowStoreWriteKeepsItsWorker) {
  options_.worker_timeout = kShortWorkerTimeout;
  Open();
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  sqlite3* other = nullptr;
  ASSERT_EQ(sqlite3_open((dir_ + "/state.db").c_str(), &other), SQLITE_OK);
  // The worker's last contact just before the writer takes mu_: the
  // timeout then starts no earlier than the stall it is about.
  ASSERT_TRUE(Heartbeat(w).ok());
  ASSERT_EQ(sqlite3_exec(other, "BEGIN EXCLUSIVE", nullptr, nullptr, nullptr), SQLITE_OK);
  std::string second;
  std::thread writer([&] { second = Submit(DemoJobSpec(2, 5)); });  // waits on the database, holding mu_
  // Time for the writer to plan its job (outside mu_) and take mu_: a
  // heartbeat ahead of it would not be in flight while the lock is held.
  // 500 + 900 ms stays well inside SQLite's 5 s busy timeout.
  absl::SleepFor(absl::Milliseconds(500));
  absl::StatusOr<v1::HeartbeatResponse> beat;
  std::thread heartbeat([&] { beat = Heartbeat(w); });  // arrives, waits for mu_
  // Three worker timeouts (kShortWorkerTimeout) with the lock held.
  absl::SleepFor(absl::Milliseconds(900));
  ASSERT_EQ(sqlite3_exec(other, "COMMIT", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(other);
  writer.join();
  heartbeat.join();
  EXPECT_FALSE(second.empty()) << "the write waited and went through";
  EXPECT_TRUE(beat.ok()) << beat.status();
  EXPECT_EQ(Get(job).state(), v1::RUNNING);
  EXPECT_THAT(Said(), ::testing::Not(HasSubstr(w + " lost"))) << Said();
  // It is still registered: the next heartbeat is answered.
  EXPECT_TRUE(Heartbeat(w).ok());
}

TEST_F(CoordinatorTest, StepEventsSurviveARestartWithoutLossOrRepeat) {
  const std::string job = Submit(DemoJobSpec(2, 10));
  const std::string w = RunningJob(job);
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, job, {1, 2})).ok());
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, job, {3}, 2.0, {0})).ok());  // rank 1 is behind
  EXPECT_EQ(StepEvents(job), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(Get(job).progress().step(), 2);
  // A report stored but the coordinator stopped before its event: both
  // ranks' step 4 is in the store, step 4 is not an event.
  ASSERT_TRUE(store_
                  ->PutRankSteps({JobRankStep{job, Steps(w, job, {4}, 2.0, {0}).steps(0).telemetry()},
                                  JobRankStep{job, Steps(w, job, {3, 4}, 2.0, {1}).steps(0).telemetry()},
                                  JobRankStep{job, Steps(w, job, {3, 4}, 2.0, {1}).steps(1).telemetry()}})
                  .ok());
  Open();
  // Steps 3 and 4 had every rank's report: events now, once.
  EXPECT_EQ(StepEvents(job), (std::vector<int64_t>{1, 2, 3, 4}));
  Register(w, {Runs(job, 0, {0, 1})});
  // The agent re-sends a batch whose reply was lost before the restart.
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, job, {3, 4})).ok());
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, job, {5})).ok());
  EXPECT_EQ(StepEvents(job), (std::vector<int64_t>{1, 2, 3, 4, 5}));
  Open();
  Register(w, {Runs(job, 0, {0, 1})});
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, job, {6})).ok());
  EXPECT_EQ(StepEvents(job), (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(Get(job).event_count(), *store_->EventCount(job));
  EXPECT_THAT(Said(), HasSubstr(job + " attempt 0 re-attached to " + w + " after the coordinator's restart"));
}

// Per-rank detail on request: each step event with every rank's report.
TEST_F(CoordinatorTest, PerRankDetailIsThereOnRequest) {
  const std::string job = Submit(DemoJobSpec(2, 10));
  const std::string w = RunningJob(job);
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, job, {1, 2, 3})).ok());
  auto plain = c().ReadEvents(job, 0, 100, /*per_rank=*/false);
  auto detail = c().ReadEvents(job, 0, 100, /*per_rank=*/true);
  ASSERT_TRUE(plain.ok() && detail.ok());
  ASSERT_EQ(plain->size(), detail->size());
  int steps = 0;
  for (size_t i = 0; i < detail->size(); ++i) {
    EXPECT_EQ((*detail)[i].index(), (*plain)[i].index());
    if (!(*detail)[i].has_job_step()) continue;
    ++steps;
    const v1::JobStepSummary& s = (*detail)[i].job_step();
    EXPECT_EQ((*plain)[i].job_step().per_rank_size(), 0);
    ASSERT_EQ(s.per_rank_size(), 2);
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(s.per_rank(r).rank(), r);
      EXPECT_EQ(s.per_rank(r).step(), s.step());
    }
  }
  EXPECT_EQ(steps, 3);
}

// A per-rank read holds at most per_rank_reports_per_read reports' worth of
// events: 5 reports over 2 ranks is 2 events a read, read on to the end
// without a gap; a plain read is not limited.
TEST_F(CoordinatorTest, APerRankReadIsBoundedByItsReports) {
  options_.per_rank_reports_per_read = 5;
  Open();
  const std::string job = Submit(DemoJobSpec(2, 10));
  const std::string w = RunningJob(job);
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, job, {1, 2, 3, 4, 5})).ok());
  auto plain = c().ReadEvents(job, 0, 100, /*per_rank=*/false);
  ASSERT_TRUE(plain.ok()) << plain.status();
  ASSERT_GT(plain->size(), 5u);
  std::vector<int64_t> indices, steps;
  for (int64_t from = 0;;) {
    auto read = c().ReadEvents(job, from, 100, /*per_rank=*/true);
    ASSERT_TRUE(read.ok()) << read.status();
    if (read->empty()) break;
    EXPECT_LE(read->size(), 2u);
    for (const v1::JobEvent& e : *read) {
      indices.push_back(e.index());
      if (e.has_job_step()) {
        steps.push_back(e.job_step().step());
        EXPECT_EQ(e.job_step().per_rank_size(), 2) << "step " << e.job_step().step();
      }
    }
    from = read->back().index() + 1;
  }
  ASSERT_EQ(indices.size(), plain->size());
  for (size_t i = 0; i < indices.size(); ++i) EXPECT_EQ(indices[i], (*plain)[i].index());
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5}));
  // A rank count past the cap still reads one event at a time.
  options_.per_rank_reports_per_read = 1;
  Open();
  auto one = c().ReadEvents(job, 0, 100, /*per_rank=*/true);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->size(), 1u);
}

TEST_F(CoordinatorTest, OnlyAFinishedJobCanBeDeletedAndThenItIsGone) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, job, {1})).ok());
  absl::Status live = c().DeleteJob(job);
  EXPECT_EQ(live.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(live.message(), HasSubstr("job " + job + " is RUNNING: only a finished job"));
  EXPECT_THAT(live.message(), HasSubstr("cancel it first"));
  ASSERT_TRUE(Exited(w, job, 0, kRankExitOk).ok());
  ASSERT_TRUE(Exited(w, job, 1, kRankExitOk).ok());
  ASSERT_EQ(Get(job).state(), v1::SUCCEEDED);
  ASSERT_TRUE(c().DeleteJob(job).ok());
  EXPECT_EQ(c().GetJob(job).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store_->ReadEvents(job, 0, 100)->empty());
  EXPECT_TRUE(store_->ReadLogs(job, 0, 100)->empty());
  EXPECT_TRUE(store_->ReadRankSteps(job, 0, 0, 100)->empty());
  EXPECT_EQ(c().DeleteJob(job).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c().DeleteJob("job-x").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Said(), HasSubstr(job + " deleted (SUCCEEDED"));
}

// A job of more rows than one part (kSweepRowsPerTick, 20,000) is deleted in
// parts with the lock released between them: a job of millions of rows
// held it for seconds, and every heartbeat waited. Meanwhile the job reads
// as it was, a second delete is refused, and a late log line is dropped.
TEST_F(CoordinatorTest, AJobOfManyRowsIsDeletedInPartsWithTheLockFreeBetween) {
  std::string job;
  std::string w;
  std::vector<int64_t> parts;
  options_.after_delete_part = [&](int64_t rows) {
    parts.push_back(rows);
    if (parts.size() != 1) return;
    // Each of these takes the coordinator's lock: with it held, they would
    // deadlock.
    absl::StatusOr<v1::Job> read = c().GetJob(job);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->state(), v1::SUCCEEDED);
    // Marked before its first part: a delete cut short by a restart leaves
    // a job that reads as swept, not one that looks whole with rows gone.
    EXPECT_TRUE(read->has_events_deleted_time());
    EXPECT_TRUE(store_->GetJob(job)->has_events_deleted_time());
    absl::Status again = c().DeleteJob(job);
    EXPECT_EQ(again.code(), absl::StatusCode::kAborted) << again;
    EXPECT_THAT(again.message(), HasSubstr("is being deleted by another request"));
    EXPECT_TRUE(c().ReportTelemetry(LogLine(w, job, "while it is deleted")).ok());
  };
  Open();
  job = Submit(DemoJobSpec(2, 5));
  w = RunningJob(job);
  ASSERT_TRUE(Exited(w, job, 0, kRankExitOk).ok());
  ASSERT_TRUE(Exited(w, job, 1, kRankExitOk).ok());
  ASSERT_EQ(Get(job).state(), v1::SUCCEEDED);
  std::vector<JobRankStep> many(45000);
  for (int i = 0; i < 45000; ++i) {
    many[i].job_id = job;
    many[i].telemetry.set_attempt(5);
    many[i].telemetry.set_step(i + 1);
  }
  ASSERT_TRUE(store_->PutRankSteps(many).ok());
  ASSERT_TRUE(c().DeleteJob(job).ok());
  ASSERT_EQ(parts.size(), 3u);  // 20,000 + 20,000 + the rest
  EXPECT_EQ(parts[0], 20000);
  EXPECT_EQ(parts[1], 20000);
  EXPECT_EQ(c().GetJob(job).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store_->ReadRankSteps(job, 5, 0, INT64_MAX)->empty());
  EXPECT_TRUE(store_->ReadLogs(job, 0, 100)->empty()) << "the late line was stored";
  EXPECT_TRUE(store_->ReadEvents(job, 0, 100)->empty());
  EXPECT_THAT(Said(), HasSubstr(job + " deleted (SUCCEEDED"));
  EXPECT_THAT(Said(), HasSubstr("its data in 3 parts"));
  // A second delete after the first ended finds nothing.
  EXPECT_EQ(c().DeleteJob(job).code(), absl::StatusCode::kNotFound);
}

// The coordinator killed between the parts of a delete (after its first of
// three), restarted: the delete is finished by the restarted coordinator,
// on its own, without a second DeleteJob. Before, the job stayed as the
// delete left it, reading as swept (events_deleted_time) with two thirds
// of its rows stored, and the retention sweep skipped it (it reads swept):
// until someone deleted it again.
TEST_F(CoordinatorTest, ADeleteCutShortByACrashIsFinishedByTheRestartedCoordinator) {
  const std::string crash = dir_ + "/crash.db";
  int parts = 0;
  options_.after_delete_part = [&](int64_t) {
    if (++parts == 1) Snapshot(crash);
  };
  Open();
  const std::string job = SucceededJob(45000);
  ASSERT_EQ(Get(job).state(), v1::SUCCEEDED);
  ASSERT_TRUE(c().DeleteJob(job, "CN=alice").ok());
  ASSERT_EQ(parts, 3);
  options_.after_delete_part = nullptr;
  // Restarted with ticks too far apart to run one: what the crash left,
  // marked and two parts' rows still there, and the delete under way.
  options_.tick = absl::Hours(1);
  RestartFrom(crash);
  EXPECT_TRUE(Get(job).has_events_deleted_time());
  EXPECT_EQ(store_->ReadRankSteps(job, 5, 0, INT64_MAX)->size(), 25000u);
  const absl::Status again = c().DeleteJob(job);
  EXPECT_EQ(again.code(), absl::StatusCode::kAborted) << again;
  EXPECT_THAT(again.message(), HasSubstr("a delete a restart of the coordinator cut short"));
  // A second restart, ticking: the ticks finish it.
  options_.tick = absl::Milliseconds(20);
  Open();
  ASSERT_TRUE(testing_cluster::WaitFor([&] { return c().GetJob(job).status().code() == absl::StatusCode::kNotFound; },
                                       absl::Seconds(20)))
      << Get(job).DebugString() << "\n"
      << store_->ReadRankSteps(job, 5, 0, INT64_MAX)->size() << " rank reports left\n"
      << Said();
  EXPECT_TRUE(store_->ReadRankSteps(job, 5, 0, INT64_MAX)->empty());
  EXPECT_TRUE(store_->ReadEvents(job, 0, 100)->empty());
  EXPECT_TRUE(store_->ReadLogs(job, 0, 100)->empty());
  EXPECT_THAT(Said(), HasSubstr(job + " deleted by CN=alice (SUCCEEDED"));
  EXPECT_THAT(Said(), HasSubstr("its delete, cut short by a restart, finished"));
  EXPECT_EQ(c().DeleteJob(job).code(), absl::StatusCode::kNotFound);
  auto list = c().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->jobs_size(), 0);
  // Nothing left to resume at the next start.
  {
    absl::MutexLock lock(&said_mu_);
    said_.clear();
  }
  Open();
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_THAT(Said(), ::testing::Not(HasSubstr("delete")));
}

// Killed after the last part of its data and before its record went: the
// job read as swept with nothing of it left, for good. The restarted
// coordinator removes the record.
TEST_F(CoordinatorTest, ADeleteCutShortAfterItsLastPartIsFinishedByTheRestartedCoordinator) {
  const std::string crash = dir_ + "/crash.db";
  int parts = 0;
  options_.after_delete_part = [&](int64_t) {
    if (++parts == 2) Snapshot(crash);  // the last of two
  };
  Open();
  const std::string job = SucceededJob(25000);
  ASSERT_EQ(Get(job).state(), v1::SUCCEEDED);
  ASSERT_TRUE(c().DeleteJob(job).ok());
  ASSERT_EQ(parts, 2);
  options_.after_delete_part = nullptr;
  RestartFrom(crash);
  ASSERT_TRUE(testing_cluster::WaitFor([&] { return c().GetJob(job).status().code() == absl::StatusCode::kNotFound; },
                                       absl::Seconds(20)))
      << Get(job).DebugString() << "\n"
      << Said();
  EXPECT_THAT(Said(), HasSubstr(job + " deleted (SUCCEEDED"));
  EXPECT_EQ(c().DeleteJob(job).code(), absl::StatusCode::kNotFound);
}

// A coordinator stopped (SIGTERM) while a delete is between its parts stops
// the delete there, says so to its caller (UNAVAILABLE: the call did not
// finish, the delete will), and the next start finishes it: a large delete
// no longer holds the shutdown for its whole length.
TEST_F(CoordinatorTest, ADeleteStoppedByAShutdownIsFinishedAtTheNextStart) {
  int parts = 0;
  options_.after_delete_part = [&](int64_t) {
    if (++parts == 1) c().Stop();
  };
  Open();
  const std::string job = SucceededJob(45000);
  ASSERT_EQ(Get(job).state(), v1::SUCCEEDED);
  const absl::Status s = c().DeleteJob(job);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("shutting down"));
  EXPECT_EQ(parts, 1) << "the delete went on after the stop";
  EXPECT_FALSE(store_->ReadRankSteps(job, 5, 0, INT64_MAX)->empty());
  options_.after_delete_part = nullptr;
  Open();  // the restart, on the same database
  ASSERT_TRUE(testing_cluster::WaitFor([&] { return c().GetJob(job).status().code() == absl::StatusCode::kNotFound; },
                                       absl::Seconds(20)))
      << Said();
  EXPECT_TRUE(store_->ReadRankSteps(job, 5, 0, INT64_MAX)->empty());
}

// A delete asked once the coordinator is shutting down is refused before
// it writes anything: UNAVAILABLE says it did not begin (it was committed
// as begun, then stopped, so a retry met ABORTED and then NOT_FOUND for a
// delete its caller was told had not happened).
TEST_F(CoordinatorTest, ADeleteAskedDuringAShutdownBeginsNothing) {
  const std::string job = SucceededJob();
  ASSERT_EQ(Get(job).state(), v1::SUCCEEDED);
  c().Stop();
  const absl::Status s = c().DeleteJob(job);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("was not deleted"));
  EXPECT_TRUE(store_->UnfinishedDeletes()->empty()) << "a delete was recorded as begun";
  absl::StatusOr<v1::Job> kept = store_->GetJob(job);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_FALSE(kept->has_events_deleted_time()) << "the job was marked as being deleted";
}

// A record of a delete that no DeleteJob could have written (a live job's:
// DeleteJob refuses those; a hand edit, a restored backup) is forgotten at
// start, not kept: kept, a restart after the job ends would delete it
// unasked.
TEST_F(CoordinatorTest, ARecordOfALiveJobsDeleteIsForgottenAtStart) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  RunningJob(job);
  ASSERT_TRUE(store_->BeginDelete(job, "someone", nullptr).ok());
  ASSERT_EQ(store_->UnfinishedDeletes()->size(), 1u);
  Open();  // the restart, on the same database: the job is live (RUNNING)
  EXPECT_TRUE(store_->UnfinishedDeletes()->empty()) << Said();
  EXPECT_THAT(Said(), HasSubstr("forgetting a record of a delete of '" + job + "'"));
  EXPECT_TRUE(c().GetJob(job).ok());
}

// A finished job whose record no longer parses fails every listing, naming
// it; deleting it is how an operator clears it, and the listing works again.
TEST_F(CoordinatorTest, AFinishedJobsCorruptRecordIsNamedAndCanBeDeleted) {
  const std::string job = SucceededJob();
  ASSERT_EQ(Get(job).state(), v1::SUCCEEDED);
  const std::string other_job = Submit(DemoJobSpec(2, 5));
  sqlite3* other = nullptr;
  ASSERT_EQ(sqlite3_open((dir_ + "/state.db").c_str(), &other), SQLITE_OK);
  sqlite3_busy_timeout(other, 10000);  // the coordinator's loop may be writing
  const std::string sql =
      absl::StrCat("UPDATE jobs SET job = x'ffffffff' WHERE seq = ", job.substr(4));
  ASSERT_EQ(sqlite3_exec(other, sql.c_str(), nullptr, nullptr, nullptr), SQLITE_OK)
      << sqlite3_errmsg(other);
  sqlite3_close(other);

  auto list = c().ListJobs(v1::ListJobsRequest());
  EXPECT_EQ(list.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(list.status().message(), HasSubstr(job + ": corrupt record"));
  EXPECT_THAT(list.status().message(), HasSubstr("plateauctl delete " + job));
  ASSERT_TRUE(c().DeleteJob(job).ok());
  EXPECT_THAT(Said(), HasSubstr(job + " deleted (SUCCEEDED; its record was corrupt)"));
  list = c().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->jobs_size(), 1);
  EXPECT_EQ(list->jobs(0).id(), other_job);
}

TEST_F(CoordinatorTest, RetentionRemovesAFinishedJobsEventsAndKeepsTheJob) {
  options_.retention = absl::Milliseconds(400);
  Open();
  const std::string done = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(done);
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, done, {1})).ok());
  ASSERT_TRUE(Exited(w, done, 0, kRankExitOk).ok());
  ASSERT_TRUE(Exited(w, done, 1, kRankExitOk).ok());
  ASSERT_EQ(Get(done).state(), v1::SUCCEEDED);
  const int64_t count = Get(done).event_count();
  // More rank reports than a tick deletes (kSweepRowsPerTick, 20,000): the
  // sweep goes on over the next ticks until none is left.
  std::vector<JobRankStep> many(25000);
  for (int i = 0; i < 25000; ++i) {
    many[i].job_id = done;
    many[i].telemetry.set_attempt(7);
    many[i].telemetry.set_step(i + 1);
  }
  ASSERT_TRUE(store_->PutRankSteps(many).ok());
  const std::string live = Submit(DemoJobSpec(2, 5));  // placed on the freed worker: live
  ASSERT_TRUE(testing_cluster::WaitFor([&] { return Get(done).has_events_deleted_time(); }, absl::Seconds(10)))
      << Get(done).DebugString();
  EXPECT_EQ(Get(done).state(), v1::SUCCEEDED);
  EXPECT_EQ(Get(done).event_count(), count);  // how many there were
  EXPECT_TRUE(store_->ReadEvents(done, 0, 100)->empty());
  EXPECT_TRUE(store_->ReadLogs(done, 0, 100)->empty());
  EXPECT_TRUE(store_->ReadRankSteps(done, 7, 0, INT64_MAX)->empty());
  EXPECT_FALSE(store_->ReadEvents(live, 0, 100)->empty()) << "a live job's events are never swept";
  EXPECT_THAT(Said(), HasSubstr(done + ": removed its " + std::to_string(count) + " event(s)"));
  // A late line of the swept job is dropped, not stored as its log's line
  // 0 (a client resuming its log from where it was would never read it).
  ASSERT_TRUE(c().ReportTelemetry(LogLine(w, done, "after the sweep")).ok());
  EXPECT_TRUE(store_->ReadLogs(done, 0, 100)->empty()) << "a swept job's log began again";
  // A sweep starts from the oldest job not yet swept: one that was live at
  // the last sweep is swept once it has finished and its retention passed.
  StartOn(w, live);
  ASSERT_TRUE(Exited(w, live, 0, kRankExitOk).ok());
  ASSERT_TRUE(Exited(w, live, 1, kRankExitOk).ok());
  ASSERT_EQ(Get(live).state(), v1::SUCCEEDED);
  ASSERT_TRUE(testing_cluster::WaitFor([&] { return Get(live).has_events_deleted_time(); }, absl::Seconds(10)))
      << Get(live).DebugString();
  EXPECT_TRUE(store_->ReadEvents(live, 0, 100)->empty());
}

// Two due jobs of 15,000 rank reports each against a budget of 20,000 rows
// a tick: the first is swept whole and the second begun in the same tick,
// then finished alone at the next (sweeping_), and the pass goes on from
// where it stopped. Both end swept; a job deleted while it was being swept
// does not stop the sweep.
TEST_F(CoordinatorTest, TheSweepSharesOneRowBudgetATickAcrossJobs) {
  options_.retention = absl::Milliseconds(300);
  Open();
  std::vector<std::string> done;
  const std::string w = Register();
  for (int j = 0; j < 3; ++j) {
    const std::string id = Submit(DemoJobSpec(2, 5));
    StartOn(w, id);  // the worker is free again after each
    ASSERT_TRUE(Exited(w, id, 0, kRankExitOk).ok());
    ASSERT_TRUE(Exited(w, id, 1, kRankExitOk).ok());
    ASSERT_EQ(Get(id).state(), v1::SUCCEEDED);
    std::vector<JobRankStep> many(15000);
    for (int i = 0; i < 15000; ++i) {
      many[i].job_id = id;
      many[i].telemetry.set_attempt(3);
      many[i].telemetry.set_step(i + 1);
    }
    ASSERT_TRUE(store_->PutRankSteps(many).ok());
    done.push_back(id);
  }
  ASSERT_TRUE(c().DeleteJob(done[2], "").ok());  // gone before its turn
  for (int j = 0; j < 2; ++j) {
    ASSERT_TRUE(testing_cluster::WaitFor([&] { return Get(done[j]).has_events_deleted_time(); }, absl::Seconds(20)))
        << done[j] << "\n"
        << Said();
    EXPECT_TRUE(store_->ReadRankSteps(done[j], 3, 0, INT64_MAX)->empty()) << done[j];
  }
}

// A job that finished before a restart is swept by the restarted
// coordinator (which reads the finished jobs still holding data once, at
// its start), and one finished after it by its end (SetState).
TEST_F(CoordinatorTest, TheSweepFindsJobsFinishedBeforeARestart) {
  options_.retention = absl::Milliseconds(500);
  Open();
  const std::string before = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(before);
  ASSERT_TRUE(Exited(w, before, 0, kRankExitOk).ok());
  ASSERT_TRUE(Exited(w, before, 1, kRankExitOk).ok());
  ASSERT_EQ(Get(before).state(), v1::SUCCEEDED);
  Open();  // a restart before it is due
  const std::string w2 = Register();
  const std::string after = Submit(DemoJobSpec(2, 5));
  StartOn(w2, after);
  ASSERT_TRUE(Exited(w2, after, 0, kRankExitOk).ok());
  ASSERT_TRUE(Exited(w2, after, 1, kRankExitOk).ok());
  for (const std::string& id : {before, after}) {
    EXPECT_TRUE(testing_cluster::WaitFor([&] { return Get(id).has_events_deleted_time(); }, absl::Seconds(10)))
        << id << "\n"
        << Said();
  }
}

// An agent that restarts before it is declared lost registers with the id it
// kept in its work dir: the same worker, once; its ranks are gone.
TEST_F(CoordinatorTest, ARestartedAgentKeepsItsIdAndItsRanksCountAsGone) {
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  ASSERT_EQ(c().ListWorkers().workers_size(), 1);
  EXPECT_EQ(c().ListWorkers().workers(0).slots_free(), 0);
  EXPECT_EQ(c().ListWorkers().workers(0).running_jobs(0), job);
  EXPECT_EQ(Register(w), w);  // same name and address, nothing running
  const v1::ListWorkersResponse workers = c().ListWorkers();
  ASSERT_EQ(workers.workers_size(), 1);
  EXPECT_EQ(workers.workers(0).id(), w);
  EXPECT_EQ(workers.workers(0).state(), "attached");
  EXPECT_EQ(workers.workers(0).address(), "127.0.0.1");
  EXPECT_EQ(workers.workers(0).slots_total(), 2);
  EXPECT_TRUE(workers.workers(0).has_last_heartbeat());
  ASSERT_TRUE(WaitState(job, v1::FAILED)) << Get(job).DebugString();
  EXPECT_THAT(Get(job).failure().message(), HasSubstr("when it registered again after its agent's restart"));
  EXPECT_THAT(Said(), HasSubstr(w + " registered again (its agent restarted)"));
  EXPECT_EQ(c().ListWorkers().workers(0).slots_free(), 2);
  // Another node with a copy of that id is not that worker.
  v1::RegisterRequest other;
  other.mutable_capabilities()->set_backend(v1::BACKEND_CPU);
  other.mutable_capabilities()->set_devices(2);
  other.mutable_capabilities()->set_rank_address("127.0.0.2");
  other.set_worker_id(w);
  auto resp = c().Register(other);
  ASSERT_TRUE(resp.ok());
  EXPECT_NE(resp->worker_id(), w);
  EXPECT_EQ(c().ListWorkers().workers_size(), 2);
}

TEST_F(CoordinatorTest, FinishedJobsMetricSeriesLeaveAfterTheRetention) {
  options_.metrics_retention = absl::Milliseconds(300);
  Open();
  const std::string job = Submit(DemoJobSpec(2, 5));
  const std::string w = RunningJob(job);
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, job, {1}, /*loss=*/2.5)).ok());
  const std::string address = absl::StrCat("127.0.0.1:", metrics_->port());
  const std::string loss = absl::StrCat("plateau_job_loss{job_id=\"", job, "\",rank=\"0\"}");
  EXPECT_EQ(testing_cluster::Sample(testing_cluster::Scrape(address), loss), 2.5);
  ASSERT_TRUE(Exited(w, job, 0, kRankExitOk).ok());
  const absl::Time done = absl::Now();  // before: the job ends inside the last Exited
  ASSERT_TRUE(Exited(w, job, 1, kRankExitOk).ok());
  ASSERT_EQ(Get(job).state(), v1::SUCCEEDED);
  // Still there right after the end: Prometheus must see the final values.
  const std::string state = absl::StrCat("plateau_job_state{job_id=\"", job, "\",state=\"SUCCEEDED\"}");
  EXPECT_EQ(testing_cluster::Sample(testing_cluster::Scrape(address), state), 1);
  ASSERT_TRUE(testing_cluster::WaitFor(
      [&] { return !absl::StrContains(testing_cluster::Scrape(address), "job_id=\"" + job + "\""); },
      absl::Seconds(10)));
  EXPECT_GE(absl::Now() - done, absl::Milliseconds(300));
}

// Scheduling against what the registered workers could ever host. Workers
// stay registered without heartbeats (worker_timeout 30 s); the restart
// settling window (reattach_timeout) is short.
class SchedulingTest : public CoordinatorTest {
 protected:
  void SetUp() override {
    CoordinatorTest::SetUp();
    options_.worker_timeout = absl::Seconds(30);
    options_.reattach_timeout = absl::Milliseconds(300);
    Open();
  }

  std::string RegisterWorker(int devices, v1::Backend backend = v1::BACKEND_CPU, int64_t device_memory_bytes = 0) {
    v1::RegisterRequest req;
    req.mutable_capabilities()->set_backend(backend);
    req.mutable_capabilities()->set_devices(devices);
    req.mutable_capabilities()->set_device_memory_bytes(device_memory_bytes);
    req.mutable_capabilities()->set_rank_address("127.0.0.1");
    auto resp = c().Register(req);
    EXPECT_TRUE(resp.ok()) << resp.status();
    return resp.ok() ? resp->worker_id() : "";
  }

  bool WaitUnschedulable(const std::string& id, bool want = true) {
    return testing_cluster::WaitFor([&] { return Get(id).unschedulable() == want; }, absl::Seconds(10));
  }

  // What WatchJob sends: the job's state changes in order.
  std::vector<v1::StateChange> Changes(const std::string& id) {
    std::vector<v1::StateChange> out;
    auto events = store_->ReadEvents(id, 0, 1000);
    EXPECT_TRUE(events.ok()) << events.status();
    if (!events.ok()) return out;
    for (const v1::JobEvent& e : *events) {
      if (e.has_state_change()) out.push_back(e.state_change());
    }
    return out;
  }
};

using ::testing::AllOf;
using ::testing::StartsWith;

TEST_F(SchedulingTest, MoreRanksThanAnyWorkerHasIsUnschedulableUntilOneThatCanRegistersAndItRuns) {
  const std::string small = RegisterWorker(2);
  const std::string job = Submit(DemoJobSpec(4, 5));
  ASSERT_TRUE(WaitUnschedulable(job)) << Get(job).DebugString();
  v1::Job j = Get(job);
  EXPECT_EQ(j.state(), v1::PENDING);
  EXPECT_THAT(j.state_reason(), AllOf(StartsWith("unschedulable: needs 1 worker(s) with backend cpu, 4 device(s)"),
                                      HasSubstr("no registered worker can host it"),
                                      HasSubstr(small + " has 2 device(s)"),
                                      HasSubstr("fails after 10m (max_pending_s)")));
  EXPECT_TRUE(j.has_unschedulable_since());
  // Watchers see the mark as a state change.
  ASSERT_FALSE(Changes(job).empty());
  EXPECT_TRUE(Changes(job).back().unschedulable());
  EXPECT_EQ(Changes(job).back().reason(), j.state_reason());

  const std::string big = RegisterWorker(4);
  j = Get(job);
  EXPECT_EQ(j.state(), v1::SCHEDULED) << j.DebugString();
  EXPECT_FALSE(j.unschedulable());
  EXPECT_FALSE(j.has_unschedulable_since());
  EXPECT_FALSE(Changes(job).back().unschedulable());
  auto hb = Heartbeat(big);
  ASSERT_TRUE(hb.ok());
  ASSERT_EQ(hb->assignments_size(), 1);
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(Started(big, job, r).ok());
  EXPECT_EQ(Get(job).state(), v1::RUNNING);
}

TEST_F(SchedulingTest, ABackendNoWorkerHasIsUnschedulable) {
  const std::string cpu = RegisterWorker(8);
  v1::JobSpec spec = DemoJobSpec(2, 5);
  spec.set_backend(v1::BACKEND_CUDA);
  spec.set_device_memory_bytes(0);
  const std::string job = Submit(spec);
  ASSERT_TRUE(WaitUnschedulable(job)) << Get(job).DebugString();
  EXPECT_THAT(Get(job).state_reason(),
              AllOf(StartsWith("unschedulable: needs 1 worker(s) with backend cuda"), HasSubstr(cpu + " has backend cpu")));
  // A CUDA worker registering takes it.
  const std::string gpu = RegisterWorker(2, v1::BACKEND_CUDA);
  const v1::Job j = Get(job);
  EXPECT_EQ(j.state(), v1::SCHEDULED);
  EXPECT_EQ(j.placement(0).worker_id(), gpu);
}

TEST_F(SchedulingTest, DevicesSmallerThanTheJobsCapAreUnschedulable) {
  const std::string w = RegisterWorker(4, v1::BACKEND_CPU, int64_t{128} << 20);
  const std::string job = Submit(DemoJobSpec(2, 5));  // 256 MiB per rank
  ASSERT_TRUE(WaitUnschedulable(job)) << Get(job).DebugString();
  EXPECT_THAT(Get(job).state_reason(), AllOf(HasSubstr("2 device(s) and 256 MiB per device"),
                                             HasSubstr(w + " has 128 MiB per device")));
}

TEST_F(SchedulingTest, MoreNodesThanWorkersIsUnschedulableUntilASecondWorkerRegisters) {
  const std::string first = RegisterWorker(4);
  v1::JobSpec spec = DemoJobSpec(2, 5);
  spec.mutable_layout()->set_nodes(2);
  const std::string job = Submit(spec);
  ASSERT_TRUE(WaitUnschedulable(job)) << Get(job).DebugString();
  EXPECT_THAT(Get(job).state_reason(),
              AllOf(StartsWith("unschedulable: needs 2 worker(s) with backend cpu, 1 device(s)"),
                    HasSubstr("only 1 registered worker(s) can host it (" + first + ")")));
  const std::string second = RegisterWorker(1);
  EXPECT_EQ(Get(job).state(), v1::SCHEDULED);
  EXPECT_EQ(Get(job).placement_size(), 2);
  // One rank a node is named as one ("ranks 0-0" read as a range).
  EXPECT_EQ(Get(job).state_reason(), "placed on " + first + " (rank 0), " + second + " (rank 1)");
}

// Capacity that exists but is busy is waited for, without a deadline.
TEST_F(SchedulingTest, AJobWaitingForBusyDevicesIsNotUnschedulable) {
  const std::string w = RegisterWorker(2);
  const std::string first = Submit(DemoJobSpec(2, 5));
  ASSERT_EQ(Get(first).state(), v1::SCHEDULED);
  v1::JobSpec spec = DemoJobSpec(2, 5);
  spec.set_max_pending_s(1);
  const std::string second = Submit(spec);
  absl::SleepFor(options_.reattach_timeout + absl::Seconds(1) + absl::Milliseconds(300));
  const v1::Job j = Get(second);
  EXPECT_EQ(j.state(), v1::PENDING);
  EXPECT_FALSE(j.unschedulable());
  EXPECT_THAT(j.state_reason(), StartsWith("waiting for 1 worker(s) with backend cpu, 2 free device(s)"));
}

// The waiting reason names every worker's free slots, so every placement
// and finish anywhere changes it. The job always shows the latest reason,
// but its events do not grow with each change: at most one a minute (before,
// 20 changes made 20 events).
TEST_F(SchedulingTest, AWaitingReasonThatKeepsChangingDoesNotFloodTheJobsEvents) {
  const std::string w = RegisterWorker(4);
  const std::string first = Submit(DemoJobSpec(1, 5));
  ASSERT_EQ(Get(first).state(), v1::SCHEDULED);
  v1::JobSpec big = DemoJobSpec(4, 5);
  big.set_priority(-10);  // the small jobs go first
  const std::string waiting = Submit(big);
  ASSERT_EQ(Get(waiting).state(), v1::PENDING);
  const auto reason_says = [&](const std::string& free) {
    return testing_cluster::WaitFor([&] { return absl::StrContains(Get(waiting).state_reason(), free); },
                                    absl::Seconds(10));
  };
  ASSERT_TRUE(reason_says("3/4 free")) << Get(waiting).state_reason();
  for (int i = 0; i < 10; ++i) {
    const std::string small = Submit(DemoJobSpec(1, 5));
    ASSERT_EQ(Get(small).state(), v1::SCHEDULED);
    ASSERT_TRUE(reason_says("2/4 free")) << Get(waiting).state_reason();
    auto hb = Heartbeat(w);
    ASSERT_TRUE(hb.ok()) << hb.status();
    ASSERT_TRUE(Exited(w, small, 0, 0).ok());
    ASSERT_EQ(Get(small).state(), v1::SUCCEEDED);
    ASSERT_TRUE(reason_says("3/4 free")) << Get(waiting).state_reason();
  }
  auto events = store_->ReadEvents(waiting, 0, 1000);
  ASSERT_TRUE(events.ok()) << events.status();
  int pending = 0;
  for (const v1::JobEvent& e : *events) pending += e.state_change().state() == v1::PENDING;
  EXPECT_LE(pending, 2) << "one at submission, one for its first waiting reason";
}

// Once the interval is up, the latest reason becomes an event even when
// nothing changes after it: the events end on what the job says.
TEST_F(SchedulingTest, TheLatestWaitingReasonBecomesAnEventOnceTheIntervalIsUp) {
  options_.pending_reason_event_every = absl::Milliseconds(500);
  Open();
  const std::string w = RegisterWorker(4);
  const std::string first = Submit(DemoJobSpec(1, 5));
  v1::JobSpec big = DemoJobSpec(4, 5);
  big.set_priority(-10);
  const std::string waiting = Submit(big);
  ASSERT_TRUE(testing_cluster::WaitFor([&] { return absl::StrContains(Get(waiting).state_reason(), "3/4 free"); },
                                       absl::Seconds(10)));
  const std::string small = Submit(DemoJobSpec(1, 5));  // 2/4 free: a change within the interval
  ASSERT_THAT(Get(waiting).state_reason(), ::testing::HasSubstr("2/4 free"));
  const auto last_pending_event = [&] {
    std::string reason;
    const absl::StatusOr<std::vector<v1::JobEvent>> events = store_->ReadEvents(waiting, 0, 1000);
    EXPECT_TRUE(events.ok()) << events.status();
    for (const v1::JobEvent& e : events.ok() ? *events : std::vector<v1::JobEvent>{}) {
      if (e.state_change().state() == v1::PENDING) reason = e.state_change().reason();
    }
    return reason;
  };
  EXPECT_TRUE(
      testing_cluster::WaitFor([&] { return absl::StrContains(last_pending_event(), "2/4 free"); }, absl::Seconds(10)))
      << last_pending_event();
  EXPECT_EQ(last_pending_event(), Get(waiting).state_reason());
}

// The mark and its clock are in the store: a restarted coordinator keeps
// both while its workers register again, and fails the job when the time
// counted from the first mark is up; a refused job is not restarted.
TEST_F(SchedulingTest, MaxPendingFailsAnUnschedulableJobCountingFromTheMarkAcrossARestart) {
  RegisterWorker(2);
  v1::JobSpec spec = DemoJobSpec(4, 5);
  spec.set_max_pending_s(4);
  spec.set_max_restarts(3);
  const std::string job = Submit(spec);
  ASSERT_TRUE(WaitUnschedulable(job)) << Get(job).DebugString();
  const v1::Job marked = Get(job);
  EXPECT_THAT(marked.state_reason(), HasSubstr("fails after 4s (max_pending_s)"));
  absl::SleepFor(absl::Milliseconds(2500));
  Open();
  const v1::Job restored = Get(job);  // in the settling window: no worker yet
  EXPECT_TRUE(restored.unschedulable());
  EXPECT_EQ(restored.unschedulable_since().SerializeAsString(), marked.unschedulable_since().SerializeAsString());
  ASSERT_TRUE(WaitState(job, v1::FAILED)) << Get(job).DebugString();
  const v1::Job j = Get(job);
  EXPECT_EQ(j.failure().kind(), v1::Failure::UNSCHEDULABLE);
  EXPECT_THAT(j.failure().message(), AllOf(StartsWith("unschedulable for 4s (max_pending_s)"),
                                           HasSubstr("no worker is registered")));
  EXPECT_EQ(j.state_reason(), j.failure().message());
  EXPECT_EQ(j.attempt(), 0);
  EXPECT_FALSE(j.unschedulable());
  // From the first mark, not from the restart (that would be >= 6.5 s).
  const absl::Duration waited = absl::FromUnixSeconds(j.end_time().seconds()) + absl::Nanoseconds(j.end_time().nanos()) -
                                (absl::FromUnixSeconds(marked.unschedulable_since().seconds()) +
                                 absl::Nanoseconds(marked.unschedulable_since().nanos()));
  EXPECT_GE(waited, absl::Seconds(4));
  EXPECT_LT(waited, absl::Seconds(5.5));
  EXPECT_EQ(Changes(job).back().failure().kind(), v1::Failure::UNSCHEDULABLE);
}

// JobSpec.max_pending_s 0 is the coordinator's default.
TEST_F(SchedulingTest, TheCoordinatorsDefaultMaxPendingAppliesWhenTheSpecLeavesItZero) {
  options_.default_max_pending = absl::Milliseconds(300);
  Open();
  const std::string job = Submit(DemoJobSpec(2, 5));
  ASSERT_TRUE(WaitState(job, v1::FAILED)) << Get(job).DebugString();
  EXPECT_EQ(Get(job).failure().kind(), v1::Failure::UNSCHEDULABLE);
  EXPECT_THAT(Get(job).failure().message(), HasSubstr("no worker is registered"));
}


// ---------------------------------------------------------------------------
// Issue 16's API: idempotent submit, labels and the ListJobs filters, the
// queue's priorities, the wall-clock limit.

class ApiTest : public SchedulingTest {
 protected:
  absl::StatusOr<v1::SubmitJobResponse> SubmitWith(const std::string& request_id, v1::JobSpec spec) {
    v1::SubmitJobRequest req;
    req.set_request_id(request_id);
    *req.mutable_spec() = std::move(spec);
    return c().SubmitJob(req);
  }

  static v1::JobSpec Labelled(std::initializer_list<std::pair<std::string, std::string>> labels) {
    v1::JobSpec spec = DemoJobSpec(2, 5);
    for (const auto& [k, v] : labels) (*spec.mutable_labels())[k] = v;
    return spec;
  }

  // Every page of `req` (page_size 2), the ids in the order listed.
  std::vector<std::string> AllPages(v1::ListJobsRequest req) {
    std::vector<std::string> ids;
    req.set_page_size(2);
    for (int pages = 0; pages < 100; ++pages) {
      auto page = c().ListJobs(req);
      EXPECT_TRUE(page.ok()) << page.status();
      if (!page.ok()) break;
      EXPECT_LE(page->jobs_size(), 2);
      for (const v1::Job& j : page->jobs()) ids.push_back(j.id());
      if (page->next_page_token().empty()) break;
      req.set_page_token(page->next_page_token());
    }
    return ids;
  }
};

TEST_F(ApiTest, ARetriedSubmitReturnsTheSameJobAlsoAfterARestart) {
  v1::JobSpec spec = Labelled({{"team", "nlp"}, {"stage", "dev"}});
  auto first = SubmitWith("retry-7f3c", spec);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->job().request_id(), "retry-7f3c");
  auto again = SubmitWith("retry-7f3c", spec);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->job().id(), first->job().id());
  EXPECT_EQ(again->plan().total_bytes(), first->plan().total_bytes());
  // The labels' order in the request does not matter (a map).
  v1::JobSpec reordered = DemoJobSpec(2, 5);
  (*reordered.mutable_labels())["stage"] = "dev";
  (*reordered.mutable_labels())["team"] = "nlp";
  auto third = SubmitWith("retry-7f3c", reordered);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->job().id(), first->job().id());

  Open();  // a restart: the request id is in the database
  auto after = SubmitWith("retry-7f3c", spec);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->job().id(), first->job().id());
  auto list = c().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->jobs_size(), 1) << "a retried submit created a second job";

  // The same id with another spec: ALREADY_EXISTS naming the job.
  v1::JobSpec other = spec;
  other.set_steps(6);
  auto conflict = SubmitWith("retry-7f3c", other);
  EXPECT_EQ(conflict.status().code(), absl::StatusCode::kAlreadyExists) << conflict.status();
  EXPECT_THAT(std::string(conflict.status().message()),
              AllOf(HasSubstr("request_id: 'retry-7f3c' already created " + first->job().id()),
                    HasSubstr("another spec")));
  // Another id is another job; no id, too.
  auto second = SubmitWith("retry-8000", spec);
  ASSERT_TRUE(second.ok());
  EXPECT_NE(second->job().id(), first->job().id());
  EXPECT_NE(SubmitWith("", spec)->job().id(), second->job().id());
  // validate_only creates nothing and records no id.
  v1::SubmitJobRequest validate;
  validate.set_request_id("validate-1");
  validate.set_validate_only(true);
  *validate.mutable_spec() = spec;
  ASSERT_TRUE(c().SubmitJob(validate).ok());
  auto later = SubmitWith("validate-1", other);
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_EQ(later->job().spec().steps(), 6);
}

TEST_F(ApiTest, ConcurrentSubmitsWithOneRequestIdCreateOneJob) {
  std::vector<std::thread> threads;
  std::vector<std::string> ids(8);
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      auto r = SubmitWith("race-1", DemoJobSpec(2, 5));
      ids[i] = r.ok() ? r->job().id() : r.status().ToString();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::string& id : ids) EXPECT_EQ(id, ids[0]);
  auto list = c().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->jobs_size(), 1);
}

TEST_F(ApiTest, BadRequestIdsLabelsPrioritiesAndLimitsNameTheField) {
  struct Case {
    std::string request_id;
    v1::JobSpec spec;
    std::string want;
  };
  v1::JobSpec bad_key = Labelled({{"team/", "nlp"}});
  v1::JobSpec bad_value = Labelled({{"team", "nlp team"}});
  v1::JobSpec high = DemoJobSpec(2, 5);
  high.set_priority(1001);
  v1::JobSpec negative = DemoJobSpec(2, 5);
  negative.set_max_duration_s(-1);
  const Case cases[] = {
      {std::string(129, 'a'), DemoJobSpec(2, 5), "request_id: expected 1 to 128 characters of [A-Za-z0-9._:-]"},
      {"has space", DemoJobSpec(2, 5), "got 'has space' (9 characters)"},
      {"nul\x01", DemoJobSpec(2, 5), "request_id: expected"},
      {"", bad_key, "labels.key: expected a name of 1 to 63 characters"},
      {"", bad_value, "labels.value: of the key 'team': expected an empty value"},
      {"", high, "priority: expected -1000 to 1000 (higher runs first; default 0), got 1001"},
      {"", negative, "max_duration_s: expected seconds from 0 (no wall-clock limit) to 31536000 (a year), got -1"},
  };
  for (const Case& k : cases) {
    auto r = SubmitWith(k.request_id, k.spec);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << k.want << ": " << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(k.want));
  }
  auto list = c().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->jobs_size(), 0);
}

TEST_F(ApiTest, ListJobsFiltersByLabelsAndStateAndPagesInBothOrders) {
  // job-1..job-8: team nlp on the odd ones, stage dev on every third.
  std::vector<std::string> all;
  for (int i = 1; i <= 8; ++i) {
    v1::JobSpec spec = Labelled({{"team", i % 2 ? "nlp" : "vision"}});
    if (i % 3 == 0) (*spec.mutable_labels())["stage"] = "dev";
    if (i == 8) spec.clear_labels();
    all.push_back(Submit(spec));
  }
  ASSERT_EQ(all.back(), "job-8");
  ASSERT_TRUE(c().CancelJob("job-5").ok());
  v1::ListJobsRequest req;
  req.set_label_selector("team=nlp,stage!=dev");
  EXPECT_EQ(AllPages(req), (std::vector<std::string>{"job-1", "job-5", "job-7"}));
  req.set_newest_first(true);
  EXPECT_EQ(AllPages(req), (std::vector<std::string>{"job-7", "job-5", "job-1"}));
  req.add_states(v1::PENDING);
  EXPECT_EQ(AllPages(req), (std::vector<std::string>{"job-7", "job-1"}));
  v1::ListJobsRequest presence;
  presence.set_label_selector("stage");
  EXPECT_EQ(AllPages(presence), (std::vector<std::string>{"job-3", "job-6"}));
  presence.set_label_selector("!team");
  EXPECT_EQ(AllPages(presence), (std::vector<std::string>{"job-8"}));
  v1::ListJobsRequest newest;
  newest.set_newest_first(true);
  EXPECT_EQ(AllPages(newest),
            (std::vector<std::string>{"job-8", "job-7", "job-6", "job-5", "job-4", "job-3", "job-2", "job-1"}));
  EXPECT_EQ(AllPages(v1::ListJobsRequest()),
            (std::vector<std::string>{"job-1", "job-2", "job-3", "job-4", "job-5", "job-6", "job-7", "job-8"}));

  // A token continues its own order only; a bad selector names itself.
  v1::ListJobsRequest first_page;
  first_page.set_page_size(2);
  first_page.set_newest_first(true);
  auto page = c().ListJobs(first_page);
  ASSERT_TRUE(page.ok());
  ASSERT_FALSE(page->next_page_token().empty());
  v1::ListJobsRequest switched;
  switched.set_page_token(page->next_page_token());
  auto refused = c().ListJobs(switched);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              AllOf(HasSubstr("page_token:"), HasSubstr("continues a newest-first listing")));
  // ...and its filters only: a page asked for with others would mix two
  // listings. The same filters in another order are the same listing.
  v1::ListJobsRequest filtered = first_page;
  filtered.add_states(v1::SUCCEEDED);
  filtered.add_states(v1::PENDING);
  page = c().ListJobs(filtered);
  ASSERT_TRUE(page.ok()) << page.status();
  ASSERT_FALSE(page->next_page_token().empty());  // 7 PENDING jobs, pages of 2
  v1::ListJobsRequest other = filtered;
  other.set_page_token(page->next_page_token());
  other.clear_states();
  refused = c().ListJobs(other);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("continues a listing with other filters"));
  other.add_states(v1::PENDING);
  other.add_states(v1::SUCCEEDED);
  EXPECT_TRUE(c().ListJobs(other).ok());
  v1::ListJobsRequest unfiltered = first_page;
  unfiltered.set_page_token(c().ListJobs(first_page)->next_page_token());
  unfiltered.set_label_selector("team=nlp");
  refused = c().ListJobs(unfiltered);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("continues a listing with other filters"));
  v1::ListJobsRequest bad;
  bad.set_label_selector("team in (nlp)");
  refused = c().ListJobs(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("label_selector: requirement 'team in (nlp)'"));
}

// One slot (a worker with 2 devices, jobs of 2 ranks): when it frees, the
// highest priority waiting goes first, the first submitted among equals.
TEST_F(ApiTest, HigherPriorityJobsSubmittedLaterStartFirstFifoWithinAPriority) {
  const std::string w = RegisterWorker(2);
  const std::string running = Submit(DemoJobSpec(2, 5));
  ASSERT_EQ(Get(running).state(), v1::SCHEDULED);
  const std::string low = Submit(DemoJobSpec(2, 5));
  v1::JobSpec urgent = DemoJobSpec(2, 5);
  urgent.set_priority(10);
  const std::string high1 = Submit(urgent);
  const std::string high2 = Submit(urgent);
  v1::JobSpec negative = DemoJobSpec(2, 5);
  negative.set_priority(-3);
  const std::string lowest = Submit(negative);
  for (const std::string& id : {low, high1, high2, lowest}) ASSERT_EQ(Get(id).state(), v1::PENDING) << id;

  std::vector<std::string> order;
  std::string current = running;
  for (int i = 0; i < 4; ++i) {
    // Not delivered yet: the cancel withdraws it and frees the slot.
    ASSERT_TRUE(c().CancelJob(current).ok());
    ASSERT_TRUE(WaitState(current, v1::CANCELLED));
    std::string next;
    ASSERT_TRUE(testing_cluster::WaitFor([&] {
      for (const std::string& id : {low, high1, high2, lowest}) {
        if (Get(id).state() == v1::SCHEDULED) next = id;
      }
      return !next.empty();
    }, absl::Seconds(10)));
    order.push_back(next);
    current = next;
  }
  EXPECT_EQ(order, (std::vector<std::string>{high1, high2, low, lowest}));
}

TEST_F(ApiTest, AJobOverItsMaxDurationFailsWithItsOwnReasonAndItsRanksAreStopped) {
  const std::string w = Register();
  v1::JobSpec spec = DemoJobSpec(2, 1000);
  spec.set_max_duration_s(1);
  spec.set_max_restarts(3);  // not restarted for it
  const std::string job = Submit(spec);
  ASSERT_NO_FATAL_FAILURE(StartOn(w, job));
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, job, {1})).ok());
  const v1::Job running = Get(job);
  // The limit counts from the job's start_time, which the coordinator set.
  const absl::Time started = absl::FromUnixSeconds(running.start_time().seconds()) +
                             absl::Nanoseconds(running.start_time().nanos());
  // The worker is told to stop the ranks once the second is up.
  bool cancelled = false;
  ASSERT_TRUE(testing_cluster::WaitFor([&] {
    auto beat = Heartbeat(w);
    cancelled = beat.ok() && beat->cancellations_size() == 1;
    return cancelled;
  }, absl::Seconds(10)));
  EXPECT_GE(absl::Now() - started, absl::Seconds(1));
  EXPECT_EQ(Get(job).failure().kind(), v1::Failure::MAX_DURATION_EXCEEDED);
  EXPECT_EQ(Get(job).state(), v1::RUNNING) << "final only once every rank is gone";
  EXPECT_THAT(Get(job).state_reason(), HasSubstr("step 1 of 1000); stopping its ranks"));
  // The ranks train on until the stop reaches them: the final reason names
  // the step they got to, not only the one when the limit fired.
  ASSERT_TRUE(c().ReportTelemetry(Steps(w, job, {2, 3})).ok());
  ASSERT_TRUE(Exited(w, job, 0, 143, 0, /*stopped=*/true).ok());
  ASSERT_TRUE(Exited(w, job, 1, 143, 0, /*stopped=*/true).ok());
  const v1::Job j = Get(job);
  EXPECT_EQ(j.state(), v1::FAILED) << j.DebugString();
  EXPECT_EQ(j.attempt(), 0);
  EXPECT_EQ(j.failure().kind(), v1::Failure::MAX_DURATION_EXCEEDED);
  EXPECT_EQ(j.failure().message(),
            "ran for its max_duration_s (1s from its first start, attempt 0): reached at step 1, stopped at step 3 "
            "of 1000; its ranks were stopped");
  EXPECT_EQ(j.progress().step(), 3);
  EXPECT_EQ(j.state_reason(), j.failure().message());
}

}  // namespace
}  // namespace plateau
