#include "client/plan_table.h"

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_format.h"

namespace plateau {
namespace {

// What ended one axis' search, in a word: the cap ("device", "host"), the
// validation limit ("limit"), or a refused shape ("refused").
std::string Limit(const v1::NMaxAxis& a) {
  if (a.limit() == "device_memory_bytes") return "device";
  if (a.limit() == "host_memory_bytes") return "host";
  if (a.limit() == "layout.batch" || a.limit() == "model.seq_len") return "limit";
  return a.limit();
}

std::string Row(const std::string& name, const v1::NMax& n) {
  return absl::StrFormat("  %-22s %9d %11d %-7s %11d %11d %-7s\n", name, n.batch().batch(),
                         n.batch().tokens_per_rank(), Limit(n.batch()), n.context().seq_len(),
                         n.context().tokens_per_rank(), Limit(n.context()));
}

}  // namespace

std::string FormatWhatIf(const v1::MemoryPlan& p) {
  if (!p.has_n_max()) return "";
  std::string out = absl::StrFormat(
      "N_max per rank (the largest batch at seq_len %d, the longest seq_len at batch %d) under a %.2f MiB "
      "device%s:\n",
      p.n_max().batch().seq_len(), p.n_max().context().batch(), p.device_memory_bytes() / 1048576.0,
      p.host_memory_bytes() > 0 ? absl::StrFormat(" and a %.2f MiB host cap", p.host_memory_bytes() / 1048576.0)
                                : " (host uncapped)");
  absl::StrAppendFormat(&out, "  %-22s %9s %11s %-7s %11s %11s %-7s\n", "schedules", "batch", "N", "limit",
                        "seq_len", "N", "limit");
  absl::StrAppend(&out, Row("as specified", p.n_max()));
  for (const v1::WhatIfRow& r : p.what_if()) absl::StrAppend(&out, Row(r.schedules(), r.n_max()));
  // Each setting once: "all on" repeats the single rows'.
  std::set<std::string> seen;
  for (const v1::WhatIfRow& r : p.what_if()) {
    for (const std::string& s : r.settings()) {
      if (seen.insert(s).second) absl::StrAppend(&out, "  with ", s, "\n");
    }
  }
  // The `auto` settings as chosen again at each answer (N_max re-chooses
  // them at every N it plans).
  for (const auto& [name, axis] : {std::pair<const char*, const v1::NMaxAxis*>{"batch", &p.n_max().batch()},
                                   {"context", &p.n_max().context()}}) {
    if (axis->auto_settings_size() == 0) continue;
    std::vector<std::string> values;
    for (const v1::AutoSetting& a : axis->auto_settings()) values.push_back(absl::StrCat(a.field(), "=", a.value()));
    absl::StrAppend(&out, "  as specified, `auto` at N_max: ", name, ": ", absl::StrJoin(values, ", "), "\n");
  }
  absl::StrAppend(&out, "  as specified, one step more: batch: ", p.n_max().batch().detail(), "\n");
  absl::StrAppend(&out, "  as specified, one step more: context: ", p.n_max().context().detail(), "\n");
  return out;
}

std::string FormatAutoSettings(const v1::MemoryPlan& plan) {
  if (plan.auto_settings_size() == 0) return "";
  std::string out = absl::StrCat("auto settings (the least modelled time among the values whose plan fits; curves ",
                                 plan.calibration(), "):\n");
  for (const v1::AutoSetting& a : plan.auto_settings()) {
    absl::StrAppend(&out, absl::StrFormat("  %-44s = %-12d %s\n", a.field(), a.value(), a.why()));
  }
  return out;
}

}  // namespace plateau
