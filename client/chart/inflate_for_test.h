// A zlib / deflate reader for the tests of deflate.h and png.h, written
// from RFC 1950 and RFC 1951 and sharing no code or tables with the
// encoder: stored, fixed-Huffman and dynamic-Huffman blocks, every
// distance checked against the output so far, the Adler-32 trailer checked
// against its own sum. Slow and simple on purpose (one bit at a time).
//
// Thread safety: pure functions.
#ifndef PLATEAU_CLIENT_CHART_INFLATE_FOR_TEST_H_
#define PLATEAU_CLIENT_CHART_INFLATE_FOR_TEST_H_

#include <string>
#include <string_view>
#include <vector>

namespace plateau::chart::testing {

struct Inflated {
  std::string data;
  std::vector<int> block_types;  // BTYPE of each block in order: 0 stored, 1 fixed, 2 dynamic
  size_t consumed = 0;           // bytes of the zlib stream read, trailer included
  std::string error;             // empty when the stream is valid
};

// Reads one zlib stream from the start of `zlib`. Bytes after the trailer
// are not read (`consumed` says where the stream ended).
Inflated Inflate(std::string_view zlib);

}  // namespace plateau::chart::testing

#endif  // PLATEAU_CLIENT_CHART_INFLATE_FOR_TEST_H_
