// The font renders every glyph it claims: each is non-blank (but the
// space), fits its 5 x 7 box, differs from every other and from the
// fallback box, and Canvas::Text puts exactly its ink on the canvas.
#include "client/chart/font.h"

#include <map>
#include <set>

#include "client/chart/canvas.h"
#include "gtest/gtest.h"

namespace plateau::chart {
namespace {

TEST(FontTest, ClaimsDigitsLettersAndPunctuation) {
  const std::string& chars = FontCharacters();
  for (char c = '0'; c <= '9'; ++c) EXPECT_TRUE(HasGlyph(c)) << c;
  for (char c = 'A'; c <= 'Z'; ++c) EXPECT_TRUE(HasGlyph(c)) << c;
  for (char c = 'a'; c <= 'z'; ++c) EXPECT_TRUE(HasGlyph(c)) << c;
  for (char c : std::string(" .,:;-+_=/()[]<>%!?'\"#*")) EXPECT_TRUE(HasGlyph(c)) << c;
  EXPECT_FALSE(HasGlyph('\x01'));
  EXPECT_EQ(std::set<char>(chars.begin(), chars.end()).size(), chars.size()) << "a character twice";
}

TEST(FontTest, EveryGlyphIsDistinctAndInsideItsBox) {
  std::map<Glyph, char> seen;
  const Glyph& box = GlyphOf('\x01');
  for (char c : FontCharacters()) {
    const Glyph& g = GlyphOf(c);
    int ink = 0;
    for (uint8_t row : g) {
      EXPECT_EQ(row >> kGlyphWidth, 0) << c;
      ink += __builtin_popcount(row);
    }
    if (c == ' ') {
      EXPECT_EQ(ink, 0);
    } else {
      EXPECT_GT(ink, 0) << "'" << c << "' is blank";
    }
    EXPECT_NE(g, box) << c;
    auto [it, inserted] = seen.emplace(g, c);
    EXPECT_TRUE(inserted) << "'" << c << "' looks like '" << it->second << "'";
  }
}

TEST(FontTest, TextDrawsEachGlyphsInkAtItsCellAndScale) {
  const Rgb white{255, 255, 255}, ink{10, 20, 30};
  for (int scale : {1, 3}) {
    for (char c : FontCharacters()) {
      Canvas canvas(2 + Canvas::TextWidth("xx", scale), 2 + Canvas::TextHeight(scale), white);
      // The second cell, so the first cell's offset is exercised too.
      canvas.Text(1, 1, std::string(" ") + c, ink, scale);
      const Glyph& g = GlyphOf(c);
      for (int y = 0; y < canvas.height(); ++y) {
        for (int x = 0; x < canvas.width(); ++x) {
          const int gx = (x - 1 - kCellWidth * scale), gy = y - 1;
          bool want = false;
          if (gx >= 0 && gy >= 0 && gx / scale < kGlyphWidth && gy / scale < kGlyphHeight) {
            want = g[gy / scale] >> (kGlyphWidth - 1 - gx / scale) & 1;
          }
          ASSERT_EQ(canvas.At(x, y) == ink, want) << "'" << c << "' scale " << scale << " at " << x << "," << y;
        }
      }
    }
  }
  EXPECT_EQ(Canvas::TextWidth("abc", 2), 36);
  EXPECT_EQ(Canvas::TextHeight(2), 16);
}

}  // namespace
}  // namespace plateau::chart
