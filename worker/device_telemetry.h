// A step's device telemetry (issue 17): the device's own view of its
// memory and the step's TFLOP/s and MFU, set on the rank's StepTelemetry
// beside the live-set peaks (which stay the budget's accounting).
#ifndef PLATEAU_WORKER_DEVICE_TELEMETRY_H_
#define PLATEAU_WORKER_DEVICE_TELEMETRY_H_

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "plateau/v1/job.pb.h"

namespace plateau {

struct PeakOverrides {
  double fp32_flops = 0;  // the agent's --device_peak_flops; 0: the table's
  double bf16_flops = 0;  // the agent's --device_peak_bf16_flops; 0: the table's
};

// Sets device_used_bytes (total - free) and device_pool_reserved_bytes from
// `view` (left 0 when the backend has none), tflops (this rank's share,
// model_flops / ranks / seconds) and mfu against the peak of the step's
// precision (`bf16`): the override for it, else kernels/device_peaks.h's
// figure for the device, else 0 (unknown).
void SetDeviceTelemetry(const absl::StatusOr<DeviceView>& view, double model_flops, int ranks, double seconds,
                        bool bf16, const PeakOverrides& overrides, v1::StepTelemetry* t);

}  // namespace plateau

#endif  // PLATEAU_WORKER_DEVICE_TELEMETRY_H_
