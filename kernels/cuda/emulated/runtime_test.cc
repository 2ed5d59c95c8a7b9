// The emulated CUDA runtime keeps the promises the GPU twin tests rely on
// when they run under --config=cuda_emulated: work runs in stream order
// and only when the host synchronises (so a missing synchronisation or a
// missing event wait shows), launches are checked as CUDA checks them, a
// failed kernel is a sticky fault, and kernels run on the SIMT emulation
// (threads, barriers, shared memory).
#include <sys/wait.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/emulated/cuda_runtime_api.h"
#include "kernels/cuda/emulated/emulation.h"

namespace {

// Two emulated GPUs, set before the runtime's first call reads it.
const bool kTwoGpus = setenv("PLATEAU_EMULATED_GPUS", "2", 1) == 0;

// Each thread writes its index into shared memory, then (after the barrier)
// reads its neighbour's and adds it to out: without the barrier, a thread
// would read a slot its neighbour has not written yet (NaN).
__global__ void NeighbourSum(float* out, int with_barrier) {
  PLATEAU_DYNAMIC_SHARED(float, slots);
  const int t = threadIdx.x, n = blockDim.x;
  slots[t] = static_cast<float>(t);
  if (with_barrier) __syncthreads();
  out[blockIdx.x * n + t] = slots[t] + slots[(t + 1) % n];
}

// Only asked about (the occupancy test), never launched: its own kernel, so
// the shared-memory opt-in it sets touches no other test.
__global__ void Unlaunched(float* out) { out[threadIdx.x] = 0.0f; }

__global__ void Scale(float* x, int64_t n, float factor) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    x[i] *= factor;
  }
}

__global__ void Deadlock(int* unused) {
  if (threadIdx.x == 0) __syncthreads();  // the other threads never arrive
  (void)unused;
}

__global__ void StaticSharedSum(float* out) {
  PLATEAU_SHARED_ARRAY(float, partial, 64);
  partial[threadIdx.x] = 1.0f + threadIdx.x;
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0;
    for (int i = 0; i < 64; ++i) sum += partial[i];
    out[blockIdx.x] = sum;
  }
}

__global__ void TooMuchSharedMemory(float* out) {
  PLATEAU_SHARED_ARRAY(float, big, 10000);  // 40000 bytes, plus the dynamic
  big[threadIdx.x] = 1.0f;
  out[threadIdx.x] = big[threadIdx.x];
}

// Writes x[i] (i may lie outside x's allocation).
__global__ void WriteAt(float* x, int i) {
  if (threadIdx.x == 0) x[i] = 1.0f;
}

class EmulatedRuntimeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&a_, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&b_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    cudaStreamDestroy(a_);
    cudaStreamDestroy(b_);
  }
  cudaStream_t a_ = nullptr, b_ = nullptr;
};

TEST_F(EmulatedRuntimeTest, WorkRunsWhenTheHostSynchronises) {
  float* pinned = nullptr;
  float* device = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&pinned), 4 * sizeof(float), 0), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&device), 4 * sizeof(float)), cudaSuccess);
  for (int i = 0; i < 4; ++i) pinned[i] = 1.0f + i;
  ASSERT_EQ(cudaMemcpyAsync(device, pinned, 4 * sizeof(float), cudaMemcpyDefault, a_),
            cudaSuccess);
  PLATEAU_KERNEL_LAUNCH(1, 32, 0, a_, Scale)(device, int64_t{4}, 2.0f);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(pinned, device, 4 * sizeof(float), cudaMemcpyDefault, a_),
            cudaSuccess);
  // Not synchronised: the host still sees what it wrote.
  EXPECT_EQ(pinned[3], 4.0f);
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  EXPECT_EQ(pinned[0], 2.0f);
  EXPECT_EQ(pinned[3], 8.0f);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
}

TEST_F(EmulatedRuntimeTest, AnEventWaitOrdersTwoStreams) {
  float* device = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&device), sizeof(float)), cudaSuccess);
  float one = 1.0f, out = 0.0f;
  ASSERT_EQ(cudaMemcpy(device, &one, sizeof(float), cudaMemcpyDefault), cudaSuccess);
  cudaEvent_t scaled;
  ASSERT_EQ(cudaEventCreateWithFlags(&scaled, cudaEventDisableTiming), cudaSuccess);

  // With the wait: b's x3 runs after a's x2 whichever stream the host
  // synchronises first.
  PLATEAU_KERNEL_LAUNCH(1, 32, 0, a_, Scale)(device, int64_t{1}, 2.0f);
  ASSERT_EQ(cudaEventRecord(scaled, a_), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(b_, scaled, 0), cudaSuccess);
  PLATEAU_KERNEL_LAUNCH(1, 32, 0, b_, Scale)(device, int64_t{1}, 3.0f);
  ASSERT_EQ(cudaStreamSynchronize(b_), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&out, device, sizeof(float), cudaMemcpyDefault), cudaSuccess);
  EXPECT_EQ(out, 6.0f);
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);

  // Without it, synchronising b runs b's work alone: a's x2 is still queued.
  ASSERT_EQ(cudaMemcpy(device, &one, sizeof(float), cudaMemcpyDefault), cudaSuccess);
  PLATEAU_KERNEL_LAUNCH(1, 32, 0, a_, Scale)(device, int64_t{1}, 2.0f);
  PLATEAU_KERNEL_LAUNCH(1, 32, 0, b_, Scale)(device, int64_t{1}, 3.0f);
  ASSERT_EQ(cudaStreamSynchronize(b_), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&out, device, sizeof(float), cudaMemcpyDefault), cudaSuccess);
  EXPECT_EQ(out, 3.0f) << "b ran before a's queued work";
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(scaled), cudaSuccess);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
}

// Timing events (the phase clock's, kernels/phase_clock.h) as CUDA's: a
// point recorded on an idle stream has run at once; one queued behind work
// is not ready until the work has run; events made without timing, or never
// recorded, are invalid handles to cudaEventElapsedTime.
TEST_F(EmulatedRuntimeTest, TimingEventsAreStampedWhenTheirPointRuns) {
  float* device = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&device), sizeof(float)), cudaSuccess);
  cudaEvent_t start, end, plain, never;
  ASSERT_EQ(cudaEventCreate(&start), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&end, cudaEventDefault), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&plain, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&never), cudaSuccess);
  float ms = -1.0f;

  ASSERT_EQ(cudaEventRecord(start, a_), cudaSuccess);
  ASSERT_EQ(cudaEventElapsedTime(&ms, start, start), cudaSuccess) << "an idle stream's point";
  EXPECT_EQ(ms, 0.0f);
  PLATEAU_KERNEL_LAUNCH(1, 32, 0, a_, Scale)(device, int64_t{1}, 2.0f);
  ASSERT_EQ(cudaEventRecord(end, a_), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(plain, a_), cudaSuccess);
  EXPECT_EQ(cudaEventElapsedTime(&ms, start, end), cudaErrorNotReady) << "queued behind a kernel";
  ms = -1.0f;
  ASSERT_EQ(cudaEventElapsedTime(&ms, start, end), cudaSuccess);
  EXPECT_GE(ms, 0.0f);
  EXPECT_EQ(cudaEventElapsedTime(&ms, plain, end), cudaErrorInvalidResourceHandle);
  EXPECT_EQ(cudaEventElapsedTime(&ms, start, never), cudaErrorInvalidResourceHandle);
  EXPECT_EQ(cudaEventElapsedTime(nullptr, start, end), cudaErrorInvalidValue);
  (void)cudaGetLastError();
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  for (cudaEvent_t e : {start, end, plain, never}) EXPECT_EQ(cudaEventDestroy(e), cudaSuccess);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
}

TEST_F(EmulatedRuntimeTest, KernelsRunOnTheSimtEmulation) {
  float* device = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&device), 2 * 64 * sizeof(float)), cudaSuccess);
  PLATEAU_KERNEL_LAUNCH(2, 64, 64 * sizeof(float), a_, NeighbourSum)(device, 1);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> out(128);
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(out.data(), device, out.size() * sizeof(float), cudaMemcpyDefault),
            cudaSuccess);
  for (int b = 0; b < 2; ++b) {
    for (int t = 0; t < 64; ++t) EXPECT_EQ(out[b * 64 + t], t + (t + 1) % 64) << b << " " << t;
  }

  PLATEAU_KERNEL_LAUNCH(3, 64, 0, a_, StaticSharedSum)(device);
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(out.data(), device, 3 * sizeof(float), cudaMemcpyDefault), cudaSuccess);
  for (int b = 0; b < 3; ++b) EXPECT_EQ(out[b], 64.0f * 65.0f / 2.0f);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
}

TEST_F(EmulatedRuntimeTest, AMissingBarrierReadsUnwrittenSharedMemory) {
  float* device = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&device), 64 * sizeof(float)), cudaSuccess);
  PLATEAU_KERNEL_LAUNCH(1, 64, 64 * sizeof(float), a_, NeighbourSum)(device, 0);
  std::vector<float> out(64);
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(out.data(), device, out.size() * sizeof(float), cudaMemcpyDefault),
            cudaSuccess);
  int nan = 0;
  for (float v : out) nan += v != v;
  EXPECT_GT(nan, 0) << "every thread ran to the end before its neighbour started";
  EXPECT_EQ(cudaFree(device), cudaSuccess);
}

TEST_F(EmulatedRuntimeTest, LaunchesAreCheckedAsCudaChecksThem) {
  float* device = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&device), 64 * sizeof(float)), cudaSuccess);
  PLATEAU_KERNEL_LAUNCH(1, 2048, 0, a_, NeighbourSum)(device, 1);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "not sticky";
  PLATEAU_KERNEL_LAUNCH(dim3(1, 70000), 64, 0, a_, NeighbourSum)(device, 1);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  // Past 48 KiB of dynamic shared memory only after opting in.
  const void* kernel = reinterpret_cast<const void*>(&NeighbourSum);
  PLATEAU_KERNEL_LAUNCH(1, 64, 64 << 10, a_, NeighbourSum)(device, 1);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 300 << 10),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue) << "past sm_90's 227 KiB";
  ASSERT_EQ(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 << 10),
            cudaSuccess);
  PLATEAU_KERNEL_LAUNCH(1, 64, 64 << 10, a_, NeighbourSum)(device, 1);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
}

// An sm_90's multiprocessor, registers taken at 255 a thread: 2 blocks of
// 128 threads by registers, fewer by shared memory past ~113 KiB a block,
// none past the kernel's opt-in (what the tensor-core attention kernels'
// choice of buffering asks).
TEST_F(EmulatedRuntimeTest, OccupancyCountsSharedMemoryThreadsAndRegisters) {
  const void* kernel = reinterpret_cast<const void*>(&Unlaunched);
  ASSERT_EQ(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 150 << 10),
            cudaSuccess);
  int blocks = -1;
  ASSERT_EQ(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, 128, 0), cudaSuccess);
  EXPECT_EQ(blocks, 2) << "registers";
  ASSERT_EQ(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, 32, 0), cudaSuccess);
  EXPECT_EQ(blocks, 8) << "registers of one warp a block";
  ASSERT_EQ(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, 128, 105472),
            cudaSuccess);
  EXPECT_EQ(blocks, 2) << "228 KiB over 104 KiB";
  ASSERT_EQ(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, 128, 120 << 10),
            cudaSuccess);
  EXPECT_EQ(blocks, 1) << "228 KiB over 121 KiB";
  ASSERT_EQ(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, 128, 151 << 10),
            cudaSuccess);
  EXPECT_EQ(blocks, 0) << "past the kernel's opt-in";
  EXPECT_EQ(cudaOccupancyMaxActiveBlocksPerMultiprocessor(nullptr, kernel, 128, 0),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, 2048, 0),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
}

TEST_F(EmulatedRuntimeTest, MemoryIsCountedAndRefusedPastTheDevice) {
  size_t free_before = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 1 << 20), cudaSuccess);
  size_t free_after = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  EXPECT_EQ(free_before - free_after, size_t{1} << 20);
  void* q = nullptr;
  EXPECT_EQ(cudaMalloc(&q, total), cudaErrorMemoryAllocation);
  EXPECT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation);
  cudaPointerAttributes attr;
  ASSERT_EQ(cudaPointerGetAttributes(&attr, static_cast<char*>(p) + 100), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
  int local = 0;
  ASSERT_EQ(cudaPointerGetAttributes(&attr, &local), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeUnregistered);
  EXPECT_EQ(cudaFree(p), cudaSuccess);
  EXPECT_EQ(cudaFree(p), cudaErrorInvalidDevicePointer) << "a second free";
  (void)cudaGetLastError();
}

TEST_F(EmulatedRuntimeTest, StreamsEventsAndOptInsBelongToOneDevice) {
  ASSERT_TRUE(kTwoGpus);
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  ASSERT_EQ(count, 2);
  float* device = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&device), 64 * sizeof(float)), cudaSuccess);
  const void* kernel = reinterpret_cast<const void*>(&NeighbourSum);
  ASSERT_EQ(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 << 10),
            cudaSuccess);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  // a_ is device 0's: a launch onto it from device 1 is refused.
  PLATEAU_KERNEL_LAUNCH(1, 64, 256, a_, NeighbourSum)(device, 1);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidResourceHandle);
  cudaEvent_t on_one;
  ASSERT_EQ(cudaEventCreateWithFlags(&on_one, cudaEventDisableTiming), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(on_one, a_), cudaErrorInvalidResourceHandle);
  (void)cudaGetLastError();
  // Device 0's opt-in does not carry over to device 1.
  cudaStream_t c = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking), cudaSuccess);
  PLATEAU_KERNEL_LAUNCH(1, 64, 64 << 10, c, NeighbourSum)(device, 1);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaStreamDestroy(c), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(on_one), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
}

TEST_F(EmulatedRuntimeTest, ASecondAsyncFreeIsRefused) {
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 100), cudaSuccess);
  EXPECT_EQ(cudaFreeAsync(p, a_), cudaSuccess);
  EXPECT_EQ(cudaFreeAsync(p, a_), cudaErrorInvalidDevicePointer);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidDevicePointer);
  EXPECT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
}

// External work (the emulated NCCL's collectives on a non-blocking
// communicator) runs on another thread; its stream waits for it.
TEST_F(EmulatedRuntimeTest, ExternalWorkBlocksItsStreamUntilDone) {
  float* device = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&device), sizeof(float)), cudaSuccess);
  const float one = 1.0f;
  ASSERT_EQ(cudaMemcpy(device, &one, sizeof(float), cudaMemcpyDefault), cudaSuccess);
  PLATEAU_KERNEL_LAUNCH(1, 32, 0, a_, Scale)(device, int64_t{1}, 2.0f);
  std::mutex mu;
  std::vector<std::function<void()>> dones;  // guarded by mu
  auto external = [&](std::function<void()> done) {
    std::lock_guard<std::mutex> lock(mu);
    dones.push_back(std::move(done));
    return true;
  };
  auto started = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return dones.size();
  };
  ASSERT_EQ(plateau::cuda_emulation::EnqueueExternal(a_, external), cudaSuccess);
  // Started at once: the work ahead of it ran (x2), the work after waits.
  EXPECT_EQ(started(), 1u);
  PLATEAU_KERNEL_LAUNCH(1, 32, 0, a_, Scale)(device, int64_t{1}, 3.0f);
  ASSERT_EQ(plateau::cuda_emulation::EnqueueExternal(a_, external), cudaSuccess);
  PLATEAU_KERNEL_LAUNCH(1, 32, 0, a_, Scale)(device, int64_t{1}, 5.0f);
  EXPECT_EQ(*device, 2.0f);
  EXPECT_EQ(started(), 1u) << "the second waits behind the first";
  for (int i = 0; i < 2; ++i) EXPECT_EQ(cudaStreamQuery(a_), cudaErrorNotReady);
  cudaEvent_t after;
  ASSERT_EQ(cudaEventCreateWithFlags(&after, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(after, a_), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(after), cudaErrorNotReady);
  // Finishing the first starts the second with no host call (its x3 runs
  // ahead of it); a device-wide wait (cudaFree) waits for both.
  float* scratch = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&scratch), sizeof(float)), cudaSuccess);
  const auto start = std::chrono::steady_clock::now();
  std::thread other([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::function<void()> first;
    {
      std::lock_guard<std::mutex> lock(mu);
      first = dones[0];
    }
    first();
    EXPECT_EQ(started(), 2u);
    EXPECT_EQ(*device, 6.0f);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::function<void()> second;
    {
      std::lock_guard<std::mutex> lock(mu);
      second = dones[1];
    }
    second();
  });
  EXPECT_EQ(cudaFree(scratch), cudaSuccess);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(90));
  other.join();
  EXPECT_EQ(*device, 30.0f);
  EXPECT_EQ(cudaEventQuery(after), cudaSuccess);
  EXPECT_EQ(cudaStreamQuery(a_), cudaSuccess);
  // Nothing to do: the stream goes on at once.
  ASSERT_EQ(
      plateau::cuda_emulation::EnqueueExternal(a_, [](std::function<void()>) { return false; }),
      cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(after), cudaSuccess);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
}

// As CUDA's: destroying a stream does not wait for its work.
TEST_F(EmulatedRuntimeTest, DestroyingAStreamBlockedByExternalWorkDoesNotWait) {
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  std::function<void()> finish;
  ASSERT_EQ(plateau::cuda_emulation::EnqueueExternal(s,
                                                     [&](std::function<void()> done) {
                                                       finish = std::move(done);
                                                       return true;
                                                     }),
            cudaSuccess);
  float* device = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&device), sizeof(float)), cudaSuccess);
  const float one = 1.0f;
  ASSERT_EQ(cudaMemcpy(device, &one, sizeof(float), cudaMemcpyDefault), cudaSuccess);
  PLATEAU_KERNEL_LAUNCH(1, 32, 0, s, Scale)(device, int64_t{1}, 4.0f);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess) << "returns although the stream is blocked";
  ASSERT_TRUE(finish != nullptr);
  finish();
  // The destroyed stream's work still runs (a device-wide wait).
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(*device, 4.0f);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
}

// A fault ends the waits for external work at once (the work is dropped).
TEST_F(EmulatedRuntimeTest, AFaultEndsAWaitForExternalWork) {
  EXPECT_EXIT(
      {
        (void)plateau::cuda_emulation::EnqueueExternal(
            a_, [](std::function<void()>) { return true; });  // never done
        std::thread faulting([this] {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
          PLATEAU_KERNEL_LAUNCH(1, 64, 0, b_, Deadlock)(nullptr);
          (void)cudaStreamSynchronize(b_);
        });
        const bool faulted = cudaStreamSynchronize(a_) == cudaErrorLaunchFailure;
        faulting.join();
        std::exit(faulted ? 3 : 4);
      },
      ::testing::ExitedWithCode(3), "device fault");
}

TEST_F(EmulatedRuntimeTest, ExternalWorkAfterAFaultIsToldNotToRun) {
  EXPECT_EXIT(
      {
        PLATEAU_KERNEL_LAUNCH(1, 64, 0, a_, Deadlock)(nullptr);
        bool told = false;
        (void)plateau::cuda_emulation::EnqueueExternal(a_, [&](std::function<void()> done) {
          told = done == nullptr;
          return false;
        });
        const bool faulted = cudaStreamSynchronize(a_) == cudaErrorLaunchFailure;
        std::exit(told && faulted ? 3 : 4);
      },
      ::testing::ExitedWithCode(3), "device fault");
}

// CUDA_VISIBLE_DEVICES as CUDA reads it (the service gives each rank its
// GPU so): indices of the machine's GPUs, in device order, up to the first
// entry that names none.
TEST(EmulatedRuntimeVisibleDevicesTest, AsCudaReadsThem) {
  using plateau::cuda_emulation::VisibleDevices;
  using V = std::vector<int>;
  EXPECT_EQ(VisibleDevices(nullptr, 3), (V{0, 1, 2}));
  EXPECT_EQ(VisibleDevices("1", 3), (V{1}));
  EXPECT_EQ(VisibleDevices("2,0", 3), (V{2, 0}));
  EXPECT_EQ(VisibleDevices(" 1 , 2", 3), (V{1, 2}));
  EXPECT_EQ(VisibleDevices("0,5,1", 3), (V{0})) << "5 is no GPU: 1 is not visible either";
  EXPECT_EQ(VisibleDevices("1,1", 3), (V{1}));
  EXPECT_EQ(VisibleDevices("0,x", 3), (V{0}));
  EXPECT_EQ(VisibleDevices("GPU-8f1c", 3), (V{})) << "UUIDs are not emulated";
  EXPECT_EQ(VisibleDevices("", 3), (V{}));
  EXPECT_EQ(VisibleDevices("-1", 3), (V{}));
  EXPECT_EQ(VisibleDevices("99999999999", 3), (V{}));
}

// This process sees PLATEAU_EMULATED_GPUS=2 with CUDA_VISIBLE_DEVICES unset.
TEST_F(EmulatedRuntimeTest, EachDeviceIsTheMachinesGpuOfItsIndex) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  ASSERT_EQ(count, 2);
  EXPECT_EQ(plateau::cuda_emulation::PhysicalDevice(0), 0);
  EXPECT_EQ(plateau::cuda_emulation::PhysicalDevice(1), 1);
  EXPECT_EQ(plateau::cuda_emulation::PhysicalDevice(2), -1);
}

// Faults are sticky, so these run in a child process each.
TEST_F(EmulatedRuntimeTest, StaticPlusDynamicSharedMemoryPastTheLimitFaults) {
  EXPECT_EXIT(
      {
        float* device = nullptr;
        (void)cudaMalloc(reinterpret_cast<void**>(&device), 64 * sizeof(float));
        // 40000 static + 40000 dynamic bytes: each fits 48 KiB, together not.
        PLATEAU_KERNEL_LAUNCH(1, 64, 40000, a_, TooMuchSharedMemory)(device);
        std::exit(cudaStreamSynchronize(a_) == cudaErrorLaunchFailure ? 3 : 4);
      },
      ::testing::ExitedWithCode(3), "past the kernel's limit of 49152");
}

// A write just past the end (into the rounding's padding), a row past it
// (into the guard band after the padding) and before the start (the guard
// band before): each is found when the memory is freed.
TEST_F(EmulatedRuntimeTest, AWriteOutsideAnAllocationIsCaught) {
  const struct {
    int index;
    const char* said;
  } cases[] = {{100, "a write at byte 0 past the end of a 400-byte allocation"},
               {100 + 1024, "a write at byte 4096 past the end of a 400-byte allocation"},
               {-64, "a write 253 bytes before the start of a 400-byte allocation"}};
  for (const auto& c : cases) {
    EXPECT_EXIT(
        {
          float* device = nullptr;
          (void)cudaMalloc(reinterpret_cast<void**>(&device), 100 * sizeof(float));
          PLATEAU_KERNEL_LAUNCH(1, 32, 0, a_, WriteAt)(device, c.index);
          (void)cudaStreamSynchronize(a_);
          std::exit(cudaFree(device) == cudaErrorLaunchFailure ? 3 : 4);
        },
        // ASan sees the write itself (the bands are poisoned); otherwise a
        // band is found changed when the memory is freed.
        [](int status) {
          return (WIFEXITED(status) && WEXITSTATUS(status) == 3) || WIFSIGNALED(status) ||
                 (WIFEXITED(status) && WEXITSTATUS(status) == 1);  // ASan's own exit
        },
        std::string(c.said) + "|use-after-poison")
        << "x[" << c.index << "]";
  }
}

// Last: a fault poisons the process's (emulated) context for good.
TEST_F(EmulatedRuntimeTest, ZzAFailedKernelIsAStickyFault) {
  PLATEAU_KERNEL_LAUNCH(1, 64, 0, a_, Deadlock)(nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the launch itself is fine";
  EXPECT_EQ(cudaStreamSynchronize(a_), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaStreamSynchronize(b_), cudaErrorLaunchFailure);
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, 16), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure) << "sticky";
}

}  // namespace
