// The training loop of one rank: data, the step, checkpoints, progress.
// The rank process (worker/rank_main.cc) wraps it; tests drive it on threads.
#ifndef PLATEAU_WORKER_TRAINER_H_
#define PLATEAU_WORKER_TRAINER_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/model/step.h"
#include "worker/data.h"

namespace plateau {

// Where batches come from (docs/MODEL.md, "Data"). The data seed is
// recall.seed, independent of StepOptions::seed (the initialisation's): text
// and shards are read in order and have no seed.
struct DataOptions {
  enum class Kind { kRecall, kShards, kText } kind = Kind::kRecall;
  RecallTask recall;
  std::vector<std::string> paths;  // shards, or the one text file
};

struct TrainerOptions {
  StepOptions step;
  DataOptions data;
  int64_t steps = 100;                 // optimizer steps to reach in total
  std::string checkpoint_dir;          // empty: no checkpoints
  int64_t checkpoint_every = 0;        // steps; 0: only at the end
  bool resume = true;                  // continue from the newest checkpoint
};

// What each step reports (every rank gets the same loss).
struct StepReport {
  StepStats stats;
  double seconds = 0.0;          // wall time of the step
  int64_t tokens = 0;            // tokens of the global batch
  double model_flops = 0.0;      // 6 * active params * tokens + attention
};

// The job `tools/demo` runs and the tests train: a small MoE model
// (hidden 64, 2 layers, 4 heads / 2 KV heads, 4 experts top-2, FFN 128) on
// associative recall with 8 keys, 8 values, 4 pairs and 4 queries in
// sequences of 32 tokens, 32 sequences per step, AdamW lr 6e-3.
TrainerOptions RecallDemoJob(int64_t ranks);

// Model FLOPs of one training step on the global batch (forward + backward,
// without recomputation): 6 * active parameters * tokens, plus causal
// causal attention 6 * L * B * T^2 * n_h * d.
double ModelFlopsPerStep(const ModelConfig& m, int64_t batch);

// Runs the loop from the newest checkpoint in options.checkpoint_dir (if
// resume) up to options.steps, calling on_step after every step.
absl::Status RunTraining(const TrainerOptions& options, Backend& backend,
                         Communicator& world,
                         const std::function<void(const StepReport&)>& on_step);

// Checkpoint file name for `step`: "<dir>/step-00000042.safetensors".
std::string CheckpointPath(const std::string& dir, int64_t step);

}  // namespace plateau

#endif  // PLATEAU_WORKER_TRAINER_H_
