// CPU streams: each stream is one worker thread draining a FIFO of tasks, so
// a copy stream and a compute stream really overlap, as CUDA streams do.
#ifndef PLATEAU_KERNELS_CPU_STREAM_H_
#define PLATEAU_KERNELS_CPU_STREAM_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "kernels/stream.h"

namespace plateau {

class CpuEvent final : public Event {
 public:
  absl::Status Synchronize() override;
  bool Done() override;

 private:
  friend class CpuStream;
  // Each Record takes the next ticket; the stream marks it complete when it
  // reaches that point. Completion is in order within one stream.
  uint64_t NextTicket();
  void Complete(uint64_t ticket);
  void WaitFor(uint64_t ticket);
  uint64_t last_ticket();

  absl::Mutex mu_;
  uint64_t recorded_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
};

class CpuStream final : public Stream {
 public:
  using Task = std::function<absl::Status()>;

  explicit CpuStream(std::string name);
  ~CpuStream() override;  // drains the queue, then joins the worker
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
  void Run();

  const std::string name_;
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
