// The optimizer schedules' bounds, callable without a backend (the
// budget's part). Each schedule allocates exactly these bytes.
//
// Notation: S = this rank's dense ZeRO shard, X = its owned parameters
// (kernels/model/params.h), both in values. Master weights and moments are
// fp32 (e.master) in either precision; each schedule allocates these bytes
// for its working type (OffloadStreamAdamW passes its element sizes to
// OffloadStreamAdamWBytes), as the budget plans them for the step's
// precision.
#ifndef PLATEAU_KERNELS_OPTIMIZER_OPTIMIZER_PLAN_H_
#define PLATEAU_KERNELS_OPTIMIZER_OPTIMIZER_PLAN_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/model/precision.h"

namespace plateau {

// Device bytes of the baseline: the dense shard's fp32 master, m and v [S],
// the owned weights' m and v [X]; in fp32 the owned weights are their own
// master, in bf16 mixed they need an fp32 master [X] too.
inline int64_t DeviceAdamWBytes(int64_t shard_numel, int64_t owned_numel,
                                const ElementBytes& e = kFp32Elements) {
  const int64_t owned_states = e.working_is_master() ? 2 : 3;
  return (3 * shard_numel + owned_states * owned_numel) * e.master;
}

// Bytes of an optimizer placement in each space (kOptimizer).
struct OptimizerBytes {
  int64_t device = 0;
  int64_t host = 0;
};

// The CPU-offload baseline: nothing on the device; on the host the
// parameters [S + X] (the dense master, and for the owned weights in fp32 a
// staging copy, since they stay authoritative on the device, in bf16 mixed
// their fp32 master), m and v [S + X] and the gradients copied down
// [S + X] (in the working precision; in bf16 the same buffer carries the
// working copies rn(master) back up).
OptimizerBytes CpuOffloadAdamWBytes(int64_t shard_numel, int64_t owned_numel,
                                    const ElementBytes& e = kFp32Elements);

// OffloadStreamAdamW: master, m and v on the host as in the device
// baseline (DeviceAdamWBytes); on the device `slots` staging slots of
// master + m + v for one bucket each. The bucket is
// min(bucket_params, max(S, X)) values: never larger than the larger group.
int64_t OffloadStreamBucket(int64_t shard_numel, int64_t owned_numel, int64_t bucket_params);
OptimizerBytes OffloadStreamAdamWBytes(int64_t shard_numel, int64_t owned_numel, int64_t bucket_params,
                                       int64_t slots, const ElementBytes& e = kFp32Elements);

// The buckets of one update, in order: the dense shard [0, S) in pieces of
// at most `bucket` values, then the owned vector [0, X). A bucket never
// spans both groups (the dense one has a separate master; the owned one is
// its own master on the device).
struct OptimizerBucket {
  bool owned = false;  // false: dense shard
  int64_t offset = 0;  // into the group
  int64_t numel = 0;
};
// Worked out per index, not listed: a list was a host vector of
// ceil(S / bucket) + ceil(X / bucket) entries made at every update, in no
// host plan (a hand-set bucket of 1 made it S + X entries).
class OffloadStreamBuckets {
 public:
  OffloadStreamBuckets(int64_t shard_numel, int64_t owned_numel, int64_t bucket)
      : shard_numel_(shard_numel),
        owned_numel_(owned_numel),
        bucket_(bucket),
        dense_(Ceil(shard_numel, bucket)),
        owned_(Ceil(owned_numel, bucket)) {}
  int64_t size() const { return dense_ + owned_; }
  OptimizerBucket operator[](int64_t i) const {
    const bool owned = i >= dense_;
    const int64_t offset = (owned ? i - dense_ : i) * bucket_, n = owned ? owned_numel_ : shard_numel_;
    return {owned, offset, std::min(bucket_, n - offset)};
  }

 private:
  static int64_t Ceil(int64_t n, int64_t d) { return (n + d - 1) / d; }
  int64_t shard_numel_, owned_numel_, bucket_, dense_, owned_;
};

// INVALID_ARGUMENT naming schedule.offload_stream_adamw.bucket_params
// (>= 1) or .staging_slots (1 to 3).
absl::Status ValidateOffloadStream(int64_t bucket_params, int64_t staging_slots);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_OPTIMIZER_OPTIMIZER_PLAN_H_
