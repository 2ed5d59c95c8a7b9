// One process per directory: an exclusive lock on DIR/.lock, held for the
// life of the DirLock. The coordinator takes its --state_dir (two
// coordinators on one SQLite state would each schedule the jobs they see,
// split the workers' heartbeats and refuse each other's cancels) and the
// worker agent its --work_dir (two agents there would register as one
// worker, with one's calibration replacing the other's).
//
// flock(2) on a file opened close-on-exec: released when the process exits,
// however it exits, and never inherited by the processes it spawns (a rank
// that outlived its agent would otherwise keep the directory locked). The
// file holds the holder's pid, for the refusal's message.
//
// Thread safety: a DirLock is not shared; Acquire is safe from any thread.
#ifndef PLATEAU_WORKER_DIR_LOCK_H_
#define PLATEAU_WORKER_DIR_LOCK_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace plateau {

class DirLock {
 public:
  // Locks `dir` (which must exist) for this process. FAILED_PRECONDITION
  // when another process holds it: "<flag>=<dir>: in use by another
  // <what> (pid N, <dir>/.lock): <why>"; other errors name the file.
  static absl::StatusOr<std::unique_ptr<DirLock>> Acquire(const std::string& dir,
                                                          const std::string& flag,
                                                          const std::string& what,
                                                          const std::string& why);
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

 private:
  explicit DirLock(int fd) : fd_(fd) {}
  int fd_;
};

}  // namespace plateau

#endif  // PLATEAU_WORKER_DIR_LOCK_H_
