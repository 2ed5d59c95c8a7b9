// OffloadStreamAdamW (DESIGN.md §1.4): the fp32 master of the dense shard
// and every AdamW moment live on the host (pinned on CUDA); an update
// streams them through `slots` device staging slots, bucket by bucket
// (OffloadStreamBuckets in optimizer_plan.h):
//
//   up stream:    host -> slot  (master, m, v of bucket i)      after slot i-slots is written back
//   stream:       AdamW on the slot; the dense master also into this rank's
//                 region of the working weights
//   down stream:  slot -> host  (master, m, v)
//
// so the copies of one bucket overlap the update of another, ordered by
// events only: no host synchronisation inside the loop. After the last
// bucket the working weights are all-gathered (in place) and the streams
// synchronised. The owned weights (experts, a Ring-DTP lm_head shard) are
// their own master on the device: their buckets bring only m and v.
//
// The arithmetic is the device baseline's (the same backend AdamW on the
// same values), so the results are bitwise DeviceAdamW's; only where the
// state lives changes. Device bytes: slots x 3 x bucket floats; host bytes:
// 3S + 2X floats (OffloadStreamAdamWBytes).
//
// Precision (W): fp32 (OffloadStreamAdamW), or bf16 mixed
// (OffloadStreamAdamWT<Bf16>, DeviceAdamWT<Bf16>'s arithmetic): the owned
// weights then have an fp32 master on the host too (3S + 3X floats), which
// their buckets bring up and write back like the dense shard's; AdamWBf16
// writes the working copies rn(master) (this rank's region of the dense
// weights, the owned weights) in the same pass, and the all-gather moves
// bf16.
//
// Thread safety: one per rank (OptimizerUpdate).
#ifndef PLATEAU_KERNELS_OPTIMIZER_OFFLOAD_STREAM_ADAMW_H_
#define PLATEAU_KERNELS_OPTIMIZER_OFFLOAD_STREAM_ADAMW_H_

#include <memory>
#include <type_traits>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/memory.h"
#include "kernels/model/step_options.h"
#include "kernels/optimizer/optimizer_plan.h"
#include "kernels/optimizer/optimizer_update.h"
#include "kernels/stream.h"

namespace plateau {

template <typename W>
class OffloadStreamAdamWT final : public OptimizerUpdate {
 public:
  // The update runs on `stream` (the step's communication stream, after the
  // gradients' reduce-scatter) and on two copy streams of its own.
  static absl::StatusOr<std::unique_ptr<OffloadStreamAdamWT>> Create(
      const OptimizerConfig& config, const OptimizerPlacementOptions& placement,
      const OptimizerParamsT<W>& params, Backend& backend, Communicator& world, Stream& stream);
  ~OffloadStreamAdamWT() override;

  absl::Status Load(const OptimizerShardState& state) override;
  absl::StatusOr<OptimizerShardState> Save() override;
  absl::Status Update(float clip, int64_t step) override;

  int64_t bucket() const { return bucket_; }

 private:
  // bf16: the owned weights' master lives apart (after the dense one).
  static constexpr bool kSeparateOwnedMaster = !std::is_same_v<W, float>;
  OffloadStreamAdamWT(const OptimizerConfig& config, const OptimizerParamsT<W>& params, int64_t bucket,
                      int64_t slots, Backend& backend, Communicator& world, Stream& stream);
  // Slot s's master, m and v (bucket_ floats each).
  float* SlotPart(int64_t s, int part) { return slots_.as<float>() + (3 * s + part) * bucket_; }
  absl::Status Settle();   // waits for the copy streams
  absl::Status Refresh();  // host master -> working weights, all-gathered

  const OptimizerConfig config_;
  const OptimizerParamsT<W> params_;
  const int64_t bucket_, slots_count_;
  Backend& backend_;
  Communicator& world_;
  Stream& stream_;
  // Declared before the buffers, so destroyed after them.
  std::unique_ptr<Stream> up_, down_;
  std::vector<std::unique_ptr<Event>> loaded_, updated_, written_;  // per slot
  Buffer slots_;                  // device: [slots][master | m | v][bucket]
  Buffer master_, m_, v_;         // host: [S] ([S + X] in bf16), [S + X], [S + X]
};

using OffloadStreamAdamW = OffloadStreamAdamWT<float>;

}  // namespace plateau

#endif  // PLATEAU_KERNELS_OPTIMIZER_OFFLOAD_STREAM_ADAMW_H_
