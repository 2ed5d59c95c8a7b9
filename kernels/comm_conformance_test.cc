// The conformance suite holds backends to the contract only if it fails the
// ones that break it. Here it runs on the Gloo communicator (P = 3 ranks as
// threads) through a wrapper that damages chosen results on the stream,
// after the real collective ran, as a broken backend would; each test checks
// that the suite reports exactly that damage.
#include "kernels/comm_conformance.h"

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/bf16.h"
#include "kernels/communicator.h"
#include "kernels/cpu_stream.h"
#include "kernels/kv_store.h"

namespace plateau {
namespace {

using ::testing::Contains;
using ::testing::Each;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// A collective's result, as the wrapper hands it to a tamper function once
// the stream has run the collective: `out` holds `count` elements of `type`
// (host memory: the suite runs on HostMemory).
struct Result {
  std::string op;  // "all_reduce", "reduce_scatter", ...
  DataType type;
  ReduceOp reduce;  // reductions only
  size_t count;
  void* out;
};
using Tamper = std::function<void(const Result&)>;

// Forwards every collective to `inner` and then enqueues `tamper` on the
// same (CPU) stream with the collective's result. Groups are the inner
// communicator's, untouched.
class TamperingCommunicator final : public Communicator {
 public:
  TamperingCommunicator(Communicator& inner, Tamper tamper)
      : Communicator(inner.backend(), inner.name(), inner.rank(), inner.members()),
        inner_(inner),
        tamper_(std::move(tamper)) {}

 protected:
  absl::Status DoAllReduce(Stream& st, const void* send, void* recv, size_t count, DataType type,
                           ReduceOp op) override {
    return Then(st, inner_.AllReduce(st, send, recv, count, type, op), {"all_reduce", type, op, count, recv});
  }
  absl::Status DoReduceScatter(Stream& st, const void* send, void* recv, size_t recv_count, DataType type,
                               ReduceOp op) override {
    return Then(st, inner_.ReduceScatter(st, send, recv, recv_count, type, op),
                {"reduce_scatter", type, op, recv_count, recv});
  }
  absl::Status DoAllGather(Stream& st, const void* send, void* recv, size_t send_count, DataType type) override {
    return Then(st, inner_.AllGather(st, send, recv, send_count, type),
                {"all_gather", type, ReduceOp::kSum, send_count * size(), recv});
  }
  absl::Status DoAllToAllV(Stream& st, const void* send, absl::Span<const int64_t> send_counts, void* recv,
                           absl::Span<const int64_t> recv_counts, DataType type) override {
    const int64_t received = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0});
    return Then(st, inner_.AllToAllV(st, send, send_counts, recv, recv_counts, type),
                {"all_to_all_v", type, ReduceOp::kSum, static_cast<size_t>(received), recv});
  }
  absl::Status DoBroadcast(Stream& st, void* data, size_t count, DataType type, int root) override {
    return Then(st, inner_.Broadcast(st, data, count, type, root), {"broadcast", type, ReduceOp::kSum, count, data});
  }
  absl::Status DoSendRecv(Stream& st, const void* send, size_t send_count, int dst, void* recv, size_t recv_count,
                          int src, DataType type) override {
    return Then(st, inner_.SendRecv(st, send, send_count, dst, recv, recv_count, src, type),
                {"send_recv", type, ReduceOp::kSum, recv_count, recv});
  }
  absl::Status DoBarrier(Stream& st) override { return inner_.Barrier(st); }
  absl::StatusOr<std::unique_ptr<Communicator>> DoGroup(const std::string& name, const std::vector<int>& ranks,
                                                        std::vector<int>) override {
    return inner_.Group(name, ranks);
  }

 private:
  absl::Status Then(Stream& st, absl::Status enqueued, Result result) {
    if (!enqueued.ok() || result.count == 0) return enqueued;
    static_cast<CpuStream&>(st).Enqueue([this, result] {
      tamper_(result);
      return absl::OkStatus();
    });
    return enqueued;
  }

  Communicator& inner_;
  const Tamper tamper_;
};

std::shared_ptr<KeyValueStore> MakeStore(const std::string& name) {
  static std::atomic<int> counter{0};
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir =
      absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/conformance_", name, "_", ::getpid(), "_", counter.fetch_add(1));
  std::filesystem::remove_all(dir);
  auto store = FileStore::Create(dir);
  EXPECT_TRUE(store.ok()) << store.status();
  return std::shared_ptr<KeyValueStore>(std::move(store).value());
}

// Runs the suite (no groups; small counts unless `large`) on `size` Gloo
// ranks, rank r's results damaged by tamper_for(r); returns every rank's
// failures.
std::vector<std::string> RunSuite(int size, const std::function<Tamper(int)>& tamper_for, bool large = false) {
  auto store = MakeStore(absl::StrCat("p", size));
  absl::Mutex mu;
  std::vector<std::string> failures;
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      CommunicatorOptions o;
      o.backend = BackendKind::kCpu;
      o.rank = r;
      o.size = size;
      o.store = store;
      o.prefix = "conformance/attempt0";
      o.timeout = absl::Seconds(30);
      CpuStream stream(absl::StrCat("comm", r));
      auto comm = CreateCommunicator(o);
      ASSERT_TRUE(comm.ok()) << "rank " << r << ": " << comm.status();
      TamperingCommunicator tampering(**comm, tamper_for(r));
      conformance::HostMemory memory;
      conformance::ConformanceOptions options;
      options.seed = 9;
      options.large = large;
      options.groups = false;
      std::vector<std::string> mine = conformance::RunConformance(tampering, stream, memory, options);
      absl::MutexLock lock(&mu);
      failures.insert(failures.end(), mine.begin(), mine.end());
    });
  }
  for (auto& t : threads) t.join();
  return failures;
}

Tamper Untouched() {
  return [](const Result&) {};
}

TEST(ConformanceSuiteTest, EveryElementTypeHasItsDataType) {
  EXPECT_EQ(conformance::DataTypeOf<float>(), DataType::kFloat32);
  EXPECT_EQ(conformance::DataTypeOf<double>(), DataType::kFloat64);
  EXPECT_EQ(conformance::DataTypeOf<int32_t>(), DataType::kInt32);
  EXPECT_EQ(conformance::DataTypeOf<int64_t>(), DataType::kInt64);
  EXPECT_EQ(conformance::DataTypeOf<Bf16>(), DataType::kBfloat16);
  // The sizes the suite's buffers are made with are the ones the
  // communicator moves.
  EXPECT_EQ(DataTypeSize(conformance::DataTypeOf<Bf16>()), sizeof(Bf16));
  EXPECT_EQ(DataTypeSize(conformance::DataTypeOf<int32_t>()), sizeof(int32_t));
}

TEST(ConformanceSuiteTest, AnUntouchedBackendPasses) {
  EXPECT_THAT(RunSuite(3, [](int) { return Untouched(); }), IsEmpty());
}

// bf16 sums 16 units in the last place off (far beyond P - 1 = 2 roundings),
// and one bit flipped in what max, min and the data movers return: every
// bf16 collective must be reported, and nothing else.
TEST(ConformanceSuiteTest, CatchesBrokenBf16Collectives) {
  const std::vector<std::string> failures = RunSuite(3, [](int) -> Tamper {
    return [](const Result& r) {
      if (r.type != DataType::kBfloat16) return;
      Bf16* out = static_cast<Bf16*>(r.out);
      const bool reduction = r.op == "all_reduce" || r.op == "reduce_scatter";
      if (reduction && r.reduce == ReduceOp::kSum) {
        for (size_t i = 0; i < r.count; ++i) out[i].bits += 16;
      } else {
        out[0].bits ^= 1;
      }
    };
  });
  EXPECT_THAT(failures, Each(HasSubstr("bfloat16")));
  for (const char* what : {"all_reduce bfloat16 sum", "all_reduce bfloat16 max", "all_reduce bfloat16 min",
                           "reduce_scatter bfloat16 sum", "reduce_scatter bfloat16 max", "all_gather bfloat16",
                           "all_to_all_v bfloat16", "broadcast bfloat16", "send_recv bfloat16"}) {
    EXPECT_THAT(failures, Contains(HasSubstr(what))) << what;
  }
}

// Rank 1's fp32 sums are one ulp off rank 0's and 2's in their first
// element: well within the tolerance of each rank's own check against the
// double reference, but ranks that clip by such results would drift apart.
TEST(ConformanceSuiteTest, CatchesRanksWhoseAllReduceDiffersByAnUlp) {
  const std::vector<std::string> failures = RunSuite(3, [](int rank) -> Tamper {
    if (rank != 1) return Untouched();
    return [](const Result& r) {
      if (r.op != "all_reduce" || r.type != DataType::kFloat32 || r.reduce != ReduceOp::kSum) return;
      float* out = static_cast<float*>(r.out);
      out[0] = std::nextafter(out[0], INFINITY);
    };
  });
  EXPECT_THAT(failures, Each(HasSubstr("ranks disagree")));
  EXPECT_THAT(failures, Contains(HasSubstr("all_reduce float32 sum n=1013")));
  EXPECT_THAT(failures, Contains(HasSubstr("all_reduce float32 sum n=1:")));
}

// Every rank's second run of the repeated sum is one ulp off its first (the
// same on every rank, so the ranks still agree).
TEST(ConformanceSuiteTest, CatchesAnAllReduceThatChangesRunToRun) {
  const std::vector<std::string> failures = RunSuite(3, [](int) -> Tamper {
    auto runs = std::make_shared<int>(0);
    return [runs](const Result& r) {
      if (r.op != "all_reduce" || r.type != DataType::kFloat32 || r.count != conformance::kRepeatedAllReduceCount ||
          ++*runs != 2) {
        return;
      }
      float* out = static_cast<float*>(r.out);
      out[7] = std::nextafter(out[7], INFINITY);
    };
  });
  EXPECT_EQ(failures.size(), 3u);
  EXPECT_THAT(failures, Each(HasSubstr("all_reduce float32 sum n=262147 run twice: the second run differs from the "
                                       "first at element 7")));
}

// A reduce-scatter wrong only past its block's first 4 MiB (the Gloo
// communicator's segment: an offset bug in its second segment) must be
// caught, so some block must be that large.
TEST(ConformanceSuiteTest, CatchesAReduceScatterWrongPastItsFirstSegment) {
  constexpr size_t kSegment = (size_t{4} << 20) / sizeof(float);
  const std::vector<std::string> failures = RunSuite(
      2,
      [](int) -> Tamper {
        return [](const Result& r) {
          if (r.op != "reduce_scatter" || r.type != DataType::kFloat32 || r.count <= kSegment) return;
          static_cast<float*>(r.out)[kSegment] += 1.0f;
        };
      },
      /*large=*/true);
  EXPECT_THAT(failures, Each(HasSubstr("reduce_scatter float32 sum block=1052675: [1048576] is")));
  EXPECT_EQ(failures.size(), 2u);
}

}  // namespace
}  // namespace plateau
