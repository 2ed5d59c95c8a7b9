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
// would otherwise wait on a dead peer until the collective timeout).
//
// Thread safety: Run() on one thread; RequestStop() from any thread or a
// signal-handling thread.
#ifndef PLATEAU_WORKER_AGENT_H_
#define PLATEAU_WORKER_AGENT_H_

#include <sys/types.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "plateau/v1/worker.grpc.pb.h"

namespace plateau {

struct AgentOptions {
  std::string coordinator;  // host:port
  // Opened by client/connection.h's OpenChannel (TLS, bearer token);
  // nullptr: plaintext, no token. The two files are passed on to the ranks,
  // whose rendezvous calls need them too.
  std::shared_ptr<grpc::Channel> channel;
  std::string token_file;
  std::string tls_ca_file;
  v1::WorkerCapabilities capabilities;
  std::string rank_binary;  // plateau_rank
  std::string work_dir;     // spec files of running jobs
  absl::Duration grace = absl::Seconds(5);
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
    pid_t pid = 0;
    bool exited = false;
    bool stop_sent = false;
    v1::RankError last_error;
    std::vector<std::thread> readers;
    std::thread waiter;
  };
  struct JobRun {
    std::string job_id;
    int attempt = 0;
    std::vector<std::unique_ptr<Rank>> ranks;
    bool stopping = false;
    absl::Time kill_at = absl::InfiniteFuture();
  };

  absl::Status RegisterNow();
  void HeartbeatOnce();
  void Start(const v1::Assignment& a);
  void StopJob(JobRun& job, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void KillOverdue() ABSL_LOCKS_EXCLUDED(mu_);
  void ReadPipe(JobRun* job, Rank* rank, int fd, bool is_stdout);
  void Wait(JobRun* job, Rank* rank);
  void Log(const std::string& job_id, int attempt, int rank, const std::string& stream,
           const std::string& line);
  void Flush() ABSL_LOCKS_EXCLUDED(send_mu_);
  void Reap() ABSL_LOCKS_EXCLUDED(mu_);
  std::unique_ptr<grpc::ClientContext> Context(absl::Duration timeout);

  const AgentOptions options_;
  std::unique_ptr<v1::WorkerService::Stub> stub_;
  std::atomic<bool> stop_{false};
  std::string worker_id_;
  absl::Duration heartbeat_interval_ = absl::Milliseconds(500);  // the coordinator's
  bool reachable_ = true;

  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<JobRun>> jobs_ ABSL_GUARDED_BY(mu_);  // "job-3/0"

  absl::Mutex out_mu_;
  v1::TelemetryRequest outbox_ ABSL_GUARDED_BY(out_mu_);
  absl::Mutex send_mu_;  // one Flush at a time, so reports keep their order
};

}  // namespace plateau

#endif  // PLATEAU_WORKER_AGENT_H_
