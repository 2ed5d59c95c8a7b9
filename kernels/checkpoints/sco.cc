#include "kernels/checkpoints/sco.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace plateau {

absl::StatusOr<std::unique_ptr<Sco>> Sco::Create(Backend& backend, Stream& compute, int64_t layers,
                                                 int64_t rows, int64_t hidden,
                                                 int64_t host_budget_bytes, const ElementBytes& e) {
  PLATEAU_RETURN_IF_ERROR(ValidateSco(host_budget_bytes));
  if (layers < 0 || rows < 1 || hidden < 1) {
    return absl::InvalidArgumentError(absl::StrCat("sco: expected layers >= 0, rows >= 1 and hidden >= 1, got ",
                                                   layers, ", ", rows, " and ", hidden));
  }
  std::unique_ptr<Sco> s(new Sco(backend, compute, PlanSco(layers, rows, hidden, host_budget_bytes, e), e.working));
  const ScoLayout& p = s->layout_;
  PLATEAU_ASSIGN_OR_RETURN(s->copy_, backend.CreateStream("sco-copy", StreamUse::kCopy));
  PLATEAU_ASSIGN_OR_RETURN(s->compute_done_, backend.CreateEvent());
  for (int64_t i = 0; i < p.slots(); ++i) {
    PLATEAU_ASSIGN_OR_RETURN(std::unique_ptr<Event> e, backend.CreateEvent());
    s->copied_.push_back(std::move(e));
  }
  PLATEAU_ASSIGN_OR_RETURN(s->slots_,
                           backend.device().Allocate(LiveSet::kCheckpoints, p.slots() * p.boundary_bytes));
  PLATEAU_ASSIGN_OR_RETURN(s->kept_,
                           backend.device().Allocate(LiveSet::kCheckpoints, p.kept() * p.boundary_bytes));
  PLATEAU_ASSIGN_OR_RETURN(s->pool_, backend.host().Allocate(LiveSet::kCheckpoints, p.host_bytes()));
  return s;
}

Sco::Sco(Backend& backend, Stream& compute, const ScoLayout& layout, int64_t element_bytes)
    : backend_(backend),
      compute_(compute),
      layout_(layout),
      element_bytes_(element_bytes),
      holds_(layout.slots(), -1),
      restoring_(layout.boundaries, false),
      done_(layout.boundaries, false) {}

Sco::~Sco() {
  // The buffers' release waits for every stream anyway; this makes the
  // order plain.
  if (copy_) copy_->Synchronize().IgnoreError();
}

absl::Status Sco::Check(int64_t l) const {
  if (l < 0 || l >= layout_.boundaries) {
    return absl::OutOfRangeError(
        absl::StrCat("boundary ", l, " of a ", layout_.boundaries - 1, "-layer model"));
  }
  return absl::OkStatus();
}

char* Sco::Device(int64_t l) {
  const int64_t b = layout_.boundary_bytes;
  if (InSlot(l)) return slots_.as<char>() + (l % 2) * b;
  return kept_.as<char>() + (l - layout_.host_boundaries - layout_.slots()) * b;
}

absl::StatusOr<void*> Sco::SlotData(int64_t l) {
  PLATEAU_RETURN_IF_ERROR(Check(l));
  if (l == 0) {  // a new step
    std::fill(restoring_.begin(), restoring_.end(), false);
    std::fill(done_.begin(), done_.end(), false);
  }
  if (InSlot(l)) {
    // The slot's last copy (h_{l-2} to the host, or a restore of the last
    // backward) must be done before compute overwrites it.
    const int64_t s = l % 2;
    PLATEAU_RETURN_IF_ERROR(compute_.Wait(*copied_[s]));
    holds_[s] = l;
  }
  return Device(l);
}

absl::Status Sco::Produced(int64_t l) {
  PLATEAU_RETURN_IF_ERROR(Check(l));
  if (!OnHost(l)) return absl::OkStatus();
  const int64_t s = l % 2;
  PLATEAU_RETURN_IF_ERROR(compute_.Record(*compute_done_));
  PLATEAU_RETURN_IF_ERROR(copy_->Wait(*compute_done_));
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(*copy_, Host(l), Device(l),
                                        layout_.boundary_bytes));
  return copy_->Record(*copied_[s]);
}

absl::Status Sco::Restore(int64_t l) {
  const int64_t s = l % 2;
  const int64_t holder = holds_[s];
  if (holder >= 0 && holder != l && !done_[holder]) {
    return absl::FailedPreconditionError(absl::StrCat("sco: boundary ", l, " cannot be restored while boundary ",
                                                      holder, " still uses its slot (Done(", holder,
                                                      ") comes first)"));
  }
  // After everything compute has enqueued so far: the holder's last use.
  PLATEAU_RETURN_IF_ERROR(compute_.Record(*compute_done_));
  PLATEAU_RETURN_IF_ERROR(copy_->Wait(*compute_done_));
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(*copy_, Device(l), Host(l),
                                        layout_.boundary_bytes));
  PLATEAU_RETURN_IF_ERROR(copy_->Record(*copied_[s]));
  holds_[s] = l;
  restoring_[l] = true;
  ++restores_;
  return absl::OkStatus();
}

absl::StatusOr<const void*> Sco::AcquireData(int64_t l) {
  PLATEAU_RETURN_IF_ERROR(Check(l));
  if (InSlot(l)) {
    const int64_t s = l % 2;
    if (holds_[s] != l) {
      if (!OnHost(l)) {
        return absl::FailedPreconditionError(
            absl::StrCat("sco: boundary ", l, " was overwritten before the backward acquired it"));
      }
      PLATEAU_RETURN_IF_ERROR(Restore(l));
    }
    if (restoring_[l]) PLATEAU_RETURN_IF_ERROR(compute_.Wait(*copied_[s]));
  }
  // One layer ahead: h_{l-1} comes back while layer l is recomputed, into
  // the slot h_{l+1} is done with.
  if (l >= 1 && OnHost(l - 1) && !restoring_[l - 1]) {
    const int64_t holder = holds_[(l - 1) % 2];
    if (holder < 0 || done_[holder]) PLATEAU_RETURN_IF_ERROR(Restore(l - 1));
  }
  return Device(l);
}

absl::Status Sco::Done(int64_t l) {
  PLATEAU_RETURN_IF_ERROR(Check(l));
  done_[l] = true;
  return absl::OkStatus();
}

}  // namespace plateau
