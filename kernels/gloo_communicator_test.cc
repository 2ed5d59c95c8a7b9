// The Gloo communicator with P = 1..4 ranks as threads of this process: each
// thread has its own CpuStream and communicator; they meet through a
// FileStore in a fresh directory and talk TCP on 127.0.0.1. Every collective
// is checked against a local computation over all ranks' inputs (each rank
// can regenerate any rank's input from its seed).
#include "kernels/gloo_communicator.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/bf16.h"
#include "kernels/comm_conformance.h"
#include "kernels/communicator.h"
#include "kernels/cpu_stream.h"
#include "kernels/kv_store.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

// --- Harness ---------------------------------------------------------------

std::string FreshDir(const std::string& name) {
  static std::atomic<int> counter{0};
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/comm_", name,
                                 "_", ::getpid(), "_", counter.fetch_add(1));
  std::filesystem::remove_all(dir);
  return dir;
}

std::shared_ptr<KeyValueStore> MakeStore(const std::string& name) {
  auto store = FileStore::Create(FreshDir(name));
  EXPECT_TRUE(store.ok()) << store.status();
  return std::shared_ptr<KeyValueStore>(std::move(store).value());
}

CommunicatorOptions Options(int rank, int size,
                            std::shared_ptr<KeyValueStore> store,
                            absl::Duration timeout = absl::Seconds(30)) {
  CommunicatorOptions o;
  o.backend = BackendKind::kCpu;
  o.rank = rank;
  o.size = size;
  o.store = std::move(store);
  o.prefix = "test/attempt0";
  o.hostname = "127.0.0.1";
  o.timeout = timeout;
  return o;
}

using RankFn = std::function<void(Communicator& comm, CpuStream& stream)>;

// Runs `fn` on `size` threads, one world rank each.
void RunRanks(int size, const RankFn& fn,
              absl::Duration timeout = absl::Seconds(30)) {
  auto store = MakeStore(absl::StrCat("p", size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      CpuStream stream(absl::StrCat("comm", r));
      auto comm = CreateCommunicator(Options(r, size, store, timeout));
      ASSERT_TRUE(comm.ok()) << "rank " << r << ": " << comm.status();
      ASSERT_EQ((*comm)->rank(), r);
      ASSERT_EQ((*comm)->size(), size);
      fn(**comm, stream);
      EXPECT_TRUE(stream.Synchronize().ok()) << stream.Synchronize();
    });
  }
  for (auto& t : threads) t.join();
}

// --- Inputs and references ---------------------------------------------
// Every rank's input is a function of (seed, rank), so any rank computes
// every other rank's contribution locally (kernels/comm_conformance.h).

using conformance::AllToAllVSplit;
using conformance::DataTypeOf;
using conformance::Input;
using conformance::Iota;
using conformance::Mismatches;
using conformance::Tagged;

template <typename T>
std::vector<double> Reference(int seed, int size, size_t n, ReduceOp op) {
  return conformance::Reference<T>(seed, Iota(size), n, op);
}

constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin};

template <typename T>
class TypedCommTest : public ::testing::Test {};
using DataTypes = ::testing::Types<float, double, int32_t, int64_t>;
TYPED_TEST_SUITE(TypedCommTest, DataTypes);

// --- All-reduce --------------------------------------------------------

TYPED_TEST(TypedCommTest, AllReduceMatchesLocalReduction) {
  using T = TypeParam;
  // 1 element (fewer than ranks), an uneven count, and one spanning several
  // of Gloo's 1 MiB ring segments.
  const std::vector<size_t> counts = {1, 1013, 300007};
  for (int size : {1, 2, 3, 4}) {
    RunRanks(size, [&](Communicator& comm, CpuStream& stream) {
      int seed = 0;
      for (size_t n : counts) {
        for (ReduceOp op : kOps) {
          for (bool in_place : {false, true}) {
            ++seed;
            std::vector<T> send = Input<T>(seed, comm.rank(), n);
            const std::vector<T> original = send;
            std::vector<T> recv(n, T{0});
            T* out = in_place ? send.data() : recv.data();
            ASSERT_TRUE(comm.AllReduce(stream, send.data(), out, n,
                                       DataTypeOf<T>(), op)
                            .ok());
            ASSERT_TRUE(stream.Synchronize().ok()) << stream.Synchronize();
            const std::string what =
                absl::StrCat("all_reduce P=", size, " n=", n, " ",
                             ReduceOpName(op), in_place ? " in place" : "",
                             " rank ", comm.rank());
            EXPECT_EQ(Mismatches(out, Reference<T>(seed, size, n, op).data(), n,
                                 op),
                      "")
                << what;
            if (!in_place) {
              EXPECT_EQ(send, original) << what << ": send changed";
            }
          }
        }
      }
    });
  }
}

// --- Reduce-scatter ----------------------------------------------------

TYPED_TEST(TypedCommTest, ReduceScatterMatchesLocalReduction) {
  using T = TypeParam;
  for (int size : {1, 2, 3, 4}) {
    RunRanks(size, [&](Communicator& comm, CpuStream& stream) {
      int seed = 100;
      for (size_t block : {size_t{1}, size_t{5}, size_t{40961}}) {
        for (ReduceOp op : kOps) {
          for (bool in_place : {false, true}) {
            ++seed;
            const size_t n = block * size;
            std::vector<T> send = Input<T>(seed, comm.rank(), n);
            const std::vector<T> original = send;
            std::vector<T> recv(block, T{0});
            T* out = in_place ? send.data() + comm.rank() * block : recv.data();
            ASSERT_TRUE(comm.ReduceScatter(stream, send.data(), out, block,
                                           DataTypeOf<T>(), op)
                            .ok());
            ASSERT_TRUE(stream.Synchronize().ok()) << stream.Synchronize();
            const std::vector<double> want = Reference<T>(seed, size, n, op);
            const std::string what =
                absl::StrCat("reduce_scatter P=", size, " block=", block, " ",
                             ReduceOpName(op), in_place ? " in place" : "",
                             " rank ", comm.rank());
            EXPECT_EQ(Mismatches(out, want.data() + comm.rank() * block, block,
                                 op),
                      "")
                << what;
            if (in_place) {
              // Only this rank's block may change.
              for (size_t i = 0; i < n; ++i) {
                if (i / block == static_cast<size_t>(comm.rank())) continue;
                ASSERT_EQ(send[i], original[i]) << what << " element " << i;
              }
            } else {
              EXPECT_EQ(send, original) << what << ": send changed";
            }
          }
        }
      }
    });
  }
}

// Blocks larger than one segment of the ring (4 MiB: the reduce-scatter
// moves a block a segment at a time, so that its scratch is two segments
// whatever the block) give the same bits as the ring order summed whole:
// element i of block b is x_{b+1} + x_{b+2} + ... + x_b, left to right, in
// fp32, in place or not, at P = 3. 1,200,007 floats are a whole segment
// (1,048,576) and part of a second; an offset off by one element anywhere
// changes the sums.
TEST(CommTest, ReduceScatterInSegmentsSumsInTheRingOrder) {
  const int size = 3;
  const size_t block = 1200007;
  std::vector<std::vector<float>> in(size);
  for (int r = 0; r < size; ++r) in[r] = Input<float>(901, r, block * size);
  RunRanks(size, [&](Communicator& comm, CpuStream& stream) {
    const int b = comm.rank();
    for (bool in_place : {false, true}) {
      std::vector<float> send = in[b];
      std::vector<float> recv(block, std::nanf(""));
      float* out = in_place ? send.data() + b * block : recv.data();
      ASSERT_TRUE(comm.ReduceScatter(stream, send.data(), out, block, DataType::kFloat32, ReduceOp::kSum).ok());
      ASSERT_TRUE(stream.Synchronize().ok());
      for (size_t i = 0; i < block; ++i) {
        const size_t at = b * block + i;
        float want = in[(b + 1) % size][at];
        for (int k = 2; k <= size; ++k) want += in[(b + k) % size][at];
        ASSERT_EQ(absl::bit_cast<uint32_t>(out[i]), absl::bit_cast<uint32_t>(want))
            << "rank " << b << (in_place ? " in place" : "") << " element " << i;
      }
    }
  });
}

// --- bf16 (communicator.h: fp32 combine, one rounding per step) ---------

std::vector<Bf16> Bf16Input(int seed, int rank, size_t n) {
  std::mt19937 rng(seed * 131 + rank);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<Bf16> v(n);
  for (Bf16& x : v) x = FloatToBf16(dist(rng));
  return v;
}

// Reduce-scatter's ring order (gloo_communicator.cc): block b is summed
// starting after its owner, x_{b+1} + x_{b+2} + ... + x_b, each step
// rounded to bf16; so the result is reproduced bitwise here. Max and min
// keep an operand's bits. Sums are also within (P - 1) roundings of 2^-8
// relative of the partial sums, bounded by the sum of magnitudes, of the
// exact sum.
TEST(CommTest, Bf16ReduceScatterSumsInFp32RoundingOncePerHop) {
  for (int size : {1, 2, 3, 4}) {
    RunRanks(size, [&](Communicator& comm, CpuStream& stream) {
      const size_t block = 4099;
      const size_t n = block * size;
      int seed = 500;
      for (ReduceOp op : kOps) {
        ++seed;
        std::vector<std::vector<Bf16>> in(size);
        for (int r = 0; r < size; ++r) in[r] = Bf16Input(seed, r, n);
        std::vector<Bf16> out(block, Bf16{0x7fc0});
        ASSERT_TRUE(comm.ReduceScatter(stream, in[comm.rank()].data(), out.data(), block,
                                       DataType::kBfloat16, op)
                        .ok());
        ASSERT_TRUE(stream.Synchronize().ok());
        const int b = comm.rank();
        for (size_t i = 0; i < block; ++i) {
          const size_t at = b * block + i;
          Bf16 want = in[(b + 1) % size][at];
          double exact = Bf16ToFloat(want), mag = std::fabs(exact);
          for (int k = 2; k <= size; ++k) {
            const Bf16 x = in[(b + k) % size][at];
            const float fw = Bf16ToFloat(want), fx = Bf16ToFloat(x);
            if (op == ReduceOp::kSum) {
              want = FloatToBf16(fw + fx);
            } else if (op == ReduceOp::kMax) {
              want = fw < fx ? x : want;
            } else {
              want = fx < fw ? x : want;
            }
            exact += fx;
            mag += std::fabs(fx);
          }
          ASSERT_EQ(out[i].bits, want.bits) << "P=" << size << " " << ReduceOpName(op) << " " << i;
          if (op == ReduceOp::kSum) {
            ASSERT_LE(std::fabs(Bf16ToFloat(out[i]) - exact),
                      (size - 1) * kBf16UnitRoundoff * mag * (1 + 1.0 / (1 << 15)))
                << i;
          }
        }
      }
    });
  }
}

// All-reduce: every rank gets the same bits, the same run to run; with
// two ranks the one combining step is rn(a + b), and in general the sum is
// within P - 1 roundings of the exact one. All-gather moves bf16 bits.
TEST(CommTest, Bf16AllReduceAndAllGather) {
  for (int size : {2, 3}) {
    const size_t n = 3001;
    std::vector<std::vector<Bf16>> got(size), again(size), gathered(size);
    RunRanks(size, [&](Communicator& comm, CpuStream& stream) {
      const int r = comm.rank();
      std::vector<Bf16> x = Bf16Input(7, r, n);
      got[r] = x;
      ASSERT_TRUE(comm.AllReduce(stream, got[r].data(), got[r].data(), n, DataType::kBfloat16,
                                 ReduceOp::kSum)
                      .ok());
      again[r].assign(n, Bf16{0x7fc0});
      ASSERT_TRUE(comm.AllReduce(stream, x.data(), again[r].data(), n, DataType::kBfloat16,
                                 ReduceOp::kSum)
                      .ok());
      gathered[r].assign(n * size, Bf16{0x7fc0});
      ASSERT_TRUE(comm.AllGather(stream, x.data(), gathered[r].data(), n, DataType::kBfloat16).ok());
      ASSERT_TRUE(stream.Synchronize().ok());
    });
    std::vector<std::vector<Bf16>> in(size);
    for (int r = 0; r < size; ++r) in[r] = Bf16Input(7, r, n);
    for (int r = 0; r < size; ++r) {
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(got[r][i].bits, got[0][i].bits) << "P=" << size << " rank " << r << " " << i;
        ASSERT_EQ(again[r][i].bits, got[0][i].bits) << "run to run, P=" << size << " " << i;
      }
      for (int q = 0; q < size; ++q) {
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(gathered[r][q * n + i].bits, in[q][i].bits);
      }
    }
    for (size_t i = 0; i < n; ++i) {
      double exact = 0, mag = 0;
      for (int q = 0; q < size; ++q) {
        exact += Bf16ToFloat(in[q][i]);
        mag += std::fabs(Bf16ToFloat(in[q][i]));
      }
      if (size == 2) {
        ASSERT_EQ(got[0][i].bits, FloatToBf16(Bf16ToFloat(in[0][i]) + Bf16ToFloat(in[1][i])).bits);
      }
      ASSERT_LE(std::fabs(Bf16ToFloat(got[0][i]) - exact), (size - 1) * kBf16UnitRoundoff * mag * (1 + 1.0 / (1 << 15)))
          << i;
    }
  }
}

// --- All-gather ----------------------------------------------------------

TYPED_TEST(TypedCommTest, AllGatherConcatenatesInRankOrder) {
  using T = TypeParam;
  for (int size : {1, 2, 3, 4}) {
    RunRanks(size, [&](Communicator& comm, CpuStream& stream) {
      int seed = 200;
      // Blocks of up to 64 KiB gather directly, larger ones around Gloo's
      // ring: both sides of the boundary, and far on each side.
      const size_t edge = (size_t{64} << 10) / sizeof(T);
      for (size_t n : {size_t{1}, size_t{6}, edge, edge + 1, size_t{70001}}) {
        for (bool in_place : {false, true}) {
          ++seed;
          std::vector<T> mine = Input<T>(seed, comm.rank(), n);
          std::vector<T> recv(n * size, T{0});
          const T* send = mine.data();
          if (in_place) {
            std::copy(mine.begin(), mine.end(), recv.begin() + comm.rank() * n);
            send = recv.data() + comm.rank() * n;
          }
          ASSERT_TRUE(
              comm.AllGather(stream, send, recv.data(), n, DataTypeOf<T>())
                  .ok());
          ASSERT_TRUE(stream.Synchronize().ok()) << stream.Synchronize();
          for (int r = 0; r < size; ++r) {
            std::vector<T> want = Input<T>(seed, r, n);
            ASSERT_TRUE(std::equal(want.begin(), want.end(),
                                   recv.begin() + r * n))
                << "all_gather P=" << size << " n=" << n << " block " << r
                << " on rank " << comm.rank()
                << (in_place ? " in place" : "");
          }
        }
      }
    });
  }
}

// --- All-to-all-v ------------------------------------------------------

// The uneven pattern of conformance::AllToAllVSplit: some pairs are empty (e.g.
// 0 -> 1, 0 -> 3, 2 -> 0, and rank 2's block to itself) and the last rank
// receives nothing at all (when P > 1).
TYPED_TEST(TypedCommTest, AllToAllVWithUnevenAndEmptySplits) {
  using T = TypeParam;
  for (int size : {1, 2, 3, 4}) {
    RunRanks(size, [&](Communicator& comm, CpuStream& stream) {
      const int me = comm.rank();
      std::vector<int64_t> send_counts(size), recv_counts(size);
      std::vector<T> send;
      for (int d = 0; d < size; ++d) {
        send_counts[d] = AllToAllVSplit(me, d, size);
        recv_counts[d] = AllToAllVSplit(d, me, size);
        for (int64_t i = 0; i < send_counts[d]; ++i) {
          send.push_back(Tagged<T>(me, d, i));
        }
      }
      int64_t total = 0;
      for (int64_t c : recv_counts) total += c;
      if (size > 1 && me == size - 1) {
        ASSERT_EQ(total, 0);
      }
      std::vector<T> recv(total, T{-1});
      ASSERT_TRUE(comm.AllToAllV(stream, send.data(), send_counts,
                                 total > 0 ? recv.data() : nullptr,
                                 recv_counts, DataTypeOf<T>())
                      .ok());
      ASSERT_TRUE(stream.Synchronize().ok()) << stream.Synchronize();
      std::vector<T> want;
      for (int s = 0; s < size; ++s) {
        for (int64_t i = 0; i < recv_counts[s]; ++i) {
          want.push_back(Tagged<T>(s, me, i));
        }
      }
      EXPECT_EQ(recv, want) << "all_to_all_v P=" << size << " rank " << me;

      // Nothing at all to move: every count zero, null buffers.
      std::vector<int64_t> zeros(size, 0);
      ASSERT_TRUE(comm.AllToAllV(stream, nullptr, zeros, nullptr, zeros,
                                 DataTypeOf<T>())
                      .ok());
      ASSERT_TRUE(stream.Synchronize().ok()) << stream.Synchronize();
    });
  }
}

// --- Broadcast -----------------------------------------------------------

TYPED_TEST(TypedCommTest, BroadcastFromEveryRoot) {
  using T = TypeParam;
  for (int size : {1, 2, 3, 4}) {
    RunRanks(size, [&](Communicator& comm, CpuStream& stream) {
      for (int root = size - 1; root >= 0; --root) {
        for (size_t n : {size_t{1}, size_t{50003}}) {
          const int seed = 300 + root;
          std::vector<T> data = Input<T>(seed, comm.rank(), n);
          ASSERT_TRUE(
              comm.Broadcast(stream, data.data(), n, DataTypeOf<T>(), root)
                  .ok());
          ASSERT_TRUE(stream.Synchronize().ok()) << stream.Synchronize();
          EXPECT_EQ(data, Input<T>(seed, root, n))
              << "broadcast P=" << size << " root " << root << " n=" << n
              << " on rank " << comm.rank();
        }
      }
    });
  }
}

// --- SendRecv ----------------------------------------------------------

TYPED_TEST(TypedCommTest, SendRecvAroundTheRingBothWays) {
  using T = TypeParam;
  for (int size : {1, 2, 3, 4}) {
    RunRanks(size, [&](Communicator& comm, CpuStream& stream) {
      const int me = comm.rank();
      const int right = (me + 1) % size;
      const int left = (me - 1 + size) % size;
      // Rank r sends 10 + 3r elements (rank 1 sends none when P > 2), so
      // sizes differ between neighbours.
      auto count_of = [&](int r) -> size_t {
        return (size > 2 && r == 1) ? 0 : 10 + 3 * r;
      };
      const int seed = 400;
      std::vector<T> mine = Input<T>(seed, me, count_of(me));
      // Clockwise: to the right, from the left.
      std::vector<T> from_left(count_of(left));
      ASSERT_TRUE(comm.SendRecv(stream, mine.data(), mine.size(), right,
                                from_left.data(), from_left.size(), left,
                                DataTypeOf<T>())
                      .ok());
      // Counter-clockwise: to the left, from the right.
      std::vector<T> from_right(count_of(right));
      ASSERT_TRUE(comm.SendRecv(stream, mine.data(), mine.size(), left,
                                from_right.data(), from_right.size(), right,
                                DataTypeOf<T>())
                      .ok());
      ASSERT_TRUE(stream.Synchronize().ok()) << stream.Synchronize();
      EXPECT_EQ(from_left, Input<T>(seed, left, count_of(left)))
          << "clockwise P=" << size << " rank " << me;
      EXPECT_EQ(from_right, Input<T>(seed, right, count_of(right)))
          << "counter-clockwise P=" << size << " rank " << me;

      // A full circulation, as Ring-DTP moves its travellers: after P - 1
      // steps every rank has held every other rank's block once.
      std::vector<T> traveller = Input<T>(seed + 1, me, 64);
      std::vector<T> next(64);
      for (int step = 1; step < size; ++step) {
        ASSERT_TRUE(comm.SendRecv(stream, traveller.data(), 64, right,
                                  next.data(), 64, left, DataTypeOf<T>())
                        .ok());
        ASSERT_TRUE(stream.Synchronize().ok()) << stream.Synchronize();
        std::swap(traveller, next);
        EXPECT_EQ(traveller, Input<T>(seed + 1, (me - step + size) % size, 64))
            << "ring step " << step << " rank " << me;
      }
    });
  }
}

// --- The shared conformance suite -------------------------------------------

// The suite the multi-process and NCCL tests run, here with ranks as threads
// (small counts; the typed tests above cover the large ones).
TEST(CommTest, ConformanceSuitePasses) {
  for (int size : {1, 2, 3, 4}) {
    RunRanks(size, [&](Communicator& comm, CpuStream& stream) {
      conformance::HostMemory memory;
      conformance::ConformanceOptions options;
      options.seed = 5;
      options.large = false;
      for (const std::string& failure :
           conformance::RunConformance(comm, stream, memory, options)) {
        ADD_FAILURE() << "P=" << size << ": " << failure;
      }
    });
  }
}

// --- Barrier -------------------------------------------------------------

TEST(CommTest, BarrierWaitsForTheLastRank) {
  for (int size : {2, 3, 4}) {
    std::vector<std::atomic<bool>> arrived(size);
    for (auto& a : arrived) a.store(false);
    std::atomic<int> early{0};
    RunRanks(size, [&](Communicator& comm, CpuStream& stream) {
      const int me = comm.rank();
      // Later ranks arrive later; the last one 150 ms after the first.
      absl::SleepFor(absl::Milliseconds(50 * me));
      stream.Enqueue([&, me] {
        arrived[me].store(true);
        return absl::OkStatus();
      });
      ASSERT_TRUE(comm.Barrier(stream).ok());
      stream.Enqueue([&, size] {
        for (int r = 0; r < size; ++r) {
          if (!arrived[r].load()) early.fetch_add(1);
        }
        return absl::OkStatus();
      });
      ASSERT_TRUE(stream.Synchronize().ok()) << stream.Synchronize();
    });
    EXPECT_EQ(early.load(), 0) << "a rank left the barrier before P=" << size
                               << " ranks had all arrived";
  }
}

// --- Stream ordering ---------------------------------------------------

TEST(CommTest, CollectiveRunsAfterEarlierWorkOnItsStream) {
  RunRanks(3, [&](Communicator& comm, CpuStream& stream) {
    std::vector<float> x(1000, 0.0f);
    // The producer runs on the same stream before the collective, slowly.
    stream.Enqueue([&x, r = comm.rank()] {
      absl::SleepFor(absl::Milliseconds(30));
      std::fill(x.begin(), x.end(), static_cast<float>(r + 1));
      return absl::OkStatus();
    });
    ASSERT_TRUE(comm.AllReduce(stream, x.data(), x.data(), x.size(),
                               DataType::kFloat32, ReduceOp::kSum)
                    .ok());
    ASSERT_TRUE(stream.Synchronize().ok());
    EXPECT_EQ(x, std::vector<float>(1000, 6.0f));  // 1 + 2 + 3
  });
}

TEST(CommTest, DestroyingWaitsForEnqueuedWork) {
  // Each rank enqueues a collective and destroys its communicator before
  // synchronising: the destructor must wait for the collective to run.
  auto store = MakeStore("destroy");
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      CpuStream stream("s");
      std::vector<int64_t> x(100, r + 1);
      {
        auto comm = CreateCommunicator(Options(r, 2, store));
        ASSERT_TRUE(comm.ok()) << comm.status();
        stream.Enqueue([] {  // hold the collective back a little
          absl::SleepFor(absl::Milliseconds(50));
          return absl::OkStatus();
        });
        ASSERT_TRUE((*comm)->AllReduce(stream, x.data(), x.data(), x.size(),
                                       DataType::kInt64, ReduceOp::kSum)
                        .ok());
      }
      ASSERT_TRUE(stream.Synchronize().ok()) << stream.Synchronize();
      EXPECT_EQ(x, std::vector<int64_t>(100, 3));
    });
  }
  for (auto& t : threads) t.join();
}

// --- Groups --------------------------------------------------------------

TEST(CommTest, GroupOfASubsetRunsCollectivesAmongItsMembers) {
  RunRanks(4, [&](Communicator& world, CpuStream& stream) {
    const int me = world.rank();
    // Two disjoint "expert" groups with the same name: {1, 3} and {0, 2}.
    const std::vector<int> ranks =
        (me % 2 == 1) ? std::vector<int>{1, 3} : std::vector<int>{0, 2};
    auto group = world.Group("expert", ranks);
    ASSERT_TRUE(group.ok()) << group.status();
    Communicator& g = **group;
    EXPECT_EQ(g.name(), "expert");
    EXPECT_EQ(g.size(), 2);
    EXPECT_EQ(g.rank(), me / 2);
    EXPECT_EQ(g.members(), ranks);
    std::vector<int64_t> x = {me, 10 * me};
    ASSERT_TRUE(
        g.AllReduce(stream, x.data(), x.data(), 2, DataType::kInt64,
                    ReduceOp::kSum)
            .ok());
    std::vector<int64_t> gathered(4);
    const int64_t mine[2] = {me, -me};
    ASSERT_TRUE(
        g.AllGather(stream, mine, gathered.data(), 2, DataType::kInt64).ok());
    ASSERT_TRUE(stream.Synchronize().ok()) << stream.Synchronize();
    const int64_t sum = ranks[0] + ranks[1];
    EXPECT_EQ(x, (std::vector<int64_t>{sum, 10 * sum})) << "rank " << me;
    EXPECT_EQ(gathered, (std::vector<int64_t>{ranks[0], -ranks[0], ranks[1],
                                              -ranks[1]}));
    // The world still works after (and beside) its groups.
    int64_t one = 1;
    ASSERT_TRUE(world.AllReduce(stream, &one, &one, 1, DataType::kInt64,
                                ReduceOp::kSum)
                    .ok());
    ASSERT_TRUE(stream.Synchronize().ok());
    EXPECT_EQ(one, 4);
  });
}

TEST(CommTest, OverlappingGroupsRunConcurrentlyOnTheirOwnStreams) {
  RunRanks(4, [&](Communicator& world, CpuStream& stream) {
    const int me = world.rank();
    // "sequence" = {0, 1, 2}; "vocabulary" = {3, 1, 2} (group rank order is
    // the list's order). Ranks 1 and 2 are in both.
    const std::vector<int> seq = {0, 1, 2};
    const std::vector<int> voc = {3, 1, 2};
    auto in = [](const std::vector<int>& v, int r) {
      return std::find(v.begin(), v.end(), r) != v.end();
    };
    std::unique_ptr<Communicator> gs, gv;
    // Making a group blocks until its members have joined, so every rank
    // makes its groups in one agreed order.
    if (in(seq, me)) {
      auto s = world.Group("sequence", seq);
      ASSERT_TRUE(s.ok()) << s.status();
      gs = std::move(s).value();
    }
    if (in(voc, me)) {
      auto v = world.Group("vocabulary", voc);
      ASSERT_TRUE(v.ok()) << v.status();
      gv = std::move(v).value();
    }
    CpuStream seq_stream("sequence"), voc_stream("vocabulary");
    std::vector<double> xs(5000, me + 1.0), xv(5000, 100.0 * (me + 1));
    if (gs != nullptr) {
      EXPECT_EQ(gs->members(), seq);
      ASSERT_TRUE(gs->AllReduce(seq_stream, xs.data(), xs.data(), xs.size(),
                                DataType::kFloat64, ReduceOp::kMax)
                      .ok());
    }
    if (gv != nullptr) {
      EXPECT_EQ(gv->members(), voc);
      EXPECT_EQ(gv->rank(), std::find(voc.begin(), voc.end(), me) - voc.begin());
      ASSERT_TRUE(gv->AllReduce(voc_stream, xv.data(), xv.data(), xv.size(),
                                DataType::kFloat64, ReduceOp::kSum)
                      .ok());
      // Rank 1 of the group (world rank 1) broadcasts.
      double token = 1000.0 + me;
      ASSERT_TRUE(
          gv->Broadcast(voc_stream, &token, 1, DataType::kFloat64, 1).ok());
      ASSERT_TRUE(voc_stream.Synchronize().ok()) << voc_stream.Synchronize();
      EXPECT_EQ(token, 1001.0);
    }
    ASSERT_TRUE(seq_stream.Synchronize().ok()) << seq_stream.Synchronize();
    ASSERT_TRUE(voc_stream.Synchronize().ok()) << voc_stream.Synchronize();
    if (gs != nullptr) {
      EXPECT_EQ(xs, std::vector<double>(5000, 3.0));
    }
    if (gv != nullptr) {
      EXPECT_EQ(xv, std::vector<double>(5000, 100.0 * (4 + 2 + 3)));
    }

    // A group of a group: ranks {0, 2} of "sequence" are world ranks {0, 2}.
    if (gs != nullptr && gs->rank() != 1) {
      auto pair = gs->Group("pair", {0, 2});
      ASSERT_TRUE(pair.ok()) << pair.status();
      EXPECT_EQ((*pair)->members(), (std::vector<int>{0, 2}));
      int32_t v = me + 5;
      ASSERT_TRUE((*pair)->AllReduce(stream, &v, &v, 1, DataType::kInt32,
                                     ReduceOp::kMin)
                      .ok());
      ASSERT_TRUE(stream.Synchronize().ok()) << stream.Synchronize();
      EXPECT_EQ(v, 5);
    }
  });
}

TEST(CommTest, AGroupCanBeMadeAgainUnderTheSameName) {
  RunRanks(3, [&](Communicator& world, CpuStream& stream) {
    if (world.rank() == 0) return;
    for (int round = 0; round < 2; ++round) {
      auto g = world.Group("expert", {1, 2});
      ASSERT_TRUE(g.ok()) << "round " << round << ": " << g.status();
      int64_t v = world.rank() * (round + 1);
      ASSERT_TRUE((*g)->AllReduce(stream, &v, &v, 1, DataType::kInt64,
                                  ReduceOp::kSum)
                      .ok());
      ASSERT_TRUE(stream.Synchronize().ok()) << stream.Synchronize();
      EXPECT_EQ(v, 3 * (round + 1));
    }
  });
}

// --- Determinism ---------------------------------------------------------

// Float sums depend on the order of additions; the ring fixes it, so two
// runs (fresh communicators) give the same bits, and every rank holds the
// same all-reduce result.
TEST(CommTest, ReductionsAreDeterministicRunToRun) {
  for (int size : {3, 4}) {
    const size_t n = 100003;
    std::vector<std::vector<std::vector<float>>> allreduce(
        2, std::vector<std::vector<float>>(size));
    std::vector<std::vector<std::vector<float>>> scattered(
        2, std::vector<std::vector<float>>(size));
    for (int run = 0; run < 2; ++run) {
      RunRanks(size, [&](Communicator& comm, CpuStream& stream) {
        const int me = comm.rank();
        std::vector<float> x = Input<float>(7, me, n);
        std::vector<float> y = Input<float>(8, me, n * size);
        std::vector<float> block(n);
        ASSERT_TRUE(comm.AllReduce(stream, x.data(), x.data(), n,
                                   DataType::kFloat32, ReduceOp::kSum)
                        .ok());
        ASSERT_TRUE(comm.ReduceScatter(stream, y.data(), block.data(), n,
                                       DataType::kFloat32, ReduceOp::kSum)
                        .ok());
        ASSERT_TRUE(stream.Synchronize().ok());
        allreduce[run][me] = x;
        scattered[run][me] = block;
      });
    }
    for (int r = 0; r < size; ++r) {
      ASSERT_EQ(allreduce[0][r].size(), n);
      EXPECT_EQ(std::memcmp(allreduce[0][r].data(), allreduce[1][r].data(),
                            n * sizeof(float)),
                0)
          << "all_reduce bits differ between runs on rank " << r;
      EXPECT_EQ(std::memcmp(allreduce[0][r].data(), allreduce[0][0].data(),
                            n * sizeof(float)),
                0)
          << "all_reduce bits differ between rank " << r << " and rank 0";
      EXPECT_EQ(std::memcmp(scattered[0][r].data(), scattered[1][r].data(),
                            n * sizeof(float)),
                0)
          << "reduce_scatter bits differ between runs on rank " << r;
    }
  }
}

// --- Validation --------------------------------------------------------

// A stream that is not a CpuStream (as a CUDA stream would be).
class ForeignStream final : public Stream {
 public:
  const std::string& name() const override { return name_; }
  absl::Status Record(Event&) override { return absl::OkStatus(); }
  absl::Status Wait(Event&) override { return absl::OkStatus(); }
  absl::Status Synchronize() override { return absl::OkStatus(); }

 private:
  std::string name_ = "foreign";
};

void ExpectInvalid(const absl::Status& s, const std::string& substr) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(substr));
}

TEST(CommTest, InvalidArgumentsNameTheArgument) {
  RunRanks(4, [&](Communicator& comm, CpuStream& stream) {
    std::vector<float> a(64), b(64);
    const std::vector<int64_t> counts4(4, 1), counts3(3, 1);
    std::vector<int64_t> negative(4, 1);
    negative[1] = -2;
    ForeignStream foreign;

    ExpectInvalid(comm.AllToAllV(stream, a.data(), counts3, b.data(), counts4,
                                 DataType::kFloat32),
                  "send_counts has 3 entries; expected one per rank (4)");
    ExpectInvalid(comm.AllToAllV(stream, a.data(), counts4, b.data(), counts3,
                                 DataType::kFloat32),
                  "recv_counts has 3 entries");
    ExpectInvalid(comm.AllToAllV(stream, a.data(), counts4, b.data(),
                                 negative, DataType::kFloat32),
                  "recv_counts[1] = -2 is negative");
    std::vector<int64_t> self_mismatch(4, 1);
    self_mismatch[comm.rank()] = 2;
    ExpectInvalid(comm.AllToAllV(stream, a.data(), counts4, b.data(),
                                 self_mismatch, DataType::kFloat32),
                  absl::StrCat("send_counts[", comm.rank(), "] = 1 but recv_counts[",
                               comm.rank(), "] = 2"));
    ExpectInvalid(comm.AllToAllV(stream, nullptr, counts4, b.data(), counts4,
                                 DataType::kFloat32),
                  "send is null but 4 elements");
    ExpectInvalid(comm.AllToAllV(stream, a.data(), counts4, a.data() + 2,
                                 counts4, DataType::kFloat32),
                  "overlap");
    ExpectInvalid(comm.Broadcast(stream, a.data(), 4, DataType::kFloat32, 4),
                  "root = 4 is not a rank of this 4-rank group");
    ExpectInvalid(comm.Broadcast(stream, a.data(), 4, DataType::kFloat32, -1),
                  "root = -1");
    ExpectInvalid(comm.SendRecv(stream, a.data(), 4, -1, b.data(), 4, 0,
                                DataType::kFloat32),
                  "dst = -1");
    ExpectInvalid(comm.SendRecv(stream, a.data(), 4, 1, b.data(), 4, 4,
                                DataType::kFloat32),
                  "src = 4");
    ExpectInvalid(comm.SendRecv(stream, a.data(), 4, comm.rank(), b.data(), 4,
                                (comm.rank() + 1) % 4, DataType::kFloat32),
                  "exchanges with itself only both ways");
    ExpectInvalid(comm.SendRecv(stream, nullptr, 4, 1, b.data(), 4, 1,
                                DataType::kFloat32),
                  "send is null");
    ExpectInvalid(comm.AllReduce(stream, a.data(), nullptr, 8,
                                 DataType::kFloat32, ReduceOp::kSum),
                  "recv is null but 8 elements");
    ExpectInvalid(comm.AllReduce(stream, a.data(), a.data() + 1, 8,
                                 DataType::kFloat32, ReduceOp::kSum),
                  "overlap");
    ExpectInvalid(comm.AllReduce(stream, a.data(), b.data(), 8, static_cast<DataType>(9), ReduceOp::kSum),
                  "type: unknown data type 9; expected float32, float64, int32, int64 or bfloat16");
    ExpectInvalid(comm.AllReduce(stream, a.data(), b.data(), 8,
                                 DataType::kFloat32, static_cast<ReduceOp>(7)),
                  "op: unknown reduce op 7");
    ExpectInvalid(comm.AllReduce(foreign, a.data(), b.data(), 8,
                                 DataType::kFloat32, ReduceOp::kSum),
                  "stream 'foreign' is not a CPU stream");
    ExpectInvalid(comm.Barrier(foreign), "barrier: stream 'foreign'");
    ExpectInvalid(comm.ReduceScatter(stream, a.data(), a.data() + 1, 4,
                                     DataType::kFloat32, ReduceOp::kSum),
                  "the only overlap allowed is in place");
    ExpectInvalid(comm.AllGather(stream, b.data() + 1, b.data(), 4,
                                 DataType::kFloat32),
                  "the only overlap allowed is in place");
    ExpectInvalid(comm.AllGather(stream, a.data(), nullptr, 4,
                                 DataType::kFloat32),
                  "recv is null but 16 elements");

    // Groups.
    ExpectInvalid(comm.Group("", {0, 1}).status(), "name is empty");
    ExpectInvalid(comm.Group("expert", {}).status(),
                  "ranks of group 'expert' is empty");
    ExpectInvalid(comm.Group("expert", {0, 1, 1}).status(),
                  "lists rank 1 twice");
    ExpectInvalid(comm.Group("expert", {0, 7}).status(),
                  "ranks[1] = 7 of group 'expert' is not a rank of group "
                  "'world'");
    const int other = (comm.rank() + 1) % 4;
    ExpectInvalid(comm.Group("expert", {other}).status(),
                  "is not in ranks");

    // Nothing was enqueued by the failed calls; the stream is healthy and
    // the communicator still works.
    ASSERT_TRUE(stream.Synchronize().ok());
    int32_t v = 1;
    ASSERT_TRUE(comm.AllReduce(stream, &v, &v, 1, DataType::kInt32,
                               ReduceOp::kSum)
                    .ok());
    ASSERT_TRUE(stream.Synchronize().ok());
    EXPECT_EQ(v, 4);
  });
}

TEST(CommTest, ZeroCountsAreNoOpsWithNullBuffers) {
  RunRanks(2, [&](Communicator& comm, CpuStream& stream) {
    EXPECT_TRUE(comm.AllReduce(stream, nullptr, nullptr, 0, DataType::kFloat32,
                               ReduceOp::kSum)
                    .ok());
    EXPECT_TRUE(comm.ReduceScatter(stream, nullptr, nullptr, 0,
                                   DataType::kFloat32, ReduceOp::kSum)
                    .ok());
    EXPECT_TRUE(
        comm.AllGather(stream, nullptr, nullptr, 0, DataType::kFloat32).ok());
    EXPECT_TRUE(
        comm.Broadcast(stream, nullptr, 0, DataType::kFloat32, 1).ok());
    EXPECT_TRUE(comm.SendRecv(stream, nullptr, 0, 1 - comm.rank(), nullptr, 0,
                              1 - comm.rank(), DataType::kFloat32)
                    .ok());
    ASSERT_TRUE(stream.Synchronize().ok());
    // Later collectives still match up across ranks.
    int64_t v = comm.rank() + 1;
    ASSERT_TRUE(comm.AllReduce(stream, &v, &v, 1, DataType::kInt64,
                               ReduceOp::kSum)
                    .ok());
    ASSERT_TRUE(stream.Synchronize().ok());
    EXPECT_EQ(v, 3);
  });
}

TEST(CommTest, OptionsAreValidated) {
  auto store = MakeStore("options");
  CommunicatorOptions o = Options(2, 2, store);
  ExpectInvalid(CreateCommunicator(o).status(), "rank = 2 is outside [0, 2)");
  o = Options(0, 0, store);
  ExpectInvalid(CreateCommunicator(o).status(), "size must be >= 1, got 0");
  o = Options(0, 1, nullptr);
  ExpectInvalid(CreateCommunicator(o).status(), "store is null");
  o = Options(0, 1, store, absl::ZeroDuration());
  ExpectInvalid(CreateCommunicator(o).status(), "timeout must be positive");
  o = Options(0, 1, store);
  o.hostname = "";
  ExpectInvalid(CreateCommunicator(o).status(), "hostname is empty");
#ifndef PLATEAU_WITH_CUDA
  o = Options(0, 1, store);
  o.backend = BackendKind::kCuda;
  auto cuda = CreateCommunicator(o);
  EXPECT_EQ(cuda.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(cuda.status().message()),
              HasSubstr("rebuild with --config=cuda"));
#endif
}

// --- The process's devices -------------------------------------------------
// Every communicator shares the process's Gloo device for its hostname
// (gloo_communicator.cc says why): worlds made at once and one after
// another each see their own peers' data, and make no second device.

TEST(CommTest, WorldsMadeAtOnceAndInTurnShareTheProcesssDevice) {
  constexpr int kWorlds = 3, kRanks = 2, kRounds = 4;
  const int64_t made_before = GlooDevicesMade();
  for (int round = 0; round < kRounds; ++round) {
    std::vector<std::thread> worlds;
    for (int w = 0; w < kWorlds; ++w) {
      worlds.emplace_back([&, w] {
        RunRanks(kRanks, [&](Communicator& comm, CpuStream& stream) {
          // Distinct per world, round and rank.
          const double mine = 1000.0 * round + 10.0 * w + comm.rank() + 1;
          std::vector<double> x(257, mine);
          ASSERT_TRUE(comm.AllReduce(stream, x.data(), x.data(), x.size(), DataType::kFloat64, ReduceOp::kSum)
                          .ok());
          ASSERT_TRUE(stream.Synchronize().ok());
          const double want = kRanks * (1000.0 * round + 10.0 * w) + kRanks * (kRanks + 1) / 2.0;
          for (double v : x) ASSERT_EQ(v, want) << "world " << w << ", round " << round;
        });
      });
    }
    for (auto& t : worlds) t.join();
  }
  // 24 communicators on 127.0.0.1, and every test here uses that hostname:
  // one device in the whole process (made here or by an earlier test).
  EXPECT_EQ(GlooDevicesMade(), 1) << "made before this test: " << made_before;
}

// Makes a 2-rank world whose rank 1 closes as soon as it is made, and runs
// `fn` on rank 0 (while the peer is leaving or gone).
void WithAPeerThatLeaves(const std::string& name, const std::function<void(Communicator&)>& fn) {
  auto store = MakeStore(name);
  std::thread leaver([&] {
    auto comm = CreateCommunicator(Options(1, 2, store, absl::Seconds(5)));
    ASSERT_TRUE(comm.ok()) << comm.status();
  });  // closes at once
  auto comm = CreateCommunicator(Options(0, 2, store, absl::Seconds(5)));
  if (comm.ok()) fn(**comm);
  leaver.join();
  ASSERT_TRUE(comm.ok()) << comm.status();
}

TEST(CommTest, AWorldAfterOneWhosePeerLeftWorks) {
  WithAPeerThatLeaves("left_then", [](Communicator& comm) {
    CpuStream stream("s");
    std::vector<float> x(64, 1.0f);
    ASSERT_TRUE(comm.AllReduce(stream, x.data(), x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum).ok());
    EXPECT_FALSE(stream.Synchronize().ok());
  });
  RunRanks(2, [&](Communicator& comm, CpuStream& stream) {
    std::vector<float> x(64, static_cast<float>(comm.rank() + 1));
    ASSERT_TRUE(comm.AllReduce(stream, x.data(), x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum).ok());
    ASSERT_TRUE(stream.Synchronize().ok());
    for (float v : x) ASSERT_EQ(v, 3.0f);
  });
}

// --- Failures become statuses, never hangs -------------------------------

TEST(CommTest, APeerThatNeverJoinsTimesOutTheRendezvous) {
  auto store = MakeStore("no_peer");
  const absl::Time start = absl::Now();
  // Rank 1 of 2 never starts.
  auto comm = CreateCommunicator(Options(0, 2, store, absl::Milliseconds(300)));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded)
      << comm.status();
  EXPECT_THAT(std::string(comm.status().message()),
              HasSubstr("rendezvous of group 'world' (rank 0 of 2)"));
  EXPECT_THAT(std::string(comm.status().message()),
              HasSubstr("test/attempt0/world/"));  // the missing key
  EXPECT_LT(took, absl::Seconds(10));
}

// Ranks 1 and 2 of 4 arrive late, each within a timeout of the one before,
// and rank 3 never does. Gloo waits for its peers' keys in turn; with a
// fresh timeout per wait, rank 0 gave up only 2.4 timeouts after it began
// (rank 2's arrival plus a whole timeout for rank 3). The rendezvous's one
// timeout bounds all of it.
TEST(CommTest, LatePeersDoNotStretchTheRendezvousPastItsTimeout) {
  auto store = MakeStore("late_peers");
  const absl::Duration timeout = absl::Seconds(1);
  std::vector<std::thread> late;
  for (int r : {1, 2}) {
    late.emplace_back([&, r] {
      absl::SleepFor(timeout * 0.7 * r);
      // They fail too (rank 0 is gone, rank 3 never comes), by their own
      // deadlines.
      auto comm = CreateCommunicator(Options(r, 4, store, timeout));
      EXPECT_FALSE(comm.ok()) << "rank " << r;
    });
  }
  const absl::Time start = absl::Now();
  auto comm = CreateCommunicator(Options(0, 4, store, timeout));
  const absl::Duration took = absl::Now() - start;
  for (auto& t : late) t.join();
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
  EXPECT_THAT(std::string(comm.status().message()), HasSubstr("rendezvous of group 'world' (rank 0 of 4)"));
  EXPECT_LT(took, 2 * timeout) << comm.status();
}

TEST(CommTest, APeerThatNeverJoinsAGroupTimesItOut) {
  RunRanks(
      3,
      [&](Communicator& world, CpuStream&) {
        if (world.rank() == 2) return;  // lists itself, never joins
        if (world.rank() == 0) return;
        auto g = world.Group("expert", {1, 2});
        EXPECT_EQ(g.status().code(), absl::StatusCode::kDeadlineExceeded)
            << g.status();
        EXPECT_THAT(std::string(g.status().message()),
                    HasSubstr("rendezvous of group 'expert' (rank 0 of 2"));
      },
      absl::Milliseconds(1500));
}

TEST(CommTest, APeerThatSkipsACollectiveTimesItOut) {
  RunRanks(
      2,
      [&](Communicator& comm, CpuStream&) {
        if (comm.rank() == 1) {
          // Stay connected but never take part; outlive rank 0's timeout.
          absl::SleepFor(absl::Milliseconds(4000));
          return;
        }
        CpuStream stream("failing");  // will hold the error
        std::vector<float> x(16, 1.0f);
        const absl::Time start = absl::Now();
        ASSERT_TRUE(comm.AllReduce(stream, x.data(), x.data(), x.size(),
                                   DataType::kFloat32, ReduceOp::kSum)
                        .ok());  // enqueued; the failure comes on the stream
        absl::Status s = stream.Synchronize();
        EXPECT_LT(absl::Now() - start, absl::Seconds(10));
        EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
        EXPECT_THAT(std::string(s.message()),
                    HasSubstr("all_reduce on group 'world' (rank 0 of 2)"));

        // The communicator is now unusable, and says why.
        CpuStream fresh("fresh");
        ASSERT_TRUE(comm.Barrier(fresh).ok());
        absl::Status again = fresh.Synchronize();
        EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
        EXPECT_THAT(std::string(again.message()),
                    HasSubstr("unusable after an earlier failure"));
        EXPECT_THAT(std::string(again.message()), HasSubstr("all_reduce"));
      },
      absl::Milliseconds(1500));
}

TEST(CommTest, APeerThatLeavesFailsTheCollective) {
  auto store = MakeStore("leaver");
  std::atomic<bool> left{false};
  std::thread leaver([&] {
    auto comm = CreateCommunicator(Options(1, 2, store, absl::Seconds(5)));
    ASSERT_TRUE(comm.ok()) << comm.status();
    comm->reset();  // closes its connections
    left.store(true);
  });
  auto comm = CreateCommunicator(Options(0, 2, store, absl::Seconds(5)));
  ASSERT_TRUE(comm.ok()) << comm.status();
  leaver.join();
  ASSERT_TRUE(left.load());
  CpuStream stream("s");
  std::vector<double> x(1000, 1.0);
  const absl::Time start = absl::Now();
  ASSERT_TRUE((*comm)->AllReduce(stream, x.data(), x.data(), x.size(),
                                 DataType::kFloat64, ReduceOp::kSum)
                  .ok());
  absl::Status s = stream.Synchronize();
  // Gloo sees the closed connection at once: UNAVAILABLE, not a timeout.
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("all_reduce on group 'world' (rank 0 of 2)"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

// Gloo writes with writev, which raises SIGPIPE once the peer has closed:
// a rank whose peer ran out of memory and left must see a failed
// collective, not die of the signal (exit 141; step_oom_test did, about one
// run in eight, on Gloo's 48-byte notifications). The write has to fall
// between the peer's close and the event loop seeing it, so the test tries
// many times: a world, rank 1 closes at once, rank 0 sends small messages.
TEST(CommTest, WritingToAPeerThatLeftFailsTheCollectiveNotTheProcess) {
  int failed = 0;
  for (int attempt = 0; attempt < 100; ++attempt) {
    WithAPeerThatLeaves("sigpipe", [&](Communicator& comm) {
      CpuStream stream("s");
      std::vector<float> x(16, 1.0f), y(16);
      for (int i = 0; i < 20; ++i) {
        ASSERT_TRUE(comm.SendRecv(stream, x.data(), x.size(), 1, y.data(), y.size(), 1, DataType::kFloat32).ok());
      }
      failed += !stream.Synchronize().ok();
    });
  }
  // The peer never receives: every attempt ends in a failed collective.
  EXPECT_EQ(failed, 100);
}

}  // namespace
}  // namespace plateau
