// The CUDA Communicator: NCCL on the cudaStream_t of Stream::native_handle().
//
// Rank 0 of a group creates the NCCL unique id and publishes it in the
// KeyValueStore ("<prefix>/world/nccl_unique_id"; groups under
// "<parent key prefix>/<name>[<world ranks>]#<n>"); the others read it
// with the communicator's timeout. Communicators are non-blocking
// (ncclConfig_t.blocking = 0) so that initialisation and every call are
// bounded by the timeout and end in ncclCommAbort instead of a hang.
// All-to-all-v and SendRecv are grouped ncclSend/ncclRecv (a rank's block to
// itself is a device copy); Barrier is a one-element all-reduce. Groups get
// a new unique id (only members call Group, which rules out ncclCommSplit:
// it needs every rank of the parent).
//
// Bounded: rendezvous, initialisation and the enqueue of each call (by
// options.timeout), and the collective itself: a watchdog thread per
// communicator brackets every collective with events on its stream, polls
// ncclCommGetAsyncError while it runs, and when NCCL reports an error or
// the collective has not finished options.timeout after it started, aborts
// the communicator (ncclCommAbort), marks it broken (later calls fail fast
// with FAILED_PRECONDITION quoting the first error) and fails every stream
// with a collective in flight (kernels/cuda/stream_errors.h), whose
// Synchronize then returns DEADLINE_EXCEEDED or the NCCL error instead of
// hanging.
//
// The communicator's device becomes current on the calling thread while it
// is created and during each call; the previous device is restored.
//
// Compiled only under --config=cuda.
#ifndef PLATEAU_KERNELS_NCCL_NCCL_COMMUNICATOR_H_
#define PLATEAU_KERNELS_NCCL_NCCL_COMMUNICATOR_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/communicator.h"

namespace plateau {

// The world communicator over NCCL on options.device_index. `options` must be
// valid (ValidateCommunicatorOptions) with backend kCuda.
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    const CommunicatorOptions& options);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_NCCL_NCCL_COMMUNICATOR_H_
