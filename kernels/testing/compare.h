// Comparing a computed tensor with a reference (usually computed in
// double): every element within `rel` times the reference's largest
// magnitude, so that values near zero are judged on the tensor's scale.
#ifndef PLATEAU_KERNELS_TESTING_COMPARE_H_
#define PLATEAU_KERNELS_TESTING_COMPARE_H_

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "gtest/gtest.h"

namespace plateau {

inline double MaxAbs(const std::vector<double>& v) {
  double m = 0;
  for (double e : v) m = std::max(m, std::abs(e));
  return m;
}

// `what` names the tensor in a failure, "[i]" is appended; `row` > 0 adds
// the row of element i (i / row) to it.
template <typename G>
void ExpectNearRelMax(const G& got, const std::vector<double>& want, double rel, const std::string& what,
                      size_t row = 0) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const double tol = rel * MaxAbs(want) + 1e-12;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tol) << what << "[" << i << "]"
                                      << (row > 0 ? " (row " + std::to_string(i / row) + ")" : "");
  }
}

// Bit-for-bit equality, for what the design holds bitwise: == would take
// -0 for +0 (and fail on two identical NaNs).
template <typename T>
bool SameBits(const T& a, const T& b) {
  static_assert(std::is_arithmetic_v<T>);
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}
template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  static_assert(std::is_arithmetic_v<T>);
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}
template <typename T>
bool SameBits(const std::vector<std::vector<T>>& a, const std::vector<std::vector<T>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!SameBits(a[i], b[i])) return false;
  }
  return true;
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_TESTING_COMPARE_H_
