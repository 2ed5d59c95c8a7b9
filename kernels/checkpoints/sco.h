// SCO, selective checkpoint offload (DESIGN.md §1.3): the earliest layer
// boundaries wait for the backward in a capped host pool instead of on the
// device. Which boundaries, and where the rest live: ScoLayout in
// checkpoints_plan.h (the host pool takes h_0 … h_{j-1}; two rotating
// device slots carry h_0 … h_{j+1}; device storage keeps h_{j+2} … h_L).
//
// Everything is ordered by events on three streams, with no host
// synchronisation:
// - forward: Slot(l) of a slot boundary makes compute wait until the copy
//   of the boundary that last used the slot (h_{l-2}) has reached the host;
//   Produced(l) of a host boundary makes the copy stream wait for compute
//   and enqueues the device-to-host copy.
// - backward: Acquire(l) starts restoring h_{l-1} into the slot that
//   h_{l+1} used (done with: Done(l+1) came first), after everything
//   compute has enqueued so far, so it lands while layer l is recomputed;
//   compute waits for a restored boundary's copy before using it.
// Exact: the values are only copied, so the step's results are bitwise
// those of FullCheckpoints.
//
// Buffers, allocated once by Create (ScoLayout's bytes exactly): the slots
// and the device storage (kCheckpoints, device), the host pool
// (kCheckpoints, host; pinned on CUDA).
//
// Thread safety: one per rank (BoundaryStore); called in the step's order:
// Slot/Produced for l = 0 … L, then Acquire(l)/Done(l) for l = L … 0.
#ifndef PLATEAU_KERNELS_CHECKPOINTS_SCO_H_
#define PLATEAU_KERNELS_CHECKPOINTS_SCO_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/checkpoints/boundary_store.h"
#include "kernels/checkpoints/checkpoints_plan.h"
#include "kernels/memory.h"
#include "kernels/stream.h"

namespace plateau {

class Sco final : public BoundaryStore {
 public:
  // Allocates PlanSco(layers, rows, hidden, host_budget_bytes, e)'s bytes
  // (boundaries of e.working bytes per element) and a copy stream;
  // `compute` is the stream the step produces and consumes the boundaries
  // on. The copies move bytes, so bf16 boundaries move as they are.
  static absl::StatusOr<std::unique_ptr<Sco>> Create(Backend& backend, Stream& compute, int64_t layers,
                                                     int64_t rows, int64_t hidden,
                                                     int64_t host_budget_bytes,
                                                     const ElementBytes& e = kFp32Elements);
  ~Sco() override;

  int64_t element_bytes() const override { return element_bytes_; }
  absl::Status Produced(int64_t l) override;
  absl::Status Done(int64_t l) override;

  const ScoLayout& layout() const { return layout_; }
  // Boundaries restored from the host pool since Create (for tests).
  int64_t restores() const { return restores_; }

 private:
  Sco(Backend& backend, Stream& compute, const ScoLayout& layout, int64_t element_bytes);
  absl::StatusOr<void*> SlotData(int64_t l) override;
  absl::StatusOr<const void*> AcquireData(int64_t l) override;
  absl::Status Check(int64_t l) const;
  bool OnHost(int64_t l) const { return l < layout_.host_boundaries; }
  bool InSlot(int64_t l) const { return l < layout_.slots() + layout_.host_boundaries; }
  char* Device(int64_t l);
  char* Host(int64_t l) { return pool_.as<char>() + l * layout_.boundary_bytes; }
  // Enqueues the copy of host boundary l back into its slot.
  absl::Status Restore(int64_t l);

  Backend& backend_;
  Stream& compute_;
  const ScoLayout layout_;
  const int64_t element_bytes_;
  // Declared before the buffers, so destroyed after them: freeing a buffer
  // waits for the backend's streams (the copies still in flight included).
  std::unique_ptr<Stream> copy_;
  std::unique_ptr<Event> compute_done_;           // compute -> copy
  std::vector<std::unique_ptr<Event>> copied_;    // per slot: its last copy (copy -> compute)
  Buffer slots_;   // [2, N, H] device
  Buffer kept_;    // [kept, N, H] device
  Buffer pool_;    // [j, N, H] host
  // Per slot: the boundary whose values it holds or is being restored
  // (-1: none yet).
  std::vector<int64_t> holds_;
  // Per boundary, in the current step: restore enqueued; Done called.
  std::vector<bool> restoring_, done_;
  int64_t restores_ = 0;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_CHECKPOINTS_SCO_H_
