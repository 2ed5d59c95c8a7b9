// The CPU-offload baseline for OffloadStreamAdamW (ZeRO-Offload /
// DeepSpeed's CPU Adam): the master weights and both moments live on the
// host, and each update copies the gradients down, runs AdamW on the host's
// cores (the same fp32 kernel as the CPU backend's, over chunks on
// std::threads), and copies the weights back up: the working dense region
// (then all-gathered) and the owned weights. Nothing on the device
// (CpuOffloadAdamWBytes). Host synchronisation is in its nature: the host
// cannot start before the gradients have landed.
//
// Thread safety: one per rank (OptimizerUpdate).
#ifndef PLATEAU_KERNELS_OPTIMIZER_CPU_OFFLOAD_ADAMW_H_
#define PLATEAU_KERNELS_OPTIMIZER_CPU_OFFLOAD_ADAMW_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/memory.h"
#include "kernels/model/step_options.h"
#include "kernels/optimizer/optimizer_update.h"

namespace plateau {

class CpuOffloadAdamW final : public OptimizerUpdate {
 public:
  // `threads` host threads run the update (0: the machine's hardware threads).
  static absl::StatusOr<std::unique_ptr<CpuOffloadAdamW>> Create(const OptimizerConfig& config,
                                                                 const OptimizerParams& params, Backend& backend,
                                                                 Communicator& world, Stream& stream,
                                                                 int threads = 0);

  absl::Status Load(const OptimizerShardState& state) override;
  absl::StatusOr<OptimizerShardState> Save() override;
  absl::Status Update(float clip, int64_t step) override;

 private:
  CpuOffloadAdamW(const OptimizerConfig& config, const OptimizerParams& params, Backend& backend,
                  Communicator& world, Stream& stream, int threads)
      : config_(config), params_(params), backend_(backend), world_(world), stream_(stream), threads_(threads) {}
  absl::Status Refresh();  // host master -> working weights, all-gathered

  const OptimizerConfig config_;
  const OptimizerParams params_;
  Backend& backend_;
  Communicator& world_;
  Stream& stream_;
  const int threads_;
  // Host, [S + X] each: the parameters (dense master | owned staging), the
  // moments, the gradients.
  Buffer param_, m_, v_, grad_;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_OPTIMIZER_CPU_OFFLOAD_ADAMW_H_
