// ZlibCompress round-trips through the test inflater (inflate_for_test.h,
// which shares nothing with the encoder and is itself checked on streams
// python's zlib made), picks stored blocks for incompressible data and
// fixed-Huffman blocks with matches for repetitive data, and is
// deterministic.
#include "client/chart/deflate.h"

#include <random>
#include <string>

#include "client/chart/inflate_for_test.h"
#include "gtest/gtest.h"

namespace plateau::chart {
namespace {

using testing::Inflate;
using testing::Inflated;

TEST(DeflateTest, Adler32MatchesItsCheckValue) {
  EXPECT_EQ(Adler32("Wikipedia"), 0x11E60398u);
  EXPECT_EQ(Adler32(""), 1u);
}

// Streams made by python3's zlib 1.2.13, so the inflater is checked
// against an outside encoder before it checks ours.
TEST(DeflateTest, TheTestInflaterReadsZlibsOwnStreams) {
  const std::string stored(
      "\x78\x01\x01\x17\x00\xe8\xff\x53\x74\x6f\x72\x65\x64\x2c\x20\x6e\x6f\x74\x20\x63\x6f\x6d\x70\x72\x65\x73\x73"
      "\x65\x64\x2e\x66\x7a\x08\x92",
      34);
  Inflated r = Inflate(stored);
  EXPECT_EQ(r.error, "");
  EXPECT_EQ(r.data, "Stored, not compressed.");
  EXPECT_EQ(r.block_types, std::vector<int>{0});
  EXPECT_EQ(r.consumed, stored.size());

  // text[i] = 'a' + (i^3 + i / 7) % 11 % 5, 400 bytes: zlib.compressobj(9, strategy=Z_FIXED) and level 9.
  std::string text;
  for (int i = 0; i < 400; ++i) text.push_back(static_cast<char>('a' + (i * i * i + i / 7) % 11 % 5));
  const std::string fixed(
      "\x78\x01\x4b\x4c\x4a\x49\x4c\x4d\x4d\x4e\x49\x4e\x4d\x4c\x4a\x4e\x4d\x4e\x4c\x4a\x4d\x4d\x49\x4c\x4e\x49\x4d"
      "\x4c\x49\x02\x72\xc0\xac\xe4\xc4\x94\x54\x20\x07\xa4\x00\xa8\x16\xc8\x49\x06\x29\x4d\x4c\x4e\x4a\x4a\x4d\x4c"
      "\x4d\x02\x2a\x48\x4a\x49\x49\x49\x02\xaa\x05\xb1\x46\x0d\xa3\xcc\x30\x00\x1c\x2b\x9a\x9a",
      76);
  r = Inflate(fixed);
  EXPECT_EQ(r.error, "");
  EXPECT_EQ(r.data, text);
  EXPECT_EQ(r.block_types, std::vector<int>{1});
  const std::string dynamic(
      "\x78\xda\xed\xcc\xb9\x0d\xc0\x00\x10\x02\xc1\x5a\x79\xb6\xff\x16\xcc\xb9\x05\xa7\xce\x58\x69\x84\x5c\x41\x1a"
      "\xe4\x10\x19\xaa\x14\xd5\x8b\x77\x45\x65\x71\x60\x76\x91\xa3\x8a\x8d\xf0\x80\xdb\x7a\xf6\xd6\x7f\xf6\xed\xec"
      "\x01\x1c\x2b\x9a\x9a",
      59);
  r = Inflate(dynamic);
  EXPECT_EQ(r.error, "");
  EXPECT_EQ(r.data, text);
  EXPECT_EQ(r.block_types, std::vector<int>{2});

  // And it rejects what is wrong: a bad trailer, a cut stream, a bad header.
  std::string bad = fixed;
  bad.back() ^= 1;
  EXPECT_EQ(Inflate(bad).error, "Adler-32 does not match the data");
  EXPECT_EQ(Inflate(fixed.substr(0, 40)).error, "stream ends early");
  bad = fixed;
  bad[1] ^= 1;
  EXPECT_EQ(Inflate(bad).error, "header check fails");
}

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng() & 0xff);
  return s;
}

Inflated RoundTrip(const std::string& data) {
  const std::string z = ZlibCompress(data);
  Inflated r = Inflate(z);
  EXPECT_EQ(r.error, "");
  EXPECT_EQ(r.consumed, z.size()) << "bytes after the trailer";
  EXPECT_EQ(r.data.size(), data.size());
  EXPECT_TRUE(r.data == data) << "the data differs";
  return r;
}

TEST(DeflateTest, ShortInputs) {
  for (const std::string& s : {std::string(), std::string("a"), std::string("ab"), std::string("abc"),
                               std::string("aaaa"), std::string(3, '\0'), std::string("abcabcabcabcabcx")}) {
    RoundTrip(s);
  }
  EXPECT_EQ(RoundTrip("").block_types, std::vector<int>{1});  // one final block with only end-of-block
}

// Random bytes have (almost) no matches: every block is stored, so the
// stream is the data plus 5 bytes a block (at most 16 KiB of input each)
// plus header and trailer.
TEST(DeflateTest, IncompressibleDataIsStored) {
  const std::string data = RandomBytes(200000, 1);
  const Inflated r = RoundTrip(data);
  EXPECT_EQ(r.block_types, std::vector<int>(13, 0));  // 200,000 / 16,384 rounded up
  EXPECT_EQ(ZlibCompress(data).size(), 2 + data.size() + 13 * 5 + 4);
}

// A run of one byte becomes distance-1 matches of 258 bytes, about 2 bytes
// each; a run of one RGB colour the same at distance 3.
TEST(DeflateTest, RunsBecomeLongMatches) {
  const std::string zeros(300000, '\0');
  const Inflated r = RoundTrip(zeros);
  for (int t : r.block_types) EXPECT_EQ(t, 1);
  EXPECT_LT(ZlibCompress(zeros).size(), 300000 / 258 * 3);
  std::string rgb;
  for (int i = 0; i < 100000; ++i) rgb += "\x1f\x5a\xb4";
  RoundTrip(rgb);
  EXPECT_LT(ZlibCompress(rgb).size(), 300000 / 258 * 3);
}

// Literals mixed with copies of every length 3..258 from distances spread
// log-uniformly over 1..32768: each length and distance code, extra bits
// included (a wrong extra-bit count in either table fails here).
TEST(DeflateTest, EveryLengthAndDistance) {
  std::mt19937 rng(7);
  std::string data = RandomBytes(40000, 2);
  for (int len = 3; len <= 258; ++len) {
    for (int k = 0; k < 4; ++k) {
      const size_t dist = 1 + rng() % (size_t{2} << (rng() % 15));  // log-uniform: every distance code
      const size_t from = data.size() - dist;
      for (int i = 0; i < len; ++i) data.push_back(data[from + i]);  // overlapping copies too
      data.push_back(static_cast<char>(rng()));
    }
  }
  const size_t copied = data.size() - 40000;
  const Inflated r = RoundTrip(data);
  EXPECT_LT(ZlibCompress(data).size(), 40000 + 10 * 5 + copied / 3) << "the copies are found as matches";
  EXPECT_NE(std::find(r.block_types.begin(), r.block_types.end(), 1), r.block_types.end());
}

// Exactly the longest distance: a random 32 KiB block repeated.
TEST(DeflateTest, TheLongestDistance) {
  std::string block = RandomBytes(32768, 3);
  const std::string data = block + block + block;
  RoundTrip(data);
  EXPECT_LT(ZlibCompress(data).size(), 32768 + 3 * 5 + 2000);
}

TEST(DeflateTest, SameBytesInSameBytesOut) {
  std::string data = RandomBytes(5000, 4) + std::string(70000, 'x') + RandomBytes(5000, 4);
  EXPECT_EQ(ZlibCompress(data), ZlibCompress(std::string(data)));
}

}  // namespace
}  // namespace plateau::chart
