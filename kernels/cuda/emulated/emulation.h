// What the emulated CUDA runtime (runtime.cc) offers the emulated libraries
// beside it (cublas.cc, nccl.cc): their calls put work on a stream as the
// real libraries do, and that work runs when the stream runs (see
// cuda_runtime_api.h: lazily, in stream order).
#ifndef PLATEAU_KERNELS_CUDA_EMULATED_EMULATION_H_
#define PLATEAU_KERNELS_CUDA_EMULATED_EMULATION_H_

#include <functional>
#include <string>
#include <vector>

#include "kernels/cuda/emulated/cuda_runtime_api.h"

namespace plateau::cuda_emulation {

// Appends `work` to `stream` (nullptr or cudaStreamLegacy: the legacy
// stream). It runs with the runtime's lock held, after everything enqueued
// on the stream before it, and must not call the emulated runtime; it may
// call Fault. Arguments the real library reads at call time (host arrays,
// alpha and beta in host pointer mode) must be copied into `work`; what the
// real library reads from device memory when the work runs (the grouped
// GEMM's pointer arrays, written by a kernel earlier on the stream) must be
// read inside it. Returns the sticky error, if the device has faulted
// (nothing is enqueued then), or cudaErrorInvalidResourceHandle for a
// destroyed stream.
cudaError_t Enqueue(cudaStream_t stream, std::function<void()> work);

// Appends work that runs off the stream, on another thread (the emulated
// NCCL's collectives: they wait for other ranks, which work run under the
// runtime's lock must never do). When the stream reaches it, `start(done)`
// is called, with the runtime's lock held: it hands the work to its thread
// and returns true, and that thread calls `done()` (once, holding no lock
// the runtime's callers might hold) when the work is over; until then the
// stream's later work waits, queries say cudaErrorNotReady and synchronising
// calls wait (without the lock). `start` returns false if there was nothing
// to do (`done` is then never called). After a device fault it is called as
// `start(nullptr)` instead: the work must not run (its inputs were never
// written). The stream's earlier work runs at once, so the work starts now
// if nothing ahead of it is blocked. Errors as for Enqueue.
cudaError_t EnqueueExternal(cudaStream_t stream,
                            std::function<bool(std::function<void()> done)> start);

// Runs everything enqueued on `stream` so far (and, first, what it waits for
// on other streams), waiting for external work in the way. Takes the
// runtime's lock; do not call it from inside work. Returns the sticky error,
// if any.
cudaError_t Flush(cudaStream_t stream);

// From inside work only: the device faults (cudaErrorLaunchFailure from then
// on, sticky); `why` is printed to stderr once.
void Fault(const std::string& why);

// The calling thread's current device, and the device a stream belongs to
// (-1 for an unknown or destroyed stream).
int CurrentDevice();
// The machine's GPU that device `device` of this process is (its entry in
// CUDA_VISIBLE_DEVICES), -1 for no such device: what NCCL's one-rank-per-GPU
// check compares across the ranks of a world, in any process.
int PhysicalDevice(int device);
int StreamDevice(cudaStream_t stream);

// The machine's GPUs (0 .. gpus-1, PLATEAU_EMULATED_GPUS) this process sees,
// in device order, given CUDA_VISIBLE_DEVICES (nullptr: unset, all of
// them): a comma-separated list of indices, as CUDA reads it — it stops at
// the first entry that names no GPU (not an index, out of range, repeated).
// GPU UUIDs are not emulated. Read once, at the runtime's first call.
std::vector<int> VisibleDevices(const char* cuda_visible_devices, int gpus);

}  // namespace plateau::cuda_emulation

#endif  // PLATEAU_KERNELS_CUDA_EMULATED_EMULATION_H_
