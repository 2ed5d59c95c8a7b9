// The worker agent: one per node. Registers with the coordinator (backend,
// devices, memory), heartbeats, and for each assignment spawns one
// plateau_rank process per rank, each in its own process group, with its
// stdout/stderr on pipes. It forwards the ranks' telemetry (RankOutput JSON
// lines) and log lines to the coordinator, reports each rank's start and
// exit (code or signal, and its last error), and stops ranks on
// cancellation: SIGTERM to the process group, SIGKILL after the grace
// period. An exit is reported only once the rank's process group is empty,
// so a job the coordinator calls finished has no process left.
//
// When one rank of a job fails, the agent stops its siblings at once (they
// would otherwise wait on a dead peer until the collective timeout). A rank
// that said it is exiting (its work over, its error reported) but is still
// tearing down AgentOptions.teardown later is killed, and its exit reported
// with the code it said.
//
// Nothing is lost while the coordinator is away: reports (rank started and
// exited, step telemetry, log lines) wait in one ordered queue and are sent
// in order once it answers again; a rank's job is forgotten only after its
// exit was acknowledged. When the coordinator says it does not know this
// worker (it restarted, or declared the worker lost), the agent registers
// again with its old id and the ranks it still runs; the coordinator
// re-attaches them or names the jobs to stop.
//
// Fencing (docs/SERVICE.md "Partitions and fencing"): every answered
// heartbeat renews a lease (HeartbeatResponse.lease_ms), counted from when
// the heartbeat was sent. When it lapses (the coordinator unreachable for
// that long: a partition, or the coordinator down), the agent freezes every
// rank it runs with SIGSTOP, before the coordinator can declare this worker
// lost and start the job's next attempt elsewhere: a frozen rank writes no
// checkpoint. Frozen ranks are resumed (SIGCONT) when a registration or
// heartbeat is answered again and their attempt was not cancelled in that
// answer (a restarted coordinator re-attached them); an attempt the
// coordinator voids while frozen is killed at once (SIGKILL, no grace).
// The ranks hold the lease too (worker/rank_lease.h): a rank stops itself
// when the lease is a second overdue, so that a frozen or hung agent, which
// fences nothing, still leaves no rank training; the agent resumes those
// ranks once it renews the lease.
//
// The id the coordinator gives it is kept in its work dir (worker_id): a
// restarted agent registers under the same id, so operators see one worker
// that came back rather than a new one beside a lost one.
//
// Devices (worker/device_slots.h): each rank gets the lowest of the
// --devices slots no live rank of this agent holds; a CUDA rank sees only
// that slot's GPU (CUDA_VISIBLE_DEVICES, --device_index=0).
//
// Threads: Run() (reaping, kills after the grace period, the lease), a heartbeat
// thread (assignments, cancellations, registering again; at shutdown it
// says the worker is leaving and heartbeats until the ranks are gone), a
// sender thread (the report queue) and a spawn thread (SpawnThread: the
// ranks' parent).
//
// Thread safety: Run() on one thread; RequestStop() from any thread or a
// signal-handling thread.
#ifndef PLATEAU_WORKER_AGENT_H_
#define PLATEAU_WORKER_AGENT_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/connection.h"
#include "grpcpp/grpcpp.h"
#include "plateau/v1/worker.grpc.pb.h"
#include "worker/rank_lease.h"

namespace plateau {

struct AgentOptions {
  std::string coordinator;  // host:port
  // Opened by client/connection.h's OpenChannel (TLS, bearer token, the
  // reconnect settings a coordinator restart needs), as agent_main does;
  // nullptr: plaintext, no token, gRPC's defaults. The files are passed on
  // to the ranks, whose rendezvous calls need them too.
  std::shared_ptr<grpc::Channel> channel;
  ConnectionFiles files;  // absolute paths: the ranks start in their own directories
  v1::WorkerCapabilities capabilities;
  std::string rank_binary;  // plateau_rank
  std::string work_dir;     // spec files of running jobs; the worker id
  // The directories a job's paths must lie in (AllowedPaths,
  // worker/assignment.h); empty: any path the agent's user can reach.
  std::vector<std::string> allowed_paths;
  absl::Duration grace = absl::Seconds(5);
  // How long a rank that said it is exiting (RankOutput.exiting: its work
  // over, its error if any already reported) may take to tear down before
  // it is killed and reported as exited with the code it said
  // (RankExited.killed_in_teardown). A teardown frees memory and ends
  // communicators, seconds at most; one that hangs (ncclCommAbort waiting
  // on a peer stuck outside NCCL) would otherwise hold the job's failure
  // until its progress timeout, 600 s by default.
  absl::Duration teardown = absl::Seconds(60);
};

class Agent {
 public:
  explicit Agent(AgentOptions options);
  ~Agent();

  // Serves until RequestStop(); then stops every rank (grace, then SIGKILL)
  // and returns once all have exited and been reported.
  absl::Status Run();
  void RequestStop() { stop_.store(true); }

 private:
  struct Rank {
    int rank = 0;
    int slot = -1;  // its device slot (worker/device_slots.h) until it has exited
    pid_t pid = 0;
    bool exited = false;
    bool exit_acked = false;  // the coordinator has its exit report
    bool stop_sent = false;
    v1::RankError last_error;
    // When its teardown clock started (MonotonicNanos; -1 until it says
    // it is exiting, RankOutput.exiting; restarted when a stopped rank is
    // resumed) and the code it said; killed_in_teardown is set when
    // KillOverdue killed it for overrunning options_.teardown.
    int64_t exiting_at = -1;
    int exiting_code = 0;
    bool killed_in_teardown = false;
    // The lease's end, shared with the rank (worker/rank_lease.h); null
    // when its page could not be made (the agent alone fences it then).
    std::unique_ptr<RankLease> lease;
    bool self_stop_logged = false;  // Fence: its resumption is logged once
    std::vector<std::thread> readers;
    std::thread waiter;
  };
  struct JobRun {
    std::string job_id;
    int attempt = 0;
    // The spec file this agent wrote for the attempt, removed when it ends;
    // empty when none was written (an assignment CheckAssignment refused
    // names no path of ours).
    std::string spec_file;
    std::vector<std::unique_ptr<Rank>> ranks;
    bool stopping = false;
    std::string stop_reason;  // StopJob's: reported with each rank it stopped
    bool frozen = false;  // SIGSTOPped: the lease lapsed
    // Start is still spawning its ranks (on the heartbeat thread): Reap
    // must not free the job when the ranks so far have all exited.
    bool starting = true;
    absl::Time kill_at = absl::InfiniteFuture();
  };

  // One entry of the report queue: a batch of telemetry and logs, or a
  // rank's status (with the rank to mark acknowledged when it is exited).
  struct Report {
    v1::TelemetryRequest telemetry;
    bool is_status = false;
    v1::RankStatusRequest status;
    Rank* rank = nullptr;
    size_t bytes = 0;
  };

  // `again`: with this worker's old id and the ranks it still runs.
  absl::Status RegisterNow(bool again);
  // Every attempt with ranks whose exit is not yet acknowledged.
  void RunningJobs(google::protobuf::RepeatedPtrField<v1::RunningJob>* out) ABSL_LOCKS_EXCLUDED(mu_);
  // Heartbeats until stop_; then says the worker is leaving, lets Run stop
  // the ranks (heartbeat_stopping_), and keeps heartbeating (leaving) until
  // Run has seen them all exit (ranks_gone_).
  void HeartbeatLoop();
  // `leaving`: HeartbeatRequest.leaving; assignments in the answer are not
  // started, and a coordinator that no longer knows the worker is not
  // registered with again.
  void HeartbeatOnce(bool leaving = false);
  // A heartbeat or re-registration was answered: says so after failures.
  void Answered();
  void Start(const v1::Assignment& a);
  // The device slots of the ranks of every job that have not exited.
  std::vector<int> SlotsInUse() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StopJob(JobRun& job, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // SIGKILL for the ranks of stopping jobs past their grace, and for ranks
  // past options_.teardown since they said they were exiting.
  void KillOverdue() ABSL_LOCKS_EXCLUDED(mu_);
  // Freezes every job when the lease has lapsed; resumes the frozen ones
  // that are not stopping once it is renewed.
  void Fence() ABSL_LOCKS_EXCLUDED(mu_);
  // An answered heartbeat or registration sent at `sent`; called after the
  // answer's cancellations were applied, so that no voided attempt resumes.
  // `sent`: MonotonicNanos() when the request left.
  void RenewLease(int64_t sent) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyCancellations(const google::protobuf::RepeatedPtrField<v1::Cancellation>& cancellations,
                          const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReadPipe(JobRun* job, Rank* rank, int fd, bool is_stdout);
  void Wait(JobRun* job, Rank* rank);
  void Log(const std::string& job_id, int attempt, int rank, const std::string& stream,
           const std::string& line);
  // Queues a rank status after everything queued before it.
  void QueueStatus(v1::RankStatusRequest status, Rank* rank);
  void CloseBatch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(out_mu_);
  // Sends the queue in order; stops at the first report the coordinator
  // cannot take now (it is retried on the next call).
  void Flush() ABSL_LOCKS_EXCLUDED(send_mu_);
  void Reap() ABSL_LOCKS_EXCLUDED(mu_);
  std::string worker_id();
  std::unique_ptr<grpc::ClientContext> Context(absl::Duration timeout);

  const AgentOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::WorkerService::Stub> stub_;
  std::atomic<bool> stop_{false};
  // Set by the heartbeat thread once it has said the worker is leaving and
  // starts nothing more (Run stops the ranks after it); set by Run once
  // every rank has exited (the heartbeat thread ends then).
  std::atomic<bool> heartbeat_stopping_{false};
  std::atomic<bool> ranks_gone_{false};
  absl::Duration heartbeat_interval_ = absl::Seconds(1);  // the coordinator's
  // Heartbeat thread only: whether the last heartbeat was answered; since
  // when they fail, and when that was last said.
  bool reachable_ = true;
  absl::Time failing_since_, failing_said_;
  // Heartbeat thread only: HeartbeatRequest.beat of the last one sent.
  int64_t beats_ = 0;

  absl::Mutex id_mu_;
  std::string worker_id_ ABSL_GUARDED_BY(id_mu_);

  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<JobRun>> jobs_ ABSL_GUARDED_BY(mu_);  // "job-3/0"
  absl::Duration lease_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();  // 0: none granted yet
  // On the monotonic clock (MonotonicNanos), as the ranks judge it: a step
  // of the wall clock moves neither the agent's fence nor theirs.
  // RankLease::kNever while no lease was granted; the ranks' pages hold it.
  int64_t lease_until_ ABSL_GUARDED_BY(mu_) = RankLease::kNever;

  absl::Mutex out_mu_;
  Report batch_ ABSL_GUARDED_BY(out_mu_);  // telemetry and logs being gathered
  // TelemetryRequest.sender and the last .batch numbered: the coordinator
  // stores a batch sent again after a lost answer once.
  const uint64_t sender_ = std::random_device()() | (uint64_t{std::random_device()()} << 32);
  int64_t batches_ ABSL_GUARDED_BY(out_mu_) = 0;
  std::deque<Report> queue_ ABSL_GUARDED_BY(out_mu_);
  size_t queued_bytes_ ABSL_GUARDED_BY(out_mu_) = 0;
  int64_t dropped_lines_ ABSL_GUARDED_BY(out_mu_) = 0;
  absl::Mutex send_mu_;  // one Flush at a time, so reports keep their order

  // Runs functions on a thread of its own, one at a time, each call
  // returning once its function has. The ranks are spawned there: a rank's
  // parent-death signal (plateau_rank sets PR_SET_PDEATHSIG) fires when the
  // *thread* that spawned it exits, and this one lives as long as the
  // Agent. Assignments arrive on the heartbeat thread, which ends as soon as
  // the agent starts stopping: ranks spawned by it died of SIGKILL at once
  // and were reported as killed by signal 9 instead of stopped.
  class SpawnThread {
   public:
    SpawnThread();
    ~SpawnThread();
    void Run(const std::function<void()>& f);

   private:
    void Loop();
    absl::Mutex mu_;
    const std::function<void()>* task_ ABSL_GUARDED_BY(mu_) = nullptr;
    int64_t issued_ ABSL_GUARDED_BY(mu_) = 0, finished_ ABSL_GUARDED_BY(mu_) = 0;
    bool stop_ ABSL_GUARDED_BY(mu_) = false;
    std::thread thread_;  // last: started once the rest exists
  };
  SpawnThread spawner_;
};

}  // namespace plateau

#endif  // PLATEAU_WORKER_AGENT_H_
