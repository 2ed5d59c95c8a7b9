// Host-side helpers for the bf16 tests: random bf16 data, conversions with
// bf16.h's rounding, and bit patterns to compare bitwise.
#ifndef PLATEAU_KERNELS_TESTING_BF16_TESTING_H_
#define PLATEAU_KERNELS_TESTING_BF16_TESTING_H_

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

}  // namespace plateau

#endif  // PLATEAU_KERNELS_TESTING_BF16_TESTING_H_
