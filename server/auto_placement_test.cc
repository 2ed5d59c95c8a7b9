// The `auto` settings chosen again when the coordinator places a job, on
// the calibration and memory of the workers it was placed on, and kept by a
// restart where they still fit (else chosen again): the real coordinator in process with a
// real SQLite store, the agents' side played by direct calls (as
// coordinator_test), so that each worker can register with curves and
// memory of the test's choosing.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/coordinator.h"
#include "tests/cluster.h"
#include "worker/auto_spec_testing.h"
#include "worker/calibration.h"
#include "worker/job_spec.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// All four settings `auto` (the demo's schedules), on `backend`.
v1::JobSpec AllAuto(v1::Backend backend) {
  v1::JobSpec s = DemoJobSpec(2, 5);
  s.set_name("auto");
  s.set_backend(backend);
  s.set_max_restarts(1);
  return WithAllAuto(std::move(s));
}

// A curve with a flat GEMM rate and the given launch, copy and collective
// figures (as kernels/budget/auto_settings_test's synthetic machines).
v1::Calibration Flat(double flops, double launch, double copy_bytes_per_s, double adamw, double collective) {
  Calibration c;
  for (int64_t rows : {1, 16, 256, 4096}) {
    c.gemm.push_back({rows, launch + 2.0 * rows * kCalibrationGemmDim * kCalibrationGemmDim / flops});
  }
  c.launch_seconds = launch;
  c.h2d_bytes_per_second = c.d2h_bytes_per_second = copy_bytes_per_s;
  c.adamw_params_per_second = adamw;
  c.collective_seconds = collective;
  v1::Calibration p = CalibrationToProto(c);
  p.set_backend("cpu");
  p.set_measured_unix_seconds(1700000000);
  return p;
}
// Slow launches and collectives: few, large buckets and chunks.
v1::Calibration LatencyBound() { return Flat(1e9, 1e-3, 1e9, 1e8, 5e-3); }
// Fast launches against slow copies: many small buckets overlap them.
v1::Calibration CopyBound() { return Flat(1e12, 1e-7, 1e6, 1e10, 1e-7); }

// AllAuto on cuda without a device cap: each worker's memory is the cap.
v1::JobSpec UncappedAllAuto() {
  v1::JobSpec s = AllAuto(v1::BACKEND_CUDA);
  s.set_device_memory_bytes(0);
  return s;
}

// The job's roomiest plan (no cap) and its smallest (nothing fits a 1-byte
// worker: planned at the smallest values).
void Extremes(const v1::JobSpec& spec, v1::MemoryPlan* roomy, v1::MemoryPlan* smallest) {
  auto r = plateau::PlanJob(spec);
  ASSERT_TRUE(r.ok()) << r.status();
  *roomy = *r;
  AutoContext none;
  none.device_memory_bytes = 1;
  auto s = plateau::PlanJob(spec, none);
  ASSERT_TRUE(s.ok()) << s.status();
  *smallest = *s;
}

std::map<std::string, int64_t> Values(const v1::MemoryPlan& plan) {
  std::map<std::string, int64_t> out;
  for (const v1::AutoSetting& a : plan.auto_settings()) out[a.field()] = a.value();
  return out;
}

// The values a resolved spec (what the ranks receive) carries.
std::map<std::string, int64_t> Values(const v1::JobSpec& spec) {
  const v1::ScheduleSpec& s = spec.schedule();
  EXPECT_FALSE(s.pipelined_llep().chunk_tokens_auto() || s.ring_dtp().strip_auto() || s.sco().host_budget_auto() ||
               s.offload_stream_adamw().bucket_params_auto())
      << "the ranks must not receive `auto`";
  return {{"schedule.pipelined_llep.chunk_tokens", s.pipelined_llep().chunk_tokens()},
          {"schedule.ring_dtp.strip", s.ring_dtp().strip()},
          {"schedule.sco.host_budget_bytes", s.sco().host_budget_bytes()},
          {"schedule.offload_stream_adamw.bucket_params", s.offload_stream_adamw().bucket_params()}};
}

class AutoPlacementTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TEST_TMPDIR");
    dir_ = (tmp ? std::string(tmp) : absl::StrCat("/tmp/plateau-test-", getpid())) + "/" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    static Metrics* const metrics = [] {
      auto m = Metrics::Create("127.0.0.1:0");
      return m.ok() ? m->release() : nullptr;
    }();
    ASSERT_NE(metrics, nullptr);
    options_.heartbeat_interval = absl::Milliseconds(100);
    options_.worker_timeout = absl::Milliseconds(300);
    options_.reattach_timeout = absl::Milliseconds(0);
    options_.tick = absl::Milliseconds(20);
    auto s = JobStore::Open(dir_ + "/state.db");
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(*s);
    coordinator_ = std::make_unique<Coordinator>(store_.get(), metrics, options_);
    ASSERT_TRUE(coordinator_->Start().ok());
  }

  Coordinator& c() { return *coordinator_; }

  std::string RegisterWorker(const std::string& name, v1::Backend backend, int64_t device_memory_bytes,
                             const v1::Calibration* calibration) {
    v1::RegisterRequest req;
    v1::WorkerCapabilities* caps = req.mutable_capabilities();
    caps->set_backend(backend);
    caps->set_devices(2);
    caps->set_device_memory_bytes(device_memory_bytes);
    caps->set_rank_address("127.0.0.1");
    caps->set_name(name);
    if (calibration != nullptr) *caps->mutable_calibration() = *calibration;
    auto resp = c().Register(req);
    EXPECT_TRUE(resp.ok()) << resp.status();
    return resp.ok() ? resp->worker_id() : "";
  }

  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const std::string& worker) {
    v1::HeartbeatRequest req;
    req.set_worker_id(worker);
    return c().Heartbeat(req);
  }

  std::string Submit(const v1::JobSpec& spec) {
    v1::SubmitJobRequest req;
    *req.mutable_spec() = spec;
    auto resp = c().SubmitJob(req);
    EXPECT_TRUE(resp.ok()) << resp.status();
    return resp.ok() ? resp->job().id() : "";
  }

  v1::Job Get(const std::string& id) {
    auto j = c().GetJob(id);
    EXPECT_TRUE(j.ok()) << j.status();
    return j.ok() ? *j : v1::Job();
  }

  // Heartbeats `worker` alone until it receives attempt 1 of `job` (the
  // worker it ran on, silent, is lost); that assignment.
  v1::Assignment RestartedOn(const std::string& worker, const std::string& job) {
    v1::Assignment out;
    const bool arrived = testing_cluster::WaitFor(
        [&] {
          auto hb = Heartbeat(worker);
          if (hb.ok()) {
            for (const v1::Assignment& as : hb->assignments()) {
              if (as.job_id() == job) out = as;
            }
          }
          return out.attempt() == 1;
        },
        absl::Seconds(10));
    EXPECT_TRUE(arrived) << Get(job).DebugString();
    return out;
  }

  // The assignment `worker` receives for `job` on its next heartbeat.
  v1::Assignment AssignmentOn(const std::string& worker, const std::string& job) {
    auto hb = Heartbeat(worker);
    EXPECT_TRUE(hb.ok()) << hb.status();
    if (hb.ok()) {
      for (const v1::Assignment& a : hb->assignments()) {
        if (a.job_id() == job) return a;
      }
    }
    ADD_FAILURE() << "no assignment of " << job << " on " << worker;
    return v1::Assignment();
  }

  std::string dir_;
  CoordinatorOptions options_;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<Coordinator> coordinator_;
};

// A worker whose calibration cannot be modelled (here: no GEMM point)
// registers without it: an `auto` job is admitted and placed there on the
// default curve, rather than every such submit being refused.
TEST_F(AutoPlacementTest, AnUnusableCalibrationIsSetAsideNotFatalToAutoJobs) {
  v1::Calibration broken = LatencyBound();
  broken.clear_gemm();
  const std::string w = RegisterWorker("broken", v1::BACKEND_CPU, 0, &broken);
  const std::string job = Submit(AllAuto(v1::BACKEND_CPU));
  ASSERT_FALSE(job.empty());
  const v1::Job j = Get(job);
  EXPECT_EQ(j.state(), v1::SCHEDULED) << j.DebugString();
  EXPECT_THAT(j.plan().calibration(), HasSubstr("the default cpu curve"));
  auto workers = c().ListWorkers();
  ASSERT_EQ(workers.workers_size(), 1);
  EXPECT_EQ(workers.workers(0).id(), w);
}

// Chosen at submit on the default curve (no worker yet); chosen again on
// worker a's curves when placed there; a is lost, and the restarted attempt
// is placed on b, where a's values fit: kept, though b's curves would
// choose others. The plan (`get`) and the ranks' spec say the same.
TEST_F(AutoPlacementTest, TheFirstPlacementChoosesOnItsWorkersCalibrationARestartKeepsIt) {
  const v1::JobSpec spec = AllAuto(v1::BACKEND_CPU);
  const std::string job = Submit(spec);
  ASSERT_FALSE(job.empty());
  v1::Job j = Get(job);
  EXPECT_EQ(j.state(), v1::PENDING);
  EXPECT_THAT(j.plan().calibration(), HasSubstr("the default cpu curve"));

  const v1::Calibration latency = LatencyBound(), copies = CopyBound();
  const std::string a = RegisterWorker("a", v1::BACKEND_CPU, 0, &latency);
  j = Get(job);
  ASSERT_EQ(j.state(), v1::SCHEDULED) << j.DebugString();
  ASSERT_EQ(j.placement(0).worker_id(), a);
  EXPECT_THAT(j.plan().calibration(), HasSubstr("measured on " + a + " (a)"));
  const std::map<std::string, int64_t> on_a = Values(j.plan());
  ASSERT_EQ(on_a.size(), 4u);
  EXPECT_EQ(Values(AssignmentOn(a, job).spec()), on_a);

  // The choice is the one PlanJob makes on each curve: a's and b's differ.
  AutoContext ca, cb;
  ca.calibration = latency;
  cb.calibration = copies;
  auto want_a = plateau::PlanJob(spec, ca);
  auto want_b = plateau::PlanJob(spec, cb);
  ASSERT_TRUE(want_a.ok() && want_b.ok());
  EXPECT_EQ(on_a, Values(*want_a));
  ASSERT_NE(Values(*want_a), Values(*want_b)) << "the two curves must choose differently for this test to say anything";

  // b registers; a goes silent: its attempt is lost and restarts on b (b's
  // heartbeats keep it alive and deliver the new attempt's assignment).
  const std::string b = RegisterWorker("b", v1::BACKEND_CPU, 0, &copies);
  const v1::Assignment on_b = RestartedOn(b, job);
  j = Get(job);
  EXPECT_EQ(j.attempt(), 1);
  ASSERT_EQ(j.placement(0).worker_id(), b);
  // a's values fit b (the spec's own 256 MiB cap): kept, so that the
  // resumed run is bitwise the uninterrupted one, though b's curve would
  // choose others.
  EXPECT_EQ(Values(j.plan()), on_a);
  EXPECT_EQ(Values(on_b.spec()), on_a);
  EXPECT_THAT(j.plan().calibration(), HasSubstr("measured on " + a + " (a)"));
  EXPECT_THAT(absl::StrJoin(j.plan().notes(), "\n"), HasSubstr("kept from the earlier attempt"));
  // The plan's bytes are at those values: the job keeps one consistent plan.
  for (const v1::LiveSetBytes& ls : j.plan().live_sets()) {
    for (const v1::LiveSetBytes& w : want_a->live_sets()) {
      if (w.live_set() == ls.live_set()) {
        EXPECT_EQ(ls.bytes(), w.bytes()) << ls.live_set();
      }
    }
  }
}

// A restart onto workers where the values the job ran with do not fit
// chooses again for them, and the job's log says the resume is not bitwise.
TEST_F(AutoPlacementTest, ARestartWhereTheEarlierValuesDoNotFitChoosesAgain) {
  const v1::JobSpec spec = UncappedAllAuto();
  v1::MemoryPlan roomy, smallest;
  ASSERT_NO_FATAL_FAILURE(Extremes(spec, &roomy, &smallest));
  const int64_t lo = smallest.total_bytes(), hi = roomy.total_bytes();
  ASSERT_LT(lo, hi);

  const std::string big = RegisterWorker("big", v1::BACKEND_CUDA, 0, nullptr);  // 0: no cap
  const std::string job = Submit(spec);
  v1::Job j = Get(job);
  ASSERT_EQ(j.state(), v1::SCHEDULED) << j.DebugString();
  const std::map<std::string, int64_t> first = Values(j.plan());
  ASSERT_EQ(first, Values(roomy));

  const int64_t middle = lo + (hi - lo) / 2;
  const std::string mid = RegisterWorker("mid", v1::BACKEND_CUDA, middle, nullptr);
  const v1::Assignment on_mid = RestartedOn(mid, job);
  j = Get(job);
  ASSERT_EQ(j.placement(0).worker_id(), mid);
  EXPECT_NE(Values(j.plan()), first);
  EXPECT_EQ(Values(on_mid.spec()), Values(j.plan()));
  EXPECT_LE(j.plan().total_bytes(), middle);
  EXPECT_THAT(absl::StrJoin(j.plan().notes(), "\n"), Not(HasSubstr("kept from the earlier attempt")));
  auto logs = store_->ReadLogs(job, 0, 1000);
  ASSERT_TRUE(logs.ok()) << logs.status();
  std::string said;
  for (const v1::LogEntry& e : *logs) absl::StrAppend(&said, e.line(), "\n");
  EXPECT_THAT(said, HasSubstr("the `auto` settings of the earlier attempt are not kept on " + mid +
                              " (device_memory_bytes: at those values the plan is "));
  EXPECT_THAT(said, HasSubstr("): chosen again there, so this attempt's steps are not bitwise"));
}

// Two nodes: the job's settings are chosen on the slower node's curves and
// the plan says which and why.
TEST_F(AutoPlacementTest, TwoNodesChooseOnTheSlowerCalibration) {
  v1::JobSpec spec = AllAuto(v1::BACKEND_CPU);
  spec.mutable_layout()->set_nodes(2);
  const v1::Calibration latency = LatencyBound(), copies = CopyBound();
  const std::string a = RegisterWorker("a", v1::BACKEND_CPU, 0, &copies);
  const std::string b = RegisterWorker("b", v1::BACKEND_CPU, 0, &latency);
  const std::string job = Submit(spec);
  const v1::Job j = Get(job);
  ASSERT_EQ(j.state(), v1::SCHEDULED) << j.DebugString();
  ASSERT_EQ(j.placement_size(), 2);
  // The slower curve is the one whose own choice models the longer step
  // (the sum of the chosen settings' modelled seconds).
  auto modelled = [&](const v1::Calibration& cal) {
    AutoContext ctx;
    ctx.calibration = cal;
    v1::MemoryPlan p = plateau::PlanJob(spec, ctx).value();
    double seconds = 0;
    for (const v1::AutoSetting& s : p.auto_settings()) seconds += s.modelled_seconds();
    return std::make_pair(seconds, p);
  };
  const auto [on_copies, plan_copies] = modelled(copies);
  const auto [on_latency, plan_latency] = modelled(latency);
  ASSERT_NE(on_copies, on_latency);
  ASSERT_NE(Values(plan_copies), Values(plan_latency)) << "the curves must choose differently";
  const bool a_slower = on_copies > on_latency;
  const v1::MemoryPlan* want = a_slower ? &plan_copies : &plan_latency;
  const std::string slower = a_slower ? a + " (a)" : b + " (b)";
  EXPECT_EQ(Values(j.plan()), Values(*want));
  EXPECT_THAT(j.plan().calibration(), HasSubstr("measured on " + slower + ", the slowest of the job's workers"));
  EXPECT_THAT(j.plan().calibration(), HasSubstr(a + " "));
  EXPECT_THAT(j.plan().calibration(), HasSubstr(b + " "));
  EXPECT_EQ(Values(AssignmentOn(a, job).spec()), Values(*want));
  EXPECT_EQ(Values(AssignmentOn(b, job).spec()), Values(*want));
}

// A spec without a device cap (cuda: the whole device) is chosen against the
// memory of the worker it is placed on: a worker where no value fits is not
// used (the job waits, saying why), one with room takes it with the values
// that fit its memory.
TEST_F(AutoPlacementTest, AWorkerWhereNothingFitsIsNotUsedAndTheChoiceFitsTheOneThatIs) {
  const v1::JobSpec spec = UncappedAllAuto();
  v1::MemoryPlan roomy, smallest;
  ASSERT_NO_FATAL_FAILURE(Extremes(spec, &roomy, &smallest));
  ASSERT_TRUE(smallest.has_auto_nothing_fits());
  EXPECT_TRUE(smallest.auto_nothing_fits().cap_of_the_worker());
  const int64_t lo = smallest.total_bytes(), hi = roomy.total_bytes();
  ASSERT_LT(lo, hi);

  const std::string tiny = RegisterWorker("tiny", v1::BACKEND_CUDA, lo - 1, nullptr);
  const std::string job = Submit(spec);  // admitted: another worker may fit
  ASSERT_TRUE(testing_cluster::WaitFor([&] { return Get(job).unschedulable(); }, absl::Seconds(10)))
      << Get(job).DebugString();
  v1::Job j = Get(job);
  EXPECT_EQ(j.state(), v1::PENDING);
  EXPECT_THAT(j.state_reason(), HasSubstr(tiny + " has "));
  EXPECT_THAT(j.state_reason(), HasSubstr("where no value of the `auto` settings fits (device_memory_bytes: "));

  const int64_t middle = lo + (hi - lo) / 2;
  const std::string mid = RegisterWorker("mid", v1::BACKEND_CUDA, middle, nullptr);
  j = Get(job);
  ASSERT_EQ(j.state(), v1::SCHEDULED) << j.DebugString();
  ASSERT_EQ(j.placement(0).worker_id(), mid);
  EXPECT_FALSE(j.plan().has_auto_nothing_fits());
  EXPECT_LE(j.plan().total_bytes(), middle);
  EXPECT_GT(j.plan().total_bytes(), lo);  // not simply the smallest: the fastest that fits
  EXPECT_NE(Values(j.plan()), Values(roomy));
  EXPECT_EQ(Values(AssignmentOn(mid, job).spec()), Values(j.plan()));
}

}  // namespace
}  // namespace plateau
