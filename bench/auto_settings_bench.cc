// Does the `auto` settings' time model pick well on this machine?
//
// Calibrates this machine's CPU backend as a worker does, then, for each of
// the four settings in turn (the others at the chooser's roomy choice),
// runs the real training step (P rank threads, all four schedules on) at
// every candidate value and times it. Reports, per setting, the value the
// model picks with room to spare, the value that measured fastest, and the
// ratio of their measured step times (1.00: the model's pick is the
// fastest; the target is <= 1.05), beside the modelled and measured times
// of every candidate. Ends with one JSON line.
//
//   OPENBLAS_NUM_THREADS=1 bazel run -c opt //bench:auto_settings_bench
#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/bench_util.h"
#include "kernels/backend.h"
#include "kernels/budget/auto_settings.h"
#include "kernels/budget/budget.h"
#include "kernels/communicator.h"
#include "kernels/step/step.h"
#include "kernels/testing/local_world.h"
#include "kernels/testing/random_tokens.h"
#include "worker/calibration.h"
#include "worker/calibration_measure.h"

namespace plateau {
namespace {

constexpr int kRanks = 2;
constexpr int64_t kArena = int64_t{1} << 30;

StepOptions Job() {
  StepOptions o;
  o.model.vocab_size = 4096;
  o.model.hidden = 128;
  o.model.layers = 3;
  o.model.heads = 4;
  o.model.kv_heads = 2;
  o.model.experts = 8;
  o.model.top_k = 2;
  o.model.expert_ffn = 256;
  o.model.seq_len = 512;
  o.layout = {kRanks, 4};  // N = 1024 tokens per rank
  o.dispatch.kind = DispatchOptions::Kind::kPipelinedLlep;
  o.dispatch.pipelined.balance.min_piece = 64;
  o.projection.kind = ProjectionOptions::Kind::kRingDtp;
  o.checkpoints.kind = CheckpointOptions::Kind::kSco;
  o.optimizer_placement.kind = OptimizerPlacementOptions::Kind::kOffloadStream;
  return o;
}

// Median seconds of one optimizer step of `o` (rank 0's clock; the ranks
// meet in every collective).
absl::StatusOr<double> StepSeconds(const StepOptions& o) {
  const RankBatches in = UniformRankBatches(kRanks, TokensPerRank(o.model, o.layout), o.model.vocab_size, 3);
  const auto& tok = in.tokens;
  const auto& tgt = in.targets;
  double median = 0;
  absl::Status s = RunLocalWorld(kRanks, kArena, FreshStoreDir("auto_bench"),
                                 [&](int r, Backend& be, Communicator& world) -> absl::Status {
                                   auto step = TrainingStep::Create(o, be, world);
                                   if (!step.ok()) return step.status();
                                   // A step that is not finite is a wrong result, not a time.
                                   auto t = bench::TimeRuns(
                                       [&]() -> absl::Status {
                                         auto st = (*step)->Step(tok[r], tgt[r]);
                                         if (!st.ok()) return st.status();
                                         return bench::CheckFiniteStep(st->loss, st->grad_norm, "a timed step");
                                       },
                                       /*warmup=*/1, /*min_reps=*/3, /*min_total_s=*/0.3, /*max_reps=*/3);
                                   if (!t.ok()) return t.status();
                                   if (r == 0) median = t->median_s;
                                   return absl::OkStatus();
                                 });
  if (!s.ok()) return s;
  return median;
}

int Main() {
  BackendOptions bo;
  bo.device_memory_bytes = int64_t{64} << 20;
  auto backend = Backend::Create(bo);
  if (!backend.ok()) return std::fprintf(stderr, "%s\n", backend.status().ToString().c_str()), 1;
  auto measured = MeasureCalibration(**backend);
  if (!measured.ok()) return std::fprintf(stderr, "%s\n", measured.status().ToString().c_str()), 1;
  auto cal = CalibrationFromProto(*measured);
  if (!cal.ok()) return std::fprintf(stderr, "%s\n", cal.status().ToString().c_str()), 1;
  std::printf("calibration (%.2f s): %s\n", measured->measure_seconds(), measured->backend().c_str());
  std::printf("OPENBLAS_NUM_THREADS=%s, %d rank threads\n", bench::EnvOr("OPENBLAS_NUM_THREADS").c_str(), kRanks);
  std::fflush(stdout);

  const StepOptions base = Job();
  const AutoRequest all{true, true, true, true};
  auto roomy = ChooseAutoSettings(base, all, *cal, FitCaps{kArena, 0});
  if (!roomy.ok()) return std::fprintf(stderr, "%s\n", roomy.status().ToString().c_str()), 1;
  std::vector<std::string> json;
  for (const AutoChoice::Setting& chosen : roomy->settings) {
    const AutoSetting s = chosen.setting;
    std::printf("\n%s (the model picks %lld)\n  %12s %14s %14s\n", AutoSettingField(s),
                static_cast<long long>(chosen.value), "value", "modelled ms", "step ms");
    int64_t best_value = 0;
    bool any = false;  // beta's first candidate is 0: not a sentinel
    double best = 0, at_choice = 0;
    std::vector<std::string> rows;
    for (int64_t v : AutoCandidates(base, s)) {
      StepOptions o = roomy->options;
      SetAutoSetting(&o, s, v);
      auto t = StepSeconds(o);
      if (!t.ok()) {
        std::printf("  %12lld  %s\n", static_cast<long long>(v), t.status().ToString().c_str());
        continue;
      }
      const double modelled = AutoSettingSeconds(o, s, v, *cal);
      std::printf("  %12lld %14.3f %14.2f%s\n", static_cast<long long>(v), modelled * 1e3, *t * 1e3,
                  v == chosen.value ? "  <- model" : "");
      std::fflush(stdout);
      if (!any || *t < best) {
        best = *t;
        best_value = v;
        any = true;
      }
      if (v == chosen.value) at_choice = *t;
      rows.push_back(absl::StrFormat("{\"value\":%d,\"modelled_ms\":%.4f,\"step_ms\":%.3f}", v, modelled * 1e3,
                                     *t * 1e3));
    }
    // The model's pick must have run: a failed one printed a 0.000x ratio,
    // "within" its target.
    if (at_choice <= 0) {
      std::fprintf(stderr, "auto_settings_bench: FAILED: %s's chosen value %lld did not run\n", AutoSettingField(s),
                   static_cast<long long>(chosen.value));
      return 1;
    }
    const double ratio = at_choice / best;
    std::printf("  measured fastest %lld; the model's pick is %.3fx its step time (target <= 1.05)\n",
                static_cast<long long>(best_value), ratio);
    json.push_back(absl::StrFormat("{\"field\":\"%s\",\"chosen\":%d,\"fastest\":%d,\"ratio\":%.4f,\"runs\":[%s]}",
                                   AutoSettingField(s), chosen.value, best_value, ratio, absl::StrJoin(rows, ",")));
  }
  std::printf("{\"bench\":\"auto_settings\",\"ranks\":%d,\"settings\":[%s]}\n", kRanks,
              absl::StrJoin(json, ",").c_str());
  return 0;
}

}  // namespace
}  // namespace plateau

int main() { return plateau::Main(); }
