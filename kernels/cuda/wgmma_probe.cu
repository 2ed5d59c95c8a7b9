// The wgmma probe's launcher; the kernel is wgmma_probe_kernels.inc (shared
// with the emulated test). See wgmma_probe.h.
#include "kernels/cuda/wgmma_probe.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/cp_async.h"
#include "kernels/cuda/cuda_device_utils.cuh"
#include "kernels/cuda/mma_layout.h"
#include "kernels/cuda/wgmma_instructions.h"
#include "kernels/cuda/wgmma_layout.h"

namespace plateau::cuda_wgmma {
namespace {

#include "kernels/cuda/wgmma_probe_kernels.inc"

template <bool kASmem, int kBLayout>
cudaError_t Launch(cudaStream_t stream, const uint16_t* a, const uint16_t* b, const uint16_t* bt,
                   float* d) {
  PLATEAU_KERNEL_LAUNCH(1, wgmma::kThreads, kProbeSmem, stream,
                        WgmmaProbeKernel<kASmem, kBLayout>)(
      reinterpret_cast<const Bf16*>(a), reinterpret_cast<const Bf16*>(b),
      reinterpret_cast<const Bf16*>(bt), d);
  return cudaGetLastError();
}

}  // namespace

cudaError_t WgmmaProbe(cudaStream_t stream, bool a_in_smem, int b_layout, const uint16_t* a,
                       const uint16_t* b, const uint16_t* bt, float* d) {
  switch (b_layout) {
    case kProbeBKMajor:
      return a_in_smem ? Launch<true, kProbeBKMajor>(stream, a, b, bt, d)
                       : Launch<false, kProbeBKMajor>(stream, a, b, bt, d);
    case kProbeBMnMajor:
      return a_in_smem ? Launch<true, kProbeBMnMajor>(stream, a, b, bt, d)
                       : Launch<false, kProbeBMnMajor>(stream, a, b, bt, d);
    case kProbeBMnKFastest:
      return a_in_smem ? Launch<true, kProbeBMnKFastest>(stream, a, b, bt, d)
                       : Launch<false, kProbeBMnKFastest>(stream, a, b, bt, d);
    default:
      return cudaErrorInvalidValue;
  }
}

namespace {
const char* BLayoutName(int b_layout) {
  return b_layout == kProbeBKMajor    ? "K-major"
         : b_layout == kProbeBMnMajor ? "MN-major"
                                      : "MN-major, core matrices k-fastest";
}
}  // namespace

cudaError_t WgmmaProbeCheck(bool* agrees, std::string* why) {
  *agrees = false;
  constexpr int kK = kProbeK;
  // Fixed values: small integers times powers of two, exact in bf16, an
  // LCG over every element (any misplaced element changes sums).
  std::vector<uint16_t> a(64 * kK), b(kK * 64), bt(64 * kK);
  uint32_t x = 12345;
  auto next = [&x] {
    x = x * 1664525u + 1013904223u;
    const float v = static_cast<float>(static_cast<int>(x >> 27) - 16) * 0.125f;  // -2 .. 1.875
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    return static_cast<uint16_t>(bits >> 16);  // exact: 5 significant bits
  };
  for (uint16_t& e : a) e = next();
  for (int k = 0; k < kK; ++k) {
    for (int n = 0; n < 64; ++n) bt[n * kK + k] = b[k * 64 + n] = next();
  }
  auto value = [](uint16_t bits) {
    const uint32_t u = uint32_t{bits} << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return static_cast<double>(f);
  };
  uint16_t *da = nullptr, *db = nullptr, *dbt = nullptr;
  float* dd = nullptr;
  cudaError_t e = cudaMalloc(&da, a.size() * 2);
  if (e == cudaSuccess) e = cudaMalloc(&db, b.size() * 2);
  if (e == cudaSuccess) e = cudaMalloc(&dbt, bt.size() * 2);
  if (e == cudaSuccess) e = cudaMalloc(&dd, 64 * 64 * 4);
  if (e == cudaSuccess) e = cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
  if (e == cudaSuccess) e = cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
  if (e == cudaSuccess) e = cudaMemcpy(dbt, bt.data(), bt.size() * 2, cudaMemcpyHostToDevice);
  std::vector<float> d(64 * 64);
  bool all = e == cudaSuccess;
  for (int layout = 0; all && layout < 2 * kProbeBLayouts; ++layout) {
    const bool a_smem = layout % 2;
    const int b_layout = layout / 2;
    e = cudaMemset(dd, 0xFF, d.size() * 4);  // NaN: an element never written shows
    if (e == cudaSuccess) e = WgmmaProbe(nullptr, a_smem, b_layout, da, db, dbt, dd);
    if (e == cudaSuccess) e = cudaMemcpy(d.data(), dd, d.size() * 4, cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
      all = false;
      break;
    }
    for (int i = 0; i < 64 * 64 && all; ++i) {
      double ref = 0.0;
      for (int k = 0; k < kK; ++k) ref += value(a[i / 64 * kK + k]) * value(b[k * 64 + i % 64]);
      if (!(std::fabs(d[i] - ref) <= 1e-5 * (1.0 + std::fabs(ref)))) {
        all = false;
        *why = std::string("wgmma probe (A ") + (a_smem ? "shared" : "registers") + ", B " +
               BLayoutName(b_layout) + "): D[" + std::to_string(i / 64) + "][" +
               std::to_string(i % 64) + "] = " + std::to_string(d[i]) + ", expected " +
               std::to_string(ref);
      }
    }
  }
  cudaFree(da);
  cudaFree(db);
  cudaFree(dbt);
  cudaFree(dd);
  if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction) {
    // Not a fault: this device runs no sm_90a code. Cleared, and reported as
    // a disagreement (the caller keeps mma.sync).
    (void)cudaGetLastError();
    *why = std::string("the probe did not launch: ") + cudaGetErrorString(e);
    return cudaSuccess;
  }
  if (e != cudaSuccess) return e;
  *agrees = all;
  return cudaSuccess;
}

}  // namespace plateau::cuda_wgmma
