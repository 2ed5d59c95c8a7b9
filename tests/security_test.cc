// Security end to end (docs/SERVICE.md "Security"), with real processes over
// loopback (tests/cluster.h): the bearer token on every RPC of JobService and
// WorkerService, workers and their ranks that need it, TLS, the loopback
// rule of --listen, the request size limit and the per-client watch limit.
#include <sys/wait.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/connection.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/empty.pb.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/wrappers.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "plateau/v1/job.grpc.pb.h"
#include "plateau/v1/worker.grpc.pb.h"
#include "tests/certificates.h"
#include "tests/cluster.h"

namespace plateau {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

using namespace testing_cluster;  // NOLINT: the harness is this file's vocabulary

std::string WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// A spec as a text-format file for plateauctl; its path.
std::string WriteSpec(const std::string& path, const v1::JobSpec& spec) {
  std::string text;
  google::protobuf::TextFormat::PrintToString(spec, &text);
  return WriteFile(path, text);
}

std::shared_ptr<grpc::Channel> Channel(const std::string& address, const std::string& token_file = "",
                                       const std::string& ca_file = "") {
  auto c = OpenChannel(ConnectionOptions{address, {token_file, ca_file}});
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : nullptr;
}

void Deadline(grpc::ClientContext& ctx, absl::Duration d = absl::Seconds(10)) {
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d));
}

template <typename Row>
grpc::Status Drain(grpc::ClientReader<Row>* reader) {
  Row row;
  while (reader->Read(&row)) {
  }
  return reader->Finish();
}

// Every RPC of both services, each with a request that would change
// something if it were let in. Keep in step with the protos: the test below
// checks that each service still has exactly the RPCs called here.
std::vector<std::pair<std::string, grpc::Status>> CallEveryRpc(const std::shared_ptr<grpc::Channel>& channel) {
  auto jobs = v1::JobService::NewStub(channel);
  auto workers = v1::WorkerService::NewStub(channel);
  std::vector<std::pair<std::string, grpc::Status>> out;
  auto unary = [&](const std::string& name, const std::function<grpc::Status(grpc::ClientContext*)>& call) {
    grpc::ClientContext ctx;
    Deadline(ctx);
    out.emplace_back(name, call(&ctx));
  };
  v1::SubmitJobRequest submit;
  *submit.mutable_spec() = TinyJob(3);
  unary("SubmitJob", [&](auto* ctx) {
    v1::SubmitJobResponse r;
    return jobs->SubmitJob(ctx, submit, &r);
  });
  unary("GetJob", [&](auto* ctx) {
    v1::GetJobRequest q;
    q.set_job_id("job-1");
    v1::Job r;
    return jobs->GetJob(ctx, q, &r);
  });
  unary("ListJobs", [&](auto* ctx) {
    v1::ListJobsResponse r;
    return jobs->ListJobs(ctx, v1::ListJobsRequest(), &r);
  });
  unary("CancelJob", [&](auto* ctx) {
    v1::CancelJobRequest q;
    q.set_job_id("job-1");
    v1::Job r;
    return jobs->CancelJob(ctx, q, &r);
  });
  unary("WatchJob", [&](auto* ctx) {
    v1::WatchJobRequest q;
    q.set_job_id("job-1");
    return Drain(jobs->WatchJob(ctx, q).get());
  });
  unary("GetJobLogs", [&](auto* ctx) {
    v1::GetJobLogsRequest q;
    q.set_job_id("job-1");
    q.set_follow(true);
    return Drain(jobs->GetJobLogs(ctx, q).get());
  });
  unary("PlanJob", [&](auto* ctx) {
    v1::PlanJobRequest q;
    *q.mutable_spec() = TinyJob(3);
    v1::PlanJobResponse r;
    return jobs->PlanJob(ctx, q, &r);
  });
  unary("GetMemoryTimeline", [&](auto* ctx) {
    v1::GetMemoryTimelineRequest q;
    q.set_job_id("job-1");
    v1::GetMemoryTimelineResponse r;
    return jobs->GetMemoryTimeline(ctx, q, &r);
  });
  unary("ListWorkers", [&](auto* ctx) {
    v1::ListWorkersResponse r;
    return jobs->ListWorkers(ctx, v1::ListWorkersRequest(), &r);
  });
  unary("DeleteJob", [&](auto* ctx) {
    v1::DeleteJobRequest q;
    q.set_job_id("job-1");
    v1::DeleteJobResponse r;
    return jobs->DeleteJob(ctx, q, &r);
  });
  unary("Register", [&](auto* ctx) {
    v1::RegisterRequest q;
    q.mutable_capabilities()->set_backend(v1::BACKEND_CPU);
    q.mutable_capabilities()->set_devices(2);
    q.mutable_capabilities()->set_device_memory_bytes(int64_t{1} << 30);
    q.mutable_capabilities()->set_rank_address("127.0.0.1");
    v1::RegisterResponse r;
    return workers->Register(ctx, q, &r);
  });
  unary("Heartbeat", [&](auto* ctx) {
    v1::HeartbeatRequest q;
    q.set_worker_id("worker-1");
    v1::HeartbeatResponse r;
    return workers->Heartbeat(ctx, q, &r);
  });
  unary("ReportRankStatus", [&](auto* ctx) {
    v1::RankStatusRequest q;
    q.set_worker_id("worker-1");
    q.set_job_id("job-1");
    q.mutable_started()->set_pid(1);
    v1::RankStatusResponse r;
    return workers->ReportRankStatus(ctx, q, &r);
  });
  unary("ReportTelemetry", [&](auto* ctx) {
    v1::TelemetryRequest q;
    q.set_worker_id("worker-1");
    q.add_logs()->set_line("forged");
    v1::TelemetryResponse r;
    return workers->ReportTelemetry(ctx, q, &r);
  });
  unary("KvSet", [&](auto* ctx) {
    v1::KvSetRequest q;
    q.set_key("security-test/probe");
    q.set_value("forged");
    v1::KvSetResponse r;
    return workers->KvSet(ctx, q, &r);
  });
  unary("KvGet", [&](auto* ctx) {
    v1::KvGetRequest q;
    q.set_key("security-test/probe");
    v1::KvGetResponse r;
    return workers->KvGet(ctx, q, &r);
  });
  unary("KvCheck", [&](auto* ctx) {
    v1::KvCheckRequest q;
    q.add_keys("security-test/probe");
    v1::KvCheckResponse r;
    return workers->KvCheck(ctx, q, &r);
  });
  return out;
}

// A unary call by method name, for services without generated stubs here.
// The messages are wire-compatible stand-ins: grpc.health.v1's
// HealthCheckRequest {string service = 1} is a StringValue, its
// HealthCheckResponse {enum status = 1} an Int32Value (1: SERVING).
template <typename Request, typename Response>
grpc::Status GenericUnary(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                          const Request& request, Response* response) {
  grpc::TemplatedGenericStub<Request, Response> stub(channel);
  grpc::ClientContext ctx;
  Deadline(ctx);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareUnaryCall(&ctx, method, request, &cq);
  call->StartCall();
  grpc::Status status;
  call->Finish(response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

grpc::Status HealthCheck(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                         int* serving) {
  google::protobuf::StringValue req;
  req.set_value(service);
  google::protobuf::Int32Value resp;
  grpc::Status s = GenericUnary(channel, "/grpc.health.v1.Health/Check", req, &resp);
  *serving = resp.value();
  return s;
}

grpc::Status Reflection(const std::shared_ptr<grpc::Channel>& channel) {
  google::protobuf::Empty req, resp;
  return GenericUnary(channel, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", req, &resp);
}

struct Tokens {
  std::string right, wrong;
};
Tokens WriteTokens(const std::string& dir) {
  return {WriteFile(dir + "/token", "tok-3f9a1c-right\n"), WriteFile(dir + "/wrong-token", "tok-3f9a1c-wrong\n")};
}

TEST(SecurityTest, EveryRpcRefusesAMissingOrWrongTokenBeforeDoingAnything) {
  // Adding an RPC to a service must add it to CallEveryRpc.
  const auto* pool = google::protobuf::DescriptorPool::generated_pool();
  ASSERT_EQ(pool->FindServiceByName("plateau.v1.JobService")->method_count(), 10);
  ASSERT_EQ(pool->FindServiceByName("plateau.v1.WorkerService")->method_count(), 7);

  const Tokens t = WriteTokens(TempDir("auth_tokens"));
  ClusterOptions o;
  o.with_worker = false;
  o.coordinator_flags = {"--token_file=" + t.right};
  o.client.connection.files.token_file = t.right;
  Cluster c("auth_rpcs", o);
  ASSERT_TRUE(c.ready()) << c.Logs();

  for (const auto& [label, channel, expected] :
       std::vector<std::tuple<std::string, std::shared_ptr<grpc::Channel>, std::string>>{
           {"no token", Channel(c.api()), "missing bearer token"},
           {"wrong token", Channel(c.api(), t.wrong), "wrong bearer token"}}) {
    const auto results = CallEveryRpc(channel);
    ASSERT_EQ(results.size(), 17u);
    for (const auto& [rpc, status] : results) {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
          << label << ": " << rpc << ": " << status.error_message();
      EXPECT_THAT(status.error_message(), HasSubstr(expected)) << label << ": " << rpc;
    }
  }

  // Nothing the refused calls asked for happened.
  auto list = c.client().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->jobs_size(), 0);
  auto with_token = Channel(c.api(), t.right);
  auto workers = v1::WorkerService::NewStub(with_token);
  {
    grpc::ClientContext ctx;
    Deadline(ctx);
    v1::KvCheckRequest q;
    q.add_keys("security-test/probe");
    v1::KvCheckResponse r;
    ASSERT_TRUE(workers->KvCheck(&ctx, q, &r).ok());
    EXPECT_FALSE(r.all_set()) << "an unauthenticated KvSet went through";
  }
  auto job = c.client().SubmitJob(TinyJob(3), false);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->job().id(), "job-1");
  {
    // The right token is let in by the same services (a key of the live
    // attempt: the only keys a rank may set).
    grpc::ClientContext ctx;
    Deadline(ctx);
    v1::KvSetRequest q;
    q.set_key("job-1/attempt-0/security-test-probe");
    q.set_value("v");
    v1::KvSetResponse r;
    grpc::Status set = workers->KvSet(&ctx, q, &r);
    EXPECT_TRUE(set.ok()) << set.error_message();
  }

  // The Client with no token file says what is missing.
  ClientOptions bare;
  bare.connection.address = c.api();
  Client anonymous(bare);
  EXPECT_EQ(anonymous.GetJob("job-1").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(anonymous.GetJob("job-1").status().message(), HasSubstr("--token_file"));

  // Health stays open for liveness probes; reflection is off (it would answer
  // without the token).
  int serving = 0;
  grpc::Status h = HealthCheck(Channel(c.api()), "plateau.v1.JobService", &serving);
  EXPECT_TRUE(h.ok()) << h.error_message();
  EXPECT_EQ(serving, 1);
  EXPECT_EQ(Reflection(Channel(c.api())).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(Reflection(with_token).error_code(), grpc::StatusCode::UNIMPLEMENTED);
}

TEST(SecurityTest, WorkerWithoutTheTokenCannotRegisterAndWithItRunsAJob) {
  const Tokens t = WriteTokens(TempDir("worker_tokens"));
  ClusterOptions o;
  o.with_worker = false;
  o.coordinator_flags = {"--token_file=" + t.right};
  o.client.connection.files.token_file = t.right;
  Cluster c("auth_worker", o);
  ASSERT_TRUE(c.ready()) << c.Logs();

  Process* none = c.StartWorker();
  Process* wrong = c.StartWorker({"--token_file=" + t.wrong});
  ASSERT_TRUE(WaitFor([&] { return !none->Running() && !wrong->Running(); }, absl::Seconds(60))) << c.Logs();
  int status = none->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << status;
  EXPECT_THAT(none->err(), AllOf(HasSubstr("cannot register with the coordinator"), HasSubstr("missing bearer token")));
  status = wrong->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << status;
  EXPECT_THAT(wrong->err(), HasSubstr("wrong bearer token"));

  auto sub = c.client().SubmitJob(TinyJob(3), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  absl::SleepFor(absl::Seconds(1));  // several scheduling rounds
  auto pending = c.client().GetJob(id);
  ASSERT_TRUE(pending.ok());
  EXPECT_EQ(pending->state(), v1::PENDING);
  EXPECT_THAT(pending->state_reason(), HasSubstr("no worker")) << "a worker registered without the token";

  // With the token the worker registers, and its ranks' rendezvous (KvSet/
  // KvGet through the coordinator) authenticates with the file passed on.
  c.StartWorker({"--token_file=" + t.right});
  const v1::Job done = c.WaitDone(id);
  EXPECT_EQ(done.state(), v1::SUCCEEDED) << done.DebugString() << c.Logs();
  EXPECT_EQ(done.progress().step(), 3);
}

// --worker_token_file: the workers' tokens apart from the users'. A user's
// token cannot act as a worker (before, any holder of the one token could
// register under a worker's name, take its assignments, read a job's
// rendezvous keys or set them), nor a worker's as a user; a worker with its
// own token runs a job, its ranks authenticating with the file passed on.
TEST(SecurityTest, WorkersTokensApartFromUsersAreEachRefusedTheOthersService) {
  const std::string dir = TempDir("worker_token_file");
  const Tokens t = WriteTokens(dir);
  const std::string workers_token = WriteFile(dir + "/workers-token", "tok-3f9a1c-workers\n");
  ClusterOptions o;
  o.with_worker = false;
  o.coordinator_flags = {"--token_file=" + t.right, "--worker_token_file=" + workers_token};
  o.client.connection.files.token_file = t.right;
  Cluster c("auth_worker_tokens", o);
  ASSERT_TRUE(c.ready()) << c.Logs();

  {
    grpc::ClientContext ctx;
    Deadline(ctx);
    v1::KvCheckRequest q;
    q.add_keys("security-test/probe");
    v1::KvCheckResponse r;
    const grpc::Status s = v1::WorkerService::NewStub(Channel(c.api(), t.right))->KvCheck(&ctx, q, &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("cannot make WorkerService calls"));
  }
  {
    grpc::ClientContext ctx;
    Deadline(ctx);
    v1::ListJobsResponse r;
    const grpc::Status s =
        v1::JobService::NewStub(Channel(c.api(), workers_token))->ListJobs(&ctx, v1::ListJobsRequest(), &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("cannot make JobService calls"));
  }
  // Neither file's token: as before, a wrong one, naming the file.
  const auto every = CallEveryRpc(Channel(c.api(), t.wrong));
  for (const auto& [rpc, status] : every) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << rpc << ": " << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("wrong bearer token")) << rpc;
  }

  Process* as_user = c.StartWorker({"--token_file=" + t.right});
  ASSERT_TRUE(WaitFor([&] { return !as_user->Running(); }, absl::Seconds(60))) << c.Logs();
  const int status = as_user->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << status;
  EXPECT_THAT(as_user->err(), HasSubstr("--worker_token_file"));

  auto sub = c.client().SubmitJob(TinyJob(3), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  c.StartWorker({"--token_file=" + workers_token});
  const v1::Job done = c.WaitDone(sub->job().id());
  EXPECT_EQ(done.state(), v1::SUCCEEDED) << done.DebugString() << c.Logs();
}

// A log line that would drive the operator's terminal (an OSC 52 write to
// the clipboard, a cursor move, a C1 CSI) is shown by plateauctl logs with
// its control characters as \xNN (tabs kept); --raw prints it as it is.
// And a spec path with a control character is refused at submit.
TEST(SecurityTest, PlateauctlShowsControlCharactersOfLogLinesAsText) {
  ClusterOptions o;
  o.with_worker = false;
  Cluster c("visible_logs", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(3), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  // A worker (played here) is given the job and reports a rank's line (a
  // job's lines are taken from the workers that hosted it only).
  auto workers = v1::WorkerService::NewStub(Channel(c.api()));
  v1::RegisterResponse registered;
  {
    grpc::ClientContext ctx;
    Deadline(ctx);
    v1::RegisterRequest q;
    q.mutable_capabilities()->set_backend(v1::BACKEND_CPU);
    q.mutable_capabilities()->set_devices(2);
    q.mutable_capabilities()->set_device_memory_bytes(int64_t{8} << 30);
    q.mutable_capabilities()->set_host_memory_bytes(int64_t{64} << 30);
    q.mutable_capabilities()->set_rank_address("127.0.0.1");
    ASSERT_TRUE(workers->Register(&ctx, q, &registered).ok());
  }
  bool assigned = false;
  for (int i = 0; i < 200 && !assigned; ++i) {
    grpc::ClientContext ctx;
    Deadline(ctx);
    v1::HeartbeatRequest q;
    q.set_worker_id(registered.worker_id());
    v1::HeartbeatResponse r;
    ASSERT_TRUE(workers->Heartbeat(&ctx, q, &r).ok());
    for (const auto& a : r.assignments()) assigned = assigned || a.job_id() == id;
    if (!assigned) absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(assigned) << "the played worker was never given " << id << "\n" << c.Logs();
  const std::string evil =
      "before\x1b]52;c;ZXZpbA==\x07\tafter\x1b[2J\xc2\x9b"
      "1m end";
  {
    grpc::ClientContext ctx;
    Deadline(ctx);
    v1::TelemetryRequest q;
    q.set_worker_id(registered.worker_id());
    v1::LogEntry* l = q.add_logs();
    l->set_job_id(id);
    l->set_rank(0);
    l->set_stream("stdout");
    l->set_line(evil);
    v1::TelemetryResponse r;
    const grpc::Status s = workers->ReportTelemetry(&ctx, q, &r);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  Ran r = RunCommand({"client/plateauctl", "--coordinator=" + c.api(), "logs", id}, c.dir() + "/logs");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("[rank 0] before\\x1b]52;c;ZXZpbA==\\x07\tafter\\x1b[2J\\u009b1m end")) << r.out;
  EXPECT_EQ(r.out.find('\x1b'), std::string::npos) << "a raw escape reached the terminal";
  r = RunCommand({"client/plateauctl", "--coordinator=" + c.api(), "logs", "--raw", id}, c.dir() + "/logs-raw");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("[rank 0] " + evil));

  v1::JobSpec bad = TinyJob(3);
  bad.mutable_checkpoint()->set_directory("/tmp/ckpt\x1b[2Jx");
  auto refused = c.client().SubmitJob(bad, false);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("checkpoint.directory"));
}

// --allowed_paths: a job whose checkpoint directory (or data) lies outside
// the worker's directories fails INVALID at the start of its ranks, naming
// the field (not restarted); one inside runs. Without it any submitter
// could have the ranks read or write any path the agent's user can.
TEST(SecurityTest, AJobsPathsMustLieInTheWorkersAllowedPaths) {
  const std::string dir = TempDir("allowed_paths");
  const std::string allowed = dir + "/allowed";
  std::filesystem::create_directories(allowed);
  ClusterOptions o;
  o.worker_flags = {"--allowed_paths=" + allowed};
  Cluster c("allowed_paths_cluster", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  v1::JobSpec outside = TinyJob(2);
  outside.mutable_checkpoint()->set_directory(dir + "/elsewhere");
  auto sub = c.client().SubmitJob(outside, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  v1::Job done = c.WaitDone(sub->job().id());
  EXPECT_EQ(done.state(), v1::FAILED) << done.DebugString();
  EXPECT_EQ(done.failure().kind(), v1::Failure::INVALID) << done.DebugString();
  EXPECT_EQ(done.attempt(), 0) << "a refused job was restarted";
  EXPECT_THAT(done.failure().message(), HasSubstr("checkpoint.directory=" + dir +
                                                  "/elsewhere: outside this worker's --allowed_paths (" + allowed));
  EXPECT_FALSE(std::filesystem::exists(dir + "/elsewhere")) << "a rank wrote there";
  v1::JobSpec inside = TinyJob(2);
  inside.mutable_checkpoint()->set_directory(allowed + "/ckpt");
  sub = c.client().SubmitJob(inside, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  done = c.WaitDone(sub->job().id());
  EXPECT_EQ(done.state(), v1::SUCCEEDED) << done.DebugString() << c.Logs();
  EXPECT_TRUE(std::filesystem::exists(allowed + "/ckpt/step-00000002.safetensors"));
}

// Writes `path` as docs/SERVICE.md "Rotating the token" says to: a new
// file renamed over the old, so no reader sees it half-written.
void Replace(const std::string& path, const std::string& text) {
  WriteFile(path + ".next", text);
  std::filesystem::rename(path + ".next", path);
}

// One watch held open by the test.
struct Watch {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::JobEvent>> reader;
  std::unique_ptr<grpc::ClientReader<v1::LogEntry>> logs;
};

// A stream opened with a token that is then rotated out of the file ends
// (within the file's recheck and the stream's wakeup), as new calls with
// it are refused: UNAVAILABLE, so that a client that has the new token
// resumes with it (the client library's watch runs through the rotation)
// and one that has not is refused at its reopen. Before, a stream streamed
// on for the job's life with a revoked token.
TEST(SecurityTest, OpenStreamsEndWhenTheirTokenIsRotatedOut) {
  const std::string dir = TempDir("rotated_streams_tokens");
  const std::string coordinator_file = WriteFile(dir + "/coordinator-token", "tok-old-91d0\n");
  const std::string old_file = WriteFile(dir + "/old-token", "tok-old-91d0\n");
  const std::string client_file = WriteFile(dir + "/client-token", "tok-old-91d0\n");
  ClusterOptions o;
  o.with_worker = false;  // the job waits: quiet streams
  o.coordinator_flags = {"--token_file=" + coordinator_file};
  o.client.connection.files.token_file = old_file;
  Cluster c("rotated_streams", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(3), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto stub = v1::JobService::NewStub(Channel(c.api(), old_file));
  Watch watch, logs;
  Deadline(watch.ctx, absl::Seconds(60));
  Deadline(logs.ctx, absl::Seconds(60));
  v1::WatchJobRequest wq;
  wq.set_job_id(sub->job().id());
  watch.reader = stub->WatchJob(&watch.ctx, wq);
  v1::JobEvent e;
  ASSERT_TRUE(watch.reader->Read(&e));
  v1::GetJobLogsRequest lq;
  lq.set_job_id(sub->job().id());
  lq.set_follow(true);
  logs.logs = stub->GetJobLogs(&logs.ctx, lq);
  // The client library's watch, from a file that will hold the new token.
  ClientOptions co;
  co.connection.address = c.api();
  co.connection.files.token_file = client_file;
  Client watcher(co);
  std::atomic<int> reconnecting{0};
  std::atomic<int> last{v1::JOB_STATE_UNSPECIFIED};
  absl::Status watched;
  std::thread through([&] {
    ClientOptions wo = co;
    wo.on_reconnecting = [&](const absl::Status&) { ++reconnecting; };
    Client w(wo);
    watched = w.WatchJob(sub->job().id(), 0, [&](const v1::JobEvent& ev) {
      if (ev.has_state_change()) last = ev.state_change().state();
      return true;
    });
  });
  // Its stream open (with the old token) before the rotation begins.
  EXPECT_TRUE(WaitFor([&] { return last.load() != v1::JOB_STATE_UNSPECIFIED; }, absl::Seconds(20)));

  // The rotation's three steps, the clients' file changed in the middle.
  Replace(coordinator_file, "tok-old-91d0\ntok-new-0b77\n");
  Replace(client_file, "tok-new-0b77\n");
  absl::SleepFor(absl::Seconds(1.5));  // the coordinator and the client look again
  const absl::Time rotated = absl::Now();
  Replace(coordinator_file, "tok-new-0b77\n");
  while (watch.reader->Read(&e)) {
  }
  const grpc::Status ended = watch.reader->Finish();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAVAILABLE) << ended.error_message();
  EXPECT_THAT(ended.error_message(), AllOf(HasSubstr("no longer accepted"), HasSubstr("wrong bearer token")));
  v1::LogEntry line;
  while (logs.logs->Read(&line)) {
  }
  EXPECT_EQ(logs.logs->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  std::printf("streams ended %s after the rotation\n", absl::FormatDuration(absl::Now() - rotated).c_str());
  // Reopened with the old token, the stream is refused for good.
  grpc::ClientContext again;
  Deadline(again, absl::Seconds(10));
  auto reopened = stub->WatchJob(&again, wq);
  while (reopened->Read(&e)) {
  }
  EXPECT_EQ(reopened->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // The library's watch went on with the new token: it sees the cancel.
  EXPECT_TRUE(WaitFor([&] { return reconnecting.load() > 0; }, absl::Seconds(10)));
  EXPECT_TRUE(watcher.CancelJob(sub->job().id()).ok());
  through.join();
  EXPECT_TRUE(watched.ok()) << watched;
  EXPECT_EQ(last.load(), v1::CANCELLED);
}

// A rotation with nothing restarted: the coordinator accepts the new token
// beside the old, the worker and the client move to it, the old one is
// removed; a running worker keeps its registration and runs the next job
// (heartbeats, telemetry, its ranks' rendezvous) with the new token.
TEST(SecurityTest, TheTokenRotatesWithoutARestart) {
  const std::string dir = TempDir("rotation_tokens");
  // One file per process, as on separate hosts.
  const std::string coordinator_file = WriteFile(dir + "/coordinator-token", "tok-old-7c1e\n");
  const std::string worker_file = WriteFile(dir + "/worker-token", "tok-old-7c1e\n");
  const std::string client_file = WriteFile(dir + "/client-token", "tok-old-7c1e\n");
  const std::string old_file = WriteFile(dir + "/old-token", "tok-old-7c1e\n");
  const std::string new_file = WriteFile(dir + "/new-token", "tok-new-52ab\n");
  ClusterOptions o;
  o.coordinator_flags = {"--token_file=" + coordinator_file};
  o.worker_flags = {"--token_file=" + worker_file};
  o.client.connection.files.token_file = client_file;
  Cluster c("rotation", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto list = [&](const std::string& token_file) {
    grpc::ClientContext ctx;
    Deadline(ctx);
    v1::ListJobsRequest req;
    v1::ListJobsResponse resp;
    return v1::JobService::NewStub(Channel(c.api(), token_file))->ListJobs(&ctx, req, &resp);
  };
  // The file is looked at again within a second of a call (TokenFile).
  const absl::Duration noticed = absl::Seconds(10);
  auto run_job = [&](const std::string& what) {
    auto sub = c.client().SubmitJob(TinyJob(3), false);
    ASSERT_TRUE(sub.ok()) << what << ": " << sub.status();
    const v1::Job done = c.WaitDone(sub->job().id());
    EXPECT_EQ(done.state(), v1::SUCCEEDED) << what << ": " << done.DebugString() << c.Logs();
  };
  run_job("before the rotation");
  ASSERT_TRUE(list(old_file).ok());
  EXPECT_EQ(list(new_file).error_code(), grpc::StatusCode::UNAUTHENTICATED);

  // 1. The coordinator accepts both.
  Replace(coordinator_file, "tok-old-7c1e\ntok-new-52ab\n");
  ASSERT_TRUE(WaitFor([&] { return list(new_file).ok(); }, noticed)) << c.Logs();
  EXPECT_TRUE(list(old_file).ok());
  EXPECT_THAT(c.coordinator()->err(), HasSubstr("changed: 2 token(s) accepted"));
  // 2. The worker and the client send the new one.
  Replace(worker_file, "tok-new-52ab\n");
  Replace(client_file, "tok-new-52ab\n");
  ASSERT_TRUE(
      WaitFor([&] { return absl::StrContains(c.worker()->out(), "changed: sending its first token"); }, noticed))
      << c.Logs();
  // 3. The old one is refused; the worker, never restarted, runs a job.
  Replace(coordinator_file, "tok-new-52ab\n");
  ASSERT_TRUE(WaitFor([&] { return !list(old_file).ok(); }, noticed)) << c.Logs();
  EXPECT_THAT(list(old_file).error_message(), HasSubstr("wrong bearer token"));
  EXPECT_THAT(c.coordinator()->err(), HasSubstr("changed: 1 token(s) accepted"));
  run_job("after the rotation");
  EXPECT_TRUE(c.worker()->Running());
  EXPECT_THAT(c.worker()->out(), ::testing::Not(HasSubstr("registered again")));
  // A file left empty keeps the token in force, and says so.
  Replace(coordinator_file, "\n");
  ASSERT_TRUE(WaitFor(
      [&] {
        list(new_file);  // the coordinator looks at the file when a call comes
        return absl::StrContains(c.coordinator()->err(), "still accepting the 1 token(s)");
      },
      noticed))
      << c.Logs();
  EXPECT_THAT(c.coordinator()->err(), HasSubstr("--token_file=" + coordinator_file + ": the file is empty"));
  EXPECT_TRUE(list(new_file).ok());
  EXPECT_FALSE(list(old_file).ok());
}

// A self-signed certificate for 127.0.0.1 and localhost, its own CA.
bool MakeCertificate(const std::string& dir, const std::string& name, std::string* cert, std::string* key) {
  testing_certificates::Pem pem;
  const bool made = testing_certificates::MakeSelfSigned(dir, name, "IP:127.0.0.1,DNS:localhost", &pem);
  *cert = pem.cert;
  *key = pem.key;
  return made;
}

TEST(SecurityTest, TlsWithTokenRunsPlateauctlAndRefusesPlaintextAndAStrangerCa) {
  const std::string dir = TempDir("tls_files");
  const Tokens t = WriteTokens(dir);
  std::string cert, key, other_cert, other_key;
  ASSERT_TRUE(MakeCertificate(dir, "coordinator", &cert, &key));
  ASSERT_TRUE(MakeCertificate(dir, "stranger", &other_cert, &other_key));
  ClusterOptions o;
  o.coordinator_flags = {"--token_file=" + t.right, "--tls_cert_file=" + cert, "--tls_key_file=" + key};
  o.worker_flags = {"--token_file=" + t.right, "--tls_ca_file=" + cert};
  o.client.connection.files.token_file = t.right;
  o.client.connection.files.tls_ca_file = cert;
  Cluster c("tls", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  EXPECT_THAT(c.coordinator()->out(), HasSubstr("(TLS, bearer token required)"));

  const std::string spec_path = WriteSpec(c.dir() + "/job.txtpb", TinyJob(3));
  const std::string ctl = "client/plateauctl";
  const std::string coord = "--coordinator=" + c.api();
  // The CA from the environment, the token from the flag.
  setenv("PLATEAU_TLS_CA_FILE", cert.c_str(), 1);
  Ran r = RunCommand({ctl, coord, "--token_file=" + t.right, "submit", spec_path, "--wait"}, c.dir() + "/submit");
  unsetenv("PLATEAU_TLS_CA_FILE");
  EXPECT_EQ(r.code, 0) << r.out << r.err << c.Logs();
  EXPECT_THAT(r.out, HasSubstr("summary: job-1 SUCCEEDED"));

  // And the other way round.
  setenv("PLATEAU_TOKEN_FILE", t.right.c_str(), 1);
  r = RunCommand({ctl, coord, "--tls_ca_file=" + cert, "get", "job-1"}, c.dir() + "/get");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("SUCCEEDED"));
  // Without a client certificate the record of who submitted is the host.
  EXPECT_THAT(r.out, HasSubstr("by:       submitted by 127.0.0.1\n"));
  // Plaintext to a TLS port: no connection (exit 4), with the right token.
  r = RunCommand({ctl, coord, "list"}, c.dir() + "/plaintext");
  unsetenv("PLATEAU_TOKEN_FILE");
  EXPECT_EQ(r.code, 4) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("cannot reach the coordinator"));
  // TLS but no token: refused, exit 2, saying what is missing.
  r = RunCommand({ctl, coord, "--tls_ca_file=" + cert, "list"}, c.dir() + "/notoken");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("UNAUTHENTICATED: missing bearer token"));
  // An unreadable token file: exit 2 naming the flag and the path.
  r = RunCommand({ctl, coord, "--tls_ca_file=" + cert, "--token_file=" + dir + "/absent", "list"},
                 c.dir() + "/absent");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--token_file=" + dir + "/absent"));

  // Raw stubs: plaintext is UNAVAILABLE; a certificate another CA signed is
  // not trusted.
  for (const auto& [label, channel] : std::vector<std::pair<std::string, std::shared_ptr<grpc::Channel>>>{
           {"plaintext", Channel(c.api(), t.right)}, {"stranger CA", Channel(c.api(), t.right, other_cert)}}) {
    auto stub = v1::JobService::NewStub(channel);
    grpc::ClientContext ctx;
    Deadline(ctx);
    v1::ListJobsResponse resp;
    grpc::Status s = stub->ListJobs(&ctx, v1::ListJobsRequest(), &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << label << ": " << s.error_message();
  }
  auto ok = v1::JobService::NewStub(Channel(c.api(), t.right, cert));
  grpc::ClientContext ctx;
  Deadline(ctx);
  v1::ListJobsResponse resp;
  EXPECT_TRUE(ok->ListJobs(&ctx, v1::ListJobsRequest(), &resp).ok());
  EXPECT_EQ(resp.jobs_size(), 1);
}

// Starts a coordinator outside the harness; its API address once serving.
std::string StartCoordinator(const std::string& dir, const std::string& name, std::vector<std::string> flags,
                             std::unique_ptr<Process>* p) {
  const std::string ready = absl::StrCat(dir, "/", name, ".ready");
  std::vector<std::string> args = {"server/plateau_coordinator", absl::StrCat("--state_dir=", dir, "/", name),
                                   "--metrics_address=127.0.0.1:0", "--ready_file=" + ready};
  args.insert(args.end(), flags.begin(), flags.end());
  *p = std::make_unique<Process>(args, absl::StrCat(dir, "/", name));
  if (!WaitFor([&] { return std::filesystem::exists(ready) || !(*p)->Running(); })) return "";
  for (absl::string_view line : absl::StrSplit(ReadFile(ready), '\n')) {
    // "api=0.0.0.0:PORT": reach it on loopback.
    if (absl::ConsumePrefix(&line, "api=")) return absl::StrCat("127.0.0.1:", line.substr(line.rfind(':') + 1));
  }
  return "";
}

// The TLS files are read again while the processes run (--tls_reload_s on
// the coordinator, ConnectionOptions::tls_reload in a client): a client CA
// added, the coordinator's certificate and key replaced (the key first, so
// that a read may find the pair mismatched for a moment), and a client's CA
// file replaced, each take effect for the next connection without a
// restart of the process that reads them.
TEST(SecurityTest, TlsFilesAreReadAgainWithoutARestart) {
  const std::string dir = TempDir("tls_reload");
  std::filesystem::create_directories(dir + "/a");
  std::filesystem::create_directories(dir + "/b");
  testing_certificates::MutualTls a;
  ASSERT_TRUE(testing_certificates::MakeMutualTls(dir + "/a", "IP:127.0.0.1", "client-a", &a));
  testing_certificates::MutualTls b;
  ASSERT_TRUE(testing_certificates::MakeMutualTls(dir + "/b", "IP:127.0.0.1", "client-b", &b));
  // What the processes read, replaced by a rename as an operator (or a
  // Kubernetes Secret volume) does.
  auto install = [](const std::string& to, const std::vector<std::string>& from) {
    std::string text;
    for (const std::string& f : from) text += ReadFile(f);
    WriteFile(to + ".tmp", text);
    std::filesystem::rename(to + ".tmp", to);
  };
  const std::string cert = dir + "/coordinator.crt", key = dir + "/coordinator.key", clients = dir + "/clients.pem",
                    trust = dir + "/trust.pem";
  install(cert, {a.server.cert});
  install(key, {a.server.key});
  install(clients, {a.client_ca.cert});
  install(trust, {a.server.cert});
  ClusterOptions o;
  o.with_worker = false;
  o.coordinator_flags = {"--tls_cert_file=" + cert, "--tls_key_file=" + key, "--tls_client_ca_file=" + clients,
                         "--tls_reload_s=1"};
  o.client.connection.files.tls_ca_file = trust;
  o.client.connection.files.tls_client_cert_file = a.client.cert;
  o.client.connection.files.tls_client_key_file = a.client.key;
  o.client.connection.tls_reload = absl::Seconds(1);
  Cluster c("tls-reload", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  ASSERT_TRUE(c.client().ListJobs(v1::ListJobsRequest()).ok());
  // A new client each time: a new connection, so a new handshake.
  auto reaches = [&](const std::string& ca, const testing_certificates::Pem& mine) {
    ClientOptions co;
    co.connection.address = c.api();
    co.connection.files.tls_ca_file = ca;
    co.connection.files.tls_client_cert_file = mine.cert;
    co.connection.files.tls_client_key_file = mine.key;
    co.timeout = absl::Seconds(2);
    return Client(co).ListJobs(v1::ListJobsRequest()).ok();
  };
  const absl::Duration noticed = absl::Seconds(15);

  // A second clients' CA.
  EXPECT_FALSE(reaches(trust, b.client));
  install(clients, {a.client_ca.cert, b.client_ca.cert});
  EXPECT_TRUE(WaitFor([&] { return reaches(trust, b.client); }, noticed)) << c.Logs();
  EXPECT_TRUE(reaches(trust, a.client));

  // The coordinator's own certificate and key.
  EXPECT_FALSE(reaches(b.server.cert, a.client));
  // The key first and, two reads later, its certificate: the reads between
  // find a mismatched pair, which refuses new connections until the pair
  // matches again.
  install(key, {b.server.key});
  absl::SleepFor(absl::Milliseconds(2500));
  install(cert, {b.server.cert});
  EXPECT_TRUE(WaitFor([&] { return reaches(b.server.cert, a.client); }, noticed)) << c.Logs();
  EXPECT_FALSE(reaches(a.server.cert, a.client));

  // The long-lived client's CA file: its connection ends with the
  // coordinator, and its next handshake, with the new certificate, needs
  // the new CA, read while it ran.
  install(trust, {b.server.cert});
  c.KillCoordinator(SIGKILL);
  ASSERT_TRUE(c.RestartCoordinator()) << c.Logs();
  EXPECT_TRUE(WaitFor([&] { return c.client().ListJobs(v1::ListJobsRequest()).ok(); }, noticed)) << c.Logs();
}

// A client checks that the coordinator's certificate names the address it
// dialled: a certificate for localhost alone is refused at 127.0.0.1 although
// its CA is trusted, and accepted at localhost.
TEST(SecurityTest, TheCoordinatorsCertificateMustNameTheAddressDialled) {
  const std::string dir = TempDir("tls_name");
  testing_certificates::Pem server;
  ASSERT_TRUE(testing_certificates::MakeSelfSigned(dir, "coordinator", "DNS:localhost", &server));
  std::unique_ptr<Process> p;
  const std::string api = StartCoordinator(
      dir, "named", {"--listen=127.0.0.1:0", "--tls_cert_file=" + server.cert, "--tls_key_file=" + server.key}, &p);
  ASSERT_FALSE(api.empty()) << p->err();
  const std::string port = api.substr(api.rfind(':') + 1);
  for (const auto& [address, ok] :
       std::vector<std::pair<std::string, bool>>{{"127.0.0.1:" + port, false}, {"localhost:" + port, true}}) {
    ClientOptions co;
    co.connection.address = address;
    co.connection.files.tls_ca_file = server.cert;
    auto list = Client(co).ListJobs(v1::ListJobsRequest());
    EXPECT_EQ(list.ok(), ok) << address << ": " << list.status();
    if (!ok) {
      EXPECT_EQ(list.status().code(), absl::StatusCode::kUnavailable) << list.status();
    }
  }
}

// Mutual TLS: a coordinator given --tls_client_ca_file serves only clients
// whose certificate that CA signed: the worker, its ranks (the job's
// rendezvous runs through the coordinator) and plateauctl, without a token
// (the certificate is the credential). A client without a certificate, or
// with one another CA signed, fails its handshake before any service
// answers, health checking included.
TEST(SecurityTest, ClientCertificatesSignedByTheClientCaAreRequiredAndEnough) {
  const std::string dir = TempDir("mtls_files");
  testing_certificates::MutualTls m;
  ASSERT_TRUE(testing_certificates::MakeMutualTls(dir, "IP:127.0.0.1,DNS:localhost", "worker-1", &m));
  const testing_certificates::Pem &server = m.server, &client_ca = m.client_ca, &client = m.client;
  testing_certificates::Pem stranger, robot;  // robot: named by a subject alternative name alone
  ASSERT_TRUE(testing_certificates::MakeSignedBy(client_ca, dir, "robot", &robot, "DNS:robot.plateau.test"));
  ASSERT_TRUE(testing_certificates::MakeSelfSigned(dir, "stranger", "DNS:stranger.plateau.test", &stranger));
  ClusterOptions o;
  testing_certificates::UseMutualTls(m, &o);
  Cluster c("mtls", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  EXPECT_THAT(c.coordinator()->out(), HasSubstr("(TLS, client certificate required, no token)"));

  const std::string spec_path = WriteSpec(c.dir() + "/job.txtpb", TinyJob(3));
  const std::string ctl = "client/plateauctl";
  const std::string coord = "--coordinator=" + c.api();
  const std::string ca = "--tls_ca_file=" + server.cert;
  // The two ranks meet through the coordinator's store with the worker's
  // certificate: the job runs to the end.
  Ran r = RunCommand({ctl, coord, ca, "--tls_client_cert_file=" + client.cert, "--tls_client_key_file=" + client.key,
                      "submit", spec_path, "--wait"},
                     c.dir() + "/submit");
  EXPECT_EQ(r.code, 0) << r.out << r.err << c.Logs();
  EXPECT_THAT(r.out, HasSubstr("summary: job-1 SUCCEEDED"));
  // The certificate from the environment.
  setenv("PLATEAU_TLS_CLIENT_CERT_FILE", client.cert.c_str(), 1);
  setenv("PLATEAU_TLS_CLIENT_KEY_FILE", client.key.c_str(), 1);
  r = RunCommand({ctl, coord, ca, "get", "job-1"}, c.dir() + "/get");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("SUCCEEDED"));
  // Who submitted it: the certificate's name and the caller's host.
  EXPECT_THAT(r.out, HasSubstr("by:       submitted by CN=worker-1 at 127.0.0.1\n"));
  // And who cancelled one: a job that waits for a second node, cancelled.
  {
    v1::JobSpec s = TinyJob(3);
    s.mutable_layout()->set_nodes(2);
    auto pending = c.client().SubmitJob(s, false);
    ASSERT_TRUE(pending.ok()) << pending.status();
  }
  r = RunCommand({ctl, coord, ca, "cancel", "job-2"}, c.dir() + "/cancel");
  unsetenv("PLATEAU_TLS_CLIENT_CERT_FILE");
  unsetenv("PLATEAU_TLS_CLIENT_KEY_FILE");
  EXPECT_EQ(r.code, 0) << r.err;
  auto cancelled = c.client().GetJob("job-2");
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::CANCELLED);
  EXPECT_EQ(cancelled->cancelled_by(), "CN=worker-1 at 127.0.0.1");
  EXPECT_EQ(cancelled->state_reason(), "cancelled by CN=worker-1 at 127.0.0.1 before it was scheduled");
  EXPECT_THAT(c.coordinator()->out(),
              HasSubstr("job-2 PENDING -> CANCELLED (attempt 0): cancelled by CN=worker-1 at 127.0.0.1 before"));
  // A certificate without a common name is recorded by its first subject
  // alternative name.
  {
    ClientOptions ro = o.client;
    ro.connection.address = c.api();
    ro.connection.files.tls_client_cert_file = robot.cert;
    ro.connection.files.tls_client_key_file = robot.key;
    v1::JobSpec s = TinyJob(3);
    s.mutable_layout()->set_nodes(2);
    auto sub = Client(ro).SubmitJob(s, false);
    ASSERT_TRUE(sub.ok()) << sub.status();
    EXPECT_EQ(sub->job().submitted_by(), "SAN=robot.plateau.test at 127.0.0.1");
    auto gone = Client(ro).CancelJob(sub->job().id());
    EXPECT_TRUE(gone.ok()) << gone.status();
  }
  // No certificate: not served (exit 4), and the message says what to give.
  r = RunCommand({ctl, coord, ca, "list"}, c.dir() + "/nocert");
  EXPECT_EQ(r.code, 4) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("give --tls_client_cert_file and --tls_client_key_file"));
  // Half a certificate: a usage error naming the missing flag.
  r = RunCommand({ctl, coord, ca, "--tls_client_cert_file=" + client.cert, "list"}, c.dir() + "/nokey");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--tls_client_key_file (or $PLATEAU_TLS_CLIENT_KEY_FILE) is missing, and the "
                               "certificate came from its flag"));
  // The environment's certificate is not used without TLS (a plaintext
  // coordinator asks for none); half of it is named as the environment's.
  setenv("PLATEAU_TLS_CLIENT_CERT_FILE", client.cert.c_str(), 1);
  r = RunCommand({ctl, coord, "list"}, c.dir() + "/envplain");
  EXPECT_EQ(r.code, 4) << r.err;  // a TLS port: plaintext cannot reach it, and is not a usage error
  r = RunCommand({ctl, coord, ca, "list"}, c.dir() + "/envhalf");
  unsetenv("PLATEAU_TLS_CLIENT_CERT_FILE");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("is missing, and the certificate came from the environment"));
  r = RunCommand({ctl, coord, "--tls_client_cert_file=" + client.cert, "--tls_client_key_file=" + client.key, "list"},
                 c.dir() + "/noca");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("give --tls_ca_file too"));

  // Raw channels: none, a stranger's and the right certificate, on the job
  // service and on health checking.
  auto channel = [&](const testing_certificates::Pem* pem) {
    ConnectionOptions co;
    co.address = c.api();
    co.files.tls_ca_file = server.cert;
    if (pem != nullptr) {
      co.files.tls_client_cert_file = pem->cert;
      co.files.tls_client_key_file = pem->key;
    }
    auto ch = OpenChannel(co);
    EXPECT_TRUE(ch.ok()) << ch.status();
    return ch.ok() ? *ch : nullptr;
  };
  for (const auto& [label, pem] : std::vector<std::pair<std::string, const testing_certificates::Pem*>>{
           {"no certificate", nullptr}, {"stranger", &stranger}, {"client", &client}}) {
    std::shared_ptr<grpc::Channel> ch = channel(pem);
    ASSERT_NE(ch, nullptr);
    const grpc::StatusCode want = pem == &client ? grpc::StatusCode::OK : grpc::StatusCode::UNAVAILABLE;
    grpc::ClientContext ctx;
    Deadline(ctx);
    v1::ListJobsResponse resp;
    grpc::Status s = v1::JobService::NewStub(ch)->ListJobs(&ctx, v1::ListJobsRequest(), &resp);
    EXPECT_EQ(s.error_code(), want) << label << ": " << s.error_message();
    int serving = 0;
    s = HealthCheck(ch, "plateau.v1.JobService", &serving);
    EXPECT_EQ(s.error_code(), want) << label << " (health): " << s.error_message();
    if (pem == &client) {
      EXPECT_EQ(serving, 1) << "SERVING";
    }
  }

  // The coordinator's flags: a client CA needs TLS and must be PEM; beyond
  // loopback, client certificates stand in for the token.
  const std::string coordinator = "server/plateau_coordinator";
  r = RunCommand({coordinator, "--state_dir=" + dir + "/refused", "--listen=127.0.0.1:0",
                  "--metrics_address=127.0.0.1:0", "--tls_client_ca_file=" + client_ca.cert},
                 dir + "/refused");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--tls_client_ca_file needs TLS"));
  const std::string not_pem = WriteFile(dir + "/not-pem", "token\n");
  r = RunCommand(
      {coordinator, "--state_dir=" + dir + "/badpem", "--listen=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
       "--tls_cert_file=" + server.cert, "--tls_key_file=" + server.key, "--tls_client_ca_file=" + not_pem},
      dir + "/badpem");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--tls_client_ca_file=" + not_pem + ": expected a PEM file"));
  // A key is PEM but no CA.
  r = RunCommand(
      {coordinator, "--state_dir=" + dir + "/keyca", "--listen=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
       "--tls_cert_file=" + server.cert, "--tls_key_file=" + server.key, "--tls_client_ca_file=" + client_ca.key},
      dir + "/keyca");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--tls_client_ca_file=" + client_ca.key + ": expected PEM CA certificate(s)"));
  // A key that is not the certificate's stops the start (served from the
  // files, it would otherwise fail every handshake); so does a reload
  // interval out of range.
  r = RunCommand({coordinator, "--state_dir=" + dir + "/mismatch", "--listen=127.0.0.1:0",
                  "--metrics_address=127.0.0.1:0", "--tls_cert_file=" + server.cert, "--tls_key_file=" + client.key},
                 dir + "/mismatch");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_THAT(r.err,
              HasSubstr("--tls_key_file=" + client.key + " is not the private key of --tls_cert_file=" + server.cert));
  r = RunCommand(
      {coordinator, "--state_dir=" + dir + "/reload", "--listen=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
       "--tls_cert_file=" + server.cert, "--tls_key_file=" + server.key, "--tls_reload_s=0"},
      dir + "/reload");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--tls_reload_s: expected seconds from 1 to 86400, got '0'"));
  // A client's mismatched pair: exit 2 naming both.
  r = RunCommand({"client/plateauctl", "--coordinator=127.0.0.1:1", "--tls_ca_file=" + server.cert,
                  "--tls_client_cert_file=" + client.cert, "--tls_client_key_file=" + server.key, "list"},
                 dir + "/client-mismatch");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--tls_client_key_file=" + server.key + " is not the private key of"));
  std::unique_ptr<Process> any;
  const std::string any_api =
      StartCoordinator(dir, "any",
                       {"--listen=0.0.0.0:0", "--tls_cert_file=" + server.cert, "--tls_key_file=" + server.key,
                        "--tls_client_ca_file=" + client_ca.cert},
                       &any);
  ASSERT_FALSE(any_api.empty()) << any->err();
  EXPECT_THAT(any->err(), ::testing::Not(HasSubstr("WARNING")));
  ClientOptions co;
  co.connection.address = any_api;
  co.connection.files.tls_ca_file = server.cert;
  co.connection.files.tls_client_cert_file = client.cert;
  co.connection.files.tls_client_key_file = client.key;
  auto list = Client(co).ListJobs(v1::ListJobsRequest());
  EXPECT_TRUE(list.ok()) << list.status();

  // Token and client certificates together: each is required, the
  // certificate does not stand in for the token.
  const std::string token = WriteFile(dir + "/token", "tok-mtls-both\n");
  std::unique_ptr<Process> both;
  co.connection.address =
      StartCoordinator(dir, "both",
                       {"--listen=127.0.0.1:0", "--token_file=" + token, "--tls_cert_file=" + server.cert,
                        "--tls_key_file=" + server.key, "--tls_client_ca_file=" + client_ca.cert},
                       &both);
  ASSERT_FALSE(co.connection.address.empty()) << both->err();
  EXPECT_THAT(both->out(), HasSubstr("(TLS, client certificate required, bearer token required)"));
  list = Client(co).ListJobs(v1::ListJobsRequest());
  EXPECT_EQ(list.status().code(), absl::StatusCode::kUnauthenticated) << list.status();
  co.connection.files.token_file = token;
  list = Client(co).ListJobs(v1::ListJobsRequest());
  EXPECT_TRUE(list.ok()) << list.status();
  co.connection.files.tls_client_cert_file = co.connection.files.tls_client_key_file = "";
  list = Client(co).ListJobs(v1::ListJobsRequest());
  EXPECT_EQ(list.status().code(), absl::StatusCode::kUnavailable) << list.status();
}

TEST(SecurityTest, NonLoopbackListenNeedsATokenOrInsecureListenAny) {
  const std::string dir = TempDir("listen_any");
  const Tokens t = WriteTokens(dir);
  const std::string coordinator = "server/plateau_coordinator";

  Ran r = RunCommand({coordinator, "--state_dir=" + dir + "/refused", "--listen=0.0.0.0:0",
                      "--metrics_address=127.0.0.1:0"},
                     dir + "/refused");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, AllOf(HasSubstr("--listen=0.0.0.0:0 is not a loopback address"), HasSubstr("--token_file"),
                           HasSubstr("--insecure_listen_any")));
  EXPECT_FALSE(std::filesystem::exists(dir + "/refused")) << "refused before anything was created";
  r = RunCommand({coordinator, "--state_dir=" + dir + "/refused6", "--listen=[::]:0", "--metrics_address=127.0.0.1:0"},
                 dir + "/refused6");
  EXPECT_EQ(r.code, 2) << r.err;

  // Bad security flags: exit 2, naming the flag. Port 0 everywhere: a
  // coordinator that wrongly started would otherwise take the fixed
  // defaults (7070, 9464) from whatever else runs on this machine.
  const std::string empty = WriteFile(dir + "/empty-token", "\n");
  for (const auto& [flag, expected] : std::vector<std::pair<std::string, std::string>>{
           {"--token_file=" + empty, "--token_file=" + empty + ": the file is empty"},
           {"--tls_cert_file=" + t.right, "--tls_key_file is missing"},
           {"--max_request_bytes=1000", "--max_request_bytes: expected an integer from 1048576"},
           {"--max_watches_per_client=-1", "--max_watches_per_client: expected an integer >= 0"},
           {"--watch_heartbeat_s=-1", "--watch_heartbeat_s: expected seconds from 0 (no heartbeat) to 3600"},
           {"--insecure_listen_any=maybe", "--insecure_listen_any: expected true or false"},
           {"--token_file=" + t.right + " --worker_token_file=" + t.right,
            "--worker_token_file: a token of it is also in --token_file"}}) {
    std::vector<std::string> argv = {coordinator, "--state_dir=" + dir + "/bad", "--listen=127.0.0.1:0",
                                     "--metrics_address=127.0.0.1:0"};
    for (absl::string_view f : absl::StrSplit(flag, ' ')) argv.emplace_back(f);
    r = RunCommand(argv, dir + "/bad");
    EXPECT_EQ(r.code, 2) << flag << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(expected)) << flag;
  }
  r = RunCommand({coordinator, "--state_dir=" + dir + "/badpem", "--listen=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
                  "--tls_cert_file=" + t.right, "--tls_key_file=" + t.right},
                 dir + "/badpem");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("--tls_cert_file=" + t.right + ": expected a PEM file"));

  // --insecure_listen_any: it serves everyone, says so, and has reflection.
  std::unique_ptr<Process> open;
  const std::string open_api = StartCoordinator(dir, "open", {"--listen=0.0.0.0:0", "--insecure_listen_any"}, &open);
  ASSERT_FALSE(open_api.empty()) << open->err();
  EXPECT_THAT(open->err(), HasSubstr("WARNING: --insecure_listen_any"));
  auto list = Client(open_api).ListJobs(v1::ListJobsRequest());
  EXPECT_TRUE(list.ok()) << list.status();
  EXPECT_NE(Reflection(Channel(open_api)).error_code(), grpc::StatusCode::UNIMPLEMENTED)
      << "reflection is on without a token (so the check in the auth test can fail)";
  open->Stop();

  // A token without TLS beyond loopback: it serves, warning about plaintext.
  std::unique_ptr<Process> tokened;
  const std::string api = StartCoordinator(dir, "tokened", {"--listen=0.0.0.0:0", "--token_file=" + t.right},
                                           &tokened);
  ASSERT_FALSE(api.empty()) << tokened->err();
  EXPECT_THAT(tokened->err(), HasSubstr("TLS is off"));
  ClientOptions co;
  co.connection.address = api;
  co.connection.files.token_file = t.right;
  EXPECT_TRUE(Client(co).ListJobs(v1::ListJobsRequest()).ok());
  EXPECT_EQ(Client(api).ListJobs(v1::ListJobsRequest()).status().code(), absl::StatusCode::kUnauthenticated);
  // plateauctl sending the token there in plaintext says so (so does the
  // agent); to a loopback address it does not.
  const std::string port = api.substr(api.rfind(':') + 1);
  // (0.0.0.0 reaches this host's listener, and is no loopback address.)
  const std::string any = "0.0.0.0:" + port;
  r = RunCommand({"client/plateauctl", "--coordinator=" + any, "--token_file=" + t.right, "list"}, dir + "/ctl-plain");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("plateauctl: WARNING: --coordinator=" + any +
                               " is not loopback and TLS is off (no --tls_ca_file): the bearer token"));
  r = RunCommand({"client/plateauctl", "--coordinator=127.0.0.1:" + port, "--token_file=" + t.right, "list"},
                 dir + "/ctl-loopback");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("WARNING")));
}

TEST(SecurityTest, OversizedRequestIsResourceExhaustedAndAbsurdFieldsAreInvalid) {
  ClusterOptions o;
  o.with_worker = false;
  o.coordinator_flags = {"--max_request_bytes=1048576"};
  Cluster c("oversized", o);
  ASSERT_TRUE(c.ready()) << c.Logs();

  v1::JobSpec huge = TinyJob(3);
  huge.set_name(std::string(1100 * 1024, 'n'));
  auto sub = c.client().SubmitJob(huge, false);
  EXPECT_EQ(sub.status().code(), absl::StatusCode::kResourceExhausted) << sub.status();
  EXPECT_THAT(sub.status().message(), HasSubstr("--max_request_bytes"));
  // The internal service has the same limit.
  auto workers = v1::WorkerService::NewStub(Channel(c.api()));
  {
    grpc::ClientContext ctx;
    Deadline(ctx);
    v1::KvSetRequest q;
    q.set_key("big");
    q.set_value(std::string(2 << 20, 'v'));
    v1::KvSetResponse r;
    EXPECT_EQ(workers->KvSet(&ctx, q, &r).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  // Under the size limit, but strings nobody needs (worker/job_spec.cc).
  v1::JobSpec named = TinyJob(3);
  named.set_name(std::string(257, 'n'));
  sub = c.client().SubmitJob(named, false);
  EXPECT_EQ(sub.status().code(), absl::StatusCode::kInvalidArgument) << sub.status();
  EXPECT_THAT(sub.status().message(), HasSubstr("name: expected at most 256 bytes, got 257 bytes"));
  named.set_name(std::string(256, 'n'));
  named.mutable_checkpoint()->set_directory("/" + std::string(5000, 'd'));
  sub = c.client().SubmitJob(named, true);
  EXPECT_EQ(sub.status().code(), absl::StatusCode::kInvalidArgument) << sub.status();
  EXPECT_THAT(sub.status().message(), HasSubstr("checkpoint.directory: expected a path of at most 4096 bytes"));
  // The coordinator is unharmed and takes a normal job.
  named.clear_checkpoint();
  sub = c.client().SubmitJob(named, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  EXPECT_EQ(sub->job().id(), "job-1");
}

// The third watch of a host with --max_watches_per_client=2 is refused
// RESOURCE_EXHAUSTED; a place frees when one ends. The refusal is for now:
// plateauctl retries it with backoff (saying so once) and gets in when a
// place frees, then watches the job to its end (exit 3, CANCELLED), as the
// Python client does (python_client_test); not exit 8 at once.
TEST(SecurityTest, WatchLimitPerClientRefusesTheThirdAndReleasesWhenOneEnds) {
  ClusterOptions o;
  o.with_worker = false;  // the jobs stay PENDING: their watches stay open
  o.coordinator_flags = {"--max_watches_per_client=2"};
  // The test's own client gives a refused stream up after 2 s (60 s by
  // default, as plateauctl).
  o.client.reconnect_for = absl::Seconds(2);
  Cluster c("watches", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(3), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  auto stub = v1::JobService::NewStub(Channel(c.api()));
  // True once the server sent the first event: the watch is held there.
  auto open = [&](Watch* w, const std::string& job) {
    v1::WatchJobRequest q;
    q.set_job_id(job);
    w->reader = stub->WatchJob(&w->ctx, q);
    v1::JobEvent e;
    return w->reader->Read(&e);
  };
  Watch a, b;
  ASSERT_TRUE(open(&a, id));
  ASSERT_TRUE(open(&b, id));
  {
    Watch third;
    ASSERT_FALSE(open(&third, id));
    grpc::Status s = third.reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_THAT(s.error_message(), AllOf(HasSubstr("127.0.0.1"), HasSubstr("at most 2"),
                                         HasSubstr("--max_watches_per_client"), HasSubstr("retry with backoff")));
  }
  {
    // GetJobLogs counts too, with follow or without (a client that stops
    // reading a long log holds a server thread as long as a follow).
    Watch logs;
    Deadline(logs.ctx, absl::Seconds(20));
    v1::GetJobLogsRequest q;
    q.set_job_id(id);
    q.set_follow(true);
    grpc::Status s = Drain(stub->GetJobLogs(&logs.ctx, q).get());
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    // The client library retries it for its reconnect window, then fails.
    const absl::Status once = c.client().GetJobLogs(id, false, 0, [](const v1::LogEntry&) { return true; });
    EXPECT_TRUE(absl::IsResourceExhausted(once)) << once;
  }

  // plateauctl's third watch: refused for now, retried.
  Process ctl({"client/plateauctl", "--coordinator=" + c.api(), "watch", id}, c.dir() + "/ctl-watch");
  ASSERT_TRUE(ctl.spawn_error().empty()) << ctl.spawn_error();
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(ctl.err(), "--max_watches_per_client"); })) << ctl.err();
  EXPECT_THAT(ctl.err(), HasSubstr("the coordinator refused the stream for now"));
  EXPECT_THAT(ctl.err(), HasSubstr("retrying with backoff"));
  absl::SleepFor(absl::Seconds(1));
  EXPECT_TRUE(ctl.Running()) << "gave up at the refusal: " << ctl.err();
  // The client ends one: its count is released (the server notices within
  // its wakeup interval), and plateauctl's retry takes the place.
  a.ctx.TryCancel();
  EXPECT_EQ(a.reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(ctl.out(), id + " PENDING"); }, absl::Seconds(60)))
      << ctl.out() << ctl.err();
  // Both places taken again (b and plateauctl's): refused. Then b ends, and
  // a new watch is accepted.
  {
    Watch fourth;
    ASSERT_FALSE(open(&fourth, id));
    EXPECT_EQ(fourth.reader->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  b.ctx.TryCancel();
  EXPECT_EQ(b.reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  std::unique_ptr<Watch> d;
  EXPECT_TRUE(WaitFor([&] {
    d = std::make_unique<Watch>();
    if (open(d.get(), id)) return true;
    d->reader->Finish();
    return false;
  }, absl::Seconds(20)));

  // The job ends: both watches end by themselves, and release their counts
  // before their status reaches the client; plateauctl's with the job's
  // outcome.
  ASSERT_TRUE(c.client().CancelJob(id).ok());
  EXPECT_TRUE(Drain(d->reader.get()).ok());
  ASSERT_TRUE(WaitFor([&] { return !ctl.Running(); })) << ctl.err();
  const int status = ctl.Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << status << ctl.out() << ctl.err();
  EXPECT_THAT(ctl.out(), HasSubstr("summary: " + id + " CANCELLED"));
  auto next = c.client().SubmitJob(TinyJob(3), false);
  ASSERT_TRUE(next.ok());
  Watch e, f;
  EXPECT_TRUE(open(&e, next->job().id()));
  EXPECT_TRUE(open(&f, next->job().id()));
  e.ctx.TryCancel();
  f.ctx.TryCancel();
  e.reader->Finish();
  f.reader->Finish();
}

}  // namespace
}  // namespace plateau
