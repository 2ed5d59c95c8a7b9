// The sticky error of each CUDA stream (kernels/stream.h: once a stream's
// work fails, later work is skipped and Synchronize() returns the first
// error), keyed by its cudaStream_t so that code which only holds the native
// handle can fail a stream too: the NCCL communicator's watchdog
// (kernels/nccl) marks every stream with a collective that timed out or lost
// a peer, and the CUDA stream's polling Synchronize() returns that error
// instead of waiting forever for a kernel that will never finish.
//
// Plain C++ (no CUDA headers): a handle is only a key here.
//
// Thread safety: every function may be called from any thread. Cheap when no
// stream has failed (one relaxed atomic load).
#ifndef PLATEAU_KERNELS_CUDA_STREAM_ERRORS_H_
#define PLATEAU_KERNELS_CUDA_STREAM_ERRORS_H_

#include "absl/status/status.h"

namespace plateau {

// Keeps `error` (not OK) as the first error of `stream` unless the stream
// already has one; returns the error the stream holds afterwards.
absl::Status FailCudaStream(const void* stream, const absl::Status& error);

// OK, or the first error recorded for `stream`.
absl::Status CudaStreamError(const void* stream);

// Drops what is kept for `stream`: called when the stream is destroyed, so a
// new stream that gets the same handle starts clean.
void ForgetCudaStream(const void* stream);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_CUDA_STREAM_ERRORS_H_
