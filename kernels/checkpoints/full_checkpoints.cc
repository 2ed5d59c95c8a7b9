#include "kernels/checkpoints/full_checkpoints.h"

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace plateau {

absl::StatusOr<std::unique_ptr<FullCheckpoints>> FullCheckpoints::Create(MemorySpace& device,
                                                                         int64_t layers, int64_t rows,
                                                                         int64_t hidden, const ElementBytes& e) {
  PLATEAU_ASSIGN_OR_RETURN(Buffer b, device.Allocate(LiveSet::kCheckpoints,
                                                     FullCheckpointsBytes(layers, rows, hidden, e)));
  return std::unique_ptr<FullCheckpoints>(new FullCheckpoints(std::move(b), layers, rows, hidden, e.working));
}

absl::Status FullCheckpoints::Check(int64_t l) const {
  if (l < 0 || l > layers_) {
    return absl::OutOfRangeError(absl::StrCat("boundary ", l, " of a ", layers_, "-layer model"));
  }
  return absl::OkStatus();
}

absl::StatusOr<void*> FullCheckpoints::SlotData(int64_t l) {
  PLATEAU_RETURN_IF_ERROR(Check(l));
  return boundaries_.as<char>() + l * rows_ * hidden_ * element_bytes_;
}

absl::Status FullCheckpoints::Produced(int64_t l) { return Check(l); }

absl::StatusOr<const void*> FullCheckpoints::AcquireData(int64_t l) {
  PLATEAU_ASSIGN_OR_RETURN(void* p, SlotData(l));
  return p;
}

absl::Status FullCheckpoints::Done(int64_t l) { return Check(l); }

}  // namespace plateau
