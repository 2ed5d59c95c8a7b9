// N_max (DESIGN.md §1.5): the largest tokens per rank that fits a device
// cap and a host cap, and the what-if table of which schedule buys how much,
// solved from the budget's plan (budget.h PlanMemory) without a backend.
// Read by the coordinator's plan (worker/job_spec.h PlanJob) and the tests.
//
// Thread safety: free functions without shared state (NMaxLimits::check is
// called on the caller's thread).
#ifndef PLATEAU_KERNELS_BUDGET_N_MAX_H_
#define PLATEAU_KERNELS_BUDGET_N_MAX_H_

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/budget/budget.h"
#include "kernels/model/step_options.h"

namespace plateau {

// N_max (DESIGN.md §1.5): the largest tokens per rank N = B T / P that fits
// a device cap and a host cap, solved from PlanMemory itself (no second
// formula), along the two axes a layout can grow:
// - batch: the largest global batch B at the spec's seq_len T (N steps by
//   T / P);
// - context: the longest seq_len T at the spec's batch, in steps of P
//   (ValidateLayout: every rank holds a contiguous slice of each sequence),
//   so N steps by B.
//
// Search: from the options' own shape, doubling until the plan does not fit
// (or the axis' limit), or halving until it does, then bisection; the answer x fits and x + 1 step does not (or x is the
// limit). Exact when the fit is monotone in N, which holds for every device
// live set: activations, the boundaries and the dense projection grow with
// N, SCO's device boundaries grow as fewer of them fit its fixed host
// budget, and the rest are flat. Two terms can make it not monotone, and
// then the answer is a boundary (fits, the next step does not) that may not
// be the largest: Ring-DTP with its mode unset switches mode at
// MaxVocabShardRows, and SCO's host pool with a fixed beta holds fewer,
// larger boundaries as N grows (its host bytes stay <= beta).
//
// Termination: some plans stop growing with N on one space: PipelinedLLEP's
// dispatch is flat once N >= c (only its count words grow, 8 (P + 1) E
// bytes per chunk), the weights, gradients and optimizer (and
// OffloadStreamAdamW's slots and host state) never grow, and with only a
// host cap the host plan may be flat altogether. So every search is capped
// at the validation limits (NMaxLimits) and says when the limit, not a cap,
// ended it.

// 0 means uncapped.
struct FitCaps {
  int64_t device_bytes = 0;
  int64_t host_bytes = 0;
  // Count standard EP's and LLEP's dispatch at their balanced case
  // (MemoryPlan::dispatch_balanced_bytes: every rank receives its N k rows)
  // instead of their worst case. Not a guarantee (routing may exceed it):
  // what a baseline run whose routing stays near balance holds, for
  // comparisons with tuned baselines (tools/frontier), and what the `auto`
  // settings are chosen against under force_launch (worker/job_spec.cc).
  // No effect on PipelinedLLEP, whose bound is its allocation.
  bool balanced_dispatch = false;
};
// The device bytes compared with the cap: the plan's total, with the
// dispatch term at its balanced case when caps.balanced_dispatch.
int64_t DeviceBytesAgainstCap(const MemoryPlan& plan, const FitCaps& caps);
// Both spaces within their caps: the device plan (standard EP's and LLEP's
// worst-case dispatch included unless caps.balanced_dispatch), and the host
// plan.
bool Fits(const MemoryPlan& plan, const FitCaps& caps);

struct NMaxLimits {
  // The largest layout.batch and model.seq_len searched (the job spec's
  // limits, worker/job_spec.cc).
  int64_t max_batch = int64_t{1} << 20;
  int64_t max_seq_len = int64_t{1} << 20;
  // Asked of every candidate shape before it is planned; a shape it refuses
  // ends the search there (limit "refused"). PlanJob passes the job spec's
  // size check, which keeps every byte count of the plan inside int64:
  // without one, the caller keeps the limits small enough for that.
  std::function<absl::Status(const StepOptions&)> check;
  // Asked before every candidate shape is checked and planned: a status
  // that is not OK ends the search, and the call (SolveNMax, a what-if
  // table), with that status. Unlike `check`'s refusal, which is an answer
  // about the shape, this is the caller's: the coordinator's PlanJob and
  // SubmitJob pass whether their RPC's caller still waits (its deadline,
  // its cancel), so that a plan nobody waits for stops within one shape,
  // not after every axis of every what-if row.
  std::function<absl::Status()> still_wanted;
};

// The largest shape along one axis.
struct NMaxAxis {
  int64_t batch = 0;            // layout.batch there (the spec's, on the context axis)
  int64_t seq_len = 0;          // model.seq_len there (the spec's, on the batch axis)
  int64_t tokens_per_rank = 0;  // N = batch * seq_len / ranks; 0: even the first step does not fit
  // What ended the search: "device_memory_bytes" or "host_memory_bytes" (the
  // next step's plan is over that cap), "layout.batch" or "model.seq_len"
  // (the validation limit fits), or "refused" (NMaxLimits::check or the
  // plan refused the next step's shape).
  std::string limit;
  // The next step's plan against the cap (its largest live sets), or why
  // nothing fits, or the limit.
  std::string detail;
  // The `auto` settings as chosen at this shape ({field, value}, e.g.
  // {"schedule.pipelined_llep.chunk_tokens", 32}) when the search chose
  // them at each shape (auto_settings.h SolveNMaxAuto); empty otherwise.
  std::vector<std::pair<std::string, int64_t>> auto_values;
};
struct NMax {
  NMaxAxis batch;
  NMaxAxis context;
};

// INVALID_ARGUMENT when the options do not plan (ValidateStepShape's error)
// or neither cap is set (name "device_memory_bytes"); NMaxLimits::
// still_wanted's status when it ends the search.
absl::StatusOr<NMax> SolveNMax(const StepOptions& options, const FitCaps& caps,
                               const NMaxLimits& limits = {});

// The plan of one candidate shape. SolveNMax plans each with PlanMemory at
// the options' own settings; a ShapePlan may instead choose settings for the
// shape (auto_settings.h: the `auto` settings chosen again at each N), which
// it writes into *shape before planning it, so that the caller can read
// what the plan was made with. An error is a shape that cannot be planned
// (the search's limit "refused"); a shape whose best plan is over a cap is a
// plan, not an error.
using ShapePlan = std::function<absl::StatusOr<MemoryPlan>(StepOptions* shape)>;

// SolveNMax with each candidate shape planned by `plan`. Exact (the answer
// fits, one step more does not) under the same monotonicity as SolveNMax:
// a ShapePlan that chooses settings must keep "some choice fits" monotone
// in N (auto_settings.h argues it for its chooser).
absl::StatusOr<NMax> SolveNMaxWith(const StepOptions& options, const FitCaps& caps, const NMaxLimits& limits,
                                   const ShapePlan& plan);

// What each schedule buys: N_max with the four schedules off (standard_ep,
// dense projection, full checkpoints, device AdamW), each one on alone, and
// all four on. A schedule the options chose runs with the options' own
// settings; otherwise with these defaults (the step's own defaults, which a
// job spec's 0 also means):
// - pipelined_llep: PipelinedLlepOptions{} (c = 4096 tokens, min_piece
//   1024, alpha 1.1): below N = c one chunk, beyond it flat;
// - ring_dtp: ProjectionOptions{} (strip min(1024, V), row_tile 2048, one
//   pass, the mode RingDtpChooseMode picks at each N);
// - sco: beta = every boundary that can leave (L - 1 of the L + 1) at each
//   N searched, less what the host cap cannot hold beside the other host
//   terms;
// - offload_stream_adamw: OptimizerPlacementOptions{} (buckets of 100M
//   parameters, 2 staging slots), the bucket cut to an eighth of the larger
//   parameter group (dense shard or owned experts) when that is smaller: a
//   bucket of the whole group would stage 2 x 3 of its floats on the
//   device, more than device AdamW's 3.
// The options' other choices (LLEP, the CPU-offload optimizer) are baselines:
// "off" means standard EP and device AdamW.
struct WhatIfRow {
  std::string schedules;              // "all off", "pipelined_llep", ..., "all on"
  std::vector<std::string> settings;  // the options the row ran with
  NMax n_max;
};

// A what-if table whose rows choose some of the options' settings at each
// shape (auto_settings.h WhatIfNMaxAuto: the spec's `auto` settings).
struct WhatIfPerShape {
  // Which of the options' own settings are chosen per shape, in
  // auto_settings.h's AutoSetting order (c, S, beta, bucket): a row that
  // runs that schedule with the options' settings prints it as "auto".
  std::array<bool, 4> chosen{};
  // The plan of a row's shapes, given the row's options (its schedules on,
  // each with the options' or the default settings).
  std::function<absl::StatusOr<ShapePlan>(const StepOptions& row)> plan;
  // The chosen values in a shape the row's plan planned (NMaxAxis::auto_values).
  std::function<std::vector<std::pair<std::string, int64_t>>(const StepOptions& planned)> values;
};

absl::StatusOr<std::vector<WhatIfRow>> WhatIfNMax(const StepOptions& options, const FitCaps& caps,
                                                  const NMaxLimits& limits = {},
                                                  const WhatIfPerShape* per_shape = nullptr);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_BUDGET_N_MAX_H_
