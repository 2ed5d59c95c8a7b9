// The PNG decodes: a reader written here (not the encoder's code) checks
// the signature, every chunk's CRC-32, the header, the zlib stream (through
// the independent inflater of inflate_for_test.h, Adler-32 included),
// undoes each row's filter (all five PNG types) and compares the pixels
// with the canvas.
#include "client/chart/png.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "client/chart/inflate_for_test.h"
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
  std::vector<int> filters;      // filter type of each row
  std::vector<int> block_types;  // deflate BTYPE of each block
  size_t idat_bytes = 0;
};

// PNG 9.4's Paeth predictor.
int Paeth(int a, int b, int c) {
  const int p = a + b - c, pa = std::abs(p - a), pb = std::abs(p - b), pc = std::abs(p - c);
  if (pa <= pb && pa <= pc) return a;
  return pb <= pc ? b : c;
}

// A reader for 8-bit RGB PNGs without interlace, any deflate blocks and any
// filter types. Fails the test (and returns what it has) on anything else.
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
  d.idat_bytes = idat.size();
  const testing::Inflated z = testing::Inflate(idat);
  EXPECT_EQ(z.error, "");
  EXPECT_EQ(z.consumed, idat.size()) << "bytes after the zlib stream";
  d.block_types = z.block_types;
  const std::string& raw = z.data;
  const size_t stride = 3 * static_cast<size_t>(d.width);
  EXPECT_EQ(raw.size(), (1 + stride) * d.height);
  std::vector<uint8_t> prev(stride, 0), cur(stride);
  for (int y = 0; y < d.height && (y + 1) * (1 + stride) <= raw.size(); ++y) {
    const size_t row = y * (1 + stride);
    const int filter = static_cast<uint8_t>(raw[row]);
    d.filters.push_back(filter);
    EXPECT_LE(filter, 4) << "row " << y;
    for (size_t i = 0; i < stride; ++i) {
      const int x = static_cast<uint8_t>(raw[row + 1 + i]);
      const int a = i >= 3 ? cur[i - 3] : 0, b = prev[i], c = i >= 3 ? prev[i - 3] : 0;
      const int predicted = filter == 1 ? a : filter == 2 ? b : filter == 3 ? (a + b) / 2 : filter == 4 ? Paeth(a, b, c) : 0;
      cur[i] = static_cast<uint8_t>(x + predicted);
    }
    d.rgb.insert(d.rgb.end(), cur.begin(), cur.end());
    prev = cur;
  }
  return d;
}

// Decodes and compares with the canvas; returns the decoding.
Decoded RoundTrip(const Canvas& c) {
  const std::string png = EncodePng(c);
  Decoded d = Decode(png);
  EXPECT_EQ(d.width, c.width());
  EXPECT_EQ(d.height, c.height());
  EXPECT_TRUE(d.rgb == c.pixels()) << c.width() << " x " << c.height() << ": the pixels differ";
  EXPECT_EQ(EncodePng(c), png) << "not deterministic";
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
  const Decoded d = RoundTrip(Pattern(17, 5));
  EXPECT_EQ(d.width, 17);
  EXPECT_EQ(d.height, 5);
}

// Noise does not compress: stored blocks, at most 5 bytes a 16 KiB block
// over the filtered rows, plus the zlib header and trailer.
TEST(PngTest, RandomPixelsStayAtTheirSize) {
  Canvas c(200, 150, {0, 0, 0});
  std::mt19937 rng(11);
  for (int y = 0; y < 150; ++y) {
    for (int x = 0; x < 200; ++x) c.Set(x, y, {uint8_t(rng()), uint8_t(rng()), uint8_t(rng())});
  }
  const Decoded d = RoundTrip(c);
  const size_t raw = 150 * (1 + 3 * 200);
  EXPECT_LE(d.idat_bytes, 2 + raw + 5 * ((raw + 16383) / 16384) + 4);
  for (int t : d.block_types) EXPECT_EQ(t, 0);
}

// A solid image: the first row Sub (one pixel, then zeros), every other
// row Up (all zeros); black rows are zeros already, so None (the lowest of
// the tied types). A 960 x 600 canvas of 1.7 MB goes below 1%.
TEST(PngTest, SolidImagesShrinkToAlmostNothing) {
  for (const Rgb colour : {Rgb{255, 255, 255}, Rgb{0, 0, 0}, Rgb{31, 90, 180}}) {
    const Canvas c(960, 600, colour);
    const Decoded d = RoundTrip(c);
    EXPECT_LT(d.idat_bytes, 600 * (1 + 3 * 960) / 100);
    const bool black = colour == Rgb{0, 0, 0};
    EXPECT_EQ(d.filters[0], black ? 0 : 1);
    for (int y = 1; y < 600; ++y) ASSERT_EQ(d.filters[y], black ? 0 : 2) << "row " << y;
    for (int t : d.block_types) EXPECT_EQ(t, 1);
  }
}

// What charts are made of: areas, lines, dashes and text.
TEST(PngTest, CanvasDrawingsRoundTrip) {
  Canvas c(321, 203, {255, 255, 255});
  c.FillRect(20, 20, 300, 180, {245, 245, 245});
  c.FillPolygon({{20, 180}, {80, 90}, {160, 120}, {300, 40}, {300, 180}}, {31, 90, 180});
  c.Polyline({{20, 150}, {90, 60}, {200, 100}, {300, 30}}, {200, 50, 40}, 2.5);
  c.DashedLine({20, 100}, {300, 100}, {235, 140, 30}, 1.5, 6, 4);
  c.Line({0, 0}, {320, 202}, {0, 0, 0});
  c.Text(30, 5, "tokens / s vs. experts, 0123456789", {0, 0, 0}, 1);
  c.Text(40, 185, "Plateau", {0, 0, 0}, 2);
  const Decoded d = RoundTrip(c);
  EXPECT_LT(d.idat_bytes, 203 * (1 + 3 * 321) / 20);
}

// Rows built so that each filter wins: a copy of the row above (Up), a
// black row (None; Sub ties and loses to the lower type), a slow gradient
// (Sub), then noise again.
TEST(PngTest, EachRowGetsTheFilterThatFitsIt) {
  const int w = 16;
  Canvas c(w, 6, {0, 0, 0});
  std::mt19937 rng(5);
  for (int x = 0; x < w; ++x) {
    const Rgb noise{uint8_t(rng()), uint8_t(rng()), uint8_t(rng())};
    c.Set(x, 0, noise);
    c.Set(x, 1, noise);
    // row 2 stays black
    c.Set(x, 3, {uint8_t(100 + 3 * x), uint8_t(150 + 3 * x), uint8_t(200 + 3 * x)});
    c.Set(x, 4, {uint8_t(100 + 3 * x), uint8_t(150 + 3 * x), uint8_t(200 + 3 * x)});
    c.Set(x, 5, {uint8_t(rng()), uint8_t(rng()), uint8_t(rng())});
  }
  const Decoded d = RoundTrip(c);
  ASSERT_EQ(d.filters.size(), 6u);
  EXPECT_EQ(d.filters[1], 2);
  EXPECT_EQ(d.filters[2], 0);
  EXPECT_EQ(d.filters[3], 1);
  EXPECT_EQ(d.filters[4], 2);
}

// Widths that are not a multiple of anything, down to a single pixel.
TEST(PngTest, OddSizesAndOnePixel) {
  for (int w : {1, 2, 3, 5, 7, 31, 33, 101}) {
    for (int h : {1, 2, 3, 7}) RoundTrip(Pattern(w, h));
  }
  const Canvas one(1, 1, {12, 34, 56});
  const Decoded d = RoundTrip(one);
  EXPECT_EQ(d.rgb, (std::vector<uint8_t>{12, 34, 56}));
  EXPECT_EQ(d.filters, std::vector<int>{0});
}

// Over 64 KiB of rows: several deflate blocks, matches across them.
TEST(PngTest, LargeImagesSpanSeveralBlocks) {
  const Canvas c = Pattern(300, 200);  // 200 x 901 = 180,200 bytes of rows
  const Decoded d = RoundTrip(c);
  EXPECT_GT(d.block_types.size(), 4u);
  EXPECT_LT(d.idat_bytes, 180200u / 2);
}

TEST(PngTest, SameCanvasSameBytes) {
  Canvas a = Pattern(64, 48), b = Pattern(64, 48);
  EXPECT_EQ(EncodePng(a), EncodePng(b));
  b.Set(63, 47, {1, 2, 3});
  EXPECT_NE(EncodePng(a), EncodePng(b));
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
