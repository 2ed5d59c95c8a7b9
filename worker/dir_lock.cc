#include "worker/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace plateau {

absl::StatusOr<std::unique_ptr<DirLock>> DirLock::Acquire(const std::string& dir,
                                                          const std::string& flag,
                                                          const std::string& what,
                                                          const std::string& why) {
  const std::string path = dir + "/.lock";
  // Never through a link (one planted in a shared directory would have
  // this process truncate and write whatever it points at).
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0)
    return absl::FailedPreconditionError(
        absl::StrCat(flag, "=", dir, ": cannot open ", path, ": ", strerror(errno)));
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    std::string holder = "another process";
    if (e == EWOULDBLOCK) {
      char buf[32] = {};
      const ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
      int64_t pid = 0;
      if (n > 0 && absl::SimpleAtoi(absl::StripAsciiWhitespace(absl::string_view(buf, n)), &pid) &&
          pid > 0) {
        holder = absl::StrCat("pid ", pid);
      }
    }
    close(fd);
    if (e != EWOULDBLOCK) {
      return absl::FailedPreconditionError(
          absl::StrCat(flag, "=", dir, ": cannot lock ", path, ": ", strerror(e)));
    }
    return absl::FailedPreconditionError(absl::StrCat(flag, "=", dir, ": in use by another ", what,
                                                      " (", holder, ", ", path, "): ", why));
  }
  // Ours: the pid for the next one's message (best effort: the lock, not
  // the content, is what excludes).
  const std::string pid = absl::StrCat(getpid(), "\n");
  if (ftruncate(fd, 0) != 0 ||
      pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    // Still locked; only the message of a refused second process is poorer.
  }
  return std::unique_ptr<DirLock>(new DirLock(fd));
}

DirLock::~DirLock() { close(fd_); }

}  // namespace plateau
