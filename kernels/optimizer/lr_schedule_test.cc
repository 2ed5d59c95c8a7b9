#include "kernels/optimizer/lr_schedule.h"

#include <cmath>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

// The references, written from the docs (python3-torch is not installed
// here), in double. t is the scheduler's count: optimizer step t + 1.
//
// transformers.get_linear_schedule_with_warmup's lr_lambda:
//   if t < W: t / max(1, W)
//   else:     max(0, (T - t) / max(1, T - W))
double HfLinear(int64_t t, int64_t W, int64_t T) {
  if (t < W) return double(t) / double(std::max<int64_t>(1, W));
  return std::max(0.0, double(T - t) / double(std::max<int64_t>(1, T - W)));
}
// transformers.get_cosine_schedule_with_warmup (num_cycles = 0.5):
//   if t < W: t / max(1, W)
//   progress = (t - W) / max(1, T - W)
//   max(0, 0.5 * (1 + cos(pi * num_cycles * 2 * progress)))
double HfCosine(int64_t t, int64_t W, int64_t T) {
  if (t < W) return double(t) / double(std::max<int64_t>(1, W));
  const double progress = double(t - W) / double(std::max<int64_t>(1, T - W));
  return std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * 0.5 * 2.0 * progress)));
}
// transformers.get_constant_schedule_with_warmup:
//   t < W: t / max(1, W); else 1
double HfConstant(int64_t t, int64_t W) { return t < W ? double(t) / double(std::max<int64_t>(1, W)) : 1.0; }
// torch.optim.lr_scheduler.CosineAnnealingLR, closed form:
//   eta_t = eta_min + (eta_max - eta_min) * (1 + cos(T_cur / T_max * pi)) / 2
double TorchCosineAnnealing(double eta_max, double eta_min, int64_t T_cur, int64_t T_max) {
  return eta_min + (eta_max - eta_min) * (1.0 + std::cos(double(T_cur) / double(T_max) * M_PI)) / 2.0;
}
// torch.optim.lr_scheduler.LinearLR, closed form:
//   base_lr * (start + (end - start) * min(T_cur, total_iters) / total_iters)
double TorchLinearLR(double base, double start, double end, int64_t T_cur, int64_t total_iters) {
  return base * (start + (end - start) * double(std::min(T_cur, total_iters)) / double(total_iters));
}

OptimizerConfig Config(LrSchedule::Decay d, int64_t W, int64_t T, double min_lr = 0.0, float lr = 6e-3f) {
  OptimizerConfig o;
  o.lr = lr;
  o.schedule.decay = d;
  o.schedule.warmup_steps = W;
  o.schedule.total_steps = T;
  o.schedule.min_lr = min_lr;
  return o;
}

// (W, T) pairs covering W = 0, W = T, W = 1, T = 1 and the general case.
const std::vector<std::pair<int64_t, int64_t>> kShapes = {{0, 10}, {3, 10}, {10, 10}, {1, 1}, {0, 1},
                                                          {1, 2},  {5, 7},  {0, 1000}, {100, 1000}};

// The same expressions in the same order where they can be (min_lr = 0:
// lr * factor), so within 2 ulps of double: the only reordering is our
// min_lr + (lr - min_lr) * f against lr * f, exact for min_lr = 0.
constexpr double kRel = 4e-16;

TEST(LrScheduleTest, DefaultIsTheLearningRateItselfAtEveryStep) {
  OptimizerConfig o;
  o.lr = 6e-3f;
  for (int64_t s : {1, 2, 3, 100, 1000000}) {
    EXPECT_EQ(LearningRate(o, s), double(o.lr)) << s;
    // Bitwise the kernel's old argument: existing jobs' losses do not change.
    EXPECT_EQ(LearningRateF(o, s), o.lr) << s;
  }
}

TEST(LrScheduleTest, MatchesTransformersWarmupHelpersWithoutFloor) {
  for (auto [W, T] : kShapes) {
    const double lr = 6e-3f;
    for (int64_t s = 1; s <= T; ++s) {
      const int64_t t = s - 1;
      EXPECT_NEAR(LearningRate(Config(LrSchedule::Decay::kLinear, W, T), s), lr * HfLinear(t, W, T), lr * kRel)
          << "linear W=" << W << " T=" << T << " step " << s;
      EXPECT_NEAR(LearningRate(Config(LrSchedule::Decay::kCosine, W, T), s), lr * HfCosine(t, W, T), lr * kRel)
          << "cosine W=" << W << " T=" << T << " step " << s;
      EXPECT_NEAR(LearningRate(Config(LrSchedule::Decay::kConstant, W, T), s), lr * HfConstant(t, W), lr * kRel)
          << "constant W=" << W << " T=" << T << " step " << s;
    }
  }
}

// With a floor, the decay is torch's CosineAnnealingLR(T_max = T - W,
// eta_min = min_lr) and LinearLR(start_factor = 1, end_factor = min_lr /
// lr, total_iters = T - W), counted from the end of the warm-up (as
// SequentialLR hands over at milestone W).
TEST(LrScheduleTest, DecayWithFloorMatchesTorchClosedForms) {
  const double min_lr = 6e-4;
  for (auto [W, T] : kShapes) {
    if (T - W < 1) continue;  // no decay phase
    const double lr = 6e-3f;
    for (int64_t s = W + 1; s <= T; ++s) {
      const int64_t T_cur = s - 1 - W;
      EXPECT_NEAR(LearningRate(Config(LrSchedule::Decay::kCosine, W, T, min_lr), s),
                  TorchCosineAnnealing(lr, min_lr, T_cur, T - W), lr * kRel)
          << "W=" << W << " T=" << T << " step " << s;
      // LinearLR's start + (end - start) * x is the same line written
      // differently: a few ulps apart.
      EXPECT_NEAR(LearningRate(Config(LrSchedule::Decay::kLinear, W, T, min_lr), s),
                  TorchLinearLR(lr, 1.0, min_lr / lr, T_cur, T - W), lr * 8e-16)
          << "W=" << W << " T=" << T << " step " << s;
    }
  }
}

TEST(LrScheduleTest, Boundaries) {
  const float lr = 6e-3f;
  const double min_lr = 6e-4;
  for (LrSchedule::Decay d : {LrSchedule::Decay::kCosine, LrSchedule::Decay::kLinear}) {
    SCOPED_TRACE(LrDecayName(d));
    // Warm-up from 0: step 1 runs at exactly 0 (torch's scheduler count 0).
    const OptimizerConfig o = Config(d, 4, 20, min_lr, lr);
    EXPECT_EQ(LearningRate(o, 1), 0.0);
    EXPECT_DOUBLE_EQ(LearningRate(o, 2), lr * 1.0 / 4.0);
    EXPECT_DOUBLE_EQ(LearningRate(o, 4), lr * 3.0 / 4.0);  // the last warm-up step
    EXPECT_EQ(LearningRateF(o, 5), lr);                    // the peak: the first step after it
    // The last step runs one decrement above the floor; the floor is where
    // the schedule stands after it (step T + 1).
    const double last = LearningRate(o, 20), after = LearningRate(o, 21);
    EXPECT_GT(last, min_lr);
    EXPECT_NEAR(after, min_lr, 1e-18);
    if (d == LrSchedule::Decay::kLinear) {
      EXPECT_NEAR(last, min_lr + (lr - min_lr) / 16.0, 1e-18);
    } else {
      EXPECT_NEAR(last, min_lr + (lr - min_lr) * 0.5 * (1 + std::cos(M_PI * 15.0 / 16.0)), 1e-18);
    }
    // Monotone: up during the warm-up, down after.
    for (int64_t s = 2; s <= 20; ++s) {
      if (s <= 5) {
        EXPECT_GT(LearningRate(o, s), LearningRate(o, s - 1)) << s;
      } else {
        EXPECT_LT(LearningRate(o, s), LearningRate(o, s - 1)) << s;
      }
    }
    // W = 0: step 1 runs at the peak.
    EXPECT_EQ(LearningRateF(Config(d, 0, 20, min_lr, lr), 1), lr);
    // W = T: the whole job warms up; its last step is at lr (T - 1) / T.
    const OptimizerConfig all = Config(d, 20, 20, min_lr, lr);
    EXPECT_EQ(LearningRate(all, 1), 0.0);
    EXPECT_DOUBLE_EQ(LearningRate(all, 20), lr * 19.0 / 20.0);
  }
}

TEST(LrScheduleTest, PureFunctionOfTheStep) {
  // What a resumed job relies on: no state, so step s gives the same bits
  // whether or not the steps before it were computed in this process.
  const OptimizerConfig o = Config(LrSchedule::Decay::kCosine, 7, 50, 1e-5);
  std::vector<double> forward;
  for (int64_t s = 1; s <= 50; ++s) forward.push_back(LearningRate(o, s));
  for (int64_t s = 50; s >= 1; --s) EXPECT_EQ(LearningRate(o, s), forward[s - 1]) << s;
}

TEST(LrScheduleTest, ValidationNamesTheField) {
  using D = LrSchedule::Decay;
  EXPECT_TRUE(ValidateLrSchedule(Config(D::kConstant, 0, 0)).ok());  // the default
  EXPECT_TRUE(ValidateLrSchedule(Config(D::kCosine, 9, 10, 6e-3f)).ok());
  // W = steps: what a job accepted before 2026-12-07 may run (only a new
  // submit refuses it: NewJobsWarmUpEndsBeforeTheLastStep).
  EXPECT_TRUE(ValidateLrSchedule(Config(D::kCosine, 10, 10, 6e-3f)).ok());
  EXPECT_TRUE(ValidateLrSchedule(Config(D::kConstant, 1, 1)).ok());
  struct Case {
    OptimizerConfig o;
    const char* want;
  };
  const Case cases[] = {
      {Config(D::kCosine, 11, 10), "optimizer.warmup_steps: expected 0 to steps = 10"},
      {Config(D::kLinear, -1, 10), "optimizer.warmup_steps"},
      {Config(D::kCosine, 0, 10, -1e-4), "optimizer.min_lr: expected a finite value >= 0"},
      {Config(D::kCosine, 0, 10, NAN), "optimizer.min_lr: expected a finite value >= 0"},
      {Config(D::kCosine, 0, 10, INFINITY), "optimizer.min_lr: expected a finite value >= 0"},
      {Config(D::kLinear, 0, 10, 7e-3), "optimizer.min_lr: expected at most optimizer.lr"},
      {Config(D::kConstant, 2, 10, 1e-4), "optimizer.min_lr: expected 0 (unset) with optimizer.lr_decay constant"},
      {Config(D::kCosine, 0, 0), "steps: expected >= 1 for a learning-rate schedule"},
  };
  for (const Case& c : cases) {
    absl::Status s = ValidateLrSchedule(c.o);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.want;
    EXPECT_THAT(s.message(), HasSubstr(c.want));
  }
}

// A new job's warm-up ends before its last step (step W + 1 runs at lr);
// W = steps ran step 1 at 0 and never reached lr.
TEST(LrScheduleTest, NewJobsWarmUpEndsBeforeTheLastStep) {
  using D = LrSchedule::Decay;
  EXPECT_TRUE(ValidateNewWarmup(Config(D::kConstant, 0, 0).schedule).ok());  // the default
  // The longest: step W + 1 = 10, the job's last, runs at lr.
  EXPECT_TRUE(ValidateNewWarmup(Config(D::kCosine, 9, 10).schedule).ok());
  struct Case {
    OptimizerConfig o;
    const char* want;
  };
  const Case cases[] = {
      {Config(D::kCosine, 10, 10), "optimizer.warmup_steps: expected 0 to steps - 1 = 9"},
      {Config(D::kCosine, 11, 10), "optimizer.warmup_steps: expected 0 to steps - 1 = 9"},
      {Config(D::kConstant, 1, 1), "optimizer.warmup_steps: expected 0 to steps - 1 = 0"},
      {Config(D::kLinear, -1, 10), "optimizer.warmup_steps: expected 0 to steps - 1 = 9"},
  };
  for (const Case& c : cases) {
    absl::Status s = ValidateNewWarmup(c.o.schedule);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.want;
    EXPECT_THAT(s.message(), HasSubstr(c.want));
    EXPECT_THAT(s.message(), HasSubstr("so that step warmup_steps + 1 runs at optimizer.lr"));
  }
}

}  // namespace
}  // namespace plateau
