// What the step tests that compare schedules share: routing skewed as far
// as it goes, and a run's peaks held to the plan.
#ifndef PLATEAU_KERNELS_STEP_STEP_TESTING_H_
#define PLATEAU_KERNELS_STEP_STEP_TESTING_H_

#include <algorithm>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/budget/budget.h"
#include "kernels/memory.h"
#include "kernels/model/config.h"
#include "kernels/model/params.h"
#include "kernels/status_macros.h"
#include "kernels/step/step.h"

namespace plateau {

// Routing skewed as far as it goes: every router weight zero, so every
// token's router logits tie and the documented tie-break picks experts
// 0..k-1, all homed on rank 0 (standard EP's and LLEP's worst case).
// Collective: every rank of the step calls it, before the step's first pass.
// Fails unless it zeroed one router per layer: a renamed weight would
// otherwise leave every "skewed" case testing the learned routing.
inline absl::Status SkewRouting(TrainingStep& step, const ModelConfig& m) {
  PLATEAU_ASSIGN_OR_RETURN(ModelState state, step.GatherState());
  const std::vector<WeightSpec> specs = ModelWeights(m);
  int64_t zeroed = 0;
  for (size_t t = 0; t < specs.size(); ++t) {
    if (absl::StrContains(specs[t].name, "router.weight")) {
      std::fill(state.weights[t].begin(), state.weights[t].end(), 0.0f);
      ++zeroed;
    }
  }
  if (zeroed != m.layers) {
    return absl::InternalError(
        absl::StrCat("SkewRouting: zeroed ", zeroed, " router weights, expected one per layer (", m.layers, ")"));
  }
  return step.LoadState(state);
}

// Every rank's device and host peaks (one MemoryStats per rank) within the
// plan of `o`: each live set, and the device total.
inline void ExpectWithinPlan(const std::vector<MemoryStats>& device,
                             const std::vector<MemoryStats>& host, const StepOptions& o,
                             const std::string& what) {
  auto plan = PlanMemory(o);
  ASSERT_TRUE(plan.ok()) << what << ": " << plan.status();
  ASSERT_EQ(device.size(), static_cast<size_t>(o.layout.ranks)) << what;
  ASSERT_EQ(host.size(), device.size()) << what;
  for (int r = 0; r < o.layout.ranks; ++r) {
    for (int i = 0; i < kNumLiveSets; ++i) {
      const std::string set(LiveSetName(static_cast<LiveSet>(i)));
      EXPECT_LE(device[r].peak[i], plan->bytes[i]) << what << " rank " << r << " device " << set;
      EXPECT_LE(host[r].peak[i], plan->host_bytes[i]) << what << " rank " << r << " host " << set;
    }
    EXPECT_LE(device[r].total_peak, plan->total()) << what << " rank " << r << " device total";
    EXPECT_LE(host[r].total_peak, plan->host_total()) << what << " rank " << r << " host total";
  }
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_STEP_STEP_TESTING_H_
