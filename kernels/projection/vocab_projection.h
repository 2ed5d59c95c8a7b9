// The vocabulary-projection schedule point (DESIGN.md §1.2): logits of a
// rank's tokens against lm_head, cross-entropy, and their gradients. Two
// schedules implement it: the dense baseline (dense_projection.h: the full
// N x V logits) and Ring-DTP (ring_dtp.h: strips over vocabulary shards that
// meet every rank's batch). The step holds one, made from its options by
// CreateSchedules (kernels/step/schedules.h); a new projection schedule is
// one more implementation plus one line there, and its bound in
// projection_plan.h for the budget.
//
// Precision: each call has an fp32 form and a bf16 mixed one (bf16 x, w,
// dx and dw; the loss statistics double, the log-sum-exp fp32), which a
// schedule that computes bf16 overrides; the others answer UNIMPLEMENTED
// (the step refuses them under bf16 before it runs: schedules.cc).
//
// Thread safety: one per rank; both calls are collective over the ranks for
// schedules that communicate.
#ifndef PLATEAU_KERNELS_PROJECTION_VOCAB_PROJECTION_H_
#define PLATEAU_KERNELS_PROJECTION_VOCAB_PROJECTION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/bf16.h"

namespace plateau {

class VocabProjection {
 public:
  virtual ~VocabProjection() = default;

  // The rows of lm_head [V, H] that `w` and `dw` point at: all V for the
  // dense projection, this rank's vocabulary shard for Ring-DTP.
  virtual int64_t FirstWeightRow() const = 0;

  // x [N, H], w [rows, H], targets [N] (kIgnoreIndex: no loss): stats[0] +=
  // the sum of this rank's valid token losses, stats[1] += their count.
  virtual absl::Status Forward(const float* x, const float* w, const int32_t* targets,
                               double* stats) = 0;
  // With scale = 1 / (valid tokens of the global batch): dx = d loss / d x
  // (overwritten), dw += d loss / d w.
  virtual absl::Status Backward(const float* x, const float* w, const int32_t* targets,
                                float scale, float* dx, float* dw) = 0;

  // The same in bf16 mixed precision. Default: UNIMPLEMENTED.
  virtual absl::Status Forward(const Bf16* x, const Bf16* w, const int32_t* targets,
                               double* stats) {
    return NoBf16();
  }
  virtual absl::Status Backward(const Bf16* x, const Bf16* w, const int32_t* targets,
                                float scale, Bf16* dx, Bf16* dw) {
    return NoBf16();
  }

 private:
  static absl::Status NoBf16() {
    return absl::UnimplementedError(
        "projection: this schedule does not compute bf16 mixed precision yet (issue 17)");
  }
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_PROJECTION_VOCAB_PROJECTION_H_
