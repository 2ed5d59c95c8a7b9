// A small zlib (RFC 1950) / deflate (RFC 1951) compressor without any
// library, for the PNG encoder (png.h). LZ77 over a 32 KiB window with a
// hash-chain matcher (chains cut at kMaxChain candidates, greedy parsing),
// coded with the fixed Huffman codes (BTYPE 01). Each block covers at most
// 16 KiB of input and is written stored (BTYPE 00) instead whenever that is
// no larger, so incompressible data grows by 5 bytes a block only.
// Charts are mostly long runs of one colour: those become matches of 258
// bytes at distance 1 or 3, about two bytes per 258.
//
// The output is a function of the input alone (no clocks, no addresses,
// no threads): the same bytes in, the same bytes out.
//
// Thread safety: pure functions.
#ifndef PLATEAU_CLIENT_CHART_DEFLATE_H_
#define PLATEAU_CLIENT_CHART_DEFLATE_H_

#include <cstdint>
#include <string>
#include <string_view>

namespace plateau::chart {

// Adler-32 (the zlib trailer).
uint32_t Adler32(std::string_view data);

// The zlib stream of `data`: header 0x78 0x01, deflate blocks, Adler-32.
std::string ZlibCompress(std::string_view data);

}  // namespace plateau::chart

#endif  // PLATEAU_CLIENT_CHART_DEFLATE_H_
