// CPU streams: each stream is one worker thread draining a FIFO of tasks, so
// a copy stream and a compute stream really overlap, as CUDA streams do.
#ifndef PLATEAU_KERNELS_CPU_STREAM_H_
#define PLATEAU_KERNELS_CPU_STREAM_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/stream.h"

namespace plateau {

class CpuEvent final : public Event {
 public:
  // A timing event keeps the steady clock's reading when its point ran. A
  // point recorded on an idle stream runs at Record.
  explicit CpuEvent(bool timing = false) : timing_(timing) {}

  absl::Status Synchronize() override;
  bool Done() override;
  absl::StatusOr<double> SecondsSince(Event& earlier) override;

 private:
  friend class CpuStream;
  // Each Record takes the next ticket; the stream marks it complete when it
  // reaches that point. Completion is in order within one stream.
  uint64_t NextTicket();
  void Complete(uint64_t ticket);
  void WaitFor(uint64_t ticket);
  uint64_t last_ticket();
  // The time the last recorded point ran; an error unless this is a timing
  // event, recorded and complete.
  absl::StatusOr<std::chrono::steady_clock::time_point> RanAt();

  const bool timing_;
  absl::Mutex mu_;
  uint64_t recorded_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  std::chrono::steady_clock::time_point completed_at_ ABSL_GUARDED_BY(mu_);
};

class CpuStream;

// The streams of one CPU backend. Its spaces call Drain() before memory goes
// back to the heap: the CPU counterpart of cudaFree, which waits for the
// device. Without it a buffer released on an error path could be reused
// while a collective queued on another stream still writes into it.
//
// Thread safety: safe from any thread. A stream task must not free backend
// memory while another stream's task does the same (each would wait for the
// other); no task in Plateau frees memory.
class CpuStreamSet {
 public:
  // Called by CpuStream's constructor and destructor.
  void Add(CpuStream* stream);
  void Remove(CpuStream* stream);
  // Blocks until every stream of the set has run everything enqueued before
  // this call. From a stream's own thread, that stream is skipped (its
  // earlier work has run, in FIFO order).
  void Drain();

 private:
  absl::Mutex mu_;
  std::vector<CpuStream*> streams_ ABSL_GUARDED_BY(mu_);
  int draining_ ABSL_GUARDED_BY(mu_) = 0;  // Drain calls using a snapshot
};

class CpuStream final : public Stream {
 public:
  using Task = std::function<absl::Status()>;

  // `set`, when given, is the backend's set this stream joins.
  explicit CpuStream(std::string name, std::shared_ptr<CpuStreamSet> set = nullptr);
  ~CpuStream() override;  // drains the queue, then joins the worker

  // The stream whose thread is calling, or nullptr.
  static const CpuStream* Current();
  CpuStream(const CpuStream&) = delete;
  CpuStream& operator=(const CpuStream&) = delete;

  const std::string& name() const override { return name_; }
  absl::Status Record(Event& event) override;
  absl::Status Wait(Event& event) override;
  absl::Status Synchronize() override;

  // Runs `task` on the stream's thread after everything enqueued before it.
  // A task that fails makes the stream's error sticky; later tasks are
  // skipped.
  void Enqueue(Task task);

 private:
  struct Item {
    Task task;
    bool control;  // event bookkeeping: runs even after an error
  };
  void Push(Item item);
  void PushLocked(Item item) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run();

  const std::string name_;
  const std::shared_ptr<CpuStreamSet> set_;
  absl::Mutex mu_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  int64_t enqueued_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t finished_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::thread worker_;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_CPU_STREAM_H_
