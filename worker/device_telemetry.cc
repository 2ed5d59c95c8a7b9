#include "worker/device_telemetry.h"

#include "kernels/device_peaks.h"

namespace plateau {

void SetDeviceTelemetry(const absl::StatusOr<DeviceView>& view, double model_flops, int ranks, double seconds,
                        bool bf16, const PeakOverrides& overrides, v1::StepTelemetry* t) {
  const double per_device = ranks > 0 ? model_flops / ranks : model_flops;
  t->set_tflops(seconds > 0 ? per_device / seconds / 1e12 : 0);
  const double override_flops = bf16 ? overrides.bf16_flops : overrides.fp32_flops;
  double peak = override_flops;
  if (view.ok()) {
    t->set_device_used_bytes(view->total_bytes - view->free_bytes);
    t->set_device_pool_reserved_bytes(view->pool_reserved_bytes);
    peak = MfuPeakFlops(override_flops, view->name, view->cc_major, view->cc_minor, bf16);
  }
  t->set_mfu(Mfu(per_device, seconds, peak));
}

}  // namespace plateau
