// Streams and events: the ordering model of the runtime, as on a GPU.
//
// Work enqueued on one stream runs in order; work on different streams may
// overlap. An Event recorded on a stream completes when everything enqueued
// on that stream before the Record has run; Stream::Wait(event) makes later
// work on another stream wait for it without blocking the host. This is what
// lets a copy stream move a checkpoint while the compute stream runs, and a
// communication stream move the next ring traveller during a strip GEMM.
//
// Errors are sticky, as in CUDA: once a stream's work fails, its later work
// is skipped and Synchronize() returns the first error. Events recorded after
// the failure still complete, so nothing waiting on them hangs.
//
// Thread safety: a Stream may be used from any thread; the order of work is
// the order of the enqueue calls.
#ifndef PLATEAU_KERNELS_STREAM_H_
#define PLATEAU_KERNELS_STREAM_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace plateau {

class Event {
 public:
  virtual ~Event() = default;
  // Blocks the host until the work captured by the last Record has run.
  // An event that was never recorded is complete.
  virtual absl::Status Synchronize() = 0;
  // True when the work captured by the last Record has run.
  virtual bool Done() = 0;
  // Seconds from the moment `earlier`'s last recorded point ran to the
  // moment this event's did, by the device's clock (CUDA's
  // cudaEventElapsedTime; the CPU's steady clock), for timing work on a
  // stream without blocking it. Both must come from one backend's
  // CreateTimingEvent and be recorded and complete (FailedPrecondition
  // otherwise). Negative when `earlier` ran later (two streams).
  virtual absl::StatusOr<double> SecondsSince(Event& earlier) {
    (void)earlier;
    return absl::UnimplementedError("event: not a timing event (Backend::CreateTimingEvent)");
  }
};

class Stream {
 public:
  virtual ~Stream() = default;
  virtual const std::string& name() const = 0;
  // `event` completes once all work enqueued so far on this stream has run.
  virtual absl::Status Record(Event& event) = 0;
  // Work enqueued on this stream after this call waits for `event` (as
  // recorded at the time of this call).
  virtual absl::Status Wait(Event& event) = 0;
  // Blocks the host until all enqueued work has run; returns the stream's
  // first error, if any.
  virtual absl::Status Synchronize() = 0;
  // The backend's own handle (a cudaStream_t on CUDA), for libraries such as
  // NCCL that take one; nullptr on the CPU.
  virtual void* native_handle() const { return nullptr; }
};

// Work enqueued on `waiter` from now on waits for everything enqueued on
// `producer` so far: `event` recorded on the producer, waited for by the
// waiter, never a host synchronisation. The one ordering between two
// streams that the ring schedules and the step use (compute -> comm before
// a send, comm -> compute before a received block is read).
inline absl::Status OrderAfter(Stream& waiter, Stream& producer, Event& event) {
  if (absl::Status s = producer.Record(event); !s.ok()) return s;
  return waiter.Wait(event);
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_STREAM_H_
