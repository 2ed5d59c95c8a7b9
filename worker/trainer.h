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
#include "kernels/memory_timeline.h"
#include "kernels/step/step.h"
#include "worker/data.h"
#include "worker/trainer_options.h"

namespace plateau {

struct StepReport {
  StepStats stats;
  double seconds = 0.0;          // wall time of the step
  int64_t tokens = 0;            // tokens of the global batch
  double model_flops = 0.0;      // 6 * active params * tokens + attention
  // The learning rate the step's AdamW ran with (kernels/optimizer/
  // lr_schedule.h; the fp32 value the kernel took).
  double lr = 0.0;
  // After the steps TrainerOptions::validation_every picks: the mean token
  // cross-entropy over the held-out sequences, with this step's weights.
  bool has_validation = false;
  double validation_loss = 0.0;
  // The step's memory timeline when it recorded one
  // (TrainerOptions::memory_timeline_every), else nullptr; valid during
  // the on_step call.
  const MemoryTimelineRecorder* timeline = nullptr;
};



// Runs the loop from the newest checkpoint in options.checkpoint_dir (if
// resume) up to options.steps, calling on_step after every step.
absl::Status RunTraining(const TrainerOptions& options, Backend& backend,
                         Communicator& world,
                         const std::function<void(const StepReport&)>& on_step);

// Checkpoint file name for `step`: "<dir>/step-00000042.safetensors".
std::string CheckpointPath(const std::string& dir, int64_t step);

}  // namespace plateau

#endif  // PLATEAU_WORKER_TRAINER_H_
