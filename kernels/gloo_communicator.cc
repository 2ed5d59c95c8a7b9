#include "kernels/gloo_communicator.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/alltoallv.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/transport/device.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/tcp/loop.h"
#include "gloo/transport/unbound_buffer.h"
#include "gloo/types.h"
#include "kernels/bf16.h"
#include "kernels/cpu_stream.h"
#include "kernels/gloo_kv_store.h"
#include "kernels/status_macros.h"

namespace plateau {
namespace {

// Slot prefixes of our own algorithms. Gloo's collectives use 0x01..0x08
// (gloo/types.h); a slot is prefix << 56 | tag << 24, so ours never meet
// theirs.
constexpr uint8_t kReduceScatterSlotPrefix = 0x40;
constexpr uint8_t kSendRecvSlotPrefix = 0x41;
constexpr uint8_t kAllGatherSlotPrefix = 0x42;
// The most of a block the ring reduce-scatter moves at once (its scratch is
// two of these): large enough that a message's latency is small beside its
// transfer, small enough that the scratch is no concern at any model size.
constexpr size_t kReduceScatterSegmentBytes = size_t{4} << 20;
// All-gathers of blocks up to this size go direct (DirectAllGather): one
// message delay instead of the ring's P - 1 in sequence. They are the small,
// latency-bound ones (PipelinedLLEP gathers every rank's routing counts per
// layer: E int64 per rank); larger blocks keep Gloo's ring, one peer in
// flight per rank at a time.
constexpr size_t kDirectAllGatherMaxBytes = size_t{64} << 10;
// The barrier that ends a rendezvous; collectives take tags from 1.
constexpr uint32_t kRendezvousTag = 0;

std::chrono::milliseconds ToChrono(absl::Duration d) {
  return std::chrono::milliseconds(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(d)));
}

// --- Reductions ------------------------------------------------------------
// Elementwise out = a op b (out may alias a or b). Integer sums wrap (two's
// complement) instead of overflowing into undefined behaviour.

template <typename T>
T Add(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}

template <typename T, ReduceOp kOp>
void ReduceInto(void* out, const void* a, const void* b, size_t n) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) {
    if constexpr (kOp == ReduceOp::kSum) {
      o[i] = Add(x[i], y[i]);
    } else if constexpr (kOp == ReduceOp::kMax) {
      o[i] = x[i] < y[i] ? y[i] : x[i];
    } else {
      o[i] = y[i] < x[i] ? y[i] : x[i];
    }
  }
}

// bf16: both operands loaded exactly, combined in fp32, the result rounded
// once (communicator.h); max / min compare the loaded values and keep the
// chosen operand's bits.
template <ReduceOp kOp>
void ReduceBf16Into(void* out, const void* a, const void* b, size_t n) {
  Bf16* o = static_cast<Bf16*>(out);
  const Bf16* x = static_cast<const Bf16*>(a);
  const Bf16* y = static_cast<const Bf16*>(b);
  for (size_t i = 0; i < n; ++i) {
    const float fx = Bf16ToFloat(x[i]), fy = Bf16ToFloat(y[i]);
    if constexpr (kOp == ReduceOp::kSum) {
      o[i] = FloatToBf16(fx + fy);
    } else if constexpr (kOp == ReduceOp::kMax) {
      o[i] = fx < fy ? y[i] : x[i];
    } else {
      o[i] = fy < fx ? y[i] : x[i];
    }
  }
}

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

template <typename T>
ReduceFn ReduceFor(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return &ReduceInto<T, ReduceOp::kSum>;
    case ReduceOp::kMax:
      return &ReduceInto<T, ReduceOp::kMax>;
    case ReduceOp::kMin:
      return &ReduceInto<T, ReduceOp::kMin>;
  }
  return nullptr;
}

ReduceFn ReduceFor(DataType type, ReduceOp op) {
  switch (type) {
    case DataType::kFloat32:
      return ReduceFor<float>(op);
    case DataType::kFloat64:
      return ReduceFor<double>(op);
    case DataType::kInt32:
      return ReduceFor<int32_t>(op);
    case DataType::kInt64:
      return ReduceFor<int64_t>(op);
    case DataType::kBfloat16:
      switch (op) {
        case ReduceOp::kSum:
          return &ReduceBf16Into<ReduceOp::kSum>;
        case ReduceOp::kMax:
          return &ReduceBf16Into<ReduceOp::kMax>;
        case ReduceOp::kMin:
          return &ReduceBf16Into<ReduceOp::kMin>;
      }
      return nullptr;
  }
  return nullptr;
}

// Calls f(T{}) with the C++ type of `type` (validated by the caller).
template <typename F>
void WithType(DataType type, F&& f) {
  switch (type) {
    case DataType::kFloat32:
      return f(float{});
    case DataType::kFloat64:
      return f(double{});
    case DataType::kInt32:
      return f(int32_t{});
    case DataType::kInt64:
      return f(int64_t{});
    case DataType::kBfloat16:
      return f(Bf16{});
  }
}

// --- Exceptions to status --------------------------------------------------

bool LooksLikeTimeout(absl::string_view what) {
  const std::string lower = absl::AsciiStrToLower(what);
  return absl::StrContains(lower, "timed out") ||
         absl::StrContains(lower, "timeout");
}

// Runs `fn`, turning anything Gloo (or the store adapter) throws into a
// status prefixed with `context`. Nothing escapes.
absl::Status CatchAll(const std::string& context,
                      const std::function<void()>& fn) {
  absl::Status s;
  try {
    fn();
    return absl::OkStatus();
  } catch (const KeyValueStoreError& e) {
    s = e.status();
  } catch (const gloo::IoException& e) {
    s = LooksLikeTimeout(e.what()) ? absl::DeadlineExceededError(e.what())
                                   : absl::UnavailableError(e.what());
  } catch (const gloo::EnforceNotMet& e) {
    s = absl::InternalError(absl::StrCat("gloo check failed: ", e.what()));
  } catch (const std::exception& e) {
    s = absl::InternalError(absl::StrCat("gloo: ", e.what()));
  } catch (...) {
    s = absl::InternalError("gloo threw a non-standard exception");
  }
  return absl::Status(s.code(), absl::StrCat(context, ": ", s.message()));
}

// --- Gloo's TCP device, one per process and hostname -----------------------
//
// A Gloo TCP device owns one event-loop thread, and that loop wakes on a
// socket event or every 10 ms (its epoll timeout). Two of its waits cost a
// tick each when nothing else wakes it, and both are pure idle time on the
// CPU backend:
//  - destroying a device joins the loop thread, which sees its stop flag
//    only at the next tick: up to 10 ms per communicator created;
//  - closing a pair (every pair of a context, one after the other, when the
//    context goes) waits for the loop's next tick, so that the loop no
//    longer calls into the pair: up to (P - 1) x 10 ms per context.
// A test or bench that makes a fresh world per case spent most of its wall
// time there (step_oom_test: both cores ~75% idle). So the device lives for
// the process, one per hostname, shared by every communicator on it. A rank
// process (worker/rank_main.cc, train_main's ranks) makes one world, so
// there it is the device it had anyway; ranks that are threads of one
// process (tests, benches) share its one loop thread, where separate
// processes would have one each. (Measured alternative: one device per
// hostname and world rank, reused by later worlds, ran composed_bench's
// second and later worlds at about half speed, for a reason not found;
// one device, or a fresh one per world, did not slow down. BENCHMARKS.md.)
// And teardown rings a bell: an eventfd on the loop, kept readable while a
// context is being destroyed, so the loop runs through its iterations
// without waiting and each pair's close returns within one iteration. (Not
// covered: a rendezvous that throws inside Gloo's connectFullMesh closes
// its half-made pairs while the exception unwinds, before we can ring; that
// failure path keeps the ticks.)
class TeardownBell final : public gloo::transport::tcp::Handler {
 public:
  // Level-triggered: the loop calls this on every iteration while the
  // counter is above zero; it must not read it (that is Quiet's job). The
  // yield hands the core to the closing threads: without it the spinning
  // loop held one of two cores and a close still took ~3.5 ms (world_bench).
  void handleEvents(int /*events*/) override { sched_yield(); }

  int fd() const { return fd_; }

  // The counter is a semaphore (EFD_SEMAPHORE): each Ring adds one, each
  // Quiet takes one, so overlapping teardowns on one device (ranks that are
  // threads of one process) keep the bell ringing until the last ends. A
  // failed write or read can only end someone's ringing early: slower,
  // never wrong.
  void Ring() {
    const uint64_t one = 1;
    (void)!::write(fd_, &one, sizeof(one));
  }
  void Quiet() {
    uint64_t one;
    (void)!::read(fd_, &one, sizeof(one));
  }

  // Rings for the lifetime of the scope.
  class Ringing {
   public:
    explicit Ringing(TeardownBell* bell) : bell_(bell) {
      if (bell_ != nullptr) bell_->Ring();
    }
    ~Ringing() {
      if (bell_ != nullptr) bell_->Quiet();
    }
    Ringing(const Ringing&) = delete;
    Ringing& operator=(const Ringing&) = delete;

   private:
    TeardownBell* bell_;
  };

  // Registered on `device`'s loop; null (teardown is then only slower)
  // when no eventfd can be made or the loop refuses it.
  static TeardownBell* RegisterOn(gloo::transport::tcp::Device& device) {
    const int fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK | EFD_SEMAPHORE);
    if (fd < 0) return nullptr;
    auto* bell = new TeardownBell(fd);
    try {
      device.registerDescriptor(fd, EPOLLIN, bell);
    } catch (...) {
      ::close(fd);
      delete bell;
      return nullptr;
    }
    return bell;  // lives as long as its device: the process
  }

 private:
  explicit TeardownBell(int fd) : fd_(fd) {}
  const int fd_;
};

struct SharedDevice {
  std::shared_ptr<gloo::transport::tcp::Device> device;
  TeardownBell* bell = nullptr;  // null if none could be registered
};

// The process's devices, made on first use and never destroyed (leaked:
// their loop threads end with the process).
struct Devices {
  absl::Mutex mu;
  std::map<std::string, SharedDevice> by_hostname ABSL_GUARDED_BY(mu);
  int64_t made ABSL_GUARDED_BY(mu) = 0;
};

std::atomic<Devices*> devices{nullptr};

// A child forked after devices exist has their maps and fds but not their
// loop threads (fork copies only the calling thread), and maybe a mutex some
// other thread held: it starts over with none (the parent's are leaked).
void ForgetDevicesInForkedChild() { devices.store(new Devices()); }

Devices& TheDevices() {
  static const bool registered = [] {
    devices.store(new Devices());
    pthread_atfork(nullptr, nullptr, ForgetDevicesInForkedChild);
    return true;
  }();
  (void)registered;
  return *devices.load();
}

// The device for `hostname`. Throws as CreateDevice does.
SharedDevice DeviceFor(const std::string& hostname) {
  Devices& all = TheDevices();
  absl::MutexLock lock(&all.mu);
  SharedDevice& d = all.by_hostname[hostname];
  if (d.device == nullptr) {
    gloo::transport::tcp::attr attr;
    attr.hostname = hostname;
    auto device = std::dynamic_pointer_cast<gloo::transport::tcp::Device>(
        gloo::transport::tcp::CreateDevice(attr));
    d.bell = TeardownBell::RegisterOn(*device);
    d.device = std::move(device);
    ++all.made;
  }
  return d;
}

// Gloo writes to its sockets with writev, which raises SIGPIPE when the
// peer has closed the connection (a rank that ran out of memory, crashed or
// was cancelled) and the write comes before the event loop has seen the
// close. Gloo's usual host, Python, ignores SIGPIPE at startup; a C++
// process with the default action dies (exit 141) instead of failing the
// collective with UNAVAILABLE. So the first communicator of a process
// ignores SIGPIPE, unless the program installed a handler of its own.
// Nothing in a rank or a test wants the signal: writes to a closed pipe or
// socket then fail with EPIPE, which every caller already reports.
void IgnoreSigpipeUnlessHandled() {
  static absl::once_flag once;
  absl::call_once(once, [] {
    struct sigaction current;
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      struct sigaction ignore = {};
      ignore.sa_handler = SIG_IGN;
      sigemptyset(&ignore.sa_mask);
      ::sigaction(SIGPIPE, &ignore, nullptr);
    }
  });
}

// --- State shared by a world and the groups made from it ------------------

struct Transport {
  std::shared_ptr<KeyValueStore> store;
  SharedDevice device;
  absl::Duration timeout;
};

// Connects a full mesh of `size` ranks whose keys live under `prefix`.
absl::StatusOr<std::shared_ptr<gloo::Context>> Connect(
    const Transport& transport, const std::string& prefix, int rank, int size,
    const std::string& context) {
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  absl::Status s = CatchAll(context, [&] {
    // The store's deadline starts now: connectFullMesh's waits for its
    // peers' keys, one after the other, share one timeout.
    GlooStoreAdapter adapter(transport.store, transport.timeout);
    ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
    ctx->setTimeout(ToChrono(transport.timeout));
    gloo::rendezvous::PrefixStore store(prefix, adapter);
    std::shared_ptr<gloo::transport::Device> device = transport.device.device;
    ctx->connectFullMesh(store, device);
    // connectFullMesh can return on one rank while a peer is still
    // connecting; if the first then exits, the peer's rendezvous fails with
    // "connection closed". A barrier (tag 0; collectives start at 1) makes
    // success symmetric: once any rank returns, every rank is connected.
    gloo::BarrierOptions barrier(ctx);
    barrier.setTag(kRendezvousTag);
    barrier.setTimeout(ToChrono(transport.timeout));
    gloo::barrier(barrier);
  });
  if (!s.ok()) {
    // A failed barrier leaves the connected pairs in ctx: close them
    // without the ticks. (A throw inside connectFullMesh has already closed
    // its own, unrung.)
    TeardownBell::Ringing ringing(transport.device.bell);
    ctx.reset();
    return s;
  }
  return std::shared_ptr<gloo::Context>(std::move(ctx));
}

// Work enqueued but not yet run (or skipped) by a stream. Held through a
// shared_ptr so that the last task can signal it after the communicator has
// begun destruction.
struct Pending {
  absl::Mutex mu;
  int count ABSL_GUARDED_BY(mu) = 0;
};

// Decrements Pending when the task that holds it is destroyed: after it ran,
// or when a failed stream skipped it.
class PendingToken {
 public:
  explicit PendingToken(std::shared_ptr<Pending> p) : p_(std::move(p)) {
    absl::MutexLock lock(&p_->mu);
    ++p_->count;
  }
  ~PendingToken() {
    absl::MutexLock lock(&p_->mu);
    --p_->count;
  }
  PendingToken(const PendingToken&) = delete;
  PendingToken& operator=(const PendingToken&) = delete;

 private:
  std::shared_ptr<Pending> p_;
};

// --- The communicator -------------------------------------------------------

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::string name, int rank, std::vector<int> members,
                   std::shared_ptr<Transport> transport,
                   std::string store_prefix,
                   std::shared_ptr<gloo::Context> context)
      : Communicator(BackendKind::kCpu, std::move(name), rank,
                     std::move(members)),
        transport_(std::move(transport)),
        store_prefix_(std::move(store_prefix)),
        context_(std::move(context)),
        pending_(std::make_shared<Pending>()) {}

  ~GlooCommunicator() override {
    // Enqueued collectives capture `this`: wait until each has run (they end
    // by the timeout at the latest) or been dropped by a failed stream.
    {
      absl::MutexLock lock(&pending_->mu);
      pending_->mu.Await(absl::Condition(
          +[](Pending* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu) {
            return p->count == 0;
          },
          pending_.get()));
    }
    // Closes this context's pairs without waiting out the loop's ticks.
    TeardownBell::Ringing ringing(transport_->device.bell);
    context_.reset();
  }

 protected:
  absl::Status DoAllReduce(Stream& stream, const void* send, void* recv,
                           size_t count, DataType type,
                           ReduceOp op) override {
    return Enqueue(stream, "all_reduce", [=](uint32_t tag) {
      gloo::AllreduceOptions opts(context_);
      WithType(type, [&](auto zero) {
        using T = decltype(zero);
        if (send != recv) {
          opts.setInput(static_cast<T*>(const_cast<void*>(send)), count);
        }
        opts.setOutput(static_cast<T*>(recv), count);
      });
      // The ring fixes the order in which each element's contributions are
      // added, given the group size and the count: deterministic.
      opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      opts.setReduceFunction(ReduceFor(type, op));
      opts.setTag(tag);
      opts.setTimeout(timeout());
      gloo::allreduce(opts);
    });
  }

  absl::Status DoReduceScatter(Stream& stream, const void* send, void* recv,
                               size_t recv_count, DataType type,
                               ReduceOp op) override {
    return Enqueue(stream, "reduce_scatter", [=](uint32_t tag) {
      RingReduceScatter(tag, send, recv, recv_count * DataTypeSize(type),
                        recv_count, ReduceFor(type, op));
    });
  }

  absl::Status DoAllGather(Stream& stream, const void* send, void* recv,
                           size_t send_count, DataType type) override {
    const size_t bytes = send_count * DataTypeSize(type);
    const size_t total = bytes * size();
    const bool in_place = send == static_cast<char*>(recv) + rank() * bytes;
    return Enqueue(stream, "all_gather", [=](uint32_t tag) {
      if (bytes <= kDirectAllGatherMaxBytes) {
        DirectAllGather(tag, send, recv, bytes, in_place);
        return;
      }
      gloo::AllgatherOptions opts(context_);
      // Without an input Gloo gathers in place: this rank's block is
      // already at its offset in the output.
      if (!in_place) {
        opts.setInput(static_cast<char*>(const_cast<void*>(send)), bytes);
      }
      opts.setOutput(static_cast<char*>(recv), total);
      opts.setTag(tag);
      opts.setTimeout(timeout());
      gloo::allgather(opts);
    });
  }

  absl::Status DoAllToAllV(Stream& stream, const void* send,
                           absl::Span<const int64_t> send_counts, void* recv,
                           absl::Span<const int64_t> recv_counts,
                           DataType type) override {
    const int64_t elem = static_cast<int64_t>(DataTypeSize(type));
    std::vector<int64_t> send_bytes, recv_bytes;
    for (int64_t c : send_counts) send_bytes.push_back(c * elem);
    for (int64_t c : recv_counts) recv_bytes.push_back(c * elem);
    return Enqueue(stream, "all_to_all_v", [=](uint32_t tag) {
      // Gloo copies this rank's own block with memcpy and hands every peer
      // block to the transport, empty ones included; a null pointer is only
      // allowed (and only passed) when nothing is read or written.
      static char kEmpty;
      char* in = send != nullptr ? static_cast<char*>(const_cast<void*>(send))
                                 : &kEmpty;
      char* out = recv != nullptr ? static_cast<char*>(recv) : &kEmpty;
      gloo::AlltoallvOptions opts(context_);
      opts.setInput(in, send_bytes);
      opts.setOutput(out, recv_bytes);
      opts.setTag(tag);
      opts.setTimeout(timeout());
      gloo::alltoallv(opts);
    });
  }

  absl::Status DoBroadcast(Stream& stream, void* data, size_t count,
                           DataType type, int root) override {
    const size_t bytes = count * DataTypeSize(type);
    return Enqueue(stream, "broadcast", [=](uint32_t tag) {
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(static_cast<char*>(data), bytes);  // in place everywhere
      opts.setRoot(root);
      opts.setTag(tag);
      opts.setTimeout(timeout());
      gloo::broadcast(opts);
    });
  }

  absl::Status DoSendRecv(Stream& stream, const void* send, size_t send_count,
                          int dst, void* recv, size_t recv_count, int src,
                          DataType type) override {
    const size_t send_bytes = send_count * DataTypeSize(type);
    const size_t recv_bytes = recv_count * DataTypeSize(type);
    return Enqueue(stream, "send_recv", [=](uint32_t tag) {
      if (dst == rank()) {  // a ring of one (validated: src == dst, same size)
        if (send_bytes > 0) std::memcpy(recv, send, send_bytes);
        return;
      }
      const uint64_t slot = gloo::Slot::build(kSendRecvSlotPrefix, tag);
      std::unique_ptr<gloo::transport::UnboundBuffer> tx, rx;
      if (recv_bytes > 0) {
        rx = context_->createUnboundBuffer(recv, recv_bytes);
        rx->recv(src, slot);
      }
      if (send_bytes > 0) {
        tx = context_->createUnboundBuffer(const_cast<void*>(send),
                                           send_bytes);
        tx->send(dst, slot);
      }
      if (rx != nullptr) Wait(*rx, /*recv=*/true, src);
      if (tx != nullptr) Wait(*tx, /*recv=*/false, dst);
    });
  }

  absl::Status DoBarrier(Stream& stream) override {
    return Enqueue(stream, "barrier", [=](uint32_t tag) {
      gloo::BarrierOptions opts(context_);
      opts.setTag(tag);
      opts.setTimeout(timeout());
      gloo::barrier(opts);
    });
  }

  absl::StatusOr<std::unique_ptr<Communicator>> DoGroup(
      const std::string& name, const std::vector<int>& ranks,
      std::vector<int> world_members) override {
    const int group_rank = static_cast<int>(
        std::find(ranks.begin(), ranks.end(), rank()) - ranks.begin());
    // The same group may be made again (e.g. after a failure): a counter per
    // (name, members) keeps each incarnation's keys apart. Only members make
    // a group, and each of them counts the same incarnations.
    std::string id =
        absl::StrCat(name, "[", absl::StrJoin(world_members, ","), "]");
    int incarnation;
    {
      absl::MutexLock lock(&groups_mu_);
      incarnation = groups_made_[id]++;
    }
    const std::string prefix =
        absl::StrCat(store_prefix_, "/", id, "#", incarnation);
    PLATEAU_ASSIGN_OR_RETURN(
        std::shared_ptr<gloo::Context> ctx,
        Connect(*transport_, prefix, group_rank,
                static_cast<int>(ranks.size()),
                absl::StrCat("rendezvous of group '", name, "' (rank ",
                             group_rank, " of ", ranks.size(), ", from rank ",
                             rank(), " of '", this->name(), "')")));
    return std::unique_ptr<Communicator>(
        new GlooCommunicator(name, group_rank, std::move(world_members),
                             transport_, prefix, std::move(ctx)));
  }

 private:
  std::chrono::milliseconds timeout() const {
    return ToChrono(transport_->timeout);
  }

  // Enqueues `body` (which receives this collective's tag) on the stream.
  absl::Status Enqueue(Stream& stream, const char* op,
                       std::function<void(uint32_t)> body) {
    // Tags are handed out in call order, which every rank shares.
    const uint32_t tag = next_tag_.fetch_add(1);
    auto token = std::make_shared<PendingToken>(pending_);
    static_cast<CpuStream&>(stream).Enqueue(
        [this, op, tag, body = std::move(body), token]() -> absl::Status {
          return Run(op, [&] { body(tag); });
        });
    return absl::OkStatus();
  }

  // Runs one collective on the stream thread.
  absl::Status Run(const char* op, const std::function<void()>& fn) {
    {
      absl::MutexLock lock(&mu_);
      if (!broken_.ok()) {
        return absl::FailedPreconditionError(absl::StrCat(
            Describe(op), ": the communicator is unusable after an earlier "
                          "failure: ",
            broken_.message()));
      }
    }
    absl::Status s = CatchAll(Describe(op), fn);
    if (!s.ok()) {
      absl::MutexLock lock(&mu_);
      if (broken_.ok()) broken_ = s;
    }
    return s;
  }

  // Throws like Gloo when a wait ends without completing.
  void Wait(gloo::transport::UnboundBuffer& buf, bool recv, int peer) {
    const bool done = recv ? buf.waitRecv(timeout()) : buf.waitSend(timeout());
    if (!done) {
      GLOO_THROW_IO_EXCEPTION(recv ? "receive from" : "send to", " rank ",
                              peer, " was aborted");
    }
  }

  // Direct all-gather over one unbound buffer (the output): this rank's
  // block goes to every peer and every peer's block comes in, all posted at
  // once, so the gather takes one message delay where Gloo's ring takes P - 1
  // in sequence. Each rank still sends P - 1 blocks. The output is the same
  // bytes either way (a gather copies; nothing is added).
  void DirectAllGather(uint32_t tag, const void* send, void* recv,
                       size_t block_bytes, bool in_place) {
    const int p = size();
    const int r = rank();
    char* out = static_cast<char*>(recv);
    if (!in_place) std::memcpy(out + r * block_bytes, send, block_bytes);
    if (p == 1 || block_bytes == 0) return;
    const uint64_t slot = gloo::Slot::build(kAllGatherSlotPrefix, tag);
    auto buf = context_->createUnboundBuffer(out, block_bytes * p);
    for (int i = 1; i < p; ++i) {
      const int to = (r + i) % p, from = (r - i + p) % p;
      buf->recv(from, slot, from * block_bytes, block_bytes);
      buf->send(to, slot, r * block_bytes, block_bytes);
    }
    // The P - 1 receives and sends complete in any order.
    for (int i = 1; i < p; ++i) {
      if (!buf->waitRecv(timeout())) {
        GLOO_THROW_IO_EXCEPTION("a receive of the direct all-gather was aborted");
      }
    }
    for (int i = 1; i < p; ++i) {
      if (!buf->waitSend(timeout())) {
        GLOO_THROW_IO_EXCEPTION("a send of the direct all-gather was aborted");
      }
    }
  }

  // Ring reduce-scatter over unbound buffers, a segment of each block at a
  // time (kReduceScatterSegmentBytes): P - 1 steps per segment; at step s
  // this rank sends its running partial of the segment of block
  // (rank - s - 1) to the right and receives the left neighbour's partial of
  // block (rank - s - 2), adding its own contribution. The last segment
  // received is this rank's: each element is summed in the fixed ring order
  // starting after its block's owner, so results are the same bits run to
  // run and whatever the segment size. Scratch: two segments (8 MiB at
  // most). A pass over whole blocks held two blocks: for the dense
  // gradient's reduce-scatter, 2 D / P elements, gigabytes at a large model,
  // on the plain heap outside every live set.
  void RingReduceScatter(uint32_t tag, const void* send, void* recv,
                         size_t block_bytes, size_t block_count,
                         ReduceFn reduce) {
    const int p = size();
    const int r = rank();
    const char* in = static_cast<const char*>(send);
    if (p == 1) {
      if (recv != send) std::memcpy(recv, send, block_bytes);
      return;
    }
    const int right = (r + 1) % p;
    const int left = (r - 1 + p) % p;
    const uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);
    auto block = [&](int b) { return in + ((b % p + p) % p) * block_bytes; };
    const size_t elem = block_bytes / block_count;  // counts are never 0 here
    const size_t segment = std::max<size_t>(1, kReduceScatterSegmentBytes / elem);
    const size_t scratch = std::min(block_count, segment) * elem;

    std::vector<char> partial(scratch), incoming(scratch);
    auto tx_input = context_->createUnboundBuffer(
        const_cast<char*>(in), block_bytes * p);
    auto tx = context_->createUnboundBuffer(partial.data(), scratch);
    auto rx = context_->createUnboundBuffer(incoming.data(), scratch);
    for (size_t first = 0; first < block_count; first += segment) {
      const size_t count = std::min(segment, block_count - first);
      const size_t offset = first * elem, bytes = count * elem;
      for (int s = 0; s < p - 1; ++s) {
        rx->recv(left, slot, 0, bytes);
        if (s == 0) {
          // The first partial of a segment is the sender's own contribution.
          tx_input->send(right, slot, (block(r - 1) - in) + offset, bytes);
          Wait(*rx, /*recv=*/true, left);
          Wait(*tx_input, /*recv=*/false, right);
        } else {
          tx->send(right, slot, 0, bytes);
          Wait(*rx, /*recv=*/true, left);
          Wait(*tx, /*recv=*/false, right);
        }
        const char* mine = block(r - s - 2) + offset;
        // Received partial first, then this rank's contribution.
        void* out = (s == p - 2) ? static_cast<char*>(recv) + offset : partial.data();
        reduce(out, incoming.data(), mine, count);
      }
    }
  }

  const std::shared_ptr<Transport> transport_;
  const std::string store_prefix_;
  std::shared_ptr<gloo::Context> context_;  // reset only by the destructor
  const std::shared_ptr<Pending> pending_;
  std::atomic<uint32_t> next_tag_{kRendezvousTag + 1};

  absl::Mutex mu_;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);

  absl::Mutex groups_mu_;
  std::map<std::string, int> groups_made_ ABSL_GUARDED_BY(groups_mu_);
};

}  // namespace

int64_t GlooDevicesMade() {
  Devices& all = TheDevices();
  absl::MutexLock lock(&all.mu);
  return all.made;
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(
    const CommunicatorOptions& options) {
  auto transport = std::make_shared<Transport>();
  transport->store = options.store;
  transport->timeout = options.timeout;
  const std::string where =
      absl::StrCat("rendezvous of group 'world' (rank ", options.rank, " of ",
                   options.size, ")");
  IgnoreSigpipeUnlessHandled();
  absl::Status s = CatchAll(where, [&] { transport->device = DeviceFor(options.hostname); });
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat(s.message(), " (listening on "
                                                            "hostname '",
                                               options.hostname, "')"));
  }
  const std::string prefix = absl::StrCat(options.prefix, "/world");
  PLATEAU_ASSIGN_OR_RETURN(
      std::shared_ptr<gloo::Context> ctx,
      Connect(*transport, prefix, options.rank, options.size, where));
  std::vector<int> members(options.size);
  for (int i = 0; i < options.size; ++i) members[i] = i;
  return std::unique_ptr<Communicator>(
      new GlooCommunicator("world", options.rank, std::move(members),
                           std::move(transport), prefix, std::move(ctx)));
}

}  // namespace plateau
