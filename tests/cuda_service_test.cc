// The service on the CUDA backend, end to end: a real coordinator and a
// worker agent with --backend=cuda --devices=2 run a 2-rank job, each rank
// a process of its own on its own GPU, the NCCL unique id passed through the
// coordinator's rendezvous, the ranks exchanging over NCCL. The same job on
// the CPU backend (a second cluster, same spec) is the reference.
//
// Built only where the worker has a CUDA backend: tools/test runs it under
// --config=cuda_emulated with two emulated GPUs (PLATEAU_EMULATED_GPUS=2;
// ranks in separate processes join one NCCL world through the emulation's
// socket). On a GPU machine it needs two GPUs. Tagged manual: the default
// build's worker has no CUDA backend.
//
// What must hold:
//   - the first step's loss equals the CPU's to the tolerance of the fp32
//     step twin test (kernels/step/cuda_step_twin_test: 2e-5 relative; the
//     sums run in other orders and expf/logf are other libraries on a GPU);
//     later steps stay within 1e-3 relative: AdamW moves a weight whose
//     gradient is within rounding of 0 by up to 2 lr either way, and that
//     compounds (measured on the emulation: see BENCHMARKS.md);
//   - every live set's measured peak, on both ranks, equals the budget's
//     planned bytes: the CUDA backend's allocations are the plan's; the
//     device's own view (cudaMemGetInfo, the pool's reservation) is
//     reported and holds at least the plan;
//   - a rank killed mid-run ends the attempt (its peer's NCCL call fails,
//     no hang) and the job restarts and finishes.
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster.h"

namespace plateau {
namespace {

using namespace testing_cluster;  // NOLINT: the harness is this file's vocabulary

constexpr int kSteps = 4;

struct JobRun {
  v1::JobState state = v1::JOB_STATE_UNSPECIFIED;
  std::map<int64_t, double> losses;  // step -> the global batch's loss
  std::vector<v1::JobStepSummary> steps;
  v1::MemoryPlan plan;
  std::string metrics;
  std::map<int, std::string> kernels;  // rank -> its log's "kernels: " line
};

JobRun RunJob(Cluster& c, v1::Backend backend) {
  JobRun run;
  v1::JobSpec spec = TinyJob(kSteps);
  spec.set_backend(backend);
  auto sub = c.client().SubmitJob(spec, false);
  EXPECT_TRUE(sub.ok()) << sub.status();
  if (!sub.ok()) return run;
  run.plan = sub->plan();
  const std::string id = sub->job().id();
  for (const v1::JobEvent& e : c.AllEvents(id)) {
    if (!e.has_job_step()) continue;
    run.losses[e.job_step().step()] = e.job_step().loss();
    run.steps.push_back(e.job_step());
  }
  run.state = c.WaitDone(id).state();
  run.metrics = Scrape(c.metrics());
  EXPECT_TRUE(c.client()
                  .GetJobLogs(id, false, 0,
                              [&](const v1::LogEntry& l) {
                                if (absl::StartsWith(l.line(), "kernels: "))
                                  run.kernels[l.rank()] = l.line();
                                return true;
                              })
                  .ok());
  return run;
}

TEST(CudaServiceTest, TwoRankJobOnCudaMatchesTheCpuJob) {
  ClusterOptions cuda_options;
  cuda_options.worker_flags = {"--backend=cuda"};
  Cluster cuda("cuda", cuda_options);
  ASSERT_TRUE(cuda.ready()) << cuda.Logs();
  const JobRun gpu = RunJob(cuda, v1::BACKEND_CUDA);
  ASSERT_EQ(gpu.state, v1::SUCCEEDED) << cuda.Logs();

  Cluster cpu_cluster("cpu");
  ASSERT_TRUE(cpu_cluster.ready()) << cpu_cluster.Logs();
  const JobRun cpu = RunJob(cpu_cluster, v1::BACKEND_CPU);
  ASSERT_EQ(cpu.state, v1::SUCCEEDED) << cpu_cluster.Logs();

  ASSERT_EQ(gpu.losses.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(cpu.losses.size(), static_cast<size_t>(kSteps));
  for (const auto& [step, loss] : cpu.losses) {
    std::printf("step %lld: loss %.9f on CUDA, %.9f on the CPU\n", static_cast<long long>(step),
                gpu.losses.at(step), loss);
    const double tolerance = (step == 1 ? 2e-5 : 1e-3) * std::abs(loss);
    EXPECT_NEAR(gpu.losses.at(step), loss, tolerance) << "step " << step;
  }

  // Each CUDA rank's log says what its kernels chose; an fp32 job launches
  // no tensor-core attention kernel, so none decided about wgmma (no probe,
  // no check at start). The CPU's kernels have nothing to say.
  ASSERT_EQ(gpu.kernels.size(), 2u) << cuda.Logs();
  for (const auto& [rank, line] : gpu.kernels) {
    EXPECT_THAT(line, ::testing::HasSubstr("on wgmma: no (not needed")) << "rank " << rank;
  }
  EXPECT_TRUE(cpu.kernels.empty()) << cpu.kernels.begin()->second;

  // The device's own view (cudaMemGetInfo; the stream-ordered pool's
  // reservation) is reported on CUDA and is 0 on the CPU.
  for (const v1::JobStepSummary& t : gpu.steps) {
    std::printf("step %lld on CUDA: device used %lld bytes, pool reserved %lld, plan total %lld\n",
                static_cast<long long>(t.step()), static_cast<long long>(t.device_used_bytes()),
                static_cast<long long>(t.device_pool_reserved_bytes()),
                static_cast<long long>(gpu.plan.total_bytes()));
    // The pool holds at least the plan's peak (here also the streams'
    // cuBLAS workspaces, outside the plan: 5 x 32 MiB).
    EXPECT_GE(t.device_pool_reserved_bytes(), gpu.plan.total_bytes()) << "step " << t.step();
    EXPECT_GE(t.device_used_bytes(), t.device_pool_reserved_bytes()) << "step " << t.step();
  }
  for (const v1::JobStepSummary& t : cpu.steps) {
    EXPECT_EQ(t.device_used_bytes(), 0);
    EXPECT_EQ(t.device_pool_reserved_bytes(), 0);
  }

  // Every live set's peak on both ranks is what the budget planned.
  ASSERT_GT(gpu.plan.live_sets_size(), 0);
  for (const auto& set : gpu.plan.live_sets()) {
    for (int rank : {0, 1}) {
      const std::string labels =
          absl::StrCat("{job_id=\"job-1\",live_set=\"", set.live_set(), "\",rank=\"", rank, "\"}");
      const double planned = Sample(gpu.metrics, "plateau_job_planned_bytes" + labels);
      const double peak = Sample(gpu.metrics, "plateau_job_peak_bytes" + labels);
      EXPECT_EQ(planned, static_cast<double>(set.bytes())) << set.live_set() << " rank " << rank;
      EXPECT_EQ(peak, planned) << set.live_set() << " rank " << rank;
    }
  }
}

// Rank 0's process (it made the NCCL unique id: the emulation's world
// lives there) is killed mid-run: rank 1's next collective fails instead of
// hanging, the attempt ends, and the job restarts on a fresh NCCL world and
// finishes.
TEST(CudaServiceTest, AKilledRankRestartsTheCudaJobOnAFreshNcclWorld) {
  ClusterOptions options;
  options.worker_flags = {"--backend=cuda"};
  Cluster c("cuda_restart", options);
  ASSERT_TRUE(c.ready()) << c.Logs();
  v1::JobSpec spec = TinyJob(40);
  spec.set_backend(v1::BACKEND_CUDA);
  spec.set_max_restarts(1);
  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  ASSERT_TRUE(c.WaitStep(id, 2)) << c.Logs();
  const pid_t rank0 = c.RankPid(id, 0);
  ASSERT_NE(rank0, 0);
  ASSERT_EQ(kill(rank0, SIGKILL), 0);
  const v1::Job job = c.WaitDone(id);
  EXPECT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.attempt(), 1);
  EXPECT_EQ(job.progress().step(), 40);
  bool restarted = false;
  for (const v1::JobEvent& e : c.AllEvents(id)) {
    if (!e.has_state_change()) continue;
    std::printf("%s: %s\n", v1::JobState_Name(e.state_change().state()).c_str(),
                e.state_change().reason().c_str());
    restarted |= e.state_change().state() == v1::RESTARTING;
  }
  EXPECT_TRUE(restarted);
}

// A CUDA worker without --device_memory_bytes offers what its GPUs have:
// the smallest card's memory less a sixteenth, at least 2 GiB, as
// plateau_rank --probe_devices read each slot's GPU (probe-SLOT.log in the
// work dir). On the emulation each of the two GPUs has
// PLATEAU_EMULATED_GPU_MIB (4096 MiB unless set). It used to offer a fixed
// 1 GiB, so that the coordinator refused every larger job on it.
TEST(CudaServiceTest, AWorkerOffersItsGpusMemoryLessAReserve) {
  ClusterOptions options;
  options.worker_flags = {"--backend=cuda", "--calibrate=false"};
  Cluster c("cuda_auto_memory", options);
  ASSERT_TRUE(c.ready()) << c.Logs();
  absl::StatusOr<v1::ListWorkersResponse> workers;
  ASSERT_TRUE(WaitFor([&] {
    workers = c.client().ListWorkers();
    return workers.ok() && workers->workers_size() == 1;
  })) << c.Logs();
  std::vector<int64_t> totals;
  for (int slot : {0, 1}) {  // --devices=2
    const std::string probe = ReadFile(absl::StrCat(c.dir(), "/work-0/probe-", slot, ".log"));
    const size_t comma = probe.rfind(", ");
    int64_t total = 0;
    ASSERT_TRUE(
        absl::StartsWith(probe, "device 0: ") && comma != std::string::npos &&
        absl::SimpleAtoi(absl::StripSuffix(absl::StripAsciiWhitespace(probe.substr(comma + 2)), " bytes"), &total))
        << "slot " << slot << ": " << probe;
    totals.push_back(total);
  }
  if (std::getenv("PLATEAU_EMULATED_GPUS") != nullptr) {
    const char* mib = std::getenv("PLATEAU_EMULATED_GPU_MIB");
    const int64_t emulated = int64_t{mib != nullptr && *mib != '\0' ? std::atoi(mib) : 4096} << 20;
    for (int64_t t : totals) EXPECT_EQ(t, emulated);
  }
  const int64_t smallest = *std::min_element(totals.begin(), totals.end());
  const int64_t offered = smallest - std::max(smallest / 16, int64_t{2} << 30);
  EXPECT_EQ(workers->workers(0).device_memory_bytes(), offered);
  EXPECT_THAT(c.Logs(),
              ::testing::HasSubstr("--device_memory_bytes=auto: " + std::to_string(offered) + " bytes per GPU"));
}

// More slots than GPUs is said at start, naming the slot without one, where
// the worker used to register and fail each job's rank there.
TEST(CudaServiceTest, MoreSlotsThanGpusIsRefusedAtStart) {
  const std::string dir = TempDir("cuda_slots");
  Ran r = RunCommand({"worker/plateau_worker", "--coordinator=127.0.0.1:1", "--backend=cuda", "--devices=4096",
                      "--work_dir=" + dir + "/work", "--rank_binary=worker/plateau_rank", "--calibrate=false"},
                     dir + "/agent");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, ::testing::ContainsRegex("--device_memory_bytes=auto: cannot read the (memory of slot [0-9]+'s "
                                              "GPU|GPUs' memory: devices: slot [0-9]+ has no GPU)"));
  if (std::getenv("PLATEAU_EMULATED_GPUS") != nullptr && std::getenv("CUDA_VISIBLE_DEVICES") == nullptr) {
    EXPECT_THAT(r.err, ::testing::HasSubstr("slot 2's GPU (CUDA_VISIBLE_DEVICES=2; it exited with code 1)"));
  }
  EXPECT_THAT(r.err, ::testing::HasSubstr("give --devices at most the GPUs this worker may use"));
  // A GPU no larger than the reserve is refused rather than offered as 0,
  // which the coordinator reads as "not said" and places anything on.
  if (std::getenv("PLATEAU_EMULATED_GPUS") != nullptr) {
    r = RunCommand({"/usr/bin/env", "PLATEAU_EMULATED_GPU_MIB=2048", "worker/plateau_worker",
                    "--coordinator=127.0.0.1:1", "--backend=cuda", "--devices=1", "--work_dir=" + dir + "/work3",
                    "--rank_binary=worker/plateau_rank", "--calibrate=false"},
                   dir + "/agent3");
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_THAT(r.err, ::testing::HasSubstr("--device_memory_bytes=auto: the smallest GPU has 2147483648 bytes, "
                                            "not more than the 2147483648 bytes kept"));
  }
  // A value that is neither `auto` nor a byte count is refused naming it.
  r = RunCommand({"worker/plateau_worker", "--coordinator=127.0.0.1:1", "--backend=cuda", "--devices=2",
                  "--device_memory_bytes=banana", "--work_dir=" + dir + "/work2", "--rank_binary=worker/plateau_rank",
                  "--calibrate=false"},
                 dir + "/agent2");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, ::testing::HasSubstr("--device_memory_bytes: expected auto or an integer >= 0, got 'banana'"));
}

}  // namespace
}  // namespace plateau
