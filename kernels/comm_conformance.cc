#include "kernels/comm_conformance.h"

#include <time.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace plateau {
namespace conformance {

std::vector<int> Iota(int size) {
  std::vector<int> v(size);
  for (int i = 0; i < size; ++i) v[i] = i;
  return v;
}

int64_t AllToAllVSplit(int src, int dst, int size) {
  if (size > 1 && dst == size - 1) return 0;
  if (src == 0 && dst == 1) return 0;
  if (src == 2 && dst == 2) return 0;
  return (src * 7 + dst * 3 + 1) % 5 * 37;
}

void* HostMemory::Alloc(size_t bytes) {
  return bytes == 0 ? nullptr : std::malloc(bytes);
}
void HostMemory::Free(void* p) { std::free(p); }
void HostMemory::CopyIn(void* dst, const void* host, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, host, bytes);
}
void HostMemory::CopyOut(void* host, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(host, src, bytes);
}

namespace {

// CLOCK_MONOTONIC is one clock for every process of a machine (and does not
// jump), so ranks' times compare.
int64_t MonotonicNanos() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// A buffer of `count` T in the memory under test.
template <typename T>
class Buffer {
 public:
  Buffer(TestMemory& m, size_t count)
      : m_(m), count_(count), p_(static_cast<T*>(m.Alloc(count * sizeof(T)))) {}
  Buffer(TestMemory& m, const std::vector<T>& host) : Buffer(m, host.size()) {
    m_.CopyIn(p_, host.data(), host.size() * sizeof(T));
  }
  ~Buffer() { m_.Free(p_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  T* get() const { return p_; }
  std::vector<T> Read() const { return Read(0, count_); }
  std::vector<T> Read(size_t offset, size_t count) const {
    std::vector<T> host(count);
    m_.CopyOut(host.data(), p_ + offset, count * sizeof(T));
    return host;
  }

 private:
  TestMemory& m_;
  const size_t count_;
  T* const p_;
};

class Suite {
 public:
  Suite(Communicator& comm, Stream& stream, TestMemory& memory,
        const ConformanceOptions& options)
      : comm_(comm), stream_(stream), mem_(memory), options_(options) {}

  std::vector<std::string> Run() {
    seed_ = options_.seed * 100000;
    RunType<float>();
    RunType<double>();
    RunType<int32_t>();
    RunType<int64_t>();
    RunType<Bf16>();
    CheckBarrier();
    if (options_.groups) CheckGroups();
    return std::move(failures_);
  }

 private:
  int me() const { return comm_.rank(); }
  int size() const { return comm_.size(); }

  void Fail(const std::string& what) {
    failures_.push_back(absl::StrCat("rank ", me(), " of '", comm_.name(),
                                     "': ", what));
  }
  // False (and a failure) when the call or the stream failed.
  bool Ok(const absl::Status& s, const std::string& what) {
    if (!s.ok()) Fail(absl::StrCat(what, ": call failed: ", s.ToString()));
    return s.ok();
  }
  bool Sync(const std::string& what) {
    absl::Status s = stream_.Synchronize();
    if (!s.ok()) Fail(absl::StrCat(what, ": stream failed: ", s.ToString()));
    return s.ok();
  }
  // Bitwise: what moves data unchanged must not change a bit.
  template <typename T>
  static size_t FirstDifference(const T* a, const T* b, size_t n) {
    size_t i = 0;
    while (i < n && std::memcmp(a + i, b + i, sizeof(T)) == 0) ++i;
    return i;
  }
  template <typename T>
  void Expect(const std::vector<T>& got, const std::vector<T>& want,
              const std::string& what) {
    const size_t i = FirstDifference(got.data(), want.data(), std::min(got.size(), want.size()));
    if (got.size() == want.size() && i == got.size()) return;
    Fail(absl::StrCat(what, ": got ", got.size(), " elements, expected ",
                      want.size(), "; first difference at ", i));
  }

  // Every rank's `out` (n elements in the memory under test) must hold the
  // same bits: all-gathered and compared with this rank's.
  template <typename T>
  void CheckRanksAgree(const T* out, size_t n, const std::string& what) {
    const std::string gather = what + ": all_gather of every rank's result";
    Buffer<T> all(mem_, n * size());
    if (!Ok(comm_.AllGather(stream_, out, all.get(), n, DataTypeOf<T>()), gather) || !Sync(gather)) return;
    const std::vector<T> results = all.Read();
    const T* mine = results.data() + me() * n;
    for (int r = 0; r < size(); ++r) {
      const T* theirs = results.data() + r * n;
      const size_t i = FirstDifference(mine, theirs, n);
      if (i < n) {
        Fail(absl::StrCat(what, ": ranks disagree: rank ", r, " holds ", ToDouble(theirs[i]), " at element ", i,
                          ", this rank ", ToDouble(mine[i]), " (results must be the same bits on every rank)"));
      }
    }
  }

  template <typename T>
  void RunType() {
    const std::string type(DataTypeName(DataTypeOf<T>()));
    AllReduce<T>(type);
    ReduceScatter<T>(type);
    AllGather<T>(type);
    AllToAllV<T>(type);
    Broadcast<T>(type);
    SendRecv<T>(type);
  }

  std::vector<size_t> Counts(size_t small, size_t uneven, size_t large) const {
    std::vector<size_t> v = {small, uneven};
    if (options_.large) v.push_back(large);
    return v;
  }

  template <typename T>
  void AllReduce(const std::string& type) {
    for (size_t n : Counts(1, 1013, 300007)) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
        for (bool in_place : {false, true}) {
          const int seed = ++seed_;
          const std::string what =
              absl::StrCat("all_reduce ", type, " ", ReduceOpName(op), " n=",
                           n, in_place ? " in place" : "");
          const std::vector<T> input = Input<T>(seed, me(), n);
          Buffer<T> send(mem_, input);
          Buffer<T> recv(mem_, n);
          T* out = in_place ? send.get() : recv.get();
          if (!Ok(comm_.AllReduce(stream_, send.get(), out, n, DataTypeOf<T>(),
                                  op),
                  what) ||
              !Sync(what)) {
            continue;
          }
          const std::vector<T> got = in_place ? send.Read() : recv.Read();
          std::vector<double> magnitude;
          const std::vector<double> want = Reference<T>(seed, Iota(size()), n, op, &magnitude);
          const std::string bad = Mismatches(got.data(), want.data(), n, op, magnitude.data(), size());
          if (!bad.empty()) Fail(what + ":" + bad);
          if (!in_place) Expect(send.Read(), input, what + ": send changed");
          CheckRanksAgree(out, n, what);
        }
      }
    }
    AllReduceRepeats<T>(type);
  }

  // A sum of kRepeatedAllReduceCount elements twice, each time on fresh
  // buffers with the same inputs: the second run's bits are the first's.
  template <typename T>
  void AllReduceRepeats(const std::string& type) {
    const size_t n = kRepeatedAllReduceCount;
    const int seed = ++seed_;
    const std::string what = absl::StrCat("all_reduce ", type, " sum n=", n, " run twice");
    const std::vector<T> input = Input<T>(seed, me(), n);
    std::vector<T> first;
    for (int run = 0; run < 2; ++run) {
      Buffer<T> send(mem_, input);
      Buffer<T> recv(mem_, n);
      if (!Ok(comm_.AllReduce(stream_, send.get(), recv.get(), n, DataTypeOf<T>(), ReduceOp::kSum), what) ||
          !Sync(what)) {
        return;
      }
      std::vector<T> got = recv.Read();
      if (run == 0) {
        first = std::move(got);
        continue;
      }
      const size_t i = FirstDifference(got.data(), first.data(), n);
      if (i < n) {
        Fail(absl::StrCat(what, ": the second run differs from the first at element ", i, ": ", ToDouble(got[i]),
                          ", first ", ToDouble(first[i]), " (the same inputs must give the same bits)"));
      }
    }
  }

  template <typename T>
  void ReduceScatter(const std::string& type) {
    for (size_t block : Counts(1, 5, 40961)) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
        for (bool in_place : {false, true}) ReduceScatterCase<T>(type, block, op, in_place);
      }
    }
    // A block of two segments of the Gloo communicator's ring
    // (kReduceScatterSegmentBytes, 4 MiB): the first whole, the second part.
    if (options_.large && std::is_same_v<T, float>) {
      ReduceScatterCase<T>(type, (size_t{4} << 20) / sizeof(T) + 4099, ReduceOp::kSum, false);
    }
  }

  template <typename T>
  void ReduceScatterCase(const std::string& type, size_t block, ReduceOp op, bool in_place) {
    const int seed = ++seed_;
    const size_t n = block * size();
    const std::string what =
        absl::StrCat("reduce_scatter ", type, " ", ReduceOpName(op), " block=", block, in_place ? " in place" : "");
    const std::vector<T> input = Input<T>(seed, me(), n);
    Buffer<T> send(mem_, input);
    Buffer<T> recv(mem_, block);
    T* out = in_place ? send.get() + me() * block : recv.get();
    if (!Ok(comm_.ReduceScatter(stream_, send.get(), out, block, DataTypeOf<T>(), op), what) || !Sync(what)) {
      return;
    }
    const std::vector<T> got = in_place ? send.Read(me() * block, block) : recv.Read();
    std::vector<double> magnitude;
    const std::vector<double> want = Reference<T>(seed, Iota(size()), n, op, &magnitude);
    const std::string bad =
        Mismatches(got.data(), want.data() + me() * block, block, op, magnitude.data() + me() * block, size());
    if (!bad.empty()) Fail(what + ":" + bad);
    // Only this rank's block of send may change (in place).
    std::vector<T> after = send.Read();
    std::vector<T> expect_send = input;
    if (in_place) {
      std::copy(after.begin() + me() * block, after.begin() + (me() + 1) * block, expect_send.begin() + me() * block);
    }
    Expect(after, expect_send, what + ": other blocks of send changed");
  }

  template <typename T>
  void AllGather(const std::string& type) {
    for (size_t n : Counts(1, 6, 70001)) {
      for (bool in_place : {false, true}) {
        const int seed = ++seed_;
        const std::string what = absl::StrCat("all_gather ", type, " n=", n,
                                              in_place ? " in place" : "");
        const std::vector<T> mine = Input<T>(seed, me(), n);
        Buffer<T> send(mem_, mine);
        std::vector<T> initial(n * size(), T{0});
        if (in_place) {
          std::copy(mine.begin(), mine.end(), initial.begin() + me() * n);
        }
        Buffer<T> recv(mem_, initial);
        const T* src = in_place ? recv.get() + me() * n : send.get();
        if (!Ok(comm_.AllGather(stream_, src, recv.get(), n, DataTypeOf<T>()),
                what) ||
            !Sync(what)) {
          continue;
        }
        std::vector<T> want;
        for (int r = 0; r < size(); ++r) {
          std::vector<T> block = Input<T>(seed, r, n);
          want.insert(want.end(), block.begin(), block.end());
        }
        Expect(recv.Read(), want, what);
      }
    }
  }

  template <typename T>
  void AllToAllV(const std::string& type) {
    const std::string what = absl::StrCat("all_to_all_v ", type);
    std::vector<int64_t> send_counts(size()), recv_counts(size());
    std::vector<T> send_host, want;
    for (int d = 0; d < size(); ++d) {
      send_counts[d] = AllToAllVSplit(me(), d, size());
      recv_counts[d] = AllToAllVSplit(d, me(), size());
      for (int64_t i = 0; i < send_counts[d]; ++i) {
        send_host.push_back(Tagged<T>(me(), d, i));
      }
      for (int64_t i = 0; i < recv_counts[d]; ++i) {
        want.push_back(Tagged<T>(d, me(), i));
      }
    }
    Buffer<T> send(mem_, send_host);
    Buffer<T> recv(mem_, std::vector<T>(want.size(), FromDouble<T>(-1)));
    if (Ok(comm_.AllToAllV(stream_, send.get(), send_counts, recv.get(),
                           recv_counts, DataTypeOf<T>()),
           what) &&
        Sync(what)) {
      Expect(recv.Read(), want, what);
    }
    // Nothing at all to move.
    const std::vector<int64_t> zeros(size(), 0);
    const std::string empty = what + " all counts zero";
    if (Ok(comm_.AllToAllV(stream_, nullptr, zeros, nullptr, zeros,
                           DataTypeOf<T>()),
           empty)) {
      Sync(empty);
    }
  }

  template <typename T>
  void Broadcast(const std::string& type) {
    for (int root = size() - 1; root >= 0; --root) {
      for (size_t n : Counts(1, 777, 50003)) {
        const int seed = ++seed_;
        const std::string what =
            absl::StrCat("broadcast ", type, " root=", root, " n=", n);
        Buffer<T> data(mem_, Input<T>(seed, me(), n));
        if (!Ok(comm_.Broadcast(stream_, data.get(), n, DataTypeOf<T>(), root),
                what) ||
            !Sync(what)) {
          continue;
        }
        Expect(data.Read(), Input<T>(seed, root, n), what);
      }
    }
  }

  template <typename T>
  void SendRecv(const std::string& type) {
    const int right = (me() + 1) % size();
    const int left = (me() - 1 + size()) % size();
    // Neighbours send different amounts; rank 1 sends nothing when P > 2.
    auto count_of = [&](int r) -> size_t {
      return (size() > 2 && r == 1) ? 0 : 10 + 3 * r;
    };
    const int seed = ++seed_;
    Buffer<T> mine(mem_, Input<T>(seed, me(), count_of(me())));
    for (bool clockwise : {true, false}) {
      const int dst = clockwise ? right : left;
      const int src = clockwise ? left : right;
      const std::string what = absl::StrCat(
          "send_recv ", type, clockwise ? " to the right" : " to the left");
      Buffer<T> got(mem_, count_of(src));
      if (Ok(comm_.SendRecv(stream_, mine.get(), count_of(me()), dst,
                            got.get(), count_of(src), src, DataTypeOf<T>()),
             what) &&
          Sync(what)) {
        Expect(got.Read(), Input<T>(seed, src, count_of(src)), what);
      }
    }
    // With P > 2, ranks 0 and 1 send nothing to the right, so rank 1 sends
    // and receives nothing while its neighbours exchange. It still takes its
    // turn in the call order: the exchange after it, where every rank sends,
    // must meet (a rank that skipped the empty call would wait on a later
    // collective than its peers until the timeout).
    if (size() > 2) {
      auto idle_count = [&](int r) -> size_t { return r <= 1 ? 0 : 5 + r; };
      const int idle_seed = ++seed_;
      Buffer<T> out(mem_, Input<T>(idle_seed, me(), idle_count(me())));
      Buffer<T> in(mem_, idle_count(left));
      const std::string what = absl::StrCat("send_recv ", type, " with rank 1 idle both ways");
      if (Ok(comm_.SendRecv(stream_, out.get(), idle_count(me()), right, in.get(), idle_count(left), left,
                            DataTypeOf<T>()),
             what) &&
          Sync(what)) {
        Expect(in.Read(), Input<T>(idle_seed, left, idle_count(left)), what);
      }
      const int after_seed = ++seed_;
      Buffer<T> every(mem_, Input<T>(after_seed, me(), 8));
      Buffer<T> got(mem_, 8);
      const std::string after = absl::StrCat("send_recv ", type, " after rank 1's idle one");
      if (Ok(comm_.SendRecv(stream_, every.get(), 8, right, got.get(), 8, left, DataTypeOf<T>()), after) &&
          Sync(after)) {
        Expect(got.Read(), Input<T>(after_seed, left, 8), after);
      }
    }
    // A full circulation, as Ring-DTP moves its travellers.
    const int ring_seed = ++seed_;
    Buffer<T> a(mem_, Input<T>(ring_seed, me(), 64));
    Buffer<T> b(mem_, 64);
    T* traveller = a.get();
    T* next = b.get();
    for (int step = 1; step < size(); ++step) {
      const std::string what =
          absl::StrCat("send_recv ", type, " ring step ", step);
      if (!Ok(comm_.SendRecv(stream_, traveller, 64, right, next, 64, left,
                             DataTypeOf<T>()),
              what) ||
          !Sync(what)) {
        return;
      }
      std::swap(traveller, next);
      std::vector<T> held(64);
      mem_.CopyOut(held.data(), traveller, 64 * sizeof(T));
      Expect(held, Input<T>(ring_seed, (me() - step + size()) % size(), 64),
             what);
    }
  }

  // Each rank arrives 40 ms after the one before; nobody may leave before
  // the last arrival. Arrival and departure times (one machine, one clock)
  // are then gathered so every rank checks every other.
  void CheckBarrier() {
    const std::string what = "barrier";
    absl::SleepFor(absl::Milliseconds(40 * me()));
    const int64_t arrive = MonotonicNanos();
    if (!Ok(comm_.Barrier(stream_), what) || !Sync(what)) return;
    const int64_t leave = MonotonicNanos();
    Buffer<int64_t> mine(mem_, std::vector<int64_t>{arrive, leave});
    Buffer<int64_t> all(mem_, 2 * size());
    if (!Ok(comm_.AllGather(stream_, mine.get(), all.get(), 2,
                            DataType::kInt64),
            what) ||
        !Sync(what)) {
      return;
    }
    const std::vector<int64_t> times = all.Read();
    int64_t last_arrival = 0;
    for (int r = 0; r < size(); ++r) {
      last_arrival = std::max(last_arrival, times[2 * r]);
    }
    for (int r = 0; r < size(); ++r) {
      if (times[2 * r + 1] < last_arrival) {
        Fail(absl::StrCat("barrier: rank ", r, " left ",
                          (last_arrival - times[2 * r + 1]) / 1000,
                          " us before the last rank arrived"));
      }
    }
  }

  void CheckGroups() {
    // The world reversed: group rank i is world rank P - 1 - i.
    std::vector<int> reversed = Iota(size());
    std::reverse(reversed.begin(), reversed.end());
    auto g = comm_.Group("reversed", reversed);
    if (!Ok(g.status(), "group 'reversed'")) return;
    CheckGroup(**g, reversed);
    // Odd and even ranks, each a group named "parity".
    std::vector<int> parity;
    for (int r = me() % 2; r < size(); r += 2) parity.push_back(r);
    auto p = comm_.Group("parity", parity);
    if (!Ok(p.status(), "group 'parity'")) return;
    CheckGroup(**p, parity);
  }

  // `ranks` are ranks of comm_ (the members, in group order).
  void CheckGroup(Communicator& g, const std::vector<int>& ranks) {
    const std::string what = absl::StrCat(
        "group '", g.name(), "' [", absl::StrJoin(ranks, ","), "]");
    const int index =
        static_cast<int>(std::find(ranks.begin(), ranks.end(), me()) -
                         ranks.begin());
    if (g.rank() != index || g.size() != static_cast<int>(ranks.size())) {
      Fail(absl::StrCat(what, ": rank ", g.rank(), " of ", g.size(),
                        ", expected ", index, " of ", ranks.size()));
      return;
    }
    std::vector<int> world;
    for (int r : ranks) world.push_back(comm_.members()[r]);
    if (g.members() != world) {
      Fail(absl::StrCat(what, ": members [", absl::StrJoin(g.members(), ","),
                        "], expected [", absl::StrJoin(world, ","), "]"));
    }
    // All-gather of each member's rank: the members in group order.
    Buffer<int64_t> mine(mem_, std::vector<int64_t>{me()});
    Buffer<int64_t> all(mem_, ranks.size());
    const std::string gather = what + " all_gather";
    if (Ok(g.AllGather(stream_, mine.get(), all.get(), 1, DataType::kInt64),
           gather) &&
        Sync(gather)) {
      Expect(all.Read(), std::vector<int64_t>(ranks.begin(), ranks.end()),
             gather);
    }
    // A sum over the members only.
    const int seed = ++seed_;
    const size_t n = 4099;
    Buffer<double> x(mem_, Input<double>(seed, me(), n));
    const std::string reduce = what + " all_reduce";
    if (Ok(g.AllReduce(stream_, x.get(), x.get(), n, DataType::kFloat64,
                       ReduceOp::kSum),
           reduce) &&
        Sync(reduce)) {
      const std::vector<double> got = x.Read();
      const std::string bad =
          Mismatches(got.data(), Reference<double>(seed, ranks, n,
                                                   ReduceOp::kSum)
                                     .data(),
                     n, ReduceOp::kSum);
      if (!bad.empty()) Fail(reduce + ":" + bad);
    }
  }

  Communicator& comm_;
  Stream& stream_;
  TestMemory& mem_;
  const ConformanceOptions options_;
  int seed_ = 0;
  std::vector<std::string> failures_;
};

}  // namespace

std::vector<std::string> RunConformance(Communicator& comm, Stream& stream,
                                        TestMemory& memory,
                                        const ConformanceOptions& options) {
  return Suite(comm, stream, memory, options).Run();
}

}  // namespace conformance
}  // namespace plateau
