// PNG encoding of a Canvas without any library: 8-bit RGB, no interlace,
// each row filtered with None, Sub or Up (the least sum of absolute
// differences), the image data one zlib stream from deflate.h (fixed
// Huffman with LZ77 matches, stored where that is smaller). A chart of flat
// colours shrinks about 80-fold (docs/frontier.png: 1.7 MB of rows, 20 KB);
// noise stays at 3 bytes a pixel plus 5 bytes every 16 KiB. Same canvas,
// same bytes.
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
