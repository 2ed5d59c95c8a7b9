#include "kernels/model/init.h"

#include <cmath>

namespace plateau {

uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t WeightKey(uint64_t seed, absl::string_view name) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a 64
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return Mix64(h ^ Mix64(seed));
}

double StandardNormal(uint64_t key, int64_t index) {
  const uint64_t i = static_cast<uint64_t>(index);
  // Uniforms in (0, 1]: never 0, so the log is finite.
  const double u1 = (static_cast<double>(Mix64(key + 2 * i) >> 11) + 1.0) * 0x1.0p-53;
  const double u2 = static_cast<double>(Mix64(key + 2 * i + 1) >> 11) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

}  // namespace plateau
