// The drawing primitives hit the pixels they should and no others.
#include "client/chart/canvas.h"

#include <set>
#include <utility>

#include "gtest/gtest.h"

namespace plateau::chart {
namespace {

const Rgb kWhite{255, 255, 255}, kInk{200, 0, 0};

std::set<std::pair<int, int>> Inked(const Canvas& c) {
  std::set<std::pair<int, int>> out;
  for (int y = 0; y < c.height(); ++y) {
    for (int x = 0; x < c.width(); ++x) {
      if (c.At(x, y) == kInk) out.insert({x, y});
    }
  }
  return out;
}

TEST(CanvasTest, BackgroundSetAndClipping) {
  Canvas c(4, 3, {1, 2, 3});
  EXPECT_EQ(c.pixels().size(), 36u);
  EXPECT_EQ(c.At(3, 2), (Rgb{1, 2, 3}));
  c.Set(3, 2, kInk);
  c.Set(-1, 0, kInk);
  c.Set(4, 0, kInk);
  EXPECT_EQ(Inked(c), (std::set<std::pair<int, int>>{{3, 2}}));
  EXPECT_EQ(c.pixels()[(2 * 4 + 3) * 3], 200);
  EXPECT_EQ(c.At(-1, 0), Rgb{});
}

TEST(CanvasTest, FillRectIsHalfOpenAndClipped) {
  Canvas c(5, 5, kWhite);
  c.FillRect(1, 2, 3, 4, kInk);
  EXPECT_EQ(Inked(c), (std::set<std::pair<int, int>>{{1, 2}, {2, 2}, {1, 3}, {2, 3}}));
  Canvas d(3, 3, kWhite);
  d.FillRect(-5, -5, 10, 1, kInk);
  EXPECT_EQ(Inked(d).size(), 3u);
}

TEST(CanvasTest, ThinLinesAreGapFreeAndOnePixelWide) {
  Canvas h(10, 5, kWhite);
  h.Line({1, 2}, {8, 2}, kInk);
  std::set<std::pair<int, int>> want;
  for (int x = 1; x <= 8; ++x) want.insert({x, 2});
  EXPECT_EQ(Inked(h), want);
  Canvas d(6, 6, kWhite);
  d.Line({0, 0}, {5, 5}, kInk);
  want.clear();
  for (int i = 0; i <= 5; ++i) want.insert({i, i});
  EXPECT_EQ(Inked(d), want);
  // A shallow slope: exactly one pixel in every column, the nearest one.
  Canvas s(21, 12, kWhite);
  s.Line({0, 1}, {20, 9}, kInk);
  const auto inked = Inked(s);
  for (int x = 0; x <= 20; ++x) {
    int n = 0;
    for (int y = 0; y < 12; ++y) n += inked.count({x, y});
    EXPECT_EQ(n, 1) << "column " << x;
    const double y = 1 + 0.4 * x;
    EXPECT_TRUE(inked.count({x, static_cast<int>(y + 0.5)}) || inked.count({x, static_cast<int>(y)})) << x;
  }
}

TEST(CanvasTest, WideLinesCoverTheirWidth) {
  Canvas c(12, 12, kWhite);
  // Centres within 1.5 of the segment: rows 4 to 6, and the round caps
  // reach one column beyond each end (distance 1 and sqrt(2)), not two.
  c.Line({2, 5}, {9, 5}, kInk, 3);
  std::set<std::pair<int, int>> want;
  for (int x = 1; x <= 10; ++x) {
    for (int y = 4; y <= 6; ++y) want.insert({x, y});
  }
  EXPECT_EQ(Inked(c), want);
}

TEST(CanvasTest, DashedLinesAlternateDashAndGap) {
  Canvas c(20, 3, kWhite);
  c.DashedLine({0, 1}, {19, 1}, kInk, 1, 3, 2);  // on 0-2, off 3-4, on 5-7, ...
  std::set<std::pair<int, int>> want;
  for (int x = 0; x <= 19; ++x) {
    if (x % 5 < 3) want.insert({x, 1});
  }
  EXPECT_EQ(Inked(c), want);
}

TEST(CanvasTest, PolygonsFillTheirInsideAndAdjacentOnesDoNotOverlap) {
  Canvas c(10, 10, kWhite);
  c.FillPolygon({{1, 1}, {5, 1}, {5, 4}, {1, 4}}, kInk);  // centres 1 <= x < 5, 1 <= y < 4
  std::set<std::pair<int, int>> want;
  for (int x = 1; x < 5; ++x) {
    for (int y = 1; y < 4; ++y) want.insert({x, y});
  }
  EXPECT_EQ(Inked(c), want);
  // Two stacked areas sharing the edge y = 4 + x/3 cover the union once.
  const Rgb other{0, 0, 200};
  Canvas s(10, 10, kWhite);
  s.FillPolygon({{0, 8}, {9, 8}, {9, 7}, {0, 4}}, kInk);
  s.FillPolygon({{0, 4}, {9, 7}, {9, 1}, {0, 1}}, other);
  for (int x = 0; x < 9; ++x) {
    for (int y = 1; y < 8; ++y) {
      // A centre exactly on the shared edge is the left edge of the upper
      // area's row span, so it belongs to that one.
      const Rgb want_colour = y > 4 + x / 3.0 ? kInk : other;
      EXPECT_EQ(s.At(x, y), want_colour) << x << "," << y;
    }
  }
  // A triangle: the pixels whose centres are inside it.
  Canvas t(8, 8, kWhite);
  t.FillPolygon({{0, 0}, {7, 7}, {0, 7}}, kInk);
  for (int y = 0; y < 8; ++y) {
    for (int x = 0; x < 8; ++x) EXPECT_EQ(t.At(x, y) == kInk, y < 7 && x < y) << x << "," << y;
  }
}

}  // namespace
}  // namespace plateau::chart
