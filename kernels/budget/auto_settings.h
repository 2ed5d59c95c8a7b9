// `auto` values of the four schedules' settings: c (PipelinedLLEP's
// chunk_tokens), S (Ring-DTP's strip), beta (SCO's host_budget_bytes) and
// the bucket (OffloadStreamAdamW's bucket_params). The choice is the
// candidate with the least modelled step time among those whose plan
// (PlanMemory, the same budget as every other plan) fits the device and the
// host caps. The time model reads a worker's measured curves (Calibration:
// GEMM time against rows, a launch's latency, copy bandwidths, the AdamW
// rate); docs/SCHEDULES.md "Automatic settings" writes it down.
//
// Each setting changes one live set only (c: dispatch, S: projection,
// beta: checkpoints, bucket: optimizer) and one part of the step's time, so
// both the plan and the modelled time are sums over the settings: the
// chooser measures each candidate's bytes with PlanMemory (one setting
// varied at a time), searches the product of the candidate lists by those
// sums, and plans the winner once more with PlanMemory to confirm the fit.
//
// Thread safety: pure functions.
#ifndef PLATEAU_KERNELS_BUDGET_AUTO_SETTINGS_H_
#define PLATEAU_KERNELS_BUDGET_AUTO_SETTINGS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/budget/budget.h"
#include "kernels/budget/n_max.h"
#include "kernels/model/params.h"
#include "kernels/model/step_options.h"

namespace plateau {

// The calibration GEMM is [rows x kCalibrationGemmDim] x [kCalibrationGemmDim
// x kCalibrationGemmDim]: its rate against `rows` stands for the rate of a
// GEMM against its narrowest dimension.
inline constexpr int64_t kCalibrationGemmDim = 256;

// What the time model reads of a worker (a plain mirror of
// plateau.v1.Calibration, which carries it from the worker).
struct Calibration {
  struct GemmPoint {
    int64_t rows = 0;
    double seconds = 0;  // one GEMM of the calibration shape, launch included
  };
  std::vector<GemmPoint> gemm;  // rows ascending, >= 1 point
  double launch_seconds = 0;    // one tiny operation, enqueue to done
  double h2d_bytes_per_second = 0;
  double d2h_bytes_per_second = 0;
  double adamw_params_per_second = 0;
  double collective_seconds = 0;  // one collective's latency (an estimate)
};

// The documented default curves, used when no worker has reported a
// calibration (docs/SCHEDULES.md gives the numbers): kCpu is a 2-core
// OpenBLAS machine over Gloo/TCP, kCuda one H200 over NVLink/NCCL.
enum class CalibrationBackend { kCpu, kCuda };
Calibration DefaultCalibration(CalibrationBackend backend);

// INVALID_ARGUMENT naming the field when a calibration cannot be modelled
// (no GEMM point, rows not ascending or past 2^30, a time or rate <= 0 or
// not finite, a time over 60 s or a rate over 1e15 a second: bounds that
// keep the model's sums finite).
absl::Status ValidateCalibration(const Calibration& c);

// --- The time model (seconds per training step, per rank) -----------------

// One GEMM [m x k] x [k x n]: the launch, then 2 m k n FLOPs at the rate the
// calibration measured at rows = min(m, k, n) (interpolated in log2 rows,
// clamped at the measured ends; the launch subtracted from each point).
double GemmSeconds(const Calibration& c, int64_t m, int64_t k, int64_t n);

// The part of a step each setting changes, at that setting (the options'
// own value of every other setting):
// - c: per layer K = ceil(N / c) chunks, each with three passes (forward,
//   the checkpointed recompute, the backward replay) of two all-to-alls and
//   their launches, and 15 expert GEMMs per local expert ([c k P / E rows x
//   H] x [H x F]: 3 forward, 3 recompute, 3 + 6 in the replay).
double DispatchSeconds(const StepOptions& o, int64_t chunk_tokens, const Calibration& c);
// - S: per meeting (P per ring) and row tile, ceil((V / P) / S) strips, each
//   four strip GEMMs ([min(N, row_tile) x H] x [H x S]: logits, the
//   backward's recompute, dX, dW) and two launches of its fold.
double ProjectionSeconds(const StepOptions& o, int64_t strip, const Calibration& c);
// One layer's forward GEMMs at N rows: attention's projections, its causal
// core (half of the [N x seq_len] score and value products), the router and
// the experts ([N k P / E] rows per local expert).
double LayerForwardSeconds(const StepOptions& o, const Calibration& c);
// - beta: each of the j = PlanSco(...).host_boundaries pooled boundaries
//   (and, under keep_attention, each pooled attention record: PlanScoPools) is
//   copied down in forward and up in backward; a copy costs its launch on
//   the compute stream (the event wait) and whatever of it the layer's
//   compute does not hide (forward: one layer's GEMMs; backward: recompute
//   and backward, three times that, less attention's core when the
//   recompute skips it: CheckpointOptions::keep_attention).
double CheckpointSeconds(const StepOptions& o, int64_t host_budget_bytes, const Calibration& c);
// - bucket: the update's buckets (OffloadStreamBuckets) through a
//   three-stage pipeline (upload master/m/v, AdamW, download) with
//   staging_slots slots: bucket i's upload waits for bucket i - slots'
//   download; each stage is a launch plus its bytes or parameters at the
//   measured rate.
double OptimizerSeconds(const StepOptions& o, int64_t bucket_params, const Calibration& c);

// --- The choice -----------------------------------------------------------

enum class AutoSetting { kChunkTokens, kStrip, kHostBudget, kBucketParams };
inline constexpr int kNumAutoSettings = 4;
// The spec's field: "schedule.pipelined_llep.chunk_tokens", ...
const char* AutoSettingField(AutoSetting s);

// Which settings are `auto`. A setting whose schedule is off in the options
// cannot be (ChooseAutoSettings refuses it, naming the field).
struct AutoRequest {
  bool chunk_tokens = false;
  bool strip = false;
  bool host_budget = false;
  bool bucket_params = false;
  bool any() const { return chunk_tokens || strip || host_budget || bucket_params; }
  bool has(AutoSetting s) const;
};

// The values considered, ascending (memory grows with c, S and the bucket,
// shrinks with beta):
// - c: powers of two from 16 below N, then N (K = 1; a larger c plans as N);
// - S: powers of two from 16 below ceil(V / P), then ceil(V / P) (one strip
//   per shard; at most V);
// - beta: j N H 4 bytes for j = 0 .. L - 1 (the smallest beta that pools j
//   boundaries), at most 33 values of j evenly spaced when L > 33;
// - bucket: powers of two from 1024 (or from the first one with at most 4096
//   buckets in the larger parameter group) below that group, then that
//   group (one bucket).
// `layout` (optional, everywhere below): LayoutOf(o), when the caller has it
// (it lists every weight: a deep model's costs more than a plan).
std::vector<int64_t> AutoCandidates(const StepOptions& o, AutoSetting s, const ParamLayout* layout = nullptr);

// The options with setting s at value v.
void SetAutoSetting(StepOptions* o, AutoSetting s, int64_t v);
int64_t GetAutoSetting(const StepOptions& o, AutoSetting s);
// The modelled seconds of setting s's part of the step at value v.
double AutoSettingSeconds(const StepOptions& o, AutoSetting s, int64_t v, const Calibration& c);

// The options with each requested setting at its candidate with the
// smallest device plan (then host plan): where a plan that cannot fit is
// shown, and what ChooseAutoSettings' nothing-fits error reports.
absl::StatusOr<StepOptions> SmallestAutoSettings(const StepOptions& options, const AutoRequest& request,
                                                 const ParamLayout* layout = nullptr);

struct AutoChoice {
  struct Setting {
    AutoSetting setting;
    int64_t value = 0;
    double seconds = 0;   // AutoSettingSeconds at value
    int candidates = 0;   // AutoCandidates' size
    int fitting = 0;      // candidates that fit with the other settings as chosen
    std::string why;      // the trade at this value
  };
  std::vector<Setting> settings;  // in AutoSetting order, the requested ones
  StepOptions options;            // the input with every chosen value set
  MemoryPlan plan;                // PlanMemory(options)
  double seconds = 0;             // the sum of the settings' seconds
};

// The candidate combination with the least modelled seconds (ties: the
// smaller device plan, then the smaller host plan, then the smaller values)
// among those whose plan fits `caps` (0: that space uncapped). Errors:
// INVALID_ARGUMENT from PlanMemory or for a setting whose schedule is off;
// RESOURCE_EXHAUSTED when nothing fits, naming the cap's field, the plan at
// the smallest settings and its largest live set.
absl::StatusOr<AutoChoice> ChooseAutoSettings(const StepOptions& options, const AutoRequest& request,
                                              const Calibration& calibration, const FitCaps& caps,
                                              const ParamLayout* layout = nullptr);

// --- N_max with the `auto` settings chosen at each N ------------------------
//
// A spec's `auto` settings are chosen for its own N; a larger N would choose
// differently (a smaller c, more of the boundaries pooled), so N_max and the
// what-if rows choose them again at every shape the search plans: a shape
// fits when some combination of the candidates fits (the chooser's
// RESOURCE_EXHAUSTED: none does, and the shape is planned at the smallest
// settings, over a cap). Only the settings the request names are chosen; a
// request for a schedule the shape does not run is dropped there (the
// what-if rows turn schedules off).
//
// The search stays exact (the answer fits, one step more does not): "some
// combination fits" is monotone in N wherever each fixed combination's fit
// is (n_max.h). Take N < N' and a combination that fits at N'; a
// combination at N with no live set larger fits too:
// - c: the candidates at N are the powers of two below N and N; c' at N'
//   maps to min(c', N), also a candidate. Its chunks are no more
//   (ceil(N / c) <= ceil(N' / c')) and no larger (c <= c'), so the dispatch
//   bound (slots of P c k rows, the count words per chunk, the borrowed
//   experts bounded by c k / min_piece) is no larger.
// - beta: the candidates are j N H e bytes, j the same list at every N (it
//   depends on L only): j' at N' maps to the same j at N, which pools the
//   same boundaries, each smaller (host j N H e, device (L + 1 - j) N H e).
// - S and the bucket: their candidates do not depend on N.
// The time model is not monotone in N, and need not be: which fitting
// combination is fastest changes nothing about whether one fits.
//
// The chooser compares the plan's total with caps.device_bytes (standard
// EP's worst case; caps.balanced_dispatch only changes that for standard EP
// and LLEP, which no `auto` setting belongs to).

// The shape plan (n_max.h) that chooses `request`'s settings for each shape
// (on `calibration`, against `caps`) and plans it at the choice; a shape
// where nothing fits is planned at SmallestAutoSettings.
// `layout`: the shapes' LayoutOf (the same at every shape), or null.
ShapePlan AutoShapePlan(const AutoRequest& request, const Calibration& calibration, const FitCaps& caps,
                        std::shared_ptr<const ParamLayout> layout = nullptr);

// The requested settings' values in `options` as {field, value}
// (AutoSettingField order), those whose schedule the options run.
std::vector<std::pair<std::string, int64_t>> AutoValues(const StepOptions& options, const AutoRequest& request);

// N_max (n_max.h SolveNMax) with `request`'s settings chosen at each N;
// each axis' auto_values are the choice at its answer. Errors: SolveNMax's,
// and INVALID_ARGUMENT for a bad calibration or a setting whose schedule the
// options do not run (as ChooseAutoSettings).
absl::StatusOr<NMax> SolveNMaxAuto(const StepOptions& options, const AutoRequest& request,
                                   const Calibration& calibration, const FitCaps& caps,
                                   const NMaxLimits& limits = {});

// The what-if table (n_max.h WhatIfNMax) with `request`'s settings chosen
// at each N in every row that runs their schedule with the options' own
// settings (printed "auto"; each axis' auto_values at its answer).
absl::StatusOr<std::vector<WhatIfRow>> WhatIfNMaxAuto(const StepOptions& options, const AutoRequest& request,
                                                      const Calibration& calibration, const FitCaps& caps,
                                                      const NMaxLimits& limits = {});

}  // namespace plateau

#endif  // PLATEAU_KERNELS_BUDGET_AUTO_SETTINGS_H_
