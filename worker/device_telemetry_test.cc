#include "worker/device_telemetry.h"

#include "gtest/gtest.h"

namespace plateau {
namespace {

DeviceView H200() {
  DeviceView v;
  v.name = "NVIDIA H200";
  v.cc_major = 9;
  v.cc_minor = 0;
  v.total_bytes = int64_t{150} << 30;
  v.free_bytes = int64_t{40} << 30;
  v.pool_reserved_bytes = int64_t{100} << 30;
  return v;
}

TEST(DeviceTelemetryTest, DeviceViewAndMfuAgainstTheBf16DensePeak) {
  v1::StepTelemetry t;
  // 2 ranks, 1.6e15 model FLOPs in 2 s: 400 TFLOP/s per device.
  SetDeviceTelemetry(H200(), 1.6e15, 2, 2.0, /*bf16=*/true, {}, &t);
  EXPECT_EQ(t.device_used_bytes(), int64_t{110} << 30);
  EXPECT_EQ(t.device_pool_reserved_bytes(), int64_t{100} << 30);
  EXPECT_DOUBLE_EQ(t.tflops(), 400);
  EXPECT_DOUBLE_EQ(t.mfu(), 4e14 / 989.4e12);
}

TEST(DeviceTelemetryTest, AnFp32StepIsMeasuredAgainstTheFp32Peak) {
  v1::StepTelemetry t;
  SetDeviceTelemetry(H200(), 3.35e13, 1, 1.0, /*bf16=*/false, {}, &t);
  EXPECT_DOUBLE_EQ(t.mfu(), 0.5);  // 33.5 of 67 TFLOP/s
}

TEST(DeviceTelemetryTest, TheAgentsFlagForTheStepsPrecisionOverridesTheTable) {
  v1::StepTelemetry t;
  PeakOverrides o;
  o.fp32_flops = 1e14;
  o.bf16_flops = 8e14;
  SetDeviceTelemetry(H200(), 4e14, 1, 1.0, /*bf16=*/true, o, &t);
  EXPECT_DOUBLE_EQ(t.mfu(), 0.5);
  SetDeviceTelemetry(H200(), 4e13, 1, 1.0, /*bf16=*/false, o, &t);
  EXPECT_DOUBLE_EQ(t.mfu(), 0.4);
}

// The CPU backend has no device view: memory fields stay 0, TFLOP/s is
// still the step's, MFU only with the agent's figure.
TEST(DeviceTelemetryTest, CpuHasNoDeviceViewAndNoTableEntry) {
  const absl::StatusOr<DeviceView> none = absl::UnimplementedError("cpu");
  v1::StepTelemetry t;
  SetDeviceTelemetry(none, 2e11, 2, 1.0, false, {}, &t);
  EXPECT_EQ(t.device_used_bytes(), 0);
  EXPECT_EQ(t.device_pool_reserved_bytes(), 0);
  EXPECT_DOUBLE_EQ(t.tflops(), 0.1);
  EXPECT_EQ(t.mfu(), 0);
  PeakOverrides o;
  o.fp32_flops = 1e12;
  SetDeviceTelemetry(none, 2e11, 2, 1.0, false, o, &t);
  EXPECT_DOUBLE_EQ(t.mfu(), 0.1);
}

}  // namespace
}  // namespace plateau
