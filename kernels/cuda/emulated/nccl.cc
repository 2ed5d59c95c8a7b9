// The emulated NCCL (nccl.h): ranks are threads of this process, and every
// operation runs on the calling thread when it is called (a group's at its
// outermost ncclGroupEnd).
//
// Why not on the stream, as NCCL does: the emulated runtime runs a stream's
// work lazily, under its lock, when some host call looks at the stream. A
// collective there would wait for the other ranks while holding that lock,
// and the other ranks need the lock to run their own streams up to the same
// collective: a deadlock. So a call first runs its stream's work so far
// (Flush: what it reads is written), takes its part in the rendezvous with
// no lock of the runtime held, and leaves its results in place before
// returning; work enqueued on the stream afterwards runs after it, as on a
// GPU.
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
// Locks: worlds_mu (forming worlds) before World::mu; comms_mu (live
// communicators) is never held together with another. None is held across
// a call into the runtime.
#include "kernels/cuda/emulated/nccl.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kernels/cuda/emulated/emulation.h"

// What a missing peer's timeout adds: the likeliest cause under the
// emulation is a world of processes (the service's rank processes), which
// it cannot join.
constexpr char kOneProcess[] =
    " (the emulated NCCL joins the ranks of one process only: ranks in other processes never "
    "arrive)";

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
  std::shared_ptr<emu::World> world;
  int rank = 0;
  int device = 0;
  emu::Clock::time_point join_deadline;
  // Guarded by world->mu.
  uint64_t next_seq = 0;
  ncclResult_t async_error = ncclSuccess;
  std::string async_why;
  // Guarded by comms_mu: calls in flight on this communicator.
  int calls = 0;
};

namespace plateau::cuda_emulation {
namespace {

std::string RankName(const ncclComm* c) {
  return "rank " + std::to_string(c->rank) + " of " + std::to_string(c->world->size);
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
std::condition_variable comms_cv;
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
  World& w = *c->world;
  const std::string what = std::string(KindName(op.kind)) + " on " + RankName(c) + ": ";
  {
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
  if (has_peer && (op.peer < 0 || op.peer >= w.size)) {
    return Fail(ncclInvalidArgument, what + (op.kind == Kind::kBroadcast ? "root " : "peer ") +
                                         std::to_string(op.peer) + " is not a rank");
  }
  // The largest buffer an operation touches: count elements per rank.
  if (op.count > SIZE_MAX / elem / static_cast<size_t>(w.size)) {
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

// Runs a group (or a single operation): every stream's work so far, then
// the sends (so that no rank's receive waits for a send queued behind it),
// the collectives in call order, the receives. Returns the first error;
// the rest still run (each fails at once on a communicator that failed).
ncclResult_t Execute(const std::vector<Op>& ops) {
  std::vector<CommUse> uses;
  uses.reserve(ops.size());
  for (const Op& op : ops) {
    uses.emplace_back(op.comm);
    if (uses.back().get() == nullptr) {
      return Fail(ncclInvalidArgument, std::string(KindName(op.kind)) + ": " + kBadComm);
    }
  }
  std::vector<cudaStream_t> flushed;
  for (const Op& op : ops) {
    if (std::find(flushed.begin(), flushed.end(), op.stream) != flushed.end()) continue;
    flushed.push_back(op.stream);
    const cudaError_t e = Flush(op.stream);
    if (e == cudaSuccess) continue;
    // Its inputs are not there: this rank cannot take part, and the others
    // must not wait for it.
    const std::string why = RankName(op.comm) + ": its stream failed before " + KindName(op.kind) +
                            " (" + cudaGetErrorName(e) + ")";
    for (const Op& o : ops) {
      World& w = *o.comm->world;
      std::lock_guard<std::mutex> lock(w.mu);
      SetAsyncLocked(o.comm, ncclUnhandledCudaError, why);
      CloseLocked(w, why);
    }
    return Fail(ncclUnhandledCudaError, why);
  }
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

}  // namespace
}  // namespace plateau::cuda_emulation

using emu::Kind;
using emu::Op;

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
  if (uniqueId == nullptr) return emu::Fail(ncclInvalidArgument, "ncclGetUniqueId: a null pointer");
  // A process-wide count first (no two ids of this process are equal), then
  // random bytes (ids of different runs differ too).
  static std::mutex mu;
  static uint64_t issued = 0;
  static std::mt19937_64 random{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mu);
  const uint64_t n = ++issued;
  std::memcpy(uniqueId->internal, &n, sizeof(n));
  for (size_t at = sizeof(n); at < NCCL_UNIQUE_ID_BYTES; at += sizeof(uint64_t)) {
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
  if (device < 0) return emu::Fail(ncclUnhandledCudaError, what + "no current device");

  auto owned = std::make_unique<ncclComm>();
  ncclComm* c = owned.get();
  c->rank = rank;
  c->device = device;
  const std::string id(commId.internal, NCCL_UNIQUE_ID_BYTES);
  std::shared_ptr<emu::World> w;
  {
    std::lock_guard<std::mutex> registry(emu::worlds_mu);
    std::shared_ptr<emu::World>& forming = emu::FormingWorlds()[id];
    if (forming == nullptr) forming = std::make_shared<emu::World>(id, nranks);
    w = forming;
    std::lock_guard<std::mutex> lock(w->mu);
    if (w->size != nranks) {
      return emu::Fail(ncclInvalidUsage, what + "the other ranks of this unique id say " +
                                             std::to_string(w->size) + " ranks");
    }
    if (w->members[static_cast<size_t>(rank)] != nullptr) {
      return emu::Fail(ncclInvalidUsage, what + "this rank has joined this unique id already");
    }
    if (w->closed) {
      return emu::Fail(ncclRemoteError, what + "the world has failed: " + w->closed_why);
    }
    w->members[static_cast<size_t>(rank)] = c;
    ++w->joined;
    c->world = w;
    c->join_deadline = emu::Clock::now() + w->timeout;
    if (w->joined == w->size) {
      // Complete: no one else may join this id.
      w->complete = true;
      emu::FormingWorlds().erase(id);
      w->cv.notify_all();
    }
  }
  {
    std::lock_guard<std::mutex> lock(emu::comms_mu);
    emu::LiveComms().insert(owned.release());
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
                          std::to_string(w->size) + " ranks joined within " +
                          emu::Ms(w->timeout) + kOneProcess;
  }
  // A blocking initialisation that fails leaves no communicator behind.
  *comm = nullptr;
  emu::Retire(c, /*abort=*/true, "gave up on", why);
  return emu::Fail(failure, why);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  if (asyncError == nullptr) {
    return emu::Fail(ncclInvalidArgument, "ncclCommGetAsyncError: asyncError is a null pointer");
  }
  emu::CommUse use(comm);
  if (use.get() == nullptr) {
    return emu::Fail(ncclInvalidArgument, std::string("ncclCommGetAsyncError: ") + emu::kBadComm);
  }
  emu::World& w = *comm->world;
  std::lock_guard<std::mutex> lock(w.mu);
  if (comm->async_error == ncclSuccess && !w.complete) {
    if (w.closed) {
      emu::SetAsyncLocked(comm, ncclRemoteError, "the world failed while joining: " + w.closed_why);
    } else if (emu::Clock::now() >= comm->join_deadline) {
      const std::string why = emu::RankName(comm) + ": only " + std::to_string(w.joined) + " of " +
                              std::to_string(w.size) + " ranks joined within " +
                              emu::Ms(w.timeout) + kOneProcess;
      emu::SetAsyncLocked(comm, ncclSystemError, why);
      emu::CloseLocked(w, why);
    } else {
      *asyncError = ncclInProgress;
      return ncclSuccess;
    }
  }
  *asyncError = comm->async_error;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  return emu::Retire(comm, /*abort=*/true, "aborted");
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  emu::CommUse use(comm);
  if (use.get() == nullptr) return emu::Fail(ncclInvalidArgument, emu::kBadComm);
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
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
    if (use.get() != nullptr) {
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
