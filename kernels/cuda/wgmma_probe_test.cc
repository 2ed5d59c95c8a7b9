// The wgmma probe (wgmma_probe.h) on a GPU of compute capability 9.0 (H100,
// H200): every operand layout against a double reference. It checks the
// reading of the PTX ISA that wgmma_layout.h and the SIMT emulation share
// (wgmma_emulated_test runs the same kernel there) against the hardware.
// Under --config=cuda_emulated it runs on the emulation. Built only with
// --config=cuda or cuda_emulated (tools/test, tools/device-check); skips,
// saying why, with no GPU or another GPU, and device-check counts a skip on
// its H200 as a failure.
#include "kernels/cuda/wgmma_probe.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace plateau::cuda_wgmma {
namespace {

uint16_t ToBf16(float x) {  // round to nearest even (finite x)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
double FromBf16(uint16_t b) {
  const uint32_t u = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#define ASSERT_CUDA(call) \
  ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(call)

TEST(WgmmaProbeTest, MatchesTheReferenceInEveryOperandLayout) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no GPU here";
  cudaDeviceProp prop;
  ASSERT_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9 || prop.minor != 0) {
    GTEST_SKIP() << "wgmma needs compute capability 9.0 (sm_90a code); this GPU is " << prop.major
                 << "." << prop.minor;
  }
  constexpr int kK = 32;
  std::mt19937 rng(2026);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  uint16_t *a, *b, *bt;
  float* d;
  ASSERT_CUDA(cudaMalloc(&a, 64 * kK * 2));
  ASSERT_CUDA(cudaMalloc(&b, 64 * kK * 2));
  ASSERT_CUDA(cudaMalloc(&bt, 64 * kK * 2));
  ASSERT_CUDA(cudaMalloc(&d, 64 * 64 * 4));
  for (bool a_smem : {false, true}) {
    for (int b_layout = 0; b_layout < kProbeBLayouts; ++b_layout) {
      SCOPED_TRACE(std::string(a_smem ? "A shared" : "A registers") + ", B layout " +
                   std::to_string(b_layout));
      // Fresh data per layout; D poisoned with NaN (0xFF bytes).
      std::vector<uint16_t> ha(64 * kK), hb(kK * 64), hbt(64 * kK);
      for (uint16_t& x : ha) x = ToBf16(u(rng));
      for (int k = 0; k < kK; ++k) {
        for (int n = 0; n < 64; ++n) hbt[n * kK + k] = hb[k * 64 + n] = ToBf16(u(rng));
      }
      ASSERT_CUDA(cudaMemcpy(a, ha.data(), ha.size() * 2, cudaMemcpyHostToDevice));
      ASSERT_CUDA(cudaMemcpy(b, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice));
      ASSERT_CUDA(cudaMemcpy(bt, hbt.data(), hbt.size() * 2, cudaMemcpyHostToDevice));
      ASSERT_CUDA(cudaMemset(d, 0xFF, 64 * 64 * 4));
      ASSERT_CUDA(WgmmaProbe(nullptr, a_smem, b_layout, a, b, bt, d));
      ASSERT_CUDA(cudaDeviceSynchronize());
      std::vector<float> hd(64 * 64);
      ASSERT_CUDA(cudaMemcpy(hd.data(), d, hd.size() * 4, cudaMemcpyDeviceToHost));
      int wrong = 0;
      for (int m = 0; m < 64; ++m) {
        for (int n = 0; n < 64; ++n) {
          double ref = 0.0;
          for (int k = 0; k < kK; ++k) ref += FromBf16(ha[m * kK + k]) * FromBf16(hb[k * 64 + n]);
          // Exact bf16 products summed in fp32 inside the tensor cores.
          if (!(std::fabs(hd[m * 64 + n] - ref) <= 1e-5 * (1.0 + std::fabs(ref))) && wrong++ < 5) {
            ADD_FAILURE() << "D[" << m << "][" << n << "] = " << hd[m * 64 + n] << ", expected "
                          << ref;
          }
        }
      }
      EXPECT_EQ(wrong, 0) << "elements wrong of 4096";
    }
  }
  cudaFree(a);
  cudaFree(b);
  cudaFree(bt);
  cudaFree(d);
}

}  // namespace
}  // namespace plateau::cuda_wgmma
