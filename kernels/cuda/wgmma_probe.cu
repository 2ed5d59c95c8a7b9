// The wgmma probe's launcher; the kernel is wgmma_probe_kernels.inc (shared
// with the emulated test). See wgmma_probe.h.
#include "kernels/cuda/wgmma_probe.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "kernels/cuda/cp_async.h"
#include "kernels/cuda/cuda_device_utils.cuh"
#include "kernels/cuda/mma_layout.h"
#include "kernels/cuda/wgmma_instructions.h"
#include "kernels/cuda/wgmma_layout.h"

namespace plateau::cuda_wgmma {
namespace {

#include "kernels/cuda/wgmma_probe_kernels.inc"

template <bool kASmem, bool kBMnMajor>
cudaError_t Launch(cudaStream_t stream, const uint16_t* a, const uint16_t* b, const uint16_t* bt,
                   float* d) {
  PLATEAU_KERNEL_LAUNCH(1, wgmma::kThreads, kProbeSmem, stream,
                        WgmmaProbeKernel<kASmem, kBMnMajor>)(
      reinterpret_cast<const Bf16*>(a), reinterpret_cast<const Bf16*>(b),
      reinterpret_cast<const Bf16*>(bt), d);
  return cudaGetLastError();
}

}  // namespace

cudaError_t WgmmaProbe(cudaStream_t stream, bool a_in_smem, bool b_mn_major, const uint16_t* a,
                       const uint16_t* b, const uint16_t* bt, float* d) {
  if (a_in_smem) {
    return b_mn_major ? Launch<true, true>(stream, a, b, bt, d)
                      : Launch<true, false>(stream, a, b, bt, d);
  }
  return b_mn_major ? Launch<false, true>(stream, a, b, bt, d)
                    : Launch<false, false>(stream, a, b, bt, d);
}

}  // namespace plateau::cuda_wgmma
