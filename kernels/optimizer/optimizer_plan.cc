#include "kernels/optimizer/optimizer_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace plateau {

namespace {
constexpr int64_t kF = sizeof(float);
}  // namespace

OptimizerBytes CpuOffloadAdamWBytes(int64_t shard_numel, int64_t owned_numel) {
  return {0, 4 * (shard_numel + owned_numel) * kF};
}

int64_t OffloadStreamBucket(int64_t shard_numel, int64_t owned_numel, int64_t bucket_params) {
  return std::max<int64_t>(1, std::min(bucket_params, std::max(shard_numel, owned_numel)));
}

OptimizerBytes OffloadStreamAdamWBytes(int64_t shard_numel, int64_t owned_numel, int64_t bucket_params,
                                       int64_t slots) {
  const int64_t bucket = OffloadStreamBucket(shard_numel, owned_numel, bucket_params);
  return {slots * 3 * bucket * kF, DeviceAdamWBytes(shard_numel, owned_numel)};
}

std::vector<OptimizerBucket> OffloadStreamBuckets(int64_t shard_numel, int64_t owned_numel, int64_t bucket) {
  std::vector<OptimizerBucket> out;
  for (bool owned : {false, true}) {
    const int64_t n = owned ? owned_numel : shard_numel;
    for (int64_t off = 0; off < n; off += bucket) out.push_back({owned, off, std::min(bucket, n - off)});
  }
  return out;
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
