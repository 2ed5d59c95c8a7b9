#include "kernels/cpu_pool.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <vector>

#include "gtest/gtest.h"

namespace plateau {
namespace {

TEST(CpuPoolTest, EveryTaskRunsOnceWithADistinctSlot) {
  for (int threads : {1, 2, 3, 5}) {
    CpuPool pool(threads);
    EXPECT_EQ(pool.threads(), threads);
    for (int64_t tasks : {0, 1, 2, 7, 1000}) {
      std::vector<std::atomic<int>> hits(tasks);
      std::vector<std::atomic<int>> in_slot(threads);
      std::atomic<bool> clash{false};
      pool.ParallelFor(tasks, [&](int64_t t, int slot) {
        if (slot < 0 || slot >= threads || in_slot[slot].fetch_add(1) != 0) clash = true;
        hits[t].fetch_add(1);
        in_slot[slot].fetch_sub(1);
      });
      EXPECT_FALSE(clash) << threads << " threads, " << tasks << " tasks";
      for (int64_t t = 0; t < tasks; ++t) ASSERT_EQ(hits[t].load(), 1) << t;
    }
  }
}

TEST(CpuPoolTest, MaxSlotsCapsTheParticipants) {
  CpuPool pool(4);
  std::atomic<int> worst{0};
  pool.ParallelFor(100, [&](int64_t, int slot) {
    int w = worst.load();
    while (slot > w && !worst.compare_exchange_weak(w, slot)) {}
  }, 2);
  EXPECT_LT(worst.load(), 2);
}

// A caller that finds the pool busy runs its tasks itself.
TEST(CpuPoolTest, ConcurrentCallersBothFinish) {
  CpuPool pool(2);
  std::atomic<int64_t> total{0};
  std::thread other([&] {
    for (int i = 0; i < 200; ++i) pool.ParallelFor(50, [&](int64_t, int) { total += 1; });
  });
  for (int i = 0; i < 200; ++i) pool.ParallelFor(50, [&](int64_t, int) { total += 1; });
  other.join();
  EXPECT_EQ(total.load(), 2 * 200 * 50);
}

// Calls of two tasks, back to back: a worker woken for one call often
// arrives after the caller has taken both tasks (the caller no longer waits
// for it); it must skip that call, and join a later one only with that
// call's function and tasks. And a call returns only once every task it
// handed off has finished: each task spins a little before it counts, so a
// caller that returned while a worker ran one would find it unfinished.
TEST(CpuPoolTest, ManySmallCallsEachRunEveryTaskOnceAndFinishBeforeReturning) {
  CpuPool pool(3);
  std::vector<std::atomic<int>> hits(2 * 20000);
  int64_t on_workers = 0;
  for (int64_t call = 0; call < 20000; ++call) {
    std::atomic<int> worker_tasks{0};
    pool.ParallelFor(2, [&, call](int64_t t, int slot) {
      // Every task spins (so that workers wake in time to take some), and
      // counts only at its end.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(20);
      while (std::chrono::steady_clock::now() < until) {
      }
      if (slot > 0) worker_tasks.fetch_add(1, std::memory_order_relaxed);
      hits[2 * call + t].fetch_add(1, std::memory_order_relaxed);
    });
    ASSERT_EQ(hits[2 * call].load() + hits[2 * call + 1].load(), 2) << "call " << call << " returned early";
    on_workers += worker_tasks.load();
  }
  for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i].load(), 1) << i;
  std::printf("%lld of 40000 tasks ran on a worker\n", static_cast<long long>(on_workers));
}

// Below kPoolMinWork a kernel runs on its caller; the rule reads the work
// alone, not the pool.
TEST(CpuPoolTest, PoolForHandsOffOnlyLargeWork) {
  CpuPool pool(2);
  EXPECT_EQ(PoolFor(&pool, kPoolMinWork - 1), nullptr);
  EXPECT_EQ(PoolFor(&pool, kPoolMinWork), &pool);
  EXPECT_EQ(PoolFor(nullptr, kPoolMinWork), nullptr);
}

TEST(CpuPoolTest, NullPoolRunsInOrder) {
  std::vector<int64_t> order;
  ParallelFor(nullptr, 5, [&](int64_t t, int slot) {
    EXPECT_EQ(slot, 0);
    order.push_back(t);
  });
  EXPECT_EQ(order, (std::vector<int64_t>{0, 1, 2, 3, 4}));
}

}  // namespace
}  // namespace plateau
