// The optimizer schedules' bounds, callable without a backend (the
// budget's part).
#ifndef PLATEAU_KERNELS_OPTIMIZER_OPTIMIZER_PLAN_H_
#define PLATEAU_KERNELS_OPTIMIZER_OPTIMIZER_PLAN_H_

#include <cstdint>

namespace plateau {

// Device bytes of the baseline: the dense shard's fp32 master, m and v [S],
// the owned weights' m and v [X] (they are their own master).
inline int64_t DeviceAdamWBytes(int64_t shard_numel, int64_t owned_numel) {
  return (3 * shard_numel + 2 * owned_numel) * static_cast<int64_t>(sizeof(float));
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_OPTIMIZER_OPTIMIZER_PLAN_H_
