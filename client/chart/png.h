// PNG encoding of a Canvas without any library: 8-bit RGB, no interlace,
// every row with filter 0, the image data a zlib stream of stored
// (uncompressed) deflate blocks. Files are larger than a compressor would
// make (3 bytes a pixel), which is fine for charts of a few hundred
// thousand pixels.
//
// Thread safety: pure functions.
#ifndef PLATEAU_CLIENT_CHART_PNG_H_
#define PLATEAU_CLIENT_CHART_PNG_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "client/chart/canvas.h"
#include "client/chart/deflate.h"  // Adler32

namespace plateau::chart {

// CRC-32 (ISO 3309, as in PNG chunks); Adler32 is in deflate.h.
uint32_t Crc32(std::string_view data);

// The whole PNG file.
std::string EncodePng(const Canvas& canvas);
// EncodePng written to `path`; an error names the path.
absl::Status WritePng(const Canvas& canvas, const std::string& path);

}  // namespace plateau::chart

#endif  // PLATEAU_CLIENT_CHART_PNG_H_
