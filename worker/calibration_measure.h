// Measuring a worker's calibration on its backend (worker/calibration.h
// says what and why). plateau_rank runs it (--calibrate_dir): the binary
// that trains is the one measured, and the agent links no compute.
//
// Thread safety: one measurement at a time per backend.
#ifndef PLATEAU_WORKER_CALIBRATION_MEASURE_H_
#define PLATEAU_WORKER_CALIBRATION_MEASURE_H_

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "plateau/v1/worker.pb.h"

namespace plateau {

// Gloo over TCP on loopback or a LAN: a small all-to-all's latency.
inline constexpr double kCpuCollectiveSeconds = 100e-6;
// NCCL within an NVLink node.
inline constexpr double kCudaCollectiveSeconds = 20e-6;

// Measures `backend` (allocating under 64 MiB of its device space and 16 MiB
// of its host space, tagged kWorkspace, freed before it returns). Sets every
// field but `binary`.
absl::StatusOr<v1::Calibration> MeasureCalibration(Backend& backend);

}  // namespace plateau

#endif  // PLATEAU_WORKER_CALIBRATION_MEASURE_H_
