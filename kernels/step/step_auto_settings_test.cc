// The `auto` settings' choice fits the real step (issue 15): under a capped
// CPU arena and a host cap, the step at the values ChooseAutoSettings picks
// runs an optimizer step, from the tightest cap any values fit to a roomy
// one, and with the caps set to exactly the chosen plan. With PipelinedLLEP
// every live set is launch-sized, so TrainingStep::Create sees the whole
// plan. (The choice's argmin and fit against the plan:
// kernels/budget/auto_settings_test.)
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/budget/auto_settings.h"
#include "kernels/budget/budget.h"
#include "kernels/communicator.h"
#include "kernels/step/capped_step_testing.h"
#include "kernels/step/step.h"
#include "kernels/testing/local_world.h"
#include "kernels/testing/tiny_model.h"

namespace plateau {
namespace {

constexpr int kRanks = 2;

StepOptions AllOn() {
  StepOptions o;
  o.model = TinyModel();
  o.model.vocab_size = 64;
  o.model.layers = 3;
  o.model.seq_len = 32;
  o.layout = {kRanks, 4};
  o.dispatch.kind = DispatchOptions::Kind::kPipelinedLlep;
  o.dispatch.pipelined.balance.min_piece = 4;
  o.projection.kind = ProjectionOptions::Kind::kRingDtp;
  o.projection.row_tile = 16;
  o.checkpoints.kind = CheckpointOptions::Kind::kSco;
  o.optimizer_placement.kind = OptimizerPlacementOptions::Kind::kOffloadStream;
  return o;
}

absl::Status RunOneStep(const StepOptions& o, const FitCaps& caps) {
  return RunOneStepUnderCaps(o, kRanks, caps.device_bytes, caps.host_bytes, /*seed=*/11, "auto");
}

TEST(StepAutoSettingsTest, TheChoiceRunsUnderTheCapsItWasChosenFor) {
  const StepOptions base = AllOn();
  const AutoRequest all{true, true, true, true};
  const Calibration cal = DefaultCalibration(CalibrationBackend::kCpu);
  auto roomy = ChooseAutoSettings(base, all, cal, FitCaps{int64_t{1} << 30, 0});
  ASSERT_TRUE(roomy.ok()) << roomy.status();
  auto smallest = SmallestAutoSettings(base, all);
  ASSERT_TRUE(smallest.ok());
  const MemoryPlan low = *PlanMemory(*smallest);
  ASSERT_LT(low.total(), roomy->plan.total());
  // The host cap holds the smallest settings' pool and the optimizer state,
  // not the roomy plan's: beta must trade against it too.
  const int64_t host_cap = low.host_total();
  std::vector<std::vector<int64_t>> chosen;
  for (int64_t cap : {low.total(), (low.total() + roomy->plan.total()) / 2, roomy->plan.total()}) {
    SCOPED_TRACE(absl::StrCat("device cap ", cap, ", host cap ", host_cap));
    auto c = ChooseAutoSettings(base, all, cal, FitCaps{cap, host_cap});
    ASSERT_TRUE(c.ok()) << c.status();
    std::vector<int64_t> values;
    for (const AutoChoice::Setting& s : c->settings) values.push_back(s.value);
    chosen.push_back(values);
    EXPECT_LE(c->plan.total(), cap);
    EXPECT_LE(c->plan.host_total(), host_cap);
    EXPECT_TRUE(RunOneStep(c->options, FitCaps{cap, host_cap}).ok());
    // Exactly the chosen plan as the caps: nothing more is needed.
    const absl::Status tight = RunOneStep(c->options, FitCaps{c->plan.total(), c->plan.host_total()});
    EXPECT_TRUE(tight.ok()) << tight;
  }
  // The caps moved the choice (the test ran more than one set of values).
  EXPECT_NE(chosen.front(), chosen.back());
}

}  // namespace
}  // namespace plateau
