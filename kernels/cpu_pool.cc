#include "kernels/cpu_pool.h"

#include <algorithm>

namespace plateau {

CpuPool::CpuPool(int threads)
    : threads_(threads > 0 ? threads
                           : std::max(1, static_cast<int>(std::thread::hardware_concurrency()))) {
  for (int slot = 1; slot < threads_; ++slot) {
    workers_.emplace_back([this, slot] { WorkerLoop(slot); });
  }
}

CpuPool::~CpuPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void CpuPool::Drain(int slot) {
  for (int64_t t = next_.fetch_add(1); t < tasks_; t = next_.fetch_add(1)) (*fn_)(t, slot);
}

void CpuPool::WorkerLoop(int slot) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      // A worker joins only a call still open: one that wakes after the
      // caller has taken every task skips it (and waits for the next).
      wake_.wait(lock, [&] {
        return stopping_ || (open_ && generation_ != seen && slot < active_slots_);
      });
      if (stopping_) return;
      seen = generation_;
      ++inside_;
    }
    Drain(slot);
    bool last;
    {
      std::lock_guard<std::mutex> lock(mu_);
      last = --inside_ == 0 && !open_;
    }
    if (last) done_.notify_one();
  }
}

void CpuPool::ParallelFor(int64_t tasks, const TaskFn& fn, int max_slots) {
  if (tasks <= 0) return;
  const int slots = static_cast<int>(std::min<int64_t>({threads_, max_slots, tasks}));
  // One task, one participant, or the pool serving another caller: run here.
  // The split is the caller's, so the result is the same either way.
  std::unique_lock<std::mutex> busy(busy_, std::defer_lock);
  if (slots <= 1 || !busy.try_lock()) {
    for (int64_t t = 0; t < tasks; ++t) fn(t, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    tasks_ = tasks;
    next_.store(0);
    active_slots_ = slots;
    open_ = true;
    ++generation_;
  }
  wake_.notify_all();
  Drain(0);
  // Every task is taken once the caller's Drain returns; wait only for the
  // workers still running one. A worker not yet scheduled is not waited
  // for: on a busy machine (the tests' ranks are threads on 2 cores) that
  // wait was a scheduler slice per call, longer than the kernel.
  std::unique_lock<std::mutex> lock(mu_);
  open_ = false;
  done_.wait(lock, [&] { return inside_ == 0; });
  active_slots_ = 0;
  fn_ = nullptr;
}

void ParallelFor(CpuPool* pool, int64_t tasks, const CpuPool::TaskFn& fn, int max_slots) {
  if (pool != nullptr) {
    pool->ParallelFor(tasks, fn, max_slots);
    return;
  }
  for (int64_t t = 0; t < tasks; ++t) fn(t, 0);
}

}  // namespace plateau
