// The composed stack against the all-off baseline (issue 15): at one device
// cap (the CPU backend's capped arena), P ranks, for several model depths,
//
// 1. Reach, predicted: N_max (kernels/budget/n_max.h) of the all-off stack
//    (standard EP, dense projection, full checkpoints, device AdamW) and of
//    the all-on stack (PipelinedLLEP, Ring-DTP, SCO, OffloadStreamAdamW,
//    with c, S, beta and the bucket left `auto`: chosen again at each N the
//    search plans, kernels/budget/auto_settings.h SolveNMaxAuto, on the
//    default CPU curve; --auto=0 runs the flags' fixed values), along both
//    axes: the longest context at `ctx_batch` sequences, and the
//    largest global batch at a shorter common context (a quarter of the
//    baseline's longest, or `batch_seq_len` tokens per sequence).
// 2. Reach, verified by running steps: each predicted shape completes one
//    optimizer step under the cap, and the next step of the axis (seq_len +
//    P, or batch + 1) is refused at launch or runs out of the arena (the
//    all-on stack's at the settings with the smallest plan there). Both
//    run with the routing skewed as far as it goes (router weights zero:
//    every token picks experts 0..k-1, all on rank 0), so standard EP's
//    dispatch reaches the worst case the plan counts; a balanced routing
//    would leave the baseline's prediction loose, not tight.
// 3. Throughput where both run: model FLOP/s (6 x active matmul params x
//    tokens + causal attention; worker/trainer_options.h: the model's
//    FLOPs, not the executed ones, which add the recomputation; see --mfu_s
//    below) at the baseline's longest context and at the shorter one: the
//    baseline at its largest batch there, the composed stack at the same
//    batch and at its own largest batch there; under the seeded router.
//    `rounds` rounds run the three back to back (each in a fresh world, one
//    untimed warm-up step, then `steps` / `own_steps` timed ones), so that
//    drift hits all three; printed: each stack's median and range, the
//    ratio of the medians and the range of the ratios within a round, and
//    what a step costs beyond its wall time — the process's CPU seconds,
//    its threads' blocking waits and rank 0's collectives per step with the
//    bytes they hand over to send (counts no other load changes).
//    --neighbours=1 also times the all-on stack at each neighbour of its
//    `auto` settings (is the chosen combination the fastest that fits?).
// 4. Attribution: at the baseline's longest context, each schedule alone
//    against the baseline (step time, CPU time, waits and collectives).
// Also printed: what limits each stack (its fixed bytes and how each live
// set grows per token), and the baseline's reach were standard EP's
// dispatch counted at its balanced estimate instead of its worst case.
//
// Ends with one JSON line. Exits 1 when a prediction is not verified (the
// predicted shape fails, peaks over its plan, or the next step completes),
// so the --quick run in the test suite fails when N_max and the step drift
// apart. Four rank threads share the cores: one BLAS thread each.
//
//   OPENBLAS_NUM_THREADS=1 bazel run -c opt //bench:composed_bench   # ~8 min on 2 cores, quiet
//   OPENBLAS_NUM_THREADS=1 bazel run -c opt //bench:composed_bench -- --quick   # < 1 min
//   bazel run -c opt //bench:composed_bench -- --plan_only   # predictions only
//   bazel run -c opt --config=cuda //bench:composed_bench -- --backend=cuda --ranks=1 --cap_mb=...
//   ... --precision=bf16   # both stacks planned and run in bf16 mixed precision (the header and
//                          # the JSON line name the precision; a step that refuses it fails the run)
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "bench/context_ladder.h"
#include "kernels/backend.h"
#include "kernels/budget/auto_settings.h"
#include "kernels/budget/budget.h"
#include "kernels/budget/n_max.h"
#include "kernels/checkpoints/checkpoints_plan.h"
#include "kernels/communicator.h"
#include "kernels/device_peaks.h"
#include "kernels/model/config.h"
#include "kernels/model/precision.h"
#include "kernels/model/reference.h"
#include "kernels/model/step_options.h"
#include "kernels/phase_clock.h"
#include "kernels/step/step.h"
#include "kernels/testing/counting_communicator.h"
#include "kernels/testing/local_world.h"
#include "worker/trainer_options.h"

namespace plateau {
namespace {

using bench::Median;
using bench::NowSeconds;

// Defaults: the full run (BENCHMARKS.md says why this regime). --quick
// replaces some of them (QuickDefaults) before the command line is read.
std::map<std::string, int64_t> flags = {
    {"ranks", 4},
    {"hidden", 64},
    {"heads", 4},
    {"kv_heads", 1},
    {"experts", 16},
    {"top_k", 4},
    {"expert_ffn", 64},
    {"vocab", 4096},
    {"cap_mb", 20},
    {"ctx_batch", 1},      // sequences on the context axis
    {"batch_seq_len", 0},  // tokens per sequence on the batch axis (0: the baseline's longest / 4)
    // All-on settings. With auto (the default) c, S, beta and the bucket are
    // chosen at each shape and the four flags below are not used.
    {"auto", 1},
    {"chunk_tokens", 64},      // PipelinedLLEP c
    {"min_piece", 256},        // LLEP's smallest moved piece
    {"max_borrowed", 1},       // experts one rank may borrow per chunk (0: no cap)
    {"strip", 256},            // Ring-DTP S (vocabulary columns)
    {"row_tile", 256},         // Ring-DTP token rows per strip tile
    {"bucket_params", 65536},  // OffloadStreamAdamW bucket
    {"staging_slots", 2},
    // Throughput. Each round runs the stacks back to back (off, on at the
    // same batch, on at its own largest batch), each in a fresh world with
    // one untimed warm-up step, so that drift over the run hits all three;
    // the ratios are taken within a round and their spread printed.
    {"steps", 3},  // timed steps per stack per round at the same batch
    // Timed steps per round at the all-on stack's own largest batch (~40x the work).
    {"own_steps", 1},
    {"rounds", 3},
    // 1: at each same-batch point, also time the all-on stack at each
    // neighbour of its `auto` settings (one setting halved or doubled to
    // the next candidate, where the plan still fits the cap): is the chosen
    // combination the fastest fitting one on this machine?
    {"neighbours", 0},
    // Each rank's CPU pool threads (BackendOptions::cpu_threads; 0: one per
    // core). The results are the same bits for any value; P ranks' pools on
    // fewer cores oversubscribe them.
    {"cpu_threads", 0},
    {"own", 1},  // 0: skip the all-on stack's own largest batch (for timing experiments)
    // Which schedules "all on" turns on (bits: 1 pipelined_llep, 2 ring_dtp,
    // 4 sco, 8 offload_stream_adamw): 15 is the composed stack; others are
    // for attributing its cost to one schedule.
    {"on_mask", 15},
    // 1: the all-on stack keeps each layer's attention forward for the
    // backward (CheckpointOptions::keep_attention: its recompute skips
    // attention's forward, for L N (heads d + heads) fp32 more device bytes);
    // the attribution times it alone, and all four with it, not the single
    // schedules. 0 or 1.
    {"keep_attention", 0},
    {"plan_only", 0},
    {"attribute", 1},  // time each schedule alone at the baseline's longest context
    {"verify", 1},     // 0: skip the reach runs (for timing experiments)
    {"quick", 0},
    // --mfu_s=S (issue 17's MFU target): instead of the comparison above,
    // the all-on stack alone at the longest context of the cap that S
    // seconds allow (RunMfu), each step's model TFLOP/s and MFU.
    {"mfu_s", 0},
    {"mfu_start", 16384},          // the ladder's first context (rounded to 1024 P)
    {"mfu_growth", 4},             // the most FLOPs one rung does over the last's
    {"mfu_max_seq_len", 1 << 20},  // N_max searched up to this (the job spec's limit)
    {"peak_tflops", 0},            // the device's peak for MFU (0: its entry in kernels/device_peaks.h)
};
std::string depths_flag = "8,10,12";
// --backend=cuda: every step on the GPU (one rank per GPU: --ranks=1 on one
// card) under the same cap, now a cap below the card's memory.
BackendKind backend_kind = BackendKind::kCpu;
// --precision=fp32|bf16: both stacks' StepOptions::precision, so the budget
// plans (N_max) and the steps run in it.
Precision precision_flag = Precision::kFp32;

void QuickDefaults() {
  flags["cap_mb"] = 8;
  flags["hidden"] = 32;
  flags["heads"] = 2;
  flags["experts"] = 8;
  flags["top_k"] = 2;
  flags["expert_ffn"] = 32;
  flags["vocab"] = 1024;
  flags["chunk_tokens"] = 128;
  flags["min_piece"] = 16;
  flags["strip"] = 128;
  flags["row_tile"] = 128;
  flags["bucket_params"] = 16384;
  flags["steps"] = 1;
  flags["own_steps"] = 1;
  flags["rounds"] = 1;
  flags["attribute"] = 0;
  depths_flag = "4";
}

int Ranks() { return static_cast<int>(flags["ranks"]); }

ModelConfig Model(int64_t layers, int64_t seq_len) { return bench::ModelFromFlags(flags, layers, seq_len); }

// The two stacks. SCO's beta is "every boundary that can leave": a host
// budget larger than L - 1 boundaries at any N searched, so the pool holds
// L - 1 of the L + 1 boundaries at every shape (no host cap is set).
constexpr int64_t kScoEveryBoundary = int64_t{1} << 50;

StepOptions Stack(bool on, int64_t layers, int64_t seq_len, int64_t batch) {
  StepOptions o;
  o.model = Model(layers, seq_len);
  o.layout = {Ranks(), batch};
  o.precision = precision_flag;
  if (!on) return o;  // the defaults are the four baselines
  o.checkpoints.keep_attention = flags["keep_attention"] != 0;
  const int64_t mask = flags["on_mask"];
  if (mask & 1) {
    o.dispatch.kind = DispatchOptions::Kind::kPipelinedLlep;
    o.dispatch.pipelined.chunk_tokens = flags["chunk_tokens"];
    o.dispatch.pipelined.balance.min_piece = flags["min_piece"];
    o.dispatch.pipelined.balance.max_borrowed = flags["max_borrowed"];
  }
  if (mask & 2) {
    o.projection.kind = ProjectionOptions::Kind::kRingDtp;
    o.projection.strip = flags["strip"];
    o.projection.row_tile = flags["row_tile"];
  }
  if (mask & 4) {
    o.checkpoints.kind = CheckpointOptions::Kind::kSco;
    o.checkpoints.host_budget_bytes = kScoEveryBoundary;
  }
  if (mask & 8) {
    o.optimizer_placement.kind = OptimizerPlacementOptions::Kind::kOffloadStream;
    o.optimizer_placement.bucket_params = flags["bucket_params"];
    o.optimizer_placement.staging_slots = flags["staging_slots"];
  }
  return o;
}

const char* StackName(bool on) { return on ? "all on" : "all off"; }

// The all-on stack's `auto` settings: each schedule's that on_mask turns on
// (none with --auto=0).
AutoRequest AutoOf() {
  AutoRequest r;
  if (flags["auto"] == 0) return r;
  const int64_t mask = flags["on_mask"];
  r.chunk_tokens = (mask & 1) != 0;
  r.strip = (mask & 2) != 0;
  r.host_budget = (mask & 4) != 0;
  r.bucket_params = (mask & 8) != 0;
  return r;
}

// The time model's curves: the documented default CPU curve, so that the
// chosen settings are the same on every machine. (Whether a shape fits does
// not depend on the curve: only which fitting settings are chosen.)
const Calibration& Curve() {
  static const Calibration c = DefaultCalibration(CalibrationBackend::kCpu);
  return c;
}

// The stack at one shape as it runs: all on with its `auto` settings chosen
// for that shape against `cap` (where nothing fits, the settings with the
// smallest plan, which the step refuses).
StepOptions Chosen(bool on, int64_t layers, int64_t seq_len, int64_t batch, int64_t cap,
                   const Calibration& curve = Curve()) {
  StepOptions o = Stack(on, layers, seq_len, batch);
  if (!on || !AutoOf().any()) return o;
  bench::OrDie(AutoShapePlan(AutoOf(), curve, FitCaps{cap, 0})(&o).status(), "AutoShapePlan");
  return o;
}

// "c=32 S=256 beta=7/9 boundaries bucket=1024": the settings a stack ran with.
std::string SettingsText(const StepOptions& o) {
  std::vector<std::string> parts;
  if (o.dispatch.kind == DispatchOptions::Kind::kPipelinedLlep) {
    parts.push_back(absl::StrCat("c=", o.dispatch.pipelined.chunk_tokens));
  }
  if (o.projection.kind == ProjectionOptions::Kind::kRingDtp) parts.push_back(absl::StrCat("S=", o.projection.strip));
  if (o.checkpoints.kind == CheckpointOptions::Kind::kSco) {
    const ScoPools sco = CheckpointPools(o);
    parts.push_back(absl::StrCat("beta=", sco.boundaries.host_boundaries, "/", sco.boundaries.boundaries, " boundaries",
                                 sco.records.boundaries > 0 ? absl::StrCat(" ", sco.records.host_boundaries, "/",
                                                                           sco.records.boundaries, " records")
                                                            : ""));
  }
  if (o.optimizer_placement.kind == OptimizerPlacementOptions::Kind::kOffloadStream) {
    parts.push_back(absl::StrCat("bucket=", o.optimizer_placement.bucket_params));
  }
  if (o.checkpoints.keep_attention) parts.push_back("keep_attention");
  return parts.empty() ? "baselines" : absl::StrJoin(parts, " ");
}

double MiB(int64_t b) { return b / 1048576.0; }

// The plan's device bytes fixed by the model alone (weights, gradients,
// optimizer state and its staging): what the regime is chosen around.
int64_t Persistent(const MemoryPlan& p) {
  return p.bytes[static_cast<int>(LiveSet::kWeights)] + p.bytes[static_cast<int>(LiveSet::kGrads)] +
         p.bytes[static_cast<int>(LiveSet::kOptimizer)];
}

// The largest device live sets of a plan, "activations 12.3 MiB, ...".
std::string Largest(const MemoryPlan& p, int count) {
  std::vector<std::pair<int64_t, int>> sets;
  for (int i = 0; i < kNumLiveSets; ++i) sets.push_back({p.bytes[i], i});
  std::sort(sets.rbegin(), sets.rend());
  std::string out;
  for (int i = 0; i < count && i < static_cast<int>(sets.size()); ++i) {
    if (sets[i].first == 0) break;
    absl::StrAppendFormat(&out, "%s%s %.1f", i ? ", " : "", LiveSetName(static_cast<LiveSet>(sets[i].second)),
                          MiB(sets[i].first));
  }
  return out;
}

// How each device live set grows with the tokens per rank near a shape, at
// the settings it ran with there (SCO pooling the same boundaries):
// (plan at seq_len + 64 P - plan at seq_len) / (64 batch), bytes per token
// per rank; the sets that do not grow are the fixed part. What limits each
// stack's reach is the cap less its fixed part, over this growth.
std::array<double, kNumLiveSets> GrowthPerToken(const StepOptions& at) {
  const int64_t step = 64 * Ranks();
  StepOptions further = at;
  further.model.seq_len += step;
  if (at.checkpoints.kind == CheckpointOptions::Kind::kSco) {
    const ModelConfig& m = at.model;
    // The same pooled boundaries (in the working type: bf16 2 bytes an
    // element) and attention records (fp32) at the larger N, as
    // PlanScoPools pools them.
    const int64_t width = ElementBytesOf(at.precision).working;
    const ScoPools pools = CheckpointPools(at);
    const int64_t N = TokensPerRank(further.model, further.layout);
    further.checkpoints.host_budget_bytes =
        pools.boundaries.host_boundaries * N * m.hidden * width +
        pools.records.host_boundaries * N * AttentionRecordWidth(at) * static_cast<int64_t>(sizeof(float));
  }
  const MemoryPlan a = PlanMemory(at).value();
  const MemoryPlan b = PlanMemory(further).value();
  std::array<double, kNumLiveSets> g{};
  for (int i = 0; i < kNumLiveSets; ++i) {
    g[i] = static_cast<double>(b.bytes[i] - a.bytes[i]) / (64.0 * at.layout.batch);
  }
  return g;
}

std::string GrowthText(const std::array<double, kNumLiveSets>& g) {
  std::string out;
  double total = 0;
  for (int i = 0; i < kNumLiveSets; ++i) {
    if (g[i] < 1) continue;
    total += g[i];
    absl::StrAppendFormat(&out, "%s %.0f, ", LiveSetName(static_cast<LiveSet>(i)), g[i]);
  }
  return absl::StrFormat("%stotal %.0f B per token per rank", out, total);
}

std::string GrowthJson(const std::array<double, kNumLiveSets>& g) {
  std::string out = "{";
  for (int i = 0; i < kNumLiveSets; ++i) {
    absl::StrAppendFormat(&out, "%s\"%s\":%.1f", i ? "," : "", LiveSetName(static_cast<LiveSet>(i)), g[i]);
  }
  return out + "}";
}

// The baseline's longest context at `batch` sequences if standard EP's
// dispatch were counted at its balanced estimate (each rank receives N k
// rows) instead of the worst case: what an operator could get with
// force_launch and a router that stays balanced, unguaranteed (a skewed
// layer then runs out of memory mid-step). For context on the guaranteed
// figure; found on the plan alone, doubling then bisection in steps of P.
int64_t BalancedContextReach(int64_t layers, int64_t batch, int64_t cap) {
  auto fits = [&](int64_t t) {
    const MemoryPlan p = PlanMemory(Stack(false, layers, t * Ranks(), batch)).value();
    return p.total() - p.bytes[static_cast<int>(LiveSet::kDispatch)] + p.dispatch_balanced_bytes <= cap;
  };
  if (!fits(1)) return 0;
  int64_t lo = 1, hi = 2;
  while (fits(hi)) {
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo * Ranks();
}

// Random tokens and targets for rank r's N = B T / P positions, from a
// fixed seed per rank: neither the step's memory nor its speed depends on
// the text (the routing is set by the router's weights).
void RankTokens(const StepOptions& o, int r, std::vector<int32_t>* tok, std::vector<int32_t>* tgt) {
  const int64_t n = TokensPerRank(o.model, o.layout);
  std::mt19937_64 rng(1000 + r);
  tok->resize(n);
  tgt->resize(n);
  for (int64_t i = 0; i < n; ++i) {
    (*tok)[i] = static_cast<int32_t>(rng() % o.model.vocab_size);
    (*tgt)[i] = static_cast<int32_t>(rng() % o.model.vocab_size);
  }
}

// Initial weights with every router weight zero, and zero moments: loaded
// into a step, every token then picks experts 0..k-1 (all owned by rank 0),
// which receives every route of every rank: standard EP's worst case.
ModelState SkewedState(const ModelConfig& m) {
  ModelState st;
  st.weights = InitWeights<float>(m, 1);
  const std::vector<WeightSpec> specs = ModelWeights(m);
  for (size_t t = 0; t < specs.size(); ++t) {
    if (absl::StrContains(specs[t].name, "router.weight")) {
      std::fill(st.weights[t].begin(), st.weights[t].end(), 0.0f);
    }
  }
  st.m = ZerosLike(st.weights);
  st.v = ZerosLike(st.weights);
  st.step = 0;
  return st;
}

// The backend of each rank: the cap, and the pool's threads.
BackendOptions RankBackend(int64_t cap) {
  BackendOptions bo = LocalWorldBackend(backend_kind, cap);
  bo.cpu_threads = static_cast<int>(flags["cpu_threads"]);
  return bo;
}

struct Attempt {
  absl::Status status;
  bool at_launch = false;  // refused by TrainingStep::Create
  int64_t peak = 0;        // the largest device total peak over ranks
  double seconds = 0;
};

// One optimizer step of `o` under the cap, with the skewed routing (the
// state is shared by the rank threads, read only).
Attempt OneStep(const StepOptions& o, const ModelState& skewed, int64_t cap) {
  Attempt a;
  std::vector<int64_t> peaks(Ranks(), 0);
  std::vector<int> launched(Ranks(), 0);
  const double t0 = NowSeconds();
  a.status = RunLocalWorld(Ranks(), RankBackend(cap), FreshStoreDir("composed"), [&](int r, Backend& be, Communicator& world) {
    auto step = TrainingStep::Create(o, be, world);
    if (!step.ok()) return step.status();
    launched[r] = 1;
    absl::Status s = (*step)->LoadState(skewed);
    if (!s.ok()) return s;
    std::vector<int32_t> tok, tgt;
    RankTokens(o, r, &tok, &tgt);
    auto st = (*step)->Step(tok, tgt);
    if (!st.ok()) return st.status();
    peaks[r] = st->device.total_peak;
    // A step that completes with a loss that is not finite has not shown
    // that the shape trains under the cap.
    return bench::CheckFiniteStep(st->loss, st->grad_norm, "the reach's step");
  });
  a.seconds = NowSeconds() - t0;
  a.at_launch = !a.status.ok() && std::count(launched.begin(), launched.end(), 1) < Ranks();
  a.peak = *std::max_element(peaks.begin(), peaks.end());
  return a;
}

// Whether the step takes --precision on this backend: TrainingStep::Create
// of the all-off stack at one layer and the shortest context, before any
// measurement, so that a refused precision ends the run saying so rather
// than reading as an unverified prediction (OneStep counts a refusal at
// launch as "over the cap").
absl::Status CheckPrecisionRuns(int64_t cap) {
  const StepOptions o = Stack(false, 1, Ranks(), 1);
  return RunLocalWorld(Ranks(), RankBackend(cap), FreshStoreDir("composed_precision"),
                       [&](int, Backend& be, Communicator& world) -> absl::Status {
                         return TrainingStep::Create(o, be, world).status();
                       });
}

// Rank 0's collectives per step by kind, and the KiB its calls handed over
// to send (CountingCommunicator::Table::bytes): at these shapes a
// collective's cost is its round trips, not its bytes.
std::string CountsText(const CountingCommunicator::Counts& c, const CountingCommunicator::Counts& bytes,
                       int64_t steps) {
  std::vector<std::string> parts, kib;
  int64_t total = 0, total_bytes = 0;
  for (const auto& [op, n] : c) {
    total += n;
    parts.push_back(absl::StrFormat("%s %.0f", op, static_cast<double>(n) / steps));
  }
  for (const auto& [op, n] : bytes) {
    total_bytes += n;
    kib.push_back(absl::StrFormat("%s %.1f", op, static_cast<double>(n) / steps / 1024));
  }
  return absl::StrFormat("%.0f collectives per step (%s), sending %.1f KiB (%s)",
                         static_cast<double>(total) / steps, absl::StrJoin(parts, ", "),
                         static_cast<double>(total_bytes) / steps / 1024, absl::StrJoin(kib, ", "));
}

// The rank threads meet here before and after their timed steps, so that
// the process's CPU time is read while no rank is inside one.
class Meeting {
 public:
  explicit Meeting(int n) : n_(n) {}
  void Arrive() {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t gen = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != gen; });
  }

 private:
  const int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int64_t generation_ = 0;
};

// User + system CPU seconds of the whole process (every thread) so far,
// and its voluntary context switches (a thread blocking: a stream or
// collective wait, a handoff between threads), which other processes' load
// changes little.
struct ProcessUsage {
  double cpu_s = 0;
  int64_t waits = 0;
};
ProcessUsage ReadUsage() {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return {ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6,
          static_cast<int64_t>(ru.ru_nvcsw)};
}

// Runs one warm-up step and then `steps` timed steps under the seeded
// router; appends each timed step's seconds (its slowest rank's) to `times`
// and sets `*cpu_s` to the process's CPU seconds per timed step (all
// ranks' threads: compute, streams, Gloo): the work a step costs, which
// other processes' load moves far less than its wall time.
// `first_loss`, when given, gets rank 0's loss of the first (untimed)
// step; a step whose loss or gradient norm is not finite fails the run (a
// wrong result's time is not a throughput).
absl::Status TimeSteps(const StepOptions& o, int64_t cap, int64_t steps, std::vector<double>* times,
                       ProcessUsage* usage = nullptr, std::string* counts_text = nullptr,
                       double* first_loss = nullptr) {
  std::vector<std::vector<double>> per_rank(Ranks());
  Meeting meeting(Ranks());
  ProcessUsage u0, u1;
  CountingCommunicator::Table table;
  CountingCommunicator::Counts before, before_bytes;
  absl::Status s = RunLocalWorld(Ranks(), RankBackend(cap), FreshStoreDir("composed-t"), [&](int r, Backend& be, Communicator& real) {
    CountingCommunicator::Table mine;
    CountingCommunicator world(real, r == 0 ? &table : &mine);
    auto step = TrainingStep::Create(o, be, world);
    // Every rank reaches both meetings, also one whose step fails (its
    // error ends the world after them).
    absl::Status failed = step.status();
    int met = 0;
    std::vector<int32_t> tok, tgt;
    if (failed.ok()) RankTokens(o, r, &tok, &tgt);
    for (int64_t i = 0; i <= steps && failed.ok(); ++i) {
      if (i == 1) {
        meeting.Arrive();
        ++met;
        if (r == 0) {
          u0 = ReadUsage();
          before = table.Read();
          before_bytes = table.ReadBytes();
        }
      }
      const double t0 = NowSeconds();
      auto st = (*step)->Step(tok, tgt);
      if (!st.ok()) {
        failed = st.status();
      } else if (absl::Status finite = bench::CheckFiniteStep(st->loss, st->grad_norm, absl::StrCat("step ", i + 1));
                 !finite.ok()) {
        failed = finite;
      } else if (i == 0 && r == 0 && first_loss != nullptr) {
        *first_loss = st->loss;
      }
      if (i > 0) per_rank[r].push_back(NowSeconds() - t0);
    }
    for (; met < 2; ++met) meeting.Arrive();
    if (r == 0) u1 = ReadUsage();
    return failed;
  });
  if (!s.ok()) return s;
  for (int64_t i = 0; i < steps; ++i) {
    double slowest = 0;
    for (int r = 0; r < Ranks(); ++r) slowest = std::max(slowest, per_rank[r][i]);
    times->push_back(slowest);
  }
  if (usage != nullptr) *usage = {(u1.cpu_s - u0.cpu_s) / steps, (u1.waits - u0.waits) / steps};
  CountingCommunicator::Counts counts = table.Read(), bytes = table.ReadBytes();
  for (const auto& [op, n] : before) counts[op] -= n;
  for (const auto& [op, n] : before_bytes) bytes[op] -= n;
  if (counts_text != nullptr) *counts_text = CountsText(counts, bytes, steps);
  return absl::OkStatus();
}

// What the machine could do: on the CPU the 1024^3 GEMM's rate on one BLAS
// thread (the ranks run one each), times the cores online; on CUDA one
// GPU's rate. The model FLOP/s below are reported beside it. Returns the
// square's side with the rate.
bench::SquareCeiling SgemmCeiling() {
  // One pool thread: the backend splits a GEMM over its pool, and the
  // ceiling is one core's rate times the cores. On CUDA room for a 4096^3
  // GEMM's three matrices (bench::GemmSquareCeiling).
  const bool cuda = backend_kind == BackendKind::kCuda;
  BackendOptions bo = LocalWorldBackend(backend_kind, cuda ? int64_t{512} << 20 : int64_t{64} << 20);
  bo.cpu_threads = 1;
  auto be = Backend::Create(bo);
  if (!be.ok()) return {};
  // The step's precision's GEMM: a bf16 step's ceiling is the bf16 GEMM, as
  // step_bench's; an fp32 sgemm ceiling made a bf16 step's percentage many
  // times too high. Timed in batches at the size where a GPU reaches its
  // rate (4096^3; 1024^3 on the CPU), as step_bench's: 1024^3 timed call by
  // call read an H200's rate low (bf16 several times, fp32 by ~20-35%).
  bench::SquareCeiling best =
      bench::GemmSquareCeiling(**be, /*bf16=*/precision_flag == Precision::kBf16Mixed, /*cpu_n=*/1024);
  // One GPU per rank: its own rate is the ceiling; on the CPU the ranks
  // share the cores.
  if (cuda) return best;
  best.gflops *= static_cast<double>(sysconf(_SC_NPROCESSORS_ONLN));
  return best;
}

// One axis of one stack: the prediction and what the steps said.
struct Reach {
  NMaxAxis axis;
  StepOptions options;        // the predicted shape as it ran (its settings)
  int64_t planned_total = 0;  // the plan at the predicted shape
  Attempt at, next;
  bool verified = false;
};

std::string Describe(const Attempt& a) {
  if (a.status.ok()) return absl::StrFormat("completed (peak %.2f MiB, %.1f s)", MiB(a.peak), a.seconds);
  return absl::StrCat(a.at_launch                                               ? "refused at launch"
                      : a.status.code() == absl::StatusCode::kResourceExhausted ? "out of memory mid-step"
                                                                                : "failed mid-step",
                      absl::StrFormat(" after %.1f s: ", a.seconds), a.status.message());
}

// Verifies one axis: the predicted shape completes one step under the cap
// with its measured peak within its plan, and the next step of the axis
// does not (RESOURCE_EXHAUSTED, at launch or mid-step).
Reach VerifyAxis(bool on, int64_t layers, const NMaxAxis& axis, bool context_axis, const ModelState& skewed,
                 int64_t cap, bool run) {
  Reach r;
  r.axis = axis;
  if (axis.tokens_per_rank == 0) return r;  // nothing fits: not verified
  const StepOptions at = Chosen(on, layers, axis.seq_len, axis.batch, cap);
  r.options = at;
  r.planned_total = PlanMemory(at).value().total();
  if (!run) return r;
  // One step more, at the settings chosen there: none fits, so these are
  // the settings with the smallest plan. It is run, not refused from its
  // plan: N_max is where the plan stops fitting, so the plan's refusal would
  // hold by construction, while the run shows the plan is tight. Where the
  // plan's excess is launch-sized (the all-on stack: PipelinedLLEP's
  // buffers are) TrainingStep::Create refuses it before any work; standard
  // EP's dispatch is allocated per layer call as the routing asks
  // (MemoryPlan::routing_bytes, which Create does not count), so the
  // baseline runs until an allocation passes the cap: one more sequence on
  // the batch axis overflows in the first layer's forward, one more token
  // per rank on the context axis only in the last layer's backward (standard
  // EP's Backward holds the most), after the whole forward, the projection
  // both ways and that layer's recomputation: about half of a step's
  // executed work at device-check's shape (H 1024, V 32768, L 4), more
  // where the projection's share is larger. "next_s" in the JSON (and the
  // seconds printed) is what it took.
  const StepOptions next = Chosen(on, layers, axis.seq_len + (context_axis ? Ranks() : 0),
                                  axis.batch + (context_axis ? 0 : 1), cap);
  r.at = OneStep(at, skewed, cap);
  r.next = OneStep(next, skewed, cap);
  // The plan is an upper bound of the peak (and the arena's cap of both).
  r.verified = r.at.status.ok() && r.at.peak <= r.planned_total &&
               r.next.status.code() == absl::StatusCode::kResourceExhausted;
  return r;
}

// The timed steps of one stack at one point: every step (its slowest
// rank's seconds) and each round's median.
struct Times {
  std::vector<double> all;
  std::vector<double> rounds;
  std::vector<double> cpu;    // process CPU seconds per step, one per round
  std::vector<double> waits;  // process voluntary context switches per step, one per round
  double waits_median() const { return Median(waits); }
  std::string collectives;  // rank 0's collectives per timed step (CountsText)
  std::vector<double> first_losses;  // rank 0's first-step loss, one per round
  double cpu_median() const { return Median(cpu); }
  double median() const { return Median(all); }
  double min() const { return all.empty() ? 0 : *std::min_element(all.begin(), all.end()); }
  double max() const { return all.empty() ? 0 : *std::max_element(all.begin(), all.end()); }
};

// Times `steps` steps of `o` in a fresh world (after its warm-up) into `t`.
absl::Status TimeRound(const StepOptions& o, int64_t cap, int64_t steps, Times* t) {
  std::vector<double> round;
  ProcessUsage u;
  double first_loss = 0;
  absl::Status s = TimeSteps(o, cap, steps, &round, &u, &t->collectives, &first_loss);
  if (!s.ok()) return s;
  t->first_losses.push_back(first_loss);
  t->cpu.push_back(u.cpu_s);
  t->waits.push_back(static_cast<double>(u.waits));
  t->all.insert(t->all.end(), round.begin(), round.end());
  t->rounds.push_back(Median(round));
  return absl::OkStatus();
}

// The spread of a throughput ratio: the ratio within each round (the two
// stacks ran back to back there), smallest and largest. `work` is the
// all-on stack's model FLOPs over the baseline's per step.
std::pair<double, double> RoundRatios(const Times& off, const Times& on, double work) {
  double lo = 0, hi = 0;
  for (size_t i = 0; i < off.rounds.size() && i < on.rounds.size(); ++i) {
    const double r = work * off.rounds[i] / on.rounds[i];
    lo = i == 0 ? r : std::min(lo, r);
    hi = i == 0 ? r : std::max(hi, r);
  }
  return {lo, hi};
}

// Model FLOP/s at one context length: the baseline at its largest batch
// there, the composed stack at the same batch (the same work: what the
// schedules cost or save per step), and the composed stack at its own
// largest batch there (what a user training at that length gets: the
// paper's comparison at the baseline's longest lengths).
struct Throughput {
  int64_t seq_len = 0, off_batch = 0, on_batch = 0;
  std::string same_settings, own_settings;  // the all-on stack's chosen settings
  Times off, same, own;
  double off_s = 0, same_s = 0, own_s = 0;  // median seconds per step
  double off_gflops = 0, same_gflops = 0, own_gflops = 0;
  std::pair<double, double> same_ratio_range, own_ratio_range;  // RoundRatios
};

absl::StatusOr<Throughput> MeasureThroughput(int64_t layers, int64_t seq_len, int64_t off_batch, int64_t on_batch,
                                             int64_t cap) {
  if (!flags["own"]) on_batch = off_batch;
  Throughput t;
  t.seq_len = seq_len;
  t.off_batch = off_batch;
  t.on_batch = on_batch;
  const StepOptions off = Stack(false, layers, seq_len, off_batch);
  const StepOptions same = Chosen(true, layers, seq_len, off_batch, cap);
  const StepOptions own = Chosen(true, layers, seq_len, on_batch, cap);
  t.same_settings = SettingsText(same);
  t.own_settings = SettingsText(own);
  // Rounds alternate the three so that all see the same machine.
  for (int64_t round = 0; round < flags["rounds"]; ++round) {
    absl::Status s = TimeRound(off, cap, flags["steps"], &t.off);
    if (s.ok()) s = TimeRound(same, cap, flags["steps"], &t.same);
    if (s.ok() && on_batch != off_batch) s = TimeRound(own, cap, flags["own_steps"], &t.own);
    if (!s.ok()) return s;
  }
  if (on_batch == off_batch) t.own = t.same;
  // The all-on stack at the baseline's batch is the same step (the same
  // tokens, weights and seed): its first loss must be the baseline's to
  // rounding (fp32 1e-4, bf16 1e-2 relative: the schedules reorder sums),
  // or its time is a wrong result's.
  const double tol = precision_flag == Precision::kBf16Mixed ? 1e-2 : 1e-4;
  for (size_t i = 0; i < t.off.first_losses.size() && i < t.same.first_losses.size(); ++i) {
    const double a = t.off.first_losses[i], b = t.same.first_losses[i];
    if (!(std::abs(a - b) <= tol * std::abs(a))) {
      return absl::InternalError(absl::StrFormat(
          "L = %d, T = %d, batch %d: the all-on stack's first loss %.9g is not the baseline's %.9g (round %d)", layers,
          seq_len, off_batch, b, a, i + 1));
    }
  }
  const ModelConfig m = Model(layers, seq_len);
  t.off_s = t.off.median();
  t.same_s = t.same.median();
  t.own_s = t.own.median();
  t.off_gflops = ModelFlopsPerStep(m, off_batch) / t.off_s / 1e9;
  t.same_gflops = ModelFlopsPerStep(m, off_batch) / t.same_s / 1e9;
  t.own_gflops = ModelFlopsPerStep(m, on_batch) / t.own_s / 1e9;
  t.same_ratio_range = RoundRatios(t.off, t.same, 1.0);
  t.own_ratio_range = RoundRatios(t.off, t.own, ModelFlopsPerStep(m, on_batch) / ModelFlopsPerStep(m, off_batch));
  return t;
}

// The chosen settings' neighbours at one shape: each `auto` setting moved
// to the candidate just below and just above its chosen value (the others
// as chosen), where the plan still fits the cap.
std::vector<StepOptions> Neighbours(const StepOptions& chosen, int64_t cap) {
  std::vector<StepOptions> out;
  const AutoRequest request = AutoOf();
  for (AutoSetting s : {AutoSetting::kChunkTokens, AutoSetting::kStrip, AutoSetting::kHostBudget,
                        AutoSetting::kBucketParams}) {
    if (!request.has(s)) continue;
    const std::vector<int64_t> cands = AutoCandidates(chosen, s);
    const auto at = std::find(cands.begin(), cands.end(), GetAutoSetting(chosen, s));
    if (at == cands.end()) continue;
    const ptrdiff_t i = at - cands.begin();
    for (ptrdiff_t j : {i - 1, i + 1}) {
      if (j < 0 || j >= static_cast<ptrdiff_t>(cands.size())) continue;
      StepOptions o = chosen;
      SetAutoSetting(&o, s, cands[j]);
      const absl::StatusOr<MemoryPlan> plan = PlanMemory(o);
      if (plan.ok() && plan->total() <= cap) out.push_back(o);
    }
  }
  return out;
}

// The all-on stack at the chosen settings and at each neighbour, each
// neighbour run right after the chosen settings in every round: step time
// over the chosen settings' (< 1: the neighbour is faster here), beside the
// time model's view of the same change (modelled seconds of the changed
// setting's part, neighbour minus chosen).
absl::Status TimeNeighbours(int64_t layers, int64_t seq_len, int64_t batch, int64_t cap) {
  const StepOptions chosen = Chosen(true, layers, seq_len, batch, cap);
  const std::vector<StepOptions> nbrs = Neighbours(chosen, cap);
  std::vector<Times> base(nbrs.size()), times(nbrs.size());
  for (int64_t round = 0; round < flags["rounds"]; ++round) {
    for (size_t i = 0; i < nbrs.size(); ++i) {
      absl::Status s = TimeRound(chosen, cap, flags["steps"], &base[i]);
      if (s.ok()) s = TimeRound(nbrs[i], cap, flags["steps"], &times[i]);
      if (!s.ok()) return s;
    }
  }
  std::printf("L=%-3lld neighbours of the chosen settings at seq_len %lld x %lld (%s):\n", (long long)layers,
              (long long)seq_len, (long long)batch, SettingsText(chosen).c_str());
  for (size_t i = 0; i < nbrs.size(); ++i) {
    double modelled = 0;
    for (AutoSetting s : {AutoSetting::kChunkTokens, AutoSetting::kStrip, AutoSetting::kHostBudget,
                          AutoSetting::kBucketParams}) {
      if (!AutoOf().has(s) || GetAutoSetting(nbrs[i], s) == GetAutoSetting(chosen, s)) continue;
      modelled = AutoSettingSeconds(nbrs[i], s, GetAutoSetting(nbrs[i], s), Curve()) -
                 AutoSettingSeconds(chosen, s, GetAutoSetting(chosen, s), Curve());
    }
    const std::pair<double, double> r = RoundRatios(times[i], base[i], 1.0);
    std::printf("        %-44s %.3f s vs chosen %.3f s: %.2fx (rounds %.2f-%.2f), CPU %.2fx, threads blocked %.0f vs "
                "%.0f; modelled %+.1f ms\n",
                SettingsText(nbrs[i]).c_str(), times[i].median(), base[i].median(),
                times[i].median() / base[i].median(), r.first, r.second,
                times[i].cpu_median() / base[i].cpu_median(), times[i].waits_median(), base[i].waits_median(),
                modelled * 1e3);
  }
  return absl::OkStatus();
}

// Each schedule on alone (the others at their baselines) at one shape,
// alternating with the baseline in every round: step time over the
// baseline's, so that the composed stack's cost can be put on the schedule
// that adds it. Runs in a 1 GiB arena, not under the cap: one schedule
// alone need not fit it (PipelinedLLEP beside device AdamW: its flat bound
// is larger than standard EP's worst case at the baseline's small N), and
// the arena's cap only accounts bytes, it does not change the speed. Its
// `auto` settings are chosen against that arena.
struct Attribution {
  const char* schedule;
  int64_t mask;
  bool keep_attention = false;  // --keep_attention=1: alone, and in all four
  double ratio = 0;      // median step time over the baseline's
  double cpu_ratio = 0;  // median CPU seconds per step over the baseline's
  double waits = 0;      // threads blocked per step (Times::waits)
  std::string settings;  // the schedule's settings as chosen
  std::string collectives;  // rank 0's per step (CountsText)
};

absl::StatusOr<std::vector<Attribution>> Attribute(int64_t layers, int64_t seq_len, int64_t batch) {
  const int64_t arena = int64_t{1} << 30;
  const bool keep = flags["keep_attention"] != 0;
  std::vector<Attribution> rows = {{"pipelined_llep", 1}, {"ring_dtp", 2}, {"sco", 4}, {"offload_stream_adamw", 8}};
  if (keep) rows.push_back({"keep_attention", 0, true});
  rows.push_back({keep ? "all four, attention kept" : "all four", 15, keep});
  Times off;
  std::vector<Times> on(rows.size());
  const int64_t saved = flags["on_mask"];
  for (int64_t round = 0; round < flags["rounds"]; ++round) {
    absl::Status s = TimeRound(Stack(false, layers, seq_len, batch), arena, flags["steps"], &off);
    for (size_t i = 0; s.ok() && i < rows.size(); ++i) {
      flags["on_mask"] = rows[i].mask;
      flags["keep_attention"] = rows[i].keep_attention ? 1 : 0;
      const StepOptions o = Chosen(true, layers, seq_len, batch, arena);
      rows[i].settings = SettingsText(o);
      s = TimeRound(o, arena, flags["steps"], &on[i]);
    }
    flags["on_mask"] = saved;
    flags["keep_attention"] = keep ? 1 : 0;
    if (!s.ok()) return s;
  }
  std::printf("L=%-3lld step time (and CPU seconds per step) over the baseline's at seq_len %lld x %lld, each "
              "schedule alone; baseline %.3f s, CPU %.3f s, %.0f threads blocked per step, rank 0 issued %s\n",
              (long long)layers, (long long)seq_len, (long long)batch, off.median(), off.cpu_median(),
              off.waits_median(), off.collectives.c_str());
  for (size_t i = 0; i < rows.size(); ++i) {
    rows[i].collectives = on[i].collectives;
    rows[i].waits = on[i].waits_median();
    rows[i].ratio = on[i].median() / off.median();
    rows[i].cpu_ratio = on[i].cpu_median() / off.cpu_median();
  }
  return rows;
}

struct DepthResult {
  int64_t layers = 0, params = 0, active = 0;
  int64_t persistent[2] = {0, 0};
  Reach context[2], batch[2];
  int64_t short_seq_len = 0;  // the batch axis' seq_len
  std::array<double, kNumLiveSets> growth[2]{};  // per token per rank, at the context reach
  int64_t balanced_off_seq_len = 0;              // BalancedContextReach
  std::vector<Attribution> attribution;          // at the baseline's longest context
  std::vector<Throughput> throughput;
};

std::string AxisJson(const Reach& r) {
  return absl::StrFormat(
      "{\"batch\":%d,\"seq_len\":%d,\"tokens_per_rank\":%d,\"settings\":%s,\"limit\":%s,\"planned_bytes\":%d,"
      "\"verified\":%s,\"at\":%s,\"at_peak_bytes\":%d,\"next\":%s,\"next_at_launch\":%s,\"at_s\":%.3f,"
      "\"next_s\":%.3f}",
      r.axis.batch, r.axis.seq_len, r.axis.tokens_per_rank,
      bench::JsonString(r.axis.tokens_per_rank == 0 ? "" : SettingsText(r.options)), bench::JsonString(r.axis.limit),
      r.planned_total, r.verified ? "true" : "false",
      bench::JsonString(r.at.status.ok() ? "ok" : r.at.status.ToString()), r.at.peak,
      bench::JsonString(r.next.status.ok() ? "ok" : r.next.status.ToString()), r.next.at_launch ? "true" : "false",
      r.at.seconds, r.next.seconds);
}

// --mfu_s: issue 17's MFU target (bf16, the longest context of one device).
// The all-on stack alone, at one sequence, climbs a ladder of contexts
// (bench/context_ladder.h) towards N_max of the context axis under the cap,
// one step at each, for as long as --mfu_s seconds from the start of the run
// allow; each step's model FLOP/s (ModelFlopsPerStep: 6 x active matmul
// parameters x tokens + causal attention) and MFU against the device's dense
// peak for the precision. MFU by model FLOPs, the convention: what the model
// needs, not what this step executes. The step executes more: the
// recomputation repeats every layer's forward (the phases' recompute +
// backward rate counts it; --keep_attention=1 keeps attention's forward for
// the backward, and the recompute runs the rest), and causal attention is counted at 3x its
// forward (backward 2x, the 6 N D convention) where the CUDA backward
// kernels execute 3.5x (dQ and dK/dV each recompute S and dP:
// attention_bench's "bwd exec"). The first rung runs one untimed step first (kernel
// loading, cuBLAS's first calls, the pool's first growth); each later rung is
// its own TrainingStep's first step, so a rung's time includes whatever a
// first step costs beyond the next: MFU as measured is a lower bound of a
// long run's. The `auto` settings are chosen as the service chooses them for
// this backend (its default curve). The router is the seeded one (no skew:
// the throughput of a trained router, not standard EP's worst case, which
// the all-on stack does not run anyway). Every step's device peak (the
// warm-up's too) must stay within its plan, live set by live set, and every
// loss and gradient norm must be finite (the warm-up's too), or the run
// exits 1.
//
// A rung can take longer than its prediction (at the cap the settings chosen
// are the ones with the smallest plan, slower per FLOP than the last rung's),
// so a watchdog ends the run at the deadline: it reports the rungs done and
// the one still running (a bound: its rate is below its FLOPs over the time
// its timed step has run) and exits, so that the caller's time limit
// (device-check's, 10 s later) never has to kill it and lose the figures.
struct Rung {
  int64_t seq_len = 0;
  std::string settings;
  double create_s = 0;  // choosing its settings and TrainingStep::Create, the slowest rank
  double step_s = 0;    // the timed step, the slowest rank
  double flops = 0;     // model FLOPs of the step (all ranks)
  double attention_share = 0;
  int64_t peak = 0, planned = 0;  // device total: the largest rank's peak, the plan
  std::string over_plan;          // live sets whose peak passed their plan, "" when none
  double loss = 0, grad_norm = 0;
  // Finite loss and gradient norm: a step that is not finite is a wrong
  // result, its rate no MFU.
  bool finite() const { return std::isfinite(loss) && std::isfinite(grad_norm); }
  // Rank 0's timed step by phase, on the device (kernels/phase_clock.h), or
  // why there is no such reading.
  PhaseTimes phases;
  std::string phases_error;
  // The model FLOPs of the layers' forward (the recompute does it again;
  // the backward twice) and of the vocabulary projection both ways.
  double layer_forward_flops = 0, projection_flops = 0;
  // What the recompute does not run again: attention's forward, when the
  // step keeps it for the backward (CheckpointOptions::keep_attention).
  double recompute_skipped_flops = 0;
};

const Calibration& ServiceCurve() {
  static const Calibration c = DefaultCalibration(
      backend_kind == BackendKind::kCuda ? CalibrationBackend::kCuda : CalibrationBackend::kCpu);
  return c;
}

// What the ladder has done so far; rank 0's thread adds to it, the watchdog
// and the end of the run report it. Everything the report needs is kept
// here (the watchdog reads nothing else, not even the flags).
class MfuLadder {
 public:
  MfuLadder(int64_t layers, const NMaxAxis& n_max, double t_start)
      : layers_(layers),
        ranks_(Ranks()),
        allowance_s_(flags["mfu_s"]),
        cap_bytes_(flags["cap_mb"] << 20),
        model_(Model(layers, Ranks())),
        n_max_(n_max),
        t_start_(t_start) {}

  void SetDevice(std::string name, double peak_flops) {
    std::lock_guard<std::mutex> lock(mu_);
    device_ = std::move(name);
    peak_flops_ = peak_flops;
  }
  // A rung begins (its settings chosen, its TrainingStep made, the first
  // rung's warm-up step), then its timed step starts and ends (rank 0's).
  void Start(int64_t seq_len, double flops) {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = seq_len;
    running_flops_ = flops;
    running_since_ = NowSeconds();
    timed_since_ = timed_until_ = 0;
  }
  void StartTimedStep(double t0) {
    std::lock_guard<std::mutex> lock(mu_);
    timed_since_ = t0;
  }
  void EndTimedStep(double t1) {
    std::lock_guard<std::mutex> lock(mu_);
    timed_until_ = t1;
  }
  void Done(const Rung& g) {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = 0;
    rungs_.push_back(g);
    std::printf(
        "  seq_len %8lld [%s]: created in %.1f s, step %.2f s, %.4g model TFLOP (attention "
        "%.1f%%), %.4g TFLOP/s%s, loss %.4f, peak %.1f MiB of its plan's %.1f%s\n",
        (long long)g.seq_len, g.settings.c_str(), g.create_s, g.step_s, g.flops / 1e12,
        100 * g.attention_share, Tflops(g), MfuText(g.flops, g.step_s, " (MFU ", ")").c_str(),
        g.loss, MiB(g.peak), MiB(g.planned),
        g.over_plan.empty() ? "" : absl::StrCat(" -- OVER ITS PLAN: ", g.over_plan).c_str());
    std::printf("    where rank 0's step went: %s\n", PhasesText(g).c_str());
  }
  // A step failed (`who`: "rank 1", or "the world"): the ladder ends, and
  // the report fails the run. The first failure is kept.
  void Fail(const std::string& who, const absl::Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.empty()) failure_ = absl::StrCat(who, ": ", status.ToString());
  }
  // Why the ladder stopped below N_max, for the summary.
  void EndedBy(std::string why) {
    std::lock_guard<std::mutex> lock(mu_);
    ended_by_ = std::move(why);
  }
  // The slowest rung so far outside its timed step (choosing the settings,
  // creating the step, the first rung's warm-up aside): what the next rung
  // costs besides its step.
  double OverheadSeconds() {
    std::lock_guard<std::mutex> lock(mu_);
    double s = 0;
    for (const Rung& g : rungs_) s = std::max(s, g.create_s);
    return s;
  }

  // Prints the summary and the JSON line; returns the exit status. `cut`:
  // the watchdog's call at the deadline.
  int Report(bool cut) {
    std::lock_guard<std::mutex> lock(mu_);
    const int P = ranks_;
    const double now = NowSeconds();
    const bool bounded = std::all_of(rungs_.begin(), rungs_.end(),
                                     [](const Rung& g) { return g.over_plan.empty(); });
    const bool finite = std::all_of(rungs_.begin(), rungs_.end(), [](const Rung& g) { return g.finite(); });
    const Rung last = rungs_.empty() ? Rung{} : rungs_.back();
    // A rung cut in its timed step bounds the rate: below its FLOPs over the
    // time the step has run. Cut before it (making the step, warming up) it
    // says nothing of the rate, nor after rank 0's step ended (other ranks'
    // steps, or the rung's record, still to come).
    const bool cut_running = cut && running_ > 0;
    const bool bound = cut_running && timed_since_ > 0 && timed_until_ == 0;
    const double timed_s =
        timed_since_ > 0 ? (timed_until_ > 0 ? timed_until_ : now) - timed_since_ : 0;
    if (cut_running) {
      std::string where = " (before its timed step)";
      if (bound) {
        where = absl::StrFormat(", %.1f s into its timed step: below %.4g TFLOP/s%s", timed_s,
                                running_flops_ / P / timed_s / 1e12,
                                MfuText(running_flops_, timed_s, " (MFU below ", ")"));
      } else if (timed_until_ > 0) {
        where = absl::StrFormat(" (rank 0's timed step had ended after %.2f s)", timed_s);
      }
      std::printf(
          "  seq_len %8lld: still running at the deadline (--mfu_s=%lld), %.1f s after it "
          "began%s\n",
          (long long)running_, (long long)allowance_s_, now - running_since_, where.c_str());
    }
    if (!failure_.empty())
      std::printf("  the ladder ended with a failed step: %s\n", failure_.c_str());
    if (rungs_.empty()) {
      std::printf("\nno rung completed\n");
    } else {
      const std::string ended = last.seq_len == n_max_.seq_len ? ""
                                : cut_running                  ? " (the deadline cut the next rung)"
                                : !ended_by_.empty()           ? absl::StrCat(" (", ended_by_, ")")
                                                               : "";
      std::printf(
          "\nlongest context run: %lld tokens, %.1f%% of N_max (%lld)%s: %.4g TFLOP/s per device, "
          "MFU %s against %s (%s dense peak %s); issue 17's target: 40%%\n",
          (long long)last.seq_len, 100.0 * last.seq_len / n_max_.seq_len, (long long)n_max_.seq_len,
          ended.c_str(), Tflops(last),
          peak_flops_ > 0 ? MfuText(last.flops, last.step_s, "", "").c_str() : "unknown",
          device_.c_str(), PrecisionName(precision_flag),
          peak_flops_ > 0 ? absl::StrFormat("%.1f TFLOP/s", peak_flops_ / 1e12).c_str()
                          : "unknown");
    }
    const bool ok = bounded && finite && failure_.empty() && !rungs_.empty();
    std::printf("%s; %.0f s\n",
                !bounded            ? "SOME PEAKS OVER THEIR PLAN"
                : !finite           ? "A LOSS OR GRADIENT NORM NOT FINITE"
                : !failure_.empty() ? "A STEP FAILED"
                                    : "every peak within its plan",
                now - t_start_);
    std::string json = absl::StrFormat(
        "{\"bench\":\"composed_mfu\",\"precision\":\"%s\",\"keep_attention\":%s,\"date\":%s,\"device\":%s,"
        "\"peak_flops\":%.6g,\"ranks\":%d,\"layers\":%d,\"cap_bytes\":%d,\"model\":{"
        "\"hidden\":%d,\"heads\":%d,\"kv_heads\":%d,\"experts\":%d,\"top_k\":%d,"
        "\"expert_ffn\":%d,\"vocab\":%d},\"allowance_s\":%d,\"n_max_seq_len\":%d,"
        "\"n_max_limit\":%s,\"bounded\":%s,\"finite\":%s,\"failure\":%s,\"rungs\":[",
        PrecisionName(precision_flag), flags["keep_attention"] != 0 ? "true" : "false",
        bench::JsonString(bench::NowText()), bench::JsonString(device_), peak_flops_, P, layers_, cap_bytes_,
        model_.hidden, model_.heads, model_.kv_heads, model_.experts, model_.top_k, model_.expert_ffn,
        model_.vocab_size, allowance_s_, n_max_.seq_len, bench::JsonString(n_max_.limit), bounded ? "true" : "false",
        finite ? "true" : "false", bench::JsonString(failure_));
    for (size_t i = 0; i < rungs_.size(); ++i) {
      const Rung& g = rungs_[i];
      absl::StrAppendFormat(&json,
                            "%s{\"seq_len\":%d,\"settings\":%s,\"create_s\":%.3f,\"step_s\":%.4f,"
                            "\"model_flops\":%.6g,\"tflops\":%.4g,\"mfu\":%.4g,\"attention_share\":%.4f,"
                            "\"peak_bytes\":%d,\"planned_bytes\":%d,\"over_plan\":%s,\"loss\":%s,\"grad_norm\":%s,%s}",
                            i ? "," : "", g.seq_len, bench::JsonString(g.settings), g.create_s, g.step_s, g.flops,
                            Tflops(g), Mfu(g.flops / P, g.step_s, peak_flops_), g.attention_share, g.peak, g.planned,
                            bench::JsonString(g.over_plan), bench::JsonNumber(g.loss), bench::JsonNumber(g.grad_norm),
                            PhasesJson(g));
    }
    absl::StrAppendFormat(
        &json, "],\"longest_seq_len\":%d,\"reached_n_max\":%s,\"tflops\":%.4g,\"mfu\":%.4g",
        last.seq_len, last.seq_len == n_max_.seq_len ? "true" : "false",
        rungs_.empty() ? 0.0 : Tflops(last), Mfu(last.flops / P, last.step_s, peak_flops_));
    if (cut_running) {
      absl::StrAppendFormat(&json, ",\"cut\":{\"seq_len\":%d,\"after_s\":%.1f,\"timed_s\":%.1f",
                            running_, now - running_since_, timed_s);
      if (bound) {
        absl::StrAppendFormat(&json, ",\"tflops_below\":%.4g,\"mfu_below\":%.4g",
                              running_flops_ / P / timed_s / 1e12,
                              Mfu(running_flops_ / P, timed_s, peak_flops_));
      }
      json += "}";
    }
    std::printf("\n%s}\n", json.c_str());
    std::fflush(stdout);
    return ok ? 0 : 1;
  }

 private:
  // "forward 24.1% at 312 TFLOP/s, ...": each group's share of the phases'
  // sum, and where its FLOPs are known its rate per device. The recompute
  // and the backward share one rate: which of them does the recompute's
  // expert work depends on the dispatch (PipelinedLLEP's backward replays
  // it), so their FLOPs are known only together: the layers' forward once
  // more (less attention's under keep_attention) and the backward's twice
  // (the MFU's model FLOPs leave the recompute out; this rate counts it).
  std::string PhasesText(const Rung& g) const {
    if (!g.phases_error.empty()) return absl::StrCat("not timed (", g.phases_error, ")");
    const PhaseTimes& t = g.phases;
    const double sum = t.total();
    if (!(sum > 0)) return "not timed (no phase took any time)";
    auto share = [&](double seconds) { return absl::StrFormat("%.1f%%", 100 * seconds / sum); };
    auto rate = [&](double flops, double seconds) {
      return seconds > 0 ? absl::StrFormat(" at %.4g TFLOP/s", flops / ranks_ / seconds / 1e12)
                         : std::string();
    };
    return absl::StrCat("forward ", share(t.forward), rate(g.layer_forward_flops, t.forward), ", recompute ",
                        share(t.recompute), " + backward ", share(t.backward),
                        rate(3 * g.layer_forward_flops - g.recompute_skipped_flops, t.recompute + t.backward),
                        ", projection ", share(t.projection), rate(g.projection_flops, t.projection), ", optimizer ",
                        share(t.optimizer), ", the rest ", share(t.embedding + t.grad_reduce + t.grad_norm),
                        absl::StrFormat("; %.3g s in all", sum));
  }
  static std::string PhasesJson(const Rung& g) {
    if (!g.phases_error.empty()) {
      return absl::StrCat("\"phases_error\":", bench::JsonString(g.phases_error));
    }
    const PhaseTimes& t = g.phases;
    return absl::StrFormat(
        "\"phases_s\":{\"embedding\":%.4g,\"forward\":%.4g,\"projection\":%.4g,"
        "\"recompute\":%.4g,\"backward\":%.4g,\"grad_reduce\":%.4g,\"grad_norm\":%.4g,"
        "\"optimizer\":%.4g},\"layer_forward_flops\":%.6g,\"recompute_skipped_flops\":%.6g,"
        "\"projection_flops\":%.6g",
        t.embedding, t.forward, t.projection, t.recompute, t.backward, t.grad_reduce, t.grad_norm, t.optimizer,
        g.layer_forward_flops, g.recompute_skipped_flops, g.projection_flops);
  }

  double Tflops(const Rung& g) const { return g.flops / ranks_ / g.step_s / 1e12; }
  // "<before>12.3%<after>" against the peak, "" when the peak is unknown.
  std::string MfuText(double flops, double seconds, const char* before, const char* after) const {
    if (peak_flops_ <= 0) return "";
    return absl::StrFormat("%s%.1f%%%s", before, 100 * Mfu(flops / ranks_, seconds, peak_flops_),
                           after);
  }

  const int64_t layers_;
  const int ranks_;
  const int64_t allowance_s_, cap_bytes_;
  const ModelConfig model_;
  const NMaxAxis n_max_;
  const double t_start_;
  std::mutex mu_;
  std::string device_ = std::string(BackendKindName(backend_kind));
  double peak_flops_ = 0;
  std::vector<Rung> rungs_;
  std::string failure_, ended_by_;
  int64_t running_ = 0;  // the rung in progress, 0 between rungs
  double running_flops_ = 0, running_since_ = 0;
  double timed_since_ = 0, timed_until_ = 0;  // rank 0's timed step, 0 before its start / end
};

// Ends the process at `deadline` with the ladder's report, unless stopped
// first. Stopped before the run's own report, so that the report is
// printed once: by the run, or by the watchdog (which then ends the process
// while the run waits in Stop).
class Watchdog {
 public:
  Watchdog(MfuLadder* ladder, double deadline)
      : thread_([this, ladder, deadline] {
          std::unique_lock<std::mutex> lock(mu_);
          const auto until = std::chrono::steady_clock::now() +
                             std::chrono::duration<double>(std::max(0.0, deadline - NowSeconds()));
          if (cv_.wait_until(lock, until, [this] { return stopped_; })) return;
          std::fflush(stdout);
          // The rank threads are inside a step: nothing they hold is needed
          // for the report, and the process ends without waiting for them.
          std::_Exit(ladder->Report(/*cut=*/true));
        }) {}
  ~Watchdog() { Stop(); }
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopped_ = false;
  std::thread thread_;  // last: it starts once the members above exist
};

int RunMfu(int64_t layers, int64_t cap, double t_start) {
  const int P = Ranks();
  const double deadline = t_start + static_cast<double>(flags["mfu_s"]);
  NMaxLimits limits;
  limits.max_batch = 1;
  limits.max_seq_len = flags["mfu_max_seq_len"];
  const StepOptions first = Stack(true, layers, P, 1);
  const NMax n =
      AutoOf().any()
          ? bench::OrDie(SolveNMaxAuto(first, AutoOf(), ServiceCurve(), {cap, 0}, limits),
                         "SolveNMaxAuto")
          : bench::OrDie(SolveNMax(first, {cap, 0}, limits), "SolveNMax");
  if (n.context.tokens_per_rank == 0) {
    std::fprintf(stderr,
                 "composed_bench: --mfu_s: RESOURCE_EXHAUSTED: not even seq_len %d fits the "
                 "%lld MiB cap: %s\n",
                 P, (long long)flags["cap_mb"], n.context.detail.c_str());
    return 1;
  }
  const bench::LadderLimits ladder_limits{n.context.seq_len, 1024 * int64_t{P},
                                          static_cast<double>(flags["mfu_growth"])};
  const bench::FlopsAt flops = [&](int64_t t) { return ModelFlopsPerStep(Model(layers, t), 1); };
  std::printf(
      "MFU: all on%s, %s, L=%lld, one sequence, P = %d, cap %lld MiB per rank: the longest "
      "context that fits is %lld tokens (N_max; limit %s), %.4g model TFLOP a step; a ladder of "
      "one-step rungs towards it within %lld s of the start (each at most %lldx the last one's "
      "FLOPs); each rung's step by phase on the device, a phase's rate counting any wait inside "
      "it (a copy, the host)\n",
      flags["keep_attention"] != 0 ? " with attention kept for the backward" : "", PrecisionName(precision_flag),
      (long long)layers, P, (long long)flags["cap_mb"], (long long)n.context.seq_len, n.context.limit.c_str(),
      flops(n.context.seq_len) / 1e12, (long long)flags["mfu_s"], (long long)flags["mfu_growth"]);

  MfuLadder ladder(layers, n.context, t_start);
  Watchdog watchdog(&ladder, deadline);
  // Rank 0 chooses each next rung between two meetings; every rank reaches
  // every meeting, also one whose step failed (which then does no more work
  // and ends the ladder: its error ends the world after the last meeting).
  // A rank whose backend cannot be made never joins the world: the others'
  // rendezvous fails after its 60 s timeout, before any meeting, and the
  // report names the error (a deadline before then reports "no rung
  // completed").
  Meeting meeting(P);
  std::vector<double> create_s(P), step_s(P);
  std::vector<StepStats> stats(P);
  StepOptions rung_options;  // rank 0's, for the rung's record
  PhaseTimes rung_phases;    // rank 0's timed step by phase
  std::string rung_phases_error;
  std::atomic<bool> failed_any{false};
  int64_t next = FirstContext(ladder_limits, flags["mfu_start"]);
  const double override_flops = static_cast<double>(flags["peak_tflops"]) * 1e12;
  absl::Status s = RunLocalWorld(
      P, RankBackend(cap), FreshStoreDir("composed-mfu"),
      [&](int r, Backend& be, Communicator& world) {
        if (r == 0) {
          if (auto view = be.QueryDevice(); view.ok() && !view->name.empty()) {
            ladder.SetDevice(
                view->name, MfuPeakFlops(override_flops, view->name, view->cc_major, view->cc_minor,
                                         precision_flag == Precision::kBf16Mixed));
          } else {
            ladder.SetDevice(std::string(BackendKindName(backend_kind)), override_flops);
          }
        }
        absl::Status failed;
        bool warm_up = true;
        for (;;) {
          meeting.Arrive();  // `next` is rank 0's choice
          const int64_t t = next;
          if (t == 0) break;
          if (r == 0) ladder.Start(t, flops(t));
          if (failed.ok()) {
            double t0 = NowSeconds();
            const StepOptions o = Chosen(true, layers, t, 1, cap, ServiceCurve());
            if (r == 0) rung_options = o;
            auto step = TrainingStep::Create(o, be, world);
            create_s[r] = NowSeconds() - t0;
            std::vector<int32_t> tok, tgt;
            MemoryStats warm_peaks;
            if (!step.ok()) {
              failed = step.status();
            } else {
              RankTokens(o, r, &tok, &tgt);
              if (warm_up) {
                auto st = (*step)->Step(tok, tgt);
                if (st.ok()) {
                  warm_peaks = st->device;
                  failed = bench::CheckFiniteStep(st->loss, st->grad_norm,
                                                  absl::StrCat("seq_len ", t, ", the warm-up step"));
                } else {
                  failed = st.status();
                }
              }
            }
            if (failed.ok()) {
              // Rank 0's step is timed phase by phase too; a clock that
              // cannot be had (or read) is reported, not a failure.
              std::unique_ptr<PhaseClock> clock;
              if (r == 0) {
                rung_phases_error.clear();
                // The layers' boundaries' events made now, outside the
                // timed step (OffloadStreamAdamW's buckets' as they come:
                // microseconds each).
                auto c = PhaseClock::Create(be, (*step)->streams(),
                                            PhaseBoundaries(o.model.layers, /*buckets=*/0));
                if (c.ok()) {
                  clock = std::move(*c);
                } else {
                  rung_phases_error = c.status().ToString();
                }
              }
              t0 = NowSeconds();
              if (r == 0) ladder.StartTimedStep(t0);
              if (clock != nullptr) {
                if (absl::Status cs = clock->Start(); !cs.ok()) {
                  rung_phases_error = cs.ToString();
                  clock.reset();
                }
              }
              auto st = (*step)->Step(tok, tgt, clock.get());
              const double t1 = NowSeconds();
              step_s[r] = t1 - t0;
              if (r == 0) ladder.EndTimedStep(t1);
              if (st.ok()) {
                stats[r] = *st;
                stats[r].device.KeepPeaks(warm_peaks);
                if (clock != nullptr) {
                  auto read = clock->Read();
                  if (read.ok()) {
                    rung_phases = SumByKind(*read);
                  } else {
                    rung_phases_error = read.status().ToString();
                  }
                }
              } else {
                failed = st.status();
              }
            }
            if (!failed.ok()) {
              failed_any = true;
              ladder.Fail(absl::StrCat("rank ", r), failed);
            }
          }
          warm_up = false;
          meeting.Arrive();  // every rank's figures are in
          if (r != 0) continue;
          next = 0;
          if (failed_any) continue;
          Rung g;
          g.seq_len = t;
          const MemoryPlan plan = PlanMemory(rung_options).value();
          g.settings = SettingsText(rung_options);
          g.create_s = *std::max_element(create_s.begin(), create_s.end());
          g.step_s = *std::max_element(step_s.begin(), step_s.end());
          g.flops = flops(t);
          g.attention_share = AttentionFlopsPerStep(rung_options.model, 1) / g.flops;
          // The layers are the rest (the final norm's few FLOPs among them).
          g.projection_flops = ProjectionFlopsPerStep(rung_options.model, 1);
          g.layer_forward_flops = (g.flops - g.projection_flops) / 3;
          // Causal attention is counted at 3x its forward: a kept
          // attention's recompute skips that forward.
          if (rung_options.checkpoints.keep_attention) {
            g.recompute_skipped_flops = AttentionFlopsPerStep(rung_options.model, 1) / 3;
          }
          g.phases = rung_phases;
          g.phases_error = rung_phases_error;
          g.planned = plan.total();
          g.loss = stats[0].loss;
          g.grad_norm = stats[0].grad_norm;
          for (int q = 0; q < P; ++q) {
            g.peak = std::max(g.peak, stats[q].device.total_peak);
            for (int i = 0; i < kNumLiveSets; ++i) {
              if (stats[q].device.peak[i] > plan.bytes[i]) {
                absl::StrAppendFormat(&g.over_plan, "%srank %d %s %lld > %lld",
                                      g.over_plan.empty() ? "" : "; ", q,
                                      LiveSetName(static_cast<LiveSet>(i)),
                                      (long long)stats[q].device.peak[i], (long long)plan.bytes[i]);
              }
            }
          }
          if (g.peak > g.planned) {
            absl::StrAppendFormat(&g.over_plan, "%stotal %lld > %lld",
                                  g.over_plan.empty() ? "" : "; ", (long long)g.peak,
                                  (long long)g.planned);
          }
          ladder.Done(g);
          if (!g.over_plan.empty()) {
            ladder.EndedBy("a peak over its plan ended the ladder");
          } else if (!g.finite()) {
            ladder.EndedBy("a loss or gradient norm not finite ended the ladder");
          } else {
            next = bench::NextContext(ladder_limits, t, g.flops / g.step_s, deadline - NowSeconds(),
                                      ladder.OverheadSeconds(), flops);
            if (next == 0) ladder.EndedBy("the time allowance ended the ladder");
          }
        }
        return failed;
      });
  watchdog.Stop();
  if (!s.ok()) {
    ladder.Fail("the world", s);  // kept only if no rank said first
    std::fflush(stdout);
    std::fprintf(stderr, "composed_bench: --mfu_s: a step failed: %s\n", s.ToString().c_str());
  }
  return ladder.Report(/*cut=*/false);
}

}  // namespace
}  // namespace plateau

int main(int argc, char** argv) {
  using namespace plateau;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--quick") QuickDefaults();
  }
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--quick") {
      flags["quick"] = 1;
      continue;
    }
    if (a == "--plan_only") {
      flags["plan_only"] = 1;
      continue;
    }
    const size_t eq = a.find('=');
    const std::string name = a.substr(0, 2) == "--" && eq != std::string::npos ? a.substr(2, eq - 2) : "";
    if (name == "depths") {
      depths_flag = a.substr(eq + 1);
      continue;
    }
    bool bad = false;
    if (bench::BackendArg(a, "composed_bench", &backend_kind, &bad)) {
      if (bad) return 2;
      continue;
    }
    if (bench::PrecisionArg(a, "composed_bench", &precision_flag, &bad)) {
      if (bad) return 2;
      continue;
    }
    if (!flags.count(name) || !absl::SimpleAtoi(a.substr(eq + 1), &flags[name])) {
      std::fprintf(stderr, "composed_bench: bad argument '%s'\n", a.c_str());
      return 2;
    }
  }
  if (flags["keep_attention"] != 0 && flags["keep_attention"] != 1) {
    std::fprintf(stderr, "composed_bench: --keep_attention: expected 0 or 1, got %lld\n",
                 (long long)flags["keep_attention"]);
    return 2;
  }
  std::vector<int64_t> depths;
  for (absl::string_view d : absl::StrSplit(depths_flag, ',')) {
    int64_t l = 0;
    if (!absl::SimpleAtoi(d, &l) || l < 1) {
      std::fprintf(stderr, "composed_bench: --depths: expected layer counts >= 1 separated by commas, got '%s'\n",
                   depths_flag.c_str());
      return 2;
    }
    depths.push_back(l);
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress visible when piped
  const bool run = flags["plan_only"] == 0;
  const int64_t cap = flags["cap_mb"] << 20;
  const int P = Ranks();
  const double t_start = NowSeconds();
  bench::CpuMeter meter;
  const ModelConfig m0 = Model(1, P);
  std::printf("composed_bench %s; load %.2f%s; precision %s\n", bench::NowText().c_str(),
              bench::LoadAverage1m(), flags["quick"] ? " (--quick)" : "", PrecisionName(precision_flag));
  if (run && precision_flag != Precision::kFp32) {
    const absl::Status takes = CheckPrecisionRuns(cap);
    if (!takes.ok()) {
      std::fflush(stdout);
      std::fprintf(stderr, "composed_bench: %s: the step refused --precision=%s: %s\n",
                   absl::StatusCodeToString(takes.code()).c_str(), PrecisionName(precision_flag),
                   std::string(takes.message()).c_str());
      return 1;
    }
  }
  if (flags["mfu_s"] > 0) {
    if (!run || depths.size() != 1 || flags["mfu_growth"] < 2 || flags["mfu_start"] < 1) {
      std::fprintf(
          stderr,
          "composed_bench: --mfu_s runs steps at one depth: expected one --depths value, no "
          "--plan_only, --mfu_growth >= 2 and --mfu_start >= 1\n");
      return 2;
    }
    return RunMfu(depths[0], cap, t_start);
  }
  const bench::SquareCeiling square = run ? SgemmCeiling() : bench::SquareCeiling{};
  const double ceiling = square.gflops;
  if (run) {
    if (backend_kind == BackendKind::kCuda) {
      std::printf("%s ceiling: %.1f GFLOP/s (%lld^3 on one GPU; the ranks' figures are per GPU below)\n",
                  precision_flag == Precision::kBf16Mixed ? "bf16 GEMM" : "sgemm", ceiling, (long long)square.n);
    } else {
      std::printf("%s ceiling: %.1f GFLOP/s (%lld^3 on one BLAS thread, OPENBLAS_NUM_THREADS=%s, x %ld cores)\n",
                  precision_flag == Precision::kBf16Mixed ? "bf16 GEMM" : "sgemm", ceiling, (long long)square.n,
                  bench::EnvOr("OPENBLAS_NUM_THREADS").c_str(), sysconf(_SC_NPROCESSORS_ONLN));
    }
  }
  std::printf("device cap %lld MiB per rank, P = %d rank threads; H=%lld heads=%lld/%lld E=%lld k=%lld F=%lld "
              "V=%lld; depths %s\n",
              (long long)flags["cap_mb"], P, (long long)m0.hidden, (long long)m0.heads, (long long)m0.kv_heads,
              (long long)m0.experts, (long long)m0.top_k, (long long)m0.expert_ffn, (long long)m0.vocab_size,
              depths_flag.c_str());
  if (AutoOf().any()) {
    std::printf("all on: pipelined_llep c=auto min_piece=%lld max_borrowed=%lld alpha=1.1 strided; ring_dtp S=auto "
                "row_tile=%lld mode=auto; sco beta=auto; offload_stream_adamw bucket=auto slots=%lld (each `auto` "
                "chosen at every shape, default cpu curve)\n",
                (long long)flags["min_piece"], (long long)flags["max_borrowed"], (long long)flags["row_tile"],
                (long long)flags["staging_slots"]);
  } else {
    std::printf("all on: pipelined_llep c=%lld min_piece=%lld max_borrowed=%lld alpha=1.1 strided; ring_dtp S=%lld "
                "row_tile=%lld mode=auto; sco beta=all L-1 boundaries; offload_stream_adamw bucket=%lld slots=%lld\n",
                (long long)flags["chunk_tokens"], (long long)flags["min_piece"], (long long)flags["max_borrowed"],
                (long long)flags["strip"], (long long)flags["row_tile"], (long long)flags["bucket_params"],
                (long long)flags["staging_slots"]);
  }
  std::printf("context axis: batch %lld; batch axis: seq_len %s. Reach verified with router weights zero "
              "(every route to rank 0)\n\n",
              (long long)flags["ctx_batch"],
              flags["batch_seq_len"] > 0 ? absl::StrCat(flags["batch_seq_len"]).c_str()
                                         : "a quarter of the baseline's longest context");

  std::vector<DepthResult> results;
  bool all_verified = true;
  for (int64_t L : depths) {
    DepthResult d;
    d.layers = L;
    d.params = ParameterCount(Model(L, P));
    d.active = ActiveParameterCount(Model(L, P));
    const ModelState skewed = run && flags["verify"] ? SkewedState(Model(L, P)) : ModelState{};
    NMaxLimits limits;
    limits.max_batch = 1 << 16;
    limits.max_seq_len = 1 << 20;
    // N_max of one stack: all on with its `auto` settings chosen at each N.
    auto solve = [&](int on, const StepOptions& o) {
      return on && AutoOf().any()
                 ? bench::OrDie(SolveNMaxAuto(o, AutoOf(), Curve(), {cap, 0}, limits), "SolveNMaxAuto")
                 : bench::OrDie(SolveNMax(o, {cap, 0}, limits), "SolveNMax");
    };
    auto print_axis = [&](int on, const Reach& r, const char* axis) {
      std::printf("L=%-3lld %-7s %-7s predicted seq_len %6lld x batch %4lld = %6lld tokens/rank, %.0f model "
                  "GFLOP (limit %s; plan %.2f MiB: %s)\n",
                  (long long)L, StackName(on), axis, (long long)r.axis.seq_len, (long long)r.axis.batch,
                  (long long)r.axis.tokens_per_rank, ModelFlopsPerStep(Model(L, r.axis.seq_len), r.axis.batch) / 1e9,
                  r.axis.limit.c_str(), MiB(r.planned_total),
                  r.axis.tokens_per_rank == 0 ? r.axis.detail.c_str()
                                              : Largest(PlanMemory(r.options).value(), 3).c_str());
      if (on && r.axis.tokens_per_rank > 0) std::printf("        settings: %s\n", SettingsText(r.options).c_str());
      if (run && flags["verify"]) {
        std::printf("        at it: %s\n        one step more: %s\n        -> %s\n", Describe(r.at).c_str(),
                    Describe(r.next).c_str(), r.verified ? "verified" : "NOT VERIFIED");
        all_verified = all_verified && r.verified;
      }
    };
    // The context axis: the longest seq_len at ctx_batch sequences.
    for (int on = 0; on < 2; ++on) {
      const StepOptions o = Stack(on, L, P, flags["ctx_batch"]);
      const NMax n = solve(on, o);
      d.context[on] = VerifyAxis(on, L, n.context, true, skewed, cap, run && flags["verify"]);
      // The fixed part at the reach, at the settings chosen there.
      d.persistent[on] = Persistent(PlanMemory(n.context.tokens_per_rank > 0 ? d.context[on].options : o).value());
      print_axis(on, d.context[on], "context");
      if (n.context.tokens_per_rank > 0) {
        d.growth[on] = GrowthPerToken(d.context[on].options);
        std::printf("        fixed %.2f MiB (weights, grads, optimizer); grows: %s\n", MiB(d.persistent[on]),
                    GrowthText(d.growth[on]).c_str());
      }
    }
    d.balanced_off_seq_len = BalancedContextReach(L, flags["ctx_batch"], cap);
    std::printf("        (all off with standard EP's dispatch at its balanced estimate, not guaranteed: seq_len %lld)\n",
                (long long)d.balanced_off_seq_len);
    // The batch axis at a shorter common context: batch_seq_len, or (0) a
    // quarter of the baseline's longest, rounded down to a multiple of P.
    d.short_seq_len = flags["batch_seq_len"] > 0 ? flags["batch_seq_len"]
                                                 : std::max<int64_t>(P, d.context[0].axis.seq_len / 4 / P * P);
    for (int on = 0; on < 2; ++on) {
      const NMax n = solve(on, Stack(on, L, d.short_seq_len, 1));
      d.batch[on] = VerifyAxis(on, L, n.batch, false, skewed, cap, run && flags["verify"]);
      print_axis(on, d.batch[on], "batch");
    }
    if (run && d.context[0].axis.tokens_per_rank > 0 && d.batch[0].axis.tokens_per_rank > 0) {
      // The composed stack's largest batch at the baseline's longest context
      // (predicted; its run below is the check that it completes).
      const int64_t T = d.context[0].axis.seq_len;
      const NMax at_t = solve(true, Stack(true, L, T, 1));
      const std::pair<int64_t, std::pair<int64_t, int64_t>> points[] = {
          {T, {d.context[0].axis.batch, at_t.batch.batch}},
          {d.short_seq_len, {d.batch[0].axis.batch, d.batch[1].axis.batch}}};
      for (const auto& [t, batches] : points) {
        auto th = MeasureThroughput(L, t, batches.first, batches.second, cap);
        if (!th.ok()) {
          std::fprintf(stderr, "composed_bench: throughput at seq_len %lld: %s\n", (long long)t,
                       th.status().ToString().c_str());
          return 1;
        }
        std::printf("L=%-3lld throughput at seq_len %lld, median (min-max) of %lld rounds x %lld steps, slowest rank:\n"
                    "        all off x %lld seqs %.3f s (%.3f-%.3f), CPU %.3f s, %.2f GFLOP/s\n"
                    "        all on  x %lld seqs %.3f s (%.3f-%.3f), CPU %.3f s, %.2f GFLOP/s: %.2fx (rounds "
                    "%.2f-%.2fx) [%s]\n"
                    "        all on  x %lld seqs (its largest) %.3f s (%.3f-%.3f), CPU %.3f s, %.2f GFLOP/s: %.2fx "
                    "(rounds %.2f-%.2fx) [%s]\n",
                    (long long)L, (long long)t, (long long)flags["rounds"], (long long)flags["steps"],
                    (long long)th->off_batch, th->off_s, th->off.min(), th->off.max(), th->off.cpu_median(),
                    th->off_gflops, (long long)th->off_batch, th->same_s, th->same.min(), th->same.max(),
                    th->same.cpu_median(), th->same_gflops, th->same_gflops / th->off_gflops,
                    th->same_ratio_range.first, th->same_ratio_range.second, th->same_settings.c_str(),
                    (long long)th->on_batch, th->own_s, th->own.min(), th->own.max(), th->own.cpu_median(),
                    th->own_gflops, th->own_gflops / th->off_gflops, th->own_ratio_range.first,
                    th->own_ratio_range.second, th->own_settings.c_str());
        std::printf("        rank 0 issued: off %s; on %s\n        threads blocked (voluntary context switches, "
                    "all ranks) per step: off %.0f, on %.0f\n",
                    th->off.collectives.c_str(), th->same.collectives.c_str(), th->off.waits_median(),
                    th->same.waits_median());
        if (flags["neighbours"] && AutoOf().any()) {
          absl::Status s = TimeNeighbours(L, t, batches.first, cap);
          if (!s.ok()) {
            std::fprintf(stderr, "composed_bench: neighbours at seq_len %lld: %s\n", (long long)t,
                         s.ToString().c_str());
            return 1;
          }
        }
        d.throughput.push_back(*th);
      }
      if (flags["attribute"]) {
        auto rows = Attribute(L, T, d.context[0].axis.batch);
        if (!rows.ok()) {
          std::fprintf(stderr, "composed_bench: attribution: %s\n", rows.status().ToString().c_str());
          return 1;
        }
        d.attribution = *rows;
        for (const Attribution& a : d.attribution) {
          std::printf("        %-20s %.2fx (CPU %.2fx, %.0f threads blocked) [%s]; %s\n", a.schedule, a.ratio,
                      a.cpu_ratio, a.waits, a.settings.c_str(), a.collectives.c_str());
        }
      }
    }
    std::printf("\n");
    results.push_back(std::move(d));
  }

  // The tables.
  auto ratio = [](int64_t a, int64_t b) { return b > 0 ? static_cast<double>(a) / b : 0.0; };
  std::printf("reach at a %lld MiB device cap per rank, P = %d (%s)\n", (long long)flags["cap_mb"], P,
              run ? "predicted by N_max, each verified by running it and one step more" : "predicted only: --plan_only");
  std::printf("%4s %8s %21s %25s %7s %7s %19s %7s %18s\n", "L", "params", "persistent MiB (cap%)",
              "longest context, tokens", "x", "at T", "largest batch, seqs", "x", "off balanced (x)");
  for (const DepthResult& d : results) {
    std::printf("%4lld %7.2fM %6.1f (%2.0f%%) / %5.1f %11lld / %11lld %6.1fx %7lld %8lld / %8lld %6.1fx %9lld (%5.1fx)\n",
                (long long)d.layers, d.params / 1e6, MiB(d.persistent[0]), 100.0 * d.persistent[0] / cap,
                MiB(d.persistent[1]), (long long)d.context[0].axis.seq_len, (long long)d.context[1].axis.seq_len,
                ratio(d.context[1].axis.seq_len, d.context[0].axis.seq_len), (long long)d.short_seq_len,
                (long long)d.batch[0].axis.batch, (long long)d.batch[1].axis.batch,
                ratio(d.batch[1].axis.batch, d.batch[0].axis.batch), (long long)d.balanced_off_seq_len,
                ratio(d.context[1].axis.seq_len, d.balanced_off_seq_len));
  }
  // The throughputs are the job's; the ceiling is one GPU's on CUDA (a GPU
  // per rank) and the machine's on the CPU (the rank threads share it).
  const double devices = backend_kind == BackendKind::kCuda ? static_cast<double>(P) : 1.0;
  if (run) {
    std::printf("\nmodel GFLOP/s where both run (median step, slowest rank; %lld rounds, each off then on back to back, "
                "%lld / %lld timed steps after a warm-up; rounds' x: the ratio within each round, smallest-largest): "
                "off at its largest batch; on at the same batch; on at its largest batch\n",
                (long long)flags["rounds"], (long long)flags["steps"], (long long)flags["own_steps"]);
    std::printf("%4s %7s %6s %9s %6s %9s %7s %13s %6s %9s %7s %13s %16s\n", "L", "T", "B off", "GF/s off", "B",
                "GF/s on", "x", "rounds' x", "B on", "GF/s on", "x", "rounds' x", "of ceiling off/on");
    for (const DepthResult& d : results) {
      for (const Throughput& t : d.throughput) {
        std::printf(
            "%4lld %7lld %6lld %9.2f %6lld %9.2f %6.2fx %5.2f-%5.2fx %6lld %9.2f %6.2fx %5.2f-%5.2fx %7.1f%% / "
            "%4.1f%%\n",
            (long long)d.layers, (long long)t.seq_len, (long long)t.off_batch, t.off_gflops, (long long)t.off_batch,
            t.same_gflops, t.same_gflops / t.off_gflops, t.same_ratio_range.first, t.same_ratio_range.second,
            (long long)t.on_batch, t.own_gflops, t.own_gflops / t.off_gflops, t.own_ratio_range.first,
            t.own_ratio_range.second, 100 * t.off_gflops / devices / ceiling, 100 * t.own_gflops / devices / ceiling);
      }
    }
  }
  const double others = meter.OthersPercent();
  std::printf("\n%s; %.0f s; other processes took %.0f%% of the CPU meanwhile\n",
              !run ? "nothing run (--plan_only)"
              : !flags["verify"] ? "predictions not verified (--verify=0)"
              : all_verified     ? "every prediction verified"
                                 : "SOME PREDICTIONS NOT VERIFIED",
              NowSeconds() - t_start, others);

  // The JSON line.
  std::string json = absl::StrFormat(
      "{\"bench\":\"composed\",\"precision\":\"%s\",\"date\":%s,\"quick\":%s,\"load_avg_1m\":%.2f,\"others_pct\":%.1f,"
      "\"ceiling_gemm\":\"%s\",\"sgemm_ceiling_gflops\":%.1f,\"ceiling_square_n\":%d,\"ranks\":%d,"
      "\"cap_bytes\":%d,\"model\":{\"hidden\":%d,\"heads\":%d,\"kv_heads\":%d,\"experts\":%d,\"top_k\":%d,"
      "\"expert_ffn\":%d,\"vocab\":%d},\"settings\":{\"auto\":%s,\"chunk_tokens\":%d,\"min_piece\":%d,\"max_borrowed\":"
      "%d,\"strip\":%d,"
      "\"row_tile\":%d,\"sco_beta\":%s,\"bucket_params\":%d,\"staging_slots\":%d},"
      "\"rounds\":%d,\"steps\":%d,\"own_steps\":%d,\"verified\":%s,\"depths\":[",
      PrecisionName(precision_flag), bench::JsonString(bench::NowText()), flags["quick"] ? "true" : "false",
      bench::LoadAverage1m(), others, precision_flag == Precision::kBf16Mixed ? "gemm_bf16" : "sgemm", ceiling,
      square.n, P, cap, m0.hidden, m0.heads, m0.kv_heads, m0.experts, m0.top_k, m0.expert_ffn, m0.vocab_size,
      AutoOf().any() ? "true" : "false", flags["chunk_tokens"], flags["min_piece"], flags["max_borrowed"],
      flags["strip"], flags["row_tile"], bench::JsonString(AutoOf().any() ? "auto" : "all L-1 boundaries"),
      flags["bucket_params"], flags["staging_slots"], flags["rounds"], flags["steps"], flags["own_steps"],
      run && flags["verify"] ? (all_verified ? "true" : "false") : "null");
  for (size_t i = 0; i < results.size(); ++i) {
    const DepthResult& d = results[i];
    absl::StrAppendFormat(&json,
                          "%s{\"layers\":%d,\"params\":%d,\"active_params\":%d,\"persistent_off_bytes\":%d,"
                          "\"persistent_on_bytes\":%d,\"balanced_off_seq_len\":%d,\"growth_off\":%s,\"growth_on\":%s,\"context_off\":%s,\"context_on\":%s,"
                          "\"batch_seq_len\":%d,"
                          "\"batch_off\":%s,\"batch_on\":%s,\"throughput\":[",
                          i ? "," : "", d.layers, d.params, d.active, d.persistent[0], d.persistent[1],
                          d.balanced_off_seq_len, GrowthJson(d.growth[0]), GrowthJson(d.growth[1]), AxisJson(d.context[0]), AxisJson(d.context[1]), d.short_seq_len, AxisJson(d.batch[0]),
                          AxisJson(d.batch[1]));
    for (size_t j = 0; j < d.throughput.size(); ++j) {
      const Throughput& t = d.throughput[j];
      absl::StrAppendFormat(&json,
                            "%s{\"seq_len\":%d,\"off_batch\":%d,\"on_batch\":%d,\"off_step_s\":%.4f,"
                            "\"on_same_batch_step_s\":%.4f,\"on_own_batch_step_s\":%.4f,\"off_gflops\":%.3f,"
                            "\"on_same_batch_gflops\":%.3f,\"on_own_batch_gflops\":%.3f,\"same_batch_ratio\":%.4f,"
                            "\"own_batch_ratio\":%.4f,\"same_batch_ratio_rounds\":[%.4f,%.4f],"
                            "\"own_batch_ratio_rounds\":[%.4f,%.4f],\"off_step_s_range\":[%.4f,%.4f],"
                            "\"on_same_batch_step_s_range\":[%.4f,%.4f],\"on_own_batch_step_s_range\":[%.4f,%.4f],"
                            "\"on_same_batch_settings\":%s,\"on_own_batch_settings\":%s,"
                            "\"off_cpu_s\":%.4f,\"on_same_batch_cpu_s\":%.4f,\"on_own_batch_cpu_s\":%.4f,"
                            "\"off_waits\":%.0f,\"on_same_batch_waits\":%.0f}",
                            j ? "," : "", t.seq_len, t.off_batch, t.on_batch, t.off_s, t.same_s, t.own_s,
                            t.off_gflops, t.same_gflops, t.own_gflops, t.same_gflops / t.off_gflops,
                            t.own_gflops / t.off_gflops, t.same_ratio_range.first, t.same_ratio_range.second,
                            t.own_ratio_range.first, t.own_ratio_range.second, t.off.min(), t.off.max(),
                            t.same.min(), t.same.max(), t.own.min(), t.own.max(),
                            bench::JsonString(t.same_settings), bench::JsonString(t.own_settings),
                            t.off.cpu_median(), t.same.cpu_median(), t.own.cpu_median(), t.off.waits_median(),
                            t.same.waits_median());
    }
    json += "],\"attribution\":{";
    for (size_t j = 0; j < d.attribution.size(); ++j) {
      absl::StrAppendFormat(&json, "%s\"%s\":{\"step_ratio\":%.4f,\"cpu_ratio\":%.4f,\"waits\":%.0f}",
                            j ? "," : "", d.attribution[j].schedule, d.attribution[j].ratio,
                            d.attribution[j].cpu_ratio, d.attribution[j].waits);
    }
    json += "}}";
  }
  json += "]}";
  std::printf("\n%s\n", json.c_str());
  return run && !all_verified ? 1 : 0;
}
