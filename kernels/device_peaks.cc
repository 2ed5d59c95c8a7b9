#include "kernels/device_peaks.h"

namespace plateau {
namespace {

struct Entry {
  std::string_view match;  // a substring of cudaDeviceProp::name
  DevicePeak peak;
};

constexpr double T = 1e12;

// First match wins: the more specific names come first. Figures are the
// vendor's datasheets, dense (the datasheets' BF16 figures "with sparsity"
// are twice these):
// - H100 SXM / PCIe / NVL: NVIDIA H100 Tensor Core GPU datasheet (2023):
//   FP32 67 / 51 / 60 TFLOPS; BF16 1,979 / 1,513 / 1,671 TFLOPS with
//   sparsity, so 989.4 / 756.5 / 835.5 dense.
// - H200 SXM / NVL: NVIDIA H200 Tensor Core GPU datasheet (2024): FP32 67 /
//   60 TFLOPS; BF16 1,979 / 1,671 with sparsity, so 989.4 / 835.5 dense.
// - A100 (SXM and PCIe, 40 and 80 GB): NVIDIA A100 datasheet: FP32 19.5
//   TFLOPS; BF16 312 dense (624 with sparsity).
// - L40S: NVIDIA L40S datasheet: FP32 91.6 TFLOPS; BF16 362.05 dense (733
//   with sparsity).
// - L4: NVIDIA L4 datasheet: FP32 30.3 TFLOPS; BF16 121 dense (242 with
//   sparsity).
// - A10: NVIDIA A10 datasheet: FP32 31.2 TFLOPS; BF16 125 dense (250 with
//   sparsity).
constexpr Entry kTable[] = {
    {"H200 NVL", {"H200 NVL", 9, 0, 60 * T, 835.5 * T}},
    {"H200", {"H200 SXM", 9, 0, 67 * T, 989.4 * T}},
    {"H100 PCIe", {"H100 PCIe", 9, 0, 51 * T, 756.5 * T}},
    {"H100 NVL", {"H100 NVL", 9, 0, 60 * T, 835.5 * T}},
    {"H100", {"H100 SXM", 9, 0, 67 * T, 989.4 * T}},  // "NVIDIA H100 80GB HBM3"
    {"A100", {"A100", 8, 0, 19.5 * T, 312 * T}},
    {"L40S", {"L40S", 8, 9, 91.6 * T, 362.05 * T}},
    {"L4", {"L4", 8, 9, 30.3 * T, 121 * T}},
    {"A10", {"A10", 8, 6, 31.2 * T, 125 * T}},
};

// `name` contains `word` as a whole word: "L4" must not match "L40S", nor
// "A10" "A100".
bool ContainsWord(std::string_view name, std::string_view word) {
  for (size_t at = name.find(word); at != std::string_view::npos; at = name.find(word, at + 1)) {
    const size_t end = at + word.size();
    const bool left = at == 0 || name[at - 1] == ' ' || name[at - 1] == '-';
    const bool right = end == name.size() || name[end] == ' ' || name[end] == '-';
    if (left && right) return true;
  }
  return false;
}

}  // namespace

std::optional<DevicePeak> LookUpDevicePeak(std::string_view device_name, int cc_major, int cc_minor) {
  for (const Entry& e : kTable) {
    if (!ContainsWord(device_name, e.match)) continue;
    if (e.peak.cc_major != cc_major || e.peak.cc_minor != cc_minor) return std::nullopt;
    return e.peak;
  }
  return std::nullopt;
}

double MfuPeakFlops(double override_flops, std::string_view device_name, int cc_major, int cc_minor, bool bf16) {
  if (override_flops > 0) return override_flops;
  std::optional<DevicePeak> p = LookUpDevicePeak(device_name, cc_major, cc_minor);
  if (!p.has_value()) return 0;
  return bf16 ? p->bf16_dense_flops : p->fp32_flops;
}

double Mfu(double model_flops_per_device, double seconds, double peak_flops) {
  if (model_flops_per_device <= 0 || seconds <= 0 || peak_flops <= 0) return 0;
  return model_flops_per_device / seconds / peak_flops;
}

}  // namespace plateau
