// The one place that turns a step's options into its schedule objects, one
// per schedule point (DESIGN.md §1): the checkpoint store, expert dispatch,
// the vocabulary projection and the optimizer placement. The step calls each through its
// interface only, so adding a schedule is its file plus one case here.
#ifndef PLATEAU_KERNELS_STEP_SCHEDULES_H_
#define PLATEAU_KERNELS_STEP_SCHEDULES_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/checkpoints/boundary_store.h"
#include "kernels/communicator.h"
#include "kernels/dispatch/expert_dispatch.h"
#include "kernels/model/model_kernels.h"
#include "kernels/model/step_options.h"
#include "kernels/optimizer/optimizer_update.h"
#include "kernels/projection/vocab_projection.h"

namespace plateau {

// What every schedule needs from the step: its options, the backend and
// model kernels, the ranks, and the compute and communication streams.
struct StepContext {
  const StepOptions& options;
  Backend& backend;
  ModelKernels& kernels;
  Communicator& world;
  Stream& compute;
  Stream& comm;
  // The step's weights and gradients the optimizer updates, in the step's
  // precision (options.precision): `params` in fp32, `params_bf16` in bf16
  // mixed; the other is unused.
  OptimizerParams params;
  OptimizerParamsT<Bf16> params_bf16;
};

struct StepSchedules {
  std::unique_ptr<BoundaryStore> checkpoints;
  // Under keep_attention, the L attention records [N, heads d + heads]
  // fp32 (record l: layer l's o, then its lse), in a store of the same
  // schedule as the boundaries (CheckpointPools' records); null without.
  std::unique_ptr<BoundaryStore> attention_records;
  std::unique_ptr<ExpertDispatch> dispatch;
  std::unique_ptr<VocabProjection> projection;
  std::unique_ptr<OptimizerUpdate> optimizer;
};

// Allocates each schedule's launch-sized buffers (what the budget plans for
// it, in the options' precision); errors name the spec field (a shape the
// bf16 step cannot take under precision bf16: CheckBf16Schedules).
absl::StatusOr<StepSchedules> CreateSchedules(const StepContext& ctx);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_STEP_SCHEDULES_H_
