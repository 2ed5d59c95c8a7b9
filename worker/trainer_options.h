// A training job's options, as the control plane sees them: the step's
// options, the data source, steps and checkpoints. Plain data with no
// dependency on the training step itself, so that the coordinator can
// validate and plan a job (worker/job_spec.h) without linking any compute.
#ifndef PLATEAU_WORKER_TRAINER_OPTIONS_H_
#define PLATEAU_WORKER_TRAINER_OPTIONS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kernels/model/config.h"
#include "kernels/model/step_options.h"
#include "worker/data.h"

namespace plateau {

// Where batches come from (docs/MODEL.md, "Data"). The data seed is
// recall.seed, independent of StepOptions::seed (the initialisation's): text
// and shards are read in order and have no seed.
struct DataOptions {
  enum class Kind { kRecall, kShards, kText } kind = Kind::kRecall;
  RecallTask recall;
  std::vector<std::string> paths;  // shards, or the one text file
  // Sequences held out of training (worker/data.h DataSlice::held_out).
  int64_t held_out = 0;
};

// JobSpec.memory_timeline_every when unset: the first step and every 100th.
inline constexpr int64_t kDefaultMemoryTimelineEvery = 100;

// True when the step that will be numbered `step` (1-based) records its
// memory timeline under `every` (TrainerOptions::memory_timeline_every).
inline bool RecordsMemoryTimeline(int64_t step, int64_t every) {
  return every > 0 && (step == 1 || step % every == 0);
}

struct TrainerOptions {
  StepOptions step;
  DataOptions data;
  int64_t steps = 100;                 // optimizer steps to reach in total
  std::string checkpoint_dir;          // empty: no checkpoints
  int64_t checkpoint_every = 0;        // steps; 0: only at the end
  // CheckpointSpec.keep_last: the newest this many checkpoints stay, older
  // ones are removed once a newer one is durable; 0: all stay.
  int64_t checkpoint_keep_last = 0;
  bool resume = true;                  // continue from the newest checkpoint
  // Resume from a checkpoint trained under another learning-rate schedule
  // (OptimizerSpec.reschedule_on_resume); false refuses it.
  bool reschedule_on_resume = false;
  // Checkpoint fencing (worker/checkpoint_fence.h): the job and attempt
  // this run is; the run claims checkpoint_dir before it reads it and
  // commits each checkpoint only while it still holds it. Attempt < 0: no
  // fencing (a run outside the service, train_main).
  std::string fence_job;
  int64_t fence_attempt = -1;
  // Record the memory timeline (kernels/memory_timeline.h) of the first
  // step and of every step that is a multiple of this; 0: never.
  int64_t memory_timeline_every = kDefaultMemoryTimelineEvery;
  // After every this many steps and after the last, a forward-only pass
  // over the data.held_out sequences (batches of layout.batch) gives the
  // validation loss (StepReport::validation_loss). 0: never.
  int64_t validation_every = 0;
  // Told what the loop does besides its steps, one line each (the
  // checkpoint it resumed from); unset: nothing is said. Every rank says
  // its own lines, on its own thread: ranks that share one `say` (in one
  // process, as the tests run them) must make it thread-safe.
  std::function<void(const std::string&)> say;
};

// What each step reports (every rank gets the same loss).
// The job `tools/demo` runs and the tests train: a small MoE model
// (hidden 64, 2 layers, 4 heads / 2 KV heads, 4 experts top-2, FFN 128) on
// associative recall with 8 keys, 8 values, 4 pairs and 4 queries in
// sequences of 32 tokens, 32 sequences per step, AdamW lr 6e-3.
TrainerOptions RecallDemoJob(int64_t ranks);

// Model FLOPs of one training step on the global batch (forward + backward,
// without recomputation): 6 * the active parameters of matrix products (not
// the embedding's, not the norms') * tokens, plus causal attention
// 6 * L * B * T^2 * n_h * d (AttentionFlopsPerStep).
double ModelFlopsPerStep(const ModelConfig& m, int64_t batch);
double AttentionFlopsPerStep(const ModelConfig& m, int64_t batch);
// The vocabulary projection's part of ModelFlopsPerStep: lm_head [V x H] on
// every token, forward and backward (6 V H tokens).
double ProjectionFlopsPerStep(const ModelConfig& m, int64_t batch);

}  // namespace plateau

#endif  // PLATEAU_WORKER_TRAINER_OPTIONS_H_
