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
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace plateau {

// The boundaries are [N, H] elements of the step's working precision W
// (float in fp32, Bf16 in bf16 mixed: kernels/model/precision.h); a store
// holds bytes and is made for one element size, which Slot<W> and
// Acquire<W> check, so a bf16 step cannot read an fp32 store or the reverse.
class BoundaryStore {
 public:
  virtual ~BoundaryStore() = default;

  // Bytes of one boundary element (ElementBytes::working of the step).
  virtual int64_t element_bytes() const = 0;

  // Where forward writes boundary l ([N, H] W on the device).
  template <typename W = float>
  absl::StatusOr<W*> Slot(int64_t l) {
    PLATEAU_RETURN_IF_ERROR(CheckElement(sizeof(W)));
    PLATEAU_ASSIGN_OR_RETURN(void* p, SlotData(l));
    return static_cast<W*>(p);
  }
  // Boundary l is complete (enqueued on the compute stream so far).
  virtual absl::Status Produced(int64_t l) = 0;
  // Boundary l for the backward, ready for work enqueued after this call on
  // the compute stream.
  template <typename W = float>
  absl::StatusOr<const W*> Acquire(int64_t l) {
    PLATEAU_RETURN_IF_ERROR(CheckElement(sizeof(W)));
    PLATEAU_ASSIGN_OR_RETURN(const void* p, AcquireData(l));
    return static_cast<const W*>(p);
  }
  // The backward of layer l is done with boundary l.
  virtual absl::Status Done(int64_t l) = 0;

 protected:
  // Slot and Acquire on the store's bytes.
  virtual absl::StatusOr<void*> SlotData(int64_t l) = 0;
  virtual absl::StatusOr<const void*> AcquireData(int64_t l) = 0;

 private:
  absl::Status CheckElement(size_t bytes) const {
    if (static_cast<int64_t>(bytes) == element_bytes()) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("boundary store: holds ", element_bytes(),
                                            "-byte elements, asked for ", bytes, "-byte ones"));
  }
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_CHECKPOINTS_BOUNDARY_STORE_H_
