// The CPU backend's ordering guarantees that mirror CUDA's and make error
// paths safe by construction (issue 10): memory freed while a stream still
// has queued work waits for that work (cudaFree waits for the device), and a
// copy from or to the caller's own memory is done when Copy returns
// (cudaMemcpyAsync with pageable memory). Each test fails without its rule.
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu_stream.h"

namespace plateau {
namespace {

std::unique_ptr<Backend> MakeBackend() {
  BackendOptions o;
  o.kind = BackendKind::kCpu;
  o.device_memory_bytes = 1 << 20;
  auto b = Backend::Create(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return std::move(*b);
}

// Holds a stream busy for `ms`, then runs `after` on it.
void BusyThen(Stream& s, int ms, std::function<void()> after) {
  static_cast<CpuStream&>(s).Enqueue([ms, after] {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    after();
    return absl::OkStatus();
  });
}

TEST(CpuBackendTest, ReleaseWaitsForQueuedWorkOnEveryStream) {
  auto be = MakeBackend();
  auto compute = be->CreateStream("compute");
  auto comm = be->CreateStream("comm");
  ASSERT_TRUE(compute.ok() && comm.ok());
  auto buf = be->device().Allocate(LiveSet::kDispatch, 4096);
  ASSERT_TRUE(buf.ok());
  std::atomic<bool> wrote{false};
  char* p = buf->as<char>();
  // As a collective queued on the comm stream writes into a receive buffer
  // that an error path on the host drops.
  BusyThen(**comm, 200, [p, &wrote] {
    std::memset(p, 7, 4096);
    wrote = true;
  });
  buf->Release();
  EXPECT_TRUE(wrote.load()) << "the memory was freed before the queued write ran";
  EXPECT_EQ(be->device().tracker().total_current(), 0);
}

TEST(CpuBackendTest, ReleaseAfterAFailedStreamStillReturns) {
  auto be = MakeBackend();
  auto s = be->CreateStream("comm");
  ASSERT_TRUE(s.ok());
  auto buf = be->device().Allocate(LiveSet::kDispatch, 64);
  ASSERT_TRUE(buf.ok());
  static_cast<CpuStream&>(**s).Enqueue([] { return absl::DeadlineExceededError("peer gone"); });
  BusyThen(**s, 10, [] {});  // skipped: the stream has failed
  buf->Release();            // returns: a failed stream skips, never hangs
  EXPECT_EQ(be->device().tracker().total_current(), 0);
  EXPECT_EQ((*s)->Synchronize().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(CpuBackendTest, CopyFromCallerMemoryIsDoneWhenCopyReturns) {
  auto be = MakeBackend();
  auto s = be->CreateStream("compute");
  ASSERT_TRUE(s.ok());
  auto dev = be->device().Allocate(LiveSet::kActivations, 256 * sizeof(float));
  ASSERT_TRUE(dev.ok());
  std::vector<float> host(256, 1.5f);
  BusyThen(**s, 100, [] {});  // the copy queues behind this
  ASSERT_TRUE(be->Copy(**s, dev->data(), host.data(), dev->bytes()).ok());
  std::fill(host.begin(), host.end(), -1.0f);  // as if the vector were freed
  ASSERT_TRUE((*s)->Synchronize().ok());
  for (int i = 0; i < 256; ++i) ASSERT_EQ(dev->as<float>()[i], 1.5f) << i;
}

TEST(CpuBackendTest, CopyIntoCallerMemoryIsDoneWhenCopyReturns) {
  auto be = MakeBackend();
  auto s = be->CreateStream("compute");
  ASSERT_TRUE(s.ok());
  auto dev = be->device().Allocate(LiveSet::kActivations, 64 * sizeof(float));
  ASSERT_TRUE(dev.ok());
  ASSERT_TRUE(be->Fill(**s, dev->as<float>(), 64, 2.5f).ok());
  float host[64] = {};
  BusyThen(**s, 100, [] {});
  ASSERT_TRUE(be->Copy(**s, host, dev->data(), sizeof(host)).ok());
  for (float v : host) ASSERT_EQ(v, 2.5f);
}

TEST(CpuBackendTest, CopyBetweenSpacesStaysAsynchronous) {
  auto be = MakeBackend();
  auto s = be->CreateStream("copy");
  ASSERT_TRUE(s.ok());
  auto dev = be->device().Allocate(LiveSet::kCheckpoints, 1024);
  auto host = be->host().Allocate(LiveSet::kCheckpoints, 1024);
  ASSERT_TRUE(dev.ok() && host.ok());
  std::atomic<bool> released{false};
  BusyThen(**s, 300, [&released] { released = true; });
  ASSERT_TRUE(be->Copy(**s, host->data(), dev->data(), 1024).ok());
  // Copy returned while the stream was still busy: it did not wait.
  EXPECT_FALSE(released.load());
  ASSERT_TRUE((*s)->Synchronize().ok());
}

}  // namespace
}  // namespace plateau
