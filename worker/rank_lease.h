// The agent's lease (worker/agent.h, "Fencing"), shared with each rank it
// spawns through a page of memory, so that a rank stops itself when its
// agent cannot stop it.
//
// Why: the agent freezes its ranks (SIGSTOP) when the coordinator stops
// answering for a lease. A frozen or hung agent freezes nothing, and its
// ranks would train on after the coordinator had declared the worker lost
// and started the job's next attempt elsewhere: their checkpoint commits
// are fenced, but they keep using the devices. So every answered heartbeat
// also writes the lease's end into each rank's page, and a watchdog thread
// in the rank stops the rank's process (SIGSTOP) once the end plus a grace
// has passed; the grace lets a live agent fence first, with its log line.
// The rank marks its page before it stops, and the agent, once a heartbeat
// renews the lease, resumes (SIGCONT) the ranks so marked, and only them
// (a rank stopped by anyone else, such as a test simulating a hang, stays
// stopped). An attempt the coordinator voided meanwhile is killed instead:
// the agent stops watching its pages (end kNever) before it signals it.
//
// The page: a memfd of one page, CLOCK_MONOTONIC nanoseconds (one clock for
// every process of the host) and the mark, both atomics; the rank inherits
// it as a file descriptor (plateau_rank --lease_fd).
#ifndef PLATEAU_WORKER_RANK_LEASE_H_
#define PLATEAU_WORKER_RANK_LEASE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace plateau {

// CLOCK_MONOTONIC, in nanoseconds.
int64_t MonotonicNanos();

// The page's descriptor in the rank (dup2'd there by the agent's spawn).
constexpr int kRankLeaseFd = 3;
// How long past the lease's end a rank waits before it stops itself: the
// agent's own fence (every 50 ms) comes first when the agent is alive.
constexpr absl::Duration kRankLeaseGrace = absl::Seconds(1);

class RankLease {
 public:
  static constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

  // The agent's side: a new page whose end is kNever.
  static absl::StatusOr<std::unique_ptr<RankLease>> Create();
  // The rank's side: the page inherited as `fd`.
  static absl::StatusOr<std::unique_ptr<RankLease>> Attach(int fd);
  ~RankLease();
  RankLease(const RankLease&) = delete;
  RankLease& operator=(const RankLease&) = delete;

  int fd() const { return fd_; }
  void SetEnd(int64_t monotonic_ns);
  int64_t end() const;
  // The rank stopped itself and has not yet been resumed.
  bool self_stopped() const;

  // The rank's watchdog: a thread that every `poll` compares the clock with
  // end() + grace; past it, marks the page and stops the process (SIGSTOP);
  // resumed, clears the mark and calls on_resumed(how long it was
  // stopped, how overdue the lease was). Nothing is written before
  // stopping: the rank's output pipes lead to the agent, which may be the
  // one not answering. on_resumed runs on the watchdog's thread and must
  // not block (a write to a full pipe would keep the watchdog from the next
  // lapse). Runs until the object is destroyed.
  void Watch(absl::Duration grace, absl::Duration poll,
             std::function<void(absl::Duration stopped, int64_t overdue_ns)> on_resumed);

 private:
  struct Page {
    std::atomic<int64_t> end;
    std::atomic<int32_t> self_stopped;
  };
  RankLease(int fd, Page* page) : fd_(fd), page_(page) {}

  int fd_;
  Page* page_;
  std::atomic<bool> stop_{false};
  std::thread watchdog_;
};

}  // namespace plateau

#endif  // PLATEAU_WORKER_RANK_LEASE_H_
