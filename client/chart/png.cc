#include "client/chart/png.h"

#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <vector>

#include "absl/strings/str_cat.h"

namespace plateau::chart {
namespace {

const std::array<uint32_t, 256>& CrcTable() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[n] = c;
    }
    return t;
  }();
  return table;
}

void PutBe32(std::string* out, uint32_t v) {
  out->push_back(static_cast<char>(v >> 24));
  out->push_back(static_cast<char>(v >> 16));
  out->push_back(static_cast<char>(v >> 8));
  out->push_back(static_cast<char>(v));
}

// length, type, data, CRC-32 of type and data.
void PutChunk(std::string* out, std::string_view type, std::string_view data) {
  PutBe32(out, static_cast<uint32_t>(data.size()));
  std::string body(type);
  body.append(data);
  out->append(body);
  PutBe32(out, Crc32(body));
}

// Each row as the bytes of the filter (PNG 9.2: 0 None, 1 Sub, 2 Up; the
// byte before the first pixel and the row above the first row read as 0)
// whose sum of |byte as signed| is least (PNG 12.8's heuristic, as libpng
// uses; ties go to the lower type). Flat runs become runs of zeros, rows
// equal to the one above become all zeros, and deflate finds both.
std::string FilteredRows(const Canvas& canvas) {
  const size_t w = static_cast<size_t>(canvas.width()), h = static_cast<size_t>(canvas.height());
  const size_t stride = 3 * w;
  const uint8_t* px = canvas.pixels().data();
  const std::vector<uint8_t> zero_row(stride, 0);
  std::string raw;
  raw.reserve(h * (1 + stride));
  std::array<std::string, 3> filtered;
  for (std::string& f : filtered) f.resize(stride);
  for (size_t y = 0; y < h; ++y) {
    const uint8_t* cur = px + y * stride;
    const uint8_t* up = y == 0 ? zero_row.data() : cur - stride;
    for (size_t i = 0; i < stride; ++i) {
      filtered[0][i] = static_cast<char>(cur[i]);
      filtered[1][i] = static_cast<char>(cur[i] - (i >= 3 ? cur[i - 3] : 0));
      filtered[2][i] = static_cast<char>(cur[i] - up[i]);
    }
    int best = 0;
    uint64_t best_sum = UINT64_MAX;
    for (int f = 0; f < 3; ++f) {
      uint64_t sum = 0;
      for (char c : filtered[f]) sum += static_cast<uint64_t>(std::abs(static_cast<int>(static_cast<int8_t>(c))));
      if (sum < best_sum) best = f, best_sum = sum;
    }
    raw.push_back(static_cast<char>(best));
    raw.append(filtered[best]);
  }
  return raw;
}

}  // namespace

uint32_t Crc32(std::string_view data) {
  const auto& t = CrcTable();
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : data) c = t[(c ^ b) & 0xff] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

std::string EncodePng(const Canvas& canvas) {
  const int w = canvas.width(), h = canvas.height();
  std::string png = "\x89PNG\r\n\x1a\n";
  std::string ihdr;
  PutBe32(&ihdr, static_cast<uint32_t>(w));
  PutBe32(&ihdr, static_cast<uint32_t>(h));
  ihdr += {'\x08', '\x02', '\x00', '\x00', '\x00'};  // 8 bits, RGB, deflate, filter method 0 (a type per row), no interlace
  PutChunk(&png, "IHDR", ihdr);
  PutChunk(&png, "IDAT", ZlibCompress(FilteredRows(canvas)));
  PutChunk(&png, "IEND", "");
  return png;
}

absl::Status WritePng(const Canvas& canvas, const std::string& path) {
  const std::string png = EncodePng(canvas);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return absl::UnavailableError(absl::StrCat(path, ": cannot open for writing: ", std::strerror(errno)));
  f.write(png.data(), static_cast<std::streamsize>(png.size()));
  f.close();
  if (!f) return absl::UnavailableError(absl::StrCat(path, ": write failed: ", std::strerror(errno)));
  return absl::OkStatus();
}

}  // namespace plateau::chart
