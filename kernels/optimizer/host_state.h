// Checks and copies shared by the optimizer placements that keep their
// state in host memory.
#ifndef PLATEAU_KERNELS_OPTIMIZER_HOST_STATE_H_
#define PLATEAU_KERNELS_OPTIMIZER_HOST_STATE_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/optimizer/optimizer_update.h"

namespace plateau {

// INVALID_ARGUMENT unless the master has S values and each moment S or X
// values or none (none: zero).
inline absl::Status CheckShardState(const OptimizerShardState& st, int64_t S, int64_t X) {
  auto check = [](const std::vector<float>& v, int64_t n, const char* what, bool may_be_empty) {
    if ((may_be_empty && v.empty()) || static_cast<int64_t>(v.size()) == n) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer state: ", what, " has ", v.size(), " values, expected ", n));
  };
  for (const absl::Status& s :
       {check(st.dense_master, S, "the dense master", false), check(st.dense_m, S, "the dense m", true),
        check(st.dense_v, S, "the dense v", true), check(st.owned_m, X, "the owned weights' m", true),
        check(st.owned_v, X, "the owned weights' v", true)}) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// dst[0, n) = src, or zeros when src is empty.
inline void PutOrZero(const std::vector<float>& src, int64_t n, float* dst) {
  if (src.empty()) {
    std::fill_n(dst, n, 0.0f);
  } else {
    std::copy_n(src.data(), n, dst);
  }
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_OPTIMIZER_HOST_STATE_H_
