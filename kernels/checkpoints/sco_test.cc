// SCO on its own, on a real CPU backend (device arena, host space, copy
// stream): the layout its policy picks for every host budget, the values
// of every boundary through forward and backward (also with every
// device<->host copy slowed, so that missing ordering would show as stale
// values), the measured device and host peaks against the plan, and the
// protocol errors. The step with SCO against the baseline step is
// kernels/step/step_offload_test.cc.
#include "kernels/checkpoints/sco.h"

#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kLayers = 6, kRows = 5, kHidden = 4;
constexpr int64_t kBoundaryBytes = kRows * kHidden * 4;

TEST(ScoPlanTest, TheHostPoolTakesTheEarliestBoundariesThatFit) {
  int64_t last_device = FullCheckpointsBytes(kLayers, kRows, kHidden) + 1;
  for (int64_t beta = 0; beta <= 10 * kBoundaryBytes; beta += kBoundaryBytes / 2) {
    const ScoLayout p = PlanSco(kLayers, kRows, kHidden, beta);
    EXPECT_EQ(p.boundaries, kLayers + 1);
    EXPECT_EQ(p.host_boundaries, std::min<int64_t>(beta / kBoundaryBytes, kLayers - 1)) << beta;
    EXPECT_LE(p.host_bytes(), beta);
    EXPECT_EQ(p.device_bytes() + p.host_bytes(), FullCheckpointsBytes(kLayers, kRows, kHidden));
    EXPECT_EQ(p.slots() + p.kept() + p.host_boundaries, p.boundaries);
    EXPECT_LE(p.device_bytes(), last_device) << "the device bytes must not grow with beta";
    last_device = p.device_bytes();
  }
  // At most L - 1 boundaries leave: two stay in the slots.
  EXPECT_EQ(PlanSco(kLayers, kRows, kHidden, int64_t{1} << 40).device_bytes(), 2 * kBoundaryBytes);
  // A one-layer model has nothing to offload.
  EXPECT_EQ(PlanSco(1, kRows, kHidden, int64_t{1} << 40).host_boundaries, 0);
}

TEST(ScoPlanTest, ANegativeBudgetNamesTheSpecField) {
  const absl::Status s = ValidateSco(-1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("schedule.sco.host_budget_bytes"));
}

struct Harness {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Stream> compute;
};

Harness MakeHarness(int64_t copy_delay_us) {
  BackendOptions bo;
  bo.device_memory_bytes = 1 << 20;
  bo.host_memory_bytes = 1 << 20;
  bo.copy_delay_us_for_testing = copy_delay_us;
  Harness h;
  h.backend = Backend::Create(bo).value();
  h.compute = h.backend->CreateStream("compute").value();
  return h;
}

float Value(int64_t step, int64_t l, int64_t i) { return static_cast<float>(1000 * step + 100 * l + i); }

// Two steps of the step's protocol. Forward: boundary l is written on the
// compute stream from the previous boundary (h_l = h_{l-1} + 100, so a
// stale or half-copied input shows in every later value); backward reads
// each boundary back on the compute stream and compares it.
void RunProtocol(int64_t beta, int64_t copy_delay_us) {
  Harness h = MakeHarness(copy_delay_us);
  Backend& be = *h.backend;
  auto store = Sco::Create(be, *h.compute, kLayers, kRows, kHidden, beta);
  ASSERT_TRUE(store.ok()) << store.status();
  const ScoLayout& p = (*store)->layout();
  const int64_t n = kRows * kHidden;
  // Allocated once: freeing a buffer drains every stream (kernels/memory.h),
  // which would order the copies for SCO and hide a missing event.
  auto hundreds = be.device().Allocate(LiveSet::kWorkspace, n * sizeof(float)).value();
  {
    std::vector<float> hundred(n, 100.0f);
    ASSERT_TRUE(be.Copy(*h.compute, hundreds.data(), hundred.data(), n * sizeof(float)).ok());
  }
  auto readback = be.host().Allocate(LiveSet::kWorkspace, (kLayers + 1) * n * sizeof(float)).value();
  for (int64_t step = 0; step < 2; ++step) {
    std::vector<float> first(n);
    for (int64_t i = 0; i < n; ++i) first[i] = Value(step, 0, i);
    const float* prev = nullptr;
    for (int64_t l = 0; l <= kLayers; ++l) {
      auto slot = (*store)->Slot(l);
      ASSERT_TRUE(slot.ok()) << slot.status();
      if (l == 0) {
        ASSERT_TRUE(be.Copy(*h.compute, *slot, first.data(), n * sizeof(float)).ok());
      } else {
        ASSERT_TRUE(be.Copy(*h.compute, *slot, prev, n * sizeof(float)).ok());
        ASSERT_TRUE(be.Add(*h.compute, *slot, *slot, hundreds.as<float>(), n).ok());
      }
      ASSERT_TRUE((*store)->Produced(l).ok());
      prev = *slot;
    }
    // Backward: each boundary is read on the compute stream into host-space
    // memory, a device-to-host copy that the delay slows too, so compute
    // lags behind the calls and a restore not ordered after compute's last
    // read of its slot would overwrite values still to be read.
    for (int64_t l = kLayers; l >= 0; --l) {
      auto in = (*store)->Acquire(l);
      ASSERT_TRUE(in.ok()) << in.status();
      ASSERT_TRUE(be.Copy(*h.compute, readback.as<float>() + l * n, *in, n * sizeof(float)).ok());
      ASSERT_TRUE((*store)->Done(l).ok());
    }
    ASSERT_TRUE(h.compute->Synchronize().ok());
    for (int64_t l = 0; l <= kLayers; ++l) {
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(readback.as<float>()[l * n + i], Value(step, l, i))
            << "beta " << beta << " step " << step << " boundary " << l;
      }
    }
  }
  EXPECT_EQ((*store)->restores(), 2 * p.host_boundaries);
  // Measured against the plan: exactly its bytes on each side.
  EXPECT_EQ(be.device().tracker().Snapshot().peak_of(LiveSet::kCheckpoints), p.device_bytes());
  EXPECT_EQ(be.host().tracker().Snapshot().peak_of(LiveSet::kCheckpoints), p.host_bytes());
}

class ScoProtocol : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(ScoProtocol, EveryBoundaryComesBackExactly) {
  const auto [host_boundaries, delay_us] = GetParam();
  RunProtocol(host_boundaries * kBoundaryBytes, delay_us);
}

// Host boundaries 0 (no copies) … 5 = L - 1 (all that can leave); every
// copy immediate, or slowed by 3 ms.
INSTANTIATE_TEST_SUITE_P(BudgetsAndDelays, ScoProtocol,
                         ::testing::Combine(::testing::Values(0, 1, 2, 3, 5),
                                            ::testing::Values(0, 3000)));

TEST(ScoTest, OutOfOrderUseIsAnError) {
  Harness h = MakeHarness(0);
  auto store = Sco::Create(*h.backend, *h.compute, kLayers, kRows, kHidden, 5 * kBoundaryBytes);
  ASSERT_TRUE(store.ok());
  for (int64_t l = 0; l <= kLayers; ++l) {
    ASSERT_TRUE((*store)->Slot(l).ok());
    ASSERT_TRUE((*store)->Produced(l).ok());
  }
  // h_0 … h_4 are on the host; h_5 and h_6 stay in the slots. Boundary 2
  // comes back into the slot boundary 4 holds, whose Done has not come.
  for (int64_t l : {6, 5}) {
    ASSERT_TRUE((*store)->Acquire(l).ok());
    ASSERT_TRUE((*store)->Done(l).ok());
  }
  ASSERT_TRUE((*store)->Acquire(4).ok());
  auto early = (*store)->Acquire(2);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(early.status().message()), HasSubstr("boundary 4"));
  EXPECT_EQ((*store)->Slot(kLayers + 1).status().code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE(h.compute->Synchronize().ok());
}

TEST(ScoTest, AHostTooSmallIsANamedOutOfMemory) {
  BackendOptions bo;
  bo.device_memory_bytes = 1 << 20;
  bo.host_memory_bytes = kBoundaryBytes;  // the pool needs 3
  auto be = Backend::Create(bo).value();
  auto compute = be->CreateStream("compute").value();
  auto store = Sco::Create(*be, *compute, kLayers, kRows, kHidden, 3 * kBoundaryBytes);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(store.status().message()), HasSubstr("live set 'checkpoints'"));
}

}  // namespace
}  // namespace plateau
