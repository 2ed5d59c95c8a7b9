#include "kernels/memory.h"

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

}  // namespace
}  // namespace plateau
