// The emulated NCCL (nccl.h): a world's ranks are threads of this process
// or of other processes. A blocking communicator's operations run on the
// calling thread when called (a group's at its outermost ncclGroupEnd); a
// non-blocking one's run on the stream, as NCCL's do.
//
// At the call (blocking communicators): the call first runs its stream's
// work so far (Flush: what it reads is written), takes its part in the
// rendezvous with no lock of the runtime held, and leaves its results in
// place before returning; work enqueued on the stream afterwards runs after
// it, as on a GPU.
//
// On the stream (non-blocking communicators, what kernels/nccl uses): the
// emulated runtime runs a stream's work under its lock, where a collective
// must not wait for the other ranks (they need the lock to run their own
// streams). So the call enqueues external work (emulation.h) and returns;
// when the stream reaches it, the communicator's worker thread takes the
// operation's part in the rendezvous, exactly as a calling thread would,
// and the stream's later work waits until it is done. Failures found there
// become the communicator's asynchronous error, and a peer that never comes
// leaves the stream blocked until the wait limit, an abort or a destroy ends
// it: the hang that kernels/nccl's watchdog exists for.
//
// A test may turn on plateauEmulatedNcclCallsNeverFinish (nccl.h): a
// non-blocking communicator's operation call then returns ncclInProgress
// and enqueues nothing, and ncclCommGetAsyncError says ncclInProgress from
// then on, until an abort: as NCCL 2.22+ does while it connects a peer at
// a collective's first call (NCCL_RUNTIME_CONNECT) and the peer never
// comes.
//
// Matching: the n-th collective of each rank of a world meet in one Slot
// (a per-communicator sequence number); the last rank to arrive checks that
// all agree and computes the results for everyone; each rank then copies
// its own part out. Sends go into per (source, destination) mailboxes,
// receives take from them in order. Every wait is bounded. A world whose
// rank gave up, aborted or failed is closed: every wait in it ends with an
// error. A rank that destroys its communicator only leaves: what it sent is
// still delivered, and only what needs it (a collective it never called, a
// receive from it with nothing in the mailbox, a send to it) fails.
//
// Ranks in other processes: a world lives in the process that made its
// unique id (the host; the id names it). A rank in another process joins
// through a proxy there, a host thread that makes that rank's calls on the
// World exactly as a local rank's thread would, so matching, ordering,
// timeouts and errors are one implementation; the remote call ships its
// inputs in one frame (wire.h) and gets its outputs back. See "Ranks in
// other processes" below.
//
// Locks: worlds_mu (forming worlds) before World::mu; Proxied::mu before
// comms_mu (live communicators), which is held with no other. proxied_mu,
// host_mu and ids_mu are held with no other either. None is held across a
// call into the runtime or a wait for another process. Worker::mu is taken
// under the runtime's lock (a stream reaching an operation) and held with
// no other. A fork takes the registries' locks (see "Forks") and the
// runtime's (runtime.cc); a fork's child uses none of its parent's
// communicators.
#include "kernels/cuda/emulated/nccl.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kernels/cuda/emulated/emulation.h"
#include "kernels/cuda/emulated/wire.h"

namespace plateau::cuda_emulation {
namespace {

using Clock = std::chrono::steady_clock;
using Bytes = std::vector<unsigned char>;

// How long a rank waits for the others (to join, to reach the same
// collective, to send what it receives) before it gives up.
std::chrono::milliseconds WaitLimit() {
  constexpr std::chrono::milliseconds kDefault{60000};
  const char* v = std::getenv("PLATEAU_EMULATED_NCCL_TIMEOUT_MS");
  if (v == nullptr || *v == '\0') return kDefault;
  char* end = nullptr;
  const long long ms = std::strtoll(v, &end, 10);
  return *end == '\0' && ms > 0 ? std::chrono::milliseconds(ms) : kDefault;
}

size_t TypeSize(ncclDataType_t type) {
  switch (type) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}

std::string TypeName(ncclDataType_t type) {
  switch (type) {
    case ncclInt8:
      return "int8";
    case ncclUint8:
      return "uint8";
    case ncclInt32:
      return "int32";
    case ncclUint32:
      return "uint32";
    case ncclInt64:
      return "int64";
    case ncclUint64:
      return "uint64";
    case ncclFloat16:
      return "float16";
    case ncclFloat32:
      return "float32";
    case ncclFloat64:
      return "float64";
    case ncclBfloat16:
      return "bfloat16";
    case ncclFloat8e4m3:
      return "float8e4m3";
    case ncclFloat8e5m2:
      return "float8e5m2";
    default:
      return "type " + std::to_string(static_cast<int>(type));
  }
}

std::string OpName(ncclRedOp_t op) {
  switch (op) {
    case ncclSum:
      return "sum";
    case ncclProd:
      return "prod";
    case ncclMax:
      return "max";
    case ncclMin:
      return "min";
    case ncclAvg:
      return "avg";
    default:
      return "op " + std::to_string(static_cast<int>(op));
  }
}

bool Reducible(ncclDataType_t type) {
  return type != ncclFloat16 && type != ncclFloat8e4m3 && type != ncclFloat8e5m2;
}

enum class Kind { kAllReduce, kAllGather, kReduceScatter, kBroadcast, kSend, kRecv };

const char* KindName(Kind kind) {
  switch (kind) {
    case Kind::kAllReduce:
      return "ncclAllReduce";
    case Kind::kAllGather:
      return "ncclAllGather";
    case Kind::kReduceScatter:
      return "ncclReduceScatter";
    case Kind::kBroadcast:
      return "ncclBroadcast";
    case Kind::kSend:
      return "ncclSend";
    case Kind::kRecv:
      return "ncclRecv";
  }
  return "?";
}

bool IsReduction(Kind kind) { return kind == Kind::kAllReduce || kind == Kind::kReduceScatter; }

// One rank's part in one collective: what it asked for and a copy of its
// input, taken before it arrived (the input may be its output too).
struct Arrival {
  bool present = false;
  Kind kind = Kind::kAllReduce;
  size_t count = 0;  // as passed: count, sendcount or recvcount
  ncclDataType_t type = ncclFloat32;
  ncclRedOp_t op = ncclSum;
  int root = 0;
  Bytes data;
};

std::string Describe(const Arrival& a) {
  std::string s =
      std::string(KindName(a.kind)) + "(count " + std::to_string(a.count) + ", " + TypeName(a.type);
  if (IsReduction(a.kind)) s += ", " + OpName(a.op);
  if (a.kind == Kind::kBroadcast) s += ", root " + std::to_string(a.root);
  return s + ")";
}

// The n-th collective of every rank of a world.
struct Slot {
  std::vector<Arrival> arrivals;  // by rank
  int arrived = 0;
  int departed = 0;
  bool done = false;
  ncclResult_t result = ncclSuccess;
  std::string error;
  Bytes output;  // everyone's results; rank r copies its part
};

struct Message {
  ncclDataType_t type;
  size_t count;
  Bytes bytes;
};

// A communicator whose world lives in another process: its two
// connections to the proxy there (see "Ranks in other processes").
struct RemoteLink {
  int ops_fd = -1;  // operations, which may wait long; one call at a time
  int ctl_fd = -1;  // asynchronous errors, abort, destroy: answered at once
  std::mutex ops_mu, ctl_mu;
  int host_pid = 0;
  std::mutex lost_mu;
  std::string lost;  // guarded by lost_mu: why the host cannot be reached
  ~RemoteLink() {
    wire::Close(ops_fd);
    wire::Close(ctl_fd);
  }
};

struct Worker;

struct World {
  World(std::string id_bytes, int n)
      : id(std::move(id_bytes)),
        size(n),
        timeout(WaitLimit()),
        members(static_cast<size_t>(n), nullptr),
        gone(static_cast<size_t>(n), false),
        mailboxes(static_cast<size_t>(n) * static_cast<size_t>(n)) {}

  const std::string id;  // the unique id's bytes
  const int size;
  const std::chrono::milliseconds timeout;

  std::mutex mu;
  std::condition_variable cv;      // any change below
  std::vector<ncclComm*> members;  // by rank; nullptr: not joined, or gone
  int joined = 0;
  bool complete = false;  // every rank has joined
  bool closed = false;    // a rank gave up, aborted or failed
  std::string closed_why;
  std::vector<bool> gone;                           // by rank: destroyed its communicator
  std::map<uint64_t, std::shared_ptr<Slot>> slots;  // by sequence number
  std::vector<std::deque<Message>> mailboxes;       // [source * size + destination]
};

}  // namespace
}  // namespace plateau::cuda_emulation

namespace emu = plateau::cuda_emulation;

struct ncclComm {
  std::shared_ptr<emu::World> world;        // null for a remote rank
  std::unique_ptr<emu::RemoteLink> remote;  // null for a local rank
  int rank = 0;
  int size = 0;
  int device = 0;    // in the calling process (a remote rank's: in its own)
  int physical = 0;  // the machine's GPU (emulation.h's PhysicalDevice)
  emu::Clock::time_point join_deadline;
  // Guarded by world->mu.
  uint64_t next_seq = 0;
  ncclResult_t async_error = ncclSuccess;
  std::string async_why;
  // Guarded by comms_mu: calls in flight on this communicator.
  int calls = 0;
  // A non-blocking communicator's thread for its operations on streams.
  std::shared_ptr<emu::Worker> worker;
  // A call left ncclInProgress (plateauEmulatedNcclCallsNeverFinish).
  std::atomic<bool> call_in_progress{false};
};

namespace plateau::cuda_emulation {
namespace {

std::string RankName(const ncclComm* c) {
  return "rank " + std::to_string(c->rank) + " of " + std::to_string(c->size);
}

std::string Ms(std::chrono::milliseconds ms) { return std::to_string(ms.count()) + " ms"; }

// ---- Errors ---------------------------------------------------------------

thread_local std::string last_error;

// The calling thread's failure: ncclGetLastError says `why`.
ncclResult_t Fail(ncclResult_t result, std::string why) {
  last_error = std::move(why);
  return result;
}

// The communicator's first asynchronous error stays (ncclCommGetAsyncError).
void SetAsyncLocked(ncclComm* c, ncclResult_t result, const std::string& why) {
  if (c->async_error != ncclSuccess) return;
  c->async_error = result;
  c->async_why = why;
}

void CloseLocked(World& w, const std::string& why) {
  if (!w.closed) {
    w.closed = true;
    w.closed_why = why;
  }
  w.cv.notify_all();
}

// ---- Live communicators -----------------------------------------------------

std::mutex comms_mu;
// Never destroyed: detached proxy threads may still use it at exit.
std::condition_variable& comms_cv = *new std::condition_variable;
std::unordered_set<ncclComm*>& LiveComms() {
  static auto* comms = new std::unordered_set<ncclComm*>;
  return *comms;
}

// Holds a communicator for one call: an abort or destroy from another
// thread waits until the call is over before freeing it. get() is nullptr
// for a null, destroyed or made-up handle.
class CommUse {
 public:
  explicit CommUse(ncclComm_t comm) {
    std::lock_guard<std::mutex> lock(comms_mu);
    if (comm != nullptr && LiveComms().count(comm) != 0) {
      comm_ = comm;
      ++comm_->calls;
    }
  }
  ~CommUse() {
    if (comm_ == nullptr) return;
    std::lock_guard<std::mutex> lock(comms_mu);
    if (--comm_->calls == 0) comms_cv.notify_all();
  }
  CommUse(CommUse&& other) noexcept : comm_(std::exchange(other.comm_, nullptr)) {}
  CommUse(const CommUse&) = delete;
  CommUse& operator=(const CommUse&) = delete;
  CommUse& operator=(CommUse&&) = delete;

  ncclComm* get() const { return comm_; }

 private:
  ncclComm* comm_ = nullptr;
};

constexpr char kBadComm[] = "invalid communicator (null, destroyed or aborted)";

ncclResult_t RetireRemote(ncclComm* c, bool abort, const std::string& why);
void StopWorker(ncclComm* c);

// Worlds whose ranks are still joining, by unique id.
std::mutex worlds_mu;
std::unordered_map<std::string, std::shared_ptr<World>>& FormingWorlds() {
  static auto* worlds = new std::unordered_map<std::string, std::shared_ptr<World>>;
  return *worlds;
}

// Takes `c` out of its world, then frees it once no call on it is in
// flight. An abort (or a world still forming) closes the world, with `why`
// or "rank r <verb> its communicator"; a destroy leaves (World::gone).
ncclResult_t Retire(ncclComm* c, bool abort, const char* verb, std::string why = "") {
  {
    std::lock_guard<std::mutex> lock(comms_mu);
    if (c == nullptr || LiveComms().erase(c) == 0) return Fail(ncclInvalidArgument, kBadComm);
  }
  // Out of LiveComms, `c` is this call's: no other call can free it.
  if (c->remote != nullptr) return RetireRemote(c, abort, why);
  if (why.empty()) why = RankName(c) + " " + verb + " its communicator";
  const std::shared_ptr<World> w = c->world;
  {
    std::lock_guard<std::mutex> registry(worlds_mu);
    std::lock_guard<std::mutex> lock(w->mu);
    if (!w->complete) {
      auto it = FormingWorlds().find(w->id);
      if (it != FormingWorlds().end() && it->second == w) FormingWorlds().erase(it);
    }
    w->members[static_cast<size_t>(c->rank)] = nullptr;
    w->gone[static_cast<size_t>(c->rank)] = true;
    if (abort || !w->complete) {
      CloseLocked(*w, why);
    } else {
      w->cv.notify_all();  // waits that need this rank end
    }
  }
  {
    std::unique_lock<std::mutex> lock(comms_mu);
    comms_cv.wait(lock, [c] { return c->calls == 0; });
  }
  StopWorker(c);
  delete c;
  return ncclSuccess;
}

// ---- Reductions -----------------------------------------------------------
// acc = acc op x, elementwise, for n elements of the buffers' type. The
// buffers are bytes; elements are moved with memcpy (no aliasing tricks).

template <typename T>
T Combine(T a, T b, ncclRedOp_t op) {
  if constexpr (std::is_integral_v<T>) {
    // Sums and products wrap (two's complement) instead of overflowing.
    using U = std::make_unsigned_t<T>;
    const uint64_t ua = static_cast<U>(a), ub = static_cast<U>(b);
    switch (op) {
      case ncclSum:
        return static_cast<T>(static_cast<U>(ua + ub));
      case ncclProd:
        return static_cast<T>(static_cast<U>(ua * ub));
      default:
        break;
    }
  } else {
    if (op == ncclSum) return a + b;
    if (op == ncclProd) return a * b;
  }
  // The same rule as the Gloo communicator: max keeps a unless a < b.
  if (op == ncclMax) return a < b ? b : a;
  return b < a ? b : a;
}

template <typename T>
void ReduceTyped(unsigned char* acc, const unsigned char* x, size_t n, ncclRedOp_t op) {
  for (size_t i = 0; i < n; ++i) {
    T a, b;
    std::memcpy(&a, acc + i * sizeof(T), sizeof(T));
    std::memcpy(&b, x + i * sizeof(T), sizeof(T));
    const T r = Combine(a, b, op);
    std::memcpy(acc + i * sizeof(T), &r, sizeof(T));
  }
}

// bf16: both operands loaded exactly, combined in fp32 and rounded once per
// step (communicator.h's rule for NCCL: n - 1 roundings over n ranks); max
// and min keep the chosen operand's bits.
void ReduceBf16(unsigned char* acc, const unsigned char* x, size_t n, ncclRedOp_t op) {
  for (size_t i = 0; i < n; ++i) {
    __nv_bfloat16 a, b;
    std::memcpy(&a.bits, acc + 2 * i, 2);
    std::memcpy(&b.bits, x + 2 * i, 2);
    const float fa = __bfloat162float(a), fb = __bfloat162float(b);
    __nv_bfloat16 r;
    switch (op) {
      case ncclSum:
        r = __float2bfloat16_rn(fa + fb);
        break;
      case ncclProd:
        r = __float2bfloat16_rn(fa * fb);
        break;
      case ncclMax:
        r = fa < fb ? b : a;
        break;
      default:
        r = fb < fa ? b : a;
        break;
    }
    std::memcpy(acc + 2 * i, &r.bits, 2);
  }
}

void Reduce(ncclDataType_t type, ncclRedOp_t op, unsigned char* acc, const unsigned char* x,
            size_t n) {
  switch (type) {
    case ncclInt8:
      return ReduceTyped<int8_t>(acc, x, n, op);
    case ncclUint8:
      return ReduceTyped<uint8_t>(acc, x, n, op);
    case ncclInt32:
      return ReduceTyped<int32_t>(acc, x, n, op);
    case ncclUint32:
      return ReduceTyped<uint32_t>(acc, x, n, op);
    case ncclInt64:
      return ReduceTyped<int64_t>(acc, x, n, op);
    case ncclUint64:
      return ReduceTyped<uint64_t>(acc, x, n, op);
    case ncclFloat32:
      return ReduceTyped<float>(acc, x, n, op);
    case ncclFloat64:
      return ReduceTyped<double>(acc, x, n, op);
    case ncclBfloat16:
      return ReduceBf16(acc, x, n, op);
    default:
      return;  // refused when the call was made (Check)
  }
}

// The last rank to arrive: checks that every rank asked for the same
// collective and computes the results, in rank order.
void Complete(Slot& slot, uint64_t seq) {
  const Arrival& first = slot.arrivals[0];
  for (size_t r = 1; r < slot.arrivals.size(); ++r) {
    const Arrival& a = slot.arrivals[r];
    if (a.kind != first.kind || a.count != first.count || a.type != first.type ||
        (IsReduction(a.kind) && a.op != first.op) ||
        (a.kind == Kind::kBroadcast && a.root != first.root)) {
      slot.result = ncclInvalidUsage;
      slot.error = "the ranks disagree on collective #" + std::to_string(seq) + ": rank 0 called " +
                   Describe(first) + ", rank " + std::to_string(r) + " " + Describe(a);
      slot.arrivals.clear();
      return;
    }
  }
  switch (first.kind) {
    case Kind::kAllReduce:
    case Kind::kReduceScatter:
      slot.output = std::move(slot.arrivals[0].data);
      for (size_t r = 1; r < slot.arrivals.size(); ++r) {
        Reduce(first.type, first.op, slot.output.data(), slot.arrivals[r].data.data(),
               slot.output.size() / TypeSize(first.type));
      }
      break;
    case Kind::kAllGather:
      for (const Arrival& a : slot.arrivals) {
        slot.output.insert(slot.output.end(), a.data.begin(), a.data.end());
      }
      break;
    case Kind::kBroadcast:
      slot.output = std::move(slot.arrivals[static_cast<size_t>(first.root)].data);
      break;
    default:
      break;
  }
  slot.arrivals.clear();
}

// ---- Operations -------------------------------------------------------------

struct Op {
  Kind kind;
  ncclComm* comm;
  cudaStream_t stream;
  const void* send;
  void* recv;
  size_t count;  // count, sendcount or recvcount, as the call names it
  ncclDataType_t type;
  ncclRedOp_t op;
  int peer;  // the root of a broadcast, the peer of a send or receive
};

bool IsLegacyStream(cudaStream_t stream) { return stream == nullptr || stream == cudaStreamLegacy; }

// The argument checks NCCL makes when an operation is called (inside a
// group too). An operation refused here takes no part in any rendezvous.
ncclResult_t Check(const Op& op) {
  ncclComm* c = op.comm;
  const std::string what = std::string(KindName(op.kind)) + " on " + RankName(c) + ": ";
  // A remote rank's proxy checks its world's state when the call arrives.
  if (c->world != nullptr) {
    World& w = *c->world;
    std::lock_guard<std::mutex> lock(w.mu);
    if (!w.complete) {
      return Fail(ncclInvalidUsage, what + "the communicator is still initialising");
    }
    if (c->async_error != ncclSuccess) {
      return Fail(c->async_error, what + "the communicator failed earlier: " + c->async_why);
    }
  }
  const size_t elem = TypeSize(op.type);
  if (elem == 0) return Fail(ncclInvalidArgument, what + "invalid data type " + TypeName(op.type));
  if (IsReduction(op.kind)) {
    if (op.op < ncclSum || op.op > ncclAvg) {
      return Fail(ncclInvalidArgument, what + "invalid reduction " + OpName(op.op));
    }
    if (op.op == ncclAvg || !Reducible(op.type)) {
      return Fail(ncclInvalidArgument, what + "the emulated NCCL does not reduce " +
                                           TypeName(op.type) + " with " + OpName(op.op));
    }
  }
  const bool has_peer =
      op.kind == Kind::kBroadcast || op.kind == Kind::kSend || op.kind == Kind::kRecv;
  if (has_peer && (op.peer < 0 || op.peer >= c->size)) {
    return Fail(ncclInvalidArgument, what + (op.kind == Kind::kBroadcast ? "root " : "peer ") +
                                         std::to_string(op.peer) + " is not a rank");
  }
  // The largest buffer an operation touches: count elements per rank.
  if (op.count > SIZE_MAX / elem / static_cast<size_t>(c->size)) {
    return Fail(ncclInvalidArgument, what + "count " + std::to_string(op.count) + " is too large");
  }
  if (op.count > 0) {
    const bool reads =
        op.kind != Kind::kRecv && (op.kind != Kind::kBroadcast || op.peer == c->rank);
    const bool writes = op.kind != Kind::kSend;
    if ((reads && op.send == nullptr) || (writes && op.recv == nullptr)) {
      return Fail(ncclInvalidArgument, what + "a null buffer pointer");
    }
  }
  if (!IsLegacyStream(op.stream)) {
    const int device = StreamDevice(op.stream);
    if (device < 0) return Fail(ncclInvalidArgument, what + "the stream is not a live stream");
    if (device != c->device) {
      return Fail(ncclInvalidArgument, what + "the stream is on device " + std::to_string(device) +
                                           ", the communicator on device " +
                                           std::to_string(c->device));
    }
  }
  return ncclSuccess;
}

// The ranks that have not reached `slot` (for a timeout's message).
std::string Missing(const Slot& slot) {
  std::string s;
  for (size_t r = 0; r < slot.arrivals.size(); ++r) {
    if (!slot.arrivals[r].present) s += (s.empty() ? "" : ", ") + std::to_string(r);
  }
  return s;
}

// A rank that has left without reaching `slot`: it never will.
int GoneBefore(const World& w, const Slot& slot) {
  for (size_t r = 0; r < slot.arrivals.size(); ++r) {
    if (!slot.arrivals[r].present && w.gone[r]) return static_cast<int>(r);
  }
  return -1;
}

ncclResult_t RunCollective(const Op& op) {
  ncclComm* c = op.comm;
  World& w = *c->world;
  const size_t n = static_cast<size_t>(w.size);
  const size_t elem = TypeSize(op.type);
  Arrival mine;
  mine.present = true;
  mine.kind = op.kind;
  mine.count = op.count;
  mine.type = op.type;
  mine.op = op.op;
  mine.root = op.peer;
  size_t in_bytes = op.count * elem;
  if (op.kind == Kind::kReduceScatter) in_bytes *= n;
  if (op.kind == Kind::kBroadcast && op.peer != c->rank) in_bytes = 0;
  const auto* in = static_cast<const unsigned char*>(op.send);
  mine.data.assign(in, in + in_bytes);

  std::shared_ptr<Slot> slot;
  {
    std::unique_lock<std::mutex> lock(w.mu);
    const std::string what = std::string(KindName(op.kind)) + " on " + RankName(c) + ": ";
    if (c->async_error != ncclSuccess) {
      return Fail(c->async_error, what + "the communicator failed earlier: " + c->async_why);
    }
    if (w.closed) {
      SetAsyncLocked(c, ncclRemoteError, w.closed_why);
      return Fail(ncclRemoteError, what + w.closed_why);
    }
    const uint64_t seq = c->next_seq++;
    std::shared_ptr<Slot>& s = w.slots[seq];
    if (s == nullptr) {
      s = std::make_shared<Slot>();
      s->arrivals.resize(n);
    }
    slot = s;
    slot->arrivals[static_cast<size_t>(c->rank)] = std::move(mine);
    if (++slot->arrived == w.size) {
      Complete(*slot, seq);
      slot->done = true;
      w.cv.notify_all();
    } else if (!w.cv.wait_until(lock, Clock::now() + w.timeout, [&] {
                 return slot->done || w.closed || GoneBefore(w, *slot) >= 0;
               })) {
      const std::string why = RankName(c) + " waited " + Ms(w.timeout) + " in " +
                              KindName(op.kind) + " (collective #" + std::to_string(seq) +
                              ") for rank(s) " + Missing(*slot) + ", which never called it";
      SetAsyncLocked(c, ncclSystemError, why);
      CloseLocked(w, why);
      return Fail(ncclSystemError, why);
    } else if (!slot->done) {
      const std::string why =
          w.closed ? w.closed_why
                   : "rank " + std::to_string(GoneBefore(w, *slot)) +
                         " destroyed its communicator without calling it (collective #" +
                         std::to_string(seq) + ")";
      SetAsyncLocked(c, ncclRemoteError, why);
      return Fail(ncclRemoteError, what + why);
    }
    if (++slot->departed == w.size) w.slots.erase(seq);
    if (slot->result != ncclSuccess) {
      SetAsyncLocked(c, slot->result, slot->error);
      return Fail(slot->result, what + slot->error);
    }
  }
  // The output no longer changes once done: copied without the lock.
  size_t offset = 0, out_bytes = slot->output.size();
  if (op.kind == Kind::kReduceScatter) {
    out_bytes = op.count * elem;
    offset = static_cast<size_t>(c->rank) * out_bytes;
  }
  if (out_bytes > 0) std::memcpy(op.recv, slot->output.data() + offset, out_bytes);
  return ncclSuccess;
}

ncclResult_t RunSend(const Op& op) {
  ncclComm* c = op.comm;
  World& w = *c->world;
  const auto* in = static_cast<const unsigned char*>(op.send);
  Message m{op.type, op.count, Bytes(in, in + op.count * TypeSize(op.type))};
  std::lock_guard<std::mutex> lock(w.mu);
  const std::string what =
      "ncclSend on " + RankName(c) + " to rank " + std::to_string(op.peer) + ": ";
  if (c->async_error != ncclSuccess) {
    return Fail(c->async_error, what + "the communicator failed earlier: " + c->async_why);
  }
  if (w.closed || w.gone[static_cast<size_t>(op.peer)]) {
    const std::string why = w.closed ? w.closed_why : "the peer destroyed its communicator";
    SetAsyncLocked(c, ncclRemoteError, why);
    return Fail(ncclRemoteError, what + why);
  }
  w.mailboxes[static_cast<size_t>(c->rank) * w.size + op.peer].push_back(std::move(m));
  w.cv.notify_all();
  return ncclSuccess;
}

ncclResult_t RunRecv(const Op& op) {
  ncclComm* c = op.comm;
  World& w = *c->world;
  Message m;
  {
    std::unique_lock<std::mutex> lock(w.mu);
    const std::string what =
        "ncclRecv on " + RankName(c) + " from rank " + std::to_string(op.peer) + ": ";
    if (c->async_error != ncclSuccess) {
      return Fail(c->async_error, what + "the communicator failed earlier: " + c->async_why);
    }
    std::deque<Message>& box = w.mailboxes[static_cast<size_t>(op.peer) * w.size + c->rank];
    // A message already sent is delivered even if the sender has left since.
    if (!w.cv.wait_until(lock, Clock::now() + w.timeout, [&] {
          return !box.empty() || w.closed || w.gone[static_cast<size_t>(op.peer)];
        })) {
      const std::string why = RankName(c) + " waited " + Ms(w.timeout) +
                              " in ncclRecv for a send from rank " + std::to_string(op.peer);
      SetAsyncLocked(c, ncclSystemError, why);
      CloseLocked(w, why);
      return Fail(ncclSystemError, why);
    }
    if (box.empty()) {
      const std::string why =
          w.closed ? w.closed_why : "the peer destroyed its communicator without sending";
      SetAsyncLocked(c, ncclRemoteError, why);
      return Fail(ncclRemoteError, what + why);
    }
    m = std::move(box.front());
    box.pop_front();
    if (m.type != op.type || m.count != op.count) {
      const std::string why = what + "it receives " + std::to_string(op.count) + " " +
                              TypeName(op.type) + " but rank " + std::to_string(op.peer) +
                              " sent " + std::to_string(m.count) + " " + TypeName(m.type);
      SetAsyncLocked(c, ncclInvalidUsage, why);
      ncclComm* sender = w.members[static_cast<size_t>(op.peer)];
      if (sender != nullptr) SetAsyncLocked(sender, ncclInvalidUsage, why);
      return Fail(ncclInvalidUsage, why);
    }
  }
  if (!m.bytes.empty()) std::memcpy(op.recv, m.bytes.data(), m.bytes.size());
  return ncclSuccess;
}

void FailRemote(ncclComm* c, ncclResult_t result, const std::string& why);
ncclResult_t ExecuteRemote(const std::vector<Op>& ops);

// `c` has failed for a reason of its own: its world is closed (the other
// ranks must not wait for it) and its asynchronous error set.
void FailComm(ncclComm* c, ncclResult_t result, const std::string& why) {
  if (c->remote != nullptr) return FailRemote(c, result, why);
  World& w = *c->world;
  std::lock_guard<std::mutex> lock(w.mu);
  SetAsyncLocked(c, result, why);
  CloseLocked(w, why);
}

// Runs the work enqueued so far on every stream `ops` name: their inputs
// are then written.
// A group whose stream cannot run it (its inputs are not there): every
// communicator in it fails, so that no peer waits for this rank.
ncclResult_t FailGroup(const std::vector<Op>& ops, const std::string& why) {
  for (const Op& o : ops) FailComm(o.comm, ncclUnhandledCudaError, why);
  return Fail(ncclUnhandledCudaError, why);
}

std::string StreamFailed(const Op& op, const std::string& how) {
  return RankName(op.comm) + ": its stream failed before " + KindName(op.kind) + " (" + how + ")";
}

ncclResult_t FlushStreams(const std::vector<Op>& ops) {
  std::vector<cudaStream_t> flushed;
  for (const Op& op : ops) {
    if (std::find(flushed.begin(), flushed.end(), op.stream) != flushed.end()) continue;
    flushed.push_back(op.stream);
    const cudaError_t e = Flush(op.stream);
    if (e != cudaSuccess) return FailGroup(ops, StreamFailed(op, cudaGetErrorName(e)));
  }
  return ncclSuccess;
}

// Runs a group (or a single operation) now, on the calling thread: the
// sends (so that no rank's receive waits for a send queued behind it), the
// collectives in call order, the receives. Returns the first error; the
// rest still run (each fails at once on a communicator that failed). The
// callers hold a CommUse of every communicator.
ncclResult_t RunOps(const std::vector<Op>& ops) {
  const bool remote = ops[0].comm->remote != nullptr;
  if (remote) return ExecuteRemote(ops);
  ncclResult_t first = ncclSuccess;
  std::string first_why;
  auto keep = [&](ncclResult_t r) {
    if (r != ncclSuccess && first == ncclSuccess) {
      first = r;
      first_why = last_error;
    }
  };
  for (const Op& op : ops) {
    if (op.kind != Kind::kSend) continue;
    try {
      keep(RunSend(op));
    } catch (const std::bad_alloc&) {
      keep(Fail(ncclSystemError, RankName(op.comm) + ": out of host memory in ncclSend"));
    }
  }
  for (const Op& op : ops) {
    if (op.kind == Kind::kSend || op.kind == Kind::kRecv) continue;
    try {
      keep(RunCollective(op));
    } catch (const std::bad_alloc&) {
      // Taken before the rendezvous (the input's copy) or by the last rank
      // while combining: either way the others cannot finish.
      const std::string why = RankName(op.comm) + ": out of host memory in " + KindName(op.kind);
      World& w = *op.comm->world;
      std::lock_guard<std::mutex> lock(w.mu);
      SetAsyncLocked(op.comm, ncclSystemError, why);
      CloseLocked(w, why);
      keep(Fail(ncclSystemError, why));
    }
  }
  for (const Op& op : ops) {
    if (op.kind == Kind::kRecv) keep(RunRecv(op));
  }
  if (first != ncclSuccess) last_error = first_why;
  return first;
}

ncclResult_t Stream(const std::vector<Op>& ops);

std::atomic<bool> calls_never_finish{false};  // plateauEmulatedNcclCallsNeverFinish

// Runs a group (or a single operation): a non-blocking communicator's on
// its streams (Stream), a blocking one's now: every stream's work so far
// (unless `flush` is false: a proxy's operations read host buffers), then
// RunOps.
ncclResult_t Execute(const std::vector<Op>& ops, bool flush = true) {
  std::vector<CommUse> uses;
  uses.reserve(ops.size());
  for (const Op& op : ops) {
    uses.emplace_back(op.comm);
    if (uses.back().get() == nullptr) {
      return Fail(ncclInvalidArgument, std::string(KindName(op.kind)) + ": " + kBadComm);
    }
  }
  const bool remote = ops[0].comm->remote != nullptr;
  const bool on_stream = ops[0].comm->worker != nullptr;
  for (const Op& op : ops) {
    if ((op.comm->remote != nullptr) != remote || (remote && op.comm != ops[0].comm)) {
      return Fail(ncclInvalidUsage,
                  "a group with a communicator whose world lives in another process takes "
                  "operations on that communicator only (a limit of the emulated NCCL)");
    }
    // Run at the call, it would overtake the other's operations queued on
    // their streams.
    if ((op.comm->worker != nullptr) != on_stream) {
      return Fail(ncclInvalidUsage,
                  "a group over blocking and non-blocking communicators (a limit of the "
                  "emulated NCCL)");
    }
    // One job is one worker's: the others' calls would not be ordered with
    // it, nor waited for by their finalize.
    if (on_stream && op.comm != ops[0].comm) {
      return Fail(ncclInvalidUsage,
                  "a group over several non-blocking communicators (a limit of the emulated "
                  "NCCL)");
    }
  }
  if (on_stream && flush) {
    if (calls_never_finish.load()) {
      ops[0].comm->call_in_progress = true;
      return ncclInProgress;
    }
    return Stream(ops);
  }
  if (flush) {
    const ncclResult_t r = FlushStreams(ops);
    if (r != ncclSuccess) return r;
  }
  return RunOps(ops);
}

// ---- Operations on the stream ------------------------------------------------
//
// A non-blocking communicator's operations are jobs for its worker thread,
// in call order (the n-th collective of each rank meet: the same order as
// at the call). A job runs once its stream has reached it (the runtime calls
// its start), and its stream's later work waits until it is done. A group
// is one job (over one communicator: Execute refuses more).

struct Job {
  std::vector<Op> ops;
  bool started = false;  // its stream has reached it
  bool faulted = false;  // ... after a device fault: it must not run
  std::function<void()> done;
};

struct Worker {
  explicit Worker(std::chrono::milliseconds l) : limit(l) {}
  const std::chrono::milliseconds limit;  // the world's wait limit
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<Job>> jobs;  // in call order; guarded by mu
  int unfinished = 0;                     // jobs queued or running; guarded by mu
  bool finalizing = false;                // ncclCommFinalize called; guarded by mu
  bool failed = false;                    // a job failed; guarded by mu
  Clock::time_point held_until;           // the failed jobs' hold ends; guarded by mu
  bool stopping = false;                  // guarded by mu
  std::thread thread;
};

// Runs `job` on the worker's thread; false if it failed. A communicator
// already aborted or destroyed does nothing (as NCCL's kernels return after
// an abort: the results are garbage, the job attempt over).
bool RunJob(const Job& job) {
  std::vector<CommUse> uses;
  for (const Op& op : job.ops) {
    uses.emplace_back(op.comm);
    if (uses.back().get() == nullptr) return true;
  }
  ncclResult_t r = ncclSuccess;
  std::string why;
  if (job.faulted) {
    r = ncclUnhandledCudaError;
    why = StreamFailed(job.ops[0], "the device faulted");
  } else {
    r = RunOps(job.ops);
    why = last_error;
  }
  if (r == ncclSuccess) return true;
  // Every failure is asynchronous here: the communicator keeps it, and its
  // world is closed so that no peer waits for this rank.
  for (const Op& op : job.ops) FailComm(op.comm, r, why);
  return false;
}

void Work(Worker* wk) {
  std::unique_lock<std::mutex> lock(wk->mu);
  for (;;) {
    // The oldest job once its stream reaches it; when stopping, any that
    // has started (each stream waits for its job), then the thread ends.
    auto next = [wk] {
      if (!wk->stopping) {
        return !wk->jobs.empty() && wk->jobs.front()->started ? wk->jobs.begin() : wk->jobs.end();
      }
      return std::find_if(wk->jobs.begin(), wk->jobs.end(),
                          [](const std::shared_ptr<Job>& j) { return j->started; });
    };
    wk->cv.wait(lock, [&] { return wk->stopping || next() != wk->jobs.end(); });
    const auto it = next();
    if (it == wk->jobs.end()) return;
    const std::shared_ptr<Job> job = *it;
    wk->jobs.erase(it);
    lock.unlock();
    const bool ok = RunJob(*job);
    lock.lock();
    if (!ok && !wk->failed) {
      wk->failed = true;
      wk->held_until = Clock::now() + wk->limit;
      wk->cv.notify_all();
    }
    if (!ok && job->done) {
      // As NCCL's kernels: a collective that failed does not return; its
      // stream stays blocked until the communicator is aborted or destroyed
      // (kernels/nccl's watchdog sees the asynchronous error and aborts) —
      // or, so that nothing here hangs for ever, until the wait limit has
      // passed once more since the first failure (every later job fails at
      // once and holds until the same time).
      wk->cv.wait_until(lock, wk->held_until, [wk] { return wk->stopping; });
    }
    lock.unlock();
    if (job->done) job->done();
    lock.lock();
    --wk->unfinished;
    wk->cv.notify_all();
  }
}

std::shared_ptr<Worker> StartWorker(std::chrono::milliseconds limit) {
  auto wk = std::make_shared<Worker>(limit);
  wk->thread = std::thread(Work, wk.get());
  return wk;
}

// What ncclCommDestroy does first, as NCCL's (an implicit finalize): waits
// until `c`'s jobs are done, or one has failed (those then hold their
// streams until the destroy), or the wait limit has passed (a job whose
// stream never reaches it: NCCL would wait for ever).
void AwaitJobs(ncclComm* c) {
  if (c->worker == nullptr) return;
  Worker& wk = *c->worker;
  std::unique_lock<std::mutex> lock(wk.mu);
  wk.cv.wait_until(lock, Clock::now() + wk.limit,
                   [&wk] { return wk.unfinished == 0 || wk.failed; });
}

// After the communicator's last call: jobs already reached by their streams
// run (and fail at once: the communicator has left its world); those not
// yet reached do nothing when they are.
void StopWorker(ncclComm* c) {
  if (c->worker == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(c->worker->mu);
    c->worker->stopping = true;
  }
  c->worker->cv.notify_all();
  c->worker->thread.join();
}

// ncclInProgress while a finalized communicator still has jobs queued or
// running, else `state`.
ncclResult_t WhileFinalizing(ncclComm* c, ncclResult_t state) {
  if (state != ncclSuccess || c->worker == nullptr) return state;
  std::lock_guard<std::mutex> lock(c->worker->mu);
  return c->worker->finalizing && c->worker->unfinished > 0 ? ncclInProgress : state;
}

// Makes stream `to` wait for the work enqueued on `from` so far (an event on
// `from`'s device). False if the runtime refuses.
bool Join(cudaStream_t from, cudaStream_t to) {
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess || cudaSetDevice(StreamDevice(from)) != cudaSuccess) {
    return false;
  }
  cudaEvent_t e = nullptr;
  bool ok = cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess;
  ok =
      ok && cudaEventRecord(e, from) == cudaSuccess && cudaStreamWaitEvent(to, e, 0) == cudaSuccess;
  if (e != nullptr) cudaEventDestroy(e);  // the wait keeps what it needs
  cudaSetDevice(current);
  return ok;
}

// The streams of a group other than the first, once each.
std::vector<cudaStream_t> OtherStreams(const std::vector<Op>& ops) {
  std::vector<cudaStream_t> others;
  for (const Op& op : ops) {
    if (op.stream != ops[0].stream &&
        std::find(others.begin(), others.end(), op.stream) == others.end()) {
      others.push_back(op.stream);
    }
  }
  return others;
}

// Enqueues `ops` as one job on their first stream. A group over several
// streams joins them there first, and they wait for the job after, as NCCL
// makes a group's streams wait for one another.
ncclResult_t Stream(const std::vector<Op>& ops) {
  const std::string unordered = RankName(ops[0].comm) + ": cannot order the group's streams";
  const std::vector<cudaStream_t> others = OtherStreams(ops);
  for (cudaStream_t s : others) {
    if (!Join(s, ops[0].stream)) return FailGroup(ops, unordered);
  }
  const std::shared_ptr<Worker> wk = ops[0].comm->worker;
  auto job = std::make_shared<Job>();
  job->ops = ops;
  {
    std::lock_guard<std::mutex> lock(wk->mu);
    wk->jobs.push_back(job);
    ++wk->unfinished;
  }
  auto drop = [wk, job]() {  // with wk->mu held
    wk->jobs.erase(std::find(wk->jobs.begin(), wk->jobs.end(), job));
    --wk->unfinished;
    wk->cv.notify_all();
  };
  const cudaError_t e = EnqueueExternal(ops[0].stream, [wk, job, drop](std::function<void()> done) {
    std::lock_guard<std::mutex> lock(wk->mu);
    if (wk->stopping) {  // the communicator is gone: nothing to do
      drop();
      return false;
    }
    job->started = true;
    job->faulted = done == nullptr;
    job->done = std::move(done);
    wk->cv.notify_all();
    return true;
  });
  if (e != cudaSuccess) {
    {
      std::lock_guard<std::mutex> lock(wk->mu);
      drop();
    }
    return FailGroup(ops, StreamFailed(ops[0], cudaGetErrorName(e)));
  }
  for (cudaStream_t s : others) {
    if (!Join(ops[0].stream, s)) return FailGroup(ops, unordered);  // the job stays queued
  }
  return ncclSuccess;
}

// ncclGroupStart / ncclGroupEnd are per thread, as in NCCL.
struct GroupState {
  int depth = 0;
  ncclResult_t error = ncclSuccess;  // the first operation refused in the group
  std::string why;
  std::vector<Op> ops;
};
thread_local GroupState group;

// Checks `op`; runs it now outside a group, else keeps it for ncclGroupEnd.
ncclResult_t Submit(const Op& op) {
  {
    CommUse use(op.comm);
    const ncclResult_t r =
        use.get() != nullptr
            ? Check(op)
            : Fail(ncclInvalidArgument, std::string(KindName(op.kind)) + ": " + kBadComm);
    if (r != ncclSuccess) {
      if (group.depth > 0 && group.error == ncclSuccess) {
        group.error = r;
        group.why = last_error;
      }
      return r;
    }
  }
  if (op.count == 0) return ncclSuccess;  // as NCCL: nothing to do, no rendezvous
  if (group.depth > 0) {
    group.ops.push_back(op);
    return ncclSuccess;
  }
  return Execute({op});
}

// Joins (or starts) the world of unique id `id_bytes` in this process, as
// rank `rank` on the machine's GPU `physical`.
ncclResult_t InitLocal(ncclComm_t* comm, int nranks, const std::string& id_bytes, int rank,
                       bool blocking, int device, int physical, const std::string& what) {
  auto owned = std::make_unique<ncclComm>();
  ncclComm* c = owned.get();
  c->rank = rank;
  c->size = nranks;
  c->device = device;
  c->physical = physical;
  const std::string& id = id_bytes;
  std::shared_ptr<World> w;
  {
    std::lock_guard<std::mutex> registry(worlds_mu);
    std::shared_ptr<World>& forming = FormingWorlds()[id];
    if (forming == nullptr) forming = std::make_shared<World>(id, nranks);
    w = forming;
    std::lock_guard<std::mutex> lock(w->mu);
    if (w->size != nranks) {
      return Fail(ncclInvalidUsage, what + "the other ranks of this unique id say " +
                                        std::to_string(w->size) + " ranks");
    }
    if (w->members[static_cast<size_t>(rank)] != nullptr) {
      return Fail(ncclInvalidUsage, what + "this rank has joined this unique id already");
    }
    if (w->closed) {
      return Fail(ncclRemoteError, what + "the world has failed: " + w->closed_why);
    }
    // As NCCL's "Duplicate GPU detected": one rank per GPU. The world fails
    // (the ranks already in it would otherwise wait for this one).
    for (const ncclComm* m : w->members) {
      if (m == nullptr || m->physical != physical) continue;
      const std::string why = "rank " + std::to_string(rank) + " and rank " +
                              std::to_string(m->rank) + " are both on GPU " +
                              std::to_string(physical) + " (NCCL takes one rank per GPU)";
      CloseLocked(*w, why);
      return Fail(ncclInvalidUsage, what + why);
    }
    w->members[static_cast<size_t>(rank)] = c;
    ++w->joined;
    c->world = w;
    c->join_deadline = Clock::now() + w->timeout;
    if (w->joined == w->size) {
      // Complete: no one else may join this id.
      w->complete = true;
      FormingWorlds().erase(id);
      w->cv.notify_all();
    }
  }
  {
    std::lock_guard<std::mutex> lock(comms_mu);
    LiveComms().insert(owned.release());
  }
  *comm = c;
  std::string why;
  ncclResult_t failure;
  {
    std::unique_lock<std::mutex> lock(w->mu);
    if (w->complete) return ncclSuccess;
    if (!blocking) return ncclInProgress;  // ncclCommGetAsyncError tells the rest
    if (w->cv.wait_until(lock, c->join_deadline, [&] { return w->complete || w->closed; }) &&
        w->complete) {
      return ncclSuccess;
    }
    failure = w->closed ? ncclRemoteError : ncclSystemError;
    why = w->closed ? what + "the world failed while joining: " + w->closed_why
                    : what + "only " + std::to_string(w->joined) + " of " +
                          std::to_string(w->size) + " ranks joined within " + Ms(w->timeout);
  }
  // A blocking initialisation that fails leaves no communicator behind.
  *comm = nullptr;
  Retire(c, /*abort=*/true, "gave up on", why);
  return Fail(failure, why);
}

// ---- Ranks in other processes ------------------------------------------------
//
// A unique id names the process that made it: bytes [8, 12) its pid,
// [12, 28) a random token of that process, which together name the abstract
// socket "plateau-emulated-nccl-<pid>-<token>" it listens on from its first
// ncclGetUniqueId. The world lives there (the host). A rank whose
// ncclCommInitRankConfig runs in another process connects twice:
//   - an operations connection, whose first frame is kJoin (with the
//     machine's GPU the rank is on): a proxy thread on the host makes the
//     InitLocal call for it, then, for each kExec
//     frame (an operation or a whole group, inputs included), the Check and
//     Execute calls, and answers with the result, the error's description
//     and the outputs. The proxy blocks where the rank's own thread would.
//   - a control connection (kControl, naming the proxied communicator and
//     the secret the join answered with):
//     kAsync, kLastError and kRetire are answered at once, even while an
//     operation waits on the other connection, so an abort from a watchdog
//     ends that wait as it would for a local rank.
// A remote process that goes away (its connection ends) without destroying
// its communicator aborts it on the host: the others' waits end with that
// reason. A host that goes away fails its remote ranks' next calls with
// ncclRemoteError; at a normal exit it first closes its worlds and writes
// the answers it owes (DrainProxies). Frames come from other processes:
// the host checks every field before sizing anything from it, and accepts
// connections from processes of its own user only. Not modelled: a group
// over several communicators one of which is remote (refused), outputs of
// a group that fails (none are delivered), a send that outlives its host
// (a send completes into the host's mailbox: if the host exits before the
// peer receives, the receive fails, where NCCL would have held the sender).

constexpr size_t kPidAt = 8, kTokenAt = 12, kTokenBytes = 16;

enum Request : uint32_t { kJoin = 1, kExec, kFailComm, kControl, kAsync, kLastError, kRetire };

std::string Hex(const std::string& bytes) {
  static const char digits[] = "0123456789abcdef";
  std::string s;
  for (unsigned char b : bytes) {
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

uint32_t IdPid(const std::string& id) {
  uint32_t pid = 0;
  std::memcpy(&pid, id.data() + kPidAt, sizeof(pid));
  return pid;
}

std::string HostSocket(const std::string& id) {
  return "plateau-emulated-nccl-" + std::to_string(IdPid(id)) + "-" +
         Hex(id.substr(kTokenAt, kTokenBytes));
}

// How long a remote rank waits for its proxy's answer: longer than any
// wait the proxy makes for the other ranks.
std::chrono::milliseconds ReplyLimit() { return 2 * WaitLimit() + std::chrono::seconds(10); }

// ---- The host: the proxies -------------------------------------------------

// One remote rank's communicator on the host. `comm` is taken (set null)
// by whichever connection retires it first, under `mu`; a call on it holds
// a CommUse taken under `mu`, so the retire waits for that call.
struct Proxied {
  std::mutex mu;
  ncclComm* comm = nullptr;
  std::string who;      // "rank r of n (process p)"
  uint64_t secret = 0;  // a control connection must name it with the handle
};

std::mutex proxied_mu;
uint64_t next_proxied = 1;  // guarded by proxied_mu
// kExec frames being served: received, not yet answered.
std::atomic<int> serving{0};
std::unordered_map<uint64_t, std::shared_ptr<Proxied>>& ProxiedComms() {
  static auto* comms = new std::unordered_map<uint64_t, std::shared_ptr<Proxied>>;
  return *comms;
}

CommUse UseProxied(Proxied& p) {
  std::lock_guard<std::mutex> lock(p.mu);
  return CommUse(p.comm);
}

ncclResult_t RetireProxied(Proxied& p, bool abort, const std::string& why) {
  ncclComm* c;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    c = std::exchange(p.comm, nullptr);
  }
  if (c == nullptr) return Fail(ncclInvalidArgument, kBadComm);
  return Retire(c, abort, abort ? "aborted" : "destroyed", why);
}

// Bytes an operation reads from its send buffer and writes to its receive
// buffer, on a rank of `ranks`.
size_t InputBytes(const Op& op, int rank, int ranks) {
  const size_t bytes = op.count * TypeSize(op.type);
  switch (op.kind) {
    case Kind::kReduceScatter:
      return bytes * static_cast<size_t>(ranks);
    case Kind::kBroadcast:
      return op.peer == rank ? bytes : 0;
    case Kind::kRecv:
      return 0;
    default:
      return bytes;
  }
}

size_t OutputBytes(const Op& op, int ranks) {
  const size_t bytes = op.count * TypeSize(op.type);
  switch (op.kind) {
    case Kind::kAllGather:
      return bytes * static_cast<size_t>(ranks);
    case Kind::kSend:
      return 0;
    default:
      return bytes;
  }
}

std::string Answer(ncclResult_t r, const std::string& why) {
  return wire::Writer().U32(static_cast<uint32_t>(r)).Str(why).Take();
}

// kExec: the operations, run on the proxied communicator with host buffers.
std::string ServeExec(Proxied& p, wire::Reader& in) {
  // The frame comes from another process: every field is checked before
  // anything is sized from it.
  constexpr uint32_t kMaxOps = 1 << 16;
  constexpr uint64_t kMaxBytes = uint64_t{1} << 36;
  const std::string malformed = "a malformed kExec frame";
  uint32_t n = 0;
  if (!in.U32(&n) || n == 0 || n > kMaxOps) return Answer(ncclInternalError, malformed);
  CommUse use = UseProxied(p);
  ncclComm* c = use.get();
  if (c == nullptr) return Answer(ncclInvalidArgument, kBadComm);
  std::vector<std::string> inputs(n), outputs(n);
  std::vector<Op> ops;
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t kind, type, redop, peer;
    uint64_t count;
    if (!in.U32(&kind) || !in.U64(&count) || !in.U32(&type) || !in.U32(&redop) || !in.U32(&peer) ||
        !in.Str(&inputs[i])) {
      return Answer(ncclInternalError, malformed);
    }
    const size_t elem = TypeSize(static_cast<ncclDataType_t>(type));
    if (kind > static_cast<uint32_t>(Kind::kRecv) || elem == 0 ||
        count > kMaxBytes / elem / static_cast<uint64_t>(c->size)) {
      return Answer(ncclInternalError, malformed);
    }
    Op op{static_cast<Kind>(kind),
          c,
          nullptr,
          inputs[i].data(),
          nullptr,
          count,
          static_cast<ncclDataType_t>(type),
          static_cast<ncclRedOp_t>(redop),
          static_cast<int>(peer)};
    if (inputs[i].size() != InputBytes(op, c->rank, c->size)) {
      return Answer(ncclInternalError, malformed + ": an input of the wrong size");
    }
    outputs[i].resize(OutputBytes(op, c->size));
    op.recv = outputs[i].data();
    const ncclResult_t r = Check(op);
    if (r != ncclSuccess) return Answer(r, last_error);
    ops.push_back(op);
  }
  const ncclResult_t r = Execute(ops, /*flush=*/false);
  wire::Writer out;
  out.U32(static_cast<uint32_t>(r)).Str(r == ncclSuccess ? "" : last_error);
  if (r == ncclSuccess) {
    for (const std::string& o : outputs) out.Str(o);
  }
  return out.Take();
}

bool MadeHere(const std::string& id);

// The operations connection: kJoin, then kExec and kFailComm until the
// remote rank closes it.
void ServeOperations(int fd, wire::Reader& join) {
  uint32_t nranks, rank, blocking, pid, physical;
  std::string id;
  std::string why;
  if (!join.U32(&nranks) || !join.U32(&rank) || !join.U32(&blocking) || !join.Str(&id) ||
      !join.U32(&pid) || !join.U32(&physical) || id.size() != NCCL_UNIQUE_ID_BYTES || nranks < 1 ||
      nranks > 1 << 16 || rank >= nranks || physical > 1 << 16) {
    wire::Send(fd, Answer(ncclInternalError, "a malformed kJoin frame"),
               Clock::now() + ReplyLimit(), &why);
    return;
  }
  if (!MadeHere(id)) {
    wire::Send(fd, Answer(ncclInvalidArgument, "the unique id was not made by this process"),
               Clock::now() + ReplyLimit(), &why);
    return;
  }
  const std::string what = "ncclCommInitRankConfig (rank " + std::to_string(rank) + " of " +
                           std::to_string(nranks) + ", process " + std::to_string(pid) + "): ";
  ncclComm_t c = nullptr;
  const ncclResult_t r = InitLocal(&c, static_cast<int>(nranks), id, static_cast<int>(rank),
                                   blocking != 0, /*device=*/0, static_cast<int>(physical), what);
  if (c == nullptr) {
    wire::Send(fd, Answer(r, last_error), Clock::now() + ReplyLimit(), &why);
    return;
  }
  auto p = std::make_shared<Proxied>();
  p->comm = c;
  p->who = RankName(c) + " (process " + std::to_string(pid) + ")";
  std::random_device random;
  p->secret = (uint64_t{random()} << 32) | random();
  uint64_t handle;
  {
    std::lock_guard<std::mutex> lock(proxied_mu);
    handle = next_proxied++;
    ProxiedComms()[handle] = p;
  }
  bool open = wire::Send(fd, wire::Writer().U32(r).Str("").U64(handle).U64(p->secret).Take(),
                         Clock::now() + ReplyLimit(), &why);
  while (open) {
    std::string frame;
    if (!wire::Receive(fd, &frame, Clock::time_point::max(), &why)) break;
    wire::Reader in(frame);
    uint32_t request = 0;
    std::string answer;
    if (in.U32(&request) && request == kExec) {
      ++serving;
      try {
        answer = ServeExec(*p, in);
      } catch (const std::bad_alloc&) {
        // The frame's buffers did not fit: this operation fails, the
        // connection and the count of answers owed stay right.
        answer = Answer(ncclSystemError, p->who + ": out of host memory in the host's proxy");
      }
    } else if (request == kFailComm) {
      uint32_t result = 0;
      std::string reason;
      in.U32(&result);
      in.Str(&reason);
      CommUse use = UseProxied(*p);
      if (use.get() != nullptr) FailComm(use.get(), static_cast<ncclResult_t>(result), reason);
      answer = Answer(ncclSuccess, "");
    } else {
      answer = Answer(ncclInternalError, "an unknown request on the operations connection");
    }
    open = wire::Send(fd, answer, Clock::now() + ReplyLimit(), &why);
    if (request == kExec) --serving;
  }
  // Gone without destroying its communicator (a clean destroy retired it
  // already): the others must not wait for it.
  RetireProxied(*p, /*abort=*/true,
                p->who + ": its process went away without destroying its communicator");
  std::lock_guard<std::mutex> lock(proxied_mu);
  ProxiedComms().erase(handle);
}

// The control connection: answers at once.
void ServeControl(int fd, wire::Reader& hello) {
  uint64_t handle = 0, secret = 0;
  std::shared_ptr<Proxied> p;
  if (hello.U64(&handle) && hello.U64(&secret)) {
    std::lock_guard<std::mutex> lock(proxied_mu);
    auto it = ProxiedComms().find(handle);
    if (it != ProxiedComms().end() && it->second->secret == secret) p = it->second;
  }
  std::string why;
  if (!wire::Send(fd, Answer(p ? ncclSuccess : ncclInvalidArgument, p ? "" : kBadComm),
                  Clock::now() + ReplyLimit(), &why) ||
      p == nullptr) {
    return;
  }
  for (;;) {
    std::string frame;
    if (!wire::Receive(fd, &frame, Clock::time_point::max(), &why)) return;
    wire::Reader in(frame);
    uint32_t request = 0;
    in.U32(&request);
    std::string answer;
    if (request == kAsync) {
      CommUse use = UseProxied(*p);
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r =
          use.get() != nullptr ? ncclCommGetAsyncError(use.get(), &state) : ncclInvalidArgument;
      answer = wire::Writer().U32(r).U32(state).Take();
    } else if (request == kLastError) {
      CommUse use = UseProxied(*p);
      std::string shown;
      if (use.get() != nullptr) {
        std::lock_guard<std::mutex> lock(use.get()->world->mu);
        shown = use.get()->async_why;
      }
      answer = Answer(ncclSuccess, shown);
    } else if (request == kRetire) {
      uint32_t abort = 0;
      std::string reason;
      in.U32(&abort);
      in.Str(&reason);
      const ncclResult_t r = RetireProxied(*p, abort != 0, reason);
      answer = Answer(r, r == ncclSuccess ? "" : last_error);
    } else {
      answer = Answer(ncclInternalError, "an unknown request on the control connection");
    }
    if (!wire::Send(fd, answer, Clock::now() + ReplyLimit(), &why)) return;
  }
}

// Connection threads (Serve) started and not yet ended.
std::atomic<int> connection_threads{0};

void Serve(int fd) {
  std::string frame, why;
  uint32_t request = 0;
  try {
    // The first frame is small (kJoin, kControl): a longer one is refused.
    if (wire::Receive(fd, &frame, Clock::now() + std::chrono::seconds(30), &why, 4096)) {
      wire::Reader in(frame);
      if (in.U32(&request) && request == kJoin) ServeOperations(fd, in);
      if (request == kControl) ServeControl(fd, in);
    }
  } catch (const std::exception& e) {
    // Out of memory outside an operation (ServeOperations answers those):
    // this connection ends instead of the process.
    std::fprintf(stderr, "emulated NCCL: a connection failed: %s\n", e.what());
  }
  wire::Close(fd);
  --connection_threads;
}

// At the host's exit: a remote rank's operation that completed with the
// host's own ranks must still get its answer (a rank that returns from the
// last collective may exit at once, before the proxy thread has written
// it). So the worlds are closed (operations still waiting end with that
// reason) and the answers drained, for 10 s at most. A process that ends
// with _exit or a signal skips this: its remote ranks lose it.
void DrainProxies() {
  std::vector<std::shared_ptr<Proxied>> all;
  {
    std::lock_guard<std::mutex> lock(proxied_mu);
    for (const auto& entry : ProxiedComms()) all.push_back(entry.second);
  }
  const std::string why =
      "the process that hosts the world (pid " + std::to_string(getpid()) + ") exited";
  for (const std::shared_ptr<Proxied>& p : all) {
    CommUse use = UseProxied(*p);
    if (use.get() == nullptr) continue;
    std::lock_guard<std::mutex> lock(use.get()->world->mu);
    CloseLocked(*use.get()->world, why);
  }
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(10);
  while (serving > 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// This process as a host: its token and socket, set up by the first
// ncclGetUniqueId (again in a forked child, which has a pid of its own and
// none of its parent's threads). If it cannot listen, its ids still work
// for its own threads.
struct Host {
  uint32_t pid = 0;
  char token[kTokenBytes] = {};
};

std::mutex host_mu;
Host host;               // guarded by host_mu; plain bytes: nothing a fork's child leaks
int host_listener = -1;  // guarded by host_mu

Host StartHost() {
  std::lock_guard<std::mutex> lock(host_mu);
  const uint32_t pid = static_cast<uint32_t>(getpid());
  if (host.pid == pid) return host;
  host.pid = pid;
  std::random_device device;
  for (char& b : host.token) b = static_cast<char>(device());
  std::string id(NCCL_UNIQUE_ID_BYTES, '\0');
  std::memcpy(id.data() + kPidAt, &pid, sizeof(pid));
  std::memcpy(id.data() + kTokenAt, host.token, kTokenBytes);
  std::string why;
  const int listener = wire::Listen(HostSocket(id), &why);
  if (listener < 0) {
    std::fprintf(stderr,
                 "emulated NCCL: process %u cannot listen for ranks in other processes (%s): "
                 "its unique ids serve its own threads only\n",
                 pid, why.c_str());
  } else {
    std::atexit(DrainProxies);
    host_listener = listener;  // a fork's child closes it (AfterForkInChild)
    // Lives as long as the process: ranks elsewhere may join at any time.
    std::thread([listener] {
      for (;;) {
        const int fd = wire::Accept(listener);
        if (fd < 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
          continue;
        }
        ++connection_threads;
        std::thread(Serve, fd).detach();
      }
    }).detach();
  }
  return host;
}

// ---- Forks ------------------------------------------------------------------
//
// A thread that forks copies the other threads' locks as they are, and the
// child has none of those threads to release them: a registry lock held by a
// proxy thread (retiring a rank whose process went away) or a watchdog's poll
// at the fork would hang the child's first call. So a fork takes every
// registry lock first and both sides release them after. These are held with
// no other of them (see "Locks" above), so any order is deadlock-free.
// A World's, a Worker's and a RemoteLink's locks are not taken: they belong to
// communicators the child cannot use (their threads and peers are the
// parent's). The runtime's lock, which communicator setup takes, has fork
// handlers of its own (runtime.cc).
std::mutex ids_mu;  // ncclGetUniqueId's count and random bytes

void BeforeFork() {
  host_mu.lock();
  ids_mu.lock();
  worlds_mu.lock();
  proxied_mu.lock();
  comms_mu.lock();
}

void AfterForkInParent() {
  comms_mu.unlock();
  proxied_mu.unlock();
  worlds_mu.unlock();
  ids_mu.unlock();
  host_mu.unlock();
}

void AfterForkInChild() {
  // A child forked without exec does not serve its parent's worlds: it must
  // not keep the socket open (remote ranks would connect into a queue no one
  // accepts, instead of learning that the host has gone).
  if (host_listener >= 0) close(host_listener);
  host_listener = -1;
  AfterForkInParent();
}

// At load, before any thread of the emulation exists.
const int fork_handlers = pthread_atfork(BeforeFork, AfterForkInParent, AfterForkInChild);

// Whether `id` was made by this process (a fork's child did not make its
// parent's ids: its pid differs).
bool MadeHere(const std::string& id) {
  return IdPid(id) == static_cast<uint32_t>(getpid()) &&
         std::memcmp(id.data() + kTokenAt, StartHost().token, kTokenBytes) == 0;
}

// ---- A remote rank ---------------------------------------------------------

// One request and its answer on one of `c`'s connections. False (and the
// link lost, with *why) if the host cannot be reached or does not answer.
bool Ask(ncclComm* c, bool control, const std::string& request, std::string* answer,
         std::string* why) {
  RemoteLink& link = *c->remote;
  {
    std::lock_guard<std::mutex> lock(link.lost_mu);
    if (!link.lost.empty()) {
      *why = link.lost;
      return false;
    }
  }
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(control ? link.ctl_mu : link.ops_mu);
    const int fd = control ? link.ctl_fd : link.ops_fd;
    if (wire::Send(fd, request, Clock::now() + ReplyLimit(), &failure) &&
        wire::Receive(fd, answer, Clock::now() + ReplyLimit(), &failure)) {
      return true;
    }
  }
  // Both connections end now: a call waiting on the other one returns, and
  // no later call can read an answer meant for this one.
  std::lock_guard<std::mutex> lock(link.lost_mu);
  if (link.lost.empty()) {
    link.lost = RankName(c) + ": lost the process that hosts its world (pid " +
                std::to_string(link.host_pid) + "): " + failure;
    wire::Shutdown(link.ops_fd);
    wire::Shutdown(link.ctl_fd);
  }
  *why = link.lost;
  return false;
}

void FailRemote(ncclComm* c, ncclResult_t result, const std::string& why) {
  std::string answer, lost;
  Ask(c, /*control=*/false, wire::Writer().U32(kFailComm).U32(result).Str(why).Take(), &answer,
      &lost);
}

ncclResult_t ExecuteRemote(const std::vector<Op>& ops) {
  ncclComm* c = ops[0].comm;
  wire::Writer request;
  request.U32(kExec).U32(static_cast<uint32_t>(ops.size()));
  for (const Op& op : ops) {
    request.U32(static_cast<uint32_t>(op.kind))
        .U64(op.count)
        .U32(static_cast<uint32_t>(op.type))
        .U32(static_cast<uint32_t>(op.op))
        .U32(static_cast<uint32_t>(op.peer))
        .Bytes(op.send, InputBytes(op, c->rank, c->size));
  }
  std::string answer, why;
  if (!Ask(c, /*control=*/false, request.Take(), &answer, &why)) return Fail(ncclRemoteError, why);
  wire::Reader in(answer);
  uint32_t r = ncclInternalError;
  std::vector<std::string> outputs(ops.size());
  if (!in.U32(&r) || !in.Str(&why)) return Fail(ncclInternalError, "a malformed answer");
  if (r != ncclSuccess) return Fail(static_cast<ncclResult_t>(r), why);
  for (size_t i = 0; i < ops.size(); ++i) {
    if (!in.Str(&outputs[i]) || outputs[i].size() != OutputBytes(ops[i], c->size)) {
      return Fail(ncclInternalError, "a malformed answer");
    }
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    if (!outputs[i].empty()) std::memcpy(ops[i].recv, outputs[i].data(), outputs[i].size());
  }
  return ncclSuccess;
}

ncclResult_t InitRemote(ncclComm_t* comm, int nranks, const std::string& id, int rank,
                        bool blocking, int device, int physical, const std::string& what) {
  auto c = std::make_unique<ncclComm>();
  c->rank = rank;
  c->size = nranks;
  c->device = device;
  c->physical = physical;
  c->remote = std::make_unique<RemoteLink>();
  RemoteLink& link = *c->remote;
  link.host_pid = static_cast<int>(IdPid(id));
  const std::string where =
      "the process that made the unique id (pid " + std::to_string(link.host_pid) + ")";
  std::string why, answer;
  link.ops_fd = wire::Connect(HostSocket(id), &why);
  if (link.ops_fd < 0) {
    return Fail(ncclSystemError, what + "cannot reach " + where + ": " + why +
                                     " (it has exited, or runs on another machine or in "
                                     "another network namespace)");
  }
  const std::string join = wire::Writer()
                               .U32(kJoin)
                               .U32(static_cast<uint32_t>(nranks))
                               .U32(static_cast<uint32_t>(rank))
                               .U32(blocking ? 1 : 0)
                               .Str(id)
                               .U32(static_cast<uint32_t>(getpid()))
                               .U32(static_cast<uint32_t>(physical))
                               .Take();
  if (!wire::Send(link.ops_fd, join, Clock::now() + ReplyLimit(), &why) ||
      !wire::Receive(link.ops_fd, &answer, Clock::now() + ReplyLimit(), &why)) {
    return Fail(ncclSystemError, what + "no answer from " + where + ": " + why);
  }
  wire::Reader in(answer);
  uint32_t r = ncclInternalError;
  uint64_t handle = 0, secret = 0;
  if (!in.U32(&r) || !in.Str(&why)) return Fail(ncclInternalError, what + "a malformed answer");
  if (r != ncclSuccess && r != ncclInProgress) return Fail(static_cast<ncclResult_t>(r), why);
  if (!in.U64(&handle) || !in.U64(&secret)) {
    return Fail(ncclInternalError, what + "a malformed answer");
  }
  link.ctl_fd = wire::Connect(HostSocket(id), &why);
  if (link.ctl_fd < 0 ||
      !wire::Send(link.ctl_fd, wire::Writer().U32(kControl).U64(handle).U64(secret).Take(),
                  Clock::now() + ReplyLimit(), &why) ||
      !wire::Receive(link.ctl_fd, &answer, Clock::now() + ReplyLimit(), &why)) {
    // The operations connection closes with `c`: the host aborts its rank.
    return Fail(ncclSystemError, what + "no control connection to " + where + ": " + why);
  }
  ncclComm* made = c.release();
  {
    std::lock_guard<std::mutex> lock(comms_mu);
    LiveComms().insert(made);
  }
  *comm = made;
  return static_cast<ncclResult_t>(r);
}

// Out of LiveComms already (Retire): tells the host, waits for the calls in
// flight (an abort ends their waits there), then frees `c`.
ncclResult_t RetireRemote(ncclComm* c, bool abort, const std::string& why) {
  std::string answer, lost;
  Ask(c, /*control=*/true, wire::Writer().U32(kRetire).U32(abort ? 1 : 0).Str(why).Take(), &answer,
      &lost);
  {
    std::unique_lock<std::mutex> lock(comms_mu);
    comms_cv.wait(lock, [c] { return c->calls == 0; });
  }
  StopWorker(c);
  delete c;  // closes both connections
  return ncclSuccess;
}

ncclResult_t RemoteAsyncError(ncclComm* c, ncclResult_t* state) {
  std::string answer, why;
  if (!Ask(c, /*control=*/true, wire::Writer().U32(kAsync).Take(), &answer, &why)) {
    *state = ncclRemoteError;
    return ncclSuccess;
  }
  wire::Reader in(answer);
  uint32_t r = ncclInternalError, s = ncclInternalError;
  if (!in.U32(&r) || !in.U32(&s)) return Fail(ncclInternalError, "a malformed answer");
  *state = static_cast<ncclResult_t>(s);
  return static_cast<ncclResult_t>(r);
}

std::string RemoteLastError(ncclComm* c) {
  std::string answer, why;
  if (!Ask(c, /*control=*/true, wire::Writer().U32(kLastError).Take(), &answer, &why)) return why;
  wire::Reader in(answer);
  uint32_t r = 0;
  std::string shown;
  in.U32(&r);
  in.Str(&shown);
  return shown;
}

}  // namespace
}  // namespace plateau::cuda_emulation

using emu::Kind;
using emu::Op;

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
  if (uniqueId == nullptr) return emu::Fail(ncclInvalidArgument, "ncclGetUniqueId: a null pointer");
  // A process-wide count first (no two ids of this process are equal), the
  // host's pid and token (see "Ranks in other processes"), then random
  // bytes (ids of different runs differ too).
  const emu::Host host = emu::StartHost();
  // The generator is made under ids_mu, which a fork takes: a fork during
  // its making would leave the child waiting on its guard.
  std::lock_guard<std::mutex> lock(emu::ids_mu);
  static uint64_t issued = 0;
  static std::mt19937_64 random{std::random_device{}()};
  const uint64_t n = ++issued;
  std::memcpy(uniqueId->internal, &n, sizeof(n));
  const uint32_t pid = static_cast<uint32_t>(getpid());
  std::memcpy(uniqueId->internal + emu::kPidAt, &pid, sizeof(pid));
  std::memcpy(uniqueId->internal + emu::kTokenAt, host.token, emu::kTokenBytes);
  for (size_t at = emu::kTokenAt + emu::kTokenBytes; at < NCCL_UNIQUE_ID_BYTES;
       at += sizeof(uint64_t)) {
    const uint64_t r = random();
    std::memcpy(uniqueId->internal + at, &r, std::min(sizeof(r), NCCL_UNIQUE_ID_BYTES - at));
  }
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t* config) {
  const std::string what = "ncclCommInitRankConfig (rank " + std::to_string(rank) + " of " +
                           std::to_string(nranks) + "): ";
  if (comm == nullptr) return emu::Fail(ncclInvalidArgument, what + "comm is a null pointer");
  *comm = nullptr;
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    return emu::Fail(ncclInvalidArgument, what + "not a rank of such a world");
  }
  bool blocking = true;
  if (config != nullptr) {
    if (config->magic != 0xcafebeef) {
      return emu::Fail(ncclInvalidArgument,
                       what + "the config was not set up with NCCL_CONFIG_INITIALIZER");
    }
    if (config->blocking != NCCL_CONFIG_UNDEF_INT) {
      if (config->blocking != 0 && config->blocking != 1) {
        return emu::Fail(ncclInvalidArgument, what + "config.blocking must be 0 or 1");
      }
      blocking = config->blocking == 1;
    }
  }
  const int device = emu::CurrentDevice();
  const int physical = emu::PhysicalDevice(device);
  if (physical < 0) {
    return emu::Fail(ncclUnhandledCudaError, what + "no CUDA device (none is visible)");
  }
  const std::string id(commId.internal, NCCL_UNIQUE_ID_BYTES);
  const ncclResult_t r =
      emu::MadeHere(id) ? emu::InitLocal(comm, nranks, id, rank, blocking, device, physical, what)
                        : emu::InitRemote(comm, nranks, id, rank, blocking, device, physical, what);
  // Not yet returned, so no other thread uses the communicator.
  if (!blocking && *comm != nullptr) {
    ncclComm* c = *comm;
    c->worker = emu::StartWorker(c->world != nullptr ? c->world->timeout : emu::WaitLimit());
  }
  return r;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  if (asyncError == nullptr) {
    return emu::Fail(ncclInvalidArgument, "ncclCommGetAsyncError: asyncError is a null pointer");
  }
  emu::CommUse use(comm);
  if (use.get() == nullptr) {
    return emu::Fail(ncclInvalidArgument, std::string("ncclCommGetAsyncError: ") + emu::kBadComm);
  }
  if (comm->call_in_progress) {
    *asyncError = ncclInProgress;
    return ncclSuccess;
  }
  if (comm->remote != nullptr) {
    const ncclResult_t r = emu::RemoteAsyncError(comm, asyncError);
    if (r == ncclSuccess) *asyncError = emu::WhileFinalizing(comm, *asyncError);
    return r;
  }
  emu::World& w = *comm->world;
  ncclResult_t state;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    if (comm->async_error == ncclSuccess && !w.complete) {
      if (w.closed) {
        emu::SetAsyncLocked(comm, ncclRemoteError,
                            "the world failed while joining: " + w.closed_why);
      } else if (emu::Clock::now() >= comm->join_deadline) {
        const std::string why = emu::RankName(comm) + ": only " + std::to_string(w.joined) +
                                " of " + std::to_string(w.size) + " ranks joined within " +
                                emu::Ms(w.timeout);
        emu::SetAsyncLocked(comm, ncclSystemError, why);
        emu::CloseLocked(w, why);
      } else {
        *asyncError = ncclInProgress;
        return ncclSuccess;
      }
    }
    state = comm->async_error;
  }
  *asyncError = emu::WhileFinalizing(comm, state);  // Worker::mu, not under World::mu
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  return emu::Retire(comm, /*abort=*/true, "aborted");
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  emu::CommUse use(comm);
  if (use.get() == nullptr) return emu::Fail(ncclInvalidArgument, emu::kBadComm);
  if (comm->worker == nullptr) return ncclSuccess;  // blocking: nothing is left in flight
  // As NCCL's non-blocking communicators: ncclCommGetAsyncError says
  // ncclInProgress until the operations on streams have finished.
  std::lock_guard<std::mutex> lock(comm->worker->mu);
  comm->worker->finalizing = true;
  return comm->worker->unfinished == 0 ? ncclSuccess : ncclInProgress;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  {
    // As NCCL's: finalizes first if the caller did not (bounded here).
    emu::CommUse use(comm);
    if (use.get() == nullptr) return emu::Fail(ncclInvalidArgument, emu::kBadComm);
    emu::AwaitJobs(comm);
  }
  return emu::Retire(comm, /*abort=*/false, "destroyed");
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled CUDA error (see ncclGetLastError)";
    case ncclSystemError:
      return "system error: a wait for other ranks timed out (see ncclGetLastError)";
    case ncclInternalError:
      return "internal error";
    case ncclInvalidArgument:
      return "invalid argument (see ncclGetLastError)";
    case ncclInvalidUsage:
      return "invalid usage (see ncclGetLastError)";
    case ncclRemoteError:
      return "another rank failed, aborted or left (see ncclGetLastError)";
    case ncclInProgress:
      return "operation in progress";
    default:
      return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  thread_local std::string shown;
  shown = emu::last_error;
  if (comm != nullptr) {
    emu::CommUse use(comm);
    if (use.get() != nullptr && comm->remote != nullptr) {
      const std::string remote = emu::RemoteLastError(comm);
      if (!remote.empty()) shown = remote;
    } else if (use.get() != nullptr) {
      std::lock_guard<std::mutex> lock(comm->world->mu);
      if (comm->async_error != ncclSuccess) shown = comm->async_why;
    }
  }
  return shown.c_str();
}

ncclResult_t ncclGroupStart() {
  ++emu::group.depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  emu::GroupState& g = emu::group;
  if (g.depth == 0) return emu::Fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--g.depth > 0) return ncclSuccess;
  std::vector<Op> ops = std::move(g.ops);
  g.ops.clear();
  const ncclResult_t refused = g.error;
  std::string why = std::move(g.why);
  g.error = ncclSuccess;
  g.why.clear();
  if (refused != ncclSuccess) {
    // As NCCL: an operation refused inside the group fails the whole group,
    // and nothing of it runs.
    return emu::Fail(refused, "the group was not run: " + why);
  }
  return ops.empty() ? ncclSuccess : emu::Execute(ops);
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return emu::Submit(
      Op{Kind::kSend, comm, stream, sendbuff, nullptr, count, datatype, ncclSum, peer});
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return emu::Submit(
      Op{Kind::kRecv, comm, stream, nullptr, recvbuff, count, datatype, ncclSum, peer});
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
  return emu::Submit(
      Op{Kind::kAllReduce, comm, stream, sendbuff, recvbuff, count, datatype, op, 0});
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  return emu::Submit(
      Op{Kind::kAllGather, comm, stream, sendbuff, recvbuff, sendcount, datatype, ncclSum, 0});
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  return emu::Submit(
      Op{Kind::kReduceScatter, comm, stream, sendbuff, recvbuff, recvcount, datatype, op, 0});
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  return emu::Submit(
      Op{Kind::kBroadcast, comm, stream, sendbuff, recvbuff, count, datatype, ncclSum, root});
}

void plateauEmulatedNcclCallsNeverFinish(bool on) { emu::calls_never_finish = on; }

int plateauEmulatedNcclConnectionThreads() { return emu::connection_threads.load(); }
