#include "kernels/optimizer/optimizer_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace plateau {

OptimizerBytes CpuOffloadAdamWBytes(int64_t shard_numel, int64_t owned_numel, const ElementBytes& e) {
  // Parameters (the dense master; the owned weights' staging copy in fp32,
  // their master in bf16), m, v in fp32, and the gradients as the device
  // holds them (in bf16 also the working copies going up).
  return {0, (3 * e.master + e.working) * (shard_numel + owned_numel)};
}

int64_t OffloadStreamBucket(int64_t shard_numel, int64_t owned_numel, int64_t bucket_params) {
  return std::max<int64_t>(1, std::min(bucket_params, std::max(shard_numel, owned_numel)));
}

OptimizerBytes OffloadStreamAdamWBytes(int64_t shard_numel, int64_t owned_numel, int64_t bucket_params,
                                       int64_t slots, const ElementBytes& e) {
  const int64_t bucket = OffloadStreamBucket(shard_numel, owned_numel, bucket_params);
  return {slots * 3 * bucket * e.master, DeviceAdamWBytes(shard_numel, owned_numel, e)};
}

absl::Status ValidateOffloadStream(int64_t bucket_params, int64_t staging_slots) {
  if (bucket_params < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "schedule.offload_stream_adamw.bucket_params: expected >= 1 parameters per bucket, got ", bucket_params));
  }
  if (staging_slots < 1 || staging_slots > 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "schedule.offload_stream_adamw.staging_slots: expected 1, 2 or 3, got ", staging_slots));
  }
  return absl::OkStatus();
}

}  // namespace plateau
