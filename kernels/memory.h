// Memory spaces with per-live-set accounting.
//
// Every allocation names the live set it belongs to (the paper's unit of
// memory: weights, gradients, optimizer state, checkpoints, dispatch,
// projection, activations, workspace). A MemoryTracker keeps the current and
// peak bytes of each live set and of their total, so that every schedule's
// bound can be checked against what the runtime actually held.
//
// Thread safety: MemoryTracker and MemorySpace are safe to use from any
// thread. A Buffer is owned by one thread at a time, like a std::unique_ptr.
#ifndef PLATEAU_KERNELS_MEMORY_H_
#define PLATEAU_KERNELS_MEMORY_H_

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace plateau {

// The live sets of DESIGN.md "Memory model". The order is the reporting order.
enum class LiveSet : int {
  kWeights = 0,
  kGrads,
  kOptimizer,
  kCheckpoints,
  kDispatch,
  kProjection,
  kActivations,
  kWorkspace,
};
inline constexpr int kNumLiveSets = 8;

// "weights", "grads", "optimizer", "checkpoints", "dispatch", "projection",
// "activations", "workspace".
absl::string_view LiveSetName(LiveSet set);
absl::StatusOr<LiveSet> ParseLiveSet(absl::string_view name);

enum class SpaceKind { kDevice, kHost };
absl::string_view SpaceKindName(SpaceKind kind);  // "device" or "host"

// A point-in-time copy of a tracker's counters.
struct MemoryStats {
  std::array<int64_t, kNumLiveSets> current{};
  std::array<int64_t, kNumLiveSets> peak{};
  int64_t total_current = 0;
  int64_t total_peak = 0;

  int64_t current_of(LiveSet s) const { return current[static_cast<int>(s)]; }
  int64_t peak_of(LiveSet s) const { return peak[static_cast<int>(s)]; }
  // Raises each live set's peak and the total peak to `other`'s where larger
  // (the peaks over several calls); the current bytes are left as they are.
  void KeepPeaks(const MemoryStats& other) {
    for (int i = 0; i < kNumLiveSets; ++i) peak[i] = std::max(peak[i], other.peak[i]);
    total_peak = std::max(total_peak, other.total_peak);
  }
  // "weights=1024 (peak 2048), grads=..., total=... (peak ...)"; sets that
  // never held anything are left out.
  std::string DebugString() const;
};

// Current and peak bytes per live set and in total. Updates are a few relaxed
// atomic operations, cheap enough to leave on in every build.
//
// The total peak is the peak of the sum, not the sum of the per-set peaks:
// two live sets that peak at different times do not add up.
class MemoryTracker {
 public:
  MemoryTracker() = default;
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

  void Add(LiveSet set, int64_t bytes);
  void Sub(LiveSet set, int64_t bytes);

  int64_t current(LiveSet set) const;
  int64_t peak(LiveSet set) const;
  int64_t total_current() const;
  int64_t total_peak() const;

  // Starts a new measurement phase (a forward, a backward, a step): every
  // peak becomes the current value, so later peaks describe only this phase.
  void ResetPeaks();

  MemoryStats Snapshot() const;

  // A second, independent set of peaks for the memory timeline
  // (kernels/memory_timeline.h), which cuts a step into many short phases:
  // the step's own peaks (ResetPeaks, StepStats) must still cover the whole
  // call, so the timeline cannot reset those. TakePhase returns the current
  // bytes and the peaks since the last TakePhase (or ResetPhasePeaks), then
  // starts the next phase at the current bytes. An allocation racing with
  // TakePhase is counted in this phase's peak or the next's (perhaps both),
  // never in neither.
  void ResetPhasePeaks();
  MemoryStats TakePhase();

 private:
  static void RaiseTo(std::atomic<int64_t>& peak, int64_t value);

  std::array<std::atomic<int64_t>, kNumLiveSets> current_{};
  std::array<std::atomic<int64_t>, kNumLiveSets> peak_{};
  std::atomic<int64_t> total_current_{0};
  std::atomic<int64_t> total_peak_{0};
  // The timeline's phase peaks: two more relaxed maxima per allocation
  // (allocations are per buffer, a few per layer, never per element).
  std::array<std::atomic<int64_t>, kNumLiveSets> phase_peak_{};
  std::atomic<int64_t> total_phase_peak_{0};
};

// What an out-of-memory refusal carries as data (a payload of the
// RESOURCE_EXHAUSTED status), so that the rank, the worker and the
// coordinator report the live set and the bytes without parsing text.
struct OutOfMemoryInfo {
  LiveSet live_set = LiveSet::kWorkspace;
  std::string space;         // "device" or "host" (the space's name)
  int64_t requested = 0;     // bytes asked for
  int64_t free = 0;          // bytes free under the cap (0 when uncapped)
  int64_t cap = 0;           // the space's cap (0: uncapped)
};
// The info of an out-of-memory status made by MemorySpace::Allocate (and
// kept by every wrapper that preserves payloads), or nullopt.
std::optional<OutOfMemoryInfo> OutOfMemoryInfoOf(const absl::Status& status);
// Attaches `info` to `status` (for code that re-creates a status).
void SetOutOfMemoryInfo(absl::Status& status, const OutOfMemoryInfo& info);

class MemorySpace;

// Owns one allocation in a MemorySpace; returns it (and its bytes in the
// tracker) when destroyed or released. Move-only.
class Buffer {
 public:
  Buffer() = default;
  ~Buffer() { Release(); }
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }
  LiveSet live_set() const { return live_set_; }
  MemorySpace* space() const { return space_; }
  bool empty() const { return space_ == nullptr; }

  // Frees the allocation now (no-op on an empty buffer).
  void Release();

 private:
  friend class MemorySpace;
  Buffer(MemorySpace* space, void* data, size_t bytes, LiveSet set)
      : space_(space), data_(data), bytes_(bytes), live_set_(set) {}

  MemorySpace* space_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  LiveSet live_set_ = LiveSet::kWorkspace;
};

// A memory space (device or host) with an optional byte cap.
//
// Allocate() checks the cap before asking the underlying allocator, so that a
// capped space behaves like a device of that size: going over it returns
// RESOURCE_EXHAUSTED naming the live set, the bytes asked, the bytes free and
// what every live set holds — never a crash or an abort. Bytes are counted as
// requested (alignment padding is not charged), so the tracker's figures are
// the ones a closed-form bound predicts.
//
// Every Buffer must be released before its space is destroyed.
//
// Release and queued work: memory goes back to the space only after the
// space's release fence has run (see HeapSpace). On CUDA, cudaFree waits for
// the device to be idle; the CPU backend's spaces wait for its streams. So a
// Buffer dropped on an error path while a stream still has work that touches
// it cannot be reused under that work.
class MemorySpace {
 public:
  static constexpr size_t kAlignment = 256;  // as cudaMalloc guarantees
  static constexpr int64_t kUncapped = 0;

  MemorySpace(SpaceKind kind, std::string name, int64_t cap_bytes);
  virtual ~MemorySpace();
  MemorySpace(const MemorySpace&) = delete;
  MemorySpace& operator=(const MemorySpace&) = delete;

  absl::StatusOr<Buffer> Allocate(LiveSet set, size_t bytes);

  SpaceKind kind() const { return kind_; }
  const std::string& name() const { return name_; }
  // kUncapped (0) when only the underlying allocator limits the space.
  int64_t cap_bytes() const { return cap_bytes_; }
  MemoryTracker& tracker() { return tracker_; }
  const MemoryTracker& tracker() const { return tracker_; }

 protected:
  // Returns the memory, or RESOURCE_EXHAUSTED / INTERNAL from the allocator.
  // Never called with bytes == 0.
  virtual absl::StatusOr<void*> RawAllocate(size_t bytes) = 0;
  virtual void RawFree(void* data, size_t bytes) = 0;
  // Runs before a Buffer's memory is returned, outside the space's lock:
  // waits until no queued work can still touch it. Default: nothing.
  virtual void ReleaseFence() {}

 private:
  friend class Buffer;
  void Free(void* data, size_t bytes, LiveSet set);
  absl::Status OutOfMemory(LiveSet set, size_t bytes, absl::string_view why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SpaceKind kind_;
  const std::string name_;
  const int64_t cap_bytes_;
  MemoryTracker tracker_;
  // Makes the cap check and the tracker update one step, so two threads
  // cannot both pass the check and overshoot the cap together.
  absl::Mutex mu_;
};

// Plain aligned heap memory with an optional cap: the CPU backend's device
// arena (its cap is the launch option that plays the GPU's memory size) and
// its host space.
//
// `release_fence` (optional) runs before every free: the CPU backend passes
// one that drains its streams, as cudaFree waits for the device. Contains()
// tells the backend whether a pointer is inside a live allocation (memory it
// may copy asynchronously) or pageable memory of the caller (which it copies
// before Copy returns, as cudaMemcpyAsync does with pageable memory).
//
// Freed blocks are cached for reuse, keyed by their exact size, as a GPU
// framework's caching allocator keeps freed device memory. A training step
// allocates the same buffers every step (at issue 18's shape: 44 dispatch
// buffers of 8, 16, 32 MiB at T = 1024, 2048, 4096), and handing each back
// to the C heap let the heap unmap or trim it, so the next step faulted its
// pages in again, each a zeroed 4 KiB page: up to 8,200 / 41,000 / 360,576
// minor faults per step at those T (all of them at 4096, where every buffer
// is above glibc's largest mmap threshold); 4 / 8 / 16 with the cache.
// A cached block is not live: it is in no live set, not in the tracker, not
// Contains()'d, and the cap is on live bytes as before, so every peak,
// refusal and message is what it was. The cache is bounded by the space's
// own history instead: live + cached bytes never exceed the most bytes the
// space has had live at once, so what the space holds from the heap stays
// within the cap and within any bound its live peaks keep (a plan's total);
// reserved_peak_bytes() reports the most they reached. A request the cache
// cannot serve first evicts cached blocks (the smallest that covers the
// excess, else the largest, repeatedly) when the bound requires it, and
// all of them if the heap refuses.
class HeapSpace final : public MemorySpace {
 public:
  HeapSpace(SpaceKind kind, std::string name, int64_t cap_bytes,
            std::function<void()> release_fence = nullptr)
      : MemorySpace(kind, std::move(name), cap_bytes),
        release_fence_(std::move(release_fence)) {}
  ~HeapSpace() override;  // frees the cached blocks

  // True when [p, p + bytes) lies inside one live allocation of this space.
  bool Contains(const void* p, size_t bytes) const;

  // Bytes of freed blocks kept for reuse (as requested when allocated).
  int64_t cached_bytes() const;
  // Live plus cached bytes: what the space holds from the heap now, and the
  // most it has held at once (never above the most bytes ever live at once:
  // the cache's bound). Alignment padding is not counted, as in the tracker.
  int64_t reserved_bytes() const;
  int64_t reserved_peak_bytes() const;

 protected:
  absl::StatusOr<void*> RawAllocate(size_t bytes) override;
  void RawFree(void* data, size_t bytes) override;
  void ReleaseFence() override {
    if (release_fence_) release_fence_();
  }

 private:
  // Frees cached blocks until at least `bytes` of them are gone (all of
  // them for SIZE_MAX): the smallest block that covers what is left, else
  // the largest, repeatedly.
  void EvictLocked(size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(heap_mu_);

  const std::function<void()> release_fence_;
  mutable absl::Mutex heap_mu_;
  // Live allocations: start address -> requested bytes.
  std::map<uintptr_t, size_t> ranges_ ABSL_GUARDED_BY(heap_mu_);
  // Freed blocks by requested bytes.
  std::multimap<size_t, void*> cache_ ABSL_GUARDED_BY(heap_mu_);
  int64_t live_ ABSL_GUARDED_BY(heap_mu_) = 0;
  int64_t cached_ ABSL_GUARDED_BY(heap_mu_) = 0;
  int64_t live_peak_ ABSL_GUARDED_BY(heap_mu_) = 0;  // never reset: the cache's bound
  int64_t reserved_peak_ ABSL_GUARDED_BY(heap_mu_) = 0;  // max of live_ + cached_
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MEMORY_H_
