// The CPU-offload baseline for OffloadStreamAdamW (ZeRO-Offload /
// DeepSpeed's CPU Adam): the master weights and both moments live on the
// host, and each update copies the gradients down, runs AdamW on the host's
// cores (the same fp32 kernel as the CPU backend's, over chunks on
// std::threads), and copies the weights back up: the working dense region
// (then all-gathered) and the owned weights. Nothing on the device
// (CpuOffloadAdamWBytes). Host synchronisation is in its nature: the host
// cannot start before the gradients have landed.
//
// Precision (W): fp32 (CpuOffloadAdamW): the owned weights are their own
// master, authoritative on the device, and come down with the gradients
// into a host staging copy. bf16 mixed (CpuOffloadAdamWT<Bf16>, issue 17):
// the owned weights' fp32 master lives on the host beside the dense one (as
// OffloadStreamAdamWT<Bf16> keeps it), the bf16 gradients come down exactly
// as the step reduced them, AdamW steps the fp32 masters with them loaded
// exactly, and the working copies rn(master) go up in bf16 (this rank's
// region of the dense weights, then the all-gather, and the owned weights):
// DeviceAdamWT<Bf16>'s arithmetic (Backend::AdamWBf16 on the CPU backend:
// load, cpu::AdamW, round), so the same bits. The host buffer the gradients
// come down into carries the working copies back up (the gradient is dead
// once loaded), so the host holds 3 fp32 and 1 bf16 value per parameter,
// what CpuOffloadAdamWBytes plans for bf16.
//
// Thread safety: one per rank (OptimizerUpdate).
#ifndef PLATEAU_KERNELS_OPTIMIZER_CPU_OFFLOAD_ADAMW_H_
#define PLATEAU_KERNELS_OPTIMIZER_CPU_OFFLOAD_ADAMW_H_

#include <memory>
#include <type_traits>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/communicator.h"
#include "kernels/memory.h"
#include "kernels/model/step_options.h"
#include "kernels/optimizer/optimizer_update.h"

namespace plateau {

template <typename W>
class CpuOffloadAdamWT final : public OptimizerUpdate {
 public:
  // `threads` host threads run the update (0: the machine's hardware threads).
  static absl::StatusOr<std::unique_ptr<CpuOffloadAdamWT>> Create(const OptimizerConfig& config,
                                                                  const OptimizerParamsT<W>& params,
                                                                  Backend& backend, Communicator& world,
                                                                  Stream& stream, int threads = 0);

  // Under bf16 the state's owned_master [X] is required.
  absl::Status Load(const OptimizerShardState& state) override;
  absl::StatusOr<OptimizerShardState> Save() override;
  absl::Status Update(float clip, int64_t step) override;

 private:
  // bf16: the owned weights' master lives on the host (after the dense one).
  static constexpr bool kSeparateOwnedMaster = !std::is_same_v<W, float>;
  CpuOffloadAdamWT(const OptimizerConfig& config, const OptimizerParamsT<W>& params, Backend& backend,
                   Communicator& world, Stream& stream, int threads)
      : config_(config), params_(params), backend_(backend), world_(world), stream_(stream), threads_(threads) {}
  // fn(lo, len) over [0, S + X) on threads_ host threads, in chunks of whole
  // cache lines; returns when every chunk is done.
  template <typename Fn>
  void OnHostThreads(Fn fn) const;
  absl::Status Refresh();  // host master -> working weights, all-gathered
  // bf16: the working copies rn(master), staged in grad_, up to the device
  // (this rank's region of the dense weights, the owned weights), then the
  // all-gather.
  absl::Status UploadWorking();

  const OptimizerConfig config_;
  const OptimizerParamsT<W> params_;
  Backend& backend_;
  Communicator& world_;
  Stream& stream_;
  const int threads_;
  // Host, [S + X] each: the parameters (the dense master | fp32: the owned
  // weights' staging copy, bf16: their master), the moments (fp32), and the
  // gradients in W (bf16: then the working copies going up).
  Buffer param_, m_, v_, grad_;
};

using CpuOffloadAdamW = CpuOffloadAdamWT<float>;

}  // namespace plateau

#endif  // PLATEAU_KERNELS_OPTIMIZER_CPU_OFFLOAD_ADAMW_H_
