// A small bitmap font for the charts: 5 x 7 glyphs in a 6 x 8 cell (one
// column and one row of spacing), drawn by Canvas::Text at an integer
// scale. Covers digits, upper- and lower-case letters, the space and common
// punctuation (FontCharacters() lists them); any other character renders as
// a hollow box.
//
// Thread safety: the glyph table is built once (thread-safe static) and
// read-only after.
#ifndef PLATEAU_CLIENT_CHART_FONT_H_
#define PLATEAU_CLIENT_CHART_FONT_H_

#include <array>
#include <cstdint>
#include <string>

namespace plateau::chart {

inline constexpr int kGlyphWidth = 5, kGlyphHeight = 7;
inline constexpr int kCellWidth = 6, kCellHeight = 8;

// Row r (0 = top) of a glyph: bit (kGlyphWidth - 1 - c) set when column c
// (0 = left) is ink.
using Glyph = std::array<uint8_t, kGlyphHeight>;

// Every character the font draws (besides the fallback box).
const std::string& FontCharacters();
bool HasGlyph(char c);
// The glyph of c, or the hollow box when the font lacks it.
const Glyph& GlyphOf(char c);

}  // namespace plateau::chart

#endif  // PLATEAU_CLIENT_CHART_FONT_H_
