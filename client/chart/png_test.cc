// The PNG decodes: a reader written here (not the encoder's code) checks
// the signature, every chunk's CRC-32, the header, the zlib stream's
// stored blocks and its Adler-32, and that the rows give back the canvas.
#include "client/chart/png.h"

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace plateau::chart {
namespace {

// Published check values of the two checksums.
TEST(PngTest, ChecksumsMatchTheirCheckValues) {
  EXPECT_EQ(Crc32("123456789"), 0xCBF43926u);
  EXPECT_EQ(Crc32(""), 0u);
  EXPECT_EQ(Adler32("Wikipedia"), 0x11E60398u);
  EXPECT_EQ(Adler32(""), 1u);
}

uint32_t Be32(const std::string& s, size_t at) {
  return (uint32_t{static_cast<uint8_t>(s[at])} << 24) | (uint32_t{static_cast<uint8_t>(s[at + 1])} << 16) |
         (uint32_t{static_cast<uint8_t>(s[at + 2])} << 8) | uint32_t{static_cast<uint8_t>(s[at + 3])};
}

struct Decoded {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;
  int stored_blocks = 0;
};

// A reader for what EncodePng may write: 8-bit RGB, stored deflate blocks,
// filter 0. Fails the test (and returns what it has) on anything else.
Decoded Decode(const std::string& png) {
  Decoded d;
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  std::string idat;
  std::vector<std::string> types;
  size_t at = 8;
  while (at + 12 <= png.size()) {
    const uint32_t len = Be32(png, at);
    const std::string type = png.substr(at + 4, 4);
    const std::string data = png.substr(at + 8, len);
    EXPECT_EQ(Be32(png, at + 8 + len), Crc32(png.substr(at + 4, 4 + len))) << "chunk " << type;
    types.push_back(type);
    if (type == "IHDR") {
      EXPECT_EQ(len, 13u);
      d.width = static_cast<int>(Be32(data, 0));
      d.height = static_cast<int>(Be32(data, 4));
      EXPECT_EQ(data.substr(8), std::string("\x08\x02\x00\x00\x00", 5));
    }
    if (type == "IDAT") idat += data;
    at += 12 + len;
  }
  EXPECT_EQ(at, png.size()) << "trailing bytes";
  EXPECT_EQ(types, (std::vector<std::string>{"IHDR", "IDAT", "IEND"}));
  // zlib header: CM 8, and (CMF * 256 + FLG) % 31 == 0.
  EXPECT_GE(idat.size(), 2u + 5u + 4u);
  if (idat.size() < 11) return d;
  const uint8_t cmf = static_cast<uint8_t>(idat[0]), flg = static_cast<uint8_t>(idat[1]);
  EXPECT_EQ(cmf & 0x0f, 8);
  EXPECT_EQ((cmf * 256 + flg) % 31, 0);
  EXPECT_EQ(flg & 0x20, 0) << "no preset dictionary";
  std::string raw;
  size_t p = 2;
  bool final_block = false;
  while (!final_block && p + 5 <= idat.size()) {
    const uint8_t head = static_cast<uint8_t>(idat[p]);
    final_block = head & 1;
    EXPECT_EQ((head >> 1) & 3, 0) << "only stored blocks";
    const uint16_t len = static_cast<uint8_t>(idat[p + 1]) | (static_cast<uint8_t>(idat[p + 2]) << 8);
    const uint16_t nlen = static_cast<uint8_t>(idat[p + 3]) | (static_cast<uint8_t>(idat[p + 4]) << 8);
    EXPECT_EQ(static_cast<uint16_t>(~len), nlen);
    raw += idat.substr(p + 5, len);
    p += 5 + len;
    ++d.stored_blocks;
  }
  EXPECT_TRUE(final_block);
  EXPECT_EQ(p + 4, idat.size());
  EXPECT_EQ(Be32(idat, p), Adler32(raw));
  const size_t stride = 1 + 3 * static_cast<size_t>(d.width);
  EXPECT_EQ(raw.size(), stride * d.height);
  for (int y = 0; y < d.height && (y + 1) * stride <= raw.size(); ++y) {
    EXPECT_EQ(raw[y * stride], '\0') << "row " << y << " filter";
    for (size_t i = 1; i < stride; ++i) d.rgb.push_back(static_cast<uint8_t>(raw[y * stride + i]));
  }
  return d;
}

Canvas Pattern(int w, int h) {
  Canvas c(w, h, {255, 255, 255});
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) {
      c.Set(x, y, {static_cast<uint8_t>(x * 7 + y), static_cast<uint8_t>(y * 13), static_cast<uint8_t>(x ^ y)});
    }
  }
  return c;
}

TEST(PngTest, DecodesBackToThePixels) {
  const Canvas c = Pattern(17, 5);
  const Decoded d = Decode(EncodePng(c));
  EXPECT_EQ(d.width, 17);
  EXPECT_EQ(d.height, 5);
  EXPECT_EQ(d.rgb, c.pixels());
  EXPECT_EQ(d.stored_blocks, 1);
}

// Over 65,535 bytes of rows the stream needs several stored blocks.
TEST(PngTest, LargeImagesSpanSeveralStoredBlocks) {
  const Canvas c = Pattern(300, 200);  // 200 x 901 = 180,200 bytes of rows
  const Decoded d = Decode(EncodePng(c));
  EXPECT_EQ(d.rgb, c.pixels());
  EXPECT_EQ(d.stored_blocks, 3);
}

TEST(PngTest, WritesTheFileOrNamesThePath) {
  const Canvas c = Pattern(3, 2);
  const std::string path = std::string(getenv("TEST_TMPDIR") ? getenv("TEST_TMPDIR") : "/tmp") + "/p.png";
  ASSERT_TRUE(WritePng(c, path).ok());
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  EXPECT_EQ(s.str(), EncodePng(c));
  const absl::Status bad = WritePng(c, "/nonexistent-dir/p.png");
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("/nonexistent-dir/p.png"), absl::string_view::npos);
}

}  // namespace
}  // namespace plateau::chart
