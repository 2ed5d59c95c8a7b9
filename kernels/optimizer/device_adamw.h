// The optimizer baseline: ZeRO-sharded AdamW with all its state on the
// device. Each rank keeps the fp32 master of its dense shard and the AdamW
// moments of the shard and of its owned weights (experts; lm_head shard
// under Ring-DTP) (DeviceAdamWBytes in the
// kOptimizer live set, allocated at launch: 16 bytes per parameter with the
// weights and gradients, the persistent term OffloadStreamAdamW cuts); an
// update runs AdamW on the shard and the owned weights, then all-gathers the
// masters into the working weights.
//
// Precision (W): fp32 (DeviceAdamW), or bf16 mixed (DeviceAdamWT<Bf16>):
// the owned weights then get an fp32 master [X] too (DeviceAdamWBytes with
// kBf16MixedElements), AdamW steps the fp32 masters with the bf16
// gradients loaded exactly and writes the working copies rn(master) in the
// same pass (Backend::AdamWBf16: the dense shard's into this rank's block of
// the working dense weights), and the all-gather moves bf16 in place.
//
// Thread safety: one per rank (OptimizerUpdate).
#ifndef PLATEAU_KERNELS_OPTIMIZER_DEVICE_ADAMW_H_
#define PLATEAU_KERNELS_OPTIMIZER_DEVICE_ADAMW_H_

#include <memory>
#include <type_traits>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/communicator.h"
#include "kernels/memory.h"
#include "kernels/model/step_options.h"
#include "kernels/optimizer/optimizer_plan.h"
#include "kernels/optimizer/optimizer_update.h"

namespace plateau {

template <typename W>
class DeviceAdamWT final : public OptimizerUpdate {
 public:
  // Work runs on `stream` (the step's communication stream, after the
  // gradients' reduce-scatter); `world` all-gathers the masters.
  static absl::StatusOr<std::unique_ptr<DeviceAdamWT>> Create(const OptimizerConfig& config,
                                                              const OptimizerParamsT<W>& params,
                                                              Backend& backend, Communicator& world,
                                                              Stream& stream);

  // Under bf16 the state's owned_master [X] is required.
  absl::Status Load(const OptimizerShardState& state) override;
  absl::StatusOr<OptimizerShardState> Save() override;
  absl::Status Update(float clip, int64_t step) override;

 private:
  static constexpr bool kSeparateOwnedMaster = !std::is_same_v<W, float>;
  DeviceAdamWT(const OptimizerConfig& config, const OptimizerParamsT<W>& params, Backend& backend,
               Communicator& world, Stream& stream)
      : config_(config), params_(params), backend_(backend), world_(world), stream_(stream) {}
  // This rank's block of the working dense weights.
  W* OwnBlock() const { return params_.dense_working + world_.rank() * params_.shard_numel; }
  absl::Status Refresh();

  const OptimizerConfig config_;
  const OptimizerParamsT<W> params_;
  Backend& backend_;
  Communicator& world_;
  Stream& stream_;
  Buffer master_, m_, v_, owned_m_, owned_v_;  // kOptimizer
  Buffer owned_master_;                        // kOptimizer, bf16 mixed only
};

using DeviceAdamW = DeviceAdamWT<float>;

}  // namespace plateau

#endif  // PLATEAU_KERNELS_OPTIMIZER_DEVICE_ADAMW_H_
