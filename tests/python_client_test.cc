// client/python/plateau_client_example.py against a real coordinator and
// worker (tests/cluster.h): Debian's python3 with python3-grpcio and the
// stubs //client/python:plateau_v1_py generated from proto/, through the
// public API only. What it prints is checked against the job's own events
// read through the C++ client.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "plateau/v1/job.grpc.pb.h"
#include "proto/does_not_fit.h"
#include "tests/certificates.h"
#include "tests/cluster.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

using namespace testing_cluster;  // NOLINT: the harness is this file's vocabulary

// Debian's interpreter by absolute path: python3-grpcio and python3-protobuf
// are installed for it alone, and the first python3 on a developer's PATH
// may be a pyenv or virtualenv one without them.
constexpr char kPython[] = "/usr/bin/python3";
constexpr char kExample[] = "client/python/plateau_client_example.py";

class PythonClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(access(kPython, X_OK), 0) << kPython << " is missing: install Debian's python3 (deploy/install-deps.sh)";
    // The generated package sits beside the example in the runfiles; the
    // script's own directory would be its source directory (Python resolves
    // the symlink), so the path is given as a user would give bazel-bin's.
    setenv("PYTHONPATH", (std::filesystem::current_path() / "client/python").c_str(), 1);
    // Runfiles are not the place for __pycache__.
    setenv("PYTHONDONTWRITEBYTECODE", "1", 1);
  }

  std::string WriteSpec(const Cluster& c, const std::string& name, const v1::JobSpec& spec) {
    std::string text;
    google::protobuf::TextFormat::PrintToString(spec, &text);
    const std::string path = c.dir() + "/" + name + ".txtpb";
    std::ofstream(path) << text;
    return path;
  }

  Ran Example(const Cluster& c, const std::string& log, std::vector<std::string> args) {
    std::vector<std::string> argv = {kPython, kExample, "--coordinator=" + c.api()};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunCommand(argv, c.dir() + "/" + log);
  }
};

// How many times `what` occurs in `text`.
int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

// "job-1 step 3/5 loss 2.49... slowest_rank 1" lines: step -> loss.
std::map<int64_t, double> PrintedSteps(const std::string& out, const std::string& id) {
  std::map<int64_t, double> steps;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    std::vector<std::string> w = absl::StrSplit(line, ' ');
    if (w.size() != 7 || w[0] != id || w[1] != "step" || w[3] != "loss" || w[5] != "slowest_rank") continue;
    int64_t step = 0;
    double loss = 0;
    std::vector<std::string> of = absl::StrSplit(w[2], '/');
    if (absl::SimpleAtoi(of[0], &step) && absl::SimpleAtod(w[4], &loss)) steps[step] = loss;
  }
  return steps;
}

// The states of the "<id> state X: reason" lines, in order, a repeat of the
// previous state counted once: the coordinator sends a new event when only
// the reason changes (PENDING "waiting to be scheduled", then PENDING "no
// worker is registered" when the submit beat the worker's registration).
std::vector<std::string> PrintedStates(const std::string& out, const std::string& id) {
  std::vector<std::string> states;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    std::vector<std::string> w = absl::StrSplit(line, absl::MaxSplits(' ', 2));
    if (w.size() >= 3 && w[0] == id && w[1] == "state") {
      std::string state = w[2].substr(0, w[2].find(':'));  // before ": reason"
      if (states.empty() || states.back() != state) states.push_back(std::move(state));
    }
  }
  return states;
}

TEST_F(PythonClientTest, SubmitsAndWatchesToSucceededPrintingEveryStepsLoss) {
  Cluster c("py-succeed");
  ASSERT_TRUE(c.ready()) << c.Logs();
  const std::string spec = WriteSpec(c, "tiny", TinyJob(100));
  // --steps replaces the file's 100: the spec is the script's to edit.
  Ran r = Example(c, "succeed", {"--spec=" + spec, "--steps=5"});
  ASSERT_EQ(r.code, 0) << r.out << r.err << c.Logs();
  EXPECT_THAT(r.out, HasSubstr("submitted job-1: "));
  EXPECT_THAT(r.out, HasSubstr("job-1 ended SUCCEEDED"));
  const std::vector<std::string> states = PrintedStates(r.out, "job-1");
  EXPECT_EQ(states, (std::vector<std::string>{"PENDING", "SCHEDULED", "RUNNING", "SUCCEEDED"})) << r.out;

  // Every step of the job (one event each), with its loss read back
  // exactly (the script prints Python's round-tripping repr).
  std::map<int64_t, double> reported;
  ASSERT_TRUE(c.client().WatchJob("job-1", 0, [&](const v1::JobEvent& e) {
    if (e.has_job_step()) reported[e.job_step().step()] = e.job_step().loss();
    return true;
  }).ok());
  ASSERT_EQ(reported.size(), 5u);
  EXPECT_EQ(PrintedSteps(r.out, "job-1"), reported) << r.out;
  EXPECT_THAT(r.out, HasSubstr("job-1 step 5/5 loss "));

  auto job = c.client().GetJob("job-1");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::SUCCEEDED);
  EXPECT_EQ(job->spec().steps(), 5);
}

// The script in the background, its output read as it runs.
struct Running {
  std::unique_ptr<Process> process;
  // Waits for it to exit (at most `limit`); its exit code, -1 if killed.
  int Wait(absl::Duration limit) {
    const absl::Time end = absl::Now() + limit;
    while (process->Running() && absl::Now() < end) absl::SleepFor(absl::Milliseconds(50));
    const int status = process->Stop(SIGKILL);  // reaps it; kills it only if still running
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
};

// A coordinator away for 8 s (killed, restarted on its port): the watch
// resumes and prints every step once (it gave up after five tries, about
// 5 s, exiting 4 while the job ran on). A frozen coordinator (no reset,
// no answer) breaks the watch by keepalive, and after --reconnect-for the
// script exits 4 (it waited for ever).
TEST_F(PythonClientTest, AWatchOutlastsACoordinatorRestartAndEndsOnAFrozenOne) {
  Cluster c("py-restart");
  ASSERT_TRUE(c.ready()) << c.Logs();
  const std::string spec = WriteSpec(c, "tiny", TinyJob(40));
  Running run{std::make_unique<Process>(
      std::vector<std::string>{kPython, kExample, "--coordinator=" + c.api(), "--spec=" + spec}, c.dir() + "/restart")};
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(run.process->out(), "job-1 step 2/40"); }, absl::Seconds(60)))
      << run.process->out() << run.process->err() << c.Logs();
  c.KillCoordinator(SIGKILL);
  absl::SleepFor(absl::Seconds(8));
  ASSERT_TRUE(c.RestartCoordinator()) << c.Logs();
  const int code = run.Wait(absl::Seconds(120));
  const std::string out = run.process->out();
  EXPECT_EQ(code, 0) << out << run.process->err() << c.Logs();
  EXPECT_THAT(run.process->err(), HasSubstr("watch interrupted")) << "a retry is said on stderr";
  EXPECT_THAT(out, ::testing::Not(HasSubstr("watch interrupted"))) << "stdout is the job's events";
  EXPECT_THAT(out, HasSubstr("job-1 ended SUCCEEDED"));
  const std::map<int64_t, double> steps = PrintedSteps(out, "job-1");
  EXPECT_EQ(steps.size(), 40u) << out;
  for (int64_t s = 1; s <= 40; ++s) {
    EXPECT_TRUE(absl::StrContains(out, absl::StrCat("job-1 step ", s, "/40 loss "))) << "step " << s;
  }
  int printed = 0;
  for (absl::string_view line : absl::StrSplit(out, '\n')) printed += absl::StartsWith(line, "job-1 step ");
  EXPECT_EQ(printed, 40) << "a step printed twice or missed:\n" << out;

  // Frozen: keepalive 1 s, reconnect for 3 s.
  const std::string long_spec = WriteSpec(c, "long", TinyJob(1000000));
  Running frozen{
      std::make_unique<Process>(std::vector<std::string>{kPython, kExample, "--coordinator=" + c.api(),
                                                         "--spec=" + long_spec, "--keepalive=1", "--reconnect-for=3"},
                                c.dir() + "/frozen")};
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(frozen.process->out(), "job-2 step 2/"); }, absl::Seconds(60)))
      << frozen.process->out() << frozen.process->err() << c.Logs();
  const pid_t coordinator = c.coordinator()->pid();
  ASSERT_EQ(kill(coordinator, SIGSTOP), 0);
  const absl::Time stopped = absl::Now();
  const int frozen_code = frozen.Wait(absl::Seconds(60));
  const absl::Duration took = absl::Now() - stopped;
  ASSERT_EQ(kill(coordinator, SIGCONT), 0);
  EXPECT_EQ(frozen_code, 4) << frozen.process->out() << frozen.process->err();
  EXPECT_LT(took, absl::Seconds(45)) << "the script waited on the frozen coordinator";
  EXPECT_THAT(frozen.process->err(), HasSubstr("watching job-2"));
  std::printf("the Python watch ended %s after the coordinator froze (keepalive 1 s, reconnect-for 3 s)\n",
              absl::FormatDuration(took).c_str());
  // The thawed coordinator answers again (the job may have failed meanwhile:
  // its worker's heartbeats went unanswered while it was frozen).
  EXPECT_TRUE(WaitFor([&] { return c.client().GetJob("job-2").ok(); })) << c.Logs();
  c.client().CancelJob("job-2").IgnoreError();
}

TEST_F(PythonClientTest, CancelsAfterAStepAndTheJobEndsCancelled) {
  Cluster c("py-cancel");
  ASSERT_TRUE(c.ready()) << c.Logs();
  const std::string spec = WriteSpec(c, "long", TinyJob(1000000));
  Ran r = Example(c, "cancel", {"--spec=" + spec, "--cancel-after-step=2"});
  EXPECT_EQ(r.code, 3) << r.out << r.err << c.Logs();
  EXPECT_THAT(r.out, HasSubstr("job-1 cancelling after step 2\n"));
  EXPECT_THAT(r.out, HasSubstr("job-1 ended CANCELLED"));
  const std::vector<std::string> states = PrintedStates(r.out, "job-1");
  ASSERT_GE(states.size(), 2u) << r.out;
  EXPECT_EQ(states[states.size() - 2], "CANCELLING") << r.out;
  EXPECT_EQ(states.back(), "CANCELLED") << r.out;
  // The cancel was sent after the job's step 2 and before the job ended:
  // steps 1 and 2 were printed before it.
  const size_t cancel_at = r.out.find("cancelling after step");
  EXPECT_LT(r.out.find("job-1 step 2/1000000 loss "), cancel_at) << r.out;

  auto job = c.client().GetJob("job-1");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::CANCELLED) << job->DebugString();
  EXPECT_GE(job->progress().step(), 2);
  EXPECT_LT(job->progress().step(), 1000000);
  EXPECT_TRUE(c.RankPids("job-1").empty());
}

TEST_F(PythonClientTest, RefusedSpecsAndAnAbsentCoordinatorAreClearErrors) {
  ClusterOptions no_worker;
  no_worker.with_worker = false;
  Cluster c("py-errors", no_worker);
  ASSERT_TRUE(c.ready()) << c.Logs();
  v1::JobSpec bad = TinyJob(5);
  bad.mutable_model()->set_heads(3);
  Ran r = Example(c, "invalid", {"--spec=" + WriteSpec(c, "invalid", bad)});
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("submit refused: INVALID_ARGUMENT model.heads"));

  // A plan over its cap: the refusal's DoesNotFit, read from the trailer's
  // google.rpc.Status, is plateauctl's exit 5.
  v1::JobSpec big = TinyJob(5);
  big.mutable_schedule()->mutable_standard_ep();
  auto plan = c.client().PlanJob(big);
  ASSERT_TRUE(plan.ok()) << plan.status();
  big.set_device_memory_bytes(plan->plan().total_bytes() - 1);
  r = Example(c, "nofit", {"--spec=" + WriteSpec(c, "nofit", big)});
  EXPECT_EQ(r.code, 5) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("submit refused: RESOURCE_EXHAUSTED device_memory_bytes: the plan does not fit"));

  std::ofstream(c.dir() + "/garbled.txtpb") << "model { heads: \"four\" }\n";
  r = Example(c, "garbled", {"--spec=" + c.dir() + "/garbled.txtpb"});
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("not a text-format plateau.v1.JobSpec"));

  // Nothing listens there (the port is held, so no other test takes it).
  const RefusedAddress refused;
  const std::string dead = refused.address();
  ASSERT_FALSE(dead.empty());
  r = RunCommand({kPython, kExample, "--coordinator=" + dead, "--connect-timeout=1", "--spec=" + WriteSpec(c, "ok", TinyJob(5))},
                 c.dir() + "/dead");
  EXPECT_EQ(r.code, 4) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("cannot reach the coordinator at " + dead));
  // None of these created a job.
  auto list = c.client().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->jobs_size(), 0);
}

// The standard Python reading of a typed refusal: a submit that does not
// fit, its grpc-status-details-bin trailer through
// grpc_status.rpc_status.from_call (which raised ValueError on the bare
// DoesNotFit the coordinator used to send), a google.rpc.Status whose one
// detail unpacks to DoesNotFit. Needs the grpc_status package (pip's
// grpcio-status; Debian 12 has no package of it): skipped, saying so,
// where /usr/bin/python3 cannot import it.
TEST_F(PythonClientTest, ADoesNotFitRefusalReadsThroughGrpcStatusFromCall) {
  ClusterOptions no_worker;
  no_worker.with_worker = false;
  Cluster c("py-from-call", no_worker);
  ASSERT_TRUE(c.ready()) << c.Logs();
  Ran probe = RunCommand({kPython, "-c", "import grpc_status.rpc_status"}, c.dir() + "/probe");
  if (probe.code != 0) {
    GTEST_SKIP() << kPython << " cannot import grpc_status (pip's grpcio-status; not packaged by Debian 12), so "
                 << "from_call is not checked here (tests/bad_input_test checks the trailer against "
                    "google.rpc.Status in C++): "
                 << probe.err;
  }
  v1::JobSpec spec = TinyJob(5);
  spec.mutable_schedule()->mutable_standard_ep();
  auto plan = c.client().PlanJob(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  spec.set_device_memory_bytes(plan->plan().total_bytes() - 1);
  const std::string script = c.dir() + "/from_call.py";
  std::ofstream(script) << R"py(import sys
import grpc
from google.protobuf import text_format
from grpc_status import rpc_status
from plateau.v1 import job_pb2, job_pb2_grpc
spec = job_pb2.JobSpec()
text_format.Parse(open(sys.argv[2]).read(), spec)
stub = job_pb2_grpc.JobServiceStub(grpc.insecure_channel(sys.argv[1]))
try:
    stub.SubmitJob(job_pb2.SubmitJobRequest(spec=spec), timeout=30)
    sys.exit("accepted")
except grpc.RpcError as e:
    status = rpc_status.from_call(e)
    print("code", status.code, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
    print("details", len(status.details))
    d = job_pb2.DoesNotFit()
    print("unpacked", status.details[0].type_url, status.details[0].Unpack(d), d.cap)
)py";
  Ran r = RunCommand({kPython, script, c.api(), WriteSpec(c, "no-fit", spec)}, c.dir() + "/from_call");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("code 8 8\n"));
  EXPECT_THAT(r.out, HasSubstr("details 1\n"));
  EXPECT_THAT(r.out, HasSubstr("unpacked type.googleapis.com/plateau.v1.DoesNotFit True device_memory_bytes\n"));
}

// A JobService that fails as told, for the failures a real coordinator
// cannot be made to give on cue (INTERNAL, DATA_LOSS, a cancel that is not
// answered, a job deleted mid-watch). Its job is "job-1": RUNNING, steps 1
// to 3, then SUCCEEDED; or, with wait_for_cancel, CANCELLED once a cancel
// is accepted (SUCCEEDED if none is within 15 s: the job ran on).
class ScriptedService final : public v1::JobService::Service {
 public:
  std::mutex mu;
  std::deque<grpc::Status> submit_errors, cancel_errors;  // answered first, in order
  grpc::Status watch_end = grpc::Status::OK;              // not OK: the watch ends so after step 3
  bool wait_for_cancel = false;
  // A heartbeat (JobEvent.heartbeat, indexed as the last event sent) before
  // every event, and the first watch broken (UNAVAILABLE) after step 2's;
  // as the coordinator, only to a watch that asks (WatchJobRequest.heartbeats).
  bool heartbeats = false;
  std::vector<int64_t> watch_froms;  // of every watch
  std::vector<bool> watch_asked_heartbeats;  // of every watch
  std::vector<absl::Time> watch_times;
  std::deque<grpc::Status> watch_refusals;  // answered first to watches, in order, before any event
  std::vector<std::string> request_ids;  // of every submit
  std::vector<absl::Time> submit_times;
  int cancels = 0;  // calls, answered or not
  bool cancelled = false;

  grpc::Status SubmitJob(grpc::ServerContext*, const v1::SubmitJobRequest* req, v1::SubmitJobResponse* resp) override {
    std::lock_guard<std::mutex> l(mu);
    request_ids.push_back(req->request_id());
    submit_times.push_back(absl::Now());
    if (!submit_errors.empty()) {
      grpc::Status s = submit_errors.front();
      submit_errors.pop_front();
      return s;
    }
    resp->mutable_job()->set_id("job-1");
    return grpc::Status::OK;
  }

  grpc::Status CancelJob(grpc::ServerContext*, const v1::CancelJobRequest*, v1::Job* resp) override {
    std::lock_guard<std::mutex> l(mu);
    ++cancels;
    if (!cancel_errors.empty()) {
      grpc::Status s = cancel_errors.front();
      cancel_errors.pop_front();
      return s;
    }
    cancelled = true;
    resp->set_id("job-1");
    resp->set_state(v1::CANCELLING);
    return grpc::Status::OK;
  }

  // The job as a swept one reads: SUCCEEDED (what a watch refused
  // FAILED_PRECONDITION falls back on).
  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest*, v1::Job* resp) override {
    resp->set_id("job-1");
    resp->set_state(v1::SUCCEEDED);
    return grpc::Status::OK;
  }

  grpc::Status WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                        grpc::ServerWriter<v1::JobEvent>* writer) override {
    const int64_t total = wait_for_cancel ? 1000 : 3;
    size_t watches = 0;
    {
      std::lock_guard<std::mutex> l(mu);
      watch_froms.push_back(req->from_index());
      watch_asked_heartbeats.push_back(req->heartbeats());
      watch_times.push_back(absl::Now());
      if (!watch_refusals.empty()) {
        grpc::Status s = watch_refusals.front();
        watch_refusals.pop_front();
        return s;
      }
      watches = watch_froms.size();
    }
    const bool beats = heartbeats && req->heartbeats();
    int64_t last = req->from_index() - 1;  // what a heartbeat is indexed as
    auto send = [&](int64_t index, const std::function<void(v1::JobEvent*)>& fill) {
      if (index < req->from_index()) return true;
      if (beats) {
        v1::JobEvent beat;
        beat.set_job_id("job-1");
        beat.set_index(last);
        beat.mutable_heartbeat();
        if (!writer->Write(beat)) return false;
      }
      v1::JobEvent e;
      e.set_job_id("job-1");
      e.set_index(index);
      fill(&e);
      last = index;
      return writer->Write(e);
    };
    auto state = [](v1::JobState s) { return [s](v1::JobEvent* e) { e->mutable_state_change()->set_state(s); }; };
    if (!send(0, state(v1::RUNNING))) return grpc::Status::CANCELLED;
    for (int64_t step = 1; step <= 3; ++step) {
      if (!send(step, [&](v1::JobEvent* e) {
            e->mutable_job_step()->set_step(step);
            e->mutable_job_step()->set_total_steps(total);
            e->mutable_job_step()->set_loss(2.5);
          })) {
        return grpc::Status::CANCELLED;
      }
      if (beats && watches == 1 && step == 2) {
        v1::JobEvent beat;
        beat.set_job_id("job-1");
        beat.set_index(last);
        beat.mutable_heartbeat();
        writer->Write(beat);
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "Connection reset by peer");
      }
    }
    if (!watch_end.ok()) return watch_end;
    bool was_cancelled = false;
    if (wait_for_cancel) {
      const absl::Time end = absl::Now() + absl::Seconds(15);
      while (!ctx->IsCancelled() && absl::Now() < end) {
        {
          std::lock_guard<std::mutex> l(mu);
          if ((was_cancelled = cancelled)) break;
        }
        absl::SleepFor(absl::Milliseconds(20));
      }
    }
    send(4, state(was_cancelled ? v1::CANCELLED : v1::SUCCEEDED));
    return grpc::Status::OK;
  }
};

class ScriptedCoordinator {
 public:
  ScriptedCoordinator() {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    if (server_ != nullptr && port > 0) address_ = absl::StrCat("127.0.0.1:", port);
  }
  ~ScriptedCoordinator() {
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }
  ScriptedService& service() { return service_; }
  const std::string& address() const { return address_; }

 private:
  ScriptedService service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

class PythonClientFailureTest : public PythonClientTest {
 protected:
  void SetUp() override {
    PythonClientTest::SetUp();
    dir_ = TempDir("py_scripted");
    std::string text;
    google::protobuf::TextFormat::PrintToString(TinyJob(3), &text);
    spec_ = dir_ + "/tiny.txtpb";
    std::ofstream(spec_) << text;
  }
  Ran Run(const ScriptedCoordinator& at, const std::string& log, std::vector<std::string> args = {}) {
    std::vector<std::string> argv = {kPython, kExample, "--coordinator=" + at.address(), "--spec=" + spec_};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunCommand(argv, dir_ + "/" + log);
  }
  std::string dir_, spec_;
};

// A submit's failure exits as plateauctl's would (client/plateauctl.cc's
// table): the coordinator's faults 8 (they were all 2, "fix your
// request"), NOT_FOUND 6, a refusal 2, a DoesNotFit 5.
TEST_F(PythonClientFailureTest, SubmitFailuresExitAsPlateauctlDoes) {
  const grpc::Status does_not_fit(
      grpc::StatusCode::RESOURCE_EXHAUSTED, "device_memory_bytes: short by 1 bytes",
      GrpcStatusDetails(DoesNotFitError("device_memory_bytes", "device_memory_bytes: short by 1 bytes")));
  const struct {
    grpc::Status status;
    int exit;
    std::string says;
  } cases[] = {
      {grpc::Status(grpc::StatusCode::INTERNAL, "store write failed"), 8,
       "submit failed on the coordinator's side (it may succeed later): INTERNAL store write failed"},
      {grpc::Status(grpc::StatusCode::UNKNOWN, "handler threw"), 8, "UNKNOWN handler threw"},
      {grpc::Status(grpc::StatusCode::ABORTED, "conflict"), 8, "ABORTED conflict"},
      {grpc::Status(grpc::StatusCode::DATA_LOSS, "torn row"), 8, "DATA_LOSS torn row"},
      {grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "too many open watches"), 8,
       "RESOURCE_EXHAUSTED too many open watches"},
      {grpc::Status(grpc::StatusCode::NOT_FOUND, "no such thing"), 6, "submit refused: NOT_FOUND no such thing"},
      {grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "not yours"), 2,
       "submit refused: PERMISSION_DENIED not yours"},
      {does_not_fit, 5, "submit refused: RESOURCE_EXHAUSTED device_memory_bytes: short by 1 bytes"},
  };
  for (const auto& c : cases) {
    ScriptedCoordinator at;
    ASSERT_FALSE(at.address().empty());
    at.service().submit_errors = {c.status};
    const std::string name = absl::StrCat("submit-", c.status.error_code());
    Ran r = Run(at, name);
    EXPECT_EQ(r.code, c.exit) << c.says << "\n" << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.says));
    EXPECT_EQ(at.service().request_ids.size(), 1u) << c.says << ": a refusal is not sent again";
  }
}

// CANCELLED (a coordinator shutting down cancels the calls in flight) is
// sent again with the same request id, after a backoff's wait (not 1 s);
// a coordinator that never answers is exit 4 after the retries.
TEST_F(PythonClientFailureTest, ACancelledSubmitIsSentAgainWithBackoff) {
  ScriptedCoordinator at;
  ASSERT_FALSE(at.address().empty());
  const grpc::Status cancelled(grpc::StatusCode::CANCELLED, "Cancelled");
  at.service().submit_errors = {cancelled, cancelled};
  Ran r = Run(at, "cancelled-twice", {"--request-id=py-again-1"});
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("job-1 ended SUCCEEDED"));
  EXPECT_THAT(r.err, HasSubstr("submit not answered (CANCELLED Cancelled); retrying in "));
  ASSERT_EQ(at.service().request_ids.size(), 3u) << r.err;
  for (const std::string& id : at.service().request_ids) EXPECT_EQ(id, "py-again-1");
  // The first wait is 0.25-0.5 s (0.5 s with jitter), the second 0.5-1 s.
  const absl::Duration first = at.service().submit_times[1] - at.service().submit_times[0];
  const absl::Duration second = at.service().submit_times[2] - at.service().submit_times[1];
  EXPECT_GE(first, absl::Milliseconds(240));
  EXPECT_LT(first, absl::Milliseconds(900)) << "not a backoff's first wait";
  EXPECT_GE(second, absl::Milliseconds(490));
  EXPECT_LT(second, absl::Milliseconds(1500));

  ScriptedCoordinator away;
  ASSERT_FALSE(away.address().empty());
  away.service().submit_errors.assign(10, grpc::Status(grpc::StatusCode::UNAVAILABLE, "shutting down"));
  r = Run(away, "unavailable");
  EXPECT_EQ(r.code, 4) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("submit: the coordinator did not answer: UNAVAILABLE shutting down"));
  EXPECT_EQ(away.service().request_ids.size(), 5u) << r.err;
}

// A cancel that is not answered (UNAVAILABLE, DEADLINE_EXCEEDED) is sent
// again until it is: the job ends CANCELLED, exit 3. (It was given up at
// once: the job ran on to SUCCEEDED and the script exited 0.) One never
// answered within --reconnect-for is exit 4, saying the job may still run.
TEST_F(PythonClientFailureTest, ACancelNotAnsweredIsSentAgain) {
  ScriptedCoordinator at;
  ASSERT_FALSE(at.address().empty());
  at.service().wait_for_cancel = true;
  at.service().cancel_errors = {grpc::Status(grpc::StatusCode::UNAVAILABLE, "Connection reset by peer"),
                                grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "Deadline Exceeded")};
  Ran r = Run(at, "cancel-retried", {"--cancel-after-step=2"});
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("job-1 cancelling after step 2\n"));
  EXPECT_THAT(r.err, HasSubstr("job-1 cancel not answered (UNAVAILABLE Connection reset by peer); retrying in "));
  EXPECT_THAT(r.err, HasSubstr("job-1 cancel not answered (DEADLINE_EXCEEDED Deadline Exceeded); retrying in "));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("not answered"))) << "stdout is the job's events";
  EXPECT_THAT(r.out, HasSubstr("job-1 ended CANCELLED"));
  EXPECT_EQ(at.service().cancels, 3);

  ScriptedCoordinator never;
  ASSERT_FALSE(never.address().empty());
  never.service().wait_for_cancel = true;
  never.service().cancel_errors.assign(100, grpc::Status(grpc::StatusCode::UNAVAILABLE, "Socket closed"));
  r = Run(never, "cancel-unanswered", {"--cancel-after-step=2", "--reconnect-for=1"});
  EXPECT_EQ(r.code, 4) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("cancel of job-1: the coordinator did not answer for 1 s (UNAVAILABLE Socket closed); "
                               "the job may still be running"));
  EXPECT_GE(never.service().cancels, 2);
}

// A watch that ends NOT_FOUND (the job deleted) is exit 6 saying so, not
// "the coordinator cannot be reached" (4); one that ends INTERNAL is 8.
TEST_F(PythonClientFailureTest, AWatchEndedByNotFoundIsNotUnreachable) {
  ScriptedCoordinator at;
  ASSERT_FALSE(at.address().empty());
  at.service().watch_end = grpc::Status(grpc::StatusCode::NOT_FOUND, "job 'job-1' not found");
  Ran r = Run(at, "watch-not-found");
  EXPECT_EQ(r.code, 6) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("job-1 step 3/3 loss 2.5"));
  EXPECT_THAT(r.err, HasSubstr("watching job-1: the job is gone (deleted?): NOT_FOUND job 'job-1' not found"));

  ScriptedCoordinator faulty;
  ASSERT_FALSE(faulty.address().empty());
  faulty.service().watch_end = grpc::Status(grpc::StatusCode::INTERNAL, "store read failed");
  r = Run(faulty, "watch-internal");
  EXPECT_EQ(r.code, 8) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("watching job-1: INTERNAL store read failed"));

  // Events removed under the watch (the retention sweep, a delete): the
  // job's final state is all there is, and the exit says it.
  ScriptedCoordinator swept;
  ASSERT_FALSE(swept.address().empty());
  swept.service().watch_end =
      grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "job job-1's events from index 4 were removed");
  r = Run(swept, "watch-swept");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("job-1 job job-1's events from index 4 were removed"));
}

// The example asks for heartbeats (WatchJobRequest.heartbeats), and they
// print nothing and count as no event: every step and state once, and a
// stream broken after a heartbeat resumes from the event after the last
// real one (3), not from the heartbeat's.
TEST_F(PythonClientFailureTest, HeartbeatsPrintNothingAndMoveNoResumePoint) {
  ScriptedCoordinator at;
  ASSERT_FALSE(at.address().empty());
  at.service().heartbeats = true;
  Ran r = Run(at, "heartbeats");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_EQ(at.service().watch_froms, (std::vector<int64_t>{0, 3})) << r.out;
  EXPECT_EQ(at.service().watch_asked_heartbeats, (std::vector<bool>{true, true})) << r.out;
  EXPECT_EQ(PrintedSteps(r.out, "job-1"), (std::map<int64_t, double>{{1, 2.5}, {2, 2.5}, {3, 2.5}})) << r.out;
  EXPECT_EQ(PrintedStates(r.out, "job-1"), (std::vector<std::string>{"RUNNING", "SUCCEEDED"})) << r.out;
  EXPECT_THAT(r.err, HasSubstr("resuming from event 3\n"));
  // Nothing else: the submission, 2 states, 3 steps, the end (the break
  // is said on stderr).
  std::vector<std::string> lines = absl::StrSplit(r.out, '\n', absl::SkipEmpty());
  EXPECT_EQ(lines.size(), 7u) << r.out;
}

// The coordinator's limit of open watches per host (RESOURCE_EXHAUSTED
// "too many open watches") refuses a watch for now: it is opened again
// with backoff, as plateauctl does (security_test), saying so once on
// stderr (it printed a line on stdout at every try), and the job is
// watched to its end. Refused for the whole --reconnect-for, it is exit 8
// ("may succeed later"), as plateauctl's.
TEST_F(PythonClientFailureTest, AWatchRefusedForTheWatchLimitIsRetriedWithBackoff) {
  const grpc::Status refused(grpc::StatusCode::RESOURCE_EXHAUSTED,
                             "too many open watches from 127.0.0.1: 2 of at most 2 (the coordinator's "
                             "--max_watches_per_client) are open; retry with backoff: a place frees when one of "
                             "them ends");
  ScriptedCoordinator at;
  ASSERT_FALSE(at.address().empty());
  at.service().watch_refusals = {refused, refused};
  Ran r = Run(at, "watch-refused");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("job-1 watch refused for now (RESOURCE_EXHAUSTED too many open watches from "));
  EXPECT_EQ(Count(r.err, "watch refused for now"), 1) << "said once, not at every try:\n" << r.err;
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("refused"))) << "stdout is the job's events";
  EXPECT_THAT(r.out, HasSubstr("job-1 ended SUCCEEDED"));
  EXPECT_EQ(PrintedSteps(r.out, "job-1"), (std::map<int64_t, double>{{1, 2.5}, {2, 2.5}, {3, 2.5}})) << r.out;
  const std::vector<absl::Time> times = at.service().watch_times;
  ASSERT_EQ(times.size(), 3u) << r.out;
  // The first wait is 0.25-0.5 s, the second 0.5-1 s: a backoff.
  EXPECT_GE(times[1] - times[0], absl::Milliseconds(240));
  EXPECT_GE(times[2] - times[1], absl::Milliseconds(490));

  ScriptedCoordinator full;
  ASSERT_FALSE(full.address().empty());
  full.service().watch_refusals.assign(100, refused);
  r = Run(full, "watch-refused-for-good", {"--reconnect-for=1"});
  EXPECT_EQ(r.code, 8) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("watching job-1: RESOURCE_EXHAUSTED too many open watches from 127.0.0.1"));
  EXPECT_GE(full.service().watch_times.size(), 2u) << "not retried";
}

// A self-signed certificate, its own CA, for `san`.
bool MakeCertificate(const std::string& dir, const std::string& name, const std::string& san, std::string* cert,
                     std::string* key) {
  testing_certificates::Pem pem;
  const bool made = testing_certificates::MakeSelfSigned(dir, name, san, &pem);
  *cert = pem.cert;
  *key = pem.key;
  return made;
}

// The deployed setup: a coordinator that requires its token and serves TLS.
// The example reaches it with --token-file or $PLATEAU_TOKEN, --ca and
// --server-name; its request id makes a second submit return the first job.
TEST_F(PythonClientTest, TokenAndTlsReachADeployedCoordinatorAndARetriedSubmitIsTheSameJob) {
  const std::string files = TempDir("py_tls_files");
  std::string cert, key, stranger, stranger_key;
  ASSERT_TRUE(MakeCertificate(files, "coordinator", "IP:127.0.0.1,DNS:coordinator.plateau.test", &cert, &key));
  ASSERT_TRUE(MakeCertificate(files, "stranger", "IP:127.0.0.1", &stranger, &stranger_key));
  const std::string token = files + "/token";
  std::ofstream(token) << "tok-py-5e21\n";
  // The coordinator's file mid-rotation (docs/SERVICE.md): the example,
  // given it, sends the first line.
  const std::string rotating = files + "/rotating-token";
  std::ofstream(rotating) << "tok-py-5e21\ntok-py-older\n";
  ClusterOptions o;
  o.coordinator_flags = {"--token_file=" + rotating, "--tls_cert_file=" + cert, "--tls_key_file=" + key};
  o.worker_flags = {"--token_file=" + token, "--tls_ca_file=" + cert};
  o.client.connection.files.token_file = token;
  o.client.connection.files.tls_ca_file = cert;
  Cluster c("py-tls", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  const std::string spec = WriteSpec(c, "tiny", TinyJob(3));

  Ran r = Example(
      c, "tls",
      {"--spec=" + spec, "--token-file=" + rotating, "--ca=" + cert, "--label=team=nlp", "--request-id=py-retry-1"});
  ASSERT_EQ(r.code, 0) << r.out << r.err << c.Logs();
  EXPECT_THAT(r.out, HasSubstr("submitted job-1: "));
  EXPECT_THAT(r.out, HasSubstr("job-1 ended SUCCEEDED"));
  auto job = c.client().GetJob("job-1");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->spec().labels().at("team"), "nlp");
  EXPECT_EQ(job->request_id(), "py-retry-1");

  // The token from the environment, the certificate checked against
  // --server-name; the same request id and spec: the same job, no second.
  setenv("PLATEAU_TOKEN", "tok-py-5e21", 1);
  r = Example(c, "retry", {"--spec=" + spec, "--ca=" + cert, "--server-name=coordinator.plateau.test",
                           "--label=team=nlp", "--request-id=py-retry-1"});
  unsetenv("PLATEAU_TOKEN");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("submitted job-1: "));
  EXPECT_THAT(r.out, HasSubstr("job-1 ended SUCCEEDED"));
  auto list = c.client().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->jobs_size(), 1) << "the retried submit created a second job";

  // No token: refused by name. A name the certificate does not carry, a CA
  // that did not sign it, or plaintext: no connection (exit 4).
  r = Example(c, "notoken", {"--spec=" + spec, "--ca=" + cert});
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("submit refused: UNAUTHENTICATED"));
  for (const auto& [name, flags] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"wrongname", {"--ca=" + cert, "--server-name=other.plateau.test"}},
           {"stranger", {"--ca=" + stranger}},
           {"plaintext", {}}}) {
    std::vector<std::string> args = {"--spec=" + spec, "--token-file=" + token, "--connect-timeout=2"};
    args.insert(args.end(), flags.begin(), flags.end());
    r = Example(c, name, args);
    EXPECT_EQ(r.code, 4) << name << ": " << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr("cannot reach the coordinator at " + c.api())) << name;
  }
  // Bad flags: usage errors naming them.
  r = Example(c, "badca", {"--spec=" + spec, "--ca=" + files + "/absent.pem"});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("--ca=" + files + "/absent.pem: No such file or directory"));
  r = Example(c, "both", {"--spec=" + spec, "--token=x", "--token-file=" + token});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("--token and --token-file: give one of them"));
  r = Example(c, "badlabel", {"--spec=" + spec, "--token-file=" + token, "--ca=" + cert, "--label=team=a b"});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("submit refused: INVALID_ARGUMENT labels.value: of the key 'team'"));
  list = c.client().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->jobs_size(), 1);
}

// A coordinator that requires client certificates (--tls_client_ca_file):
// the example's --cert and --key reach it, no certificate does not.
TEST_F(PythonClientTest, ClientCertificateReachesACoordinatorThatRequiresOne) {
  const std::string files = TempDir("py_mtls_files");
  testing_certificates::MutualTls m;
  ASSERT_TRUE(testing_certificates::MakeMutualTls(files, "IP:127.0.0.1", "py-client", &m));
  const testing_certificates::Pem &server = m.server, &client = m.client;
  ClusterOptions o;
  testing_certificates::UseMutualTls(m, &o);
  Cluster c("py-mtls", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  const std::string spec = WriteSpec(c, "tiny", TinyJob(2));

  // The key from the environment.
  setenv("PLATEAU_TLS_CLIENT_KEY_FILE", client.key.c_str(), 1);
  Ran r = Example(c, "mtls", {"--spec=" + spec, "--ca=" + server.cert, "--cert=" + client.cert});
  unsetenv("PLATEAU_TLS_CLIENT_KEY_FILE");
  ASSERT_EQ(r.code, 0) << r.out << r.err << c.Logs();
  EXPECT_THAT(r.out, HasSubstr("job-1 ended SUCCEEDED"));
  r = Example(c, "nocert", {"--spec=" + spec, "--ca=" + server.cert, "--connect-timeout=2"});
  EXPECT_EQ(r.code, 4) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("cannot reach the coordinator at " + c.api()));
  r = Example(c, "nokey", {"--spec=" + spec, "--ca=" + server.cert, "--cert=" + client.cert});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("a client certificate needs both --cert and --key; --key "
                               "($PLATEAU_TLS_CLIENT_KEY_FILE) is missing"));
  // The environment's certificate without --ca is left unused (plaintext,
  // which this TLS port cannot answer), not a usage error; --cert is one.
  setenv("PLATEAU_TLS_CLIENT_CERT_FILE", client.cert.c_str(), 1);
  setenv("PLATEAU_TLS_CLIENT_KEY_FILE", client.key.c_str(), 1);
  r = Example(c, "envplain", {"--spec=" + spec, "--connect-timeout=2"});
  EXPECT_EQ(r.code, 4) << r.out << r.err;
  r = Example(c, "flagplain", {"--spec=" + spec, "--cert=" + client.cert, "--key=" + client.key});
  unsetenv("PLATEAU_TLS_CLIENT_CERT_FILE");
  unsetenv("PLATEAU_TLS_CLIENT_KEY_FILE");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("--cert: only with TLS (--ca)"));
  r = Example(c, "badkey", {"--spec=" + spec, "--ca=" + server.cert, "--cert=" + client.cert, "--key=" + spec});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--key=" + spec + ": expected a PEM file"));
  auto list = c.client().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->jobs_size(), 1);
}

}  // namespace
}  // namespace plateau
