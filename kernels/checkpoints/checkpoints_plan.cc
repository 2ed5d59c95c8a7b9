#include "kernels/checkpoints/checkpoints_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace plateau {

int64_t FullCheckpointsBytes(int64_t layers, int64_t rows, int64_t hidden, const ElementBytes& e) {
  return (layers + 1) * rows * hidden * e.working;
}

ScoLayout PlanSco(int64_t layers, int64_t rows, int64_t hidden, int64_t host_budget_bytes,
                  const ElementBytes& e) {
  ScoLayout s;
  s.boundaries = layers + 1;
  s.boundary_bytes = rows * hidden * e.working;
  const int64_t fit = s.boundary_bytes > 0 ? std::max<int64_t>(host_budget_bytes, 0) / s.boundary_bytes : 0;
  s.host_boundaries = std::min(fit, std::max<int64_t>(0, layers - 1));
  return s;
}

ScoPools PlanScoPools(int64_t layers, int64_t rows, int64_t hidden, int64_t record_width, int64_t host_budget_bytes,
                      const ElementBytes& e) {
  ScoPools p;
  p.boundaries = PlanSco(layers, rows, hidden, host_budget_bytes, e);
  if (record_width > 0 && layers > 0) {
    const int64_t rest = std::max<int64_t>(host_budget_bytes, 0) - p.boundaries.host_bytes();
    p.records = PlanSco(layers - 1, rows, record_width, rest, kFp32Elements);
  }
  return p;
}

absl::Status ValidateSco(int64_t host_budget_bytes) {
  if (host_budget_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "schedule.sco.host_budget_bytes: expected >= 0 bytes of host memory per rank, got ",
        host_budget_bytes));
  }
  return absl::OkStatus();
}

}  // namespace plateau
