// The C++ client's stream reader (client/client.h WatchJob) against a
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

// A JobService whose WatchJob answers from a script; once the script is
// out, every call gets `then`.
class ScriptedJobs final : public v1::JobService::Service {
 public:
  void Script(std::deque<WatchAnswer> answers, WatchAnswer then) {
    absl::MutexLock lock(&mu_);
    answers_ = std::move(answers);
    then_ = std::move(then);
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

  grpc::Status WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                        grpc::ServerWriter<v1::JobEvent>* writer) override {
    WatchAnswer a;
    {
      absl::MutexLock lock(&mu_);
      requests_.push_back(*req);
      times_.push_back(absl::Now());
      if (answers_.empty()) {
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
  std::vector<v1::WatchJobRequest> requests_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Time> times_ ABSL_GUARDED_BY(mu_);
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
  static v1::JobEvent Heartbeat(int64_t index) {
    v1::JobEvent e;
    e.set_job_id("job-1");
    e.set_index(index);
    e.mutable_heartbeat();
    return e;
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
  a.rows = {Heartbeat(-1), State(0, v1::PENDING), Heartbeat(0), Heartbeat(0), State(1, v1::CANCELLED)};
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

}  // namespace
}  // namespace plateau
