// What a failed open, read or listing of a job's file or directory is, by
// errno: the job's own setting, or a failure that may pass. The rank's exit
// code follows (worker/rank_main.cc: NOT_FOUND and FAILED_PRECONDITION are
// an invalid job, never restarted; UNAVAILABLE is an error the attempt's
// restart may get past).
#ifndef PLATEAU_WORKER_FILE_ERRORS_H_
#define PLATEAU_WORKER_FILE_ERRORS_H_

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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

// Opens `path` to read (O_CLOEXEC), or an error as FileError says; a path
// that is not a regular file is FAILED_PRECONDITION naming what it is. Opened
// without blocking first: a FIFO's open would wait for a writer for ever
// (the rank hung before its first collective), and a directory opens and
// then reads as an error or as 2^63 bytes, depending on the file system.
// The caller owns the descriptor.
inline absl::StatusOr<int> OpenRegularFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int error = errno;
    // Linux refuses to open a Unix socket, and a device without a driver,
    // with ENXIO (ENODEV): the path names no file, the spec's to fix.
    if (error == ENXIO || error == ENODEV) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, ": expected a regular file, found a socket or a device (", std::strerror(error), ")"));
    }
    return FileError(absl::StrCat(path, ": cannot open"), error);
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int error = errno;
    close(fd);
    return FileError(absl::StrCat(path, ": cannot stat"), error);
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    const char* what = S_ISDIR(st.st_mode)    ? "a directory"
                       : S_ISFIFO(st.st_mode) ? "a FIFO"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                                              : "not a regular file";
    return absl::FailedPreconditionError(absl::StrCat(path, ": expected a regular file, found ", what));
  }
  // Reads of a regular file block as usual whatever O_NONBLOCK says; it is
  // cleared all the same, so that nothing downstream meets it.
  const int flags = fcntl(fd, F_GETFL);
  if (flags >= 0) fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

}  // namespace plateau

#endif  // PLATEAU_WORKER_FILE_ERRORS_H_
