// The optimizer baseline: ZeRO-sharded AdamW with all its state on the
// device. Each rank keeps the fp32 master of its dense shard and the AdamW
// moments of the shard and of its owned weights (experts; lm_head shard
// under Ring-DTP) (DeviceAdamWBytes in the
// kOptimizer live set, allocated at launch: 16 bytes per parameter with the
// weights and gradients, the persistent term OffloadStreamAdamW cuts); an
// update runs AdamW on the shard and the owned weights, then all-gathers the
// masters into the working weights.
//
// Thread safety: one per rank (OptimizerUpdate).
#ifndef PLATEAU_KERNELS_OPTIMIZER_DEVICE_ADAMW_H_
#define PLATEAU_KERNELS_OPTIMIZER_DEVICE_ADAMW_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/memory.h"
#include "kernels/model/step_options.h"
#include "kernels/optimizer/optimizer_plan.h"
#include "kernels/optimizer/optimizer_update.h"

namespace plateau {

class DeviceAdamW final : public OptimizerUpdate {
 public:
  // Work runs on `stream` (the step's communication stream, after the
  // gradients' reduce-scatter); `world` all-gathers the masters.
  static absl::StatusOr<std::unique_ptr<DeviceAdamW>> Create(const OptimizerConfig& config,
                                                             const OptimizerParams& params, Backend& backend,
                                                             Communicator& world, Stream& stream);

  absl::Status Load(const OptimizerShardState& state) override;
  absl::StatusOr<OptimizerShardState> Save() override;
  absl::Status Update(float clip, int64_t step) override;

 private:
  DeviceAdamW(const OptimizerConfig& config, const OptimizerParams& params, Backend& backend,
              Communicator& world, Stream& stream)
      : config_(config), params_(params), backend_(backend), world_(world), stream_(stream) {}
  absl::Status Refresh();

  const OptimizerConfig config_;
  const OptimizerParams params_;
  Backend& backend_;
  Communicator& world_;
  Stream& stream_;
  Buffer master_, m_, v_, owned_m_, owned_v_;  // kOptimizer
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_OPTIMIZER_DEVICE_ADAMW_H_
