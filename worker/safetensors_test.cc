#include "worker/safetensors.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

std::string TmpPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  if (dir != nullptr) return std::string(dir) + "/" + name;
  // Run by hand: a directory of this process's own, not a fixed /tmp path.
  const std::string own = "/tmp/plateau-test-" + std::to_string(getpid());
  std::filesystem::create_directories(own);
  return own + "/" + name;
}

TEST(SafetensorsTest, RoundTripsBitsShapesAndMetadata) {
  std::vector<float> a = {1.5f, -0.0f, 3.4e38f, 1e-45f, NAN, INFINITY};
  std::vector<float> b(7 * 3);
  std::mt19937 rng(1);
  for (auto& x : b) x = std::uniform_real_distribution<float>(-1, 1)(rng);
  const std::string path = TmpPath("ckpt.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"embed.weight", {2, 3}, a.data()},
                                      {"layers.0.attn.wq", {7, 3}, b.data()},
                                      {"empty", {0, 4}, nullptr}},
                               {{"step", "42"}, {"data_position", "1234"}})
                  .ok());
  auto f = ReadSafetensors(path);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->tensors.size(), 3u);
  const Tensor& ta = f->tensors.at("embed.weight");
  EXPECT_EQ(ta.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(ta.data.data(), a.data(), a.size() * 4), 0);  // bit for bit
  EXPECT_EQ(f->tensors.at("layers.0.attn.wq").data, b);
  EXPECT_TRUE(f->tensors.at("empty").data.empty());
  EXPECT_EQ(f->metadata.at("step"), "42");
  EXPECT_EQ(f->metadata.at("data_position"), "1234");
}

TEST(SafetensorsTest, HeaderIsStandardJsonAligned) {
  std::vector<float> a = {1, 2};
  const std::string path = TmpPath("h.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"x", {2}, a.data()}}, {}).ok());
  std::ifstream in(path, std::ios::binary);
  uint64_t len = 0;
  in.read(reinterpret_cast<char*>(&len), 8);
  EXPECT_EQ(len % 8, 0u);
  std::string header(len, ' ');
  in.read(header.data(), len);
  EXPECT_THAT(header, HasSubstr("\"x\":{\"data_offsets\":[0,8],\"dtype\":\"F32\",\"shape\":[2]}"));
}

TEST(SafetensorsTest, CorruptFilesAreDataLossNamingTheFile) {
  const std::string path = TmpPath("bad.safetensors");
  { std::ofstream(path) << "xx"; }
  auto f = ReadSafetensors(path);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(f.status().message(), HasSubstr("bad.safetensors"));

  // A valid file cut short: the offsets no longer fit.
  std::vector<float> a(100, 1.0f);
  ASSERT_TRUE(WriteSafetensors(path, {{"w", {100}, a.data()}}, {}).ok());
  std::FILE* fp = std::fopen(path.c_str(), "r+");
  std::fseek(fp, 0, SEEK_END);
  ASSERT_EQ(ftruncate(fileno(fp), std::ftell(fp) - 4), 0);
  std::fclose(fp);
  f = ReadSafetensors(path);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(f.status().message(), HasSubstr("tensor 'w'"));

  EXPECT_EQ(ReadSafetensors(TmpPath("none")).status().code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, RefusesDuplicateNames) {
  float x = 0;
  auto s = WriteSafetensors(TmpPath("d.safetensors"), {{"a", {1}, &x}, {"a", {1}, &x}}, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace plateau
