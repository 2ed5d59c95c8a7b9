#include "worker/device_slots.h"

#include <unistd.h>  // environ

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace plateau {

absl::StatusOr<std::vector<int>> FreeDeviceSlots(int slots, const std::vector<int>& in_use, int count) {
  std::vector<int> free;
  for (int s = 0; s < slots && static_cast<int>(free.size()) < count; ++s) {
    if (std::find(in_use.begin(), in_use.end(), s) == in_use.end()) free.push_back(s);
  }
  if (static_cast<int>(free.size()) < count) {
    std::vector<int> taken = in_use;
    std::sort(taken.begin(), taken.end());
    return absl::ResourceExhaustedError(absl::StrCat("devices: ", count, " rank(s) need a device slot each, but only ",
                                                     free.size(), " of ", slots, " are free (held: ",
                                                     absl::StrJoin(taken, ","), ")"));
  }
  return free;
}

absl::StatusOr<std::string> RankVisibleDevices(const std::optional<std::string>& agent_visible, int slot) {
  if (!agent_visible.has_value() || agent_visible->empty()) return absl::StrCat(slot);
  std::vector<std::string> ids = absl::StrSplit(*agent_visible, ',', absl::SkipWhitespace());
  if (slot < 0 || slot >= static_cast<int>(ids.size())) {
    return absl::InvalidArgumentError(absl::StrCat("devices: slot ", slot, " has no GPU: the agent's CUDA_VISIBLE_DEVICES='",
                                                   *agent_visible, "' names ", ids.size(),
                                                   " (start the agent with --devices at most that)"));
  }
  return std::string(absl::StripAsciiWhitespace(ids[slot]));
}

std::vector<std::string> WithVisibleDevices(const std::vector<std::string>& env, const std::string& visible) {
  std::vector<std::string> out;
  out.reserve(env.size() + 1);
  const std::string entry = absl::StrCat("CUDA_VISIBLE_DEVICES=", visible);
  bool replaced = false;
  for (const std::string& e : env) {
    if (absl::StartsWith(e, "CUDA_VISIBLE_DEVICES=")) {
      if (!replaced) out.push_back(entry);
      replaced = true;
    } else {
      out.push_back(e);
    }
  }
  if (!replaced) out.push_back(entry);
  return out;
}

absl::StatusOr<std::vector<std::string>> CudaRankEnvironment(const std::vector<std::string>& env, int slot,
                                                             std::string* visible) {
  std::optional<std::string> agent_visible;
  bool module_loading = false;
  for (const std::string& e : env) {
    absl::string_view value = e;
    if (absl::ConsumePrefix(&value, "CUDA_VISIBLE_DEVICES=")) agent_visible = std::string(value);
    module_loading = module_loading || absl::StartsWith(e, "CUDA_MODULE_LOADING=");
  }
  absl::StatusOr<std::string> ids = RankVisibleDevices(agent_visible, slot);
  if (!ids.ok()) return ids.status();
  *visible = *ids;
  std::vector<std::string> out = WithVisibleDevices(env, *ids);
  if (!module_loading) out.push_back("CUDA_MODULE_LOADING=EAGER");
  return out;
}

std::vector<std::string> ProcessEnvironment() {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  return env;
}

}  // namespace plateau
