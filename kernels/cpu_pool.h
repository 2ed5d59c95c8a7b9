// A small thread pool owned by the CPU backend, so that the non-GEMM kernels
// (elementwise ops, row-wise norms and softmaxes, cross-entropy, the router,
// attention) use every core instead of only the stream's thread.
//
// Determinism: a kernel splits its work into tasks by the problem's size
// alone (a fixed number of rows or elements per task), never by the pool's
// size. Each task writes only its own outputs, and a reduction keeps one
// partial per task and combines them in task order, so the bits are the same
// for any pool size, 1 included, and run to run.
//
// OpenBLAS: the backend runs it single-threaded (openblas_set_num_threads(1),
// process-wide) and splits a GEMM into row blocks, one sgemm call per pool
// task (cpu::Gemm), with the number of blocks fixed by the GEMM's rows alone.
// A stream runs one kernel at a time, so on one stream a GEMM and another
// pool-parallel kernel never overlap; the pool's workers block on a condition
// variable (no spinning) between calls. Two streams may still call into the
// pool at once (the copy stream runs no kernels today): the second runs its
// tasks itself (below), and results do not change.
//
// Thread safety: ParallelFor may be called from any thread. Calls do not
// nest: a caller that finds the pool busy (another stream's kernel) runs all
// of its tasks itself, which gives the same bits.
#ifndef PLATEAU_KERNELS_CPU_POOL_H_
#define PLATEAU_KERNELS_CPU_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace plateau {

class CpuPool {
 public:
  // fn(task, slot): slot < the participants of this call (<= max_slots),
  // distinct among tasks running at the same time, so a task may use
  // per-slot scratch.
  using TaskFn = std::function<void(int64_t task, int slot)>;

  // `threads` participants in all: the caller plus threads - 1 workers.
  // threads <= 0 means one per core (std::thread::hardware_concurrency()).
  explicit CpuPool(int threads);
  ~CpuPool();
  CpuPool(const CpuPool&) = delete;
  CpuPool& operator=(const CpuPool&) = delete;

  int threads() const { return threads_; }

  // Runs fn(t, slot) for every t in [0, tasks) and returns when all are done.
  // Tasks may run in any order and on any participant.
  void ParallelFor(int64_t tasks, const TaskFn& fn, int max_slots = 1 << 30);

 private:
  void WorkerLoop(int slot);
  void Drain(int slot);

  const int threads_;
  std::vector<std::thread> workers_;
  std::mutex busy_;  // held by the one caller the pool serves at a time

  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  uint64_t generation_ = 0;     // guarded by mu_
  int active_slots_ = 0;        // slots (workers 1..) this call may use
  bool open_ = false;           // workers may still join this call; mu_
  int inside_ = 0;              // workers running this call's tasks; mu_
  bool stopping_ = false;       // guarded by mu_
  const TaskFn* fn_ = nullptr;  // the current call's function
  int64_t tasks_ = 0;
  std::atomic<int64_t> next_{0};
};

// Runs fn(t, slot) for t in [0, tasks): on `pool` when it is given, else in
// order on the calling thread with slot 0 (what the CPU kernels do when
// called without a pool, e.g. as references in tests).
void ParallelFor(CpuPool* pool, int64_t tasks, const CpuPool::TaskFn& fn,
                 int max_slots = 1 << 30);

// Kernels whose task size is not already fixed at tens of microseconds (the
// GEMMs' row blocks, attention's heads and tiles) run on the caller below
// kPoolMinWork flops: waking a worker and waiting for it costs a futex wake
// and a wait, ~5-20 us on a quiet machine and up to a scheduler slice on a
// busy one, more than such a kernel takes on one core. The tests' tiny
// models (hidden 16-64) paid it thousands of times per test (BENCHMARKS.md,
// "The test suite's wall time before and after issue 18"). The rule reads
// the problem's size only, and the inline path runs the same tasks (the
// no-pool path of ParallelFor), so the bits do not change.
inline constexpr int64_t kPoolMinWork = int64_t{1} << 20;

// `pool` when `work` (about the kernel's flops) is worth a hand-off, else
// null: run the tasks in order on the calling thread.
inline CpuPool* PoolFor(CpuPool* pool, int64_t work) {
  return work < kPoolMinWork ? nullptr : pool;
}

// The number of tasks of `per_task` items that cover n items (at least 1).
inline int64_t TaskCount(int64_t n, int64_t per_task) {
  return n <= per_task ? 1 : (n + per_task - 1) / per_task;
}

// fn(begin, end) over [0, n) in tasks of `per_task` items (the last one
// shorter): the split depends on n and per_task only.
template <typename Fn>
void ParallelBlocks(CpuPool* pool, int64_t n, int64_t per_task, Fn fn) {
  if (n <= 0) return;
  ParallelFor(pool, TaskCount(n, per_task), [&](int64_t t, int) {
    const int64_t b = t * per_task;
    fn(b, n - b < per_task ? n : b + per_task);
  });
}

// Rows of `cols` floats per task for row-wise kernels: about 16K floats
// (64 KiB) per task, at least one row.
inline int64_t RowsPerTask(int64_t cols) {
  return cols >= (int64_t{1} << 14) ? 1 : (int64_t{1} << 14) / (cols < 1 ? 1 : cols);
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_CPU_POOL_H_
