// The baseline training step's speed and memory on the CPU backend.
//
// Measures, in one run: this machine's sgemm rate through the backend (the
// ceiling), then the full step (forward, backward with recomputation,
// AdamW) at several sequence lengths: step time, tokens/s, model FLOP/s
// (6 x active params x tokens + causal attention; the embedding and the
// norms' weights excluded: no matrix products) as a
// fraction of the sgemm rate, and the peak bytes of every live set, so that
// it shows how each peak grows with the sequence. Also per step (medians):
// the process's minor page faults and CPU seconds (getrusage around each
// step), two counts that do not depend on the machine's load the way the
// wall time does: a fault is memory mapped and zeroed anew in the step, and
// CPU seconds against step_s show how busy the cores were. The JSON also
// has the CPU device space's most live + cached bytes (HeapSpace's cache of
// freed blocks; never above its most live bytes). Ends with one JSON line.
//
// --timeline=1 also measures what recording the memory timeline costs
// (kernels/memory_timeline.h; the service records one step in 100 by
// default): the steps alternate between recorded and not, in the same run,
// and the line reports both medians and their ratio.
//
//   bazel run -c opt //bench:step_bench -- --seq_lens=1024,4096
//   bazel run -c opt //bench:step_bench -- --seq_lens=1024 --steps=20 --timeline=1
//   bazel run -c opt --config=cuda //bench:step_bench -- --backend=cuda   # one rank per GPU
//   bazel run -c opt --config=cuda //bench:step_bench -- --backend=cuda --precision=bf16
//
// --precision=fp32|bf16 (fp32 by default) is the step's precision
// (StepOptions::precision); the header and the JSON line name it. In bf16
// the ceiling is the backend's bf16 GEMM (GemmBf16: bf16 A and B, fp32
// accumulation) at the step's shape and a square (2048^3 on the CPU,
// 4096^3 on a GPU, where smaller squares do not reach its rate;
// "ceiling_square_n" in the JSON), timed in batches of back-to-back GEMMs
// synchronised once (bench::TimeBatched, as sgemm_bench), and
// "fraction_of_ceiling" is against it; the fp32 ceiling is timed the same
// way. The ceiling is one device's (on CUDA, one GPU) and model_gflops the
// whole job's, so on CUDA the fractions divide the job's rate by the ranks
// (one GPU each); on the CPU the ranks share the machine whose GEMM rate is
// the ceiling. A step that refuses the precision (TrainingStep::Create: a backend
// that does not compute it) ends the run with exit status 1 and says so, as
// does a step (the warm-up too) whose loss or gradient norm is not finite:
// a wrong result's time is not a speed.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <random>
#include <sys/resource.h>
#include <string>
#include <thread>
#include <vector>

#include <cblas.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/communicator.h"
#include "kernels/memory.h"
#include "kernels/memory_timeline.h"
#include "kernels/model/precision.h"
#include "kernels/step/step.h"
#include "kernels/testing/local_world.h"
#include "worker/trainer.h"

namespace plateau {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The same rate from OpenBLAS's own threads (one per core) on one whole
// cblas_sgemm call, outside the backend, which runs OpenBLAS single-threaded
// and splits GEMMs over its pool (kernels/cpu_ops.h). The ceiling is the
// better of the two, so the backend's choice cannot lower it.
double OpenBlasThreadedRate(int64_t m, int64_t n, int64_t k, int reps) {
  std::vector<float> a(m * k, 0.5f), b(k * n, 0.25f), c(m * n);
  const int before = openblas_get_num_threads();
  openblas_set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  auto call = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m),
                static_cast<int>(n), static_cast<int>(k), 1.0f, a.data(), static_cast<int>(k),
                b.data(), static_cast<int>(n), 0.0f, c.data(), static_cast<int>(n));
  };
  call();  // faults the buffers in, starts the threads
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    double t0 = Now();
    call();
    best = std::max(best, 2.0 * m * n * k / (Now() - t0) / 1e9);
  }
  openblas_set_num_threads(before);
  return best;
}

// The process's minor page faults and CPU seconds (user + system, all
// threads) so far.
struct Usage {
  int64_t minor_faults = 0;
  double cpu_s = 0;
};
Usage UsageNow() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
  return {static_cast<int64_t>(u.ru_minflt), seconds(u.ru_utime) + seconds(u.ru_stime)};
}

template <typename T>
T Median(std::vector<T> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Result {
  int64_t seq_len = 0;
  double step_s = 0, tokens_per_s = 0, gflops = 0;
  // Medians over the timed steps, process-wide (every rank of the local
  // world and the backend's threads): minor page faults and CPU seconds.
  int64_t faults_per_step = 0;
  double cpu_s_per_step = 0;
  // The CPU device space's live + cached bytes at most (HeapSpace keeps
  // freed blocks for reuse; memory.h); 0 on other backends.
  int64_t reserved_peak = 0;
  double recorded_step_s = 0;  // --timeline=1: the median of the recorded steps
  int64_t phases = 0;
  MemoryStats peaks;
};

}  // namespace
}  // namespace plateau

int main(int argc, char** argv) {
  using namespace plateau;
  std::map<std::string, int64_t> f = {{"ranks", 1},     {"hidden", 1024},  {"layers", 2},
                                      {"heads", 8},     {"kv_heads", 4},   {"experts", 8},
                                      {"top_k", 2},     {"expert_ffn", 1024}, {"vocab", 8192},
                                      {"batch", 1},     {"steps", 3},      {"device_mb", 8192},
                                      {"timeline", 0}};
  std::string seq_lens = "1024,4096";
  BackendKind backend = BackendKind::kCpu;  // --backend=cuda: the same step on the GPU (--ranks GPUs)
  Precision precision = Precision::kFp32;   // --precision=bf16: bf16 mixed precision
  bool bad_backend = false, bad_precision = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    size_t eq = a.find('=');
    std::string name = eq == std::string::npos ? a : a.substr(2, eq - 2);
    std::string value = eq == std::string::npos ? "" : a.substr(eq + 1);
    if (name == "seq_lens") {
      seq_lens = value;
    } else if (bench::BackendArg(a, "step_bench", &backend, &bad_backend)) {
      if (bad_backend) return 2;
    } else if (bench::PrecisionArg(a, "step_bench", &precision, &bad_precision)) {
      if (bad_precision) return 2;
    } else if (!f.count(name) || !absl::SimpleAtoi(value, &f[name])) {
      std::fprintf(stderr, "step_bench: bad argument '%s'\n", a.c_str());
      return 2;
    }
  }
  const int P = static_cast<int>(f["ranks"]);
  ModelConfig m;
  m.hidden = f["hidden"];
  m.layers = f["layers"];
  m.heads = f["heads"];
  m.kv_heads = f["kv_heads"];
  m.experts = f["experts"];
  m.top_k = f["top_k"];
  m.expert_ffn = f["expert_ffn"];
  m.vocab_size = f["vocab"];

  const BackendOptions bo = LocalWorldBackend(backend, f["device_mb"] << 20);
  auto probe = Backend::Create(bo);
  if (!probe.ok()) {
    std::fprintf(stderr, "step_bench: %s\n", probe.status().ToString().c_str());
    return 1;
  }
  // The ceiling: square sgemm and the step's dominant shape (tokens x H x F),
  // each the better of the backend's GEMM and (on the CPU) OpenBLAS's own
  // threads. The backend's timed in batches of back-to-back GEMMs
  // synchronised once, the square at the size where the device reaches its
  // rate (2048^3 on the CPU, 4096^3 on a GPU: bench::GemmSquareCeiling).
  const bench::SquareCeiling fp32_square = bench::GemmSquareCeiling(**probe, /*bf16=*/false, /*cpu_n=*/2048);
  const double square_backend = fp32_square.gflops;
  const double shape_backend = bench::GemmRate(**probe, 4096, m.expert_ffn, m.hidden, /*bf16=*/false);
  const bool cpu = backend == BackendKind::kCpu;
  const double square_blas = cpu ? OpenBlasThreadedRate(2048, 2048, 2048, 5) : 0;
  const double shape_blas = cpu ? OpenBlasThreadedRate(4096, m.expert_ffn, m.hidden, 5) : 0;
  const double sgemm_square = std::max(square_backend, square_blas);
  const double sgemm_shape = std::max(shape_backend, shape_blas);
  const double sgemm = std::max(sgemm_square, sgemm_shape);
  const bool bf16 = precision == Precision::kBf16Mixed;
  // The bf16 square at the size where the device reaches its rate (4096^3
  // on a GPU, 2048^3 on the CPU: bench::GemmSquareCeiling says why), both
  // timed in batches of back-to-back GEMMs synchronised once.
  const bench::SquareCeiling bf16_square =
      bf16 ? bench::GemmSquareCeiling(**probe, /*bf16=*/true, /*cpu_n=*/2048) : bench::SquareCeiling{};
  const double bf16_shape = bf16 ? bench::GemmRate(**probe, 4096, m.expert_ffn, m.hidden, /*bf16=*/true) : 0;
  const double ceiling = bf16 ? std::max(bf16_square.gflops, bf16_shape) : sgemm;
  const int64_t ceiling_square_n = bf16 ? bf16_square.n : fp32_square.n;
  // What the ceiling is one of: a GPU per rank on CUDA; the one machine the
  // rank threads share on the CPU.
  const double devices = cpu ? 1.0 : static_cast<double>(P);
  probe->reset();

  std::printf("step_bench: %s\n", (*Backend::Create(bo))->Describe().c_str());
  std::printf("model: H=%lld L=%lld heads=%lld/%lld E=%lld k=%lld F=%lld V=%lld; %lld active params "
              "(%lld total); ranks=%d batch=%lld\n",
              (long long)m.hidden, (long long)m.layers, (long long)m.heads, (long long)m.kv_heads,
              (long long)m.experts, (long long)m.top_k, (long long)m.expert_ffn,
              (long long)m.vocab_size, (long long)ActiveParameterCount(m),
              (long long)ParameterCount(m), P, (long long)f["batch"]);
  std::printf("precision: %s\n", PrecisionName(precision));
  std::printf(
      "sgemm ceiling: %.1f GFLOP/s (%lld^3: %.1f; 4096x%lldx%lld: %.1f; backend / "
      "OpenBLAS threads: %.1f / %.1f, %.1f / %.1f)\n",
      sgemm, (long long)fp32_square.n, sgemm_square, (long long)m.expert_ffn, (long long)m.hidden, sgemm_shape,
      square_backend, square_blas, shape_backend, shape_blas);
  if (bf16) {
    if (ceiling > 0) {
      std::printf("bf16 GEMM ceiling: %.1f GFLOP/s (%lld^3: %.1f; 4096x%lldx%lld: %.1f)\n", ceiling,
                  (long long)bf16_square.n, bf16_square.gflops, (long long)m.expert_ffn, (long long)m.hidden,
                  bf16_shape);
    } else {
      std::printf("bf16 GEMM ceiling: n/a (the backend's GemmBf16 could not be timed)\n");
    }
  }
  std::printf("\n%8s %10s %10s %12s %8s %8s %8s  %s\n", "seq_len", "step_s", "tok/s", "model GF/s",
              bf16 ? "of bf16" : "of sgemm", "cpu_s", "faults", "peak MiB per live set (rank 0)");

  std::vector<Result> results;
  for (absl::string_view sl : absl::StrSplit(seq_lens, ',')) {
    int64_t T = 0;
    if (!absl::SimpleAtoi(sl, &T)) return 2;
    m.seq_len = T;
    Result res;
    res.seq_len = T;
    absl::Status run = RunLocalWorld(
        P, bo, FreshStoreDir(absl::StrCat("bench", T)),
        [&](int r, Backend& be, Communicator& world) -> absl::Status {
          StepOptions o;
          o.model = m;
          o.layout = {P, f["batch"]};
          o.precision = precision;
          auto step = TrainingStep::Create(o, be, world);
          if (!step.ok()) {
            return absl::Status(step.status().code(),
                                absl::StrCat("the step refused --precision=", PrecisionName(precision),
                                             ": ", step.status().message()));
          }
          const int64_t N = TokensPerRank(m, o.layout);
          std::mt19937 rng(r);
          std::vector<int32_t> tok(N), tgt(N);
          for (int64_t i = 0; i < N; ++i) {
            tok[i] = rng() % m.vocab_size;
            tgt[i] = rng() % m.vocab_size;
          }
          std::vector<double> times, recorded, cpu_s;
          std::vector<int64_t> faults;
          MemoryTimelineRecorder timeline(be.device().tracker(), be.host().tracker());
          for (int64_t s = 0; s <= f["steps"]; ++s) {  // step 0 warms up
            // --timeline=1: odd steps recorded, even ones not, so both see the same machine.
            const bool record = f["timeline"] != 0 && s % 2 == 1;
            const Usage u0 = UsageNow();
            double t0 = Now();
            if (record) timeline.Begin();
            auto st = (*step)->Step(tok, tgt, record ? &timeline : nullptr);
            if (!st.ok()) return st.status();
            const absl::Status finite = bench::CheckFiniteStep(
                st->loss, st->grad_norm, absl::StrCat("seq_len ", T, ", step ", s, s == 0 ? " (the warm-up)" : ""));
            if (!finite.ok()) return finite;
            if (s > 0) (record ? recorded : times).push_back(Now() - t0);
            if (s > 0 && !record) {
              const Usage u1 = UsageNow();
              faults.push_back(u1.minor_faults - u0.minor_faults);
              cpu_s.push_back(u1.cpu_s - u0.cpu_s);
            }
            if (r == 0 && !record) res.peaks = st->device;
          }
          std::sort(recorded.begin(), recorded.end());
          if (r == 0) {
            res.step_s = Median(times);
            res.faults_per_step = Median(faults);
            res.cpu_s_per_step = Median(cpu_s);
            if (auto* heap = dynamic_cast<HeapSpace*>(&be.device())) {
              res.reserved_peak = heap->reserved_peak_bytes();
            }
          }
          if (r == 0 && !recorded.empty()) {
            res.recorded_step_s = recorded[recorded.size() / 2];
            res.phases = timeline.phases_seen();
          }
          return absl::OkStatus();
        });
    if (!run.ok()) {
      std::fflush(stdout);  // the table so far, then why it ends
      std::fprintf(stderr, "step_bench: %s\n", run.ToString().c_str());
      return 1;
    }
    const double tokens = static_cast<double>(f["batch"]) * T;
    res.tokens_per_s = tokens / res.step_s;
    res.gflops = ModelFlopsPerStep(m, f["batch"]) / res.step_s / 1e9;
    std::string peaks;
    for (int i = 0; i < kNumLiveSets; ++i) {
      if (res.peaks.peak[i] == 0) continue;
      absl::StrAppendFormat(&peaks, "%s=%.1f ", LiveSetName(static_cast<LiveSet>(i)),
                            res.peaks.peak[i] / 1048576.0);
    }
    std::printf("%8lld %10.3f %10.0f %12.1f %7.1f%% %8.2f %8lld  %s\n", (long long)T, res.step_s, res.tokens_per_s,
                res.gflops, ceiling > 0 ? 100.0 * res.gflops / devices / ceiling : 0.0, res.cpu_s_per_step,
                (long long)res.faults_per_step, peaks.c_str());
    if (res.recorded_step_s > 0) {
      std::printf("%8s memory timeline recorded (%lld phases): median step %.4f s vs %.4f s unrecorded: %.4fx\n",
                  "", (long long)res.phases, res.recorded_step_s, res.step_s, res.recorded_step_s / res.step_s);
    }
    std::fflush(stdout);
    results.push_back(res);
  }
  std::string json = absl::StrFormat(
      "{\"bench\":\"step\",\"precision\":\"%s\",\"ranks\":%d,\"sgemm_gflops\":%.1f,"
      "\"ceiling\":\"%s\",\"ceiling_gflops\":%.1f,\"ceiling_square_n\":%d,\"runs\":[",
      PrecisionName(precision), P, sgemm, bf16 ? "gemm_bf16" : "sgemm", ceiling, ceiling_square_n);
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    // No ceiling measured (a bf16 GEMM that could not be timed): null, not inf.
    const std::string of_ceiling =
        ceiling > 0 ? absl::StrFormat("%.4f", r.gflops / devices / ceiling) : std::string("null");
    absl::StrAppendFormat(&json,
                          "%s{\"seq_len\":%d,\"step_s\":%.4f,\"tokens_per_s\":%.1f,\"model_gflops\":%.2f,\"fraction_of_"
                          "sgemm\":%.4f,\"fraction_of_ceiling\":%s,\"cpu_s_per_step\":%.3f,\"minor_faults_per_step\":%"
                          "d,\"device_reserved_peak_bytes\":%d,\"peak_bytes\":{",
                          i ? "," : "", r.seq_len, r.step_s, r.tokens_per_s, r.gflops, r.gflops / devices / sgemm,
                          of_ceiling, r.cpu_s_per_step, r.faults_per_step, r.reserved_peak);
    bool first = true;
    for (int s = 0; s < kNumLiveSets; ++s) {
      if (r.peaks.peak[s] == 0) continue;
      absl::StrAppendFormat(&json, "%s\"%s\":%d", first ? "" : ",", LiveSetName(static_cast<LiveSet>(s)), r.peaks.peak[s]);
      first = false;
    }
    json += "}";
    if (r.recorded_step_s > 0) {
      absl::StrAppendFormat(&json, ",\"timeline_phases\":%d,\"recorded_step_s\":%.4f,\"recorded_ratio\":%.4f", r.phases,
                            r.recorded_step_s, r.recorded_step_s / r.step_s);
    }
    json += "}";
  }
  json += "]}";
  std::printf("\n%s\n", json.c_str());
  return 0;
}
