#include "client/chart/png.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>

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

// zlib: header 0x78 0x01 (deflate, 32 KiB window, no dictionary; 0x7801 is a
// multiple of 31 as the header check requires), stored blocks of at most
// 65,535 bytes (BFINAL on the last, BTYPE 00, LEN and its one's complement
// little-endian), Adler-32 of the data big-endian.
std::string ZlibStored(std::string_view data) {
  std::string out = {'\x78', '\x01'};
  size_t pos = 0;
  do {
    const size_t n = std::min<size_t>(65535, data.size() - pos);
    const bool last = pos + n == data.size();
    out.push_back(last ? '\x01' : '\x00');
    const uint16_t len = static_cast<uint16_t>(n), nlen = static_cast<uint16_t>(~len);
    out.push_back(static_cast<char>(len & 0xff));
    out.push_back(static_cast<char>(len >> 8));
    out.push_back(static_cast<char>(nlen & 0xff));
    out.push_back(static_cast<char>(nlen >> 8));
    out.append(data.substr(pos, n));
    pos += n;
  } while (pos < data.size());
  PutBe32(&out, Adler32(data));
  return out;
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
  ihdr += {'\x08', '\x02', '\x00', '\x00', '\x00'};  // 8 bits, RGB, deflate, filter 0, no interlace
  PutChunk(&png, "IHDR", ihdr);
  std::string raw;
  raw.reserve(static_cast<size_t>(h) * (1 + 3 * static_cast<size_t>(w)));
  const std::vector<uint8_t>& px = canvas.pixels();
  for (int y = 0; y < h; ++y) {
    raw.push_back('\0');  // filter type 0 (none)
    raw.append(reinterpret_cast<const char*>(px.data()) + static_cast<size_t>(y) * w * 3, static_cast<size_t>(w) * 3);
  }
  PutChunk(&png, "IDAT", ZlibStored(raw));
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
