#include "worker/assignment.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace plateau {

absl::Status CheckAssignment(const v1::Assignment& a) {
  const std::string& id = a.job_id();
  // "job-" and 1 to 19 digits, the first not 0: JobIdOf's spelling.
  bool canonical = id.size() > 4 && id.size() <= 23 && id.rfind("job-", 0) == 0 && id[4] != '0';
  for (size_t i = 4; canonical && i < id.size(); ++i)
    canonical = absl::ascii_isdigit(static_cast<unsigned char>(id[i]));
  if (!canonical) {
    return absl::InvalidArgumentError(
        absl::StrCat("assignment: job_id: expected 'job-N' (N > 0), got '", absl::CHexEscape(id.substr(0, 64)), "'"));
  }
  if (a.attempt() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("assignment: attempt: expected >= 0, got ", a.attempt()));
  }
  const std::string& prefix = a.kv_prefix();
  bool printable = !prefix.empty() && prefix.size() <= 1024;
  for (char c : prefix) printable = printable && absl::ascii_isgraph(static_cast<unsigned char>(c));
  if (!printable) {
    return absl::InvalidArgumentError(
        absl::StrCat("assignment: kv_prefix: expected 1 to 1024 printable characters without spaces, got '",
                     absl::CHexEscape(prefix.substr(0, 64)), "'"));
  }
  const int64_t ranks = a.spec().layout().ranks();
  std::vector<bool> seen(static_cast<size_t>(std::clamp<int64_t>(ranks, 0, int64_t{1} << 20)), false);
  for (int r : a.ranks()) {
    if (r < 0 || r >= static_cast<int64_t>(seen.size()) || seen[r]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "assignment: ranks: expected distinct ranks of 0 to layout.ranks - 1 = ", ranks - 1, ", got ", r));
    }
    seen[r] = true;
  }
  return absl::OkStatus();
}

}  // namespace plateau
