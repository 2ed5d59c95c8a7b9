// Job labels (JobSpec.labels) and the label selector of ListJobs, with
// Kubernetes' rules and selector syntax, so that tools written for one read
// the other the same way. Pure functions, no state.
//
// A key is [prefix/]name: the prefix a DNS subdomain (lowercase [a-z0-9]
// at both ends, [-.a-z0-9] between, at most 253 characters), the name at
// most 63 characters [A-Za-z0-9] at both ends and [-_.A-Za-z0-9] between. A
// value is empty or such a name.
//
// A selector is a comma-separated list of requirements, all of which must
// hold: `key=value` / `key==value`, `key!=value` (also true when the job
// has no such key, as in Kubernetes), `key` (present), `!key` (absent).
// Spaces around the parts are ignored. Set-based forms (`in`, `notin`) are
// not supported and are refused by name.
#ifndef PLATEAU_SERVER_LABELS_H_
#define PLATEAU_SERVER_LABELS_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/map.h"

namespace plateau {

constexpr int kMaxLabels = 64;

// INVALID_ARGUMENT naming `field` (as "labels.key: ..." or "labels.value:
// of the key 'team': ..."), the label and what was expected.
absl::Status CheckLabels(const google::protobuf::Map<std::string, std::string>& labels,
                         const char* field = "labels");

struct LabelRequirement {
  enum class Op { kEquals, kNotEquals, kExists, kNotExists };
  std::string key;
  Op op = Op::kExists;
  std::string value;  // kEquals, kNotEquals
};

class LabelSelector {
 public:
  // INVALID_ARGUMENT naming `field`, the requirement and what was expected.
  static absl::StatusOr<LabelSelector> Parse(const std::string& text,
                                             const char* field = "label_selector");
  bool empty() const { return requirements_.empty(); }
  bool Matches(const google::protobuf::Map<std::string, std::string>& labels) const;
  const std::vector<LabelRequirement>& requirements() const { return requirements_; }

 private:
  std::vector<LabelRequirement> requirements_;
};

}  // namespace plateau

#endif  // PLATEAU_SERVER_LABELS_H_
