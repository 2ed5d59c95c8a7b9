// The heap, counted, for tests and benchmarks that hold host memory to a
// bound: linking this library replaces the global operator new and delete
// (every form) with ones that add and take off each block's usable size.
// What is counted is the plain heap: the state's std::vectors, the
// binary's own, Gloo's. The backends' arenas (the device, the host live
// sets, tracked by their MemorySpace) do not come from here.
//
// Only for binaries that link it on purpose (alwayslink): it changes every
// allocation of the process.
#ifndef PLATEAU_KERNELS_TESTING_HEAP_COUNTER_H_
#define PLATEAU_KERNELS_TESTING_HEAP_COUNTER_H_

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace plateau {

// Whether this binary's heap is counted: a block of operator new shows in
// HeapInUse. Not under AddressSanitizer (--config=asan), whose allocator
// takes operator new over: every count reads 0 there, so a test holding the
// heap to a bound checks this first and skips, saying why, rather than
// pass on zeros.
bool HeapIsCounted();
// Bytes in use now.
int64_t HeapInUse();
// The most in use at once since the last ResetHeapPeak.
int64_t HeapPeak();
// Starts a new peak at what is in use now; returns that.
int64_t ResetHeapPeak();

// The heap over a stretch of work that P rank threads do together: each
// rank calls Begin(), works, and calls End(), which returns (to every
// rank) the most the heap held above what it held at Begin. Begin and End
// are meetings of all P ranks (allocating nothing); a rank that never
// comes (it failed) makes the others give up after `timeout_s` (a rank's
// work between Begin and End must take less), and broken() is true from
// then on (every later meeting returns at once).
//
// Between the two, Held() (a meeting too) returns what the heap holds now
// above Begin's, and RestartPeak() (a meeting) starts the peak again from
// what is in use now, so that End() gives the most above Begin's during the
// work after it only: e.g. what a layer keeps from its forward to its
// backward (Held) and the most its recompute takes on top (End).
class HeapWindow {
 public:
  explicit HeapWindow(int ranks, int timeout_s = 60) : ranks_(ranks), timeout_s_(timeout_s) {}
  void Begin();
  int64_t Held();
  void RestartPeak();
  int64_t End();
  bool broken();

 private:
  // All ranks meet; the last to arrive runs `last` first.
  template <typename Fn>
  void Meet(Fn last);

  std::mutex mu_;
  std::condition_variable cv_;
  const int ranks_, timeout_s_;
  int arrived_ = 0;
  int64_t round_ = 0;
  bool broken_ = false;
  int64_t base_ = 0, above_ = 0, held_ = 0;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_TESTING_HEAP_COUNTER_H_
