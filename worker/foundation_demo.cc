// The foundation demo: the most real thing the runtime core can do before the
// service exists. It starts P rank processes that rendezvous through a file
// store, each with its own capped "device" arena, and trains a ZeRO-sharded
// linear model on distinct per-rank data with the collectives the schedules
// use: all-reduce (loss, gradient norm), reduce-scatter (gradients),
// all-gather (weights). Compute and communication run on separate streams
// ordered by events. At the end each rank reports its peak bytes per live set
// and shows what going over the device cap looks like.
//
//   foundation_demo --ranks=2 --steps=60
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/kv_store.h"
#include "kernels/memory.h"
#include "kernels/status_macros.h"

extern char** environ;

namespace plateau {
namespace {

struct Options {
  int ranks = 2;
  int rank = -1;  // >= 0 in a rank process
  int steps = 60;
  int hidden = 256;
  int tokens = 1024;  // per rank
  int64_t device_mb = 32;
  std::string store_dir;
};

absl::StatusOr<Options> ParseArgs(int argc, char** argv) {
  Options o;
  std::map<std::string, int*> ints = {{"ranks", &o.ranks},   {"rank", &o.rank},
                                      {"steps", &o.steps},   {"hidden", &o.hidden},
                                      {"tokens", &o.tokens}};
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    size_t eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("argument '", arg, "': expected --name=value"));
    }
    std::string name = arg.substr(2, eq - 2), value = arg.substr(eq + 1);
    if (name == "store_dir") {
      o.store_dir = value;
    } else if (name == "device_mb") {
      if (!absl::SimpleAtoi(value, &o.device_mb) || o.device_mb <= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("--device_mb: expected a positive integer, got '",
                         value, "'"));
      }
    } else if (auto it = ints.find(name); it != ints.end()) {
      if (!absl::SimpleAtoi(value, it->second)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--", name, ": expected an integer, got '", value, "'"));
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown flag --", name,
          "; expected --ranks, --steps, --hidden, --tokens, --device_mb"));
    }
  }
  if (o.ranks < 1 || o.ranks > 8) {
    return absl::InvalidArgumentError("--ranks: expected 1 to 8");
  }
  if (o.steps < 1) return absl::InvalidArgumentError("--steps: expected >= 1");
  if (o.hidden < 1 || o.tokens < 1) {
    return absl::InvalidArgumentError("--hidden and --tokens: expected >= 1");
  }
  if ((static_cast<int64_t>(o.hidden) * o.hidden) % o.ranks != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--hidden: hidden^2 = ", int64_t{o.hidden} * o.hidden,
        " weights must split evenly over --ranks = ", o.ranks));
  }
  return o;
}

// One rank of the demo. Everything on the "device" is allocated up front,
// tagged with its live set, before the first step.
absl::Status RunRank(const Options& o) {
  const int64_t H = o.hidden, N = o.tokens, P = o.ranks;
  const int64_t shard = H * H / P;

  BackendOptions bo;
  bo.kind = BackendKind::kCpu;
  bo.device_memory_bytes = o.device_mb << 20;
  PLATEAU_ASSIGN_OR_RETURN(auto backend, Backend::Create(bo));
  MemorySpace& dev = backend->device();
  MemorySpace& host = backend->host();

  CommunicatorOptions co;
  co.backend = BackendKind::kCpu;
  co.rank = o.rank;
  co.size = o.ranks;
  PLATEAU_ASSIGN_OR_RETURN(co.store, FileStore::Create(o.store_dir));
  co.prefix = "foundation_demo";
  co.timeout = absl::Seconds(30);
  PLATEAU_ASSIGN_OR_RETURN(auto comm, CreateCommunicator(co));

  PLATEAU_ASSIGN_OR_RETURN(auto compute, backend->CreateStream("compute"));
  PLATEAU_ASSIGN_OR_RETURN(auto comms, backend->CreateStream("comm"));
  PLATEAU_ASSIGN_OR_RETURN(auto grads_ready, backend->CreateEvent());
  PLATEAU_ASSIGN_OR_RETURN(auto update_ready, backend->CreateEvent());

  auto alloc = [&](MemorySpace& s, LiveSet set, int64_t floats) {
    return s.Allocate(set, static_cast<size_t>(floats) * sizeof(float));
  };
  PLATEAU_ASSIGN_OR_RETURN(Buffer w, alloc(dev, LiveSet::kWeights, H * H));
  PLATEAU_ASSIGN_OR_RETURN(Buffer master, alloc(dev, LiveSet::kOptimizer, shard));
  PLATEAU_ASSIGN_OR_RETURN(Buffer m, alloc(dev, LiveSet::kOptimizer, shard));
  PLATEAU_ASSIGN_OR_RETURN(Buffer v, alloc(dev, LiveSet::kOptimizer, shard));
  PLATEAU_ASSIGN_OR_RETURN(Buffer grad, alloc(dev, LiveSet::kGrads, H * H));
  PLATEAU_ASSIGN_OR_RETURN(Buffer grad_shard, alloc(dev, LiveSet::kGrads, shard));
  PLATEAU_ASSIGN_OR_RETURN(Buffer x, alloc(dev, LiveSet::kActivations, N * H));
  PLATEAU_ASSIGN_OR_RETURN(Buffer y, alloc(dev, LiveSet::kActivations, N * H));
  PLATEAU_ASSIGN_OR_RETURN(Buffer diff, alloc(dev, LiveSet::kActivations, N * H));
  PLATEAU_ASSIGN_OR_RETURN(Buffer scalars, alloc(dev, LiveSet::kWorkspace, 2));
  PLATEAU_ASSIGN_OR_RETURN(Buffer staging, alloc(host, LiveSet::kWorkspace, N * H));

  // Distinct data per rank from one fixed teacher: y = x W* + noise.
  {
    std::mt19937_64 teacher_rng(12345);
    std::normal_distribution<float> wdist(0.0f, 1.0f / std::sqrt(float(H)));
    std::vector<float> teacher(H * H);
    for (auto& t : teacher) t = wdist(teacher_rng);
    std::mt19937_64 rng(1000 + o.rank);
    std::normal_distribution<float> unit(0.0f, 1.0f);
    float* hx = staging.as<float>();
    for (int64_t i = 0; i < N * H; ++i) hx[i] = unit(rng);
    PLATEAU_RETURN_IF_ERROR(backend->Copy(*compute, x.data(), hx, x.bytes()));
    PLATEAU_RETURN_IF_ERROR(compute->Synchronize());
    GemmArgs g{false, false, N, H, H, 1.0f, x.as<float>(), H,
               teacher.data(), H, 0.0f, y.as<float>(), H};
    PLATEAU_RETURN_IF_ERROR(backend->Gemm(*compute, g));
    PLATEAU_RETURN_IF_ERROR(compute->Synchronize());
    float* ynoise = staging.as<float>();
    for (int64_t i = 0; i < N * H; ++i) ynoise[i] = 0.01f * unit(rng);
    PLATEAU_RETURN_IF_ERROR(
        backend->Axpy(*compute, y.as<float>(), ynoise, N * H, 1.0f));
  }
  PLATEAU_RETURN_IF_ERROR(backend->Fill(*compute, w.as<float>(), H * H, 0.0f));
  PLATEAU_RETURN_IF_ERROR(backend->Fill(*compute, master.as<float>(), shard, 0.0f));
  PLATEAU_RETURN_IF_ERROR(backend->Fill(*compute, m.as<float>(), shard, 0.0f));
  PLATEAU_RETURN_IF_ERROR(backend->Fill(*compute, v.as<float>(), shard, 0.0f));
  PLATEAU_RETURN_IF_ERROR(compute->Synchronize());
  dev.tracker().ResetPeaks();

  AdamWArgs adam;
  adam.lr = 0.02f;
  adam.weight_decay = 0.0f;
  const float max_norm = 1.0f;
  float first_loss = 0.0f, loss = 0.0f;
  auto t0 = std::chrono::steady_clock::now();
  for (int step = 1; step <= o.steps; ++step) {
    float* s = scalars.as<float>();  // s[0]: loss, s[1]: grad norm^2
    // Forward: diff = x W - y; loss = sum(diff^2) / (2 N H P) summed over ranks.
    PLATEAU_RETURN_IF_ERROR(backend->Copy(*compute, diff.data(), y.data(), y.bytes()));
    GemmArgs fwd{false, false, N, H, H, 1.0f, x.as<float>(), H,
                 w.as<float>(), H, -1.0f, diff.as<float>(), H};
    PLATEAU_RETURN_IF_ERROR(backend->Gemm(*compute, fwd));
    PLATEAU_RETURN_IF_ERROR(backend->SumSquares(*compute, &s[0], diff.as<float>(), N * H));
    PLATEAU_RETURN_IF_ERROR(backend->Scale(*compute, &s[0], 1, 0.5f / (N * H * P)));
    // Backward: dW = x^T diff / (N H P), the gradient of the global mean.
    GemmArgs bwd{true, false, H, H, N, 1.0f / (N * H * P), x.as<float>(), H,
                 diff.as<float>(), H, 0.0f, grad.as<float>(), H};
    PLATEAU_RETURN_IF_ERROR(backend->Gemm(*compute, bwd));
    PLATEAU_RETURN_IF_ERROR(compute->Record(*grads_ready));
    // Communication stream: global loss, ZeRO reduce-scatter of gradients,
    // global gradient norm for clipping.
    PLATEAU_RETURN_IF_ERROR(comms->Wait(*grads_ready));
    PLATEAU_RETURN_IF_ERROR(comm->AllReduce(*comms, &s[0], &s[0], 1,
                                            DataType::kFloat32, ReduceOp::kSum));
    PLATEAU_RETURN_IF_ERROR(comm->ReduceScatter(*comms, grad.data(), grad_shard.data(),
                                                shard, DataType::kFloat32, ReduceOp::kSum));
    PLATEAU_RETURN_IF_ERROR(backend->SumSquares(*comms, &s[1], grad_shard.as<float>(), shard));
    PLATEAU_RETURN_IF_ERROR(comm->AllReduce(*comms, &s[1], &s[1], 1,
                                            DataType::kFloat32, ReduceOp::kSum));
    // The clip scale is needed on the host: bring both scalars over.
    float* hs = staging.as<float>();
    PLATEAU_RETURN_IF_ERROR(backend->Copy(*comms, hs, s, 2 * sizeof(float)));
    PLATEAU_RETURN_IF_ERROR(comms->Synchronize());
    loss = hs[0];
    if (step == 1) first_loss = loss;
    const float norm = std::sqrt(hs[1]);
    adam.step = step;
    adam.grad_scale = std::min(1.0f, max_norm / (norm + 1e-6f));
    // Each rank updates its shard, then the working weights are all-gathered.
    PLATEAU_RETURN_IF_ERROR(backend->AdamW(*comms, master.as<float>(), grad_shard.as<float>(),
                                           m.as<float>(), v.as<float>(), shard, adam));
    PLATEAU_RETURN_IF_ERROR(comm->AllGather(*comms, master.data(), w.data(), shard,
                                            DataType::kFloat32));
    PLATEAU_RETURN_IF_ERROR(comms->Record(*update_ready));
    PLATEAU_RETURN_IF_ERROR(compute->Wait(*update_ready));
    if (o.rank == 0 && (step == 1 || step % 10 == 0 || step == o.steps)) {
      std::printf("[rank 0] step %3d/%d  loss %.6f  grad-norm %.4f\n", step,
                  o.steps, loss, norm);
      std::fflush(stdout);
    }
  }
  PLATEAU_RETURN_IF_ERROR(compute->Synchronize());
  PLATEAU_RETURN_IF_ERROR(comms->Synchronize());
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  MemoryStats stats = dev.tracker().Snapshot();
  std::string peaks;
  for (int i = 0; i < kNumLiveSets; ++i) {
    if (stats.peak[i] == 0) continue;
    absl::StrAppend(&peaks, " ", LiveSetName(static_cast<LiveSet>(i)), "=",
                    stats.peak[i]);
  }
  // Show the device cap doing its job: ask for one byte more than is free.
  const int64_t free_bytes = dev.cap_bytes() - dev.tracker().total_current();
  auto too_big = dev.Allocate(LiveSet::kDispatch, free_bytes + 1);
  std::printf(
      "[rank %d] %d steps in %.2fs; loss %.6f -> %.6f; device peak bytes:%s "
      "(total %lld of %lld)\n[rank %d] over the cap on purpose: %s\n",
      o.rank, o.steps, secs, first_loss, loss, peaks.c_str(),
      static_cast<long long>(stats.total_peak),
      static_cast<long long>(dev.cap_bytes()), o.rank,
      too_big.ok() ? "UNEXPECTEDLY FIT" : too_big.status().ToString().c_str());
  if (too_big.ok()) return absl::InternalError("the device cap did not hold");
  if (!(loss < 0.1f * first_loss)) {
    return absl::InternalError(absl::StrFormat(
        "loss did not fall below a tenth of its start (%.6f -> %.6f)", first_loss, loss));
  }
  return absl::OkStatus();
}

std::vector<pid_t> g_children;

void KillChildren(int) {
  for (pid_t p : g_children) kill(p, SIGTERM);
}

// The launcher: P rank processes, a fresh store directory, exit codes checked.
int Launch(const Options& o, const char* self) {
  std::string dir = (std::filesystem::temp_directory_path() /
                     absl::StrCat("plateau-demo-", getpid()))
                        .string();
  std::filesystem::create_directories(dir);
  signal(SIGINT, KillChildren);
  signal(SIGTERM, KillChildren);
  for (int r = 0; r < o.ranks; ++r) {
    std::vector<std::string> args = {
        self,
        absl::StrCat("--rank=", r),
        absl::StrCat("--ranks=", o.ranks),
        absl::StrCat("--steps=", o.steps),
        absl::StrCat("--hidden=", o.hidden),
        absl::StrCat("--tokens=", o.tokens),
        absl::StrCat("--device_mb=", o.device_mb),
        absl::StrCat("--store_dir=", dir)};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid;
    if (posix_spawn(&pid, self, nullptr, nullptr, argv.data(), environ) != 0) {
      std::perror("posix_spawn");
      KillChildren(0);
      return 1;
    }
    g_children.push_back(pid);
  }
  int failures = 0;
  for (size_t i = 0; i < g_children.size(); ++i) {
    int status = 0;
    waitpid(g_children[i], &status, 0);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
    ++failures;
    if (WIFSIGNALED(status)) {
      std::fprintf(stderr, "rank %zu killed by signal %d\n", i, WTERMSIG(status));
    } else {
      std::fprintf(stderr, "rank %zu exited with code %d\n", i, WEXITSTATUS(status));
    }
    KillChildren(0);  // one rank failing means the job failed
  }
  std::filesystem::remove_all(dir);
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace plateau

int main(int argc, char** argv) {
  auto opts = plateau::ParseArgs(argc, argv);
  if (!opts.ok()) {
    std::fprintf(stderr, "foundation_demo: %s\n", opts.status().ToString().c_str());
    return 2;
  }
  if (opts->rank < 0) {
    std::error_code ec;
    std::string self = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (ec) {
      std::fprintf(stderr, "foundation_demo: cannot find own binary: %s\n",
                   ec.message().c_str());
      return 1;
    }
    return plateau::Launch(*opts, self.c_str());
  }
  absl::Status s = plateau::RunRank(*opts);
  if (!s.ok()) {
    std::fprintf(stderr, "[rank %d] failed: %s\n", opts->rank, s.ToString().c_str());
    return 1;
  }
  return 0;
}
