// The learning rate of each optimizer step (docs/MODEL.md "Learning-rate
// schedule"): a pure function of the options and the step, so that a job
// resumed from a checkpoint (which stores the step) continues the same
// schedule bit for bit, and every rank computes the same value.
//
// The convention is torch's: a scheduler is stepped after each optimizer
// step, so optimizer step s (1-based, as OptimizerUpdate::Update numbers
// them) runs at the scheduler's count t = s - 1. With W warm-up steps and T
// = total_steps, factor(t) is
//   t < W:           t / W                         (step 1 runs at 0)
//   t >= W:          p = (t - W) / max(1, T - W)
//     constant:      1
//     linear:        (T - t) / max(1, T - W)        (= 1 - p)
//     cosine:        0.5 * (1 + cos(pi * p))
// and lr(s) = min_lr + (lr - min_lr) * factor(t) after the warm-up, lr *
// factor(t) during it. With min_lr = 0 these are transformers'
// get_{constant,linear,cosine}_schedule_with_warmup exactly (LambdaLR over
// the same lambdas); the cosine part is torch's CosineAnnealingLR closed
// form with eta_min = min_lr, T_cur = t - W and T_max = T - W. The floor is
// reached at t = T: the value a step after the last would run at (what
// scheduler.step() sets after the job's last optimizer step); the last
// step itself runs one decrement above it.
//
// Thread safety: pure functions.
#ifndef PLATEAU_KERNELS_OPTIMIZER_LR_SCHEDULE_H_
#define PLATEAU_KERNELS_OPTIMIZER_LR_SCHEDULE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/model/step_options.h"

namespace plateau {

// The learning rate of 1-based optimizer step `step`, in double. Under the
// default schedule (constant, no warm-up) it is exactly o.lr, so an fp32
// kernel gets the same bits as before schedules existed.
double LearningRate(const OptimizerConfig& o, int64_t step);

// What the fp32 AdamW kernels run with: LearningRate rounded to float.
float LearningRateF(const OptimizerConfig& o, int64_t step);

// Checks o.schedule against o.lr; errors name the spec's fields under
// `prefix` ("optimizer"): warmup_steps within 0..total_steps, total_steps
// >= 1 when there is a warm-up or a decay, min_lr finite, >= 0, <= lr, and
// 0 under the constant schedule (it has no floor). What every job runs
// with, whenever it was accepted: each rank and each placement check it.
absl::Status ValidateLrSchedule(const OptimizerConfig& o, absl::string_view prefix = "optimizer");

// The tighter rule for a new job (the coordinator's SubmitJob): warmup_steps
// within 0..total_steps - 1, so that step W + 1, the first at lr, is one of
// the job's. W = total_steps was accepted until 2026-12-07, so
// ValidateLrSchedule still accepts it: a job stored with it keeps running
// (restarted, resumed, placed again) the schedule it was accepted with.
absl::Status ValidateNewWarmup(const LrSchedule& s, absl::string_view prefix = "optimizer");

// "constant", "cosine", "linear".
absl::string_view LrDecayName(LrSchedule::Decay d);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_OPTIMIZER_LR_SCHEDULE_H_
