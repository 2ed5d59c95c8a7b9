#include "kernels/memory_timeline.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace plateau {
namespace {

// b follows a: bytes at b's end, the larger peaks.
MemoryStats Join(const MemoryStats& a, const MemoryStats& b) {
  MemoryStats s = b;
  s.KeepPeaks(a);
  return s;
}

void Absorb(TimelinePhase& into, TimelinePhase&& next) {
  into.last = std::move(next.last);
  into.merged += next.merged;
  into.device = Join(into.device, next.device);
  into.host = Join(into.host, next.host);
}

}  // namespace

std::string StepPhaseName(StepPhase kind, int64_t index) {
  switch (kind) {
    case StepPhase::kEmbedding:
      return "embedding";
    case StepPhase::kForward:
      return absl::StrCat("forward ", index);
    case StepPhase::kProjectionForward:
      return "projection forward";
    case StepPhase::kProjectionBackward:
      return "projection backward";
    case StepPhase::kRecompute:
      return absl::StrCat("recompute ", index);
    case StepPhase::kBackward:
      return absl::StrCat("backward ", index);
    case StepPhase::kGradReduce:
      return "grad reduce";
    case StepPhase::kGradNorm:
      return "grad norm";
    case StepPhase::kOptimizerBucket:
      return absl::StrCat("optimizer bucket ", index);
    case StepPhase::kOptimizer:
      return "optimizer";
  }
  return absl::StrCat("phase ", static_cast<int>(kind), " ", index);
}

std::string TimelinePhase::name() const { return first == last ? first : absl::StrCat(first, " .. ", last); }

MemoryTimelineRecorder::MemoryTimelineRecorder(MemoryTracker& device, MemoryTracker& host, size_t max_phases)
    : device_(device), host_(host), max_phases_(std::max<size_t>(2, (max_phases + 1) / 2 * 2)) {
  phases_.reserve(max_phases_);
}

void MemoryTimelineRecorder::Begin() {
  phases_.clear();
  stride_ = 1;
  seen_ = 0;
  device_.ResetPhasePeaks();
  host_.ResetPhasePeaks();
}

void MemoryTimelineRecorder::Halve() {
  size_t out = 0;
  for (size_t i = 0; i < phases_.size(); i += 2) {
    TimelinePhase p = std::move(phases_[i]);
    if (i + 1 < phases_.size()) Absorb(p, std::move(phases_[i + 1]));
    phases_[out++] = std::move(p);
  }
  phases_.resize(out);
  stride_ *= 2;
}

void MemoryTimelineRecorder::EndPhase(StepPhase kind, int64_t index) {
  ++seen_;
  TimelinePhase p;
  p.first = StepPhaseName(kind, index);
  p.last = p.first;
  p.device = device_.TakePhase();
  p.host = host_.TakePhase();
  if (!phases_.empty() && phases_.back().merged < stride_) {
    Absorb(phases_.back(), std::move(p));
    return;
  }
  if (phases_.size() == max_phases_) {
    Halve();
    if (phases_.back().merged < stride_) {
      Absorb(phases_.back(), std::move(p));
      return;
    }
  }
  phases_.push_back(std::move(p));
}

}  // namespace plateau
