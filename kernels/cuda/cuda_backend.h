// The CUDA backend: cuBLAS for GEMM (cublasGemmGroupedBatchedEx for
// GroupedGemm), our kernels (cuda_ops.h) for the other
// primitives, device memory from a stream-ordered pool and cudaHostAlloc'd
// pinned host memory, non-blocking CUDA streams and timing-free events.
// Built only with --config=cuda; Backend::Create(kind = kCuda) reaches it.
//
// Releases never synchronise: device memory goes back with cudaFreeAsync on
// a release stream that first waits (on the GPU) for the work enqueued so
// far on every stream of the backend, and stays in the pool for the next
// allocation; pinned host blocks wait in a cache until that work has run
// and are reused, cudaFreeHost running only outside the space's lock. A new
// allocation makes every stream wait for the release stream, so memory is
// never written by its next user before its last user has finished. The
// live-set accounting (memory.h) is the CPU's: live bytes as requested.
//
// Errors are sticky per stream (stream.h): the first failure is kept,
// later work on that stream is skipped, Synchronize returns it. Synchronize
// polls, so a collective that the NCCL watchdog gives up on ends it with the
// communicator's status instead of a hang. A device fault (illegal address,
// failed launch, kernel assert, uncorrectable ECC error) poisons the whole
// CUDA context: its status says so, and only a new process recovers.
//
// Memory: every buffer of the step goes through the device MemorySpace and
// is tracked by live set, against the cap the budget plans. Each stream's
// workspace (cuBLAS's workspace and the reductions' scratch: 32 MiB per
// stream on Hopper and later, 4 MiB before, as cuBLAS recommends; then 24
// KiB of device pointer arrays for GroupedGemm's cuBLAS calls) comes from
// the same pool but outside the cap and the live sets, with the CUDA
// context, NCCL's buffers and the libraries' code: the headroom between the
// plan and the card (docs/FRONTIER.md; about 160 MiB for the composed
// step's five streams). Counted against a cap sized to the plan, it made
// the step at N_max fail by its bytes.
//
// Determinism: each stream has its own cuBLAS handle and workspace (cuBLAS
// promises the same bits run to run only then), cuBLAS runs plain FP32 math
// (no TF32, no emulation), and our reductions use fixed grids and no atomics.
//
// Thread safety: as Backend. Launches onto one stream are serialised, so an
// operation's kernels, which share that stream's workspace, are never
// interleaved with another thread's. Streams and events must be destroyed
// before the backend that created them.
#ifndef PLATEAU_KERNELS_CUDA_CUDA_BACKEND_H_
#define PLATEAU_KERNELS_CUDA_CUDA_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace plateau {

// FAILED_PRECONDITION when no GPU is visible (no driver, no device) or the
// device can run none of this build's kernels (sm_80 and sm_90 machine
// code, compute_90 PTX that newer GPUs compile at load);
// INVALID_ARGUMENT when options.device_index names no visible GPU.
// options.device_memory_bytes caps the device space (0: what the GPU has);
// options.host_memory_bytes caps the pinned host space (0: uncapped).
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(
    const BackendOptions& options);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_CUDA_CUDA_BACKEND_H_
