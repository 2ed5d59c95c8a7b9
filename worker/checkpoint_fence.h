// Fencing of a job's checkpoint directory across its attempts
// (docs/SERVICE.md "Partitions and fencing").
//
// When a worker is cut off, the coordinator restarts the job elsewhere while
// the old attempt's ranks may still run (until their agent's lease lapses
// and freezes them). Both attempts write the same checkpoint names
// (step-N.safetensors), so a late write of the old attempt could replace
// the new attempt's file, or appear between two ranks of the new attempt
// reading "the newest checkpoint". The rule that rules both out:
//
//   - every rank of an attempt claims the directory before it reads the
//     newest checkpoint: the fence file (dir/.plateau-fence) then names
//     this job and attempt; a claim by an older attempt of the same job
//     is refused;
//   - a checkpoint is written under a partial name no reader takes
//     (dir/.partial-...) and renamed into place only while the fence still
//     names the writer's job and attempt.
//
// The check and the rename happen under one lock on the fence file (an
// open-file-description lock, F_OFD_SETLK, polled with a deadline: it excludes other processes
// and other threads alike, and works on NFS), so once a newer attempt has
// claimed the directory no older attempt's write can land, and whatever
// landed before the claim was a complete checkpoint of the same job.
//
// Thread safety: the functions are safe to call from any thread or process.
#ifndef PLATEAU_WORKER_CHECKPOINT_FENCE_H_
#define PLATEAU_WORKER_CHECKPOINT_FENCE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace plateau {

struct CheckpointFence {
  std::string job;       // the job id; "" when the directory was never claimed
  int64_t attempt = -1;
};

// How long a claim or a commit waits for the fence's lock. Another process
// holds it only for a check and a rename; one that holds it longer is
// stopped (a frozen rank of an older attempt, SIGSTOPped by its agent while
// committing) and may hold it for as long as its partition lasts. Past the
// wait the call fails UNAVAILABLE, which restarts the attempt, rather than
// hanging where no collective timeout reaches.
inline constexpr absl::Duration kCheckpointFenceWait = absl::Seconds(60);

// Claims `dir` (created if missing) for `job`'s `attempt`. ABORTED when a
// later attempt of the same job holds it (this attempt is stale). Partial
// files of the job's older attempts and of other jobs are removed (none of
// them can commit any more). `job` becomes part of file names: letters,
// digits, '.', '_' and '-' (INVALID_ARGUMENT otherwise).
absl::Status ClaimCheckpointDir(const std::string& dir, const std::string& job, int64_t attempt,
                                absl::Duration wait = kCheckpointFenceWait);

// Where `job`'s `attempt` writes step `step` before committing it: a name
// of its own, so that no other job or attempt writes or removes it.
std::string PartialCheckpointPath(const std::string& dir, const std::string& job, int64_t attempt, int64_t step);

// Renames `partial` to `final_path` if the fence of `dir` still names `job`
// and `attempt`; otherwise removes `partial` and returns ABORTED naming the
// holder.
absl::Status CommitCheckpoint(const std::string& dir, const std::string& job, int64_t attempt,
                              const std::string& partial, const std::string& final_path,
                              absl::Duration wait = kCheckpointFenceWait);

// What a checkpoint directory that cannot be created or opened is: the
// job's own setting when the reason is one (no permission, a read-only file
// system, a path through a file or where nothing can be created, as under
// /proc): FAILED_PRECONDITION, which the rank reports as an invalid job
// rather than a crash to be restarted. Other reasons (a full disk, I/O
// errors) may pass: UNAVAILABLE (worker/file_errors.h).
// "checkpoint.directory=DIR: cannot ACTION: REASON".
absl::Status CheckpointDirectoryError(const std::string& dir, const std::string& action, int error);

// The fence as it stands (for tests and diagnostics).
absl::StatusOr<CheckpointFence> ReadCheckpointFence(const std::string& dir);

}  // namespace plateau

#endif  // PLATEAU_WORKER_CHECKPOINT_FENCE_H_
