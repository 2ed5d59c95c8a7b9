#include "timeline/memory_chart.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace plateau {
namespace {

struct SetStyle {
  const char* name;
  const char* color;
  char letter;
};
// kernels/memory.h LiveSet order; colours from a palette readable by most
// colour-blind viewers (Tableau 10).
constexpr SetStyle kStyles[] = {
    {"weights", "#4e79a7", 'W'},     {"grads", "#f28e2b", 'G'},      {"optimizer", "#e15759", 'O'},
    {"checkpoints", "#76b7b2", 'C'}, {"dispatch", "#59a14f", 'D'},   {"projection", "#edc948", 'P'},
    {"activations", "#b07aa1", 'A'}, {"workspace", "#9c755f", 'S'},
};

const SetStyle* StyleOf(const std::string& name) {
  for (const SetStyle& s : kStyles) {
    if (name == s.name) return &s;
  }
  return nullptr;
}

int64_t At(const google::protobuf::RepeatedField<int64_t>& v, int i) { return i < v.size() ? v.Get(i) : 0; }

MemoryChart Build(const v1::MemoryTimeline& t, const v1::MemoryPlan& plan, bool device,
                  const std::string& job_id) {
  MemoryChart c;
  c.space = device ? "device" : "host";
  c.title = absl::StrCat(job_id, ", rank ", t.rank(), ", step ", t.step(), ": ", c.space, " memory");
  std::map<std::string, int64_t> bounds;
  for (const v1::LiveSetBytes& b : device ? plan.live_sets() : plan.host_live_sets()) bounds[b.live_set()] += b.bytes();
  c.planned_total = device ? plan.total_bytes() : plan.host_total_bytes();
  c.cap = device ? t.device_cap_bytes() : t.host_cap_bytes();
  if (c.cap == 0) c.cap = device ? plan.device_memory_bytes() : plan.host_memory_bytes();
  for (const v1::MemoryTimelinePhase& p : t.phases()) {
    c.phases.push_back(p.name());
    c.merged.push_back(p.merged());
    c.total_peak.push_back(device ? p.device_peak_total_bytes() : p.host_peak_total_bytes());
  }
  c.total.assign(c.phases.size(), 0);
  // Series in the timeline's order (LiveSet order), then any set only the plan names.
  std::vector<std::string> names(t.live_sets().begin(), t.live_sets().end());
  for (const auto& [name, bytes] : bounds) {
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  int64_t stacked = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    ChartSeries s;
    s.live_set = names[i];
    const SetStyle* style = StyleOf(s.live_set);
    s.color = style ? style->color : "#bab0ac";
    s.letter = style ? style->letter : '?';
    s.bound = bounds.count(s.live_set) ? bounds[s.live_set] : 0;
    bool seen = s.bound > 0;
    for (int k = 0; k < t.phases_size(); ++k) {
      const v1::MemoryTimelinePhase& p = t.phases(k);
      const int idx = static_cast<int>(i);
      const int64_t bytes = idx < t.live_sets_size() ? At(device ? p.device_bytes() : p.host_bytes(), idx) : 0;
      const int64_t peak =
          idx < t.live_sets_size() ? At(device ? p.device_peak_bytes() : p.host_peak_bytes(), idx) : 0;
      s.bytes.push_back(bytes);
      s.peak.push_back(std::max(peak, bytes));
      c.total[k] += bytes;
      seen = seen || bytes > 0 || peak > 0;
    }
    if (!seen) continue;  // a live set this space never holds and the plan gives nothing
    stacked += s.bound;
    s.stacked_bound = stacked;
    c.series.push_back(std::move(s));
  }
  for (size_t k = 0; k < c.total_peak.size(); ++k) c.total_peak[k] = std::max(c.total_peak[k], c.total[k]);
  return c;
}

bool HasHost(const v1::MemoryTimeline& t, const v1::MemoryPlan& plan) {
  if (plan.host_total_bytes() > 0) return true;
  for (const v1::MemoryTimelinePhase& p : t.phases()) {
    if (p.host_peak_total_bytes() > 0) return true;
  }
  return false;
}

}  // namespace

int64_t MemoryChart::data_max() const {
  int64_t m = planned_total;
  for (int64_t v : total_peak) m = std::max(m, v);
  for (const ChartSeries& s : series) m = std::max(m, s.stacked_bound);
  return m;
}

bool MemoryChart::cap_on_scale() const {
  return cap > 0 && static_cast<double>(cap) <= 1.5 * static_cast<double>(std::max<int64_t>(1, data_max()));
}

double MemoryChart::scale_max() const {
  return cap_on_scale() ? 1.04 * static_cast<double>(cap)
                        : 1.08 * static_cast<double>(std::max<int64_t>(1, data_max()));
}

double ChartTickStep(double max) {
  double unit = 1;
  for (double u : {1024.0, 1048576.0, 1073741824.0}) {
    if (max >= u) unit = u;
  }
  const double raw = max / unit / 5;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * p >= raw) return m * p * unit;
  }
  return 10 * p * unit;
}

absl::StatusOr<std::vector<MemoryChart>> MemoryCharts(const v1::GetMemoryTimelineResponse& response, int rank) {
  std::vector<std::string> have;
  for (const v1::MemoryTimeline& t : response.ranks()) {
    if (t.rank() != rank) {
      have.push_back(absl::StrCat(t.rank()));
      continue;
    }
    std::vector<MemoryChart> out;
    out.push_back(Build(t, response.plan(), true, response.job_id()));
    if (HasHost(t, response.plan())) out.push_back(Build(t, response.plan(), false, response.job_id()));
    return out;
  }
  return absl::NotFoundError(absl::StrCat("rank: ", response.job_id(), " has no memory timeline of rank ", rank,
                                          have.empty() ? std::string(" (none of any rank)")
                                                       : absl::StrCat(" (ranks with one: ", absl::StrJoin(have, ", "), ")")));
}

std::string FormatBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes < 0) return absl::StrCat("-", FormatBytes(-bytes));
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  if (bytes < (int64_t{1} << 20)) return absl::StrFormat("%.2f KiB", b / 1024);
  if (bytes < (int64_t{1} << 30)) return absl::StrFormat("%.2f MiB", b / (1 << 20));
  return absl::StrFormat("%.2f GiB", b / (1 << 30));
}

}  // namespace plateau
