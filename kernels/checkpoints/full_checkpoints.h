// The checkpoint baseline: every layer boundary h_0 … h_L stays on the
// device from the forward to the backward, (L + 1) x N x H floats in the
// kCheckpoints live set, allocated at launch. That grows with L and N: the
// peak SCO bounds. Produced and Done have nothing to do.
//
// Thread safety: one per rank (BoundaryStore).
#ifndef PLATEAU_KERNELS_CHECKPOINTS_FULL_CHECKPOINTS_H_
#define PLATEAU_KERNELS_CHECKPOINTS_FULL_CHECKPOINTS_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/checkpoints/boundary_store.h"
#include "kernels/checkpoints/checkpoints_plan.h"
#include "kernels/memory.h"

namespace plateau {

class FullCheckpoints final : public BoundaryStore {
 public:
  // Allocates FullCheckpointsBytes(layers, rows, hidden, e) on `device`:
  // boundaries of e.working bytes per element.
  static absl::StatusOr<std::unique_ptr<FullCheckpoints>> Create(MemorySpace& device, int64_t layers,
                                                                 int64_t rows, int64_t hidden,
                                                                 const ElementBytes& e = kFp32Elements);

  int64_t element_bytes() const override { return element_bytes_; }
  absl::Status Produced(int64_t l) override;
  absl::Status Done(int64_t l) override;

 protected:
  absl::StatusOr<void*> SlotData(int64_t l) override;
  absl::StatusOr<const void*> AcquireData(int64_t l) override;

 private:
  FullCheckpoints(Buffer boundaries, int64_t layers, int64_t rows, int64_t hidden, int64_t element_bytes)
      : boundaries_(std::move(boundaries)), layers_(layers), rows_(rows), hidden_(hidden),
        element_bytes_(element_bytes) {}
  absl::Status Check(int64_t l) const;

  Buffer boundaries_;  // [L + 1, N, H]
  const int64_t layers_, rows_, hidden_, element_bytes_;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_CHECKPOINTS_FULL_CHECKPOINTS_H_
