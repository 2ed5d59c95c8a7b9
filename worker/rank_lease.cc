#include "worker/rank_lease.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"

namespace plateau {

int64_t MonotonicNanos() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

namespace {

// The page is one of memory, whatever the structure's size.
constexpr size_t kPageBytes = 4096;

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat("rank lease: ", what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<RankLease>> RankLease::Create() {
  static_assert(sizeof(Page) <= kPageBytes);
  // Shared between processes: only lock-free atomics are plain memory.
  static_assert(std::atomic<int64_t>::is_always_lock_free && std::atomic<int32_t>::is_always_lock_free);
  const int made = memfd_create("plateau-rank-lease", MFD_CLOEXEC);
  if (made < 0) return Errno("memfd_create");
  // Above the descriptors a spawn sets up (0-2, and 3 where the rank gets
  // it): the agent's copy never sits where a child's dup2 lands.
  const int fd = fcntl(made, F_DUPFD_CLOEXEC, 10);
  close(made);
  if (fd < 0) return Errno("fcntl(F_DUPFD_CLOEXEC)");
  if (ftruncate(fd, kPageBytes) != 0) {
    close(fd);
    return Errno("ftruncate");
  }
  void* p = mmap(nullptr, kPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    return Errno("mmap");
  }
  std::unique_ptr<RankLease> lease(new RankLease(fd, new (p) Page()));
  lease->page_->end.store(kNever);
  lease->page_->self_stopped.store(0);
  return lease;
}

absl::StatusOr<std::unique_ptr<RankLease>> RankLease::Attach(int fd) {
  // A page of the right size, or the first load would fault (SIGBUS).
  struct stat st;
  if (fstat(fd, &st) != 0) return Errno(absl::StrCat("fstat of --lease_fd=", fd));
  if (!S_ISREG(st.st_mode) || st.st_size < static_cast<off_t>(kPageBytes)) {
    return absl::InvalidArgumentError(absl::StrCat("rank lease: --lease_fd=", fd, " is not a lease page (",
                                                   st.st_size, " bytes, expected ", kPageBytes, ")"));
  }
  void* p = mmap(nullptr, kPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return Errno(absl::StrCat("mmap of --lease_fd=", fd));
  return std::unique_ptr<RankLease>(new RankLease(fd, static_cast<Page*>(p)));
}

RankLease::~RankLease() {
  stop_.store(true);
  if (watchdog_.joinable()) watchdog_.join();
  munmap(page_, kPageBytes);
  close(fd_);
}

void RankLease::SetEnd(int64_t monotonic_ns) { page_->end.store(monotonic_ns); }
int64_t RankLease::end() const { return page_->end.load(); }
bool RankLease::self_stopped() const { return page_->self_stopped.load() != 0; }

void RankLease::Watch(absl::Duration grace, absl::Duration poll,
                      std::function<void(absl::Duration, int64_t)> on_resumed) {
  const int64_t grace_ns = absl::ToInt64Nanoseconds(grace);
  watchdog_ = std::thread([this, grace_ns, poll, on_resumed = std::move(on_resumed)] {
    while (!stop_.load()) {
      // The clock first: an end read before it could be one the agent has
      // renewed since (after freezing and resuming this rank in between).
      const int64_t now = MonotonicNanos(), end = page_->end.load();
      if (end != kNever && now > end && now - end > grace_ns && page_->end.load() == end) {
        page_->self_stopped.store(1);
        raise(SIGSTOP);  // the whole process, until the agent's SIGCONT
        page_->self_stopped.store(0);
        if (on_resumed) on_resumed(absl::Nanoseconds(MonotonicNanos() - now), now - end);
      }
      absl::SleepFor(poll);
    }
  });
}

}  // namespace plateau
