#include "kernels/testing/heap_counter.h"

#include <malloc.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <new>

namespace {

std::atomic<int64_t> g_heap_now{0}, g_heap_peak{0};

void* Counted(void* p) {
  if (p == nullptr) throw std::bad_alloc();
  const int64_t size = static_cast<int64_t>(malloc_usable_size(p));
  const int64_t now = g_heap_now.fetch_add(size) + size;
  int64_t peak = g_heap_peak.load();
  while (now > peak && !g_heap_peak.compare_exchange_weak(peak, now)) {
  }
  return p;
}

void Uncounted(void* p) {
  if (p == nullptr) return;
  g_heap_now.fetch_sub(static_cast<int64_t>(malloc_usable_size(p)));
  std::free(p);
}

// aligned_alloc wants a multiple of the alignment.
size_t Aligned(size_t n, std::align_val_t a) {
  const size_t al = static_cast<size_t>(a);
  return (n + al - 1) / al * al;
}

}  // namespace

// The array and nothrow forms of libstdc++ call these.
void* operator new(size_t n) { return Counted(std::malloc(n == 0 ? 1 : n)); }
void* operator new(size_t n, std::align_val_t a) {
  return Counted(std::aligned_alloc(static_cast<size_t>(a), Aligned(n == 0 ? 1 : n, a)));
}
void operator delete(void* p) noexcept { Uncounted(p); }
void operator delete(void* p, size_t) noexcept { Uncounted(p); }
void operator delete(void* p, std::align_val_t) noexcept { Uncounted(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { Uncounted(p); }

namespace plateau {

bool HeapIsCounted() {
  const int64_t before = g_heap_now.load();
  // A call of the allocation function, not a new-expression, which the
  // compiler may elide.
  void* p = ::operator new(4096);
  const bool counted = g_heap_now.load() >= before + 4096;
  ::operator delete(p);
  return counted;
}

int64_t HeapInUse() { return g_heap_now.load(); }
int64_t HeapPeak() { return g_heap_peak.load(); }
int64_t ResetHeapPeak() {
  const int64_t now = g_heap_now.load();
  g_heap_peak.store(now);
  return now;
}

template <typename Fn>
void HeapWindow::Meet(Fn last) {
  std::unique_lock<std::mutex> lock(mu_);
  if (broken_) return;
  const int64_t round = round_;
  if (++arrived_ == ranks_) {
    last();
    arrived_ = 0;
    ++round_;
    cv_.notify_all();
  } else if (!cv_.wait_for(lock, std::chrono::seconds(timeout_s_), [&] { return round_ != round || broken_; })) {
    broken_ = true;
    cv_.notify_all();
  }
}

void HeapWindow::Begin() {
  Meet([this] { base_ = ResetHeapPeak(); });
}

int64_t HeapWindow::Held() {
  Meet([this] { held_ = HeapInUse() - base_; });
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

void HeapWindow::RestartPeak() {
  Meet([] { ResetHeapPeak(); });
}

int64_t HeapWindow::End() {
  Meet([this] { above_ = HeapPeak() - base_; });
  std::lock_guard<std::mutex> lock(mu_);
  return above_;
}

bool HeapWindow::broken() {
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

}  // namespace plateau
