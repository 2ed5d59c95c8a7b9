// A small RGB raster for charts written as PNG files (png.h): filled
// rectangles, lines of any width (solid or dashed), filled polygons (the
// stacked areas of a memory timeline) and text in the bitmap font of font.h.
// No anti-aliasing: a pixel is ink or not, so tests can name the pixels a
// primitive must hit.
//
// Coordinates: pixel (x, y) is column x from the left, row y from the top,
// and its centre is the point (x, y); primitives take doubles so that
// scaled chart coordinates need no rounding by the caller. Everything is
// clipped to the canvas.
//
// Thread safety: a Canvas is a value; concurrent use of one needs a lock.
#ifndef PLATEAU_CLIENT_CHART_CANVAS_H_
#define PLATEAU_CLIENT_CHART_CANVAS_H_

#include <cstdint>
#include <string_view>
#include <vector>

namespace plateau::chart {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  bool operator==(const Rgb& o) const { return r == o.r && g == o.g && b == o.b; }
  bool operator!=(const Rgb& o) const { return !(*this == o); }
};

struct Point {
  double x = 0, y = 0;
};

class Canvas {
 public:
  // width, height >= 1 (smaller values are raised to 1).
  Canvas(int width, int height, Rgb background);

  int width() const { return width_; }
  int height() const { return height_; }
  // Row-major RGB bytes, 3 per pixel, no padding.
  const std::vector<uint8_t>& pixels() const { return pixels_; }
  Rgb At(int x, int y) const;  // black outside the canvas

  void Set(int x, int y, Rgb c);  // ignored outside the canvas
  // The pixels x0 <= x < x1, y0 <= y < y1.
  void FillRect(int x0, int y0, int x1, int y1, Rgb c);
  // Every pixel whose centre lies within width / 2 of the segment (a width
  // of 1 draws a gap-free one-pixel line). width >= 1.
  void Line(Point a, Point b, Rgb c, double width = 1);
  // The same, inked only where the distance along the segment from `a`
  // modulo (dash + gap) is below dash: dash, gap > 0 pixels.
  void DashedLine(Point a, Point b, Rgb c, double width, double dash, double gap);
  // Line through consecutive points.
  void Polyline(const std::vector<Point>& points, Rgb c, double width = 1);
  // Every pixel whose centre is inside the polygon (even-odd rule; a centre
  // exactly on a left or top edge is inside, on a right or bottom edge
  // outside, so polygons sharing an edge never overlap).
  void FillPolygon(const std::vector<Point>& points, Rgb c);
  // Text with its top-left corner at (x, y), each font pixel a scale x
  // scale square (scale >= 1), one 6 x 8 cell per character; '\n' is not
  // special.
  void Text(int x, int y, std::string_view text, Rgb c, int scale = 1);
  static int TextWidth(std::string_view text, int scale = 1);
  static int TextHeight(int scale = 1);

 private:
  void Segment(Point a, Point b, Rgb c, double width, double dash, double gap);

  int width_, height_;
  std::vector<uint8_t> pixels_;
};

}  // namespace plateau::chart

#endif  // PLATEAU_CLIENT_CHART_CANVAS_H_
