// The dense peak FLOP/s of the GPUs we name, for MFU (issue 17): the step's
// model FLOPs per second on one device over that device's peak for the
// step's precision. A bf16 mixed-precision step is measured against the
// card's bf16 dense tensor-core peak (without structured sparsity), an fp32
// step against its fp32 (CUDA-core, non-tensor) peak: the fp32 step's GEMMs
// run in full fp32 (CUBLAS_DEFAULT_MATH, no TF32), so TF32's tensor-core
// rate is not its ceiling.
//
// Lookup is by the device name the CUDA runtime reports
// (cudaDeviceProp::name, e.g. "NVIDIA H100 80GB HBM3"); variants are told
// apart by name first (H100 PCIe / NVL before the SXM part, H200 NVL
// before H200), then by compute capability as a check. An unknown card has
// no entry: MFU is then 0 (unknown) unless the agent's --device_peak_flops /
// --device_peak_bf16_flops give the figure.
//
// Pure functions; thread-safe.
#ifndef PLATEAU_KERNELS_DEVICE_PEAKS_H_
#define PLATEAU_KERNELS_DEVICE_PEAKS_H_

#include <optional>
#include <string_view>

namespace plateau {

struct DevicePeak {
  const char* model;        // "H100 SXM"
  int cc_major, cc_minor;   // its compute capability
  double fp32_flops;        // FP32, CUDA cores
  double bf16_dense_flops;  // BF16 tensor cores, dense
};

// The entry for `device_name` at compute capability major.minor; nullopt
// when the name is not one we list or the capability contradicts it.
std::optional<DevicePeak> LookUpDevicePeak(std::string_view device_name, int cc_major, int cc_minor);

// The peak MFU is measured against: `override_flops` when > 0 (the agent's
// flag for this precision), else the table's figure for `bf16` (true: the
// bf16 dense peak; false: fp32), else 0 (unknown).
double MfuPeakFlops(double override_flops, std::string_view device_name, int cc_major, int cc_minor, bool bf16);

// model_flops / seconds / peak; 0 when either is not positive.
double Mfu(double model_flops_per_device, double seconds, double peak_flops);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_DEVICE_PEAKS_H_
