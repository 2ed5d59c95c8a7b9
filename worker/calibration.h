// A worker's calibration: the curves the time model of the spec's `auto`
// settings reads (kernels/budget/auto_settings.h), measured on the worker's
// own backend in well under a second when the agent starts, cached in its
// work dir per backend and binary, and sent to the coordinator with the
// worker's registration (WorkerCapabilities.calibration).
//
// What is measured (worker/calibration_measure.h, run by plateau_rank
// --calibrate_dir, so that the agent links no compute): GEMM [rows x 256] x [256 x 256]
// for rows 1, 4, ..., 4096 (the rate against the narrow dimension), one
// tiny operation enqueue-to-done (the launch), 16 MiB copies host to device
// and back, a 1M-parameter device AdamW update; each the fastest of a few
// runs, so that a busy machine disturbs it less. A collective's latency
// cannot be measured by one worker alone: it is the backend's estimate
// (kCpuCollectiveSeconds, kCudaCollectiveSeconds).
//
// The cache (LoadOrMeasureCalibration): <work_dir>/calibration-<backend>.txtpb,
// text format. It is used while the backend describes itself the same way
// (device, thread count, library) and the binaries' fingerprint is the same;
// otherwise measured again and rewritten.
//
// Thread safety: free functions; the cache file is the caller's (one agent
// per work dir).
#ifndef PLATEAU_WORKER_CALIBRATION_H_
#define PLATEAU_WORKER_CALIBRATION_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"  // BackendKind
#include "kernels/budget/auto_settings.h"
#include "plateau/v1/worker.pb.h"

namespace plateau {

// The model's view of a calibration; INVALID_ARGUMENT naming the field when
// it cannot be modelled (ValidateCalibration).
absl::StatusOr<Calibration> CalibrationFromProto(const v1::Calibration& c);
v1::Calibration CalibrationToProto(const Calibration& c);

// "<size>:<mtime ns>" of each file, joined by "+": changes when any of them
// is rebuilt or replaced. A file that cannot be read gives "<path>:missing".
std::string BinaryFingerprint(const std::vector<std::string>& paths);

// The shared libraries this process has mapped that do its arithmetic or
// talk to the device (BLAS, cuBLAS/cuBLASLt, NCCL, the CUDA runtime and
// driver, Gloo), from /proc/self/maps, sorted: a calibration measured
// before one of them was upgraded (a new driver, another OpenBLAS) is then
// measured again, as when the rank binary changes.
std::vector<std::string> LoadedComputeLibraries();

// The cache file's path for a backend kind ("cpu", "cuda").
std::string CalibrationCachePath(const std::string& work_dir, BackendKind kind);

// The cached calibration when it is for this backend (`describe`:
// Backend::Describe()) and `binary` (BinaryFingerprint) and can be modelled;
// otherwise `measure()`'s, stamped with `binary` and written to the cache
// (*measured says which). An unwritable cache is an error naming the file.
absl::StatusOr<v1::Calibration> LoadOrMeasureCalibration(
    const std::string& work_dir, BackendKind kind, const std::string& describe, const std::string& binary,
    const std::function<absl::StatusOr<v1::Calibration>()>& measure, bool* measured);

}  // namespace plateau

#endif  // PLATEAU_WORKER_CALIBRATION_H_
