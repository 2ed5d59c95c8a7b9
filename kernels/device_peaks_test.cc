#include "kernels/device_peaks.h"

#include "gtest/gtest.h"

namespace plateau {
namespace {

// The names as cudaGetDeviceProperties reports them on each card.
TEST(DevicePeaksTest, CardsByTheirRuntimeNames) {
  struct Case {
    const char* name;
    int major, minor;
    const char* model;
    double fp32_t, bf16_t;
  } cases[] = {
      {"NVIDIA H200", 9, 0, "H200 SXM", 67, 989.4},
      {"NVIDIA H200 NVL", 9, 0, "H200 NVL", 60, 835.5},
      {"NVIDIA H100 80GB HBM3", 9, 0, "H100 SXM", 67, 989.4},
      {"NVIDIA H100 PCIe", 9, 0, "H100 PCIe", 51, 756.5},
      {"NVIDIA H100 NVL", 9, 0, "H100 NVL", 60, 835.5},
      {"NVIDIA A100-SXM4-80GB", 8, 0, "A100", 19.5, 312},
      {"NVIDIA A100 80GB PCIe", 8, 0, "A100", 19.5, 312},
      {"NVIDIA L40S", 8, 9, "L40S", 91.6, 362.05},
      {"NVIDIA L4", 8, 9, "L4", 30.3, 121},
      {"NVIDIA A10", 8, 6, "A10", 31.2, 125},
  };
  for (const Case& c : cases) {
    auto p = LookUpDevicePeak(c.name, c.major, c.minor);
    ASSERT_TRUE(p.has_value()) << c.name;
    EXPECT_STREQ(p->model, c.model) << c.name;
    EXPECT_DOUBLE_EQ(p->fp32_flops, c.fp32_t * 1e12) << c.name;
    EXPECT_DOUBLE_EQ(p->bf16_dense_flops, c.bf16_t * 1e12) << c.name;
  }
}

TEST(DevicePeaksTest, UnknownCardsAndContradictingCapabilitiesHaveNoEntry) {
  EXPECT_FALSE(LookUpDevicePeak("NVIDIA GeForce RTX 4090", 8, 9).has_value());
  EXPECT_FALSE(LookUpDevicePeak("", 9, 0).has_value());
  EXPECT_FALSE(LookUpDevicePeak("NVIDIA H100 80GB HBM3", 8, 0).has_value());  // not a Hopper: not this card
  EXPECT_FALSE(LookUpDevicePeak("NVIDIA L40", 8, 9).has_value());             // not L40S, not L4
}

// MFU is against the bf16 dense peak for a bf16 step and the fp32 peak for
// an fp32 step; the agent's flag for the step's precision overrides the
// table.
TEST(DevicePeaksTest, MfuAgainstThePeakOfTheStepsPrecision) {
  EXPECT_DOUBLE_EQ(MfuPeakFlops(0, "NVIDIA H200", 9, 0, /*bf16=*/true), 989.4e12);
  EXPECT_DOUBLE_EQ(MfuPeakFlops(0, "NVIDIA H200", 9, 0, /*bf16=*/false), 67e12);
  EXPECT_DOUBLE_EQ(MfuPeakFlops(5e14, "NVIDIA H200", 9, 0, true), 5e14);
  EXPECT_DOUBLE_EQ(MfuPeakFlops(0, "cpu", 0, 0, false), 0);
  // 400 TFLOP/s of a bf16 step on an H200 is 40.43% MFU.
  EXPECT_DOUBLE_EQ(Mfu(4e14, 1.0, MfuPeakFlops(0, "NVIDIA H200", 9, 0, true)), 4e14 / 989.4e12);
  EXPECT_DOUBLE_EQ(Mfu(8e14, 2.0, 1e15), 0.4);
  EXPECT_EQ(Mfu(1e12, 0, 1e15), 0);
  EXPECT_EQ(Mfu(1e12, 1, 0), 0);  // peak unknown: no MFU, never infinity
}

}  // namespace
}  // namespace plateau
