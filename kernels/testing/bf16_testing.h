// Host-side helpers for the bf16 tests: random bf16 data, conversions with
// bf16.h's rounding, and bit patterns to compare bitwise.
#ifndef PLATEAU_KERNELS_TESTING_BF16_TESTING_H_
#define PLATEAU_KERNELS_TESTING_BF16_TESTING_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/bf16.h"

namespace plateau {

// fp32's unit roundoff, 2^-24 (bf16's is kBf16UnitRoundoff, 2^-8).
inline constexpr double kFp32Unit = 1.0 / (1 << 24);

// n normal(0, scale) values rounded to bf16.
inline std::vector<Bf16> RandomBf16(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<Bf16> v(n);
  for (Bf16& x : v) x = FloatToBf16(dist(rng));
  return v;
}

// Each value as the fp32 it loads as (exact).
inline std::vector<float> Loaded(const std::vector<Bf16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = Bf16ToFloat(v[i]);
  return f;
}

// Each value rounded to bf16 as a kernel's store rounds it.
inline std::vector<Bf16> Rounded(const std::vector<float>& v) {
  std::vector<Bf16> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = FloatToBf16(v[i]);
  return b;
}

// Random fp32 values that bf16 holds exactly, so an fp32 and a bf16 run
// read the same numbers.
inline std::vector<float> Representable(int64_t n, uint32_t seed, float scale = 1.0f) {
  return Loaded(RandomBf16(n, seed, scale));
}

inline std::vector<uint16_t> Bits(const std::vector<Bf16>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = v[i].bits;
  return b;
}

inline std::vector<uint16_t> RoundedBits(const std::vector<float>& v) { return Bits(Rounded(v)); }

// A value a kernel computes in fp32 and stores to bf16, as a double
// reference sees it. The reference computes z exactly (in double) from its
// own inputs; the kernel's fp32 value z' is within `err` of z (the op's
// fp32 error bound plus what its inputs may differ by from the
// reference's); the store rounds to nearest (to fp32, then to bf16: each
// monotone), so the stored value lies in [rn(z - err), rn(z + err)].
// `value` = rn(z) is the reference's own store; dev() the most the
// kernel's can differ from it: 0 unless a rounding boundary lies within
// err of z, else one bf16 unit or so.
struct StoredBf16 {
  double value = 0, lo = 0, hi = 0;
  double dev() const { return std::max(value - lo, hi - value); }
  bool Holds(double got) const { return lo <= got && got <= hi; }
};
inline double RoundDoubleToBf16(double z) { return RoundToBf16(static_cast<float>(z)); }
inline StoredBf16 StoreBf16(double z, double err) {
  const double e = err * (1 + 1e-9) + 1e-15 * std::abs(z);  // and z - e, z + e's own double roundings
  return {RoundDoubleToBf16(z), RoundDoubleToBf16(z - e), RoundDoubleToBf16(z + e)};
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_TESTING_BF16_TESTING_H_
