// The checkpoint schedules' bounds, callable without a backend (the
// budget's part).
#ifndef PLATEAU_KERNELS_CHECKPOINTS_CHECKPOINTS_PLAN_H_
#define PLATEAU_KERNELS_CHECKPOINTS_CHECKPOINTS_PLAN_H_

#include <cstdint>

namespace plateau {

// Device bytes of the baseline: the L + 1 boundaries [N, H] in fp32.
inline int64_t FullCheckpointsBytes(int64_t layers, int64_t rows, int64_t hidden) {
  return (layers + 1) * rows * hidden * static_cast<int64_t>(sizeof(float));
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_CHECKPOINTS_CHECKPOINTS_PLAN_H_
