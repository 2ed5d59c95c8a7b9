#include "client/chart/deflate.h"

#include <algorithm>
#include <array>
#include <vector>

namespace plateau::chart {
namespace {

constexpr int kMinMatch = 3;
constexpr int kMaxMatch = 258;
constexpr int64_t kWindow = 32768;  // the largest distance deflate can name
constexpr int kHashBits = 15;
// Candidates tried per position. Runs of one colour find a 258-byte match
// at the first candidate; the bound only matters on busy data.
constexpr int kMaxChain = 64;
// Input bytes a block covers at most: below a stored block's limit of
// 65,535, so any block can fall back to stored, and small enough that data
// mixing noise and runs gets the cheaper coding for each part (a block
// costs 10 bits fixed, 5 bytes stored).
constexpr size_t kMaxBlockInput = 16384;

// RFC 1951 3.2.5: length codes 257..285 and distance codes 0..29.
constexpr std::array<int, 29> kLengthBase = {3,  4,  5,  6,  7,  8,  9,  10, 11,  13,  15,  17,  19,  23, 27,
                                             31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258};
constexpr std::array<int, 29> kLengthExtra = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2,
                                              2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0};
constexpr std::array<int, 30> kDistBase = {1,   2,   3,   4,   5,   7,    9,    13,   17,   25,   33,   49,   65,    97,    129,
                                           193, 257, 385, 513, 769, 1025, 1537, 2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577};
constexpr std::array<int, 30> kDistExtra = {0, 0, 0, 0, 1, 1, 2, 2,  3,  3,  4,  4,  5,  5,  6,
                                            6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13};

// A literal byte (dist == 0) or a match of `len` bytes starting `dist` back.
struct Token {
  uint16_t len_or_literal;
  uint16_t dist;
};

// Index of the largest base <= v (the code for a length or distance).
template <size_t N>
int CodeOf(const std::array<int, N>& base, int v) {
  return static_cast<int>(std::upper_bound(base.begin(), base.end(), v) - base.begin()) - 1;
}

uint32_t Reverse(uint32_t v, int n) {
  uint32_t r = 0;
  for (int i = 0; i < n; ++i, v >>= 1) r = (r << 1) | (v & 1);
  return r;
}

// Huffman codes are defined most-significant bit first but packed from the
// low end of each byte, so the table holds them reversed.
struct Code {
  uint32_t bits;
  int len;
};

// RFC 1951 3.2.6: the fixed literal/length code.
const std::array<Code, 288>& FixedLitLen() {
  static const std::array<Code, 288> table = [] {
    std::array<Code, 288> t{};
    for (int s = 0; s < 288; ++s) {
      if (s < 144) {
        t[s] = {Reverse(0x30 + s, 8), 8};
      } else if (s < 256) {
        t[s] = {Reverse(0x190 + (s - 144), 9), 9};
      } else if (s < 280) {
        t[s] = {Reverse(s - 256, 7), 7};
      } else {
        t[s] = {Reverse(0xC0 + (s - 280), 8), 8};
      }
    }
    return t;
  }();
  return table;
}

class BitWriter {
 public:
  explicit BitWriter(std::string* out) : out_(out) {}
  // The low n bits of v (n <= 32), least significant first.
  void Put(uint32_t v, int n) {
    acc_ |= uint64_t{v} << count_;
    count_ += n;
    while (count_ >= 8) {
      out_->push_back(static_cast<char>(acc_ & 0xff));
      acc_ >>= 8;
      count_ -= 8;
    }
  }
  void Put(Code c) { Put(c.bits, c.len); }
  void AlignToByte() {
    if (count_ > 0) Put(0, 8 - count_);
  }
  // Whole bytes; only after AlignToByte.
  void Append(std::string_view bytes) { out_->append(bytes); }

 private:
  std::string* out_;
  uint64_t acc_ = 0;
  int count_ = 0;
};

// Greedy LZ77: at each position the longest match among the first
// kMaxChain earlier positions with the same 3-byte hash, else a literal.
std::vector<Token> Parse(std::string_view data) {
  const size_t n = data.size();
  const auto* d = reinterpret_cast<const uint8_t*>(data.data());
  std::vector<int64_t> head(size_t{1} << kHashBits, -1);
  std::vector<int64_t> prev(kWindow, -1);  // prev[p % kWindow]: the position before p on p's chain
  auto hash = [d](size_t p) {
    const uint32_t v = uint32_t{d[p]} | uint32_t{d[p + 1]} << 8 | uint32_t{d[p + 2]} << 16;
    return (v * 2654435761u) >> (32 - kHashBits);
  };
  // A position joins its chain after it has been searched, so a slot of
  // prev is reused only once its position is out of the window.
  auto insert = [&](size_t p) {
    if (p + kMinMatch > n) return;
    const uint32_t h = hash(p);
    prev[p % kWindow] = head[h];
    head[h] = static_cast<int64_t>(p);
  };
  std::vector<Token> tokens;
  size_t p = 0;
  while (p < n) {
    size_t best_len = 0, best_dist = 0;
    if (p + kMinMatch <= n) {
      const size_t max_len = std::min<size_t>(kMaxMatch, n - p);
      int64_t cand = head[hash(p)];
      for (int chain = kMaxChain; chain > 0 && cand >= 0 && static_cast<int64_t>(p) - cand <= kWindow;
           --chain, cand = prev[cand % kWindow]) {
        const uint8_t* c = d + cand;
        if (c[best_len] != d[p + best_len]) continue;  // cannot beat best_len
        size_t len = 0;
        while (len < max_len && c[len] == d[p + len]) ++len;
        if (len > best_len) {
          best_len = len;
          best_dist = p - static_cast<size_t>(cand);
          if (len == max_len) break;
        }
      }
    }
    if (best_len >= kMinMatch) {
      tokens.push_back({static_cast<uint16_t>(best_len), static_cast<uint16_t>(best_dist)});
      for (size_t q = p; q < p + best_len; ++q) insert(q);
      p += best_len;
    } else {
      tokens.push_back({d[p], 0});
      insert(p);
      ++p;
    }
  }
  return tokens;
}

size_t InputBytes(const Token& t) { return t.dist == 0 ? 1 : t.len_or_literal; }

// Bits of a token in the fixed code.
uint64_t FixedBits(const Token& t) {
  if (t.dist == 0) return FixedLitLen()[t.len_or_literal].len;
  const int lc = CodeOf(kLengthBase, t.len_or_literal), dc = CodeOf(kDistBase, t.dist);
  return FixedLitLen()[257 + lc].len + kLengthExtra[lc] + 5 + kDistExtra[dc];
}

void PutFixed(BitWriter* w, const Token& t) {
  if (t.dist == 0) {
    w->Put(FixedLitLen()[t.len_or_literal]);
    return;
  }
  const int lc = CodeOf(kLengthBase, t.len_or_literal), dc = CodeOf(kDistBase, t.dist);
  w->Put(FixedLitLen()[257 + lc]);
  w->Put(static_cast<uint32_t>(t.len_or_literal - kLengthBase[lc]), kLengthExtra[lc]);
  w->Put(Reverse(static_cast<uint32_t>(dc), 5), 5);  // the fixed distance code: 5 bits, MSB first
  w->Put(static_cast<uint32_t>(t.dist - kDistBase[dc]), kDistExtra[dc]);
}

}  // namespace

uint32_t Adler32(std::string_view data) {
  constexpr uint32_t kMod = 65521;
  uint32_t a = 1, b = 0;
  for (unsigned char c : data) {
    a = (a + c) % kMod;
    b = (b + a) % kMod;
  }
  return (b << 16) | a;
}

// zlib header 0x78 0x01: deflate, 32 KiB window, no dictionary, "fastest"
// level; 0x7801 is a multiple of 31 as the header check requires.
std::string ZlibCompress(std::string_view data) {
  const std::vector<Token> tokens = Parse(data);
  std::string out = {'\x78', '\x01'};
  BitWriter w(&out);
  size_t t = 0, pos = 0;
  do {
    // The next block: the tokens that cover at most kMaxBlockInput bytes
    // (matches may reach back into earlier blocks, stored or not).
    size_t end = t, span = 0;
    uint64_t fixed_bits = 3 + FixedLitLen()[256].len;  // header, end of block
    while (end < tokens.size() && span + InputBytes(tokens[end]) <= kMaxBlockInput) {
      span += InputBytes(tokens[end]);
      fixed_bits += FixedBits(tokens[end]);
      ++end;
    }
    const bool last = end == tokens.size();
    const uint64_t stored_bits = 3 + 7 + 32 + 8 * uint64_t{span};  // header, padding at most, LEN NLEN, bytes
    w.Put(last ? 1 : 0, 1);
    if (stored_bits <= fixed_bits) {
      w.Put(0, 2);
      w.AlignToByte();
      w.Put(static_cast<uint32_t>(span), 16);
      w.Put(static_cast<uint32_t>(~span & 0xffff), 16);
      w.Append(data.substr(pos, span));
    } else {
      w.Put(1, 2);
      for (size_t i = t; i < end; ++i) PutFixed(&w, tokens[i]);
      w.Put(FixedLitLen()[256]);
    }
    t = end;
    pos += span;
  } while (t < tokens.size());
  w.AlignToByte();
  const uint32_t adler = Adler32(data);
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>(adler >> shift));
  return out;
}

}  // namespace plateau::chart
