// The memory timeline of one training step: for each phase of the step
// (kernels/phase_recorder.h), the bytes every live set holds when the phase
// ends and the most it held during the phase, on the device and on the
// host. A transient inside a phase (a dispatch buffer allocated and freed
// within one layer) shows in the phase's peak although it is gone at both
// boundaries.
//
// Bounded: at most max_phases entries, whatever the depth or the bucket
// count. When a step has more phases, neighbouring phases are merged in
// pairs (bytes at the later one's end, peaks the larger of the two) and
// every later entry stands for as many phases, so the whole step stays
// covered at a coarser grain and the size of a report is fixed.
//
// Cheap when off: the step holds no recorder. When on, each boundary costs
// two tracker snapshots (kernels/memory.h MemoryTracker::TakePhase).
//
// Thread safety: one recorder per step, used from the step's thread.
#ifndef PLATEAU_KERNELS_MEMORY_TIMELINE_H_
#define PLATEAU_KERNELS_MEMORY_TIMELINE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/memory.h"
#include "kernels/phase_recorder.h"

namespace plateau {

// "embedding", "forward 3", "optimizer bucket 2", ...
std::string StepPhaseName(StepPhase kind, int64_t index);

struct TimelinePhase {
  std::string first, last;  // the phases this entry covers (equal: one)
  int64_t merged = 1;       // how many phases it covers
  // current: at the end of the (last) phase; peak: the most during it.
  MemoryStats device, host;

  // "forward 3", or "forward 3 .. backward 1" for a merged entry.
  std::string name() const;
};

class MemoryTimelineRecorder final : public PhaseRecorder {
 public:
  // Large enough for 3L + 8 phases of an 80-layer model unmerged; small
  // enough that one report stays far below a telemetry line's limit.
  static constexpr size_t kDefaultMaxPhases = 256;

  // `max_phases` is rounded up to an even number, at least 2.
  MemoryTimelineRecorder(MemoryTracker& device, MemoryTracker& host, size_t max_phases = kDefaultMaxPhases);

  // Starts a step: forgets the last one and starts the first phase at the
  // bytes allocated now.
  void Begin();
  void EndPhase(StepPhase kind, int64_t index) override;

  const std::vector<TimelinePhase>& phases() const { return phases_; }
  // Phases ended since Begin (>= phases().size() once merging started).
  int64_t phases_seen() const { return seen_; }
  size_t max_phases() const { return max_phases_; }

 private:
  void Halve();

  MemoryTracker& device_;
  MemoryTracker& host_;
  const size_t max_phases_;
  int64_t stride_ = 1;  // phases per entry from now on
  int64_t seen_ = 0;
  std::vector<TimelinePhase> phases_;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MEMORY_TIMELINE_H_
