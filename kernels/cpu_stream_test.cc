#include "kernels/cpu_stream.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

TEST(CpuStreamTest, RunsInOrder) {
  CpuStream s("compute");
  std::vector<int> order;
  for (int i = 0; i < 100; ++i) {
    s.Enqueue([&order, i] {
      order.push_back(i);
      return absl::OkStatus();
    });
  }
  ASSERT_TRUE(s.Synchronize().ok());
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
}

TEST(CpuStreamTest, TwoStreamsOverlap) {
  // Each stream's task waits until both are running: this only finishes if
  // the two streams really run at the same time.
  CpuStream a("copy"), b("compute");
  std::atomic<int> running{0};
  auto task = [&running] {
    running.fetch_add(1);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (running.load() < 2) {
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError("streams did not overlap");
      }
      std::this_thread::yield();
    }
    return absl::OkStatus();
  };
  a.Enqueue(task);
  b.Enqueue(task);
  EXPECT_TRUE(a.Synchronize().ok());
  EXPECT_TRUE(b.Synchronize().ok());
}

TEST(CpuStreamTest, WaitOrdersAcrossStreams) {
  CpuStream producer("copy"), consumer("compute");
  CpuEvent ready;
  std::atomic<int> value{0};
  int seen = -1;
  producer.Enqueue([&value] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    value.store(42);
    return absl::OkStatus();
  });
  ASSERT_TRUE(producer.Record(ready).ok());
  ASSERT_TRUE(consumer.Wait(ready).ok());
  consumer.Enqueue([&] {
    seen = value.load();
    return absl::OkStatus();
  });
  ASSERT_TRUE(consumer.Synchronize().ok());
  EXPECT_EQ(seen, 42);
  EXPECT_TRUE(ready.Done());
}

TEST(CpuStreamTest, EventCapturesWorkAtRecordTime) {
  CpuStream s("s");
  CpuEvent e;
  EXPECT_TRUE(e.Done());  // never recorded
  std::atomic<bool> release{false};
  s.Enqueue([&release] {
    while (!release.load()) std::this_thread::yield();
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.Record(e).ok());
  EXPECT_FALSE(e.Done());
  release.store(true);
  ASSERT_TRUE(e.Synchronize().ok());
  EXPECT_TRUE(e.Done());
  // Work enqueued after the Record does not hold the event back.
  s.Enqueue([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return absl::OkStatus();
  });
  EXPECT_TRUE(e.Done());
  EXPECT_TRUE(s.Synchronize().ok());
}

TEST(CpuStreamTest, ErrorsAreStickyAndNamed) {
  CpuStream s("copy");
  CpuEvent after;
  int ran = 0;
  s.Enqueue([] { return absl::DataLossError("copy failed"); });
  s.Enqueue([&ran] {
    ++ran;
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.Record(after).ok());
  absl::Status st = s.Synchronize();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(st.message(), HasSubstr("stream 'copy': copy failed"));
  EXPECT_EQ(ran, 0);               // skipped after the failure
  EXPECT_TRUE(after.Done());       // but events still complete
  EXPECT_EQ(s.Synchronize().code(), absl::StatusCode::kDataLoss);
}

TEST(CpuStreamTest, DestructorDrainsQueuedWork) {
  std::atomic<int> ran{0};
  {
    CpuStream s("s");
    for (int i = 0; i < 10; ++i) {
      s.Enqueue([&ran] {
        ran.fetch_add(1);
        return absl::OkStatus();
      });
    }
  }
  EXPECT_EQ(ran.load(), 10);
}

}  // namespace
}  // namespace plateau
