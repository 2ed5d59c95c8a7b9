// The NCCL communicator through the same conformance suite as Gloo
// (kernels/comm_conformance.h), on device memory and CUDA streams. Needs a
// build with --config=cuda and a visible GPU (two for the two-rank test);
// otherwise the tests skip and say why.
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/comm_conformance.h"
#include "kernels/communicator.h"
#include "kernels/cpu_stream.h"
#include "kernels/kv_store.h"

#ifdef PLATEAU_WITH_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/stream_errors.h"
#endif
#ifdef PLATEAU_CUDA_EMULATED
#include <nccl.h>  // the emulation's, for its test switch
#endif

namespace plateau {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<KeyValueStore> MakeStore(const std::string& name) {
  static std::atomic<int> counter{0};
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/nccl_",
                                 name, "_", ::getpid(), "_", counter++);
  std::filesystem::remove_all(dir);
  auto store = FileStore::Create(dir);
  EXPECT_TRUE(store.ok()) << store.status();
  return std::shared_ptr<KeyValueStore>(std::move(store).value());
}

CommunicatorOptions Options(int rank, int size,
                            std::shared_ptr<KeyValueStore> store,
                            absl::Duration timeout = absl::Seconds(60)) {
  CommunicatorOptions o;
  o.backend = BackendKind::kCuda;
  o.rank = rank;
  o.size = size;
  o.store = std::move(store);
  o.prefix = "nccl_test/attempt0";
  o.timeout = timeout;
  o.device_index = rank;
  return o;
}

#ifndef PLATEAU_WITH_CUDA

TEST(NcclCommunicatorTest, DefaultBuildSaysToRebuildWithCuda) {
  auto comm = CreateCommunicator(Options(0, 1, MakeStore("no_cuda")));
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(comm.status().message()),
              HasSubstr("rebuild with --config=cuda"));
}

TEST(NcclCommunicatorTest, ConformanceSuite) {
  GTEST_SKIP() << "built without --config=cuda: NCCL is not compiled in";
}

#else  // PLATEAU_WITH_CUDA

// Visible GPUs; `why` says what was found when there are none.
int DeviceCount(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    *why = absl::StrCat("cudaGetDeviceCount failed: ", cudaGetErrorName(e),
                        " (", cudaGetErrorString(e), ")");
    return 0;
  }
  *why = absl::StrCat(n, " CUDA device(s) visible");
  return n;
}

#define REQUIRE_GPUS(k)                                                   \
  do {                                                                    \
    std::string why;                                                      \
    if (DeviceCount(&why) < (k)) {                                        \
      GTEST_SKIP() << "needs " << (k) << " GPU(s) for NCCL; " << why;     \
    }                                                                     \
  } while (0)

// A CUDA stream as the CUDA backend would hand out (only what NCCL needs).
class TestCudaStream final : public Stream {
 public:
  explicit TestCudaStream(int device) : device_(device) {
    cudaSetDevice(device_);
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
              cudaSuccess);
  }
  ~TestCudaStream() override { cudaStreamDestroy(stream_); }
  const std::string& name() const override { return name_; }
  absl::Status Record(Event&) override {
    return absl::UnimplementedError("not needed by this test");
  }
  absl::Status Wait(Event&) override {
    return absl::UnimplementedError("not needed by this test");
  }
  // Polls, as the CUDA backend's streams do, so that a collective the
  // watchdog gave up on ends the wait with its status.
  absl::Status Synchronize() override {
    for (;;) {
      absl::Status sticky = CudaStreamError(stream_);
      if (!sticky.ok()) return sticky;
      cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return CudaStreamError(stream_);
      if (e != cudaErrorNotReady) {
        return absl::InternalError(
            absl::StrCat("cudaStreamQuery: ", cudaGetErrorString(e)));
      }
      absl::SleepFor(absl::Microseconds(50));
    }
  }
  void* native_handle() const override { return stream_; }

 private:
  const int device_;
  const std::string name_ = "nccl_test";
  cudaStream_t stream_ = nullptr;
};

// Copies run on the test's own stream (pinned staging is not needed for
// correctness: cudaMemcpyAsync from pageable memory stages it), ordered with
// the collectives instead of racing them on the legacy default stream.
class DeviceMemory final : public conformance::TestMemory {
 public:
  DeviceMemory(int device, cudaStream_t stream)
      : device_(device), stream_(stream) {}
  void* Alloc(size_t bytes) override {
    if (bytes == 0) return nullptr;
    cudaSetDevice(device_);
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    return p;
  }
  void Free(void* p) override {
    if (p == nullptr) return;
    cudaStreamSynchronize(stream_);  // the suite's collectives may read it
    cudaFree(p);
  }
  void CopyIn(void* dst, const void* host, size_t bytes) override {
    if (bytes == 0) return;
    cudaSetDevice(device_);
    EXPECT_EQ(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice,
                              stream_),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  }
  void CopyOut(void* host, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    cudaSetDevice(device_);
    EXPECT_EQ(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost,
                              stream_),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  }

 private:
  const int device_;
  const cudaStream_t stream_;
};

// Runs the suite on `size` ranks (threads), rank r on GPU r.
void RunSuite(int size) {
  auto store = MakeStore(absl::StrCat("suite", size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      cudaSetDevice(r);
      TestCudaStream stream(r);
      DeviceMemory memory(
          r, static_cast<cudaStream_t>(stream.native_handle()));
      auto comm = CreateCommunicator(Options(r, size, store));
      ASSERT_TRUE(comm.ok()) << "rank " << r << ": " << comm.status();
      EXPECT_EQ((*comm)->backend(), BackendKind::kCuda);
      conformance::ConformanceOptions options;
      options.seed = 3;
      for (const std::string& failure :
           conformance::RunConformance(**comm, stream, memory, options)) {
        ADD_FAILURE() << "P=" << size << ": " << failure;
      }
    });
  }
  for (auto& t : threads) t.join();
}

TEST(NcclCommunicatorTest, NoGpuIsAFailedPreconditionNotACrash) {
  std::string why;
  if (DeviceCount(&why) > 0) GTEST_SKIP() << "a GPU is visible: " << why;
  auto comm = CreateCommunicator(Options(0, 1, MakeStore("no_gpu")));
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kFailedPrecondition)
      << comm.status();
  EXPECT_THAT(std::string(comm.status().message()),
              HasSubstr("rendezvous of group 'world' (rank 0 of 1)"));
}

TEST(NcclCommunicatorTest, ConformanceSuite) {
  REQUIRE_GPUS(1);
  RunSuite(1);
}

TEST(NcclCommunicatorTest, ConformanceSuiteOnTwoGpus) {
  REQUIRE_GPUS(2);
  RunSuite(2);
}

TEST(NcclCommunicatorTest, RejectsAStreamWithoutACudaHandle) {
  REQUIRE_GPUS(1);
  auto comm = CreateCommunicator(Options(0, 1, MakeStore("cpu_stream")));
  ASSERT_TRUE(comm.ok()) << comm.status();
  CpuStream cpu("cpu");
  float x = 1.0f;
  absl::Status s = (*comm)->AllReduce(cpu, &x, &x, 1, DataType::kFloat32,
                                      ReduceOp::kSum);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("stream 'cpu' has no CUDA stream handle"));
}

// The unique id travels through the job's store (the coordinator's KV in a
// job, worker/rank_main.cc) under "<prefix>/world/nccl_unique_id": the key
// the other ranks wait for.
TEST(NcclCommunicatorTest, RankZeroPublishesTheUniqueIdUnderTheJobsPrefix) {
  REQUIRE_GPUS(1);
  auto store = MakeStore("publish");
  auto comm = CreateCommunicator(Options(0, 1, store));
  ASSERT_TRUE(comm.ok()) << comm.status();
  absl::StatusOr<std::string> id =
      store->Get("nccl_test/attempt0/world/nccl_unique_id", absl::Seconds(1));
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(id->size(), 128u);  // NCCL_UNIQUE_ID_BYTES
}

TEST(NcclCommunicatorTest, AMissingRankZeroTimesOutNamingTheKey) {
  REQUIRE_GPUS(1);
  // Rank 1 of 2 alone (on GPU 0): rank 0 never publishes the unique id.
  CommunicatorOptions o = Options(1, 2, MakeStore("no_rank0"),
                                  absl::Milliseconds(500));
  o.device_index = 0;
  const absl::Time start = absl::Now();
  auto comm = CreateCommunicator(o);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded)
      << comm.status();
  EXPECT_THAT(std::string(comm.status().message()),
              HasSubstr("nccl_test/attempt0/world/nccl_unique_id"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(NcclCommunicatorTest, AMissingPeerTimesOutInitialisation) {
  REQUIRE_GPUS(1);
  // Rank 0 of 2 alone: it publishes the id, but nobody joins NCCL's init.
  const absl::Time start = absl::Now();
  auto comm = CreateCommunicator(
      Options(0, 2, MakeStore("no_rank1"), absl::Seconds(2)));
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded)
      << comm.status();
  EXPECT_THAT(std::string(comm.status().message()),
              HasSubstr("rendezvous of group 'world' (rank 0 of 2)"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

// Two ranks of one world (threads), rank r on GPU r, each communicator
// with `timeout`; comms[r] stays null if rank r failed (a test failure).
void MakeTwoRanks(const std::string& name, absl::Duration timeout,
                  std::unique_ptr<Communicator> comms[2]) {
  auto store = MakeStore(name);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      CommunicatorOptions o = Options(r, 2, store, timeout);
      o.device_index = r;
      auto comm = CreateCommunicator(o);
      ASSERT_TRUE(comm.ok()) << "rank " << r << ": " << comm.status();
      comms[r] = std::move(*comm);
    });
  }
  for (auto& t : threads) t.join();
}

// `n` zeroed floats on the current device (nullptr on failure).
float* ZeroedFloats(size_t n) {
  float* x = nullptr;
  EXPECT_EQ(cudaMalloc(&x, n * sizeof(float)), cudaSuccess);
  if (x != nullptr) {
    EXPECT_EQ(cudaMemset(x, 0, n * sizeof(float)), cudaSuccess);
  }
  return x;
}

// What the failure tests below share: two ranks of one world
// (MakeTwoRanks), and on GPU 0 a stream and 1024 zeroed floats for rank
// 0's collectives; ready() is false if any of it failed. A test may reset
// a rank's communicator early (a rank that leaves, a destroy under test).
struct TwoRanksOnGpu0 {
  TwoRanksOnGpu0(const std::string& name, absl::Duration timeout) {
    MakeTwoRanks(name, timeout, comms);
    cudaSetDevice(0);
    stream = std::make_unique<TestCudaStream>(0);
    x = ZeroedFloats(kCount);
  }
  ~TwoRanksOnGpu0() {
    comms[0].reset();
    comms[1].reset();
    cudaSetDevice(0);
    cudaFree(x);
  }
  bool ready() const { return comms[0] != nullptr && comms[1] != nullptr && x != nullptr; }
  absl::Status AllReduce() {
    return comms[0]->AllReduce(*stream, x, x, kCount, DataType::kFloat32, ReduceOp::kSum);
  }

  static constexpr size_t kCount = 1024;
  std::unique_ptr<Communicator> comms[2];
  std::unique_ptr<TestCudaStream> stream;
  float* x = nullptr;
};

// The watchdog (issue 17): rank 0 enqueues an all-reduce that rank 1 never
// joins. Synchronize must end with DEADLINE_EXCEEDED about options.timeout
// after the collective started, not hang; the next call fails fast with
// FAILED_PRECONDITION quoting it. Needs two GPUs (NCCL puts one rank per
// GPU).
TEST(NcclCommunicatorTest, WatchdogEndsACollectiveAPeerNeverJoins) {
  REQUIRE_GPUS(2);
  TwoRanksOnGpu0 w("watchdog", absl::Seconds(2));
  ASSERT_TRUE(w.ready());
  const absl::Time start = absl::Now();
  ASSERT_TRUE(w.AllReduce().ok());
  absl::Status s = w.stream->Synchronize();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("all_reduce on group 'world' (rank 0 of 2)"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  absl::Status again = w.AllReduce();
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  EXPECT_THAT(std::string(again.message()), HasSubstr("did not complete"));
}

// A call NCCL never finishes enqueuing (non-blocking: ncclInProgress past
// the deadline; what NCCL 2.22+ does when it connects a peer at a
// collective's first call and the peer never comes) ends the communicator
// at once: DEADLINE_EXCEEDED from the call, its stream failed with the
// same status (NCCL may still put the kernel there; aborting stops that),
// later calls FAILED_PRECONDITION, and the destructors return. The
// emulated NCCL provokes it (plateauEmulatedNcclCallsNeverFinish);
// real NCCL between two GPUs of one process connects at init, so on a GPU
// this skips (device-check filters it, named).
TEST(NcclCommunicatorTest, ACallNcclNeverFinishesEndsTheCommunicatorAndItsStream) {
  REQUIRE_GPUS(2);
#ifndef PLATEAU_CUDA_EMULATED
  GTEST_SKIP() << "needs the emulated NCCL to leave a call in progress";
#else
  TwoRanksOnGpu0 w("never_finishes", absl::Seconds(2));
  ASSERT_TRUE(w.ready());
  const absl::Time start = absl::Now();
  plateauEmulatedNcclCallsNeverFinish(true);
  const absl::Status s = w.AllReduce();
  plateauEmulatedNcclCallsNeverFinish(false);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("all_reduce on group 'world' (rank 0 of 2)"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("did not accept the call"));
  const absl::Status synced = w.stream->Synchronize();
  EXPECT_EQ(synced, s) << "the stream of a call NCCL may still enqueue must fail with it";
  const absl::Status again = w.AllReduce();
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  w.comms[0].reset();
  w.comms[1].reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
#endif
}

// A communicator destroyed while a collective it enqueued cannot finish
// (the peer never joins, and the watchdog's deadline has not come):
// finalize waits out the timeout, then the communicator is aborted, which
// lets the collective's kernel return with garbage. Its stream must fail,
// not synchronise OK.
TEST(NcclCommunicatorTest, DestroyedWithACollectiveInFlightFailsItsStreamOnTwoGpus) {
  REQUIRE_GPUS(2);
  TwoRanksOnGpu0 w("destroyed_in_flight", absl::Seconds(2));
  ASSERT_TRUE(w.ready());
  ASSERT_TRUE(w.AllReduce().ok());
  const absl::Time start = absl::Now();
  w.comms[0].reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  const absl::Status s = w.stream->Synchronize();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("destroyed with collectives that did not finish"));
}

// The watchdog's other way in: rank 0's collective waits for rank 1, which
// leaves (destroys its communicator) without calling it. The failure is
// reported only asynchronously and the collective never returns on its own,
// so the watchdog must see ncclCommGetAsyncError, abort and fail the stream
// well before the deadline — with the asynchronous error, not a timeout.
// The emulated NCCL reports a departed peer so; real NCCL reports peer
// failures through its network transports, which one process cannot
// provoke (between two GPUs of one process the collective just waits, and
// the first watchdog test covers that).
TEST(NcclCommunicatorTest, WatchdogEndsACollectiveWhosePeerFailed) {
  REQUIRE_GPUS(2);
#ifndef PLATEAU_CUDA_EMULATED
  GTEST_SKIP() << "needs an asynchronous NCCL error, which only the emulated "
                  "NCCL can be made to raise in one process";
#endif
  // A long deadline: only the asynchronous error can end the wait soon.
  TwoRanksOnGpu0 w("watchdog_async", absl::Seconds(60));
  ASSERT_TRUE(w.ready());
  const absl::Time start = absl::Now();
  ASSERT_TRUE(w.AllReduce().ok());
  w.comms[1].reset();  // leaves without joining the all-reduce
  absl::Status s = w.stream->Synchronize();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("all_reduce on group 'world' (rank 0 of 2)"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("asynchronous NCCL error"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(30)) << "not the deadline";
  absl::Status again = w.AllReduce();
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
}

#endif  // PLATEAU_WITH_CUDA

}  // namespace
}  // namespace plateau
