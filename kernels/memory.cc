#include "kernels/memory.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <new>
#include <utility>

#if defined(__SANITIZE_ADDRESS__)
#define PLATEAU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PLATEAU_ASAN 1
#endif
#endif
#ifndef PLATEAU_ASAN
#define PLATEAU_ASAN 0
#endif
#if PLATEAU_ASAN
#include <sanitizer/asan_interface.h>
#endif

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace plateau {
namespace {

constexpr absl::string_view kLiveSetNames[kNumLiveSets] = {
    "weights",     "grads",      "optimizer",   "checkpoints",
    "dispatch",    "projection", "activations", "workspace",
};

// The payload's type URL and its text: "live_set=dispatch space=device
// requested=1024 free=512 cap=4096". Text keeps it readable in a debugger;
// it is parsed only here.
constexpr absl::string_view kOomPayloadUrl = "type.plateau.dev/plateau.OutOfMemoryInfo";

// Under AddressSanitizer (--config=asan) a cached block is poisoned, so that
// code touching a Buffer after releasing it is still reported, as it was
// when every release went back to the heap.
void PoisonCached(void* p, size_t bytes) {
#if PLATEAU_ASAN
  ASAN_POISON_MEMORY_REGION(p, bytes);
#else
  (void)p;
  (void)bytes;
#endif
}
void UnpoisonCached(void* p, size_t bytes) {
#if PLATEAU_ASAN
  ASAN_UNPOISON_MEMORY_REGION(p, bytes);
#else
  (void)p;
  (void)bytes;
#endif
}

// Under AddressSanitizer the bytes an allocation is rounded up to
// (kAlignment) past the size asked for are poisoned too: the heap knows the
// rounded block only, so a kernel writing up to 255 bytes past a small
// buffer (counts, index words, per-token state) passed ASan and every peak
// test, which count the bytes asked for.
void PoisonTail(void* p, size_t bytes, size_t rounded) {
#if PLATEAU_ASAN
  if (rounded > bytes) ASAN_POISON_MEMORY_REGION(static_cast<char*>(p) + bytes, rounded - bytes);
#else
  (void)p;
  (void)bytes;
  (void)rounded;
#endif
}

}  // namespace

void SetOutOfMemoryInfo(absl::Status& status, const OutOfMemoryInfo& info) {
  status.SetPayload(kOomPayloadUrl,
                    absl::Cord(absl::StrCat("live_set=", LiveSetName(info.live_set),
                                            " space=", info.space, " requested=", info.requested,
                                            " free=", info.free, " cap=", info.cap)));
}

std::optional<OutOfMemoryInfo> OutOfMemoryInfoOf(const absl::Status& status) {
  auto payload = status.GetPayload(kOomPayloadUrl);  // absl::optional here
  if (!payload.has_value()) return std::nullopt;
  OutOfMemoryInfo info;
  bool have_set = false;
  for (absl::string_view kv : absl::StrSplit(std::string(*payload), ' ', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
    if (p.first == "live_set") {
      absl::StatusOr<LiveSet> set = ParseLiveSet(p.second);
      if (!set.ok()) return std::nullopt;
      info.live_set = *set;
      have_set = true;
    } else if (p.first == "space") {
      info.space = std::string(p.second);
    } else if (p.first == "requested" || p.first == "free" || p.first == "cap") {
      int64_t v = 0;
      if (!absl::SimpleAtoi(p.second, &v)) return std::nullopt;
      (p.first == "requested" ? info.requested : p.first == "free" ? info.free : info.cap) = v;
    }
  }
  if (!have_set) return std::nullopt;
  return info;
}

absl::string_view LiveSetName(LiveSet set) {
  int i = static_cast<int>(set);
  return (i >= 0 && i < kNumLiveSets) ? kLiveSetNames[i] : "unknown";
}

absl::StatusOr<LiveSet> ParseLiveSet(absl::string_view name) {
  for (int i = 0; i < kNumLiveSets; ++i) {
    if (kLiveSetNames[i] == name) return static_cast<LiveSet>(i);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "live set: unknown name '", name,
      "'; expected one of weights, grads, optimizer, checkpoints, dispatch, "
      "projection, activations, workspace"));
}

absl::string_view SpaceKindName(SpaceKind kind) {
  return kind == SpaceKind::kDevice ? "device" : "host";
}

std::string MemoryStats::DebugString() const {
  std::string out;
  for (int i = 0; i < kNumLiveSets; ++i) {
    if (current[i] == 0 && peak[i] == 0) continue;
    absl::StrAppend(&out, kLiveSetNames[i], "=", current[i], " (peak ",
                    peak[i], "), ");
  }
  absl::StrAppend(&out, "total=", total_current, " (peak ", total_peak, ")");
  return out;
}

// ---------------------------------------------------------------------------
// MemoryTracker

void MemoryTracker::RaiseTo(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen &&
         !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

void MemoryTracker::Add(LiveSet set, int64_t bytes) {
  int i = static_cast<int>(set);
  const int64_t now = current_[i].fetch_add(bytes, std::memory_order_relaxed) + bytes;
  RaiseTo(peak_[i], now);
  RaiseTo(phase_peak_[i], now);
  const int64_t total = total_current_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  RaiseTo(total_peak_, total);
  RaiseTo(total_phase_peak_, total);
}

void MemoryTracker::Sub(LiveSet set, int64_t bytes) {
  current_[static_cast<int>(set)].fetch_sub(bytes, std::memory_order_relaxed);
  total_current_.fetch_sub(bytes, std::memory_order_relaxed);
}

int64_t MemoryTracker::current(LiveSet set) const {
  return current_[static_cast<int>(set)].load(std::memory_order_relaxed);
}
int64_t MemoryTracker::peak(LiveSet set) const {
  return peak_[static_cast<int>(set)].load(std::memory_order_relaxed);
}
int64_t MemoryTracker::total_current() const {
  return total_current_.load(std::memory_order_relaxed);
}
int64_t MemoryTracker::total_peak() const {
  return total_peak_.load(std::memory_order_relaxed);
}

void MemoryTracker::ResetPeaks() {
  for (int i = 0; i < kNumLiveSets; ++i) {
    peak_[i].store(current_[i].load(std::memory_order_relaxed),
                   std::memory_order_relaxed);
  }
  total_peak_.store(total_current_.load(std::memory_order_relaxed),
                    std::memory_order_relaxed);
}

void MemoryTracker::ResetPhasePeaks() {
  for (int i = 0; i < kNumLiveSets; ++i) {
    phase_peak_[i].store(current_[i].load(std::memory_order_relaxed), std::memory_order_relaxed);
  }
  total_phase_peak_.store(total_current_.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

MemoryStats MemoryTracker::TakePhase() {
  MemoryStats s;
  for (int i = 0; i < kNumLiveSets; ++i) {
    s.current[i] = current_[i].load(std::memory_order_relaxed);
    // exchange, then raise again: an Add between the load above and here is
    // counted in this phase's peak (the exchange returns it) and, through
    // the raise, in the next phase's start.
    s.peak[i] = std::max(phase_peak_[i].exchange(s.current[i], std::memory_order_relaxed), s.current[i]);
    RaiseTo(phase_peak_[i], current_[i].load(std::memory_order_relaxed));
  }
  s.total_current = total_current_.load(std::memory_order_relaxed);
  s.total_peak = std::max(total_phase_peak_.exchange(s.total_current, std::memory_order_relaxed), s.total_current);
  RaiseTo(total_phase_peak_, total_current_.load(std::memory_order_relaxed));
  return s;
}

MemoryStats MemoryTracker::Snapshot() const {
  MemoryStats s;
  for (int i = 0; i < kNumLiveSets; ++i) {
    s.current[i] = current_[i].load(std::memory_order_relaxed);
    s.peak[i] = peak_[i].load(std::memory_order_relaxed);
  }
  s.total_current = total_current();
  s.total_peak = total_peak();
  return s;
}

// ---------------------------------------------------------------------------
// Buffer

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    Release();
    space_ = std::exchange(other.space_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    live_set_ = other.live_set_;
  }
  return *this;
}

void Buffer::Release() {
  if (space_ == nullptr) return;
  space_->Free(data_, bytes_, live_set_);
  space_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

// ---------------------------------------------------------------------------
// MemorySpace

MemorySpace::MemorySpace(SpaceKind kind, std::string name, int64_t cap_bytes)
    : kind_(kind), name_(std::move(name)), cap_bytes_(cap_bytes) {}

MemorySpace::~MemorySpace() = default;

absl::Status MemorySpace::OutOfMemory(LiveSet set, size_t bytes,
                                      absl::string_view why) {
  MemoryStats s = tracker_.Snapshot();
  std::string free_text =
      cap_bytes_ == kUncapped
          ? std::string("no cap")
          : absl::StrCat(cap_bytes_ - s.total_current, " bytes free of a ",
                         cap_bytes_, "-byte cap");
  absl::Status status = absl::ResourceExhaustedError(absl::StrFormat(
      "%s out of memory: live set '%s' asked for %d bytes; %s (%s); in use: "
      "%s",
      name_, LiveSetName(set), bytes, free_text, why, s.DebugString()));
  OutOfMemoryInfo info;
  info.live_set = set;
  info.space = name_;
  info.requested = static_cast<int64_t>(std::min<size_t>(bytes, INT64_MAX));
  info.cap = cap_bytes_;
  info.free = cap_bytes_ == kUncapped ? 0 : cap_bytes_ - s.total_current;
  SetOutOfMemoryInfo(status, info);
  return status;
}

absl::StatusOr<Buffer> MemorySpace::Allocate(LiveSet set, size_t bytes) {
  int idx = static_cast<int>(set);
  if (idx < 0 || idx >= kNumLiveSets) {
    return absl::InvalidArgumentError(
        absl::StrCat("Allocate: live set ", idx, " is not a LiveSet value"));
  }
  if (bytes == 0) return Buffer(this, nullptr, 0, set);
  absl::MutexLock lock(&mu_);
  if (bytes > static_cast<size_t>(INT64_MAX / 2)) {
    return OutOfMemory(set, bytes, "larger than any space");
  }
  if (cap_bytes_ != kUncapped &&
      tracker_.total_current() + static_cast<int64_t>(bytes) > cap_bytes_) {
    return OutOfMemory(set, bytes, "over the cap");
  }
  absl::StatusOr<void*> data = RawAllocate(bytes);
  if (!data.ok()) {
    if (absl::IsResourceExhausted(data.status())) {
      return OutOfMemory(set, bytes, data.status().message());
    }
    return data.status();
  }
  tracker_.Add(set, static_cast<int64_t>(bytes));
  return Buffer(this, *data, bytes, set);
}

void MemorySpace::Free(void* data, size_t bytes, LiveSet set) {
  if (bytes == 0) return;
  // Outside the lock: the fence may wait for queued work, and another thread
  // must still be able to allocate meanwhile.
  ReleaseFence();
  absl::MutexLock lock(&mu_);
  RawFree(data, bytes);
  tracker_.Sub(set, static_cast<int64_t>(bytes));
}

// ---------------------------------------------------------------------------
// HeapSpace

HeapSpace::~HeapSpace() {
  absl::MutexLock lock(&heap_mu_);
  EvictLocked(SIZE_MAX);
}

void HeapSpace::EvictLocked(size_t bytes) {
  size_t freed = 0;
  while (freed < bytes && !cache_.empty()) {
    auto it = cache_.lower_bound(bytes - freed);
    if (it == cache_.end()) it = std::prev(cache_.end());
    UnpoisonCached(it->second, it->first);
    std::free(it->second);
    freed += it->first;
    cached_ -= static_cast<int64_t>(it->first);
    cache_.erase(it);
  }
}

absl::StatusOr<void*> HeapSpace::RawAllocate(size_t bytes) {
  absl::MutexLock lock(&heap_mu_);
  const int64_t n = static_cast<int64_t>(bytes);
  void* p = nullptr;
  if (auto hit = cache_.find(bytes); hit != cache_.end()) {
    p = hit->second;
    UnpoisonCached(p, bytes);
    cache_.erase(hit);
    cached_ -= n;
  } else {
    // New memory: first give back whatever cached bytes would take live +
    // cached past the most ever live at once (raised by this request if it
    // goes above it).
    const int64_t bound = std::max(live_peak_, live_ + n);
    if (live_ + cached_ + n > bound) EvictLocked(static_cast<size_t>(live_ + cached_ + n - bound));
    const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    p = std::aligned_alloc(kAlignment, rounded);
    if (p == nullptr && !cache_.empty()) {  // the heap may take the cache back
      EvictLocked(SIZE_MAX);
      p = std::aligned_alloc(kAlignment, rounded);
    }
    if (p == nullptr) {
      return absl::ResourceExhaustedError("the host allocator refused");
    }
    PoisonTail(p, bytes, rounded);  // a cached block's stays poisoned
  }
  live_ += n;
  live_peak_ = std::max(live_peak_, live_);
  // Measured, not derived from the bound, so that tests check the bound.
  reserved_peak_ = std::max(reserved_peak_, live_ + cached_);
  ranges_[reinterpret_cast<uintptr_t>(p)] = bytes;
  return p;
}

void HeapSpace::RawFree(void* data, size_t bytes) {
  absl::MutexLock lock(&heap_mu_);
  ranges_.erase(reinterpret_cast<uintptr_t>(data));
  live_ -= static_cast<int64_t>(bytes);
  // Live + cached is unchanged, so the cache's bound still holds.
  cache_.emplace(bytes, data);
  cached_ += static_cast<int64_t>(bytes);
  reserved_peak_ = std::max(reserved_peak_, live_ + cached_);
  PoisonCached(data, bytes);
}

int64_t HeapSpace::cached_bytes() const {
  absl::MutexLock lock(&heap_mu_);
  return cached_;
}

int64_t HeapSpace::reserved_bytes() const {
  absl::MutexLock lock(&heap_mu_);
  return live_ + cached_;
}

int64_t HeapSpace::reserved_peak_bytes() const {
  absl::MutexLock lock(&heap_mu_);
  return reserved_peak_;
}

bool HeapSpace::Contains(const void* p, size_t bytes) const {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  absl::MutexLock lock(&heap_mu_);
  auto it = ranges_.upper_bound(a);
  if (it == ranges_.begin()) return false;
  --it;  // the last allocation starting at or before p
  const uintptr_t offset = a - it->first;
  return offset <= it->second && bytes <= it->second - offset;
}

}  // namespace plateau
