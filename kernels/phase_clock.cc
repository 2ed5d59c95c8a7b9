#include "kernels/phase_clock.h"

#include <algorithm>
#include <utility>

#include "kernels/status_macros.h"

namespace plateau {

double PhaseTimes::total() const {
  return embedding + forward + projection + recompute + backward + grad_reduce + grad_norm +
         optimizer;
}

PhaseTimes SumByKind(const std::vector<TimedPhase>& phases) {
  PhaseTimes t;
  for (const TimedPhase& p : phases) {
    switch (p.kind) {
      case StepPhase::kEmbedding:
        t.embedding += p.seconds;
        break;
      case StepPhase::kForward:
        t.forward += p.seconds;
        break;
      case StepPhase::kProjectionForward:
      case StepPhase::kProjectionBackward:
        t.projection += p.seconds;
        break;
      case StepPhase::kRecompute:
        t.recompute += p.seconds;
        break;
      case StepPhase::kBackward:
        t.backward += p.seconds;
        break;
      case StepPhase::kGradReduce:
        t.grad_reduce += p.seconds;
        break;
      case StepPhase::kGradNorm:
        t.grad_norm += p.seconds;
        break;
      case StepPhase::kOptimizerBucket:
      case StepPhase::kOptimizer:
        t.optimizer += p.seconds;
        break;
    }
  }
  return t;
}

absl::StatusOr<std::unique_ptr<PhaseClock>> PhaseClock::Create(Backend& backend,
                                                               std::vector<Stream*> streams,
                                                               int64_t boundaries) {
  if (streams.empty() || std::count(streams.begin(), streams.end(), nullptr) > 0) {
    return absl::InvalidArgumentError("phase clock: needs the step's streams");
  }
  if (boundaries < 0 || boundaries > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError("phase clock: boundaries: expected 0 to 2^20");
  }
  std::unique_ptr<PhaseClock> clock(new PhaseClock(backend, std::move(streams)));
  // The start's events and the boundaries' now: a backend without timing
  // events says so here.
  for (int64_t point = 0; point <= boundaries; ++point) {
    PLATEAU_RETURN_IF_ERROR(clock->MakePoint());
  }
  return clock;
}

absl::Status PhaseClock::MakePoint() {
  std::vector<std::unique_ptr<Event>> events;
  for (size_t s = 0; s < streams_.size(); ++s) {
    PLATEAU_ASSIGN_OR_RETURN(std::unique_ptr<Event> e, backend_.CreateTimingEvent());
    events.push_back(std::move(e));
  }
  points_.push_back(std::move(events));
  return absl::OkStatus();
}

absl::Status PhaseClock::RecordPoint(size_t point) {
  if (point == points_.size()) PLATEAU_RETURN_IF_ERROR(MakePoint());
  for (size_t s = 0; s < streams_.size(); ++s) {
    PLATEAU_RETURN_IF_ERROR(streams_[s]->Record(*points_[point][s]));
  }
  return absl::OkStatus();
}

absl::Status PhaseClock::Start() {
  boundaries_.clear();
  error_ = absl::OkStatus();
  started_ = true;
  return RecordPoint(0);
}

void PhaseClock::EndPhase(StepPhase kind, int64_t index) {
  if (!started_) {
    if (error_.ok())
      error_ = absl::FailedPreconditionError("phase clock: a boundary before Start()");
    return;
  }
  boundaries_.emplace_back(kind, index);
  absl::Status s = RecordPoint(boundaries_.size());
  if (!s.ok() && error_.ok()) error_ = s;
}

absl::StatusOr<std::vector<TimedPhase>> PhaseClock::Read() {
  if (!started_) return absl::FailedPreconditionError("phase clock: Read() before Start()");
  PLATEAU_RETURN_IF_ERROR(error_);
  // Every point's time from the start on the first stream (events of one
  // backend share its clock, whichever stream ran them); a point has passed
  // when the last stream has run it.
  Event& origin = *points_[0][0];
  auto passed_at = [&](size_t point) -> absl::StatusOr<double> {
    double passed = 0;
    for (const std::unique_ptr<Event>& e : points_[point]) {
      PLATEAU_RETURN_IF_ERROR(e->Synchronize());
      PLATEAU_ASSIGN_OR_RETURN(double t, e->SecondsSince(origin));
      passed = std::max(passed, t);
    }
    return passed;
  };
  PLATEAU_ASSIGN_OR_RETURN(double previous, passed_at(0));
  std::vector<TimedPhase> phases;
  for (size_t b = 0; b < boundaries_.size(); ++b) {
    PLATEAU_ASSIGN_OR_RETURN(double passed, passed_at(b + 1));
    passed = std::max(passed, previous);  // the streams' clocks never run a boundary backwards
    phases.push_back({boundaries_[b].first, boundaries_[b].second, passed - previous});
    previous = passed;
  }
  return phases;
}

}  // namespace plateau
