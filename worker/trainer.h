// The training loop of one rank: data, the step, checkpoints, progress.
// The rank process (worker/rank_main.cc) wraps it; tests drive it on threads.
#ifndef PLATEAU_WORKER_TRAINER_H_
#define PLATEAU_WORKER_TRAINER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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
  double model_flops = 0.0;      // ModelFlopsPerStep (trainer_options.h)
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
  // In the first report of a RunTraining call only: what the step's model
  // kernels chose at creation (TrainingStep::KernelsDescribe; on CUDA
  // whether attention runs on wgmma, and why not), for the log. Else "".
  std::string kernels;
};



// Runs the loop from the newest checkpoint in options.checkpoint_dir (if
// resume) up to options.steps, calling on_step after every step.
absl::Status RunTraining(const TrainerOptions& options, Backend& backend,
                         Communicator& world,
                         const std::function<void(const StepReport&)>& on_step);

// Checkpoint file name for `step`: "<dir>/step-00000042.safetensors".
std::string CheckpointPath(const std::string& dir, int64_t step);

// The newest checkpoint's step in `dir` (names as CheckpointPath writes
// them; others are not checkpoints), or -1 when there is none (a directory
// not made yet counts as empty). A directory that cannot be read is an
// error, never "none": a rank that started afresh beside ranks that resumed
// would train on a mixed state.
absl::StatusOr<int64_t> NewestCheckpoint(const std::string& dir);

// Removes what killed writers left in `dir`: "step-N.safetensors.tmp.PID"
// files whose PID is no process on this host (a live writer's file stays).
// Returns the names removed. For runs without the fence (plateau_train):
// a fenced job's claim removes other attempts' partial files instead.
absl::StatusOr<std::vector<std::string>> RemoveAbandonedCheckpointFiles(const std::string& dir);

// What RemoveOldCheckpoints did in a checkpoint directory.
struct CheckpointRetention {
  std::vector<int64_t> kept;         // steps of the checkpoints that stay, newest first
  int64_t kept_bytes = 0;            // their sizes, summed
  std::vector<std::string> removed;  // file names removed, newest first
  std::vector<std::string> failed;   // "NAME: REASON" for each that could not be removed
};

// Checkpoint retention (CheckpointSpec.keep_last), run by the writer once
// the checkpoint of step `newest` is durable. Of the checkpoints in `dir`
// (names as CheckpointPath writes them, no others) of steps up to `newest`,
// the `keep_last` newest stay and the rest are removed; `newest` itself
// always stays, and a later step (not this run's to judge) is never
// touched. keep_last 0 removes nothing. An error only where `dir` cannot be
// listed; a file that cannot be removed is reported in `failed`.
absl::StatusOr<CheckpointRetention> RemoveOldCheckpoints(const std::string& dir, int64_t newest, int64_t keep_last);

// The checkpoint file of docs/MODEL.md ("Checkpoints"), streamed: no host
// holds the full state. Collective: every rank calls it; the `writer` (the
// trainer's rank 0) writes `path` atomically with `metadata`, the others
// only take part in the gathers (host memory: the budget's
// StreamStateHostBytes). An error of the writer's file comes back from the
// writer once the gathers end.
absl::Status WriteCheckpointFile(TrainingStep& step, const std::string& path,
                                 const std::map<std::string, std::string>& metadata, bool writer);
// Collective: every rank passes the metadata of `path` to `accept` (which
// returns the step count to resume at, or an error that ends the read
// before anything is loaded), checks that the file holds every tensor of
// this model with its shape and no other (DATA_LOSS naming a missing one,
// FAILED_PRECONDITION naming an extra one: another model's file) and reads
// its own shard (LoadStreamedStateHostBytes).
absl::Status ReadCheckpointFile(
    const std::string& path, TrainingStep& step,
    const std::function<absl::StatusOr<int64_t>(std::map<std::string, std::string>)>& accept);

}  // namespace plateau

#endif  // PLATEAU_WORKER_TRAINER_H_
