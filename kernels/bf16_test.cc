// FloatToBf16 against an independent reference: the two bf16 neighbours of
// a float are found by truncation and the nearer one chosen by comparing the
// exact distances in double (ties to the even neighbour). Every bf16 value
// (all 2^16 upper halves) is combined with the low halves that decide a
// rounding: exact, just above zero, just below, at and around the half, and
// the top.
#include "kernels/bf16.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "gtest/gtest.h"

namespace plateau {
namespace {

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

uint32_t BitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// The reference: nearest of the two neighbours, ties to even, IEEE overflow.
uint16_t ReferenceRound(float f) {
  if (std::isnan(f)) return 0x7fff;
  const uint32_t u = BitsOf(f);
  const uint16_t down = static_cast<uint16_t>(u >> 16);  // towards zero
  if ((u & 0xffffu) == 0) return down;
  const uint16_t up = static_cast<uint16_t>(down + 1);   // away from zero (may be inf)
  const double x = std::fabs(static_cast<double>(f));
  const double d = std::fabs(static_cast<double>(FromBits(static_cast<uint32_t>(down) << 16)));
  // The neighbour away from zero: above the largest finite bf16 it is the
  // value 2^128, where IEEE puts the overflow threshold.
  const double a = (down & 0x7fff) == 0x7f7f ? std::ldexp(1.0, 128)
                                             : std::fabs(static_cast<double>(
                                                   FromBits(static_cast<uint32_t>(up) << 16)));
  if (x - d < a - x) return down;
  if (a - x < x - d) return up;
  return (down & 1) ? up : down;
}

TEST(Bf16Test, RoundsToNearestEvenLikeCuda) {
  const uint32_t lows[] = {0x0000, 0x0001, 0x3fff, 0x7ffe, 0x7fff, 0x8000,
                           0x8001, 0xbfff, 0xfffe, 0xffff};
  int64_t checked = 0;
  for (uint32_t hi = 0; hi < 0x10000; ++hi) {
    for (uint32_t lo : lows) {
      const uint32_t u = (hi << 16) | lo;
      const float f = FromBits(u);
      ASSERT_EQ(FloatToBf16(f).bits, ReferenceRound(f)) << std::hex << "input bits 0x" << u;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 10 * 65536);
}

TEST(Bf16Test, SpecialValues) {
  EXPECT_EQ(FloatToBf16(0.0f).bits, 0x0000);
  EXPECT_EQ(FloatToBf16(-0.0f).bits, 0x8000);
  EXPECT_EQ(FloatToBf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()).bits, 0x7f80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()).bits, 0xff80);
  // Every NaN, whatever its sign or payload, is CUDA's canonical one; a NaN
  // with a payload only in the low bits must not truncate to infinity.
  EXPECT_EQ(FloatToBf16(FromBits(0x7f800001u)).bits, 0x7fff);
  EXPECT_EQ(FloatToBf16(FromBits(0xffc00000u)).bits, 0x7fff);
  // The largest float rounds up to inf (above bf16's largest finite value
  // by more than half a unit); the largest finite bf16 stays.
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()).bits, 0x7f80);
  EXPECT_EQ(FloatToBf16(FromBits(0x7f7f0000u)).bits, 0x7f7f);
  // Subnormals are rounded, not flushed: the smallest float subnormal is far
  // below half of the smallest bf16 subnormal (0x0001 = 2^-133).
  EXPECT_EQ(FloatToBf16(FromBits(0x00000001u)).bits, 0x0000);
  EXPECT_EQ(FloatToBf16(FromBits(0x00010000u)).bits, 0x0001);
  EXPECT_EQ(FloatToBf16(FromBits(0x00018000u)).bits, 0x0002);  // tie, odd below: up
  EXPECT_EQ(FloatToBf16(FromBits(0x00028000u)).bits, 0x0002);  // tie, even below: stays
  // 1 + 2^-8 is the exact half between 1 and 1 + 2^-7: ties to even (1).
  EXPECT_EQ(FloatToBf16(1.0f + 1.0f / 256).bits, 0x3f80);
  EXPECT_EQ(FloatToBf16(1.0f + 3.0f / 256).bits, 0x3f82);
}

TEST(Bf16Test, LoadIsExactAndOneRoundingIsWithinTheUnitRoundoff) {
  for (uint32_t hi = 0; hi < 0x10000; ++hi) {
    const Bf16 b{static_cast<uint16_t>(hi)};
    const float f = Bf16ToFloat(b);
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBf16(f).bits, b.bits) << "bf16 -> fp32 -> bf16 must be exact, 0x" << std::hex
                                           << hi;
  }
  // The stated bound over the normal range, at many points across binades.
  for (uint32_t u = 0x00800000u; u < 0x7f000000u; u += 0x00012345u) {
    const float f = FromBits(u);
    const double err = std::fabs(static_cast<double>(RoundToBf16(f)) - f) / f;
    ASSERT_LE(err, kBf16UnitRoundoff) << f;
  }
}

}  // namespace
}  // namespace plateau
