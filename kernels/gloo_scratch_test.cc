// The Gloo communicator's scratch on the plain heap, counted by replacing
// operator new (kernels/testing/heap_counter.h). The ring reduce-scatter is
// the step's largest collective (the dense gradient, D / P elements a
// block); its scratch is in no live set, so it has to stay small whatever
// the block: two 4 MiB segments per rank. Moving whole blocks it took two
// blocks per rank (here 64 MiB a rank; gigabytes at a large model).
#include <cstdint>
#include <cstdio>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/testing/heap_counter.h"
#include "kernels/testing/local_world.h"

namespace plateau {
namespace {

TEST(GlooScratchTest, TheReduceScattersScratchIsTwoSegmentsWhateverTheBlock) {
  if (!HeapIsCounted()) GTEST_SKIP() << "the heap is not counted in this build (AddressSanitizer's allocator)";
  constexpr int kRanks = 2;
  constexpr size_t kBlock = size_t{8} << 20;  // floats: 32 MiB a block
  constexpr int64_t kSegmentBytes = int64_t{4} << 20;
  HeapWindow window(kRanks);
  std::vector<int64_t> above(kRanks, -1);
  const absl::Status s = RunLocalWorld(
      kRanks, int64_t{3} * kRanks * kBlock * sizeof(float) / 2 + (int64_t{16} << 20), FreshStoreDir("scratch"),
      [&](int r, Backend& be, Communicator& world) -> absl::Status {
        absl::StatusOr<std::unique_ptr<Stream>> stream = be.CreateStream("comm");
        if (!stream.ok()) return stream.status();
        // The data lives in the device arena (not the heap), so the window
        // sees only what the collective itself allocates.
        absl::StatusOr<Buffer> send = be.device().Allocate(LiveSet::kGrads, kRanks * kBlock * sizeof(float));
        if (!send.ok()) return send.status();
        absl::StatusOr<Buffer> recv = be.device().Allocate(LiveSet::kGrads, kBlock * sizeof(float));
        if (!recv.ok()) return recv.status();
        float* x = send->as<float>();
        for (size_t i = 0; i < kRanks * kBlock; ++i) x[i] = static_cast<float>((i + r) % 7);
        window.Begin();
        absl::Status done =
            world.ReduceScatter(**stream, x, recv->as<float>(), kBlock, DataType::kFloat32, ReduceOp::kSum);
        if (done.ok()) done = (*stream)->Synchronize();
        above[r] = window.End();
        if (!done.ok()) return done;
        const float* y = recv->as<float>();
        for (size_t i = 0; i < kBlock; i += 4099) {
          const size_t at = r * kBlock + i;
          const float want = static_cast<float>(at % 7) + static_cast<float>((at + 1) % 7);
          if (y[i] != want) return absl::InternalError("a reduced element is wrong");
        }
        return absl::OkStatus();
      });
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_FALSE(window.broken());
  std::printf("heap over a reduce-scatter of %zu-byte blocks: rank 0 +%lld bytes, rank 1 +%lld bytes\n",
              kBlock * sizeof(float), static_cast<long long>(above[0]), static_cast<long long>(above[1]));
  // Both ranks at once: two segments each, and 1 MiB for Gloo's own
  // bookkeeping (buffers' descriptors, the stream's closures).
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_LE(above[r], kRanks * 2 * kSegmentBytes + (int64_t{1} << 20))
        << "rank " << r << ": the heap grew by " << above[r] << " bytes over a reduce-scatter of "
        << kBlock * sizeof(float) << "-byte blocks";
  }
}

}  // namespace
}  // namespace plateau
