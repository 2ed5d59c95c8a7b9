#include "worker/safetensors.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
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

// A link planted under the writer's temporary name (a user who can write
// the checkpoint directory), symbolic or hard, is not written through: the
// file it points at keeps its bytes, and the checkpoint is written.
TEST(SafetensorsTest, TheTemporaryIsNeverWrittenThroughALink) {
  for (const bool hard : {false, true}) {
    SCOPED_TRACE(hard ? "hard link" : "symbolic link");
    const std::string victim = TmpPath("victim.txt");
    { std::ofstream(victim) << "precious"; }
    const std::string path = TmpPath("linked.safetensors");
    const std::string tmp = path + ".tmp." + std::to_string(getpid());
    std::filesystem::remove(tmp);
    std::filesystem::remove(path);
    if (hard) {
      std::filesystem::create_hard_link(victim, tmp);
    } else {
      std::filesystem::create_symlink(victim, tmp);
    }
    std::vector<float> a = {1, 2};
    const absl::Status s = WriteSafetensors(path, {{"w", {2}, a.data()}}, {});
    EXPECT_TRUE(s.ok()) << s;
    std::ifstream in(victim);
    std::string kept((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(kept, "precious");
    auto read = ReadSafetensors(path);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->tensors.at("w").data, a);
  }
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

// A file of only a header (its JSON padded to 8 bytes), no data bytes.
void WriteHeaderOnly(const std::string& path, std::string header) {
  header.resize((header.size() + 7) / 8 * 8, ' ');
  const uint64_t len = header.size();
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&len), 8);
  out << header;
}

// A header whose shape's element count would wrap around 2^64 (or whose
// dimension does not fit int64) is refused, not read as a tensor of a few
// values or with a negative dimension.
TEST(SafetensorsTest, ShapesPastInt64AreDataLoss) {
  const auto write = [](const std::string& path, const std::string& shape) {
    WriteHeaderOnly(path, "{\"w\":{\"dtype\":\"F32\",\"shape\":" + shape + ",\"data_offsets\":[0,0]}}");
  };
  const std::string wraps = TmpPath("wraps.safetensors");
  write(wraps, "[4,4611686018427387904]");  // 4 x 2^62 = 2^64: 0 mod 2^64
  auto f = ReadSafetensors(wraps);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss) << f.status();
  EXPECT_THAT(f.status().message(), HasSubstr("tensor 'w' is larger than the file"));
  const std::string negative = TmpPath("negative.safetensors");
  write(negative, "[0,12297829382473034411]");  // over INT64_MAX
  f = ReadSafetensors(negative);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss) << f.status();
  EXPECT_THAT(f.status().message(), HasSubstr("tensor 'w' has a bad dimension"));
}

// A hostile header: a dtype nested a million arrays deep is DATA_LOSS
// naming its JSON type (its dump() recursed once per level: the rank died of
// a stack overflow), and a megabyte name is cut to 200 bytes in the message
// (the agent cuts a rank's error line at 256 KiB, which lost the message).
// A directory or a FIFO where the checkpoint should be is named as such.
TEST(SafetensorsTest, HostileHeadersAndPathsGiveShortClearErrors) {
  const std::string nested = TmpPath("nested.safetensors");
  WriteHeaderOnly(nested, "{\"w\":{\"dtype\":" + std::string(1000000, '[') + std::string(1000000, ']') +
                              ",\"shape\":[],\"data_offsets\":[0,0]}}");
  auto f = ReadSafetensors(nested);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss) << f.status().message().substr(0, 300);
  EXPECT_THAT(f.status().message(), HasSubstr("tensor 'w' has dtype a JSON array, expected \"F32\""));

  const std::string named = TmpPath("named.safetensors");
  WriteHeaderOnly(named,
                  "{\"" + std::string(1 << 20, 'n') + "\":{\"dtype\":\"F16\",\"shape\":[],\"data_offsets\":[0,0]}}");
  f = ReadSafetensors(named);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(f.status().message(), HasSubstr("... (1048576 bytes)' has dtype \"F16\""));
  EXPECT_LT(f.status().message().size(), 1000u);

  const std::string dir = TmpPath("dir.safetensors");
  std::filesystem::create_directories(dir);
  f = ReadSafetensors(dir);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition) << f.status();
  EXPECT_THAT(f.status().message(), HasSubstr("expected a regular file, found a directory"));
  const std::string fifo = TmpPath("fifo.safetensors");
  std::filesystem::remove(fifo);
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  f = ReadSafetensors(fifo);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition) << f.status();
  EXPECT_THAT(f.status().message(), HasSubstr("found a FIFO"));
}

TEST(SafetensorsTest, RefusesDuplicateNames) {
  float x = 0;
  auto s = WriteSafetensors(TmpPath("d.safetensors"), {{"a", {1}, &x}, {"a", {1}, &x}}, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

std::string Bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Pieces written backwards, out of tensor order, give the very bytes that
// WriteSafetensors writes for the same tensors; pieces read back are the
// values at those offsets.
TEST(SafetensorsWriterTest, PiecesInAnyOrderMakeTheSameFile) {
  std::vector<float> a(10), b(3 * 4);
  for (size_t i = 0; i < a.size(); ++i) a[i] = 0.5f * static_cast<float>(i) - 1.0f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = -0.25f * static_cast<float>(i);
  const std::map<std::string, std::string> meta = {{"step", "7"}};
  const std::string whole = TmpPath("whole.safetensors"), pieces = TmpPath("pieces.safetensors");
  ASSERT_TRUE(WriteSafetensors(whole, {{"a", {10}, a.data()}, {"b", {3, 4}, b.data()}}, meta).ok());
  auto w = SafetensorsWriter::Create(pieces, {{"a", {10}}, {"b", {3, 4}}}, meta);
  ASSERT_TRUE(w.ok()) << w.status();
  for (int64_t lo = 9; lo >= 0; lo -= 3) {
    const int64_t from = std::max<int64_t>(0, lo - 2);
    ASSERT_TRUE((*w)->Write(1, from, b.data() + from, lo - from + 1).ok());
    ASSERT_TRUE((*w)->Write(0, from, a.data() + from, lo - from + 1).ok());
  }
  ASSERT_TRUE((*w)->Write(1, 10, b.data() + 10, 2).ok());
  EXPECT_FALSE(std::filesystem::exists(pieces)) << "visible before Commit";
  ASSERT_TRUE((*w)->Commit().ok());
  EXPECT_EQ(Bytes(pieces), Bytes(whole));

  auto r = SafetensorsReader::Open(pieces);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->metadata().at("step"), "7");
  EXPECT_EQ((*r)->tensors().at("b").shape, (std::vector<int64_t>{3, 4}));
  float got[4];
  ASSERT_TRUE((*r)->Read("b", 5, got, 4).ok());
  EXPECT_EQ(std::vector<float>(got, got + 4), std::vector<float>(b.begin() + 5, b.begin() + 9));
  EXPECT_EQ((*r)->Read("b", 9, got, 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*r)->Read("c", 0, got, 1).code(), absl::StatusCode::kNotFound);
}

// A value written twice is refused where it is written (a part map that
// sent two ranks' runs to one place), even when the total would come out
// right; a value never written would read back as zero: Commit refuses,
// names the tensor, and leaves no file under the name, nor a temporary
// beside it.
TEST(SafetensorsWriterTest, CommitRefusesAFileWithValuesUnwritten) {
  const std::string path = TmpPath("short.safetensors");
  std::vector<float> a(4, 1.0f);
  {
    auto w = SafetensorsWriter::Create(path, {{"a", {4}}, {"b", {2}}}, {});
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Write(0, 0, a.data(), 4).ok());
    ASSERT_TRUE((*w)->Write(1, 0, a.data(), 1).ok());
    EXPECT_EQ((*w)->Write(1, 1, a.data(), 2).code(), absl::StatusCode::kInvalidArgument);  // past its end
    const absl::Status twice = (*w)->Write(0, 3, a.data(), 1);
    EXPECT_EQ(twice.code(), absl::StatusCode::kInternal);
    EXPECT_THAT(twice.message(), HasSubstr("values [3, 4) of tensor 'a' were written before"));
    EXPECT_EQ((*w)->Write(1, 0, a.data(), 2).code(), absl::StatusCode::kInternal);  // overlaps [0, 1)
    const absl::Status s = (*w)->Commit();
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
    EXPECT_THAT(s.message(), HasSubstr("tensor 'b' got 1 values written, expected 2"));
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(path).parent_path())) {
    EXPECT_EQ(e.path().string().find("short.safetensors.tmp"), std::string::npos) << e.path();
  }
}

// The written ranges merge as they touch, on either side, whatever the
// order, and a write into any of them is refused: [0, 2) and [4, 6), then
// [2, 4) between them make one range [0, 6), into which [1, 5) and [3, 4)
// are refused; [6, 8) completes the tensor.
TEST(SafetensorsWriterTest, WrittenRangesMergeAndRefuseOverlaps) {
  std::vector<float> a(8, 2.0f);
  const std::string path = TmpPath("ranges.safetensors");
  auto w = SafetensorsWriter::Create(path, {{"a", {8}}}, {});
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Write(0, 0, a.data(), 2).ok());
  ASSERT_TRUE((*w)->Write(0, 4, a.data(), 2).ok());
  ASSERT_TRUE((*w)->Write(0, 2, a.data(), 2).ok());
  EXPECT_EQ((*w)->Write(0, 1, a.data(), 4).code(), absl::StatusCode::kInternal);
  EXPECT_EQ((*w)->Write(0, 3, a.data(), 1).code(), absl::StatusCode::kInternal);
  EXPECT_EQ((*w)->Write(0, 5, a.data(), 2).code(), absl::StatusCode::kInternal);  // straddles the end
  EXPECT_TRUE((*w)->Write(0, 6, a.data(), 0).ok());                              // nothing
  ASSERT_TRUE((*w)->Write(0, 6, a.data(), 2).ok());
  ASSERT_TRUE((*w)->Commit().ok());
  auto f = ReadSafetensors(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->tensors.at("a").data, a);
}

}  // namespace
}  // namespace plateau
