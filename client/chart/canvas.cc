#include "client/chart/canvas.h"

#include <algorithm>
#include <cmath>

#include "client/chart/font.h"

namespace plateau::chart {

Canvas::Canvas(int width, int height, Rgb background)
    : width_(std::max(1, width)), height_(std::max(1, height)) {
  pixels_.resize(static_cast<size_t>(width_) * height_ * 3);
  for (size_t i = 0; i < pixels_.size(); i += 3) {
    pixels_[i] = background.r;
    pixels_[i + 1] = background.g;
    pixels_[i + 2] = background.b;
  }
}

Rgb Canvas::At(int x, int y) const {
  if (x < 0 || y < 0 || x >= width_ || y >= height_) return {};
  const size_t i = (static_cast<size_t>(y) * width_ + x) * 3;
  return {pixels_[i], pixels_[i + 1], pixels_[i + 2]};
}

void Canvas::Set(int x, int y, Rgb c) {
  if (x < 0 || y < 0 || x >= width_ || y >= height_) return;
  const size_t i = (static_cast<size_t>(y) * width_ + x) * 3;
  pixels_[i] = c.r;
  pixels_[i + 1] = c.g;
  pixels_[i + 2] = c.b;
}

void Canvas::FillRect(int x0, int y0, int x1, int y1, Rgb c) {
  x0 = std::max(x0, 0);
  y0 = std::max(y0, 0);
  x1 = std::min(x1, width_);
  y1 = std::min(y1, height_);
  for (int y = y0; y < y1; ++y) {
    for (int x = x0; x < x1; ++x) Set(x, y, c);
  }
}

void Canvas::Line(Point a, Point b, Rgb c, double width) { Segment(a, b, c, width, 0, 0); }

void Canvas::DashedLine(Point a, Point b, Rgb c, double width, double dash, double gap) {
  if (!(dash > 0) || !(gap > 0)) return;
  Segment(a, b, c, width, dash, gap);
}

void Canvas::Polyline(const std::vector<Point>& points, Rgb c, double width) {
  for (size_t i = 1; i < points.size(); ++i) Line(points[i - 1], points[i], c, width);
}

// Distance from each pixel centre near the segment to the segment; the
// bounding box grows by the half width. dash = 0: solid.
void Canvas::Segment(Point a, Point b, Rgb c, double width, double dash, double gap) {
  const double half = std::max(width, 1.0) / 2;
  const double dx = b.x - a.x, dy = b.y - a.y, len2 = dx * dx + dy * dy, len = std::sqrt(len2);
  const int x0 = std::max(0, static_cast<int>(std::floor(std::min(a.x, b.x) - half)));
  const int x1 = std::min(width_ - 1, static_cast<int>(std::ceil(std::max(a.x, b.x) + half)));
  const int y0 = std::max(0, static_cast<int>(std::floor(std::min(a.y, b.y) - half)));
  const int y1 = std::min(height_ - 1, static_cast<int>(std::ceil(std::max(a.y, b.y) + half)));
  for (int y = y0; y <= y1; ++y) {
    for (int x = x0; x <= x1; ++x) {
      // The closest point of the segment: a + t (b - a), t in [0, 1].
      const double t = len2 > 0 ? std::clamp(((x - a.x) * dx + (y - a.y) * dy) / len2, 0.0, 1.0) : 0.0;
      const double ex = a.x + t * dx - x, ey = a.y + t * dy - y;
      if (ex * ex + ey * ey > half * half + 1e-9) continue;
      if (dash > 0 && std::fmod(t * len, dash + gap) >= dash) continue;
      Set(x, y, c);
    }
  }
}

void Canvas::FillPolygon(const std::vector<Point>& points, Rgb c) {
  if (points.size() < 3) return;
  double ymin = points[0].y, ymax = points[0].y;
  for (const Point& p : points) {
    ymin = std::min(ymin, p.y);
    ymax = std::max(ymax, p.y);
  }
  const int y0 = std::max(0, static_cast<int>(std::ceil(ymin)));
  const int y1 = std::min(height_ - 1, static_cast<int>(std::floor(ymax)));
  std::vector<double> xs;
  for (int y = y0; y <= y1; ++y) {
    xs.clear();
    for (size_t i = 0; i < points.size(); ++i) {
      const Point& p = points[i];
      const Point& q = points[(i + 1) % points.size()];
      // Half-open in y: an edge counts for rows p.y <= y < q.y (either
      // direction), so a vertex shared by two edges is counted once and a
      // horizontal edge never.
      if ((p.y <= y) == (q.y <= y)) continue;
      xs.push_back(p.x + (y - p.y) * (q.x - p.x) / (q.y - p.y));
    }
    std::sort(xs.begin(), xs.end());
    for (size_t i = 0; i + 1 < xs.size(); i += 2) {
      // Centres x with xs[i] <= x < xs[i + 1].
      const int xa = std::max(0, static_cast<int>(std::ceil(xs[i])));
      const int xb = std::min(width_ - 1, static_cast<int>(std::ceil(xs[i + 1])) - 1);
      for (int x = xa; x <= xb; ++x) Set(x, y, c);
    }
  }
}

void Canvas::Text(int x, int y, std::string_view text, Rgb c, int scale) {
  scale = std::max(1, scale);
  for (size_t i = 0; i < text.size(); ++i) {
    const Glyph& g = GlyphOf(text[i]);
    const int gx = x + static_cast<int>(i) * kCellWidth * scale;
    for (int r = 0; r < kGlyphHeight; ++r) {
      for (int col = 0; col < kGlyphWidth; ++col) {
        if (!(g[r] >> (kGlyphWidth - 1 - col) & 1)) continue;
        FillRect(gx + col * scale, y + r * scale, gx + (col + 1) * scale, y + (r + 1) * scale, c);
      }
    }
  }
}

int Canvas::TextWidth(std::string_view text, int scale) {
  return static_cast<int>(text.size()) * kCellWidth * std::max(1, scale);
}

int Canvas::TextHeight(int scale) { return kCellHeight * std::max(1, scale); }

}  // namespace plateau::chart
