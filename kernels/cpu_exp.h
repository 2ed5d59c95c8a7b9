// A vectorised expf for the CPU kernels' hot loops (softmax, attention,
// SwiGLU's sigmoid, cross-entropy): Cephes' range reduction and degree-6
// polynomial, eight lanes at a time with AVX2/FMA (the build's baseline,
// -march=x86-64-v3), and a scalar twin that performs the same operations in
// the same order, so an element's result does not depend on whether it fell
// in a vector or in the tail (nor, therefore, on how work was split).
//
// Accuracy (kernels/cpu_exp_test.cc checks it against std::exp over
// [-104, 89], ~9.7M points): at most 1 ulp measured (the test allows 2)
// from the correctly rounded exp where the result is a normal float; for x below -87.33 (subnormal results) within
// 2^-149 * 2 absolute; exp(-inf) = 0, exp(x > 88.73) = inf, NaN stays NaN.
// std::exp (glibc) is correctly rounded in practice, so results differ from
// it by those ulps: fp32 rounding, within every test's tolerance.
#ifndef PLATEAU_KERNELS_CPU_EXP_H_
#define PLATEAU_KERNELS_CPU_EXP_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PLATEAU_EXP_AVX2 1
#endif

namespace plateau::cpu {
namespace exp_detail {
// Outside [kLo, kHi] the result is 0 or inf in float anyway; clamping keeps
// 2^n within the two-factor scaling below.
inline constexpr float kLo = -104.0f, kHi = 89.0f;
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kC1 = 0.693359375f, kC2 = -2.12194440e-4f;  // ln 2 = C1 + C2
inline constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f,
                       kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                       kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
}  // namespace exp_detail

// exp(x): the scalar twin of the vector lanes.
inline float Exp(float x) {
  using namespace exp_detail;
  x = kLo > x ? kLo : x;  // as MAXPS(kLo, x): a NaN x passes through
  x = kHi < x ? kHi : x;
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(-n, kC1, x);
  r = std::fma(-n, kC2, r);
  float p = kP0;
  p = std::fma(p, r, kP1);
  p = std::fma(p, r, kP2);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r, kP5);
  const float r2 = r * r;
  float y = std::fma(p, r2, r) + 1.0f;
  // 2^n as 2^n1 * 2^n2, both normal for n in [-151, 129].
  // A NaN x gives a NaN n: the vector lanes' conversion yields INT32_MIN
  // for it (x86's "integer indefinite"); spelled out here, since the C++
  // cast of a NaN is undefined. The exponent bits are built in unsigned
  // arithmetic (for a NaN they wrap; the NaN y carries the result anyway).
  const int32_t ni = std::isnan(n) ? INT32_MIN : static_cast<int32_t>(n);
  const int32_t n1 = ni >> 1, n2 = ni - n1;
  const uint32_t b1 = static_cast<uint32_t>(n1 + 127) << 23, b2 = static_cast<uint32_t>(n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, 4);
  std::memcpy(&s2, &b2, 4);
  return (y * s1) * s2;
}

#ifdef PLATEAU_EXP_AVX2
inline __m256 Exp8(__m256 x) {
  using namespace exp_detail;
  x = _mm256_max_ps(_mm256_set1_ps(kLo), x);
  x = _mm256_min_ps(_mm256_set1_ps(kHi), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kC1), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kC2), r);
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  const __m256 r2 = _mm256_mul_ps(r, r);
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1);
  const __m256i n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
}
#endif

// y[i] = exp(x[i] - shift) for i < n; returns the sum of the y[i] in float,
// accumulated in 8 interleaved lanes (lane j takes i = j mod 8, the tail
// after the last full group of 8 goes into lanes 0..) combined in a fixed
// tree: the same bits for the same n on any machine with this build. y may
// alias x.
inline float ExpShiftSum(const float* x, float shift, float* y, int64_t n) {
  int64_t i = 0;
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#ifdef PLATEAU_EXP_AVX2
  __m256 acc = _mm256_setzero_ps();
  const __m256 sh = _mm256_set1_ps(shift);
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh));
    _mm256_storeu_ps(y + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  _mm256_storeu_ps(lanes, acc);
#else
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) lanes[j] += (y[i + j] = Exp(x[i + j] - shift));
  }
#endif
  for (int j = 0; i < n; ++i, ++j) lanes[j] += (y[i] = Exp(x[i] - shift));
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) +
         ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

// The same sum without storing the exponentials.
inline float ExpShiftSumOnly(const float* x, float shift, int64_t n) {
  int64_t i = 0;
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#ifdef PLATEAU_EXP_AVX2
  __m256 acc = _mm256_setzero_ps();
  const __m256 sh = _mm256_set1_ps(shift);
  for (; i + 8 <= n; i += 8) {
    acc = _mm256_add_ps(acc, Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh)));
  }
  _mm256_storeu_ps(lanes, acc);
#else
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) lanes[j] += Exp(x[i + j] - shift);
  }
#endif
  for (int j = 0; i < n; ++i, ++j) lanes[j] += Exp(x[i] - shift);
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) +
         ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

// y[i] = exp(x[i] - shift) * scale (no sum). y may alias x.
inline void ExpShiftScale(const float* x, float shift, float scale, float* y, int64_t n) {
  int64_t i = 0;
#ifdef PLATEAU_EXP_AVX2
  const __m256 sh = _mm256_set1_ps(shift), sc = _mm256_set1_ps(scale);
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_mul_ps(Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh)), sc));
  }
#endif
  for (; i < n; ++i) y[i] = Exp(x[i] - shift) * scale;
}

// Row maximum (-inf for n == 0); exact, so lanes change nothing but speed.
inline float RowMax(const float* x, int64_t n) {
  float m = -INFINITY;
  int64_t i = 0;
#ifdef PLATEAU_EXP_AVX2
  if (n >= 8) {
    __m256 v = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
    float l[8];
    _mm256_storeu_ps(l, v);
    for (float e : l) m = e > m ? e : m;
  }
#endif
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

}  // namespace plateau::cpu

#endif  // PLATEAU_KERNELS_CPU_EXP_H_
