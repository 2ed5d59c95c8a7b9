// The checkpoint schedule point (DESIGN.md §1.3): where the step keeps the
// L + 1 layer boundaries h_0 … h_L between the forward and the backward's
// recomputation. The baseline keeps them all on the device
// (full_checkpoints.h); SCO will keep them in a capped host pool and
// prefetch one layer ahead (issue 13). The step holds one, made from its
// options by CreateSchedules (kernels/step/schedules.h).
//
// The step's protocol, per step: forward writes boundary l into Slot(l) and
// calls Produced(l) once it is complete (l = 0 … L); the backward, for
// l = L-1 … 0, reads its layer input through Acquire(l) (waiting for it, by
// event, if it is on its way back) and calls Done(l) when that layer's
// backward no longer needs it. Acquire(L) gives the last boundary for the
// final norm's backward.
//
// Thread safety: one per rank, called from the step's thread; the work it
// enqueues is ordered on the streams it was given.
#ifndef PLATEAU_KERNELS_CHECKPOINTS_BOUNDARY_STORE_H_
#define PLATEAU_KERNELS_CHECKPOINTS_BOUNDARY_STORE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace plateau {

class BoundaryStore {
 public:
  virtual ~BoundaryStore() = default;

  // Where forward writes boundary l ([N, H] floats on the device).
  virtual absl::StatusOr<float*> Slot(int64_t l) = 0;
  // Boundary l is complete (enqueued on the compute stream so far).
  virtual absl::Status Produced(int64_t l) = 0;
  // Boundary l for the backward, ready for work enqueued after this call on
  // the compute stream.
  virtual absl::StatusOr<const float*> Acquire(int64_t l) = 0;
  // The backward of layer l is done with boundary l.
  virtual absl::Status Done(int64_t l) = 0;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_CHECKPOINTS_BOUNDARY_STORE_H_
