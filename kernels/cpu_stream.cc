#include "kernels/cpu_stream.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"

namespace plateau {

// ---------------------------------------------------------------------------
// CpuEvent

uint64_t CpuEvent::NextTicket() {
  absl::MutexLock lock(&mu_);
  return ++recorded_;
}

uint64_t CpuEvent::last_ticket() {
  absl::MutexLock lock(&mu_);
  return recorded_;
}

void CpuEvent::Complete(uint64_t ticket) {
  // Read before the lock: the time the stream reached the point, not the
  // time a waiter let go of the mutex.
  const auto now =
      timing_ ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
  absl::MutexLock lock(&mu_);
  if (ticket > completed_) {
    completed_ = ticket;
    completed_at_ = now;
  }
}

absl::StatusOr<std::chrono::steady_clock::time_point> CpuEvent::RanAt() {
  if (!timing_)
    return absl::FailedPreconditionError("event: not a timing event (Backend::CreateTimingEvent)");
  absl::MutexLock lock(&mu_);
  if (recorded_ == 0) return absl::FailedPreconditionError("event: never recorded");
  if (completed_ < recorded_)
    return absl::FailedPreconditionError("event: its point has not run yet");
  return completed_at_;
}

absl::StatusOr<double> CpuEvent::SecondsSince(Event& earlier) {
  auto* e = dynamic_cast<CpuEvent*>(&earlier);
  if (e == nullptr) return absl::InvalidArgumentError("event: SecondsSince needs a CPU event");
  auto from = e->RanAt();
  if (!from.ok()) return from.status();
  auto to = RanAt();
  if (!to.ok()) return to.status();
  return std::chrono::duration<double>(*to - *from).count();
}

void CpuEvent::WaitFor(uint64_t ticket) {
  absl::MutexLock lock(&mu_);
  struct Arg {
    const uint64_t* completed;
    uint64_t ticket;
  } arg{&completed_, ticket};
  mu_.Await(absl::Condition(
      +[](Arg* a) { return *a->completed >= a->ticket; }, &arg));
}

absl::Status CpuEvent::Synchronize() {
  WaitFor(last_ticket());
  return absl::OkStatus();
}

bool CpuEvent::Done() {
  absl::MutexLock lock(&mu_);
  return completed_ >= recorded_;
}

// ---------------------------------------------------------------------------
// CpuStreamSet

void CpuStreamSet::Add(CpuStream* stream) {
  absl::MutexLock lock(&mu_);
  streams_.push_back(stream);
}

void CpuStreamSet::Remove(CpuStream* stream) {
  absl::MutexLock lock(&mu_);
  // A Drain may still hold this stream in its snapshot.
  mu_.Await(absl::Condition(
      +[](int* draining) { return *draining == 0; }, &draining_));
  streams_.erase(std::remove(streams_.begin(), streams_.end(), stream), streams_.end());
}

void CpuStreamSet::Drain() {
  std::vector<CpuStream*> streams;
  {
    absl::MutexLock lock(&mu_);
    streams = streams_;
    ++draining_;
  }
  const CpuStream* self = CpuStream::Current();
  for (CpuStream* s : streams) {
    // The stream's own error is its owner's to report; here only the
    // ordering matters.
    if (s != self) s->Synchronize().IgnoreError();
  }
  absl::MutexLock lock(&mu_);
  --draining_;
}

// ---------------------------------------------------------------------------
// CpuStream

namespace {
thread_local const CpuStream* current_stream = nullptr;
}  // namespace

const CpuStream* CpuStream::Current() { return current_stream; }

CpuStream::CpuStream(std::string name, std::shared_ptr<CpuStreamSet> set)
    : name_(std::move(name)), set_(std::move(set)), worker_([this] {
        current_stream = this;
        Run();
      }) {
  if (set_ != nullptr) set_->Add(this);
}

CpuStream::~CpuStream() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  worker_.join();
  if (set_ != nullptr) set_->Remove(this);
}

void CpuStream::Push(Item item) {
  absl::MutexLock lock(&mu_);
  PushLocked(std::move(item));
}

void CpuStream::PushLocked(Item item) {
  queue_.push_back(std::move(item));
  ++enqueued_;
}

void CpuStream::Enqueue(Task task) { Push({std::move(task), false}); }

absl::Status CpuStream::Record(Event& event) {
  auto* e = dynamic_cast<CpuEvent*>(&event);
  if (e == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("stream '", name_, "': Record needs a CPU event"));
  }
  uint64_t ticket = e->NextTicket();
  // A point recorded on an idle stream has run now, as on a GPU: complete
  // (and, for a timing event, stamped) here, not after the worker wakes.
  // Stream lock, then the event's: the worker completes events without
  // holding its lock.
  absl::MutexLock lock(&mu_);
  if (finished_ == enqueued_) {
    e->Complete(ticket);
    return absl::OkStatus();
  }
  PushLocked({[e, ticket] {
                e->Complete(ticket);
                return absl::OkStatus();
              },
              true});
  return absl::OkStatus();
}

absl::Status CpuStream::Wait(Event& event) {
  auto* e = dynamic_cast<CpuEvent*>(&event);
  if (e == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("stream '", name_, "': Wait needs a CPU event"));
  }
  uint64_t ticket = e->last_ticket();
  if (ticket == 0) return absl::OkStatus();  // never recorded: complete
  Push({[e, ticket] {
          e->WaitFor(ticket);
          return absl::OkStatus();
        },
        true});
  return absl::OkStatus();
}

absl::Status CpuStream::Synchronize() {
  absl::MutexLock lock(&mu_);
  struct Arg {
    const int64_t* finished;
    int64_t target;
  } arg{&finished_, enqueued_};
  mu_.Await(absl::Condition(
      +[](Arg* a) { return *a->finished >= a->target; }, &arg));
  return error_;
}

void CpuStream::Run() {
  for (;;) {
    Item item;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](CpuStream* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
            return !s->queue_.empty() || s->stopping_;
          },
          this));
      if (queue_.empty()) return;  // stopping and drained
      item = std::move(queue_.front());
      queue_.pop_front();
      if (!item.control && !error_.ok()) {
        ++finished_;  // skipped: the stream already failed
        continue;
      }
    }
    absl::Status s = item.task();
    absl::MutexLock lock(&mu_);
    if (!s.ok() && error_.ok()) {
      error_ = absl::Status(s.code(),
                            absl::StrCat("stream '", name_, "': ", s.message()));
    }
    ++finished_;
  }
}

}  // namespace plateau
