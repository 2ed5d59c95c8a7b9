#include "kernels/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <list>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/cpu_ops.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/stream_errors.h"
#include "kernels/memory.h"
#include "kernels/status_macros.h"
#include "kernels/stream.h"

namespace plateau {
namespace {

// Cleanup paths (destructors, RawFree) cannot return a status; they report
// on stderr with the call's file and line and carry on.
void ReportIfError(cudaError_t error, const char* call, const char* file,
                   int line) {
  if (error == cudaSuccess) return;
  absl::Status s = CudaStatus(error, call, file, line);
  std::fprintf(stderr, "plateau cuda backend: %s\n",
               std::string(s.message()).c_str());
}
#define PLATEAU_CUDA_REPORT(call) ReportIfError((call), #call, __FILE__, __LINE__)

// ---------------------------------------------------------------------------
// Release order

// Orders the memory spaces' frees and allocations against every stream of
// the backend on the GPU, never blocking the host. cudaFree and cudaFreeHost
// synchronise the whole device; called under a memory space's lock they
// stalled compute and NCCL at every release and could deadlock with a
// collective in flight whose peer waits on this process. Instead:
//  - a release first makes the release stream wait for the work enqueued so
//    far on every stream (Fence), then frees in the release stream's order
//    (cudaFreeAsync, or the pinned cache's ready event), so no work that may
//    still touch the memory can see it reused;
//  - an allocation, made in the release stream's order, makes every stream
//    (and the legacy default stream, which tests' synchronous cudaMemcpy
//    uses) wait for the release stream's work so far (Publish), so memory
//    whose last user has not finished is never written by its next one.
// Both are a few event records and waits: no host synchronisation. The cost
// is on the GPU: after an allocation, each stream's next work also waits for
// what every stream had queued at the last release. The step allocates its
// buffers at launch (llm.c's habit), so this ordering is paid at launch,
// not per layer.
class ReleaseOrder {
 public:
  ReleaseOrder(int device, cudaStream_t release, cudaEvent_t event)
      : device_(device), release_(release), event_(event) {}
  ~ReleaseOrder() {
    PLATEAU_CUDA_REPORT(cudaSetDevice(device_));
    PLATEAU_CUDA_REPORT(cudaStreamSynchronize(release_));
    PLATEAU_CUDA_REPORT(cudaEventDestroy(event_));
    PLATEAU_CUDA_REPORT(cudaStreamDestroy(release_));
  }
  ReleaseOrder(const ReleaseOrder&) = delete;
  ReleaseOrder& operator=(const ReleaseOrder&) = delete;

  cudaStream_t stream() const { return release_; }

  // A new stream: its work waits for the release stream's work so far.
  absl::Status Add(cudaStream_t stream) {
    absl::MutexLock lock(&mu_);
    PLATEAU_CUDA_RETURN_IF_ERROR(cudaEventRecord(event_, release_));
    PLATEAU_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, event_, 0));
    streams_.push_back(stream);
    return absl::OkStatus();
  }

  void Remove(cudaStream_t stream) {
    absl::MutexLock lock(&mu_);
    streams_.erase(std::remove(streams_.begin(), streams_.end(), stream),
                   streams_.end());
  }

  // The release stream's later work waits for everything enqueued so far on
  // every stream. One event serves every stream: a wait captures the
  // event's latest record at the time of the call.
  cudaError_t Fence() {
    absl::MutexLock lock(&mu_);
    for (cudaStream_t s : streams_) {
      cudaError_t e = cudaEventRecord(event_, s);
      if (e == cudaSuccess) e = cudaStreamWaitEvent(release_, event_, 0);
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  }

  // Every stream's later work waits for the release stream's work so far.
  cudaError_t Publish() {
    absl::MutexLock lock(&mu_);
    cudaError_t e = cudaEventRecord(event_, release_);
    for (size_t i = 0; e == cudaSuccess && i <= streams_.size(); ++i) {
      e = cudaStreamWaitEvent(i < streams_.size() ? streams_[i]
                                                  : cudaStreamLegacy,
                              event_, 0);
    }
    return e;
  }

 private:
  const int device_;
  const cudaStream_t release_;
  absl::Mutex mu_;
  std::vector<cudaStream_t> streams_ ABSL_GUARDED_BY(mu_);
  const cudaEvent_t event_;  // recorded and waited on only under mu_
};

// ---------------------------------------------------------------------------
// Memory spaces

// Device memory from a stream-ordered pool (cudaMallocFromPoolAsync /
// cudaFreeAsync on the release stream) whose release threshold keeps freed
// memory reserved for the next allocation: a release never synchronises the
// device and never returns memory to the driver mid-step. The MemorySpace
// base enforces the optional cap on live bytes and names the live set on
// failure, exactly as on the CPU; this adds what the GPU itself had free
// when the pool refused. cudaMemGetInfo therefore counts the pool's reserve
// as used: the budget's figures are the tracker's, not the driver's.
class CudaDeviceSpace final : public MemorySpace {
 public:
  CudaDeviceSpace(int device, int64_t cap_bytes, ReleaseOrder* order,
                  cudaMemPool_t pool)
      : MemorySpace(SpaceKind::kDevice, "device", cap_bytes),
        device_(device),
        order_(order),
        pool_(pool) {}
  ~CudaDeviceSpace() override {
    // Every buffer is released by now; let the queued frees run first.
    PLATEAU_CUDA_REPORT(cudaSetDevice(device_));
    PLATEAU_CUDA_REPORT(cudaStreamSynchronize(order_->stream()));
    PLATEAU_CUDA_REPORT(cudaMemPoolDestroy(pool_));
  }

 protected:
  absl::StatusOr<void*> RawAllocate(size_t bytes) override {
    PLATEAU_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    void* p = nullptr;
    cudaError_t error =
        cudaMallocFromPoolAsync(&p, bytes, pool_, order_->stream());
    if (error == cudaErrorMemoryAllocation) {
      // The reserve may be fragmented (blocks freed by an earlier, smaller
      // step: a benchmark's ladder of contexts on one backend): hand what
      // is unused back to the driver and try once more. Memory whose
      // stream-ordered free the host has not seen complete counts as
      // outstanding and is not released (cudaMemPoolTrimTo's
      // documentation), so first wait for the release stream: its frees
      // and the work they are ordered after. This path alone waits (under
      // the space's lock, which a Free queued meanwhile waits for: it
      // needs nothing this wait waits on); an allocation that fits never
      // does.
      (void)cudaGetLastError();
      PLATEAU_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(order_->stream()));
      PLATEAU_CUDA_RETURN_IF_ERROR(cudaMemPoolTrimTo(pool_, 0));
      error = cudaMallocFromPoolAsync(&p, bytes, pool_, order_->stream());
    }
    if (error == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky; keep it out of later checks
      size_t free_bytes = 0, total_bytes = 0;
      if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        return absl::ResourceExhaustedError(absl::StrFormat(
            "the device pool refused on GPU %d; cudaMemGetInfo failed too",
            device_));
      }
      return absl::ResourceExhaustedError(absl::StrFormat(
          "the device pool refused: GPU %d has %d bytes free of %d", device_,
          free_bytes, total_bytes));
    }
    PLATEAU_CUDA_RETURN_IF_ERROR(error);
    const cudaError_t published = order_->Publish();
    if (published != cudaSuccess) {
      PLATEAU_CUDA_REPORT(cudaFreeAsync(p, order_->stream()));
      return CudaStatus(published, "ReleaseOrder::Publish", __FILE__,
                        __LINE__);
    }
    return p;
  }

  // Under the space's lock: only a stream-ordered free, which returns at
  // once; ReleaseFence (outside the lock) ordered it after every stream.
  void RawFree(void* data, size_t /*bytes*/) override {
    PLATEAU_CUDA_REPORT(cudaSetDevice(device_));
    PLATEAU_CUDA_REPORT(cudaFreeAsync(data, order_->stream()));
  }

  void ReleaseFence() override {
    PLATEAU_CUDA_REPORT(cudaSetDevice(device_));
    PLATEAU_CUDA_REPORT(order_->Fence());
  }

 public:
  // The backend's own memory, from the same pool but outside the cap and
  // the live sets: each stream's cuBLAS workspace. The budget plans the
  // step's buffers; what the libraries need beside them (the CUDA context,
  // NCCL's buffers, cuBLAS's workspaces) is the headroom between the plan
  // and the card (docs/FRONTIER.md), so it must not count against a cap
  // sized to the plan (a step at N_max would fail by the workspaces' bytes).
  absl::StatusOr<void*> AllocateUnplanned(size_t bytes) { return RawAllocate(bytes); }
  // After every stream's work so far, as a Buffer's release.
  void FreeUnplanned(void* p) {
    ReleaseFence();
    RawFree(p, 0);
  }

 private:
  const int device_;
  ReleaseOrder* const order_;
  const cudaMemPool_t pool_;
};

// Pinned (page-locked) host memory: copies to and from it are true
// asynchronous DMA that overlaps compute, which SCO's offload and the
// optimizer's staging rely on.
//
// cudaFreeHost synchronises the device, so a released block is not freed:
// it waits in a cache with an event recorded on the release stream (after
// every stream's work at release time) and is handed out again, once that
// event has completed, to an allocation of at least its size and at most
// twice it. Blocks beyond kCacheBytes are freed by the next release, outside
// the space's lock; the rest when the space is destroyed. The tracker counts
// live bytes only, as on the CPU.
class CudaPinnedSpace final : public MemorySpace {
 public:
  // The cache's bound: enough for the staging buffers of a step to come back
  // without a cudaHostAlloc, small next to a training host's memory.
  static constexpr size_t kCacheBytes = size_t{1} << 30;

  CudaPinnedSpace(int device, int64_t cap_bytes, ReleaseOrder* order)
      : MemorySpace(SpaceKind::kHost, "host", cap_bytes),
        device_(device),
        order_(order) {}
  ~CudaPinnedSpace() override {
    PLATEAU_CUDA_REPORT(cudaSetDevice(device_));
    PLATEAU_CUDA_REPORT(cudaStreamSynchronize(order_->stream()));
    absl::MutexLock lock(&cache_mu_);
    for (const Cached& c : cache_) {
      if (c.ready != nullptr) PLATEAU_CUDA_REPORT(cudaEventDestroy(c.ready));
      PLATEAU_CUDA_REPORT(cudaFreeHost(c.data));
    }
    for (cudaEvent_t e : spare_events_) PLATEAU_CUDA_REPORT(cudaEventDestroy(e));
  }

 protected:
  absl::StatusOr<void*> RawAllocate(size_t bytes) override {
    {
      absl::MutexLock lock(&cache_mu_);
      auto best = cache_.end();
      for (auto it = cache_.begin(); it != cache_.end(); ++it) {
        if (it->capacity < bytes || it->capacity / 2 > bytes) continue;
        if (best != cache_.end() && best->capacity <= it->capacity) continue;
        if (it->ready == nullptr) continue;  // its release was never ordered
        const cudaError_t q = cudaEventQuery(it->ready);
        if (q == cudaErrorNotReady) continue;
        PLATEAU_CUDA_RETURN_IF_ERROR(q);
        best = it;
      }
      if (best != cache_.end()) {
        void* p = best->data;
        live_[p] = best->capacity;
        cached_bytes_ -= best->capacity;
        spare_events_.push_back(best->ready);
        cache_.erase(best);
        return p;
      }
    }
    PLATEAU_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    void* p = nullptr;
    const cudaError_t error = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (error == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      absl::MutexLock lock(&cache_mu_);
      return absl::ResourceExhaustedError(absl::StrCat(
          "cudaHostAlloc refused to pin that much host memory (", cached_bytes_,
          " bytes are pinned in the release cache, of other sizes or still in "
          "use by queued copies)"));
    }
    PLATEAU_CUDA_RETURN_IF_ERROR(error);
    absl::MutexLock lock(&cache_mu_);
    live_[p] = bytes;
    return p;
  }

  // Under the space's lock: an event record and a list insert, no free.
  void RawFree(void* data, size_t /*bytes*/) override {
    absl::MutexLock lock(&cache_mu_);
    auto it = live_.find(data);
    const size_t capacity = it == live_.end() ? 0 : it->second;
    if (it != live_.end()) live_.erase(it);
    cudaEvent_t ready = nullptr;
    if (!spare_events_.empty()) {
      ready = spare_events_.back();
      spare_events_.pop_back();
    } else if (cudaEventCreateWithFlags(&ready, cudaEventDisableTiming) !=
               cudaSuccess) {
      (void)cudaGetLastError();
      ready = nullptr;
    }
    if (ready != nullptr && cudaEventRecord(ready, order_->stream()) !=
                                cudaSuccess) {
      (void)cudaGetLastError();
      PLATEAU_CUDA_REPORT(cudaEventDestroy(ready));
      ready = nullptr;  // never reused; freed with the space
    }
    cache_.push_back(Cached{data, capacity, ready});
    cached_bytes_ += capacity;
  }

  // Outside the space's lock: order the release after every stream, then
  // free completed blocks beyond the cache's bound (cudaFreeHost waits for
  // the device, which is allowed here and only here).
  void ReleaseFence() override {
    PLATEAU_CUDA_REPORT(cudaSetDevice(device_));
    PLATEAU_CUDA_REPORT(order_->Fence());
    std::vector<Cached> trimmed;
    {
      absl::MutexLock lock(&cache_mu_);
      for (auto it = cache_.begin();
           it != cache_.end() && cached_bytes_ > kCacheBytes;) {
        if (it->ready != nullptr && cudaEventQuery(it->ready) == cudaSuccess) {
          cached_bytes_ -= it->capacity;
          trimmed.push_back(*it);
          it = cache_.erase(it);
        } else {
          (void)cudaGetLastError();
          ++it;
        }
      }
    }
    for (const Cached& c : trimmed) {
      PLATEAU_CUDA_REPORT(cudaEventDestroy(c.ready));
      PLATEAU_CUDA_REPORT(cudaFreeHost(c.data));
    }
  }

 private:
  struct Cached {
    void* data;
    size_t capacity;
    cudaEvent_t ready;  // nullptr: reuse never safe; freed with the space
  };

  const int device_;
  ReleaseOrder* const order_;
  absl::Mutex cache_mu_;
  std::list<Cached> cache_ ABSL_GUARDED_BY(cache_mu_);
  size_t cached_bytes_ ABSL_GUARDED_BY(cache_mu_) = 0;
  // Live blocks' capacities (a reused block may be larger than asked).
  std::map<void*, size_t> live_ ABSL_GUARDED_BY(cache_mu_);
  std::vector<cudaEvent_t> spare_events_ ABSL_GUARDED_BY(cache_mu_);
};

// ---------------------------------------------------------------------------
// Events and streams

class CudaEvent final : public Event {
 public:
  CudaEvent(int device, cudaEvent_t event, bool timing = false)
      : device_(device), event_(event), timing_(timing) {}
  ~CudaEvent() override { PLATEAU_CUDA_REPORT(cudaEventDestroy(event_)); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  absl::Status Synchronize() override {
    PLATEAU_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event_));
    return absl::OkStatus();
  }

  bool Done() override {
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaSuccess) return true;
    (void)cudaGetLastError();
    // A real error counts as done, so a polling caller does not spin
    // forever; Synchronize() reports it.
    return e != cudaErrorNotReady;
  }

  // cudaEventElapsedTime: milliseconds at about half a microsecond's
  // resolution; cudaErrorNotReady while either point has not run, and an
  // invalid handle for an event never recorded or made without timing.
  absl::StatusOr<double> SecondsSince(Event& earlier) override {
    auto* e = dynamic_cast<CudaEvent*>(&earlier);
    if (e == nullptr) return absl::InvalidArgumentError("event: SecondsSince needs a CUDA event");
    if (!timing_ || !e->timing_) {
      return absl::FailedPreconditionError(
          "event: not a timing event (Backend::CreateTimingEvent)");
    }
    float ms = 0.0f;
    const cudaError_t err = cudaEventElapsedTime(&ms, e->event_, event_);
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not the next launch's error
      return absl::FailedPreconditionError("event: its point has not run yet");
    }
    PLATEAU_RETURN_IF_ERROR(CudaStatus(err, "cudaEventElapsedTime", __FILE__, __LINE__));
    return ms * 1e-3;
  }

  int device() const { return device_; }
  cudaEvent_t native() const { return event_; }

 private:
  const int device_;
  const cudaEvent_t event_;
  const bool timing_;
};

// The most GEMMs one cublasGemmGroupedBatchedEx call takes: the device
// arrays of their A, B and C pointers sit at the end of each stream's
// workspace (24 KiB), after the part lent to cuBLAS and the reductions.
constexpr int64_t kGroupedGemmsPerCall = 1024;
constexpr size_t kGemmPointerBytes = 3 * kGroupedGemmsPerCall * sizeof(void*);
// cublasGemmGroupedBatchedEx is cuBLAS 12.5's; built against an older one
// the grouped GEMMs run one cublasGemmEx per entry.
#if CUBLAS_VERSION >= 120500
constexpr bool kHaveGroupedGemm = true;
#else
constexpr bool kHaveGroupedGemm = false;
#endif

// A non-blocking CUDA stream (it does not synchronise with the legacy default
// stream) with its own cuBLAS handle and workspace: `blas_bytes` of it for
// cuBLAS and the reductions' scratch, then the grouped GEMM's pointer
// arrays (kGemmPointerBytes).
//
// Errors are sticky, as stream.h promises: the first failure (an enqueue
// that failed, a kernel fault seen by Synchronize, or a collective that the
// NCCL watchdog gave up on) is kept in stream_errors.h under this stream's
// handle; later work is skipped and Synchronize returns it. Record and Wait
// still run, so events recorded after the failure complete.
class CudaStream final : public Stream {
 public:
  CudaStream(std::string name, int device, cudaStream_t stream,
             cublasHandle_t blas, void* workspace, size_t blas_bytes,
             ReleaseOrder* order, CudaDeviceSpace* space)
      : name_(std::move(name)),
        device_(device),
        stream_(stream),
        blas_(blas),
        workspace_(workspace),
        blas_bytes_(blas_bytes),
        order_(order),
        space_(space) {}

  ~CudaStream() override {
    // The workspace may still be in use by enqueued work: drain first.
    PLATEAU_CUDA_REPORT(cudaSetDevice(device_));
    PLATEAU_CUDA_REPORT(cudaStreamSynchronize(stream_));
    order_->Remove(stream_);
    if (blas_ != nullptr && cublasDestroy(blas_) != CUBLAS_STATUS_SUCCESS) {
      std::fprintf(stderr, "plateau cuda backend: cublasDestroy failed\n");
    }
    PLATEAU_CUDA_REPORT(cudaStreamDestroy(stream_));
    ForgetCudaStream(stream_);
    if (workspace_ != nullptr) space_->FreeUnplanned(workspace_);
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  const std::string& name() const override { return name_; }

  absl::Status Record(Event& event) override {
    auto* e = dynamic_cast<CudaEvent*>(&event);
    if (e == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("stream '", name_, "': Record needs a CUDA event"));
    }
    absl::MutexLock lock(&launch_mu_);  // between operations, not inside one
    PLATEAU_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    PLATEAU_CUDA_RETURN_IF_ERROR(cudaEventRecord(e->native(), stream_));
    return absl::OkStatus();
  }

  absl::Status Wait(Event& event) override {
    auto* e = dynamic_cast<CudaEvent*>(&event);
    if (e == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("stream '", name_, "': Wait needs a CUDA event"));
    }
    absl::MutexLock lock(&launch_mu_);
    PLATEAU_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    PLATEAU_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, e->native(), 0));
    return absl::OkStatus();
  }

  // Polls instead of blocking in cudaStreamSynchronize: a collective whose
  // peer died never completes, and the NCCL watchdog reports it by failing
  // this stream (after aborting the communicator) — a blocked host thread
  // would never see that. The poll backs off from 2 us to 200 us, so a
  // step's synchronise costs at most that much latency.
  absl::Status Synchronize() override {
    PLATEAU_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    absl::Duration backoff = absl::Microseconds(2);
    for (;;) {
      absl::Status sticky = error();
      if (!sticky.ok()) return sticky;
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return error();
      if (e != cudaErrorNotReady) {
        return Fail(CudaStatus(e, "cudaStreamQuery", __FILE__, __LINE__));
      }
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, absl::Microseconds(200));
    }
  }

  // OK, or the stream's first error.
  absl::Status error() const { return CudaStreamError(stream_); }
  // Keeps `s` as the stream's first error (naming the stream) unless it has
  // one; returns `s` as named.
  absl::Status Fail(const absl::Status& s) {
    absl::Status named(s.code(),
                       absl::StrCat("stream '", name_, "': ", s.message()));
    (void)FailCudaStream(stream_, named);
    return named;
  }

  void* native_handle() const override { return stream_; }

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  // A copy stream (StreamUse::kCopy) has neither: FAILED_PRECONDITION for
  // the operations that need them, before blas() or scratch() is used.
  absl::Status RequireCompute() const {
    if (workspace_ != nullptr) return absl::OkStatus();
    // Enqueue names the stream (Fail).
    return absl::FailedPreconditionError("a copy stream (StreamUse::kCopy): no GEMM or reduction runs on it");
  }
  cublasHandle_t blas() const { return blas_; }
  void* scratch() const { return workspace_; }
  // kGroupedGemmsPerCall entries each, device memory; read by the grouped
  // GEMM enqueued after they are written, so stream order lets the next
  // grouped GEMM overwrite them.
  const void** gemm_a() const {
    return reinterpret_cast<const void**>(gemm_pointers());
  }
  const void** gemm_b() const { return gemm_a() + kGroupedGemmsPerCall; }
  void** gemm_c() const {
    return reinterpret_cast<void**>(gemm_pointers()) + 2 * kGroupedGemmsPerCall;
  }
  // Held while an operation enqueues its kernels (see cuda_backend.h).
  absl::Mutex& launch_mu() { return launch_mu_; }

 private:
  const std::string name_;
  const int device_;
  const cudaStream_t stream_;
  // Null on a copy stream (no workspace): a caller that skipped
  // RequireCompute gets a null pointer, not one 32 MiB past null.
  char* gemm_pointers() const { return workspace_ == nullptr ? nullptr : static_cast<char*>(workspace_) + blas_bytes_; }

  const cublasHandle_t blas_;
  void* const workspace_;  // CudaDeviceSpace::AllocateUnplanned
  const size_t blas_bytes_;
  ReleaseOrder* const order_;
  CudaDeviceSpace* const space_;  // where the workspace goes back
  absl::Mutex launch_mu_;
};

// ---------------------------------------------------------------------------
// The backend

class CudaBackend final : public Backend {
 public:
  CudaBackend(const BackendOptions& o, const cudaDeviceProp& prop,
              std::unique_ptr<ReleaseOrder> order, cudaMemPool_t pool)
      : device_index_(o.device_index),
        prop_(prop),
        // cuBLAS's recommended workspace: 32 MiB on Hopper and later, 4 MiB
        // before; never less than our reductions' scratch.
        workspace_bytes_(std::max(
            prop.major >= 9 ? size_t{32} << 20 : size_t{4} << 20,
            cuda_ops::kScratchBytes)),
        order_(std::move(order)),
        device_(o.device_index, o.device_memory_bytes, order_.get(), pool),
        host_(o.device_index, o.host_memory_bytes, order_.get()),
        pool_(pool) {}

  BackendKind kind() const override { return BackendKind::kCuda; }

  // The bf16 step's every op has a CUDA kernel (cuda_bf16_twin_test,
  // cuda_model_twin_test) and the step is checked against the CPU's exact
  // emulation by cuda_step_twin_test's bf16 cases: on a GPU, device-check.
  bool computes_bf16() const override { return true; }
  std::string Describe() const override {
    return absl::StrFormat(
        "cuda (%s, sm_%d%d, %d SMs, %d MiB, GPU %d; device cap %s)",
        prop_.name, prop_.major, prop_.minor, prop_.multiProcessorCount,
        static_cast<int64_t>(prop_.totalGlobalMem >> 20), device_index_,
        device_.cap_bytes() == MemorySpace::kUncapped
            ? std::string("none")
            : absl::StrCat(device_.cap_bytes(), " bytes"));
  }

  MemorySpace& device() override { return device_; }
  MemorySpace& host() override { return host_; }

  // Neither call synchronises the device, so a step's telemetry can ask
  // every step.
  absl::StatusOr<DeviceView> QueryDevice() override {
    PLATEAU_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_index_));
    size_t free = 0, total = 0;
    PLATEAU_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free, &total));
    uint64_t reserved = 0;  // the attribute is a cuuint64_t
    PLATEAU_CUDA_RETURN_IF_ERROR(
        cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &reserved));
    DeviceView v;
    v.device_index = device_index_;
    v.name = prop_.name;
    v.cc_major = prop_.major;
    v.cc_minor = prop_.minor;
    v.total_bytes = static_cast<int64_t>(total);
    v.free_bytes = static_cast<int64_t>(free);
    v.pool_reserved_bytes = static_cast<int64_t>(reserved);
    return v;
  }

  // A copy stream gets no cuBLAS handle and no workspace (32 MiB on Hopper,
  // outside every plan): SCO's and OffloadStreamAdamW's streams only copy.
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream(absl::string_view name,
                                                       StreamUse use = StreamUse::kCompute) override {
    PLATEAU_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_index_));
    const bool compute = use == StreamUse::kCompute;
    void* workspace = nullptr;
    if (compute) {
      PLATEAU_ASSIGN_OR_RETURN(workspace, device_.AllocateUnplanned(workspace_bytes_ + kGemmPointerBytes));
    }
    cudaStream_t stream = nullptr;
    absl::Status s = CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                                "cudaStreamCreateWithFlags", __FILE__, __LINE__);
    cublasHandle_t blas = nullptr;
    if (s.ok() && compute) s = ConfigureBlas(stream, workspace, &blas);
    // The stream waits for the release stream's work so far: its workspace
    // (and any earlier allocation) may reuse memory whose last user is
    // still queued.
    if (s.ok()) s = order_->Add(stream);
    if (!s.ok()) {
      if (blas != nullptr) cublasDestroy(blas);
      if (stream != nullptr) PLATEAU_CUDA_REPORT(cudaStreamDestroy(stream));
      if (workspace != nullptr) device_.FreeUnplanned(workspace);
      return s;
    }
    return std::make_unique<CudaStream>(std::string(name), device_index_,
                                        stream, blas, workspace,
                                        workspace_bytes_, order_.get(), &device_);
  }

  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override { return MakeEvent(false); }
  absl::StatusOr<std::unique_ptr<Event>> CreateTimingEvent() override { return MakeEvent(true); }

 protected:
  // With the caller's own (pageable) memory on either side, the copy is
  // complete when DoCopy returns, as backend.h promises: the stream is
  // synchronised after it. cudaMemcpyAsync alone does not give that: from
  // pageable memory it returns once the source is staged, and the write to
  // the device lands later in this stream's order, so work on another stream
  // (a collective on the communication stream reading counts the compute
  // stream copied in) could read the old bytes. Between the backend's
  // spaces (device, pinned host) the copy stays asynchronous.
  absl::Status DoCopy(Stream& st, void* dst, const void* src,
                      size_t bytes) override {
    // Classified before the copy is queued: an error here leaves nothing in
    // flight that reads or writes the caller's memory.
    PLATEAU_ASSIGN_OR_RETURN(const bool pageable_dst, IsPageable(dst));
    PLATEAU_ASSIGN_OR_RETURN(const bool pageable_src, IsPageable(src));
    PLATEAU_RETURN_IF_ERROR(Enqueue(st, [&](CudaStream* s) -> absl::Status {
      // cudaMemcpyDefault: unified addressing tells device from host pointers.
      PLATEAU_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s->stream()));
      return absl::OkStatus();
    }));
    if (!pageable_dst && !pageable_src) return absl::OkStatus();
    return st.Synchronize();
  }

  // Host memory the driver does not know (neither cudaMalloc'd nor pinned).
  static absl::StatusOr<bool> IsPageable(const void* p) {
    cudaPointerAttributes attr;
    PLATEAU_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attr, p));
    return attr.type == cudaMemoryTypeUnregistered;
  }

  absl::Status DoGemm(Stream& st, const GemmArgs& g) override {
    return Enqueue(st, [&](CudaStream* s) { return EnqueueGemm(s, g); });
  }

  // The fp32 GEMM. Runs under the stream's launch lock (Enqueue).
  static absl::Status EnqueueGemm(CudaStream* s, const GemmArgs& g) {
    if (g.k == 0) {  // C = beta * C; A and B may be null
      PLATEAU_CUDA_RETURN_IF_ERROR(
          cuda_ops::ScaleMatrix(s->stream(), g.c, g.m, g.n, g.ldc, g.beta));
      return absl::OkStatus();
    }
    // cuBLAS is column-major. A row-major matrix read as column-major is its
    // transpose, so the row-major C = op(A) op(B) is computed as the
    // column-major C^T (n x m) = op(B)^T op(A)^T: the operands swap places
    // and keep their own transpose flags and leading dimensions.
    const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    PLATEAU_RETURN_IF_ERROR(s->RequireCompute());
    PLATEAU_CUBLAS_RETURN_IF_ERROR(
        cublasGemmEx(s->blas(), op_b, op_a, static_cast<int>(g.n), static_cast<int>(g.m),
                     static_cast<int>(g.k), &g.alpha, g.b, CUDA_R_32F, static_cast<int>(g.ldb), g.a,
                     CUDA_R_32F, static_cast<int>(g.lda), &g.beta, g.c, CUDA_R_32F,
                     static_cast<int>(g.ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return absl::OkStatus();
  }

  // One cublasGemmGroupedBatchedEx call per kGroupedGemmsPerCall GEMMs.
  // Each GEMM is swapped to column-major as in DoGemm; consecutive GEMMs
  // with the same parameters (all but the pointers) form one cuBLAS group.
  // GEMMs with k = 0 (C = beta C) go to ScaleMatrix, as in DoGemm.
  absl::Status DoGroupedGemm(Stream& st,
                             absl::Span<const GemmArgs> gemms) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_RETURN_IF_ERROR(RequireComputeForGrouped(s, gemms));
      std::vector<GroupedEntry> todo;
      for (const GemmArgs& g : gemms) {
        if (g.k == 0) {
          PLATEAU_CUDA_RETURN_IF_ERROR(
              cuda_ops::ScaleMatrix(s->stream(), g.c, g.m, g.n, g.ldc, g.beta));
        } else {
          todo.push_back({g.trans_a, g.trans_b, g.m, g.n, g.k, g.alpha, g.a, g.lda, g.b, g.ldb,
                          g.beta, g.c, g.ldc});
        }
      }
      return EnqueueGrouped(s, todo, CUDA_R_32F, CUDA_R_32F, [&](const GroupedEntry& e) {
        return EnqueueGemm(
            s, {e.trans_a, e.trans_b, e.m, e.n, e.k, e.alpha, static_cast<const float*>(e.a), e.lda,
                static_cast<const float*>(e.b), e.ldb, e.beta, static_cast<float*>(e.c), e.ldc});
      });
    });
  }

  // The expert groups' bf16 GEMMs: the entries with a bf16 C (the expert
  // activations and gradients) as grouped cuBLAS calls with bf16 A, B, C and
  // CUBLAS_COMPUTE_32F, as DoGroupedGemm; k = 0 entries and those with an
  // fp32 C (which the grouped call is not asked to take) one by one through
  // DoGemmBf16's path. The entries' outputs do not overlap (validated), so
  // the order between the two sets does not matter. Each C is what GemmBf16
  // gives to fp32 rounding of the sum before the one bf16 rounding.
  absl::Status DoGroupedGemmBf16(Stream& st, absl::Span<const GemmBf16Args> gemms) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_RETURN_IF_ERROR(RequireComputeForGrouped(s, gemms));
      std::vector<GroupedEntry> todo;
      for (const GemmBf16Args& g : gemms) {
        if (g.k == 0 || g.c == nullptr) {
          PLATEAU_RETURN_IF_ERROR(EnqueueGemmBf16(s, g));
        } else {
          todo.push_back({g.trans_a, g.trans_b, g.m, g.n, g.k, g.alpha, g.a, g.lda, g.b, g.ldb,
                          g.beta, g.c, g.ldc});
        }
      }
      // Entries the grouped call cannot take (EnqueueGrouped says which) go
      // one by one through GemmBf16's path, said once on stderr since it is
      // slower. Each C is then GemmBf16's, which cuBLAS may compute with
      // another kernel than the grouped call's (another order of the sums):
      // the same to fp32 rounding, not bit for bit. Which entries go here
      // depends on their pointers' alignment, a function of the shapes only
      // (buffers are laid out from them), so a run and its recompute or
      // resume take the same path.
      return EnqueueGrouped(s, todo, CUDA_R_16BF, CUDA_R_16BF, [&](const GroupedEntry& e) {
        static std::atomic<bool> said{false};
        if (!said.exchange(true)) {
          std::fprintf(stderr,
                       "plateau cuda backend: GroupedGemmBf16 runs some entries one cublasGemmEx "
                       "each (a matrix not 16-byte aligned, or no grouped bf16 call here): "
                       "slower, the same values to rounding\n");
        }
        GemmBf16Args g;
        g.trans_a = e.trans_a;
        g.trans_b = e.trans_b;
        g.m = e.m;
        g.n = e.n;
        g.k = e.k;
        g.alpha = e.alpha;
        g.a = static_cast<const Bf16*>(e.a);
        g.lda = e.lda;
        g.b = static_cast<const Bf16*>(e.b);
        g.ldb = e.ldb;
        g.beta = e.beta;
        g.c = static_cast<Bf16*>(e.c);
        g.ldc = e.ldc;
        return EnqueueGemmBf16(s, g);
      });
    });
  }

  absl::Status DoFill(Stream& st, float* x, int64_t n, float value) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(cuda_ops::Fill(s->stream(), x, n, value));
      return absl::OkStatus();
    });
  }

  absl::Status DoScale(Stream& st, float* x, int64_t n, float alpha) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(cuda_ops::Scale(s->stream(), x, n, alpha));
      return absl::OkStatus();
    });
  }

  absl::Status DoAxpy(Stream& st, float* y, const float* x, int64_t n,
                      float alpha) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(cuda_ops::Axpy(s->stream(), y, x, n, alpha));
      return absl::OkStatus();
    });
  }

  absl::Status DoAdd(Stream& st, float* out, const float* a, const float* b,
                     int64_t n) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(cuda_ops::Add(s->stream(), out, a, b, n));
      return absl::OkStatus();
    });
  }

  absl::Status DoMul(Stream& st, float* out, const float* a, const float* b,
                     int64_t n) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(cuda_ops::Mul(s->stream(), out, a, b, n));
      return absl::OkStatus();
    });
  }

  absl::Status DoSwiGluForward(Stream& st, float* out, const float* gate,
                               const float* up, int64_t n) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(
          cuda_ops::SwiGluForward(s->stream(), out, gate, up, n));
      return absl::OkStatus();
    });
  }

  absl::Status DoSwiGluBackward(Stream& st, float* dgate, float* dup,
                                const float* dout, const float* gate,
                                const float* up, int64_t n) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(cuda_ops::SwiGluBackward(
          s->stream(), dgate, dup, dout, gate, up, n));
      return absl::OkStatus();
    });
  }

  absl::Status DoRmsNormForward(Stream& st, float* out, float* rstd,
                                const float* x, const float* weight,
                                int64_t rows, int64_t cols,
                                float eps) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(cuda_ops::RmsNormForward(
          s->stream(), out, rstd, x, weight, rows, cols, eps));
      return absl::OkStatus();
    });
  }

  absl::Status DoRmsNormBackward(Stream& st, float* dx, float* dweight,
                                 const float* dout, const float* x,
                                 const float* weight, const float* rstd,
                                 int64_t rows, int64_t cols) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_RETURN_IF_ERROR(s->RequireCompute());
      PLATEAU_CUDA_RETURN_IF_ERROR(
          cuda_ops::RmsNormBackward(s->stream(), dx, dweight, dout, x, weight,
                                    rstd, rows, cols, s->scratch()));
      return absl::OkStatus();
    });
  }

  absl::Status DoSoftmaxRows(Stream& st, float* y, const float* x,
                             int64_t rows, int64_t cols) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(
          cuda_ops::SoftmaxRows(s->stream(), y, x, rows, cols));
      return absl::OkStatus();
    });
  }

  absl::Status DoLogSumExpRows(Stream& st, float* out, const float* x,
                               int64_t rows, int64_t cols) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(
          cuda_ops::LogSumExpRows(s->stream(), out, x, rows, cols));
      return absl::OkStatus();
    });
  }

  absl::Status DoSum(Stream& st, float* out, const float* x,
                     int64_t n) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_RETURN_IF_ERROR(s->RequireCompute());
      PLATEAU_CUDA_RETURN_IF_ERROR(
          cuda_ops::Sum(s->stream(), out, x, n, s->scratch()));
      return absl::OkStatus();
    });
  }

  absl::Status DoSumSquares(Stream& st, float* out, const float* x,
                            int64_t n) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_RETURN_IF_ERROR(s->RequireCompute());
      PLATEAU_CUDA_RETURN_IF_ERROR(
          cuda_ops::SumSquares(s->stream(), out, x, n, s->scratch()));
      return absl::OkStatus();
    });
  }

  // The kernel's scalars: the CPU twin's per-step values (one formula).
  static cuda_ops::AdamWScalars AdamWScalarsOf(const AdamWArgs& args) {
    const cpu::AdamWStepScalars step = cpu::ComputeAdamWStepScalars(args);
    cuda_ops::AdamWScalars k;
    k.beta1 = args.beta1;
    k.one_minus_beta1 = 1.0f - args.beta1;
    k.beta2 = args.beta2;
    k.one_minus_beta2 = 1.0f - args.beta2;
    k.eps = args.eps;
    k.grad_scale = args.grad_scale;
    k.step_size = step.step_size;
    k.bc2_sqrt = step.bc2_sqrt;
    k.decay = step.decay;
    return k;
  }

  absl::Status DoAdamW(Stream& st, float* param, const float* grad, float* m,
                       float* v, int64_t n, const AdamWArgs& args) override {
    const cuda_ops::AdamWScalars k = AdamWScalarsOf(args);
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(
          cuda_ops::AdamW(s->stream(), param, grad, m, v, n, k));
      return absl::OkStatus();
    });
  }

  // --- bf16 mixed precision (kernels/bf16.h) -----------------------------
  // The bf16 GEMM: cublasGemmEx with bf16 A and B and CUBLAS_COMPUTE_32F
  // (fp32 products and sums), alpha * acc + beta * C in fp32 and one
  // rounding to a bf16 C, or an fp32 C. Swapped to column-major as DoGemm.
  absl::Status DoGemmBf16(Stream& st, const GemmBf16Args& g) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status { return EnqueueGemmBf16(s, g); });
  }
  absl::Status DoConvertToBf16(Stream& st, Bf16* out, const float* x, int64_t n) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(cuda_ops::ConvertToBf16(s->stream(), Bits(out), x, n));
      return absl::OkStatus();
    });
  }
  absl::Status DoConvertToFloat(Stream& st, float* out, const Bf16* x, int64_t n) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(cuda_ops::ConvertToFloat(s->stream(), out, Bits(x), n));
      return absl::OkStatus();
    });
  }
  absl::Status DoSwiGluForwardBf16(Stream& st, Bf16* out, const Bf16* gate, const Bf16* up,
                                   int64_t n) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(
          cuda_ops::SwiGluForwardBf16(s->stream(), Bits(out), Bits(gate), Bits(up), n));
      return absl::OkStatus();
    });
  }
  absl::Status DoSwiGluBackwardBf16(Stream& st, Bf16* dgate, Bf16* dup, const Bf16* dout,
                                    const Bf16* gate, const Bf16* up, int64_t n) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(cuda_ops::SwiGluBackwardBf16(
          s->stream(), Bits(dgate), Bits(dup), Bits(dout), Bits(gate), Bits(up), n));
      return absl::OkStatus();
    });
  }
  absl::Status DoRmsNormForwardBf16(Stream& st, Bf16* out, float* rstd, const Bf16* x,
                                    const Bf16* weight, int64_t rows, int64_t cols,
                                    float eps) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(cuda_ops::RmsNormForwardBf16(
          s->stream(), Bits(out), rstd, Bits(x), Bits(weight), rows, cols, eps));
      return absl::OkStatus();
    });
  }
  absl::Status DoRmsNormBackwardBf16(Stream& st, Bf16* dx, Bf16* dweight, const Bf16* dout,
                                     const Bf16* x, const Bf16* weight, const float* rstd,
                                     int64_t rows, int64_t cols) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_RETURN_IF_ERROR(s->RequireCompute());
      PLATEAU_CUDA_RETURN_IF_ERROR(cuda_ops::RmsNormBackwardBf16(
          s->stream(), Bits(dx), Bits(dweight), Bits(dout), Bits(x), Bits(weight), rstd, rows,
          cols, s->scratch()));
      return absl::OkStatus();
    });
  }
  absl::Status DoFillBf16(Stream& st, Bf16* x, int64_t n, float value) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(cuda_ops::FillBf16(s->stream(), Bits(x), n, value));
      return absl::OkStatus();
    });
  }
  absl::Status DoAddBf16(Stream& st, Bf16* out, const Bf16* a, const Bf16* b,
                         int64_t n) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(cuda_ops::AddBf16(s->stream(), Bits(out), Bits(a), Bits(b), n));
      return absl::OkStatus();
    });
  }
  absl::Status DoSumRowsBf16(Stream& st, Bf16* out, const Bf16* x, int64_t rows, int64_t n, int64_t ld) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(cuda_ops::SumRowsBf16(s->stream(), Bits(out), Bits(x), rows, n, ld));
      return absl::OkStatus();
    });
  }
  absl::Status DoAddRowsBf16(Stream& st, Bf16* out, const Bf16* x, absl::Span<const int32_t> rows, int64_t ld,
                             int64_t n) override {
    static_assert(kBf16AddRowsPerCall == cuda_ops::kAddRowsPerLaunch, "one launch per call");
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(
          cuda_ops::AddRowsBf16(s->stream(), Bits(out), Bits(x), rows.data(), static_cast<int>(rows.size()), ld, n));
      return absl::OkStatus();
    });
  }
  absl::Status DoSumSquaresBf16(Stream& st, float* out, const Bf16* x, int64_t n) override {
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_RETURN_IF_ERROR(s->RequireCompute());
      PLATEAU_CUDA_RETURN_IF_ERROR(
          cuda_ops::SumSquaresBf16(s->stream(), out, Bits(x), n, s->scratch()));
      return absl::OkStatus();
    });
  }
  absl::Status DoAdamWBf16(Stream& st, float* master, const Bf16* grad, float* m, float* v,
                           Bf16* working, int64_t n, const AdamWArgs& args) override {
    const cuda_ops::AdamWScalars k = AdamWScalarsOf(args);
    return Enqueue(st, [&](CudaStream* s) -> absl::Status {
      PLATEAU_CUDA_RETURN_IF_ERROR(
          cuda_ops::AdamWBf16(s->stream(), master, Bits(grad), m, v, Bits(working), n, k));
      return absl::OkStatus();
    });
  }

 private:
  // A Bf16 buffer as the launchers take it (its bits; cuda_ops.h is plain
  // C++ and names no bf16 type).
  static uint16_t* Bits(Bf16* p) { return reinterpret_cast<uint16_t*>(p); }
  static const uint16_t* Bits(const Bf16* p) { return reinterpret_cast<const uint16_t*>(p); }

  // One GEMM of a grouped call, its pointers untyped (the call names the
  // element types).
  struct GroupedEntry {
    bool trans_a, trans_b;
    int64_t m, n, k;
    float alpha;
    const void* a;
    int64_t lda;
    const void* b;
    int64_t ldb;
    float beta;
    void* c;
    int64_t ldc;
  };

  // Enqueues `todo` (every k > 0) as cublasGemmGroupedBatchedEx calls of
  // A grouped GEMM with any product (k > 0) on a copy stream is refused
  // before any entry is enqueued: its pointer arrays and cuBLAS handle are
  // the compute stream's workspace (a k = 0 entry only scales C).
  template <typename Args>
  static absl::Status RequireComputeForGrouped(CudaStream* s, absl::Span<const Args> gemms) {
    for (const Args& g : gemms) {
      if (g.k != 0) return s->RequireCompute();
    }
    return absl::OkStatus();
  }

  // kGroupedGemmsPerCall GEMMs, A and B of type `ab`, C of type `c_type`,
  // CUBLAS_COMPUTE_32F, and through `one_by_one` (a single GEMM each):
  //   - entries with a matrix not 16-byte aligned. The grouped call reads
  //     its matrix pointers from device memory, so cuBLAS cannot look at
  //     them and picks kernels that assume the alignment its documentation
  //     asks of them; a misaligned one is a misaligned-address fault, which
  //     ends the process's CUDA context. A single GEMM's pointers are
  //     arguments cuBLAS inspects. (The step's slices are aligned where
  //     hidden and expert_ffn are multiples of 8.)
  //   - every entry where this cuBLAS predates the grouped call (12.5);
  //   - the entries of a call cuBLAS answers CUBLAS_STATUS_NOT_SUPPORTED
  //     (it enqueued nothing).
  // The entries' outputs are disjoint (ValidateGroupedGemm), so the order
  // between the two paths does not matter. Runs under the stream's launch
  // lock (Enqueue).
  static absl::Status EnqueueGrouped(
      CudaStream* s, const std::vector<GroupedEntry>& todo, cudaDataType ab, cudaDataType c_type,
      const std::function<absl::Status(const GroupedEntry&)>& one_by_one) {
    std::vector<GroupedEntry> aligned;
    for (const GroupedEntry& g : todo) {
      const uintptr_t any = reinterpret_cast<uintptr_t>(g.a) | reinterpret_cast<uintptr_t>(g.b) |
                            reinterpret_cast<uintptr_t>(g.c);
      if (kHaveGroupedGemm && any % 16 == 0) {
        aligned.push_back(g);
      } else {
        PLATEAU_RETURN_IF_ERROR(one_by_one(g));
      }
    }
#if CUBLAS_VERSION >= 120500
    auto same = [](const GroupedEntry& x, const GroupedEntry& y) {
      return x.trans_a == y.trans_a && x.trans_b == y.trans_b && x.m == y.m &&
             x.n == y.n && x.k == y.k && x.lda == y.lda && x.ldb == y.ldb &&
             x.ldc == y.ldc && x.alpha == y.alpha && x.beta == y.beta;
    };
    for (size_t first = 0; first < aligned.size(); first += kGroupedGemmsPerCall) {
      const size_t last =
          std::min(aligned.size(), first + static_cast<size_t>(kGroupedGemmsPerCall));
      // Per GEMM: the pointers; per group: the rest.
      std::vector<const void*> a, b;
      std::vector<void*> c;
      std::vector<cublasOperation_t> op_a, op_b;
      std::vector<int> m, n, k, lda, ldb, ldc, size;
      std::vector<float> alpha, beta;
      for (size_t i = first; i < last; ++i) {
        const GroupedEntry& g = aligned[i];
        // Column-major C^T = op(B)^T op(A)^T: cuBLAS's A is our B.
        a.push_back(g.b);
        b.push_back(g.a);
        c.push_back(g.c);
        if (i > first && same(g, aligned[i - 1])) {
          ++size.back();
          continue;
        }
        op_a.push_back(g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
        op_b.push_back(g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
        m.push_back(static_cast<int>(g.n));
        n.push_back(static_cast<int>(g.m));
        k.push_back(static_cast<int>(g.k));
        lda.push_back(static_cast<int>(g.ldb));
        ldb.push_back(static_cast<int>(g.lda));
        ldc.push_back(static_cast<int>(g.ldc));
        alpha.push_back(g.alpha);
        beta.push_back(g.beta);
        size.push_back(1);
      }
      // The previous call's kernels read the pointer arrays before these
      // writes run: both are on this stream, in order.
      PLATEAU_CUDA_RETURN_IF_ERROR(cuda_ops::StoreGemmPointers(
          s->stream(), a.data(), b.data(), c.data(), static_cast<int64_t>(a.size()),
          s->gemm_a(), s->gemm_b(), s->gemm_c()));
      // The per-group arrays (and alpha, beta: host pointer mode) are read
      // during the call; the pointer arrays on the device, in stream order.
      PLATEAU_RETURN_IF_ERROR(s->RequireCompute());
      const cublasStatus_t st = cublasGemmGroupedBatchedEx(
          s->blas(), op_a.data(), op_b.data(), m.data(), n.data(), k.data(), alpha.data(),
          s->gemm_a(), ab, lda.data(), s->gemm_b(), ab, ldb.data(), beta.data(), s->gemm_c(),
          c_type, ldc.data(), static_cast<int>(size.size()), size.data(), CUBLAS_COMPUTE_32F);
      if (st == CUBLAS_STATUS_NOT_SUPPORTED) {
        for (size_t i = first; i < last; ++i) PLATEAU_RETURN_IF_ERROR(one_by_one(aligned[i]));
        continue;
      }
      if (st != CUBLAS_STATUS_SUCCESS) {
        return CublasStatus(st, "cublasGemmGroupedBatchedEx", __FILE__, __LINE__);
      }
    }
#else
    (void)ab;
    (void)c_type;
#endif
    return absl::OkStatus();
  }

  // The bf16 GEMM: cublasGemmEx with bf16 A and B and CUBLAS_COMPUTE_32F
  // (fp32 products and sums), alpha * acc + beta * C in fp32 and one
  // rounding to a bf16 C, or an fp32 C. Swapped to column-major as DoGemm.
  // Runs under the stream's launch lock (Enqueue).
  static absl::Status EnqueueGemmBf16(CudaStream* s, const GemmBf16Args& g) {
    const bool bf16_c = g.c != nullptr;
    void* c = bf16_c ? static_cast<void*>(g.c) : static_cast<void*>(g.c_fp32);
    if (g.k == 0) {  // C = beta * C; A and B may be null
      PLATEAU_CUDA_RETURN_IF_ERROR(
          bf16_c ? cuda_ops::ScaleMatrixBf16(s->stream(), Bits(g.c), g.m, g.n, g.ldc, g.beta)
                 : cuda_ops::ScaleMatrix(s->stream(), g.c_fp32, g.m, g.n, g.ldc, g.beta));
      return absl::OkStatus();
    }
    const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    PLATEAU_RETURN_IF_ERROR(s->RequireCompute());
    PLATEAU_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(
        s->blas(), op_b, op_a, static_cast<int>(g.n), static_cast<int>(g.m),
        static_cast<int>(g.k), &g.alpha, g.b, CUDA_R_16BF, static_cast<int>(g.ldb), g.a,
        CUDA_R_16BF, static_cast<int>(g.lda), &g.beta, c, bf16_c ? CUDA_R_16BF : CUDA_R_32F,
        static_cast<int>(g.ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return absl::OkStatus();
  }

 private:
  // A timing event (cudaEventDefault) costs a timestamp at every record, so
  // the step's own events are made without (cudaEventDisableTiming).
  absl::StatusOr<std::unique_ptr<Event>> MakeEvent(bool timing) {
    PLATEAU_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_index_));
    cudaEvent_t event = nullptr;
    PLATEAU_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&event, timing ? cudaEventDefault : cudaEventDisableTiming));
    return std::make_unique<CudaEvent>(device_index_, event, timing);
  }

  // Enqueues one operation: `launch(s)` runs with the stream's launch lock
  // held. A stream that has already failed skips it (stream.h: errors are
  // sticky; Synchronize returns the first); a launch that fails becomes the
  // stream's error and is returned here too.
  template <typename F>
  absl::Status Enqueue(Stream& st, F&& launch) {
    PLATEAU_ASSIGN_OR_RETURN(CudaStream * s, Native(st));
    absl::MutexLock lock(&s->launch_mu());
    if (!s->error().ok()) return absl::OkStatus();
    absl::Status status = launch(s);
    if (!status.ok()) return s->Fail(status);
    return absl::OkStatus();
  }

  // The stream as one of ours on this backend's GPU, with that GPU current
  // on the calling thread (launches go to the current device's streams).
  absl::StatusOr<CudaStream*> Native(Stream& stream) {
    auto* s = dynamic_cast<CudaStream*>(&stream);
    if (s == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stream '", stream.name(), "' does not belong to the CUDA backend"));
    }
    if (s->device() != device_index_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stream '", stream.name(), "' is on GPU ", s->device(),
          ", this backend on GPU ", device_index_));
    }
    PLATEAU_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_index_));
    return s;
  }

  // One handle per stream, bound to it once, with the stream's own
  // workspace and plain FP32 math: CUBLAS_DEFAULT_MATH never turns on TF32
  // or BF16x9 emulation, which would round inputs below fp32 and break the
  // agreement with the CPU backend. DISALLOW_REDUCED_PRECISION_REDUCTION:
  // a bf16-output GEMM may otherwise keep split-K partial sums in bf16
  // (cuBLAS's choice, likeliest for the weight gradients, k = N tokens, up
  // to 10^6, small m x n), which breaks the bf16 contract of one rounding
  // of an fp32 sum (docs/RUNTIME.md) far beyond the twin tests' k <= 300.
  absl::Status ConfigureBlas(cudaStream_t stream, void* workspace,
                             cublasHandle_t* blas) {
    PLATEAU_CUBLAS_RETURN_IF_ERROR(cublasCreate(blas));
    // cublasSetStream resets the workspace to cuBLAS's own pool, so the
    // stream goes first.
    PLATEAU_CUBLAS_RETURN_IF_ERROR(cublasSetStream(*blas, stream));
    PLATEAU_CUBLAS_RETURN_IF_ERROR(
        cublasSetWorkspace(*blas, workspace, workspace_bytes_));
    PLATEAU_CUBLAS_RETURN_IF_ERROR(
        cublasSetMathMode(*blas, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                                           CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    return absl::OkStatus();
  }

  const int device_index_;
  const cudaDeviceProp prop_;
  const size_t workspace_bytes_;
  // Declared before the spaces, which use it until they are destroyed.
  const std::unique_ptr<ReleaseOrder> order_;
  CudaDeviceSpace device_;
  CudaPinnedSpace host_;
  const cudaMemPool_t pool_;  // owned by device_
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(
    const BackendOptions& options) {
  // Every kernel is loaded when the context is created. With lazy loading
  // (CUDA's default since 12.2) a kernel's first launch loads its module,
  // which can wait for the context to go idle: mid-ring, behind an NCCL
  // kernel that waits for a peer, that is a deadlock. Only effective when
  // this is the process's first CUDA call and the variable is unset (the
  // agent and tools/device-check set it from the start). The price: the
  // libraries' every kernel is loaded too, a larger context (hundreds of
  // MiB more have been reported for cuBLAS and NCCL) and a slower start,
  // both in the headroom beside the plan; to be measured on the first GPU
  // run.
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    // Both versions: a driver older than the runtime this build links
    // (cudaErrorInsufficientDriver) is the usual cause besides no GPU.
    int driver = 0, runtime = 0;
    (void)cudaDriverGetVersion(&driver);
    (void)cudaRuntimeGetVersion(&runtime);
    (void)cudaGetLastError();
    auto version = [](int v) {
      return v > 0 ? absl::StrCat(v / 1000, ".", v % 1000 / 10) : std::string("none");
    };
    return absl::FailedPreconditionError(absl::StrCat(
        "backend: cuda was asked for, but no GPU is visible (",
        error != cudaSuccess ? absl::StrCat("cudaGetDeviceCount: ", cudaGetErrorName(error), ", ",
                                            cudaGetErrorString(error))
                             : std::string("cudaGetDeviceCount found 0 devices"),
        "; the driver supports CUDA ", version(driver), ", this build's runtime is CUDA ",
        version(runtime),
        "); run on a machine with an NVIDIA GPU and a driver for that CUDA, or use the "
        "cpu backend"));
  }
  if (options.device_index < 0 || options.device_index >= count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device_index: ", options.device_index, " is not one of the ", count,
        " visible GPUs (0..", count - 1, ")"));
  }
  PLATEAU_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device_index));
  cudaDeviceProp prop;
  PLATEAU_CUDA_RETURN_IF_ERROR(
      cudaGetDeviceProperties(&prop, options.device_index));
  const cudaError_t image = cuda_ops::CheckKernelImage();
  if (image != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "backend: GPU ", options.device_index, " (", prop.name, ", sm_",
        prop.major, prop.minor,
        ") cannot run this build's kernels (machine code for sm_80 and "
        "sm_90, PTX for compute_90) (",
        cudaGetErrorName(image), ")"));
  }
  // The release stream and the device pool (see ReleaseOrder and
  // CudaDeviceSpace).
  int pools_supported = 0;
  PLATEAU_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
      &pools_supported, cudaDevAttrMemoryPoolsSupported, options.device_index));
  if (!pools_supported) {
    return absl::FailedPreconditionError(absl::StrCat(
        "backend: GPU ", options.device_index, " (", prop.name,
        ") does not support stream-ordered memory pools, which the cuda "
        "backend's device space needs (CUDA 11.2+ driver, not under MPS "
        "limits that disable them)"));
  }
  cudaStream_t release = nullptr;
  PLATEAU_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&release, cudaStreamNonBlocking));
  cudaEvent_t order_event = nullptr;
  const cudaError_t event_error =
      cudaEventCreateWithFlags(&order_event, cudaEventDisableTiming);
  if (event_error != cudaSuccess) {
    PLATEAU_CUDA_REPORT(cudaStreamDestroy(release));
    return CudaStatus(event_error, "cudaEventCreateWithFlags", __FILE__,
                      __LINE__);
  }
  auto order =
      std::make_unique<ReleaseOrder>(options.device_index, release, order_event);
  cudaMemPoolProps props = {};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = options.device_index;
  cudaMemPool_t pool = nullptr;
  PLATEAU_CUDA_RETURN_IF_ERROR(cudaMemPoolCreate(&pool, &props));
  // Freed memory stays in the pool (reused by the next allocation) instead
  // of going back to the driver at every synchronisation.
  uint64_t keep = UINT64_MAX;
  const cudaError_t keep_error =
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
  if (keep_error != cudaSuccess) {
    PLATEAU_CUDA_REPORT(cudaMemPoolDestroy(pool));
    return CudaStatus(keep_error, "cudaMemPoolSetAttribute(ReleaseThreshold)",
                      __FILE__, __LINE__);
  }
  return std::make_unique<CudaBackend>(options, prop, std::move(order), pool);
}

}  // namespace plateau
