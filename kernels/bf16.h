// bf16 storage for the CPU emulation of bf16 mixed precision (issue 17):
// the upper 16 bits of an IEEE fp32 (1 sign, 8 exponent, 7 stored mantissa
// bits), rounded on every store exactly as CUDA's __float2bfloat16_rn does
// (round to nearest, ties to even; every NaN becomes the canonical 0x7FFF;
// subnormals kept, never flushed; overflow rounds to +-inf as IEEE does). A
// load is exact (a bf16 is an fp32 with 16 zero low bits), so arithmetic on
// loaded values is fp32 arithmetic: the kernels that store bf16 compute and
// accumulate in fp32 and round once per stored element, the contract of
// cuBLASLt's bf16 GEMM with CUBLAS_COMPUTE_32F and of the CUDA twins.
//
// The relative error of one rounding is at most 2^-8 (~3.9e-3): bf16 keeps 8
// significant bits, so a unit in the last place is 2^-7 of the leading bit's
// weight and half of it at most 2^-8 of the value (the tests bound each op
// with it).
//
// Thread safety: value type and pure functions.
#ifndef PLATEAU_KERNELS_BF16_H_
#define PLATEAU_KERNELS_BF16_H_

#include <cstdint>
#include <cstring>

namespace plateau {

// Layout-compatible with CUDA's __nv_bfloat16 (2 bytes, same bits), so a
// buffer of Bf16 is handed to cuBLAS and the CUDA kernels as it is.
struct Bf16 {
  uint16_t bits = 0;
};
static_assert(sizeof(Bf16) == 2, "Bf16 must be 2 bytes (the budget's kBf16MixedElements.working)");

// The unit roundoff u = 2^-8: one rounding's relative error is at most u
// (normal range; below it the absolute error is at most 2^-134).
inline constexpr double kBf16UnitRoundoff = 1.0 / 256.0;

inline Bf16 FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  // NaN: CUDA's canonical quiet NaN (a plain truncation could turn a NaN
  // whose payload sits in the low bits into an infinity).
  if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{0x7fff};
  // Round to nearest even on the dropped 16 bits: add just under half
  // (0x7fff) plus the kept part's lowest bit, so an exact half rounds up
  // only when that makes the result even. A carry out of the mantissa bumps
  // the exponent, which is the correct rounding (up to inf at the top).
  u += 0x7fffu + ((u >> 16) & 1u);
  return Bf16{static_cast<uint16_t>(u >> 16)};
}

inline float Bf16ToFloat(Bf16 b) {
  const uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// The fp32 value a bf16 store of f reads back as.
inline float RoundToBf16(float f) { return Bf16ToFloat(FloatToBf16(f)); }

}  // namespace plateau

#endif  // PLATEAU_KERNELS_BF16_H_
