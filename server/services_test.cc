// The gRPC services (server/services.h) on a real server over loopback, in
// process: a coordinator on a real SQLite store, JobServiceImpl on a port of
// the kernel's choosing, and a plain stub as the client. What only a real
// call shows: the caller's deadline and cancellation as the handler sees
// them, and the handlers' answers as they leave the server (an interceptor
// records each one, since a client past its deadline never reads it).
#include "server/services.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/server_interceptor.h"
#include "gtest/gtest.h"
#include "plateau/v1/job.grpc.pb.h"
#include "proto/timestamps.h"
#include "server/coordinator.h"
#include "server/job_store.h"
#include "server/metrics.h"
#include "server/security.h"
#include "server/test_db.h"
#include "worker/job_spec.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

// The status each handler returned, by method ("ListJobs"), in order.
class Answers {
 public:
  void Add(const std::string& method, const grpc::Status& s) {
    absl::MutexLock lock(&mu_);
    by_method_[method].push_back(s);
  }
  std::vector<grpc::Status> Of(const std::string& method) {
    absl::MutexLock lock(&mu_);
    return by_method_[method];
  }
  // The server's side of the latest call of `method` (valid while it runs).
  void Began(const std::string& method, grpc::ServerContextBase* ctx) {
    absl::MutexLock lock(&mu_);
    contexts_[method] = ctx;
  }
  grpc::ServerContextBase* Latest(const std::string& method) {
    absl::MutexLock lock(&mu_);
    return contexts_[method];
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::vector<grpc::Status>> by_method_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, grpc::ServerContextBase*> contexts_ ABSL_GUARDED_BY(mu_);
};

// "/plateau.v1.JobService/ListJobs" -> "ListJobs".
std::string MethodOf(const char* full) {
  const std::string m = full != nullptr ? full : "";
  return m.substr(m.rfind('/') + 1);
}

class RecordAnswers final : public grpc::experimental::Interceptor {
 public:
  RecordAnswers(Answers* answers, std::string method) : answers_(answers), method_(std::move(method)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      answers_->Add(method_, methods->GetSendStatus());
    }
    methods->Proceed();
  }

 private:
  Answers* const answers_;
  const std::string method_;
};

class RecordAnswersFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RecordAnswersFactory(Answers* answers) : answers_(answers) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    answers_->Began(MethodOf(info->method()), info->server_context());
    return new RecordAnswers(answers_, MethodOf(info->method()));
  }

 private:
  Answers* const answers_;
};

std::chrono::system_clock::time_point In(absl::Duration d) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d);
}

// Waits (60 s at most) until `holds`.
void Await(const std::function<bool()>& holds) {
  const absl::Time until = absl::Now() + absl::Seconds(60);
  while (!holds() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
}

// A stream's rows (JobEvent, LogEntry) until it ends; its status.
template <typename Row>
std::vector<Row> ReadToTheEnd(grpc::ClientReader<Row>& reader, grpc::Status* status) {
  std::vector<Row> rows;
  Row row;
  while (reader.Read(&row)) rows.push_back(row);
  *status = reader.Finish();
  return rows;
}

// Rows of a stream that did not ask for heartbeats: none is one, and they
// are the stored rows from index 0 on.
template <typename Row>
void ExpectNoHeartbeats(const std::vector<Row>& rows) {
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_FALSE(rows[i].has_heartbeat()) << rows[i].DebugString();
    EXPECT_EQ(rows[i].index(), static_cast<int64_t>(i));
  }
}

// The first row of a stream resumed from index `from` with nothing new: a
// heartbeat carrying the index before it. Ends the call.
template <typename Row>
void ExpectResumedHeartbeat(grpc::ClientContext& ctx, grpc::ClientReader<Row>& reader, int64_t from) {
  Row row;
  ASSERT_TRUE(reader.Read(&row));
  EXPECT_TRUE(row.has_heartbeat()) << row.DebugString();
  EXPECT_EQ(row.index(), from - 1);
  ctx.TryCancel();
  reader.Finish();
}

class ServicesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = JobStore::Open(TempDb(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
    // One metrics server for all tests.
    static Metrics* const metrics = [] {
      auto m = Metrics::Create("127.0.0.1:0");
      return m.ok() ? m->release() : nullptr;
    }();
    ASSERT_NE(metrics, nullptr);
    metrics_ = metrics;
    options_.log = [](const std::string&) {};
  }

  void TearDown() override { Stop(); }

  // The coordinator and the server, once the test has set options_ and
  // filled the store.
  void Serve(ServiceGuards guards = {}, StreamOptions streams = {}) {
    coordinator_ = std::make_unique<Coordinator>(store_.get(), metrics_, options_);
    ASSERT_TRUE(coordinator_->Start().ok());
    jobs_ = std::make_unique<JobServiceImpl>(coordinator_.get(), guards, streams);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(jobs_.get());
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(std::make_unique<RecordAnswersFactory>(&answers_));
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    address_ = absl::StrCat("127.0.0.1:", port);
    stub_ = v1::JobService::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  }

  // Waits for every call in flight to end (its handler returned), then
  // stops the coordinator: what a handler did after its caller left is
  // all done when this returns.
  void Stop() {
    if (server_ != nullptr) server_->Shutdown();
    server_.reset();
    if (coordinator_ != nullptr) coordinator_->Stop();
  }

  // A finished job stored directly (the coordinator not yet started).
  std::string FinishedJob(const std::string& name) {
    v1::Job job;
    job.mutable_spec()->set_name(name);
    job.set_state(v1::SUCCEEDED);
    absl::StatusOr<v1::Job> stored = store_->CreateJob(job);
    EXPECT_TRUE(stored.ok()) << stored.status();
    return stored.ok() ? stored->id() : "";
  }

  // A job submitted to the coordinator: PENDING for good (no worker).
  std::string PendingJob() {
    v1::SubmitJobRequest req;
    *req.mutable_spec() = DemoJobSpec(2, 5);
    absl::StatusOr<v1::SubmitJobResponse> resp = coordinator_->SubmitJob(req);
    EXPECT_TRUE(resp.ok()) << resp.status();
    return resp.ok() ? resp->job().id() : "";
  }

  // A call held at the server's first check between two pieces of its
  // work (options_.between_list_reads, between_plan_shapes): Hold() is the
  // hook; it counts the checks and holds the first until the client has
  // given up (GaveUp) and the handler sees it: its deadline passed, or its
  // cancel arrived.
  struct HeldCall {
    absl::Notification gave_up;
    std::atomic<int> checks{0};
  };
  enum class GivesUpBy { kDeadline, kCancel };
  std::function<void()> Hold(HeldCall* held, const std::string& method, GivesUpBy by) {
    return [this, held, method, by] {
      if (held->checks.fetch_add(1) != 0) return;
      held->gave_up.WaitForNotificationWithTimeout(absl::Seconds(60));
      // The server's deadline is the client's as the request arrived (a
      // little later); the cancel reaches the handler after the client's
      // call has returned.
      Await([&] {
        grpc::ServerContextBase* call = answers_.Latest(method);
        return by == GivesUpBy::kDeadline ? std::chrono::system_clock::now() >= call->deadline() : call->IsCancelled();
      });
    };
  }
  // `call` on a thread of its own, cancelled by its client (ctx) once the
  // server's first check has begun; its status.
  grpc::Status CancelledOnceHeld(grpc::ClientContext& ctx, const HeldCall& held,
                                 const std::function<grpc::Status()>& call) {
    grpc::Status s;
    absl::Notification done;
    std::thread t([&] {
      s = call();
      done.Notify();
    });
    Await([&] { return held.checks.load() > 0; });
    ctx.TryCancel();
    done.WaitForNotificationWithTimeout(absl::Seconds(60));
    t.join();
    return s;
  }
  // The handler of `method` answered once, with `code`; its message.
  std::string AnsweredOnce(const std::string& method, grpc::StatusCode code) {
    const std::vector<grpc::Status> answered = answers_.Of(method);
    EXPECT_EQ(answered.size(), 1u) << method;
    if (answered.empty()) return "";
    EXPECT_EQ(answered[0].error_code(), code) << answered[0].error_message();
    return answered[0].error_message();
  }

  std::unique_ptr<JobStore> store_;
  Metrics* metrics_ = nullptr;
  // Outlives the server (a stream's lease is given back as its handler
  // ends, which may be during Stop).
  std::unique_ptr<WatchLimiter> limit_;
  CoordinatorOptions options_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<JobServiceImpl> jobs_;
  Answers answers_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::unique_ptr<v1::JobService::Stub> stub_;
};

// A ListJobs whose label_selector matches none of a long history scans it
// kListScanRows jobs a read. Its caller's deadline passes during the
// first read (the hook holds it there until the client has its
// DEADLINE_EXCEEDED): the scan stops at the next check and the handler
// answers DEADLINE_EXCEEDED, instead of reading every job for no one.
TEST_F(ServicesTest, AListJobsScanStopsOnceItsCallersDeadlinePassed) {
  for (int i = 0; i < 2 * kListScanRows + 8; ++i) FinishedJob(absl::StrCat("history-", i));  // three reads
  HeldCall held;
  options_.between_list_reads = Hold(&held, "ListJobs", GivesUpBy::kDeadline);
  Serve();
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Milliseconds(500)));
  v1::ListJobsRequest req;
  req.set_label_selector("team=nobody");
  v1::ListJobsResponse resp;
  const grpc::Status s = stub_->ListJobs(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  held.gave_up.Notify();
  Stop();
  // One check between the reads, and none after: the second read never ran.
  EXPECT_EQ(held.checks.load(), 1);
  EXPECT_THAT(AnsweredOnce("ListJobs", grpc::StatusCode::DEADLINE_EXCEEDED), HasSubstr("the caller's deadline passed"));
}

// The same scan cancelled by its client (a Ctrl-C in plateauctl list)
// ends CANCELLED at the next check.
TEST_F(ServicesTest, AListJobsScanStopsOnceItsCallerCancelled) {
  for (int i = 0; i < 2 * kListScanRows + 8; ++i) FinishedJob(absl::StrCat("history-", i));
  HeldCall held;
  options_.between_list_reads = Hold(&held, "ListJobs", GivesUpBy::kCancel);
  Serve();
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Seconds(60)));
  v1::ListJobsRequest req;
  req.set_label_selector("team=nobody");
  v1::ListJobsResponse resp;
  // Once the scan has begun (its first check is waiting), the client
  // cancels.
  const grpc::Status s = CancelledOnceHeld(ctx, held, [&] { return stub_->ListJobs(&ctx, req, &resp); });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  held.gave_up.Notify();
  Stop();
  EXPECT_EQ(held.checks.load(), 1);
  AnsweredOnce("ListJobs", grpc::StatusCode::CANCELLED);
}

// A page found within the deadline is answered as before: the checks
// between reads cost a listing nothing.
TEST_F(ServicesTest, AListJobsScanWithinItsDeadlineAnswersItsPage) {
  for (int i = 0; i < 2 * kListScanRows + 8; ++i) FinishedJob(absl::StrCat("history-", i));
  const std::string last = FinishedJob("wanted");
  Serve();
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Seconds(60)));
  v1::ListJobsRequest req;
  req.set_label_selector("!team");  // every job: none has labels
  req.set_page_size(1000);
  v1::ListJobsResponse resp;
  const grpc::Status s = stub_->ListJobs(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(resp.jobs_size(), 2 * kListScanRows + 9);
  EXPECT_EQ(resp.jobs(resp.jobs_size() - 1).id(), last);
}

// A plan is work for its caller alone: its N_max and what-if searches plan
// dozens of shapes per axis, fourteen axes. A PlanJob whose caller's deadline
// passes during its first shape (the hook holds it there until the server's
// deadline has passed) stops at the next check and answers
// DEADLINE_EXCEEDED, instead of planning every shape for no one.
TEST_F(ServicesTest, APlanStopsOnceItsCallersDeadlinePassed) {
  HeldCall held;
  options_.between_plan_shapes = Hold(&held, "PlanJob", GivesUpBy::kDeadline);
  Serve();
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Milliseconds(500)));
  v1::PlanJobRequest req;
  *req.mutable_spec() = DemoJobSpec(2, 5);  // a device cap: N_max is searched
  v1::PlanJobResponse resp;
  const grpc::Status s = stub_->PlanJob(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  held.gave_up.Notify();
  Stop();
  // One shape, then the stop: no other shape was planned.
  EXPECT_EQ(held.checks.load(), 1);
  const std::string said = AnsweredOnce("PlanJob", grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(said, HasSubstr("the caller's deadline passed"));
  EXPECT_THAT(said, HasSubstr("PlanJob stopped planning"));
}

// The same plan cancelled by its client (a Ctrl-C in plateauctl plan) ends
// CANCELLED at the next check.
TEST_F(ServicesTest, APlanStopsOnceItsCallerCancelled) {
  HeldCall held;
  options_.between_plan_shapes = Hold(&held, "PlanJob", GivesUpBy::kCancel);
  Serve();
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Seconds(60)));
  v1::PlanJobRequest req;
  *req.mutable_spec() = DemoJobSpec(2, 5);
  v1::PlanJobResponse resp;
  const grpc::Status s = CancelledOnceHeld(ctx, held, [&] { return stub_->PlanJob(&ctx, req, &resp); });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  held.gave_up.Notify();
  Stop();
  EXPECT_EQ(held.checks.load(), 1);
  AnsweredOnce("PlanJob", grpc::StatusCode::CANCELLED);
}

// A submit plans the same way (SubmitJob is plateauctl plan's twin with
// validate_only): one whose caller's deadline passes while it plans stops
// there and creates no job. (It would have stored a job its client, told
// DEADLINE_EXCEEDED, knows nothing of.)
TEST_F(ServicesTest, ASubmitStopsPlanningOnceItsCallersDeadlinePassedAndCreatesNothing) {
  HeldCall held;
  options_.between_plan_shapes = Hold(&held, "SubmitJob", GivesUpBy::kDeadline);
  Serve();
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Milliseconds(500)));
  v1::SubmitJobRequest req;
  *req.mutable_spec() = DemoJobSpec(2, 5);
  v1::SubmitJobResponse resp;
  const grpc::Status s = stub_->SubmitJob(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  held.gave_up.Notify();
  Stop();
  EXPECT_EQ(held.checks.load(), 1);
  EXPECT_THAT(AnsweredOnce("SubmitJob", grpc::StatusCode::DEADLINE_EXCEEDED), HasSubstr("SubmitJob stopped planning"));
  bool more = false;
  absl::StatusOr<std::vector<v1::Job>> jobs = store_->ListJobs(0, 10, {}, &more);
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_TRUE(jobs->empty()) << "a job was created: " << jobs->front().id();
}

// A submit with a request id plans to its end whoever waits, and stores
// the job: its client, whose own deadline passed first (a slow plan on a
// loaded coordinator), retries with the same id and is answered that job.
// Stopped at the deadline, every retry planned again and stopped again,
// and the submit never succeeded.
TEST_F(ServicesTest, ASubmitWithARequestIdPlansToItsEndAndItsRetryFindsTheJob) {
  HeldCall held;
  options_.between_plan_shapes = Hold(&held, "SubmitJob", GivesUpBy::kDeadline);
  Serve();
  v1::SubmitJobRequest req;
  *req.mutable_spec() = DemoJobSpec(2, 5);
  req.set_request_id("slow-plan-1");
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(absl::Milliseconds(500)));
    v1::SubmitJobResponse resp;
    const grpc::Status s = stub_->SubmitJob(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  }
  held.gave_up.Notify();
  Await([&] { return !answers_.Of("SubmitJob").empty(); });
  AnsweredOnce("SubmitJob", grpc::StatusCode::OK);
  EXPECT_GT(held.checks.load(), 14) << "the plan stopped before its end";
  grpc::ClientContext retry;
  retry.set_deadline(In(absl::Seconds(60)));
  v1::SubmitJobResponse again;
  const grpc::Status s = stub_->SubmitJob(&retry, req, &again);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(again.job().id(), "job-1");
  bool more = false;
  absl::StatusOr<std::vector<v1::Job>> jobs = store_->ListJobs(0, 10, {}, &more);
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_EQ(jobs->size(), 1u);
}

// A plan within its deadline is answered as before: the checks between
// its shapes (many: the hook counts them) cost it nothing.
TEST_F(ServicesTest, APlanWithinItsDeadlineAnswersItsPlan) {
  std::atomic<int> shapes{0};
  options_.between_plan_shapes = [&] { shapes.fetch_add(1); };
  Serve();
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Seconds(60)));
  v1::PlanJobRequest req;
  *req.mutable_spec() = DemoJobSpec(2, 5);
  v1::PlanJobResponse resp;
  const grpc::Status s = stub_->PlanJob(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(resp.plan().has_n_max());
  EXPECT_EQ(resp.plan().what_if_size(), 6);
  EXPECT_GT(shapes.load(), 14) << "fewer checks than the plan's axes";
}

// A DeleteJob is wanted work, whoever waits for it: one of a job of more
// rows than one part (kSweepRowsPerTick) whose caller's deadline passes
// during its first part (plateauctl's 10 s on a large job) goes on through
// every part, the lock free between them, and answers OK (to no one). It
// stopped there, leaving the job half-deleted and the client saying it
// could not reach the coordinator.
TEST_F(ServicesTest, ADeleteInPartsRunsToItsEndThoughItsCallersDeadlinePassed) {
  const std::string job = FinishedJob("many-rows");
  std::vector<JobRankStep> many(45000);  // three parts
  for (int i = 0; i < 45000; ++i) {
    many[i].job_id = job;
    many[i].telemetry.set_step(i + 1);
  }
  ASSERT_TRUE(store_->PutRankSteps(many).ok());
  HeldCall held;  // its checks: the parts
  options_.after_delete_part = [hold = Hold(&held, "DeleteJob", GivesUpBy::kDeadline)](int64_t) { hold(); };
  Serve();
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(absl::Milliseconds(500)));
    v1::DeleteJobRequest req;
    req.set_job_id(job);
    v1::DeleteJobResponse resp;
    const grpc::Status s = stub_->DeleteJob(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  }
  held.gave_up.Notify();
  // The handler's answer, once it has left.
  Await([&] { return !answers_.Of("DeleteJob").empty(); });
  AnsweredOnce("DeleteJob", grpc::StatusCode::OK);
  EXPECT_EQ(held.checks.load(), 3);
  EXPECT_EQ(store_->GetJob(job).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store_->ReadRankSteps(job, 0, 0, INT64_MAX)->empty());
}

// A watch of a pending job is quiet: one that asks for heartbeats
// (WatchJobRequest.heartbeats) gets a JobEvent.heartbeat when it has had
// nothing to send for the interval, so that a proxy that cuts idle streams
// does not cut it. A heartbeat carries the job's id, the time and the
// index of the last event sent (a client resuming from it + 1 misses
// nothing), is never stored, and comes about once an interval.
TEST_F(ServicesTest, AQuietWatchSendsHeartbeatsIndexedAsItsLastEventAndNeverStored) {
  StreamOptions streams;
  streams.watch_heartbeat = absl::Milliseconds(200);
  Serve({}, streams);
  const std::string id = PendingJob();
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Seconds(15)));  // five heartbeats take a second
  v1::WatchJobRequest req;
  req.set_job_id(id);
  req.set_heartbeats(true);
  auto reader = stub_->WatchJob(&ctx, req);
  std::vector<v1::JobEvent> events, beats;
  std::vector<int64_t> last_index_at_beat;
  const absl::Time start = absl::Now();
  v1::JobEvent e;
  while (beats.size() < 5 && reader->Read(&e)) {
    if (e.has_heartbeat()) {
      last_index_at_beat.push_back(events.empty() ? -1 : events.back().index());
      beats.push_back(e);
    } else {
      events.push_back(e);
    }
  }
  const absl::Duration took = absl::Now() - start;
  ctx.TryCancel();
  reader->Finish();
  ASSERT_EQ(beats.size(), 5u) << "the watch ended after " << events.size() << " event(s)";
  ASSERT_FALSE(events.empty());  // the submission, at least
  for (size_t i = 0; i < beats.size(); ++i) {
    EXPECT_EQ(beats[i].job_id(), id);
    EXPECT_EQ(beats[i].index(), last_index_at_beat[i]) << beats[i].DebugString();
    EXPECT_GT(beats[i].time().seconds(), 0);
  }
  // About one an interval: not one per wakeup of the stream.
  EXPECT_GE(took, absl::Milliseconds(5 * 200 - 50));
  absl::StatusOr<int64_t> stored = store_->EventCount(id);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(*stored, events.back().index() + 1) << "a heartbeat was stored";

  // A watch from the next index (a client resuming) is as quiet: its
  // heartbeats carry the index before its from_index.
  grpc::ClientContext resumed_ctx;
  resumed_ctx.set_deadline(In(absl::Seconds(60)));
  req.set_from_index(*stored);
  ExpectResumedHeartbeat(resumed_ctx, *stub_->WatchJob(&resumed_ctx, req), *stored);
}

// Heartbeats are sent only to a watch that asks for them
// (WatchJobRequest.heartbeats): a client built before them (plateauctl
// before 2026-12-07 printed each as an event under --output json) asks for
// none and gets none, however quiet its watch.
TEST_F(ServicesTest, AWatchThatDoesNotAskForHeartbeatsGetsNone) {
  StreamOptions streams;
  streams.watch_heartbeat = absl::Milliseconds(100);
  Serve({}, streams);
  const std::string id = PendingJob();
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Milliseconds(1500)));  // fifteen intervals
  v1::WatchJobRequest req;
  req.set_job_id(id);
  grpc::Status s;
  const std::vector<v1::JobEvent> rows = ReadToTheEnd(*stub_->WatchJob(&ctx, req), &s);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  ASSERT_FALSE(rows.empty());  // the submission, at least
  ExpectNoHeartbeats(rows);
}

// A followed log of a pending job is as quiet as its watch: one that asks
// for heartbeats (GetJobLogsRequest.heartbeats) gets a LogEntry.heartbeat
// when it has had nothing to send for the interval, through the same
// machinery as a watch's. A heartbeat carries the job's id, the time and
// the index of the last line sent (a client resuming from it + 1 misses
// nothing), is never stored, and comes about once an interval. A read
// without follow ends at the stored lines, heartbeats asked or not.
TEST_F(ServicesTest, AQuietLogFollowSendsHeartbeatsIndexedAsItsLastLineAndNeverStored) {
  StreamOptions streams;
  streams.watch_heartbeat = absl::Milliseconds(200);
  Serve({}, streams);
  const std::string id = PendingJob();
  std::vector<v1::LogEntry> two(2);
  for (int i = 0; i < 2; ++i) {
    two[i].set_job_id(id);
    two[i].set_rank(0);
    two[i].set_stream("stdout");
    two[i].set_line(absl::StrCat("line ", i));
  }
  ASSERT_TRUE(store_->AppendLogs(two).ok());
  const auto stored_lines = [&] { return store_->ReadLogs(id, 0, 1000).value_or(std::vector<v1::LogEntry>()); };
  const size_t stored = stored_lines().size();
  ASSERT_GE(stored, 2u);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Seconds(15)));  // five heartbeats take a second
  v1::GetJobLogsRequest req;
  req.set_job_id(id);
  req.set_follow(true);
  req.set_heartbeats(true);
  auto reader = stub_->GetJobLogs(&ctx, req);
  std::vector<v1::LogEntry> lines, beats;
  std::vector<int64_t> last_index_at_beat;
  v1::LogEntry l;
  while (beats.size() < 5 && reader->Read(&l)) {
    if (l.has_heartbeat()) {
      last_index_at_beat.push_back(lines.empty() ? -1 : lines.back().index());
      beats.push_back(l);
    } else {
      lines.push_back(l);
    }
  }
  ctx.TryCancel();
  reader->Finish();
  ASSERT_EQ(beats.size(), 5u) << "the log ended after " << lines.size() << " line(s)";
  // Spaced by the server's clock (each beat's time is when it was sent), so
  // a stall of this client between its reads cannot bunch them up.
  const absl::Duration took = TimeOf(beats.back().time()) - TimeOf(beats.front().time());
  ASSERT_EQ(lines.size(), stored);
  for (size_t i = 0; i < beats.size(); ++i) {
    EXPECT_EQ(beats[i].job_id(), id);
    EXPECT_EQ(beats[i].index(), last_index_at_beat[i]) << beats[i].DebugString();
    EXPECT_EQ(beats[i].index(), static_cast<int64_t>(stored) - 1) << beats[i].DebugString();
    EXPECT_GT(beats[i].time().seconds(), 0);
    EXPECT_TRUE(beats[i].line().empty()) << beats[i].DebugString();
  }
  EXPECT_GE(took, absl::Milliseconds(4 * 200 - 1)) << "five beats, 200 ms of silence before each";
  EXPECT_EQ(stored_lines().size(), stored) << "a heartbeat was stored";

  // Resumed from the next index: its heartbeats carry the index before
  // its from_index.
  grpc::ClientContext resumed_ctx;
  resumed_ctx.set_deadline(In(absl::Seconds(60)));
  req.set_from_index(static_cast<int64_t>(stored));
  ExpectResumedHeartbeat(resumed_ctx, *stub_->GetJobLogs(&resumed_ctx, req), static_cast<int64_t>(stored));

  // Without follow: the stored lines, then the end.
  grpc::ClientContext once_ctx;
  once_ctx.set_deadline(In(absl::Seconds(60)));
  req.set_from_index(0);
  req.set_follow(false);
  grpc::Status s;
  const std::vector<v1::LogEntry> read = ReadToTheEnd(*stub_->GetJobLogs(&once_ctx, req), &s);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(read.size(), stored);
  ExpectNoHeartbeats(read);
}

// Log heartbeats are opt-in as a watch's: a client built before them asks
// for none and gets none, however quiet the log it follows.
TEST_F(ServicesTest, ALogFollowThatDoesNotAskForHeartbeatsGetsNone) {
  StreamOptions streams;
  streams.watch_heartbeat = absl::Milliseconds(100);
  Serve({}, streams);
  const std::string id = PendingJob();
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Milliseconds(1500)));  // fifteen intervals
  v1::GetJobLogsRequest req;
  req.set_job_id(id);
  req.set_follow(true);
  grpc::Status s;
  const std::vector<v1::LogEntry> rows = ReadToTheEnd(*stub_->GetJobLogs(&ctx, req), &s);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  ExpectNoHeartbeats(rows);
}

// The number of WatchJob calls the server refused RESOURCE_EXHAUSTED.
int Refused(Answers& answers) {
  int n = 0;
  for (const grpc::Status& s : answers.Of("WatchJob")) n += s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
  return n;
}

// A watch over the coordinator's limit of open watches per client host
// (here 1) is refused RESOURCE_EXHAUSTED for now, not for good: the client
// opens it again with backoff, says so once, and gets in when the other
// watch of its host ends; it then streams the job to its end as any watch.
TEST_F(ServicesTest, AWatchRefusedForTheLimitIsRetriedWithBackoffAndGetsInOnceAPlaceFrees) {
  limit_ = std::make_unique<WatchLimiter>(1);
  Serve({nullptr, nullptr, limit_.get()});
  const std::string id = PendingJob();
  grpc::ClientContext held_ctx;
  v1::WatchJobRequest req;
  req.set_job_id(id);
  auto held = stub_->WatchJob(&held_ctx, req);
  v1::JobEvent e;
  ASSERT_TRUE(held->Read(&e));  // open: the host's one place is taken

  ClientOptions o;
  o.connection.address = address_;
  absl::Mutex mu;
  std::vector<absl::Status> notices;
  o.on_reconnecting = [&](const absl::Status& s) {
    absl::MutexLock lock(&mu);
    notices.push_back(s);
  };
  Client client(o);
  std::vector<v1::JobEvent> seen;
  absl::Status watched;
  std::atomic<bool> ended{false};
  std::thread watch([&] {
    watched = client.WatchJob(id, 0, [&](const v1::JobEvent& ev) {
      absl::MutexLock lock(&mu);
      seen.push_back(ev);
      return true;
    });
    ended = true;
  });
  Await([&] { return Refused(answers_) >= 2 || ended; });
  EXPECT_FALSE(ended) << "the watch gave up at its refusal: " << watched;
  EXPECT_GE(Refused(answers_), 2) << "the refused watch was not opened again";
  held_ctx.TryCancel();
  held->Finish();
  Await([&] {
    absl::MutexLock lock(&mu);
    return !seen.empty() || ended;
  });
  ASSERT_TRUE(coordinator_->CancelJob(id).ok());
  watch.join();
  EXPECT_TRUE(watched.ok()) << watched;
  absl::MutexLock lock(&mu);
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.front().index(), 0);
  EXPECT_TRUE(seen.back().has_state_change() && seen.back().state_change().state() == v1::CANCELLED)
      << seen.back().DebugString();
  ASSERT_EQ(notices.size(), 1u) << "said once, not at every retry";
  EXPECT_EQ(notices[0].code(), absl::StatusCode::kResourceExhausted) << notices[0];
  EXPECT_THAT(notices[0].message(), HasSubstr("--max_watches_per_client"));
}

// Refused for the whole reconnect window (here 3 s), the watch fails with
// the refusal (plateauctl's exit 8, "may succeed later"), after a few
// tries spaced by a growing backoff (0.25-0.5 s, 0.5-1 s, 1-2 s, ...), not
// a try every 250 ms.
TEST_F(ServicesTest, AWatchRefusedForItsWholeReconnectWindowFailsWithTheRefusal) {
  limit_ = std::make_unique<WatchLimiter>(1);
  Serve({nullptr, nullptr, limit_.get()});
  const std::string id = PendingJob();
  grpc::ClientContext held_ctx;
  v1::WatchJobRequest req;
  req.set_job_id(id);
  auto held = stub_->WatchJob(&held_ctx, req);
  v1::JobEvent e;
  ASSERT_TRUE(held->Read(&e));

  ClientOptions o;
  o.connection.address = address_;
  o.reconnect_for = absl::Seconds(3);
  Client client(o);
  const absl::Time start = absl::Now();
  const absl::Status watched = client.WatchJob(id, 0, [](const v1::JobEvent&) { return true; });
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(watched.code(), absl::StatusCode::kResourceExhausted) << watched;
  EXPECT_THAT(watched.message(), HasSubstr("--max_watches_per_client"));
  EXPECT_GE(took, absl::Seconds(3));
  EXPECT_LT(took, absl::Seconds(30));
  const int tries = Refused(answers_);
  EXPECT_GE(tries, 3);
  EXPECT_LE(tries, 6) << "not a backoff";
  held_ctx.TryCancel();
  held->Finish();
}

}  // namespace
}  // namespace plateau
