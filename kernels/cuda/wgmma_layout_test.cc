// wgmma_layout.h against what the kernels rely on: every element of A and D
// has exactly one (thread, register) home and the homes are mma.sync's per
// warp; the no-swizzle tile offsets put each element in its own 2 bytes,
// core matrices as 128 contiguous bytes, inside the tile; the descriptor's
// bit fields (PTX ISA, "Matrix Descriptor Format").
#include "kernels/cuda/wgmma_layout.h"

#include <set>
#include <utility>

#include "gtest/gtest.h"

namespace plateau::wgmma {
namespace {

TEST(WgmmaLayoutTest, EveryElementOfDAndAHasOneHome) {
  std::set<std::pair<int, int>> d, a;
  for (int t = 0; t < kThreads; ++t) {
    for (int r = 0; r < kDFloats; ++r) {
      const mma::Coord e = DElement(t, r);
      ASSERT_TRUE(e.row >= 0 && e.row < kM && e.col >= 0 && e.col < kN);
      EXPECT_TRUE(d.insert({e.row, e.col}).second) << "D element held twice";
      // Warp t / 32 owns rows 16 (t / 32) ..: mma.sync's m16n8 tile r / 4.
      EXPECT_EQ(e.row / 16, t / 32);
    }
    for (int r = 0; r < kARegs; ++r) {
      for (int h = 0; h < 2; ++h) {
        const mma::Coord e = AElement(t, r, h);
        ASSERT_TRUE(e.row >= 0 && e.row < kM && e.col >= 0 && e.col < kK);
        EXPECT_TRUE(a.insert({e.row, e.col}).second) << "A element held twice";
      }
    }
  }
  EXPECT_EQ(d.size(), static_cast<size_t>(kM * kN));
  EXPECT_EQ(a.size(), static_cast<size_t>(kM * kK));
  // Float r of a thread: row half (r % 4) / 2, columns 8 (r / 4) + 2 (t % 4) + r % 2.
  EXPECT_EQ(DElement(37, 0).row, 16 + 1);
  EXPECT_EQ(DElement(37, 0).col, 2);
  EXPECT_EQ(DElement(37, 7).row, 16 + 1 + 8);
  EXPECT_EQ(DElement(37, 7).col, 8 + 2 + 1);
}

TEST(WgmmaLayoutTest, TileOffsetsAreCoreMatricesOfContiguousRows) {
  constexpr int kRows = 64, kCols = 32;
  for (bool mn_major : {false, true}) {
    std::set<uint32_t> seen;
    for (int mn = 0; mn < kRows; ++mn) {
      for (int k = 0; k < kCols; ++k) {
        const uint32_t at = mn_major ? MnMajorOffset(mn, k, kRows) : KMajorOffset(mn, k, kRows);
        EXPECT_LT(at, static_cast<uint32_t>(kRows * kCols * 2));
        EXPECT_EQ(at % 2, 0u);
        EXPECT_TRUE(seen.insert(at).second);
        // The core matrix (mn / 8, k / 8) is the 128 bytes at its first
        // element; a 16-byte row runs along k (K-major) or mn (MN-major).
        const uint32_t core = mn_major ? MnMajorOffset(mn / 8 * 8, k / 8 * 8, kRows)
                                       : KMajorOffset(mn / 8 * 8, k / 8 * 8, kRows);
        EXPECT_EQ(core % 128, 0u);
        const uint32_t in_core =
            mn_major ? (k % 8) * 16 + (mn % 8) * 2 : (mn % 8) * 16 + (k % 8) * 2;
        EXPECT_EQ(at, core + in_core);
        // Neighbouring core matrices: 128 bytes along M/N (SBO), 16 R along K (LBO).
        EXPECT_EQ(core, (mn / 8) * 128u + (k / 8) * 16u * kRows);
      }
    }
  }
}

TEST(WgmmaLayoutTest, DescriptorFields) {
  const uint64_t d = Descriptor(0x1230, 0x400, 0x80);
  EXPECT_EQ(d & 0x3fff, 0x123u);
  EXPECT_EQ(d >> 16 & 0x3fff, 0x40u);
  EXPECT_EQ(d >> 32 & 0x3fff, 0x8u);
  EXPECT_EQ(d >> 49 & 7, 0u);        // base offset
  EXPECT_EQ(d >> 62, 0u);            // no swizzle
  EXPECT_EQ(d & 0xc000c000ull, 0u);  // the reserved bits
  // k-step s of a 64-row tile: start 2 s 16 64 bytes in, LBO 16 * 64, SBO 128.
  EXPECT_EQ(TileDescriptor(0x400, 64, 1), Descriptor(0x400 + 2048, 1024, 128));
}

TEST(WgmmaLayoutTest, AdvanceIsTheDescriptorOfTheAddressFurtherOn) {
  // Every start and distance (multiples of 16) within the 2^18 bytes the
  // address field holds, with strides whose fields are full: no carry.
  for (uint32_t lbo : {128u, 1024u, 0x3fff0u}) {
    for (uint32_t a = 0; a < (1u << 18); a += 16 * 37) {
      for (uint32_t bytes = 0; a + bytes < (1u << 18); bytes += 16 * 101) {
        ASSERT_EQ(Advance(Descriptor(a, lbo, 0x3fff0), bytes), Descriptor(a + bytes, lbo, 0x3fff0))
            << a << " + " << bytes << ", lbo " << lbo;
      }
    }
  }
  EXPECT_EQ(Advance(TileDescriptor(0x400, 64, 0), 3 * 2048), TileDescriptor(0x400, 64, 3));
}

}  // namespace
}  // namespace plateau::wgmma
