// Timing and reporting helpers shared by the benchmarks in bench/.
//
// Every benchmark prints a human-readable table and, as its last line, one
// JSON object (a scripts' line: `tail -1 | jq`).
#ifndef PLATEAU_BENCH_BENCH_UTIL_H_
#define PLATEAU_BENCH_BENCH_UTIL_H_

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/model/config.h"
#include "kernels/model/precision.h"
#include "kernels/status_macros.h"
#include "kernels/stream.h"

namespace plateau::bench {

// The benchmarks' --backend=cpu|cuda (cpu by default; cuda needs a build
// with --config=cuda and one GPU per rank). Returns whether `arg` is that
// flag; sets *kind, or prints why and sets *bad on an unknown value.
inline bool BackendArg(absl::string_view arg, absl::string_view bench, BackendKind* kind, bool* bad) {
  if (!absl::ConsumePrefix(&arg, "--backend=")) return false;
  absl::StatusOr<BackendKind> k = ParseBackendKind(arg);
  if (k.ok()) {
    *kind = *k;
  } else {
    std::fprintf(stderr, "%.*s: --backend: %s\n", static_cast<int>(bench.size()), bench.data(),
                 std::string(k.status().message()).c_str());
    *bad = true;
  }
  return true;
}

// The command line of a bench whose only flag is --quick (small sizes:
// every code path, no meaningful figure). False, after saying why, for
// anything else.
inline bool QuickOnlyArgs(int argc, char** argv, absl::string_view bench, bool* quick) {
  *quick = false;
  for (int i = 1; i < argc; ++i) {
    if (absl::string_view(argv[i]) != "--quick") {
      std::fprintf(stderr, "%.*s: unknown argument '%s' (expected --quick or nothing)\n",
                   static_cast<int>(bench.size()), bench.data(), argv[i]);
      return false;
    }
    *quick = true;
  }
  return true;
}

// The benchmarks' --precision=fp32|bf16 (fp32 by default): the step's
// precision (StepOptions::precision; bf16 = bf16 mixed, kernels/model/
// precision.h). Returns whether `arg` is that flag; sets *p, or prints why
// and sets *bad on another value.
inline bool PrecisionArg(absl::string_view arg, absl::string_view bench, Precision* p, bool* bad) {
  if (!absl::ConsumePrefix(&arg, "--precision=")) return false;
  if (arg == "fp32") {
    *p = Precision::kFp32;
  } else if (arg == "bf16") {
    *p = Precision::kBf16Mixed;
  } else {
    std::fprintf(stderr, "%.*s: --precision: expected fp32 or bf16, got '%.*s'\n",
                 static_cast<int>(bench.size()), bench.data(), static_cast<int>(arg.size()),
                 arg.data());
    *bad = true;
  }
  return true;
}

inline double NowSeconds() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Timing {
  double best_s = 0;
  double median_s = 0;
  int reps = 0;
};

// The median of `v` (the mean of the two middle values for an even count);
// 0 when empty.
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : (v[h - 1] + v[h]) / 2;
}

// Runs `run` (which must wait for its own work) `warmup` times untimed, then
// at least `min_reps` times and until `min_total_s` seconds of timed runs,
// at most `max_reps` times. Best and median of the timed runs.
inline absl::StatusOr<Timing> TimeRuns(const std::function<absl::Status()>& run,
                                       int warmup, int min_reps,
                                       double min_total_s, int max_reps) {
  for (int i = 0; i < warmup; ++i) {
    absl::Status s = run();
    if (!s.ok()) return s;
  }
  std::vector<double> times;
  double total = 0;
  while (static_cast<int>(times.size()) < max_reps &&
         (static_cast<int>(times.size()) < min_reps || total < min_total_s)) {
    const double t0 = NowSeconds();
    absl::Status s = run();
    if (!s.ok()) return s;
    times.push_back(NowSeconds() - t0);
    total += times.back();
  }
  std::sort(times.begin(), times.end());
  Timing t;
  t.best_s = times.front();
  t.median_s = times[times.size() / 2];
  t.reps = static_cast<int>(times.size());
  return t;
}

// Each value rounded to bf16 (round to nearest even, as the kernels store).
inline std::vector<Bf16> ToBf16(const std::vector<float>& v) {
  std::vector<Bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FloatToBf16(v[i]);
  return out;
}

// Fills `v` with pseudo-random values in [-1, 1) (splitmix64): fast enough
// for hundreds of millions of elements, and never zeros, which can run
// faster than real data.
inline void FillRandom(std::vector<float>& v, uint64_t seed) {
  uint64_t x = seed;
  for (float& f : v) {
    x += 0x9e3779b97f4a7c15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    f = static_cast<float>(static_cast<double>(z >> 40) / (1 << 23) - 1.0);
  }
}

// One call of `enqueue` (which enqueues its work on `s`) timed: a warm-up
// (thread pools, cuBLAS heuristics, page faults) that also sizes a batch of
// back-to-back calls lasting ~50 ms, then the best and median of 3 to 10
// batches, per call, each batch synchronised once: on a GPU a single call
// synchronised on its own would count 10-20 us of launch and
// synchronisation, more than a whole 2048^3 bf16 GEMM takes on an H200.
// `inner`: the batch's size.
inline absl::StatusOr<Timing> TimeBatched(Stream& s, const std::function<absl::Status()>& enqueue, int* inner) {
  const double t0 = NowSeconds();
  PLATEAU_RETURN_IF_ERROR(enqueue());
  PLATEAU_RETURN_IF_ERROR(s.Synchronize());
  const double once = NowSeconds() - t0;
  const int n = static_cast<int>(std::clamp(0.05 / std::max(once, 1e-9), 1.0, 1000.0));
  PLATEAU_ASSIGN_OR_RETURN(Timing t, TimeRuns(
                                         [&]() -> absl::Status {
                                           for (int i = 0; i < n; ++i) {
                                             PLATEAU_RETURN_IF_ERROR(enqueue());
                                           }
                                           return s.Synchronize();
                                         },
                                         /*warmup=*/0, /*min_reps=*/3, /*min_total_s=*/0.3,
                                         /*max_reps=*/10));
  t.best_s /= n;
  t.median_s /= n;
  *inner = n;
  return t;
}

// Best GFLOP/s of C = A B at m x n x k (row-major, A m x k, B k x n) through
// the backend: the bf16 GEMM (GemmBf16: bf16 A, B and C, fp32 accumulation)
// or the fp32 one (Gemm), timed in batches (TimeBatched). A and B hold
// random values in [-1, 1), as sgemm_bench's: constant inputs toggle fewer
// bits and can run faster than a step's data. 0 when the backend cannot run
// it (no bf16 GEMM, no room for the three matrices).
inline double GemmRate(Backend& be, int64_t m, int64_t n, int64_t k, bool bf16) {
  const int64_t elem = bf16 ? 2 : 4;
  auto a = be.device().Allocate(LiveSet::kWorkspace, m * k * elem);
  auto b = be.device().Allocate(LiveSet::kWorkspace, k * n * elem);
  auto c = be.device().Allocate(LiveSet::kWorkspace, m * n * elem);
  auto s = be.CreateStream("bench");
  if (!a.ok() || !b.ok() || !c.ok() || !s.ok()) return 0;
  // Copied in from the host: on CUDA the buffers are not host memory.
  for (auto [buf, count, seed] : {std::tuple{&*a, m * k, 1}, {&*b, k * n, 2}}) {
    std::vector<float> host(count);
    FillRandom(host, seed);
    const std::vector<Bf16> rounded = bf16 ? ToBf16(host) : std::vector<Bf16>();
    const void* src = bf16 ? static_cast<const void*>(rounded.data()) : host.data();
    absl::Status copied = be.Copy(**s, buf->data(), src, count * elem);
    if (copied.ok()) copied = (*s)->Synchronize();  // before the host copies are freed
    if (!copied.ok()) return 0;
  }
  std::function<absl::Status()> gemm;
  if (bf16) {
    GemmBf16Args g;
    g.m = m;
    g.n = n;
    g.k = k;
    g.a = a->as<Bf16>();
    g.lda = k;
    g.b = b->as<Bf16>();
    g.ldb = n;
    g.c = c->as<Bf16>();
    g.ldc = n;
    gemm = [&be, &s, g] { return be.GemmBf16(**s, g); };
  } else {
    const GemmArgs g{false, false, m, n, k, 1.0f, a->as<float>(), k, b->as<float>(), n, 0.0f, c->as<float>(), n};
    gemm = [&be, &s, g] { return be.Gemm(**s, g); };
  }
  int inner = 0;
  absl::StatusOr<Timing> t = TimeBatched(**s, gemm, &inner);
  if (!t.ok() || !(t->best_s > 0)) return 0;
  return 2.0 * m * n * k / t->best_s / 1e9;
}

// The square GEMM a ceiling is read from: its side and its rate.
struct SquareCeiling {
  int64_t n = 0;
  double gflops = 0;
};

// The rate of the square GEMM (GemmRate) at a size where the device's GEMM
// reaches its ceiling: a "fraction of the ceiling" is only as honest as the
// ceiling is high. On the CPU `cpu_n`, the caller's size: there a GEMM of
// a few GFLOP already runs for tens of milliseconds, far past any call
// overhead, and a larger one would only lengthen a slow run. On CUDA 4096: an H100/H200 does 2048^3 bf16 (17 GFLOP) in
// ~25 us and 1024^3 in ~3 us, too few tiles to keep its SMs busy even
// batched, while 4096^3 (137 GFLOP, ~0.2 ms) runs at cuBLAS's full rate.
// 1024^3 is timed first: a "GPU" that takes over 10 ms for it (the CPU
// emulation of CUDA, --config=cuda_emulated: a few GFLOP/s on one core,
// minutes for 4096^3) keeps 1024 and that rate, a check of the code path
// rather than a ceiling.
inline SquareCeiling GemmSquareCeiling(Backend& be, bool bf16, int64_t cpu_n) {
  if (be.kind() == BackendKind::kCpu) return {cpu_n, GemmRate(be, cpu_n, cpu_n, cpu_n, bf16)};
  constexpr int64_t kProbe = 1024, kGpu = 4096;
  SquareCeiling probe{kProbe, GemmRate(be, kProbe, kProbe, kProbe, bf16)};
  const double probe_s = probe.gflops > 0 ? 2.0 * kProbe * kProbe * kProbe / (probe.gflops * 1e9) : 0;
  if (probe.gflops <= 0 || probe_s > 0.01) return probe;
  SquareCeiling full{kGpu, GemmRate(be, kGpu, kGpu, kGpu, bf16)};
  return full.gflops >= probe.gflops ? full : probe;
}

// Whether a training step's loss and gradient norm (StepStats::loss,
// ::grad_norm) are finite; INTERNAL, naming the step (`what`: "seq_len 4096,
// step 2") and both values, when not: a step that computes NaN or inf is a
// wrong result, and its time is not a speed. A benchmark that runs steps
// ends its run on it (exit status 1).
inline absl::Status CheckFiniteStep(double loss, double grad_norm, absl::string_view what) {
  if (std::isfinite(loss) && std::isfinite(grad_norm)) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": the loss is ", loss, " and the gradient norm ", grad_norm,
                                          ": a step that is not finite is a wrong result, not a speed"));
}

// The model named by a benchmark's flags "hidden", "heads", "kv_heads",
// "experts", "top_k", "expert_ffn" and "vocab", at `layers` and `seq_len`
// (the other fields keep their defaults).
inline ModelConfig ModelFromFlags(const std::map<std::string, int64_t>& flags, int64_t layers, int64_t seq_len) {
  ModelConfig m;
  m.hidden = flags.at("hidden");
  m.layers = layers;
  m.heads = flags.at("heads");
  m.kv_heads = flags.at("kv_heads");
  m.experts = flags.at("experts");
  m.top_k = flags.at("top_k");
  m.expert_ffn = flags.at("expert_ffn");
  m.vocab_size = flags.at("vocab");
  m.seq_len = seq_len;
  return m;
}

// The value of an environment variable, or "unset".
inline std::string EnvOr(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "unset" : v;
}

inline std::string JsonString(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// `v` as a JSON number (%.6g), or null where it is not finite: JSON has no
// NaN or inf, and a line with "-nan" in it does not parse at all.
inline std::string JsonNumber(double v) { return std::isfinite(v) ? absl::StrFormat("%.6g", v) : "null"; }

// Local date and time, "2026-12-02 10:11:12 UTC+0000".
// (Benchmarks read the clock; results are printed, never compared to
// hard-coded values.)
inline std::string NowText() {
  std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S UTC%z",
                std::localtime(&t));
  return buf;
}

// The 1-minute load average when the benchmark started (other processes
// competing for the cores show here), or -1 where /proc/loadavg is missing.
inline double LoadAverage1m() {
  std::FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return -1;
  double load = -1;
  if (std::fscanf(f, "%lf", &load) != 1) load = -1;
  std::fclose(f);
  return load;
}

// How much of the machine's CPU time other processes used over an interval:
// these benchmarks share their cores with whatever else runs, and a figure
// taken while others were busy is not a ceiling. Reads /proc/stat (all
// busy time) and getrusage (this process's time, all threads).
class CpuMeter {
 public:
  CpuMeter() { Restart(); }
  void Restart() { Read(&busy0_, &total0_, &self0_); }
  // Percent of all core-seconds in the interval spent by other processes,
  // or -1 where /proc/stat cannot be read.
  double OthersPercent() const {
    double busy, total, self;
    Read(&busy, &total, &self);
    if (busy0_ < 0 || busy < 0 || total <= total0_) return -1;
    const double others = (busy - busy0_) - (self - self0_);
    return std::max(0.0, 100.0 * others / (total - total0_));
  }

 private:
  static void Read(double* busy, double* total, double* self) {
    *busy = *total = -1;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    *self = ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 +
            ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
    std::FILE* f = std::fopen("/proc/stat", "r");
    if (f == nullptr) return;
    unsigned long long v[8] = {};
    const int got = std::fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu",
                                &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                                &v[6], &v[7]);
    std::fclose(f);
    if (got != 8) return;
    // user nice system idle iowait irq softirq steal
    const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
    *busy = (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / tick;
    *total = (v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7]) / tick;
  }

  double busy0_, total0_, self0_;
};

// Exits with the status on error: the benchmarks are command-line tools.
template <typename T>
T OrDie(absl::StatusOr<T> v, absl::string_view what) {
  if (!v.ok()) {
    std::fprintf(stderr, "%s: %s\n", std::string(what).c_str(),
                 v.status().ToString().c_str());
    std::exit(1);
  }
  return std::move(*v);
}
inline void OrDie(const absl::Status& s, absl::string_view what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", std::string(what).c_str(),
                 s.ToString().c_str());
    std::exit(1);
  }
}

}  // namespace plateau::bench

#endif  // PLATEAU_BENCH_BENCH_UTIL_H_
