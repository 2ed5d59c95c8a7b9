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
      wake_.wait(lock, [&] { return stopping_ || (generation_ != seen && slot < active_slots_); });
      if (stopping_) return;
      seen = generation_;
    }
    Drain(slot);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++finished_workers_;
    }
    done_.notify_one();
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
    finished_workers_ = 0;
    ++generation_;
  }
  wake_.notify_all();
  Drain(0);
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return finished_workers_ == slots - 1; });
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
