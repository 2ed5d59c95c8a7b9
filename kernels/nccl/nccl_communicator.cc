#include "kernels/nccl/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kernels/cuda/stream_errors.h"
#include "kernels/status_macros.h"

namespace plateau {
namespace {

absl::Status CudaError(cudaError_t e, absl::string_view what) {
  // Clear the thread's last-error slot: a non-sticky error left there would
  // be blamed on the next kernel launch of whoever checks it.
  (void)cudaGetLastError();
  std::string msg = absl::StrCat(what, ": CUDA error ", static_cast<int>(e),
                                 " (", cudaGetErrorName(e), "): ",
                                 cudaGetErrorString(e));
  if (e == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(msg);
  }
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ||
      e == cudaErrorInvalidDevice) {
    return absl::FailedPreconditionError(msg);
  }
  return absl::InternalError(msg);
}

#define PLATEAU_CUDA_RETURN_IF_ERROR(expr, what) \
  do {                                           \
    cudaError_t plateau_cuda_e_ = (expr);        \
    if (plateau_cuda_e_ != cudaSuccess) {        \
      return CudaError(plateau_cuda_e_, what);   \
    }                                            \
  } while (0)

absl::StatusCode NcclCode(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return absl::StatusCode::kOk;
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::StatusCode::kInvalidArgument;
    case ncclSystemError:
    case ncclRemoteError:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::Status NcclError(ncclResult_t r, ncclComm_t comm,
                       absl::string_view what) {
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  return absl::Status(
      NcclCode(r),
      absl::StrCat(what, ": NCCL error ", static_cast<int>(r), " (",
                   ncclGetErrorString(r), ")",
                   last != nullptr && last[0] != '\0'
                       ? absl::StrCat(": ", last)
                       : std::string()));
}

// Makes `device` current on this thread for the guard's lifetime.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    status_ = cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

ncclDataType_t NcclType(DataType type) {
  switch (type) {
    case DataType::kFloat32:
      return ncclFloat32;
    case DataType::kFloat64:
      return ncclFloat64;
    case DataType::kInt32:
      return ncclInt32;
    case DataType::kInt64:
      return ncclInt64;
    case DataType::kBfloat16:
      return ncclBfloat16;  // fp32 combine, one rounding per step: communicator.h
  }
  return ncclFloat32;
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  return ncclSum;
}

// Waits (up to `deadline`) until a non-blocking communicator has finished
// the operation that returned ncclInProgress.
ncclResult_t AwaitComm(ncclComm_t comm, absl::Time deadline) {
  absl::Duration backoff = absl::Microseconds(20);
  for (;;) {
    ncclResult_t state = ncclInProgress;
    ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (absl::Now() >= deadline) return ncclInProgress;
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(5));
  }
}

struct Shared {
  std::shared_ptr<KeyValueStore> store;
  absl::Duration timeout;
  int device = 0;
};

// Creates an NCCL communicator of `size` ranks whose unique id lives under
// `key_prefix` (rank 0 publishes it).
absl::StatusOr<ncclComm_t> InitComm(const Shared& shared,
                                    const std::string& key_prefix, int rank,
                                    int size, const std::string& context) {
  auto fail = [&](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(context, ": ", s.message()));
  };
  DeviceGuard guard(shared.device);
  if (guard.status() != cudaSuccess) {
    return fail(CudaError(guard.status(),
                          absl::StrCat("cudaSetDevice(", shared.device, ")")));
  }
  const std::string key = absl::StrCat(key_prefix, "/nccl_unique_id");
  ncclUniqueId id;
  if (rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) return fail(NcclError(r, nullptr, "ncclGetUniqueId"));
    absl::Status s = shared.store->Set(
        key, std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
    if (!s.ok()) return fail(s);
  } else {
    absl::StatusOr<std::string> v = shared.store->Get(key, shared.timeout);
    if (!v.ok()) return fail(v.status());
    if (v->size() != sizeof(id)) {
      return fail(absl::DataLossError(
          absl::StrCat("key '", key, "' holds ", v->size(),
                       " bytes, not an NCCL unique id (", sizeof(id), ")")));
    }
    std::memcpy(&id, v->data(), sizeof(id));
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every wait below is bounded by the timeout
  ncclComm_t comm = nullptr;
  const absl::Time deadline = absl::Now() + shared.timeout;
  ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  if (r == ncclInProgress) r = AwaitComm(comm, deadline);
  if (r == ncclInProgress) {
    ncclCommAbort(comm);
    return fail(absl::DeadlineExceededError(absl::StrCat(
        "NCCL initialisation did not complete within ",
        absl::FormatDuration(shared.timeout), " (a rank did not join)")));
  }
  if (r != ncclSuccess) {
    absl::Status s = NcclError(r, comm, "ncclCommInitRankConfig");
    if (comm != nullptr) ncclCommAbort(comm);
    return fail(s);
  }
  return comm;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::string name, int rank, std::vector<int> members,
                   std::shared_ptr<Shared> shared, std::string key_prefix,
                   ncclComm_t comm, int* scratch)
      : Communicator(BackendKind::kCuda, std::move(name), rank,
                     std::move(members)),
        shared_(std::move(shared)),
        key_prefix_(std::move(key_prefix)),
        comm_(comm),
        scratch_(scratch),
        watchdog_([this] { WatchdogLoop(); }) {}

  ~NcclCommunicator() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    watchdog_.join();
    DeviceGuard guard(shared_->device);
    {
      absl::MutexLock comm_lock(&comm_mu_);
      if (!aborted_) {  // else the watchdog or a failed call aborted it
        absl::Status failure;
        {
          absl::MutexLock lock(&mu_);
          failure = broken_;
        }
        if (failure.ok()) {
          // Flushes enqueued work (bounded); a communicator that cannot
          // finish in time, or already failed, is aborted instead.
          ncclResult_t r = ncclCommFinalize(comm_);
          if (r == ncclInProgress) r = AwaitComm(comm_, absl::Now() + shared_->timeout);
          if (r == ncclInProgress) {
            failure = absl::DeadlineExceededError(absl::StrCat(
                "the communicator was destroyed with collectives that did not finish within ",
                absl::FormatDuration(shared_->timeout), "; it was aborted"));
          } else if (r != ncclSuccess) {
            failure = NcclError(r, comm_, "ncclCommFinalize (the communicator was aborted)");
          }
        }
        if (failure.ok()) {
          ncclCommDestroy(comm_);
        } else {
          AbortLocked(failure, nullptr);
        }
      }
    }
    absl::MutexLock lock(&mu_);
    for (const Watched& w : watched_) {
      cudaEventDestroy(w.start);
      cudaEventDestroy(w.end);
    }
    watched_.clear();
    for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
    spare_events_.clear();
    cudaFree(scratch_);
  }

 protected:
  absl::Status DoAllReduce(Stream& stream, const void* send, void* recv,
                           size_t count, DataType type,
                           ReduceOp op) override {
    return Call("all_reduce", stream, [&] {
      return ncclAllReduce(send, recv, count, NcclType(type), NcclOp(op),
                           comm_, Native(stream));
    });
  }

  absl::Status DoReduceScatter(Stream& stream, const void* send, void* recv,
                               size_t recv_count, DataType type,
                               ReduceOp op) override {
    return Call("reduce_scatter", stream, [&] {
      return ncclReduceScatter(send, recv, recv_count, NcclType(type),
                               NcclOp(op), comm_, Native(stream));
    });
  }

  absl::Status DoAllGather(Stream& stream, const void* send, void* recv,
                           size_t send_count, DataType type) override {
    return Call("all_gather", stream, [&] {
      return ncclAllGather(send, recv, send_count, NcclType(type), comm_,
                           Native(stream));
    });
  }

  absl::Status DoAllToAllV(Stream& stream, const void* send,
                           absl::Span<const int64_t> send_counts, void* recv,
                           absl::Span<const int64_t> recv_counts,
                           DataType type) override {
    PLATEAU_RETURN_IF_ERROR(CheckUsable("all_to_all_v"));
    const size_t elem = DataTypeSize(type);
    const char* in = static_cast<const char*>(send);
    char* out = static_cast<char*>(recv);
    cudaStream_t s = Native(stream);
    std::vector<size_t> send_off(size()), recv_off(size());
    for (int r = 1; r < size(); ++r) {
      send_off[r] = send_off[r - 1] + send_counts[r - 1] * elem;
      recv_off[r] = recv_off[r - 1] + recv_counts[r - 1] * elem;
    }
    // This rank's block to itself is a device copy, ordered on the stream.
    if (send_counts[rank()] > 0) {
      DeviceGuard guard(shared_->device);
      PLATEAU_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(out + recv_off[rank()], in + send_off[rank()],
                          send_counts[rank()] * elem, cudaMemcpyDeviceToDevice,
                          s),
          Describe("all_to_all_v"));
    }
    return Grouped("all_to_all_v", stream, [&]() -> ncclResult_t {
      for (int p = 0; p < size(); ++p) {
        if (p == rank()) continue;
        if (send_counts[p] > 0) {
          ncclResult_t r = ncclSend(in + send_off[p], send_counts[p],
                                    NcclType(type), p, comm_, s);
          if (r != ncclSuccess && r != ncclInProgress) return r;
        }
        if (recv_counts[p] > 0) {
          ncclResult_t r = ncclRecv(out + recv_off[p], recv_counts[p],
                                    NcclType(type), p, comm_, s);
          if (r != ncclSuccess && r != ncclInProgress) return r;
        }
      }
      return ncclSuccess;
    });
  }

  absl::Status DoBroadcast(Stream& stream, void* data, size_t count,
                           DataType type, int root) override {
    return Call("broadcast", stream, [&] {
      return ncclBroadcast(data, data, count, NcclType(type), root, comm_,
                           Native(stream));
    });
  }

  absl::Status DoSendRecv(Stream& stream, const void* send, size_t send_count,
                          int dst, void* recv, size_t recv_count, int src,
                          DataType type) override {
    PLATEAU_RETURN_IF_ERROR(CheckUsable("send_recv"));
    cudaStream_t s = Native(stream);
    if (dst == rank()) {  // a ring of one (validated: src == dst, same size)
      DeviceGuard guard(shared_->device);
      PLATEAU_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(recv, send, send_count * DataTypeSize(type),
                          cudaMemcpyDeviceToDevice, s),
          Describe("send_recv"));
      return absl::OkStatus();
    }
    return Grouped("send_recv", stream, [&]() -> ncclResult_t {
      if (send_count > 0) {
        ncclResult_t r =
            ncclSend(send, send_count, NcclType(type), dst, comm_, s);
        if (r != ncclSuccess && r != ncclInProgress) return r;
      }
      if (recv_count > 0) {
        ncclResult_t r =
            ncclRecv(recv, recv_count, NcclType(type), src, comm_, s);
        if (r != ncclSuccess && r != ncclInProgress) return r;
      }
      return ncclSuccess;
    });
  }

  absl::Status DoBarrier(Stream& stream) override {
    // NCCL has no barrier: a one-element all-reduce completes on a rank's
    // stream only after every rank has contributed.
    return Call("barrier", stream, [&] {
      return ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_,
                           Native(stream));
    });
  }

  absl::StatusOr<std::unique_ptr<Communicator>> DoGroup(
      const std::string& name, const std::vector<int>& ranks,
      std::vector<int> world_members) override {
    const int group_rank = static_cast<int>(
        std::find(ranks.begin(), ranks.end(), rank()) - ranks.begin());
    const std::string id =
        absl::StrCat(name, "[", absl::StrJoin(world_members, ","), "]");
    int incarnation;
    {
      absl::MutexLock lock(&mu_);
      incarnation = groups_made_[id]++;
    }
    const std::string prefix =
        absl::StrCat(key_prefix_, "/", id, "#", incarnation);
    return Make(name, group_rank, std::move(world_members), shared_, prefix,
                absl::StrCat("rendezvous of group '", name, "' (rank ",
                             group_rank, " of ", ranks.size(), ", from rank ",
                             rank(), " of '", this->name(), "')"));
  }

 public:
  static absl::StatusOr<std::unique_ptr<Communicator>> Make(
      const std::string& name, int rank, std::vector<int> members,
      std::shared_ptr<Shared> shared, const std::string& key_prefix,
      const std::string& context) {
    int* scratch = nullptr;
    {
      DeviceGuard guard(shared->device);
      if (guard.status() != cudaSuccess) {
        return CudaError(guard.status(),
                         absl::StrCat(context, ": cudaSetDevice(",
                                      shared->device, ")"));
      }
      PLATEAU_CUDA_RETURN_IF_ERROR(
          cudaMalloc(reinterpret_cast<void**>(&scratch), sizeof(int)),
          absl::StrCat(context, ": barrier scratch"));
      // Barrier all-reduces it; zeroed so that no rank ever reads
      // uninitialised memory (compute-sanitizer's initcheck).
      // cudaMemset runs on the legacy stream, which the barrier's
      // non-blocking stream does not wait for: synchronised here (once, at
      // creation) so that its first all-reduce reads the zero.
      cudaError_t zeroed = cudaMemset(scratch, 0, sizeof(int));
      if (zeroed == cudaSuccess) zeroed = cudaDeviceSynchronize();
      if (zeroed != cudaSuccess) {
        cudaFree(scratch);
        return CudaError(zeroed, absl::StrCat(context, ": barrier scratch"));
      }
    }
    absl::StatusOr<ncclComm_t> comm =
        InitComm(*shared, key_prefix, rank, static_cast<int>(members.size()),
                 context);
    if (!comm.ok()) {
      cudaFree(scratch);
      return comm.status();
    }
    return std::unique_ptr<Communicator>(
        new NcclCommunicator(name, rank, std::move(members), std::move(shared),
                             key_prefix, *comm, scratch));
  }

 private:
  static cudaStream_t Native(Stream& stream) {
    return static_cast<cudaStream_t>(stream.native_handle());
  }

  absl::Status CheckUsable(const char* op) {
    absl::MutexLock lock(&mu_);
    if (broken_.ok()) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat(Describe(op), ": the communicator is unusable after an "
                                   "earlier failure: ",
                     broken_.message()));
  }

  // Records the first failure; the communicator is unusable from then on.
  absl::Status Failed(const char* op, absl::Status s) {
    s = absl::Status(s.code(), absl::StrCat(Describe(op), ": ", s.message()));
    absl::MutexLock lock(&mu_);
    if (broken_.ok()) broken_ = s;
    return s;
  }

  // Finishes a call on the non-blocking communicator: ncclInProgress means
  // "still being enqueued"; wait for it within the timeout.
  absl::Status Finish(const char* op, ncclResult_t r) {
    if (r == ncclInProgress) {
      r = AwaitComm(comm_, absl::Now() + shared_->timeout);
      if (r == ncclInProgress) {
        return Failed(op, absl::DeadlineExceededError(absl::StrCat(
                              "NCCL did not accept the call within ",
                              absl::FormatDuration(shared_->timeout))));
      }
    }
    if (r != ncclSuccess) return Failed(op, NcclError(r, comm_, "nccl"));
    return absl::OkStatus();
  }

  // One collective: `f` enqueues it on `stream`, between two events the
  // watchdog reads. comm_mu_ keeps the watchdog's abort from freeing the
  // communicator under the call.
  template <typename F>
  absl::Status Call(const char* op, Stream& stream, F&& f) {
    // Checked before comm_mu_ too: a broken communicator fails the call at
    // once, even while the watchdog still holds comm_mu_ for its abort.
    PLATEAU_RETURN_IF_ERROR(CheckUsable(op));
    absl::MutexLock comm_lock(&comm_mu_);
    PLATEAU_RETURN_IF_ERROR(CheckUsable(op));
    DeviceGuard guard(shared_->device);
    PLATEAU_ASSIGN_OR_RETURN(cudaEvent_t start, MarkStart(op, stream));
    absl::Status s = Finish(op, f());
    return Watch(op, stream, start, s);
  }

  // Runs `f` (ncclSend/ncclRecv calls) inside ncclGroupStart/End, as Call.
  template <typename F>
  absl::Status Grouped(const char* op, Stream& stream, F&& f) {
    PLATEAU_RETURN_IF_ERROR(CheckUsable(op));
    absl::MutexLock comm_lock(&comm_mu_);
    PLATEAU_RETURN_IF_ERROR(CheckUsable(op));
    DeviceGuard guard(shared_->device);
    PLATEAU_ASSIGN_OR_RETURN(cudaEvent_t start, MarkStart(op, stream));
    ncclResult_t r = ncclGroupStart();
    absl::Status s;
    if (r != ncclSuccess) {
      s = Failed(op, NcclError(r, comm_, "ncclGroupStart"));
    } else {
      ncclResult_t inner = f();
      r = ncclGroupEnd();  // always close the group, even after an error
      s = inner != ncclSuccess ? Failed(op, NcclError(inner, comm_, "nccl"))
                               : Finish(op, r);
    }
    return Watch(op, stream, start, s);
  }

  // ---- The watchdog -------------------------------------------------------
  //
  // NCCL reports a peer that died or never arrived only asynchronously, and
  // a kernel waiting for it blocks its stream for ever. So every collective
  // is bracketed by two events on its stream; a thread per communicator
  // polls the oldest one: once its start event has completed, the
  // collective has begun and has options.timeout to finish; while it runs,
  // ncclCommGetAsyncError is polled. On an asynchronous error or a missed
  // deadline the watchdog aborts the communicator (ncclCommAbort, which
  // makes the stuck kernels return), marks it broken (later calls fail with
  // FAILED_PRECONDITION quoting the error) and fails every stream with a
  // collective still in flight (stream_errors.h): their Synchronize returns
  // the status instead of hanging. The data those collectives produced is
  // garbage; the job attempt is over, as communicator.h says.

  struct Watched {
    const char* op;
    cudaStream_t stream;
    cudaEvent_t start;
    cudaEvent_t end;
    absl::Time started = absl::InfiniteFuture();  // when start was seen done
  };

  absl::StatusOr<cudaEvent_t> TakeEvent() {
    {
      absl::MutexLock lock(&mu_);
      if (!spare_events_.empty()) {
        cudaEvent_t e = spare_events_.back();
        spare_events_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    PLATEAU_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "watchdog event");
    return e;
  }

  absl::StatusOr<cudaEvent_t> MarkStart(const char* op, Stream& stream) {
    absl::StatusOr<cudaEvent_t> start = TakeEvent();
    if (!start.ok()) return Failed(op, start.status());
    const cudaError_t e = cudaEventRecord(*start, Native(stream));
    if (e != cudaSuccess) {
      cudaEventDestroy(*start);
      return Failed(op, CudaError(e, "cudaEventRecord (watchdog start)"));
    }
    return *start;
  }

  // Hands the enqueued collective to the watchdog; `s` is the enqueue's own
  // status. A failed enqueue ends the communicator here (AbortLocked), its
  // stream failed with it: NCCL may have enqueued part of it, or still be
  // enqueuing it (a non-blocking call that did not finish in time: NCCL
  // 2.22+ connects peers at a collective's first call, so a peer that never
  // comes shows here), and a kernel it puts on the stream later would wait
  // for ever, or return garbage once aborted.
  absl::Status Watch(const char* op, Stream& stream, cudaEvent_t start, absl::Status s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(comm_mu_) {
    if (!s.ok()) {
      {
        absl::MutexLock lock(&mu_);
        spare_events_.push_back(start);
      }
      AbortLocked(s, Native(stream));
      return s;
    }
    absl::StatusOr<cudaEvent_t> end = TakeEvent();
    cudaError_t e = end.ok() ? cudaEventRecord(*end, Native(stream))
                             : cudaErrorMemoryAllocation;
    if (e != cudaSuccess) {  // enqueued, but it could not be watched
      if (end.ok()) cudaEventDestroy(*end);
      {
        absl::MutexLock lock(&mu_);
        spare_events_.push_back(start);
      }
      const absl::Status failed =
          Failed(op, end.ok() ? CudaError(e, "cudaEventRecord (watchdog end)") : end.status());
      AbortLocked(failed, Native(stream));
      return failed;
    }
    absl::MutexLock lock(&mu_);
    watched_.push_back(Watched{op, Native(stream), start, *end});
    return absl::OkStatus();
  }

  void WatchdogLoop() {
    DeviceGuard guard(shared_->device);
    absl::MutexLock lock(&mu_);
    for (;;) {
      // 1 ms while collectives are in flight, idle otherwise; Watch and the
      // destructor wake it.
      auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !watched_.empty();
      };
      if (watched_.empty()) {
        mu_.Await(absl::Condition(&wake));
      } else {
        mu_.AwaitWithTimeout(absl::Condition(&stopping_),
                             absl::Milliseconds(1));
      }
      if (stopping_) return;
      absl::Status failure = PollLocked();
      if (failure.ok()) continue;
      // Abort outside mu_ (callers hold comm_mu_ then mu_; ncclCommAbort
      // can take a while) but under comm_mu_, so no call is inside NCCL or
      // adds a collective to watch.
      mu_.Unlock();
      {
        absl::MutexLock comm_lock(&comm_mu_);
        AbortLocked(failure, nullptr);
      }
      mu_.Lock();
      return;  // nothing more to watch: later calls fail in CheckUsable
    }
  }

  // Retires finished collectives; returns the failure that ends the
  // communicator (OK while all is well) and marks it broken. Every
  // collective in flight is checked, not only the oldest: collectives on
  // different streams may start out of enqueue order.
  absl::Status PollLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time now = absl::Now();
    for (auto it = watched_.begin(); it != watched_.end();) {
      cudaError_t e = cudaEventQuery(it->end);
      if (e == cudaSuccess) {
        spare_events_.push_back(it->start);
        spare_events_.push_back(it->end);
        it = watched_.erase(it);
        continue;
      }
      if (e == cudaErrorNotReady && it->started == absl::InfiniteFuture()) {
        e = cudaEventQuery(it->start);
        if (e == cudaSuccess) it->started = now;
      }
      if (e != cudaSuccess && e != cudaErrorNotReady) {
        return BreakLocked(it->op, CudaError(e, "the collective's stream"));
      }
      if (now - it->started > shared_->timeout) {
        return BreakLocked(
            it->op,
            absl::DeadlineExceededError(absl::StrCat(
                "the collective did not complete within ",
                absl::FormatDuration(shared_->timeout),
                " of starting (a peer is dead, stalled, or did not issue the "
                "same collective); the communicator was aborted")));
      }
      ++it;
    }
    if (watched_.empty()) return absl::OkStatus();
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) state = r;
    if (state != ncclSuccess && state != ncclInProgress) {
      return BreakLocked(watched_.front().op,
                         NcclError(state, comm_,
                                   "asynchronous NCCL error (a peer failed or "
                                   "the network broke)"));
    }
    return absl::OkStatus();
  }

  // Ends the communicator after `failure` (once; later calls do nothing):
  // marks it broken (the first failure stays its reason), fails every
  // stream with a collective not yet finished and `also` (if not null) with
  // that reason, then aborts it, which lets stuck kernels return.
  // - The streams fail before the abort: a Synchronize that found its
  //   stream drained with no error recorded yet would report success for
  //   garbage (the emulated NCCL showed it: with a 50 ms pause between the
  //   two, the watchdog test's Synchronize returned OK).
  // - The watched collectives leave watched_ in the same critical section:
  //   the watchdog polls comm_ (ncclCommGetAsyncError) holding only mu_,
  //   and only while watched_ is not empty, so it never touches comm_
  //   during or after the abort, which frees it.
  void AbortLocked(const absl::Status& failure, cudaStream_t also)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(comm_mu_) ABSL_LOCKS_EXCLUDED(mu_) {
    if (aborted_) return;
    std::deque<Watched> unwatched;
    {
      absl::MutexLock lock(&mu_);
      if (broken_.ok()) broken_ = failure;
      for (const Watched& w : watched_) {
        if (cudaEventQuery(w.end) != cudaSuccess) (void)FailCudaStream(w.stream, broken_);
      }
      if (also != nullptr) (void)FailCudaStream(also, broken_);
      unwatched.swap(watched_);
    }
    ncclCommAbort(comm_);
    aborted_ = true;
    for (const Watched& w : unwatched) {
      cudaEventDestroy(w.start);
      cudaEventDestroy(w.end);
    }
  }

  absl::Status BreakLocked(const char* op, const absl::Status& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::Status named(s.code(), absl::StrCat(Describe(op), ": ", s.message()));
    if (broken_.ok()) broken_ = named;
    return named;
  }

  const std::shared_ptr<Shared> shared_;
  const std::string key_prefix_;
  // Held while a call is inside NCCL and while the watchdog aborts; taken
  // before mu_ when both are held.
  absl::Mutex comm_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  ncclComm_t comm_;
  bool aborted_ ABSL_GUARDED_BY(comm_mu_) = false;
  int* const scratch_;

  absl::Mutex mu_;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> groups_made_ ABSL_GUARDED_BY(mu_);
  std::deque<Watched> watched_ ABSL_GUARDED_BY(mu_);
  std::vector<cudaEvent_t> spare_events_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread watchdog_;  // last: started once everything above exists
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    const CommunicatorOptions& options) {
  auto shared = std::make_shared<Shared>();
  shared->store = options.store;
  shared->timeout = options.timeout;
  shared->device = options.device_index;
  std::vector<int> members(options.size);
  for (int i = 0; i < options.size; ++i) members[i] = i;
  return NcclCommunicator::Make(
      "world", options.rank, std::move(members), std::move(shared),
      absl::StrCat(options.prefix, "/world"),
      absl::StrCat("rendezvous of group 'world' (rank ", options.rank, " of ",
                   options.size, ")"));
}

}  // namespace plateau
