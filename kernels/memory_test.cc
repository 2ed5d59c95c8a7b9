#include "kernels/memory.h"

#include <sys/resource.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

#include <cstring>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(LiveSetTest, NamesRoundTrip) {
  for (int i = 0; i < kNumLiveSets; ++i) {
    LiveSet s = static_cast<LiveSet>(i);
    auto parsed = ParseLiveSet(LiveSetName(s));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, s);
  }
  EXPECT_EQ(LiveSetName(LiveSet::kDispatch), "dispatch");
  auto bad = ParseLiveSet("logits");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("'logits'"));
}

TEST(MemoryTrackerTest, CurrentAndPeakPerSetAndTotal) {
  MemoryTracker t;
  t.Add(LiveSet::kWeights, 100);
  t.Add(LiveSet::kDispatch, 50);
  t.Sub(LiveSet::kDispatch, 50);
  t.Add(LiveSet::kProjection, 30);
  EXPECT_EQ(t.current(LiveSet::kWeights), 100);
  EXPECT_EQ(t.current(LiveSet::kDispatch), 0);
  EXPECT_EQ(t.peak(LiveSet::kDispatch), 50);
  EXPECT_EQ(t.current(LiveSet::kProjection), 30);
  EXPECT_EQ(t.total_current(), 130);
  // The total peak is the peak of the sum (150), not the sum of the per-set
  // peaks (180): dispatch and projection never coexisted.
  EXPECT_EQ(t.total_peak(), 150);
}

TEST(MemoryTrackerTest, ResetPeaksStartsANewPhase) {
  MemoryTracker t;
  t.Add(LiveSet::kActivations, 1000);
  t.Sub(LiveSet::kActivations, 900);
  t.ResetPeaks();
  EXPECT_EQ(t.peak(LiveSet::kActivations), 100);
  EXPECT_EQ(t.total_peak(), 100);
  t.Add(LiveSet::kActivations, 50);
  EXPECT_EQ(t.peak(LiveSet::kActivations), 150);
  MemoryStats s = t.Snapshot();
  EXPECT_EQ(s.peak_of(LiveSet::kActivations), 150);
  EXPECT_EQ(s.current_of(LiveSet::kActivations), 150);
  EXPECT_THAT(s.DebugString(), HasSubstr("activations=150 (peak 150)"));
}

TEST(MemoryTrackerTest, ConcurrentUpdatesAreExact) {
  MemoryTracker t;
  constexpr int kThreads = 4, kIters = 20000;
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&t] {
      for (int j = 0; j < kIters; ++j) {
        t.Add(LiveSet::kWorkspace, 8);
        t.Sub(LiveSet::kWorkspace, 8);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(t.current(LiveSet::kWorkspace), 0);
  EXPECT_EQ(t.total_current(), 0);
  EXPECT_GE(t.peak(LiveSet::kWorkspace), 8);
  EXPECT_LE(t.peak(LiveSet::kWorkspace), 8 * kThreads);
}

TEST(HeapSpaceTest, BuffersAreTrackedAndAligned) {
  HeapSpace space(SpaceKind::kDevice, "device", 1 << 20);
  {
    auto a = space.Allocate(LiveSet::kWeights, 1000);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % MemorySpace::kAlignment,
              0u);
    EXPECT_EQ(a->bytes(), 1000u);
    EXPECT_EQ(a->live_set(), LiveSet::kWeights);
    EXPECT_EQ(space.tracker().current(LiveSet::kWeights), 1000);
    Buffer moved = std::move(*a);
    EXPECT_TRUE(a->empty());
    EXPECT_EQ(space.tracker().current(LiveSet::kWeights), 1000);
    moved.Release();
    EXPECT_EQ(space.tracker().current(LiveSet::kWeights), 0);
    auto b = space.Allocate(LiveSet::kGrads, 24);
    ASSERT_TRUE(b.ok());
    static_cast<float*>(b->data())[5] = 1.0f;  // usable memory
  }
  EXPECT_EQ(space.tracker().total_current(), 0);
  EXPECT_EQ(space.tracker().total_peak(), 1000);
}

#if defined(__SANITIZE_ADDRESS__)
// Under ASan the tail a block is rounded up to is poisoned, fresh or
// reused from the cache: a write of a few bytes past a small buffer was
// inside the heap's (rounded) block and passed unseen.
TEST(HeapSpaceTest, TheRoundedTailIsPoisonedUnderAsan) {
  HeapSpace space(SpaceKind::kHost, "host", MemorySpace::kUncapped);
  for (int round = 0; round < 2; ++round) {  // the second reuses the cached block
    auto a = space.Allocate(LiveSet::kDispatch, 10);
    ASSERT_TRUE(a.ok()) << a.status();
    const char* p = static_cast<const char*>(a->data());
    EXPECT_FALSE(__asan_address_is_poisoned(p + 9)) << "round " << round;
    EXPECT_TRUE(__asan_address_is_poisoned(p + 10)) << "round " << round;
    EXPECT_TRUE(__asan_address_is_poisoned(p + MemorySpace::kAlignment - 1)) << "round " << round;
  }
}
#endif

TEST(HeapSpaceTest, ZeroBytesIsAnEmptyBuffer) {
  HeapSpace space(SpaceKind::kHost, "host", MemorySpace::kUncapped);
  auto a = space.Allocate(LiveSet::kCheckpoints, 0);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->data(), nullptr);
  EXPECT_EQ(space.tracker().total_peak(), 0);
}

TEST(HeapSpaceTest, CapRefusalNamesLiveSetBytesAndFree) {
  HeapSpace space(SpaceKind::kDevice, "device", 4096);
  auto w = space.Allocate(LiveSet::kWeights, 3000);
  ASSERT_TRUE(w.ok());
  auto d = space.Allocate(LiveSet::kDispatch, 2000);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(d.status().message(),
              AllOf(HasSubstr("device out of memory"),
                    HasSubstr("live set 'dispatch'"),
                    HasSubstr("asked for 2000 bytes"),
                    HasSubstr("1096 bytes free of a 4096-byte cap"),
                    HasSubstr("weights=3000")));
  // The refusal changed nothing, and what fits still fits, to the byte.
  EXPECT_EQ(space.tracker().total_current(), 3000);
  EXPECT_EQ(space.tracker().peak(LiveSet::kDispatch), 0);
  auto exact = space.Allocate(LiveSet::kDispatch, 1096);
  EXPECT_TRUE(exact.ok()) << exact.status();
  EXPECT_EQ(space.tracker().total_peak(), 4096);
}

TEST(HeapSpaceTest, CapRefusalCarriesTheLiveSetAndBytesAsData) {
  HeapSpace space(SpaceKind::kDevice, "device", 4096);
  auto w = space.Allocate(LiveSet::kWeights, 3000);
  ASSERT_TRUE(w.ok());
  auto d = space.Allocate(LiveSet::kDispatch, 2000);
  ASSERT_FALSE(d.ok());
  auto info = OutOfMemoryInfoOf(d.status());
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->live_set, LiveSet::kDispatch);
  EXPECT_EQ(info->space, "device");
  EXPECT_EQ(info->requested, 2000);
  EXPECT_EQ(info->free, 1096);
  EXPECT_EQ(info->cap, 4096);
  // A copy of the status (as PLATEAU_RETURN_IF_ERROR passes it up) keeps it;
  // a status that is not an out-of-memory has none.
  absl::Status copy = d.status();
  EXPECT_EQ(OutOfMemoryInfoOf(copy)->requested, 2000);
  EXPECT_FALSE(OutOfMemoryInfoOf(absl::ResourceExhaustedError("other")).has_value());
  EXPECT_FALSE(OutOfMemoryInfoOf(absl::OkStatus()).has_value());
}

TEST(HeapSpaceTest, ContainsOnlyLiveAllocations) {
  HeapSpace space(SpaceKind::kHost, "host", 0);
  auto b = space.Allocate(LiveSet::kCheckpoints, 1000);
  ASSERT_TRUE(b.ok());
  const char* p = b->as<char>();
  EXPECT_TRUE(space.Contains(p, 1000));
  EXPECT_TRUE(space.Contains(p + 999, 1));
  EXPECT_FALSE(space.Contains(p + 1, 1000));  // runs past the end
  EXPECT_FALSE(space.Contains(p - 1, 1));
  int on_stack = 0;
  EXPECT_FALSE(space.Contains(&on_stack, sizeof(on_stack)));
  b->Release();
  EXPECT_FALSE(space.Contains(p, 1));
}

TEST(HeapSpaceTest, ReleaseFenceRunsBeforeTheMemoryIsFreed) {
  int fences = 0;
  int64_t held_during_fence = -1;
  HeapSpace* self = nullptr;
  HeapSpace space(SpaceKind::kDevice, "device", 4096, [&] {
    ++fences;
    held_during_fence = self->tracker().total_current();
  });
  self = &space;
  auto b = space.Allocate(LiveSet::kDispatch, 512);
  ASSERT_TRUE(b.ok());
  b->Release();
  EXPECT_EQ(fences, 1);
  // Still charged while the fence waits: the bytes are not reusable yet.
  EXPECT_EQ(held_during_fence, 512);
  EXPECT_EQ(space.tracker().total_current(), 0);
}

TEST(HeapSpaceTest, AbsurdSizeIsAnErrorNotACrash) {
  HeapSpace host(SpaceKind::kHost, "host", MemorySpace::kUncapped);
  auto a = host.Allocate(LiveSet::kOptimizer, ~size_t{0});
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(a.status().message(), HasSubstr("live set 'optimizer'"));
  EXPECT_EQ(host.tracker().total_current(), 0);
}

TEST(HeapSpaceTest, BadLiveSetIsInvalidArgument) {
  HeapSpace space(SpaceKind::kDevice, "device", 4096);
  auto a = space.Allocate(static_cast<LiveSet>(42), 8);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(HeapSpaceTest, ConcurrentAllocationsNeverOvershootTheCap) {
  constexpr int64_t kCap = 64 * 1024;
  HeapSpace space(SpaceKind::kDevice, "device", kCap);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&space] {
      for (int j = 0; j < 2000; ++j) {
        auto b = space.Allocate(LiveSet::kActivations, 20000);  // 4 x 20000 > cap
        if (b.ok()) std::this_thread::yield();
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_LE(space.tracker().total_peak(), kCap);
  EXPECT_EQ(space.tracker().total_current(), 0);
}

int64_t MinorFaults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// A released block comes back for the next request of its size: the same
// memory, no pages faulted in again. 64 MiB is above glibc's largest mmap
// threshold (32 MiB), so without the cache the heap unmaps it on free and
// maps fresh zero pages for the next allocation: 16,384 faults.
TEST(HeapSpaceTest, ReleasedBlocksAreReusedWithoutFaultingAgain) {
  constexpr size_t kBytes = 64 << 20;
  HeapSpace space(SpaceKind::kDevice, "device", 128 << 20);
  void* first = nullptr;
  {
    auto a = space.Allocate(LiveSet::kProjection, kBytes);
    ASSERT_TRUE(a.ok()) << a.status();
    std::memset(a->data(), 1, kBytes);
    first = a->data();
  }
  EXPECT_EQ(space.cached_bytes(), static_cast<int64_t>(kBytes));
  EXPECT_FALSE(space.Contains(first, 1));  // cached is not live
  EXPECT_EQ(space.tracker().total_current(), 0);
  const int64_t faults_before = MinorFaults();
  auto b = space.Allocate(LiveSet::kDispatch, kBytes);  // any live set
  ASSERT_TRUE(b.ok()) << b.status();
  std::memset(b->data(), 2, kBytes);
  const int64_t faults = MinorFaults() - faults_before;
  EXPECT_EQ(b->data(), first);
  EXPECT_TRUE(space.Contains(first, kBytes));
  EXPECT_LT(faults, static_cast<int64_t>(kBytes / 4096 / 4));
  EXPECT_EQ(space.cached_bytes(), 0);
  EXPECT_EQ(space.tracker().current(LiveSet::kDispatch), static_cast<int64_t>(kBytes));
  EXPECT_EQ(space.tracker().peak(LiveSet::kProjection), static_cast<int64_t>(kBytes));
}

// Live + cached bytes never exceed the most ever live at once, so under a
// cap the cache never holds what the cap does not allow; a request that
// fits the cap is never refused because of the cache.
TEST(HeapSpaceTest, CacheStaysWithinTheMostEverLive) {
  HeapSpace space(SpaceKind::kDevice, "device", 4096);
  auto a = space.Allocate(LiveSet::kWeights, 3000);
  ASSERT_TRUE(a.ok());
  a->Release();
  EXPECT_EQ(space.cached_bytes(), 3000);
  EXPECT_EQ(space.reserved_bytes(), 3000);
  // Another size: 2000 live + 3000 cached would pass 3000, so the cached
  // block goes.
  auto b = space.Allocate(LiveSet::kDispatch, 2000);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(space.cached_bytes(), 0);
  EXPECT_EQ(space.reserved_bytes(), 2000);
  auto c = space.Allocate(LiveSet::kDispatch, 2000);
  ASSERT_TRUE(c.ok()) << c.status();
  b->Release();
  c->Release();
  EXPECT_EQ(space.cached_bytes(), 4000);
  EXPECT_EQ(space.reserved_peak_bytes(), 4000);
  // The whole cap in one request: allowed (the cap is on live bytes), and
  // both cached blocks go first.
  auto d = space.Allocate(LiveSet::kActivations, 4096);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(space.cached_bytes(), 0);
  EXPECT_EQ(space.reserved_bytes(), 4096);
  EXPECT_EQ(space.reserved_peak_bytes(), 4096);
  // The tracker saw live bytes only, as without the cache.
  EXPECT_EQ(space.tracker().total_peak(), 4096);
  EXPECT_EQ(space.tracker().peak(LiveSet::kDispatch), 4000);
  EXPECT_EQ(space.tracker().current(LiveSet::kWeights), 0);
}

// A miss evicts the smallest cached block that covers what the bound
// needs, not the first or the largest; the others stay for their sizes.
TEST(HeapSpaceTest, AMissEvictsTheSmallestBlockThatCovers) {
  HeapSpace space(SpaceKind::kHost, "host", MemorySpace::kUncapped);
  {
    auto a = space.Allocate(LiveSet::kWorkspace, 1000);
    auto b = space.Allocate(LiveSet::kWorkspace, 3000);
    auto c = space.Allocate(LiveSet::kWorkspace, 5000);
    ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  }
  EXPECT_EQ(space.cached_bytes(), 9000);
  // 4000 new + 9000 cached passes 9000 by 4000: the 5000 block goes.
  auto d = space.Allocate(LiveSet::kWorkspace, 4000);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(space.cached_bytes(), 4000);
  EXPECT_EQ(space.reserved_bytes(), 8000);
  auto e = space.Allocate(LiveSet::kWorkspace, 3000);  // a hit
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(space.cached_bytes(), 1000);
  EXPECT_EQ(space.reserved_bytes(), 8000);
  EXPECT_EQ(space.reserved_peak_bytes(), 9000);
}

}  // namespace
}  // namespace plateau
