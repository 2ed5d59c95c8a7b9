// A Plateau cluster of real processes on loopback for the end-to-end tests:
// a coordinator (real SQLite under a temporary directory, real /metrics),
// zero or more worker agents spawning real rank processes, and a C++ client.
// Ports are chosen by the OS and read back from --ready_file; a restarted
// coordinator listens on the port its predecessor had, so that running
// workers find it again.
//
// Also the small process, file and HTTP helpers those tests share.
#ifndef PLATEAU_TESTS_CLUSTER_H_
#define PLATEAU_TESTS_CLUSTER_H_

#include <signal.h>
#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "client/client.h"
#include "plateau/v1/job.pb.h"

namespace plateau {
namespace testing_cluster {

// Generous: a loaded 2-core machine runs these alongside other tests.
constexpr absl::Duration kDeadline = absl::Seconds(120);

// $TEST_TMPDIR/name, emptied; an absolute path. Outside Bazel (no
// TEST_TMPDIR) the base is a directory of this process's own under /tmp,
// never a fixed /tmp path another run could share.
std::string TempDir(const std::string& name);
std::string ReadFile(const std::string& path);
// Polls `ready` every 50 ms until it holds or the deadline passes.
bool WaitFor(const std::function<bool()>& ready, absl::Duration deadline = kDeadline);
// /proc/PID/stat's state letter ('T': stopped, 'Z': a zombie), or 0 when
// the process is gone.
char ProcState(pid_t pid);
// The step of the newest "step-N.safetensors" in dir (the trainer's
// naming, worker/trainer.cc), or -1 when there is none.
int64_t NewestCheckpointIn(const std::string& dir);

// A child process in its own process group, stdout and stderr to
// log_prefix.out / .err; the whole group is stopped when destroyed, and the
// process is killed (PR_SET_PDEATHSIG) when the thread that made it exits:
// make it on the test's main thread. When it cannot be started (a missing
// binary), pid() is 0, Running() is false and spawn_error() says why.
class Process {
 public:
  Process(const std::vector<std::string>& args, const std::string& log_prefix);
  ~Process() { Stop(); }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  // Empty when the process was started.
  const std::string& spawn_error() const { return spawn_error_; }
  std::string out() const;
  std::string err() const;
  // Sends `sig` to the group, SIGKILL after 20 s; returns the wait status.
  int Stop(int sig = SIGTERM);
  // True while the process has not exited (reaps it when it has).
  bool Running();

 private:
  std::string log_;
  std::string spawn_error_;
  pid_t pid_ = 0;
  int status_ = 0;
};

// Runs a command to completion (kDeadline at most).
struct Ran {
  int code = -1;  // exit code; -1 when killed, timed out or not started
  std::string out, err;  // err: the reason when the command could not start
};
Ran RunCommand(const std::vector<std::string>& args, const std::string& log_prefix);

// An HTTP/1.0 GET of `path` on HOST:PORT over a plain socket; the whole
// response (status line, headers, body), or "" when unreachable.
std::string HttpGet(const std::string& address, const std::string& path);
// A raw client connection to HOST:PORT (IPv4) for tests of odd HTTP
// requests: the bytes go out exactly as given, in as many pieces as the test
// sends them.
class RawHttp {
 public:
  explicit RawHttp(const std::string& address);
  ~RawHttp();
  RawHttp(const RawHttp&) = delete;
  RawHttp& operator=(const RawHttp&) = delete;

  bool connected() const { return fd_ >= 0; }
  // False once the server has closed or reset the connection.
  bool Send(const std::string& bytes);
  // Everything the server sends until it closes (or `timeout` passes).
  std::string ReadAll(absl::Duration timeout = absl::Seconds(30));

 private:
  int fd_ = -1;
};
// The status code of a response ("HTTP/1.1 404 Not Found..." -> 404), 0 when
// there is none (nothing came back).
int HttpStatus(const std::string& response);
// GET /metrics: what Prometheus does.
std::string Scrape(const std::string& address);
// The value of the sample `series` ("name{labels}", labels as the exposition
// orders them: prometheus-cpp sorts them by name), or NaN when absent.
double Sample(const std::string& text, const std::string& series);
// Pids of the processes in the process table whose command line names a
// path below `dir` (an argument, or a --flag=value's value, starting with
// dir + "/"). Without a PID namespace (Bazel's processwrapper-sandbox, most
// containers) /proc shows every test's processes: a test finds its own by its
// own directory, never by a name (a binary, a job id) another test shares.
std::vector<pid_t> ProcessesUnder(const std::string& dir);
// A free TCP port on 127.0.0.1, bound, then released: another process may
// take it before it is used. Prefer port 0 and a ready file; a caller of this
// must retry on "address in use" (or hold the port, as RefusedAddress does).
int FreePort();

// An address on 127.0.0.1 where nothing listens, for as long as this lives:
// the port stays bound (never listened on), so connections are refused and no
// other process can take it meanwhile.
class RefusedAddress {
 public:
  RefusedAddress();
  ~RefusedAddress();
  RefusedAddress(const RefusedAddress&) = delete;
  RefusedAddress& operator=(const RefusedAddress&) = delete;
  // "127.0.0.1:PORT"; "" when no port could be bound.
  const std::string& address() const { return address_; }

 private:
  int fd_ = -1;
  std::string address_;
};

// The demo's model on a tiny batch: a few seconds per 100 steps here.
v1::JobSpec TinyJob(int64_t steps);

struct ClusterOptions {
  // The coordinator's --listen (port 0: chosen by the OS); another address
  // than loopback needs a token or --insecure_listen_any among
  // coordinator_flags.
  std::string listen = "127.0.0.1:0";
  bool with_worker = true;
  double worker_timeout_s = 10;  // 0: the coordinator's default (two heartbeats)
  int heartbeat_ms = 200;
  std::vector<std::string> coordinator_flags;  // appended to the defaults
  std::vector<std::string> worker_flags;
  // Options of the test's Client (auth, TLS); the address is filled in.
  ClientOptions client;
};

class Cluster {
 public:
  explicit Cluster(const std::string& name, ClusterOptions options = {});
  ~Cluster();

  bool ready() const { return ready_ && !api_.empty() && !metrics_.empty(); }
  Client& client() { return *client_; }
  const std::string& api() const { return api_; }
  const std::string& metrics() const { return metrics_; }
  const std::string& dir() const { return dir_; }
  Process* coordinator() { return coordinator_.get(); }
  // The first worker (nullptr when none).
  Process* worker() { return workers_.empty() ? nullptr : workers_[0].get(); }
  Process* worker(size_t i) { return workers_.at(i).get(); }

  // Starts one more worker agent (its work dir: dir/work-<n>). `wrap`, when
  // given, turns the agent's command line into the one started
  // (TestNetwork::InHost: the agent in a network namespace of its own).
  Process* StartWorker(const std::vector<std::string>& extra_flags = {},
                       const std::function<std::vector<std::string>(const std::vector<std::string>&)>& wrap = {});
  // Kills the coordinator with `sig` and waits for it to exit.
  void KillCoordinator(int sig);
  // Starts a coordinator on the same state directory and API port; true
  // once it is serving.
  bool RestartCoordinator();

  std::string Logs() const;
  // Waits for the job's final state (kDeadline at most).
  v1::Job WaitDone(const std::string& id);
  // Every event of the job from index 0, in order: a watch to its end (it
  // ends after the final state; for a live job this waits for it).
  std::vector<v1::JobEvent> AllEvents(const std::string& id);
  // Watches until the job's step `step` is an event (every rank reported it).
  bool WaitStep(const std::string& id, int64_t step);

  // Pids of this cluster's plateau_rank processes of job `id`: those below
  // dir() (ProcessesUnder: their --spec_file lies in a worker's work dir),
  // including ranks whose worker is gone. Another cluster's job of the same
  // id, in this test or in one running beside it, is never among them.
  std::vector<pid_t> RankPids(const std::string& id) const;
  // Pid of rank `rank` of this cluster's job `id`, or 0.
  pid_t RankPid(const std::string& id, int rank) const;

 private:
  bool StartCoordinator(const std::string& listen);

  ClusterOptions options_;
  std::string dir_, api_, metrics_;
  bool ready_ = false;
  int coordinator_starts_ = 0;
  std::unique_ptr<Process> coordinator_;
  std::vector<std::unique_ptr<Process>> workers_;
  std::unique_ptr<Client> client_;
};

}  // namespace testing_cluster
}  // namespace plateau

#endif  // PLATEAU_TESTS_CLUSTER_H_
