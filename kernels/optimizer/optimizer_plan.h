// The optimizer schedules' bounds, callable without a backend (the
// budget's part). Each schedule allocates exactly these bytes.
//
// Notation: S = this rank's dense ZeRO shard, X = its owned parameters
// (kernels/model/params.h), both in fp32 values.
#ifndef PLATEAU_KERNELS_OPTIMIZER_OPTIMIZER_PLAN_H_
#define PLATEAU_KERNELS_OPTIMIZER_OPTIMIZER_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace plateau {

// Device bytes of the baseline: the dense shard's fp32 master, m and v [S],
// the owned weights' m and v [X] (they are their own master).
inline int64_t DeviceAdamWBytes(int64_t shard_numel, int64_t owned_numel) {
  return (3 * shard_numel + 2 * owned_numel) * static_cast<int64_t>(sizeof(float));
}

// Bytes of an optimizer placement in each space (kOptimizer).
struct OptimizerBytes {
  int64_t device = 0;
  int64_t host = 0;
};

// The CPU-offload baseline: nothing on the device; on the host the
// parameters [S + X] (the dense master, and a staging copy of the owned
// weights, which stay authoritative on the device), m and v [S + X] and the
// gradients copied down [S + X].
OptimizerBytes CpuOffloadAdamWBytes(int64_t shard_numel, int64_t owned_numel);

// OffloadStreamAdamW: master, m and v on the host as in the device
// baseline, 3S + 2X floats; on the device `slots` staging slots of
// master + m + v for one bucket each. The bucket is
// min(bucket_params, max(S, X)) values: never larger than the larger group.
int64_t OffloadStreamBucket(int64_t shard_numel, int64_t owned_numel, int64_t bucket_params);
OptimizerBytes OffloadStreamAdamWBytes(int64_t shard_numel, int64_t owned_numel, int64_t bucket_params,
                                       int64_t slots);

// The buckets of one update, in order: the dense shard [0, S) in pieces of
// at most `bucket` values, then the owned vector [0, X). A bucket never
// spans both groups (the dense one has a separate master; the owned one is
// its own master on the device).
struct OptimizerBucket {
  bool owned = false;  // false: dense shard
  int64_t offset = 0;  // into the group
  int64_t numel = 0;
};
std::vector<OptimizerBucket> OffloadStreamBuckets(int64_t shard_numel, int64_t owned_numel, int64_t bucket);

// INVALID_ARGUMENT naming schedule.offload_stream_adamw.bucket_params
// (>= 1) or .staging_slots (1 to 3).
absl::Status ValidateOffloadStream(int64_t bucket_params, int64_t staging_slots);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_OPTIMIZER_OPTIMIZER_PLAN_H_
