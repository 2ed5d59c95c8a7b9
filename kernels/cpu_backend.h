// The CPU backend: the "device" is a heap arena capped at a launch option, so
// that bounds, out-of-memory and feasibility behave as on a GPU and are
// testable without one. Streams are worker threads (kernels/cpu_stream.h);
// copies and compute enqueued on different streams overlap.
#ifndef PLATEAU_KERNELS_CPU_BACKEND_H_
#define PLATEAU_KERNELS_CPU_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cpu_pool.h"

namespace plateau {

// The backend owns a thread pool (kernels/cpu_pool.h, options.cpu_threads
// participants, one per core by default) created at launch; its elementwise,
// row-wise and optimizer kernels, and the model kernels created for it, split
// their work over the pool with a fixed split, so results do not depend on
// the pool's size. OpenBLAS (its own threads) runs the GEMMs; both are called
// from stream threads and a stream runs one task at a time (cpu_pool.h).
//
// options.device_memory_bytes must be > 0 (the arena's size).
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(
    const BackendOptions& options);

// The pool of a backend made by CreateCpuBackend; nullptr for any other.
std::shared_ptr<CpuPool> CpuBackendPool(Backend& backend);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_CPU_BACKEND_H_
