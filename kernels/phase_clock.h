// Where a step's time goes, phase by phase (kernels/phase_recorder.h), timed
// on the device without slowing it: at the start and at every phase boundary
// the clock records a timing event (Backend::CreateTimingEvent) on each of
// the step's streams, and after the step reads when each ran. A boundary is
// passed when the last of the streams reaches it, so a phase's time is from
// the previous boundary's passing to its own: the device work the host issued
// for it, and any host wait inside it (the loss's all-reduce and read-back,
// the gradient's reduce-scatter), whichever ends later. The phases' times
// sum to the span from the start to the last boundary.
//
// A stream left idle at a boundary reaches it when the host records it, so a
// phase whose work lies wholly on another stream is still timed by that
// stream. Work of a stream the clock is not given (the optimizer's copy
// streams) shows where a given stream waits for it, or where the host does.
//
// Use: Create once per step (the events are made there, and as more
// boundaries come than it was told of), Start() right before the step,
// pass the clock as the step's recorder, Read() after it. Start() begins a
// new reading.
//
// Thread safety: one clock per step, used from the step's thread.
#ifndef PLATEAU_KERNELS_PHASE_CLOCK_H_
#define PLATEAU_KERNELS_PHASE_CLOCK_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/phase_recorder.h"
#include "kernels/stream.h"

namespace plateau {

struct TimedPhase {
  StepPhase kind;
  int64_t index;   // the layer or bucket; 0 where the phase has none
  double seconds;  // from the previous boundary's passing to this one's
};

// A step's phases summed by kind, in the order a step runs them.
struct PhaseTimes {
  double embedding = 0;    // tokens in, h_0
  double forward = 0;      // the layers' forward
  double projection = 0;   // the vocabulary projection and the loss, both ways
  double recompute = 0;    // the layers recomputed from their checkpoints
  double backward = 0;     // the layers' backward
  double grad_reduce = 0;  // embedding backward and the gradients' reduce-scatter
  double grad_norm = 0;
  double optimizer = 0;  // every bucket and the weights' all-gather
  double total() const;
};
PhaseTimes SumByKind(const std::vector<TimedPhase>& phases);

// The boundaries of one Step of `layers` layers whose optimizer ends
// `buckets` bucket phases (OffloadStreamAdamW's; 0 for the others): the
// embedding, each layer's forward, the projection's two, each layer's
// recompute and backward, the gradient reduce, the norm, the buckets and
// the optimizer.
constexpr int64_t PhaseBoundaries(int64_t layers, int64_t buckets) {
  return 3 * layers + 6 + buckets;
}

class PhaseClock final : public PhaseRecorder {
 public:
  // `streams`: the step's (TrainingStep::streams()); they must outlive the
  // clock. The events of `boundaries` boundaries are made here, so that
  // making them costs the timed step nothing (PhaseBoundaries); more are
  // made as they come.
  static absl::StatusOr<std::unique_ptr<PhaseClock>> Create(Backend& backend,
                                                            std::vector<Stream*> streams,
                                                            int64_t boundaries = 0);

  // Records the start on every stream and forgets the last reading.
  absl::Status Start();
  void EndPhase(StepPhase kind, int64_t index) override;
  // Waits until every boundary has passed, then the phases in the step's
  // order. The first error of a record since Start() comes back here.
  absl::StatusOr<std::vector<TimedPhase>> Read();

 private:
  PhaseClock(Backend& backend, std::vector<Stream*> streams)
      : backend_(backend), streams_(std::move(streams)) {}
  // Makes the events of one more point, one per stream.
  absl::Status MakePoint();
  // Records points_[point][s] on every stream s (point <= points_.size()).
  absl::Status RecordPoint(size_t point);

  Backend& backend_;
  const std::vector<Stream*> streams_;
  // points_[0] the start, points_[i] boundary i; one event per stream.
  std::vector<std::vector<std::unique_ptr<Event>>> points_;
  std::vector<std::pair<StepPhase, int64_t>> boundaries_;
  bool started_ = false;
  absl::Status error_;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_PHASE_CLOCK_H_
