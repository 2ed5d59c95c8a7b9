// The CPU backend: the "device" is a heap arena capped at a launch option, so
// that bounds, out-of-memory and feasibility behave as on a GPU and are
// testable without one. Streams are worker threads (kernels/cpu_stream.h);
// copies and compute enqueued on different streams overlap.
#ifndef PLATEAU_KERNELS_CPU_BACKEND_H_
#define PLATEAU_KERNELS_CPU_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace plateau {

// options.device_memory_bytes must be > 0 (the arena's size).
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(
    const BackendOptions& options);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_CPU_BACKEND_H_
