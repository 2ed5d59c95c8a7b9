// Writes sample PNGs (NAME.png beside NAME.rgb, the canvas's raw pixels
// with a "W H\n" header) and a zlib stream (deflate.z beside deflate.bin)
// into the directory given as the only argument, for png_zlib_check.py to
// read back with python's zlib: a decoder that shares nothing with ours.
#include <cstdio>
#include <fstream>
#include <random>
#include <string>

#include "client/chart/canvas.h"
#include "client/chart/deflate.h"
#include "client/chart/png.h"

namespace plateau::chart {
namespace {

bool WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.close();
  return static_cast<bool>(f);
}

bool WriteSample(const std::string& dir, const std::string& name, const Canvas& c) {
  const std::string header = std::to_string(c.width()) + " " + std::to_string(c.height()) + "\n";
  const std::string rgb(c.pixels().begin(), c.pixels().end());
  return WriteFile(dir + "/" + name + ".png", EncodePng(c)) && WriteFile(dir + "/" + name + ".rgb", header + rgb);
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

int Main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: png_samples DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  std::mt19937 rng(3);
  Canvas noise(200, 150, {0, 0, 0});
  for (int y = 0; y < 150; ++y) {
    for (int x = 0; x < 200; ++x) noise.Set(x, y, {uint8_t(rng()), uint8_t(rng()), uint8_t(rng())});
  }
  Canvas chart(321, 203, {255, 255, 255});
  chart.FillPolygon({{20, 180}, {80, 90}, {160, 120}, {300, 40}, {300, 180}}, {31, 90, 180});
  chart.Polyline({{20, 150}, {90, 60}, {200, 100}, {300, 30}}, {200, 50, 40}, 2.5);
  chart.DashedLine({20, 100}, {300, 100}, {235, 140, 30}, 1.5, 6, 4);
  chart.Text(30, 5, "tokens / s, 0123456789", {0, 0, 0}, 2);
  bool ok = WriteSample(dir, "noise", noise) && WriteSample(dir, "solid", Canvas(960, 600, {31, 90, 180})) &&
            WriteSample(dir, "chart", chart) && WriteSample(dir, "one", Canvas(1, 1, {12, 34, 56})) &&
            WriteSample(dir, "odd", Pattern(33, 7)) && WriteSample(dir, "large", Pattern(300, 200));
  // Random bytes, runs and copies from up to 32 KiB back, for ZlibCompress alone.
  std::string data;
  for (int i = 0; i < 40000; ++i) data.push_back(static_cast<char>(rng()));
  for (int k = 0; k < 2000; ++k) {
    const size_t len = 3 + rng() % 256, dist = 1 + rng() % 32768, from = data.size() - dist;
    for (size_t i = 0; i < len; ++i) data.push_back(data[from + i]);
    data.append(rng() % 4, static_cast<char>(rng()));
  }
  ok = ok && WriteFile(dir + "/deflate.bin", data) && WriteFile(dir + "/deflate.z", ZlibCompress(data));
  if (!ok) std::fprintf(stderr, "png_samples: cannot write into %s\n", dir.c_str());
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace plateau::chart

int main(int argc, char** argv) { return plateau::chart::Main(argc, argv); }
