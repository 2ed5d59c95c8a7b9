#include "client/chart/inflate_for_test.h"

#include <cstdint>
#include <stdexcept>

namespace plateau::chart::testing {
namespace {

// Thrown inside this file only, caught by Inflate and turned into `error`.
struct Malformed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Bits {
 public:
  explicit Bits(std::string_view s) : s_(s) {}
  int Bit() {
    if (byte_ >= s_.size()) throw Malformed("stream ends early");
    const int b = (static_cast<uint8_t>(s_[byte_]) >> bit_) & 1;
    if (++bit_ == 8) bit_ = 0, ++byte_;
    return b;
  }
  // n bits as a number, first bit least significant (RFC 1951 3.1.1).
  uint32_t Number(int n) {
    uint32_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<uint32_t>(Bit()) << i;
    return v;
  }
  void SkipToByte() {
    if (bit_ != 0) bit_ = 0, ++byte_;
  }
  uint8_t Byte() {
    if (bit_ != 0) throw Malformed("byte read off a byte boundary");
    if (byte_ >= s_.size()) throw Malformed("stream ends early");
    return static_cast<uint8_t>(s_[byte_++]);
  }
  size_t position() const { return byte_; }

 private:
  std::string_view s_;
  size_t byte_ = 0;
  int bit_ = 0;
};

// A canonical Huffman code given by its code lengths (RFC 1951 3.2.2),
// decoded one bit at a time: count[l] codes of length l, and the symbols
// sorted by (length, symbol value).
class Huffman {
 public:
  explicit Huffman(const std::vector<int>& lengths) : count_(16, 0) {
    for (int l : lengths) ++count_[l];
    count_[0] = 0;
    std::vector<int> first(16, 0);
    for (int l = 1; l < 16; ++l) first[l] = first[l - 1] + count_[l - 1];
    sorted_.resize(lengths.size());
    int used = 0;
    for (size_t s = 0; s < lengths.size(); ++s) {
      if (lengths[s] != 0) sorted_[first[lengths[s]] + (counted_[lengths[s]]++)] = static_cast<int>(s), ++used;
    }
    sorted_.resize(used);
  }
  int Decode(Bits* in) const {
    int code = 0, first = 0, index = 0;  // first code of this length, and its index in sorted_
    for (int l = 1; l < 16; ++l) {
      code |= in->Bit();
      if (code - first < count_[l]) return sorted_[index + (code - first)];
      index += count_[l];
      first = (first + count_[l]) << 1;
      code <<= 1;
    }
    throw Malformed("no such Huffman code");
  }

 private:
  std::vector<int> count_;
  int counted_[16] = {};
  std::vector<int> sorted_;
};

// Length codes 257..285 and distance codes 0..29 (RFC 1951 3.2.5), built
// from the rule that each code's extra bits exactly fill the gap to the next.
struct Tables {
  int length_base[29], length_extra[29], dist_base[30], dist_extra[30];
  Tables() {
    int base = 3;
    for (int i = 0; i < 28; ++i) {
      length_extra[i] = i < 8 ? 0 : (i - 4) / 4;
      length_base[i] = base;
      base += 1 << length_extra[i];
    }
    length_base[28] = 258, length_extra[28] = 0;
    base = 1;
    for (int i = 0; i < 30; ++i) {
      dist_extra[i] = i < 4 ? 0 : (i - 2) / 2;
      dist_base[i] = base;
      base += 1 << dist_extra[i];
    }
  }
};

void Codes(Bits* in, const Huffman& litlen, const Huffman& dist, std::string* out) {
  static const Tables t;
  for (;;) {
    const int sym = litlen.Decode(in);
    if (sym < 256) {
      out->push_back(static_cast<char>(sym));
      continue;
    }
    if (sym == 256) return;
    if (sym > 285) throw Malformed("length symbol 286 or 287");
    const int len = t.length_base[sym - 257] + static_cast<int>(in->Number(t.length_extra[sym - 257]));
    const int dsym = dist.Decode(in);
    if (dsym > 29) throw Malformed("distance symbol 30 or 31");
    const size_t d = static_cast<size_t>(t.dist_base[dsym]) + in->Number(t.dist_extra[dsym]);
    if (d > out->size()) throw Malformed("distance reaches before the start");
    if (d > 32768) throw Malformed("distance beyond the 32 KiB window");
    for (int i = 0; i < len; ++i) out->push_back((*out)[out->size() - d]);
  }
}

void Dynamic(Bits* in, std::string* out) {
  const int hlit = static_cast<int>(in->Number(5)) + 257;
  const int hdist = static_cast<int>(in->Number(5)) + 1;
  const int hclen = static_cast<int>(in->Number(4)) + 4;
  static const int kOrder[19] = {16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15};
  std::vector<int> cl(19, 0);
  for (int i = 0; i < hclen; ++i) cl[kOrder[i]] = static_cast<int>(in->Number(3));
  const Huffman clcode(cl);
  std::vector<int> lengths;
  while (static_cast<int>(lengths.size()) < hlit + hdist) {
    const int s = clcode.Decode(in);
    if (s < 16) {
      lengths.push_back(s);
    } else if (s == 16) {
      if (lengths.empty()) throw Malformed("repeat with nothing before it");
      const int n = 3 + static_cast<int>(in->Number(2));
      for (int i = 0; i < n; ++i) lengths.push_back(lengths.back());
    } else {
      const int n = s == 17 ? 3 + static_cast<int>(in->Number(3)) : 11 + static_cast<int>(in->Number(7));
      lengths.insert(lengths.end(), n, 0);
    }
  }
  if (static_cast<int>(lengths.size()) != hlit + hdist) throw Malformed("code lengths overrun");
  const Huffman litlen(std::vector<int>(lengths.begin(), lengths.begin() + hlit));
  const Huffman dist(std::vector<int>(lengths.begin() + hlit, lengths.end()));
  Codes(in, litlen, dist, out);
}

void Fixed(Bits* in, std::string* out) {
  std::vector<int> l(288);
  for (int s = 0; s < 288; ++s) l[s] = s < 144 ? 8 : s < 256 ? 9 : s < 280 ? 7 : 8;
  static const Huffman litlen(l), dist(std::vector<int>(30, 5));
  Codes(in, litlen, dist, out);
}

void Stored(Bits* in, std::string* out) {
  in->SkipToByte();
  int len = in->Byte();
  len |= in->Byte() << 8;
  int nlen = in->Byte();
  nlen |= in->Byte() << 8;
  if ((len ^ 0xffff) != nlen) throw Malformed("stored LEN and NLEN disagree");
  for (int i = 0; i < len; ++i) out->push_back(static_cast<char>(in->Byte()));
}

}  // namespace

Inflated Inflate(std::string_view zlib) {
  Inflated r;
  try {
    Bits in(zlib);
    const int cmf = in.Byte();
    const int flg = in.Byte();
    if ((cmf & 0x0f) != 8) throw Malformed("compression method is not deflate");
    if ((cmf >> 4) > 7) throw Malformed("window larger than 32 KiB");
    if ((cmf * 256 + flg) % 31 != 0) throw Malformed("header check fails");
    if (flg & 0x20) throw Malformed("preset dictionary");
    bool last = false;
    while (!last) {
      last = in.Bit() == 1;
      const int type = static_cast<int>(in.Number(2));
      r.block_types.push_back(type);
      if (type == 0) {
        Stored(&in, &r.data);
      } else if (type == 1) {
        Fixed(&in, &r.data);
      } else if (type == 2) {
        Dynamic(&in, &r.data);
      } else {
        throw Malformed("block type 3");
      }
    }
    in.SkipToByte();
    uint32_t want = 0;
    for (int i = 0; i < 4; ++i) want = want << 8 | in.Byte();
    // Adler-32 from its definition (RFC 1950 8.2), not the encoder's.
    uint64_t a = 1, b = 0;
    for (unsigned char c : r.data) {
      a = (a + c) % 65521;
      b = (b + a) % 65521;
    }
    if (want != static_cast<uint32_t>(b << 16 | a)) throw Malformed("Adler-32 does not match the data");
    r.consumed = in.position();
  } catch (const Malformed& e) {
    r.error = e.what();
  }
  return r;
}

}  // namespace plateau::chart::testing
