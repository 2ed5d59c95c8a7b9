// A world of P ranks on threads of one process, for tests and benchmarks:
// each rank gets its own backend (CPU: a capped device arena) and the
// backend's communicator (Gloo over loopback; NCCL on CUDA), rendezvousing
// through a fresh file store. On CUDA rank r runs on GPU
// backend_options.device_index + r: NCCL refuses two ranks of one
// communicator on one device, so P CUDA ranks need P GPUs.
#ifndef PLATEAU_KERNELS_TESTING_LOCAL_WORLD_H_
#define PLATEAU_KERNELS_TESTING_LOCAL_WORLD_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"

namespace plateau {

// Runs fn(rank, backend, world) on `ranks` threads and joins them. `dir` is
// the rendezvous directory (must not be reused). Returns the first rank's
// error in rank order, or OK.
absl::Status RunLocalWorld(
    int ranks, int64_t device_bytes, const std::string& dir,
    const std::function<absl::Status(int, Backend&, Communicator&)>& fn);

// The same with each rank's backend made from `backend_options` (a host
// cap, a copy delay for ordering tests).
absl::Status RunLocalWorld(
    int ranks, const BackendOptions& backend_options, const std::string& dir,
    const std::function<absl::Status(int, Backend&, Communicator&)>& fn);

// The options of RunLocalWorld's backends on `kind` with a device cap of
// `device_bytes` (CPU: the arena; CUDA: a cap below the card, 0: all of it).
BackendOptions LocalWorldBackend(BackendKind kind, int64_t device_bytes);

// A fresh directory name under $TEST_TMPDIR (or /tmp) for RunLocalWorld.
std::string FreshStoreDir(const std::string& tag);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_TESTING_LOCAL_WORLD_H_
