// The baseline store: one launch-sized allocation of exactly its plan, a
// slot per boundary, and a clear error for a boundary the model does not have.
#include "kernels/checkpoints/full_checkpoints.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

TEST(FullCheckpointsTest, HoldsEveryBoundaryInItsPlannedBytes) {
  HeapSpace device(SpaceKind::kDevice, "device", 1 << 20);
  auto store = FullCheckpoints::Create(device, 3, 5, 4);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(device.tracker().current(LiveSet::kCheckpoints), FullCheckpointsBytes(3, 5, 4));
  EXPECT_EQ(FullCheckpointsBytes(3, 5, 4), 4 * 5 * 4 * 4);
  for (int64_t l = 0; l <= 3; ++l) {
    auto slot = (*store)->Slot(l);
    ASSERT_TRUE(slot.ok());
    for (int i = 0; i < 20; ++i) (*slot)[i] = static_cast<float>(100 * l + i);
    EXPECT_TRUE((*store)->Produced(l).ok());
  }
  for (int64_t l = 3; l >= 0; --l) {
    auto in = (*store)->Acquire(l);
    ASSERT_TRUE(in.ok());
    for (int i = 0; i < 20; ++i) ASSERT_EQ((*in)[i], static_cast<float>(100 * l + i)) << l;
    EXPECT_TRUE((*store)->Done(l).ok());
  }
  EXPECT_EQ((*store)->Slot(4).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string((*store)->Acquire(-1).status().message()), ::testing::HasSubstr("boundary -1"));
  store->reset();
  EXPECT_EQ(device.tracker().current(LiveSet::kCheckpoints), 0);
}

TEST(FullCheckpointsTest, ADeviceTooSmallIsANamedOutOfMemory) {
  HeapSpace device(SpaceKind::kDevice, "device", 100);
  auto store = FullCheckpoints::Create(device, 3, 5, 4);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(store.status().message()), ::testing::HasSubstr("live set 'checkpoints'"));
}

}  // namespace
}  // namespace plateau
