// The budget of a training step, computed from its options without a
// backend, a communicator or any allocation: every live set's device bytes
// and host bytes (pinned on CUDA), each an upper bound of what the step can
// hold for any input. The launch-
// sized buffers come from one list (StepLaunchBuffers) that the step also
// allocates from, the projection's and the dispatch's from their schedules'
// own bound functions (kernels/projection/projection_plan.h,
// kernels/dispatch/standard_ep_plan.h). Used by the coordinator's admission
// (worker/job_spec.h), by the rank before it allocates, and by the tests.
#ifndef PLATEAU_KERNELS_BUDGET_BUDGET_H_
#define PLATEAU_KERNELS_BUDGET_BUDGET_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/checkpoints/checkpoints_plan.h"
#include "kernels/memory.h"
#include "kernels/model/params.h"
#include "kernels/model/step_options.h"
#include "kernels/projection/projection_plan.h"

namespace plateau {

// Bytes per live set that the step may hold on the device: an upper bound of
// every live set's peak for any input. Dispatch is PipelinedLLEP's bound, or
// standard EP's / LLEP's worst case (every route of every source rank
// received by one rank); dispatch_balanced_bytes is what the latter hold
// when each rank receives N*k rows (dispatch_note says which).
//
// Host bytes: what the schedules keep in host memory (SCO's boundary pool,
// the offloaded optimizers' master and moments, PipelinedLLEP's index
// staging, kept counts and planner's arrays). The baseline schedules keep
// nothing in the host live sets; standard EP's and LLEP's plans are plain
// heap vectors of the layer's routes (O(N k) int32 words, their index
// vectors' host copies), outside this plan like their growth on the device
// is outside any bound of their own.
struct MemoryPlan {
  std::array<int64_t, kNumLiveSets> bytes{};       // device
  std::array<int64_t, kNumLiveSets> host_bytes{};  // host
  int64_t dispatch_balanced_bytes = 0;
  // What the dispatch term is: a schedule's bound, or a baseline's worst case.
  std::string dispatch_note;
  // Device bytes allocated per layer call, following the routing: the
  // dispatch term of standard EP and LLEP; 0 under PipelinedLLEP, whose
  // buffers are launch-sized.
  int64_t routing_bytes = 0;
  int64_t total() const;  // device
  // What the step allocates when it starts: total() - routing_bytes.
  int64_t launch_total() const { return total() - routing_bytes; }
  int64_t host_total() const;
  // "weights=… grads=… total=…", then " host: … total=…" when any host term.
  std::string DebugString() const;
};

// Validates what the plan depends on (the model and layout, the projection
// schedule's options); errors name the spec field.
absl::Status ValidateStepShape(const StepOptions& options);

absl::StatusOr<MemoryPlan> PlanMemory(const StepOptions& options);
// The same plan with the options' parameter layout given: LayoutOf(options),
// which depends on neither layout.batch nor model.seq_len (INVALID_ARGUMENT
// when its model, ranks or lm_head placement differ). The N_max search
// plans hundreds of shapes of one model, and the layout lists every weight
// of every layer.
absl::StatusOr<MemoryPlan> PlanMemory(const StepOptions& options, const ParamLayout& layout);

// One buffer the step allocates at launch: `name` is its member of
// TrainingStep::Impl (the step allocates in this order, from `space`, and
// checks the names).
struct StepBufferSpec {
  const char* name;
  LiveSet set;
  int64_t bytes;
  SpaceKind space = SpaceKind::kDevice;
};
std::vector<StepBufferSpec> StepLaunchBuffers(const StepOptions& options);
std::vector<StepBufferSpec> StepLaunchBuffers(const StepOptions& options, const ParamLayout& layout);
// The columns of one attention record under CheckpointOptions::
// keep_attention (heads d of output and heads of log-sum-exp, fp32 a row of
// N), 0 without.
int64_t AttentionRecordWidth(const StepOptions& options);
// Where the checkpoint schedule keeps the boundaries and the attention
// records (kCheckpoints): PlanScoPools at SCO's beta, or at beta = 0 (all
// on the device) under full checkpointing.
ScoPools CheckpointPools(const StepOptions& options);
// The entry of a StepLaunchBuffers list that the bf16 step lends its ZeRO
// gradient reduce as staging (kernels/step/grad_reduce.h; dead by then: the
// step's Allocate says why): the first largest device kActivations buffer
// (the fewest chunks). -1 when the list has none.
int64_t GradReduceStagingIndex(const std::vector<StepBufferSpec>& buffers);

// Where the parameters live under these options: the lm_head is
// vocabulary-sharded (owned by its shard's rank) under Ring-DTP, in the
// ZeRO-sharded dense weights otherwise.
ParamLayout LayoutOf(const StepOptions& options);

// What the step cannot take in bf16 mixed precision (issue 17). Every
// schedule computes bf16 (standard EP, LLEP and PipelinedLLEP, the dense
// projection and Ring-DTP, full checkpoints and SCO, the device,
// OffloadStream and CPU-offload AdamW); one shape does not: model.experts >
// model.hidden. OK in fp32 or for every other shape; otherwise
// INVALID_ARGUMENT naming the job spec's field (model.experts).
// The step checks it at Create and the job spec at submit: one list.
absl::Status CheckBf16Schedules(const StepOptions& options);

// The host memory of a checkpoint, beside the plan (plain heap between
// steps, not a live set): a streamed save (TrainingStep::StreamState) holds
// the rank's optimizer shard (4 x (3 S + 2 X) bytes; 3 X under bf16, the
// owned masters) and, on a rank that receives (rank 0, which writes the
// file), one gathered chunk: the dense gradient buffer's bytes as floats. A
// streamed load holds the shard, 4 x 3 x (S + X). Nothing scales with the
// full model on any rank.
int64_t StreamStateHostBytes(const StepOptions& options, const ParamLayout& layout, bool with_sink);
int64_t LoadStreamedStateHostBytes(const ParamLayout& layout);

// Ring-DTP's configuration for the step's options (the mode chosen when the
// options leave it unset).
RingDtpConfig RingDtpConfigOf(const StepOptions& options);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_BUDGET_BUDGET_H_
