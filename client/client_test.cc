// The C++ client's stream reader (client/client.h WatchJob, GetJobLogs) against a
// JobService the test scripts, on a real gRPC server over loopback: what it
// asks for and what it does with each answer, given on cue.
#include "client/client.h"

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "plateau/v1/job.grpc.pb.h"
#include "proto/streams.h"

namespace plateau {
namespace {

using ::testing::ElementsAre;

// One answer of the scripted WatchJob: a status it ends with before
// anything is sent (a refusal, a coordinator going away), or, when `open`,
// the stream opened and `rows` sent, then `end`.
struct WatchAnswer {
  bool open = false;
  std::vector<v1::JobEvent> rows;
  grpc::Status end = grpc::Status::OK;
};

// One answer of the scripted GetJobLogs: the stream opened, `rows` sent,
// then `end`.
struct LogsAnswer {
  std::vector<v1::LogEntry> rows;
  grpc::Status end = grpc::Status::OK;
};

// A JobService whose WatchJob answers from a script: `answers` in order,
// then `then` to every call; or, with By, what a function of the time
// since the first call says. Its GetJobLogs answers `ScriptLogs`' answers
// in order, then ends OK.
class ScriptedJobs final : public v1::JobService::Service {
 public:
  void Script(std::deque<WatchAnswer> answers, WatchAnswer then) {
    absl::MutexLock lock(&mu_);
    answers_ = std::move(answers);
    then_ = std::move(then);
  }
  void By(std::function<WatchAnswer(absl::Duration since_first)> answer) {
    absl::MutexLock lock(&mu_);
    by_ = std::move(answer);
  }
  // The request and the time of each WatchJob call.
  std::vector<v1::WatchJobRequest> Requests() {
    absl::MutexLock lock(&mu_);
    return requests_;
  }
  std::vector<absl::Time> Times() {
    absl::MutexLock lock(&mu_);
    return times_;
  }
  void ScriptLogs(std::deque<LogsAnswer> answers) {
    absl::MutexLock lock(&mu_);
    logs_ = std::move(answers);
  }
  std::vector<v1::GetJobLogsRequest> LogRequests() {
    absl::MutexLock lock(&mu_);
    return log_requests_;
  }

  grpc::Status GetJobLogs(grpc::ServerContext* ctx, const v1::GetJobLogsRequest* req,
                          grpc::ServerWriter<v1::LogEntry>* writer) override {
    LogsAnswer a;
    {
      absl::MutexLock lock(&mu_);
      log_requests_.push_back(*req);
      if (!logs_.empty()) {
        a = std::move(logs_.front());
        logs_.pop_front();
      }
    }
    ctx->AddInitialMetadata(kStreamOpenMetadata, "1");
    writer->SendInitialMetadata();
    for (const v1::LogEntry& l : a.rows) {
      if (!writer->Write(l)) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
    }
    return a.end;
  }

  grpc::Status WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                        grpc::ServerWriter<v1::JobEvent>* writer) override {
    WatchAnswer a;
    {
      absl::MutexLock lock(&mu_);
      requests_.push_back(*req);
      times_.push_back(absl::Now());
      if (by_) {
        a = by_(times_.back() - times_.front());
      } else if (answers_.empty()) {
        a = then_;
      } else {
        a = std::move(answers_.front());
        answers_.pop_front();
      }
    }
    if (!a.open) return a.end;
    ctx->AddInitialMetadata(kStreamOpenMetadata, "1");
    writer->SendInitialMetadata();
    for (const v1::JobEvent& e : a.rows) {
      if (!writer->Write(e)) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
    }
    return a.end;
  }

 private:
  absl::Mutex mu_;
  std::deque<WatchAnswer> answers_ ABSL_GUARDED_BY(mu_);
  WatchAnswer then_ ABSL_GUARDED_BY(mu_);
  std::function<WatchAnswer(absl::Duration)> by_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::WatchJobRequest> requests_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Time> times_ ABSL_GUARDED_BY(mu_);
  std::deque<LogsAnswer> logs_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::GetJobLogsRequest> log_requests_ ABSL_GUARDED_BY(mu_);
};

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&jobs_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }

  static v1::JobEvent State(int64_t index, v1::JobState state) {
    v1::JobEvent e;
    e.set_job_id("job-1");
    e.set_index(index);
    e.mutable_state_change()->set_state(state);
    return e;
  }
  // A stream's heartbeat (JobEvent or LogEntry) at `index`.
  template <typename Row>
  static Row Beat(int64_t index) {
    Row r;
    r.set_job_id("job-1");
    r.set_index(index);
    r.mutable_heartbeat();
    return r;
  }

  static v1::LogEntry Line(int64_t index) {
    v1::LogEntry l;
    l.set_job_id("job-1");
    l.set_index(index);
    l.set_rank(0);
    l.set_line(absl::StrCat("line ", index));
    return l;
  }

  ScriptedJobs jobs_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

// WatchJob asks for the stream's heartbeats (WatchJobRequest.heartbeats:
// the coordinator sends them only when asked, so that a client built
// before them does not show them) and hands its caller only the events.
TEST_F(ClientTest, AWatchAsksForHeartbeatsAndSkipsThem) {
  WatchAnswer a;
  a.open = true;
  a.rows = {Beat<v1::JobEvent>(-1), State(0, v1::PENDING), Beat<v1::JobEvent>(0), Beat<v1::JobEvent>(0),
            State(1, v1::CANCELLED)};
  jobs_.Script({}, a);
  ClientOptions o;
  o.connection.address = address_;
  Client client(o);
  std::vector<int64_t> seen;
  const absl::Status s = client.WatchJob("job-1", 0, [&](const v1::JobEvent& e) {
    EXPECT_FALSE(e.has_heartbeat());
    seen.push_back(e.index());
    return true;
  });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_THAT(seen, ElementsAre(0, 1));
  const std::vector<v1::WatchJobRequest> asked = jobs_.Requests();
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_TRUE(asked[0].heartbeats()) << asked[0].DebugString();
}

// GetJobLogs asks for a followed log's heartbeats (GetJobLogsRequest.
// heartbeats) and hands its caller only the lines (plateauctl logs
// --follow prints each one it is handed, under --output json too). A
// heartbeat moves no resume point: the follow broken after one resumes
// from the line after the last line read.
TEST_F(ClientTest, ALogFollowAsksForHeartbeatsAndSkipsThem) {
  LogsAnswer first;
  first.rows = {Beat<v1::LogEntry>(-1), Line(0), Beat<v1::LogEntry>(0), Line(1), Beat<v1::LogEntry>(1)};
  first.end = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the coordinator is shutting down; resume from index 2");
  LogsAnswer second;
  second.rows = {Beat<v1::LogEntry>(1), Line(2)};
  jobs_.ScriptLogs({first, second});
  ClientOptions o;
  o.connection.address = address_;
  o.reconnect_for = absl::Seconds(20);
  Client client(o);
  std::vector<int64_t> seen;
  const absl::Status s = client.GetJobLogs("job-1", /*follow=*/true, 0, [&](const v1::LogEntry& l) {
    EXPECT_FALSE(l.has_heartbeat()) << l.DebugString();
    seen.push_back(l.index());
    return true;
  });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_THAT(seen, ElementsAre(0, 1, 2));
  const std::vector<v1::GetJobLogsRequest> asked = jobs_.LogRequests();
  ASSERT_EQ(asked.size(), 2u);
  for (const v1::GetJobLogsRequest& r : asked) {
    EXPECT_TRUE(r.follow()) << r.DebugString();
    EXPECT_TRUE(r.heartbeats()) << r.DebugString();
  }
  EXPECT_EQ(asked[1].from_index(), 2) << "resumed from a heartbeat's index";
}

// A watch that never got in (its first try refused for the coordinator's
// watch limit, RESOURCE_EXHAUSTED) meets the coordinator going away on a
// retry (UNAVAILABLE: a restart). It was refused, so the coordinator was
// reached: it keeps retrying for the reconnect window (here 20 s) from
// that refusal, and gets in once the coordinator is back (4 s). It took a
// never-connected watch's 3 s then, and failed UNAVAILABLE (plateauctl's
// exit 4) while the coordinator restarted.
TEST_F(ClientTest, AWatchRefusedThenBrokenRetriesForTheReconnectWindow) {
  jobs_.By([](absl::Duration since_first) {
    WatchAnswer a;
    if (since_first == absl::ZeroDuration()) {
      a.end = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                           "too many open watches from 127.0.0.1: 1 of at most 1 (the coordinator's "
                           "--max_watches_per_client) are open; retry with backoff");
    } else if (since_first < absl::Seconds(4)) {
      a.end = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the coordinator is shutting down");
    } else {
      a.open = true;
      a.rows = {State(0, v1::CANCELLED)};
    }
    return a;
  });
  ClientOptions o;
  o.connection.address = address_;
  o.reconnect_for = absl::Seconds(20);
  absl::Mutex mu;
  std::vector<absl::Status> notices;
  o.on_reconnecting = [&](const absl::Status& s) {
    absl::MutexLock lock(&mu);
    notices.push_back(s);
  };
  Client client(o);
  std::vector<int64_t> seen;
  const absl::Time start = absl::Now();
  const absl::Status s = client.WatchJob("job-1", 0, [&](const v1::JobEvent& e) {
    seen.push_back(e.index());
    return true;
  });
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE(s.ok()) << s << " after " << took << " and " << jobs_.Times().size() << " tries";
  EXPECT_THAT(seen, ElementsAre(0));
  EXPECT_GE(took, absl::Seconds(4));
  EXPECT_LT(took, absl::Seconds(20));
  EXPECT_GE(jobs_.Times().size(), 3u);
  // Said once, for the outage that began with the refusal.
  absl::MutexLock lock(&mu);
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_EQ(notices[0].code(), absl::StatusCode::kResourceExhausted) << notices[0];
}

}  // namespace
}  // namespace plateau
