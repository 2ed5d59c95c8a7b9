// The options of the training step: the model, its layout over the ranks,
// the optimizer and the schedule chosen at each schedule point. Plain data,
// read by the step (kernels/step/step.h) and by the budget
// (kernels/budget/budget.h), which plans them without a backend.
#ifndef PLATEAU_KERNELS_MODEL_STEP_OPTIONS_H_
#define PLATEAU_KERNELS_MODEL_STEP_OPTIONS_H_

#include <cstdint>
#include <optional>

#include "kernels/model/config.h"

namespace plateau {

// Ring-DTP's circulation modes (kernels/projection/ring_dtp.h): the batch
// travels (activations) or the vocabulary shards do (weights). Here, with
// the options, so that the model's folder needs nothing from above it.
enum class RingDtpMode { kActivations, kWeights };

struct OptimizerConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  float max_grad_norm = 1.0f;  // 0 turns clipping off
};

// Which schedule computes the vocabulary projection and cross-entropy.
struct ProjectionOptions {
  enum class Kind { kDense, kRingDtp };
  Kind kind = Kind::kDense;
  // Ring-DTP (kernels/projection/ring_dtp.h): the circulation mode (unset:
  // RingDtp::ChooseMode picks the smaller traveller), the strip width S, the
  // token rows per strip tile, and the rows per activation-mode pass (0: the
  // whole batch in one pass).
  std::optional<RingDtpMode> mode;
  int64_t strip = 1024;
  int64_t row_tile = 2048;
  int64_t chunk_rows = 0;
};

// Where the layer boundaries wait for the backward's recomputation.
struct CheckpointOptions {
  enum class Kind {
    kFull,  // every boundary on the device (kernels/checkpoints/full_checkpoints.h)
    kSco    // the earliest boundaries in a capped host pool (kernels/checkpoints/sco.h)
  };
  Kind kind = Kind::kFull;
  // SCO: beta, the host bytes per rank the boundaries may take (the pool
  // holds as many whole boundaries as fit; kernels/checkpoints/checkpoints_plan.h).
  int64_t host_budget_bytes = 0;
};

// Where the optimizer state lives and how it is updated
// (kernels/optimizer/).
struct OptimizerPlacementOptions {
  enum class Kind {
    kDevice,        // master, m and v on the device (device_adamw.h)
    kCpuOffload,    // on the host, updated there (cpu_offload_adamw.h; the baseline)
    kOffloadStream  // on the host, streamed through device slots (offload_stream_adamw.h)
  };
  Kind kind = Kind::kDevice;
  // OffloadStreamAdamW: parameters per bucket, and staging slots (1 to 3).
  int64_t bucket_params = 100'000'000;
  int64_t staging_slots = 2;
};

struct StepOptions {
  ModelConfig model;
  LayoutConfig layout;
  OptimizerConfig optimizer;
  ProjectionOptions projection;
  CheckpointOptions checkpoints;
  OptimizerPlacementOptions optimizer_placement;
  uint64_t seed = 1;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_STEP_OPTIONS_H_
