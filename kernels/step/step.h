// The baseline MoE training step: explicit forward and backward of the model
// of docs/MODEL.md over P ranks, on buffers sized at launch. This is the
// all-schedules-off stack every schedule is measured against:
//
// - each rank holds a distinct slice of every sequence (N = B*T/P tokens);
// - attention is ring attention over the world (K/V blocks circulate on the
//   communication stream while the compute stream folds the current block;
//   in backward the blocks' dK/dV accumulators travel with them);
// - experts are partitioned E/P per rank; routes reach them by standard
//   expert parallelism (kernels/dispatch/standard_ep.h), LLEP or
//   PipelinedLLEP as options.dispatch chooses;
// - dense weights are ZeRO-sharded: gradients reduce-scattered, each rank
//   updates its shard with AdamW (torch semantics, global-norm clipping),
//   working weights all-gathered;
// - the vocabulary projection is dense (full N x V logits,
//   kernels/projection/dense_projection.h; lm_head is a dense weight), or
//   Ring-DTP when options.projection chooses it (each rank owns its
//   vocabulary shard of lm_head, which meets every rank's batch; no N x V
//   logits, and the full lm_head is never gathered: kernels/model/params.h);
// - full activation checkpointing: each layer's input is kept (kCheckpoints)
//   and the layer is recomputed in backward; with
//   options.checkpoints.keep_attention each layer's attention output and
//   log-sum-exp are kept too (kCheckpoints, a second store of the same
//   schedule) and the recompute skips attention's forward.
//
// Every allocation is made by Create() except the dispatch buffers of
// standard EP and LLEP, whose size depends on the routing (the baselines'
// unbounded live set; PipelinedLLEP's are launch-sized). The whole-model
// views and the checkpoint (GatherWeights, GatherGrads, GatherState,
// LoadState, StreamState, LoadStreamedState) allocate nothing on the device: the gathers move the state in
// chunks through the full dense gradient buffer, idle between steps
// (step.cc says why it is idle and how the chunk is sized).
//
// Thread safety: one TrainingStep per rank process; all methods are
// collective (every rank calls them in the same order).
#ifndef PLATEAU_KERNELS_STEP_STEP_H_
#define PLATEAU_KERNELS_STEP_STEP_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/memory.h"
#include "kernels/model/config.h"
#include "kernels/model/params.h"
#include "kernels/budget/budget.h"
#include "kernels/model/step_options.h"
#include "kernels/phase_recorder.h"

namespace plateau {

// The model state's families, streamed (TrainingStep::StreamState), in the
// order a checkpoint file holds each weight's tensors (docs/MODEL.md).
enum class StateFamily { kWeights = 0, kM = 1, kV = 2 };
// Values [offset, offset + n) of tensor `weight` (an index into
// ParamLayout::weights()) of one family: received, or to fill.
using StateSink = std::function<absl::Status(StateFamily family, int weight, int64_t offset,
                                             const float* values, int64_t n)>;
using StateSource = std::function<absl::Status(StateFamily family, int weight, int64_t offset,
                                               float* values, int64_t n)>;

struct StepStats {
  int64_t step = 0;            // optimizer steps taken so far
  double loss = 0.0;           // mean over the global batch's valid targets
  int64_t valid_tokens = 0;    // of the global batch
  double grad_norm = 0.0;      // before clipping (0 for ForwardBackward)
  MemoryStats device;          // peaks during this call
  MemoryStats host;
};

// The whole optimizer state as full tensors (ModelWeights() order).
struct ModelState {
  std::vector<std::vector<float>> weights, m, v;
  int64_t step = 0;

  std::vector<std::vector<float>>& family(StateFamily f) {
    return f == StateFamily::kWeights ? weights : f == StateFamily::kM ? m : v;
  }
  const std::vector<std::vector<float>>& family(StateFamily f) const {
    return const_cast<ModelState*>(this)->family(f);
  }
};

class TrainingStep {
 public:
  // Validates the options (an error names the field) and allocates every
  // launch-sized buffer; refuses a device cap that cannot hold them, naming
  // the live sets. Initialises the weights from options.seed.
  static absl::StatusOr<std::unique_ptr<TrainingStep>> Create(
      const StepOptions& options, Backend& backend, Communicator& world);
  ~TrainingStep();

  // Forward and backward on this rank's slice of the global batch
  // ([B, T/P] tokens and targets): leaves the global gradient in the grad
  // buffers (dense shard + local experts). No update.
  //
  // `phases` (optional; the memory timeline, kernels/memory_timeline.h) is
  // told at every phase boundary of kernels/phase_recorder.h, in its order;
  // the step's own peaks (StepStats) are not affected.
  absl::StatusOr<StepStats> ForwardBackward(const std::vector<int32_t>& tokens,
                                            const std::vector<int32_t>& targets,
                                            PhaseRecorder* phases = nullptr);
  // Forward only, for a validation loss: the loss of the global batch
  // (stats.loss and valid_tokens, exactly as ForwardBackward computes them
  // for the same weights and batch), no gradient, no optimizer, the step
  // count unchanged. Collective. It runs the forward's buffers only, so
  // its peaks stay within the training step's plan; the checkpoint
  // schedule's boundaries are released in the backward's order, so the
  // next step finds the store as a step leaves it.
  absl::StatusOr<StepStats> Evaluate(const std::vector<int32_t>& tokens,
                                     const std::vector<int32_t>& targets);
  // ForwardBackward, global-norm clipping, AdamW, weight all-gather.
  absl::StatusOr<StepStats> Step(const std::vector<int32_t>& tokens,
                                 const std::vector<int32_t>& targets,
                                 PhaseRecorder* phases = nullptr);

  // Collective: the full weights, or the gradient of the last
  // ForwardBackward, as full tensors on every rank: the working weights the
  // kernels read and the working gradients (under bf16 mixed precision their
  // bf16 values, loaded exactly into floats).
  absl::StatusOr<std::vector<std::vector<float>>> GatherWeights();
  absl::StatusOr<std::vector<std::vector<float>>> GatherGrads();
  // The optimizer's state: the weights are the fp32 masters (in fp32 the
  // working weights themselves), so that LoadState resumes bit for bit.
  // Every rank gets the full state in host memory (step.cc: what it takes).
  // These gathers overwrite the dense gradient buffer (dead between steps:
  // the next ForwardBackward zeroes it; GatherGrads reads the reduced shard).
  absl::StatusOr<ModelState> GatherState();
  // Collective: every rank passes the same full state (the working weights
  // are rn(master) under bf16).
  absl::Status LoadState(const ModelState& state);

  // The same state streamed, for models whose full state does not fit one
  // host (GatherState holds all of it on every rank): the values of each
  // family pass through `sink` in runs of consecutive values of one tensor,
  // every value exactly once, in an order that depends on the layout (not
  // the tensors' order). Collective; every rank gathers, and only the ranks
  // that pass a sink receive (the trainer: rank 0 writes the file). A sink
  // error stops the sink, not the gathers, and is returned once they end.
  // Host memory, at most StreamStateHostBytes(sink != nullptr) (the
  // budget's formula, kernels/budget/budget.h): this rank's optimizer
  // shard, and where a sink is given one gathered chunk. Device memory:
  // none of its own.
  absl::Status StreamState(const StateSink* sink);
  int64_t StreamStateHostBytes(bool with_sink) const;
  // Collective: every rank reads its own shard from `source` (the same
  // state on every rank: a checkpoint file) and none holds more; then the
  // step count is `step`. What LoadState does with a full state. Host
  // memory, at most LoadStreamedStateHostBytes(): this rank's shard.
  absl::Status LoadStreamedState(int64_t step, const StateSource& source);
  int64_t LoadStreamedStateHostBytes() const;

  // Collective: the least and the greatest of `value` over the world's
  // ranks (exact below 2^53), through the step's own two-double stats
  // buffer (no memory of its own). How the ranks check that they agree on
  // a choice each made alone (the trainer: which checkpoint to resume).
  absl::StatusOr<std::pair<int64_t, int64_t>> RangeAcrossRanks(int64_t value);

  int64_t step() const { return step_; }
  // Attention forwards this step has run since Create, one per layer per
  // forward and per recompute (none in a recompute under
  // CheckpointOptions::keep_attention): what the kept attention saves.
  int64_t attention_forwards() const;
  const ParamLayout& layout() const { return layout_; }
  // What the step's model kernels chose at creation (ModelKernels::
  // Describe: on CUDA the tensor-core attention kernels' buffering and
  // whether they run on wgmma, and why not); "" on the CPU.
  std::string KernelsDescribe() const;
  Backend& backend() { return backend_; }
  // The step's compute and communication streams, in that order: for timing
  // its phases on the device (kernels/phase_clock.h). Work enqueued on them
  // runs in the step's order.
  std::vector<Stream*> streams();

  // The buffers and streams; opaque outside step.cc.
  struct Impl;

 private:
  TrainingStep(const StepOptions& options, Backend& backend, Communicator& world);
  absl::Status Allocate();
  // ForwardBackward, or with backward = false Evaluate: PassT on the
  // options' working type (float, or Bf16 under bf16 mixed precision).
  absl::StatusOr<StepStats> Pass(const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets,
                                 PhaseRecorder* phases, bool backward);
  template <typename W>
  absl::StatusOr<StepStats> PassT(const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets,
                                  PhaseRecorder* phases, bool backward);
  absl::Status CheckBatch(const std::vector<int32_t>& tokens,
                          const std::vector<int32_t>& targets) const;

  const StepOptions options_;
  Backend& backend_;
  Communicator& world_;
  ParamLayout layout_;
  int64_t step_ = 0;
  std::unique_ptr<Impl> impl_;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_STEP_STEP_H_
