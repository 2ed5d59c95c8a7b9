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
// the pool's size. GEMMs run on the pool too, rows of C split by their size
// into single-threaded OpenBLAS calls (the backend sets OpenBLAS to one
// thread, process-wide), so no OpenBLAS worker idles against the pool.
//
// options.device_memory_bytes must be > 0 (the arena's size).
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(
    const BackendOptions& options);

// The pool of a backend made by CreateCpuBackend; nullptr for any other.
std::shared_ptr<CpuPool> CpuBackendPool(Backend& backend);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_CPU_BACKEND_H_
