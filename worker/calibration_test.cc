// The calibration: a real measurement on the CPU backend gives a curve the
// model accepts and frees what it allocated; the cache returns what it
// stored, and measures again when the backend, the binaries or the file
// change.
#include "worker/calibration.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/memory.h"
#include "worker/calibration_measure.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(base ? base : "/tmp", "/", name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

TEST(CalibrationTest, MeasuresTheCpuBackendAndFreesWhatItUsed) {
  BackendOptions o;
  o.kind = BackendKind::kCpu;
  o.device_memory_bytes = int64_t{64} << 20;
  auto backend = Backend::Create(o);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto c = MeasureCalibration(**backend);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->backend(), (*backend)->Describe());
  ASSERT_EQ(c->gemm_size(), 7);
  for (int i = 0; i < c->gemm_size(); ++i) {
    EXPECT_EQ(c->gemm(i).rows(), int64_t{1} << (2 * i));
    EXPECT_GT(c->gemm(i).seconds(), 0);
  }
  // 4096 rows are 4096 times the work of one: slower, whatever the load.
  EXPECT_GT(c->gemm(6).seconds(), c->gemm(0).seconds());
  EXPECT_GT(c->h2d_bytes_per_second(), 0);
  EXPECT_GT(c->d2h_bytes_per_second(), 0);
  EXPECT_GT(c->adamw_params_per_second(), 0);
  EXPECT_EQ(c->collective_seconds(), kCpuCollectiveSeconds);
  EXPECT_GT(c->measured_unix_seconds(), 0);
  EXPECT_TRUE(CalibrationFromProto(*c).ok());
  EXPECT_EQ((*backend)->device().tracker().total_current(), 0);
  EXPECT_EQ((*backend)->host().tracker().total_current(), 0);
  std::printf("calibration: %s\n", c->ShortDebugString().c_str());
}

v1::Calibration Synthetic(double launch) {
  v1::Calibration c = CalibrationToProto(DefaultCalibration(CalibrationBackend::kCpu));
  c.set_backend("cpu (test)");
  c.set_launch_seconds(launch);
  return c;
}

TEST(CalibrationTest, CacheRoundTripAndInvalidation) {
  const std::string dir = TempDir("cache");
  int calls = 0;
  double launch = 1e-6;
  auto measure = [&]() -> absl::StatusOr<v1::Calibration> {
    ++calls;
    return Synthetic(launch);
  };
  bool measured = false;
  auto first = LoadOrMeasureCalibration(dir, BackendKind::kCpu, "cpu (test)", "bin-1", measure, &measured);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(measured);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(first->binary(), "bin-1");
  EXPECT_TRUE(std::filesystem::exists(CalibrationCachePath(dir, BackendKind::kCpu)));
  // Read back as stored: the same message, no measurement.
  launch = 2e-6;
  auto again = LoadOrMeasureCalibration(dir, BackendKind::kCpu, "cpu (test)", "bin-1", measure, &measured);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(measured);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(again->SerializeAsString(), first->SerializeAsString());
  EXPECT_EQ(again->launch_seconds(), 1e-6);
  // Another binary: measured again, and the new one is what is cached.
  auto rebuilt = LoadOrMeasureCalibration(dir, BackendKind::kCpu, "cpu (test)", "bin-2", measure, &measured);
  ASSERT_TRUE(rebuilt.ok());
  EXPECT_TRUE(measured);
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(rebuilt->launch_seconds(), 2e-6);
  EXPECT_EQ(rebuilt->binary(), "bin-2");
  // Another backend description (the measurement says "cpu (test)", so the
  // next call with "cpu (other)" measures again too).
  auto other = LoadOrMeasureCalibration(dir, BackendKind::kCpu, "cpu (other)", "bin-2", measure, &measured);
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE(measured);
  EXPECT_EQ(calls, 3);
  // Each backend kind has its own file.
  EXPECT_NE(CalibrationCachePath(dir, BackendKind::kCpu), CalibrationCachePath(dir, BackendKind::kCuda));
  // A damaged file: measured again.
  { std::ofstream(CalibrationCachePath(dir, BackendKind::kCpu)) << "gemm { rows: "; }
  auto damaged = LoadOrMeasureCalibration(dir, BackendKind::kCpu, "cpu (test)", "bin-2", measure, &measured);
  ASSERT_TRUE(damaged.ok());
  EXPECT_TRUE(measured);
  EXPECT_EQ(calls, 4);
  // A file that parses but cannot be modelled (no GEMM point): measured again.
  v1::Calibration empty = Synthetic(1e-6);
  empty.set_binary("bin-2");
  empty.clear_gemm();
  { std::ofstream(CalibrationCachePath(dir, BackendKind::kCpu)) << empty.DebugString(); }
  auto unusable = LoadOrMeasureCalibration(dir, BackendKind::kCpu, "cpu (test)", "bin-2", measure, &measured);
  ASSERT_TRUE(unusable.ok());
  EXPECT_TRUE(measured);
  EXPECT_EQ(calls, 5);
  // A measurement that cannot be modelled is an error, and is not cached.
  auto broken = [&]() -> absl::StatusOr<v1::Calibration> {
    v1::Calibration c = Synthetic(1e-6);
    c.set_h2d_bytes_per_second(0);
    return c;
  };
  auto refused = LoadOrMeasureCalibration(dir, BackendKind::kCuda, "cuda (test)", "bin-2", broken, &measured);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("calibration.h2d_bytes_per_second: expected > 0"));
  EXPECT_FALSE(std::filesystem::exists(CalibrationCachePath(dir, BackendKind::kCuda)));
}

TEST(CalibrationTest, FingerprintFollowsTheFiles) {
  const std::string dir = TempDir("fingerprint");
  const std::string a = dir + "/a", b = dir + "/b";
  { std::ofstream(a) << "one"; }
  { std::ofstream(b) << "two"; }
  const std::string before = BinaryFingerprint({a, b});
  EXPECT_EQ(before, BinaryFingerprint({a, b}));
  { std::ofstream(b) << "three!"; }  // another size
  EXPECT_NE(BinaryFingerprint({a, b}), before);
  EXPECT_THAT(BinaryFingerprint({dir + "/none"}), HasSubstr("/none:missing"));
}

// This test links the CPU backend, whose OpenBLAS (and Gloo) are shared
// libraries: they are among the files the cache's fingerprint follows.
TEST(CalibrationTest, TheComputeLibrariesLoadedAreFound) {
  const std::vector<std::string> libs = LoadedComputeLibraries();
  bool blas = false;
  for (const std::string& l : libs) {
    EXPECT_EQ(l[0], '/') << l;
    blas |= l.find("libopenblas") != std::string::npos;
  }
  EXPECT_TRUE(blas) << absl::StrJoin(libs, ", ");
  EXPECT_TRUE(std::is_sorted(libs.begin(), libs.end()));
}

TEST(CalibrationTest, ProtoRoundTripAndValidation) {
  const Calibration c = DefaultCalibration(CalibrationBackend::kCuda);
  auto back = CalibrationFromProto(CalibrationToProto(c));
  ASSERT_TRUE(back.ok());
  ASSERT_EQ(back->gemm.size(), c.gemm.size());
  for (size_t i = 0; i < c.gemm.size(); ++i) {
    EXPECT_EQ(back->gemm[i].rows, c.gemm[i].rows);
    EXPECT_EQ(back->gemm[i].seconds, c.gemm[i].seconds);
  }
  EXPECT_EQ(back->launch_seconds, c.launch_seconds);
  EXPECT_EQ(back->h2d_bytes_per_second, c.h2d_bytes_per_second);
  EXPECT_EQ(back->d2h_bytes_per_second, c.d2h_bytes_per_second);
  EXPECT_EQ(back->adamw_params_per_second, c.adamw_params_per_second);
  EXPECT_EQ(back->collective_seconds, c.collective_seconds);
  v1::Calibration bad = CalibrationToProto(c);
  bad.mutable_gemm(2)->set_seconds(-1);
  EXPECT_THAT(CalibrationFromProto(bad).status().message(),
              HasSubstr("calibration.gemm[2].seconds: expected > 0 and <= 60"));
}

}  // namespace
}  // namespace plateau
