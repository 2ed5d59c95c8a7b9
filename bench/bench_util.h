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
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/model/config.h"
#include "kernels/model/precision.h"

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

// Best GFLOP/s of the bf16 GEMM (bf16 A, B and C, fp32 accumulation) at
// m x n x k over `reps` runs after an untimed one: the ceiling of a bf16
// step (step_bench, composed_bench). 0 when the backend has no bf16 GEMM.
inline double GemmBf16Rate(Backend& be, int64_t m, int64_t n, int64_t k, int reps) {
  auto a = be.device().Allocate(LiveSet::kWorkspace, m * k * 2);
  auto b = be.device().Allocate(LiveSet::kWorkspace, k * n * 2);
  auto c = be.device().Allocate(LiveSet::kWorkspace, m * n * 2);
  auto s = be.CreateStream("bench");
  if (!a.ok() || !b.ok() || !c.ok() || !s.ok()) return 0;
  if (!be.FillBf16(**s, a->as<Bf16>(), m * k, 0.5f).ok() || !be.FillBf16(**s, b->as<Bf16>(), k * n, 0.25f).ok()) {
    return 0;
  }
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
  if (!be.GemmBf16(**s, g).ok() || !(*s)->Synchronize().ok()) return 0;  // untimed first run
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const double t0 = NowSeconds();
    be.GemmBf16(**s, g).IgnoreError();
    if (!(*s)->Synchronize().ok()) return 0;
    best = std::max(best, 2.0 * m * n * k / (NowSeconds() - t0) / 1e9);
  }
  return best;
}

// Each value rounded to bf16 (round to nearest even, as the kernels store).
inline std::vector<Bf16> ToBf16(const std::vector<float>& v) {
  std::vector<Bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FloatToBf16(v[i]);
  return out;
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
