#include "worker/rank_communicator.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "kernels/status_macros.h"
#include "worker/job_spec.h"

namespace plateau {

absl::StatusOr<CommunicatorOptions> ToCommunicatorOptions(const v1::JobSpec& spec) {
  PLATEAU_ASSIGN_OR_RETURN(BackendOptions backend, ToBackendOptions(spec));
  if (spec.layout().ranks() < 1) return absl::InvalidArgumentError(absl::StrCat("layout.ranks: expected >= 1, got ", spec.layout().ranks()));
  if (spec.progress_timeout_s() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "progress_timeout_s: expected >= 0 (0: the coordinator's default), got ", spec.progress_timeout_s()));
  }
  CommunicatorOptions o;
  o.backend = backend.kind;
  o.size = static_cast<int>(spec.layout().ranks());
  // 600 s: the coordinator's --default_progress_timeout default, which a
  // rank cannot see.
  const int64_t progress_s = spec.progress_timeout_s() > 0 ? spec.progress_timeout_s() : 600;
  o.timeout = absl::Seconds(std::max<int64_t>(progress_s, 60));
  return o;
}

}  // namespace plateau
