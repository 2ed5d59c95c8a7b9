#include "worker/checkpoint_fence.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "worker/file_errors.h"

namespace plateau {
namespace {

constexpr char kFenceName[] = ".plateau-fence";
// Partial files: ".partial-JOB-attempt-A-step-N.safetensors" (and the
// writer's ".tmp.PID" beside it). Before 2026-12-07 without JOB, so two
// jobs sharing a directory, both attempt 0, wrote and removed one name.
constexpr char kPartialPrefix[] = ".partial-";

std::string PartialPrefix(const std::string& job, int64_t attempt) {
  return absl::StrCat(kPartialPrefix, job, "-attempt-", attempt, "-");
}

// A job id goes into file names: letters, digits, '.', '_' and '-' only.
bool IsFileNamePart(const std::string& job) {
  if (job.empty() || job == "." || job == "..") return false;
  for (char c : job) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') return false;
  }
  return true;
}

}  // namespace

absl::Status CheckpointDirectoryError(const std::string& dir, const std::string& action,
                                      int error) {
  // FileError's rule, where a missing parent is the setting too (the
  // directory is being created) and so are a read-only file system and a
  // file in the way.
  absl::Status s = FileError(absl::StrCat("checkpoint.directory=", dir, ": cannot ", action), error);
  if (absl::IsNotFound(s) || error == EROFS || error == EEXIST) {
    return absl::FailedPreconditionError(s.message());
  }
  return s;
}

namespace {

// The fence file, open and locked (exclusive, whole file) while this lives.
class LockedFence {
 public:
  static absl::StatusOr<LockedFence> Open(const std::string& dir, absl::Duration wait) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return CheckpointDirectoryError(dir, "create it", ec.value());
    const std::string path = absl::StrCat(dir, "/", kFenceName);
    LockedFence f;
    f.path_ = path;
    // Never through a link: one planted in the job's directory would have
    // this rank empty and rewrite whatever it points at.
    f.fd_ = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (f.fd_ < 0)
      return CheckpointDirectoryError(dir, absl::StrCat("open ", kFenceName, " there"), errno);
    struct flock lk = {};
    lk.l_type = F_WRLCK;
    lk.l_whence = SEEK_SET;
    // Polled rather than F_OFD_SETLKW, which waits for ever.
    const absl::Time deadline = absl::Now() + wait;
    while (fcntl(f.fd_, F_OFD_SETLK, &lk) != 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EACCES) {
        return absl::InternalError(absl::StrCat(path, ": cannot lock: ", std::strerror(errno)));
      }
      if (absl::Now() >= deadline) {
        return absl::UnavailableError(absl::StrCat(
            "checkpoint.directory=", dir, ": its fence (", kFenceName, ") has been locked by another process for ",
            absl::FormatDuration(wait), ": a stopped or hung rank of an earlier attempt holds it; not waiting longer"));
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return f;
  }
  LockedFence(LockedFence&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }
  LockedFence(const LockedFence&) = delete;
  ~LockedFence() {
    if (fd_ >= 0) close(fd_);  // releases the lock
  }

  // "job attempt\n"; an empty file: never claimed.
  absl::StatusOr<CheckpointFence> Read() {
    char buf[512];
    ssize_t n = pread(fd_, buf, sizeof(buf) - 1, 0);
    if (n < 0) return absl::InternalError(absl::StrCat(path_, ": cannot read: ", std::strerror(errno)));
    CheckpointFence out;
    std::string text(buf, static_cast<size_t>(n));
    if (text.empty()) return out;
    std::vector<std::string> parts = absl::StrSplit(absl::StripTrailingAsciiWhitespace(text), ' ');
    if (parts.size() != 2 || parts[0].empty() || !absl::SimpleAtoi(parts[1], &out.attempt)) {
      return absl::DataLossError(absl::StrCat(path_, ": not a checkpoint fence ('", text.substr(0, 80),
                                              "'); remove it only when no attempt of the job runs"));
    }
    out.job = parts[0];
    return out;
  }

  absl::Status Write(const CheckpointFence& f) {
    const std::string text = absl::StrCat(f.job, " ", f.attempt, "\n");
    if (ftruncate(fd_, 0) != 0 || pwrite(fd_, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size()) ||
        fsync(fd_) != 0) {
      return absl::InternalError(absl::StrCat(path_, ": cannot write: ", std::strerror(errno)));
    }
    return absl::OkStatus();
  }

 private:
  LockedFence() = default;
  int fd_ = -1;
  std::string path_;
};

std::string Holder(const CheckpointFence& f) {
  return f.job.empty() ? std::string("nobody") : absl::StrCat(f.job, " attempt ", f.attempt);
}

}  // namespace

std::string PartialCheckpointPath(const std::string& dir, const std::string& job, int64_t attempt, int64_t step) {
  return absl::StrCat(dir, "/", PartialPrefix(job, attempt), "step-", step, ".safetensors");
}

absl::StatusOr<CheckpointFence> ReadCheckpointFence(const std::string& dir) {
  auto f = LockedFence::Open(dir, kCheckpointFenceWait);
  if (!f.ok()) return f.status();
  return f->Read();
}

absl::Status ClaimCheckpointDir(const std::string& dir, const std::string& job, int64_t attempt, absl::Duration wait) {
  if (!IsFileNamePart(job) || attempt < 0) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint fence: bad job '", job, "' or attempt ", attempt,
                                                   " (expected letters, digits, '.', '_', '-'; attempt >= 0)"));
  }
  auto f = LockedFence::Open(dir, wait);
  if (!f.ok()) return f.status();
  auto held = f->Read();
  if (!held.ok()) return held.status();
  if (held->job == job && held->attempt > attempt) {
    return absl::AbortedError(absl::StrCat("fenced: checkpoint directory ", dir, " belongs to ", Holder(*held),
                                           "; attempt ", attempt, " is stale and stops"));
  }
  if (held->job != job || held->attempt != attempt) {
    if (absl::Status s = f->Write({job, attempt}); !s.ok()) return s;
  }
  // Every other partial file (older attempts', other jobs', the old
  // names'): never read, and never committed now that the fence names this
  // attempt. Its own are written only after every rank has claimed.
  const std::string mine = PartialPrefix(job, attempt);
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(kPartialPrefix, 0) != 0 || name.rfind(mine, 0) == 0) continue;
    std::filesystem::remove(e.path(), ec);
  }
  return absl::OkStatus();
}

absl::Status CommitCheckpoint(const std::string& dir, const std::string& job, int64_t attempt,
                              const std::string& partial, const std::string& final_path, absl::Duration wait) {
  auto f = LockedFence::Open(dir, wait);
  if (!f.ok()) return f.status();
  auto held = f->Read();
  if (!held.ok()) return held.status();
  if (held->job != job || held->attempt != attempt) {
    std::remove(partial.c_str());
    return absl::AbortedError(absl::StrCat("fenced: ", final_path, " not written: the checkpoint directory belongs to ",
                                           Holder(*held), ", not ", job, " attempt ", attempt,
                                           " (a newer attempt replaced this one)"));
  }
  if (std::rename(partial.c_str(), final_path.c_str()) != 0) {
    const int err = errno;
    std::remove(partial.c_str());
    return absl::InternalError(absl::StrCat(final_path, ": rename failed: ", std::strerror(err)));
  }
  // The rename is durable before the lock is released, or the commit
  // fails: a checkpoint said saved must survive a crash of the node.
  // UNAVAILABLE whatever the errno: the file is in place, and the restart
  // this allows resumes from it (a spec error it is not).
  const int d = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d < 0) {
    return absl::UnavailableError(
        absl::StrCat(dir, ": cannot open to make ", final_path, " durable: ", std::strerror(errno)));
  }
  const int synced = fsync(d);
  const int err = errno;
  close(d);
  if (synced != 0) {
    return absl::UnavailableError(
        absl::StrCat(dir, ": fsync after renaming ", final_path, " failed: ", std::strerror(err)));
  }
  return absl::OkStatus();
}

}  // namespace plateau
