// The optimizer schedule point (DESIGN.md §1.4): where the fp32 master of
// this rank's ZeRO shard of the dense weights and the AdamW moments live,
// and how one step updates them. The baseline keeps everything on the
// device (device_adamw.h); OffloadStreamAdamW will keep master, m and v on
// the host and stream them through two device slots (issue 14). The step
// holds one, made from its options by CreateSchedules
// (kernels/step/schedules.h).
//
// The step owns the working weights (kWeights: the all-gathered dense
// weights and this rank's owned weights — its experts and, under Ring-DTP,
// its lm_head vocabulary shard; in fp32 their own master, in bf16 mixed
// the rounding of an fp32 master the optimizer keeps) and
// the gradients (kGrads); the optimizer owns its state (kOptimizer). The
// step computes the global gradient norm and the clip coefficient before
// Update, as the paper's pipeline needs it before the first bucket.
//
// Thread safety: one per rank; Load and Update are collective (they refresh
// the working weights by all-gather).
#ifndef PLATEAU_KERNELS_OPTIMIZER_OPTIMIZER_UPDATE_H_
#define PLATEAU_KERNELS_OPTIMIZER_OPTIMIZER_UPDATE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/bf16.h"
#include "kernels/phase_recorder.h"

namespace plateau {

// This rank's optimizer state on the host: the dense shard's master and
// moments [S], the owned weights' moments [X] (kernels/model/params.h).
// owned_master [X]: the owned weights' fp32 master under bf16 mixed
// precision (empty in fp32, where the owned weights are their own master).
struct OptimizerShardState {
  std::vector<float> dense_master, dense_m, dense_v;
  std::vector<float> owned_m, owned_v;
  std::vector<float> owned_master;
};

// The step's buffers the optimizer reads and writes (device), in the
// working precision W (float; Bf16 under bf16 mixed: the working copies
// rn(master) and bf16 gradients).
template <typename W>
struct OptimizerParamsT {
  W* dense_working = nullptr;           // [S * P] all-gathered from the masters
  W* owned = nullptr;                   // [X] updated in place (bf16: rn(its master))
  const W* dense_grad_shard = nullptr;  // [S]
  const W* owned_grad = nullptr;        // [X]
  int64_t shard_numel = 0;              // S
  int64_t owned_numel = 0;              // X, ParamLayout::owned_numel_per_rank()
};
using OptimizerParams = OptimizerParamsT<float>;

class OptimizerUpdate {
 public:
  virtual ~OptimizerUpdate() = default;

  // Sets the master shard and the moments (empty moments: zero) and
  // refreshes the working dense weights from the masters.
  virtual absl::Status Load(const OptimizerShardState& state) = 0;
  // This rank's state, copied to the host.
  virtual absl::StatusOr<OptimizerShardState> Save() = 0;
  // One AdamW step (torch semantics) at 1-based `step` with the gradients
  // scaled by `clip`; then the working dense weights are refreshed.
  virtual absl::Status Update(float clip, int64_t step) = 0;

  // The memory timeline's hook for the next Update, or nullptr (off; the
  // default). A schedule that works bucket by bucket ends a
  // StepPhase::kOptimizerBucket phase after issuing each bucket
  // (kernels/phase_recorder.h); the others leave it to the step.
  void set_phase_recorder(PhaseRecorder* phases) { phases_ = phases; }

 protected:
  PhaseRecorder* phases_ = nullptr;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_OPTIMIZER_OPTIMIZER_UPDATE_H_
