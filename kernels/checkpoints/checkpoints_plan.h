// The checkpoint schedules' bounds, callable without a backend (the
// budget's part). The schedules allocate exactly these bytes.
#ifndef PLATEAU_KERNELS_CHECKPOINTS_CHECKPOINTS_PLAN_H_
#define PLATEAU_KERNELS_CHECKPOINTS_CHECKPOINTS_PLAN_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/model/precision.h"

namespace plateau {

// Device bytes of the baseline: the L + 1 boundaries [N, H] in the working
// precision (e.working bytes each: 4 in fp32, 2 in bf16 mixed). The
// schedules allocate with the step's element sizes, as the budget plans
// them.
int64_t FullCheckpointsBytes(int64_t layers, int64_t rows, int64_t hidden,
                             const ElementBytes& e = kFp32Elements);

// Where SCO keeps the L + 1 boundaries h_0 … h_L for a host budget beta.
//
// Selection policy: the host pool takes the earliest boundaries,
// h_0 … h_{j-1}, as many whole ones as beta holds, at most L - 1:
//   j = min(floor(beta / (N H b)), max(0, L - 1)), b = e.working.
// The earliest are produced first and needed last (the backward runs from
// h_L down), so both their offload and their restore have the most compute
// to hide behind. The device holds the rest, L + 1 - j boundaries, as:
// - two rotating slots: in forward, h_0 … h_{j+1} are written into slot
//   l % 2 (h_l's slot is reused for h_{l+2} once h_l's copy to the host has
//   completed); h_j and h_{j+1} are never offloaded — they are still in the
//   slots when the backward reaches them. In backward, h_{l-1} is restored
//   into the slot h_{l+1} used, while layer l is recomputed (one layer
//   ahead): at most two restored boundaries on the device at once;
// - device storage for h_{j+2} … h_L.
// So every boundary in the host pool is one fewer on the device, and the
// device bytes fall by N H b per boundary until j = L - 1 (a 1-layer model
// has no boundary to offload).
struct ScoLayout {
  int64_t boundaries = 0;       // L + 1
  int64_t host_boundaries = 0;  // j
  int64_t boundary_bytes = 0;   // N H b
  int64_t slots() const { return boundaries < 2 ? boundaries : 2; }
  int64_t kept() const { return boundaries - host_boundaries - slots(); }  // h_{j+2} … h_L
  int64_t device_bytes() const { return (boundaries - host_boundaries) * boundary_bytes; }
  int64_t host_bytes() const { return host_boundaries * boundary_bytes; }
};
ScoLayout PlanSco(int64_t layers, int64_t rows, int64_t hidden, int64_t host_budget_bytes,
                  const ElementBytes& e = kFp32Elements);

// The checkpoints' two pools when the step also keeps each layer's
// attention record for the backward (CheckpointOptions::keep_attention):
// L records [rows, record_width] fp32, record l holding layer l's attention
// output and log-sum-exp. The records go through a store of their own with
// SCO's protocol (record l written in layer l's forward, read in its
// backward: PlanSco over L - 1 "layers", so at most L - 2 on the host, the
// last two never leaving the slots). One host budget beta serves both: the
// boundaries take it first (PlanSco), the records whole ones of what is
// left, the earliest first. beta = 0 is full checkpointing: everything on
// the device. record_width 0: no records (an empty layout).
struct ScoPools {
  ScoLayout boundaries, records;
  int64_t device_bytes() const { return boundaries.device_bytes() + records.device_bytes(); }
  int64_t host_bytes() const { return boundaries.host_bytes() + records.host_bytes(); }
};
ScoPools PlanScoPools(int64_t layers, int64_t rows, int64_t hidden, int64_t record_width, int64_t host_budget_bytes,
                      const ElementBytes& e = kFp32Elements);

// INVALID_ARGUMENT naming schedule.sco.host_budget_bytes unless >= 0.
absl::Status ValidateSco(int64_t host_budget_bytes);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_CHECKPOINTS_CHECKPOINTS_PLAN_H_
