#include "kernels/optimizer/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace plateau {

double LearningRate(const OptimizerConfig& o, int64_t step) {
  const LrSchedule& s = o.schedule;
  const double lr = o.lr;
  // The default returns lr untouched (no arithmetic): bitwise the old step.
  if (s.decay == LrSchedule::Decay::kConstant && s.warmup_steps == 0) return lr;
  const int64_t t = step - 1;  // the scheduler's count before this step
  const int64_t W = s.warmup_steps, T = s.total_steps;
  if (t < W) return lr * static_cast<double>(t) / static_cast<double>(std::max<int64_t>(1, W));
  const double span = static_cast<double>(std::max<int64_t>(1, T - W));
  double factor = 1.0;
  switch (s.decay) {
    case LrSchedule::Decay::kConstant:
      return lr;
    case LrSchedule::Decay::kLinear:
      // transformers' (T - t) / max(1, T - W), written as they write it.
      factor = std::max(0.0, static_cast<double>(T - t) / span);
      break;
    case LrSchedule::Decay::kCosine: {
      const double p = static_cast<double>(t - W) / span;
      factor = std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * p)));
      break;
    }
  }
  return s.min_lr + (lr - s.min_lr) * factor;
}

float LearningRateF(const OptimizerConfig& o, int64_t step) {
  return static_cast<float>(LearningRate(o, step));
}

absl::string_view LrDecayName(LrSchedule::Decay d) {
  switch (d) {
    case LrSchedule::Decay::kConstant:
      return "constant";
    case LrSchedule::Decay::kCosine:
      return "cosine";
    case LrSchedule::Decay::kLinear:
      return "linear";
  }
  return "?";
}

absl::Status ValidateNewWarmup(const LrSchedule& s, absl::string_view prefix) {
  // At most steps - 1: step W + 1 is the first at lr, so a warm-up of the
  // job's whole length (W = steps) runs step 1 at 0 and never reaches lr.
  const int64_t most = std::max<int64_t>(0, s.total_steps - 1);
  if (s.warmup_steps >= 0 && s.warmup_steps <= most) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(prefix, ".warmup_steps: expected 0 to steps - 1 = ", most,
                   " (the warm-up must end before the job's last step, so that step warmup_steps + 1 runs at ", prefix,
                   ".lr), got ", s.warmup_steps));
}

absl::Status ValidateLrSchedule(const OptimizerConfig& o, absl::string_view prefix) {
  const LrSchedule& s = o.schedule;
  const bool scheduled = s.decay != LrSchedule::Decay::kConstant || s.warmup_steps != 0;
  if (scheduled && s.total_steps < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "steps: expected >= 1 for a learning-rate schedule (it ends at the job's last step), got ", s.total_steps));
  }
  // W = steps is accepted here: jobs submitted with it before new submits
  // refused it (ValidateNewWarmup) are placed, restarted and resumed with
  // this check, and run the schedule they were accepted with.
  if (s.warmup_steps < 0 || s.warmup_steps > std::max<int64_t>(0, s.total_steps)) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, ".warmup_steps: expected 0 to steps = ", s.total_steps,
                                                   " (a warm-up no longer than the job), got ", s.warmup_steps));
  }
  if (!std::isfinite(s.min_lr) || s.min_lr < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, ".min_lr: expected a finite value >= 0 (an absolute learning rate), got ", s.min_lr));
  }
  if (s.min_lr > static_cast<double>(o.lr)) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, ".min_lr: expected at most ", prefix, ".lr = ", o.lr,
                                                   " (the floor the decay ends at), got ", s.min_lr));
  }
  if (s.decay == LrSchedule::Decay::kConstant && s.min_lr != 0) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, ".min_lr: expected 0 (unset) with ", prefix,
                                                   ".lr_decay constant, which has no floor; got ", s.min_lr,
                                                   " (set lr_decay to LR_DECAY_COSINE or LR_DECAY_LINEAR)"));
  }
  return absl::OkStatus();
}

}  // namespace plateau
