// The hook a training step calls at each phase boundary, so that something
// outside the step (the memory timeline, kernels/memory_timeline.h) can see
// what every live set holds there. The step and the schedules know nothing
// of what is recorded; a null recorder (the default) costs one pointer test
// per boundary, about 3L + 8 per step.
//
// Phases, in the order a step ends them (docs/RUNTIME.md "Memory timeline"):
//   embedding            tokens in, gradients zeroed, h_0
//   forward l            layer l forward (l = 0 .. L-1), h_{l+1} kept
//   projection forward   final norm, the vocabulary projection, the loss
//   projection backward  its backward and the final norm's
//   recompute l          layer l recomputed from its checkpoint (l = L-1 .. 0)
//   backward l           layer l backward
//   grad reduce          embedding backward, the gradients' reduce-scatter
//   grad norm            the global gradient norm (Step only)
//   optimizer bucket b   one bucket of a bucketed optimizer (OffloadStreamAdamW)
//   optimizer            the rest of the update and the weights' all-gather
//
// A boundary is where the step's host thread has issued the phase's work:
// the bytes are the allocator's, as every live set's accounting is
// (kernels/memory.h), not a device-side clock.
//
// Thread safety: called from the step's thread only.
#ifndef PLATEAU_KERNELS_PHASE_RECORDER_H_
#define PLATEAU_KERNELS_PHASE_RECORDER_H_

#include <cstdint>

namespace plateau {

enum class StepPhase : int {
  kEmbedding = 0,
  kForward,
  kProjectionForward,
  kProjectionBackward,
  kRecompute,
  kBackward,
  kGradReduce,
  kGradNorm,
  kOptimizerBucket,
  kOptimizer,
};

class PhaseRecorder {
 public:
  virtual ~PhaseRecorder() = default;
  // The phase `kind` (of layer or bucket `index`; 0 where it has none) has
  // ended: what is allocated now is what the next phase starts from.
  virtual void EndPhase(StepPhase kind, int64_t index) = 0;
};

// Ends a phase when recording is on.
inline void EndPhase(PhaseRecorder* recorder, StepPhase kind, int64_t index = 0) {
  if (recorder != nullptr) recorder->EndPhase(kind, index);
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_PHASE_RECORDER_H_
