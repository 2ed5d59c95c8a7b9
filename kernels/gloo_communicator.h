// The CPU Communicator: Gloo over TCP.
//
// Ranks meet through the KeyValueStore (adapted to Gloo's Store, under a
// PrefixStore of "<prefix>/world"), connect a full mesh of TCP pairs on
// `hostname`, and run each collective on the CpuStream's worker thread when
// the stream reaches it. Gloo's own algorithms carry all-reduce (ring),
// all-gather (ring; blocks up to 64 KiB go directly to every peer instead,
// one message delay rather than P - 1), all-to-all-v, broadcast (binomial
// tree) and barrier;
// reduce-scatter is a ring of our own over unbound buffers (Gloo's
// ReduceScatterHalvingDoubling takes int counts and an in-place buffer of
// the whole input), and so is SendRecv. Every collective gets the next tag
// of the communicator, so the messages of two collectives never match.
//
// Gloo reports failures by throwing; every exception is caught on the
// stream thread and becomes a status naming the collective, the group and
// the rank: DEADLINE_EXCEEDED for a timeout, UNAVAILABLE for a lost peer,
// INTERNAL for anything else. It is the stream's sticky error and marks the
// communicator unusable (see communicator.h).
//
// A group made with Group() is a new Gloo context over its members (same
// TCP device, PrefixStore "<parent prefix>/<name>[<world ranks>]#<n>").
//
// Process-wide effects: the Gloo TCP device (one event-loop thread) for a
// hostname is made by the first communicator that needs it and shared by
// every communicator on that hostname until the process ends (ranks that
// are threads of one process share its loop thread); and the
// first communicator sets SIGPIPE to ignored unless the program handles it
// (Gloo's writes to a peer that has left would otherwise kill the process;
// a rank whose stdout reader goes away now keeps running, its prints
// failing). gloo_communicator.cc says why.
#ifndef PLATEAU_KERNELS_GLOO_COMMUNICATOR_H_
#define PLATEAU_KERNELS_GLOO_COMMUNICATOR_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/communicator.h"

namespace plateau {

// The world communicator over Gloo. `options` must be valid
// (ValidateCommunicatorOptions) with backend kCpu.
absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(
    const CommunicatorOptions& options);

// How many Gloo devices this process has made (for tests and benches: one
// per hostname used).
int64_t GlooDevicesMade();

}  // namespace plateau

#endif  // PLATEAU_KERNELS_GLOO_COMMUNICATOR_H_
