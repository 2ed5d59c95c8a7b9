// What a failed open, read or listing of a job's file or directory is, by
// errno: the job's own setting, or a failure that may pass. The rank's exit
// code follows (worker/rank_main.cc: NOT_FOUND and FAILED_PRECONDITION are
// an invalid job, never restarted; UNAVAILABLE is an error the attempt's
// restart may get past).
#ifndef PLATEAU_WORKER_FILE_ERRORS_H_
#define PLATEAU_WORKER_FILE_ERRORS_H_

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace plateau {

// "<what>: <strerror(error)>" as NOT_FOUND (missing, or a path through a
// file), FAILED_PRECONDITION (no permission, a directory where a file was
// meant, a name too long or looping: the spec's to fix) or UNAVAILABLE
// (EIO, ESTALE, EMFILE, ...: the file may be whole, a later attempt may
// read it).
inline absl::Status FileError(const std::string& what, int error) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(error));
  switch (error) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
    case EISDIR:
    case ELOOP:
    case ENAMETOOLONG:
      return absl::FailedPreconditionError(message);
    default:
      return absl::UnavailableError(message);
  }
}

}  // namespace plateau

#endif  // PLATEAU_WORKER_FILE_ERRORS_H_
