#include "tests/cluster.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "worker/job_spec.h"

extern char** environ;

namespace plateau {
namespace testing_cluster {

namespace {

// $TEST_TMPDIR (Bazel gives every test its own), else a new directory of
// this process's own, made once.
const std::string& TempBase() {
  static const std::string* const base = [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    if (tmp != nullptr && *tmp != '\0') return new std::string(std::filesystem::absolute(tmp).string());
    char pattern[] = "/tmp/plateau-test-XXXXXX";
    return new std::string(mkdtemp(pattern) != nullptr ? pattern : "/tmp");
  }();
  return *base;
}

std::vector<std::string> CommandLine(pid_t pid) {
  const std::string cmd = ReadFile(absl::StrCat("/proc/", pid, "/cmdline"));
  return absl::StrSplit(cmd, '\0', absl::SkipEmpty());
}

bool NamesPathUnder(absl::string_view arg, const std::string& prefix) {
  if (absl::StartsWith(arg, "--")) {
    const size_t eq = arg.find('=');
    if (eq == absl::string_view::npos) return false;
    arg.remove_prefix(eq + 1);
  }
  return absl::StartsWith(arg, prefix);
}

}  // namespace

std::string TempDir(const std::string& name) {
  std::string dir = absl::StrCat(TempBase(), "/", name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool WaitFor(const std::function<bool()>& ready, absl::Duration deadline) {
  const absl::Time end = absl::Now() + deadline;
  while (absl::Now() < end) {
    if (ready()) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return ready();
}

char ProcState(pid_t pid) {
  const std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat"));
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? 0 : stat[paren + 2];
}

int64_t NewestCheckpointIn(const std::string& dir) {
  int64_t newest = -1;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    constexpr absl::string_view kPrefix = "step-", kSuffix = ".safetensors";
    int64_t step = 0;
    if (absl::StartsWith(name, kPrefix) && absl::EndsWith(name, kSuffix) &&
        absl::SimpleAtoi(absl::string_view(name).substr(
                             kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size()),
                         &step)) {
      newest = std::max(newest, step);
    }
  }
  return newest;
}

Process::Process(const std::vector<std::string>& args, const std::string& log_prefix) : log_(log_prefix) {
  std::vector<std::string> a = args;
  std::vector<char*> argv;
  for (std::string& s : a) argv.push_back(s.data());
  argv.push_back(nullptr);
  const std::string out = log_ + ".out", err = log_ + ".err";
  // Why exec failed, from the child: its errno through a pipe that exec
  // closes (nothing read: it started).
  int report[2];
  if (argv[0] == nullptr || pipe2(report, O_CLOEXEC) != 0) {
    spawn_error_ = absl::StrCat("cannot start ", args.empty() ? "(no command)" : args[0]);
    return;
  }
  const pid_t parent = getpid();
  pid_ = fork();
  if (pid_ == 0) {
    // Between fork and exec only async-signal-safe calls. Its own group
    // (Stop kills the group), and SIGKILL when the test process dies: a
    // test killed at its timeout, or crashed, runs no destructor, and its
    // coordinator and agents (in groups of their own, out of reach of the
    // test runner's kill) would train on and redial freed ports for ever.
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // it died before the prctl
    const int o = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int e = open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (o < 0 || e < 0 || dup2(o, 1) < 0 || dup2(e, 2) < 0) {
      const int why = errno;
      (void)!write(report[1], &why, sizeof(why));
      _exit(127);
    }
    close(o);
    close(e);
    execve(argv[0], argv.data(), environ);
    const int why = errno;
    (void)!write(report[1], &why, sizeof(why));
    _exit(127);
  }
  close(report[1]);
  if (pid_ < 0) {
    pid_ = 0;
    spawn_error_ = absl::StrCat("cannot start ", args[0], ": fork: ", std::strerror(errno));
    close(report[0]);
    return;
  }
  int why = 0;
  ssize_t n;
  do n = read(report[0], &why, sizeof(why));
  while (n < 0 && errno == EINTR);
  close(report[0]);
  if (n == sizeof(why)) {
    waitpid(pid_, &status_, 0);
    pid_ = 0;
    spawn_error_ = absl::StrCat("cannot start ", args[0], ": ", std::strerror(why));
  }
}

std::string Process::out() const { return ReadFile(log_ + ".out"); }
std::string Process::err() const { return ReadFile(log_ + ".err"); }

bool Process::Running() {
  if (pid_ == 0) return false;
  if (waitpid(pid_, &status_, WNOHANG) == 0) return true;
  kill(-pid_, SIGKILL);  // anything left in its group
  pid_ = 0;
  return false;
}

int Process::Stop(int sig) {
  if (pid_ == 0) return status_;
  kill(-pid_, sig);
  const absl::Time end = absl::Now() + absl::Seconds(20);
  while (waitpid(pid_, &status_, WNOHANG) == 0) {
    if (absl::Now() > end) {
      kill(-pid_, SIGKILL);
      waitpid(pid_, &status_, 0);
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  kill(-pid_, SIGKILL);  // anything left in its group
  pid_ = 0;
  return status_;
}

Ran RunCommand(const std::vector<std::string>& args, const std::string& log_prefix) {
  Process p(args, log_prefix);
  Ran r;
  // Without a child, waitpid(0, ...) below would wait for any child of the
  // test (a cluster's coordinator) instead of failing.
  if (p.pid() == 0) {
    r.err = p.spawn_error();
    return r;
  }
  int status = 0;
  const absl::Time end = absl::Now() + kDeadline;
  pid_t waited = 0;
  while ((waited = waitpid(p.pid(), &status, WNOHANG)) == 0 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  const bool exited = waited == p.pid();
  r.code = exited && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = p.out();
  r.err = p.err();
  return r;
}

std::string HttpGet(const std::string& address, const std::string& path) {
  std::vector<std::string> hp = absl::StrSplit(address, ':');
  int port = 0;
  if (hp.size() != 2 || !absl::SimpleAtoi(hp[1], &port)) return "";
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, hp[0].c_str(), &sa.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return "";
  }
  const std::string req = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", address, "\r\n\r\n");
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return "";
  }
  std::string resp;
  char buf[65536];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) resp.append(buf, static_cast<size_t>(n));
  close(fd);
  return resp;
}

RawHttp::RawHttp(const std::string& address) {
  std::vector<std::string> hp = absl::StrSplit(address, ':');
  int port = 0;
  if (hp.size() != 2 || !absl::SimpleAtoi(hp[1], &port)) return;
  fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, hp[0].c_str(), &sa.sin_addr);
  if (connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd_);
    fd_ = -1;
  }
}

RawHttp::~RawHttp() {
  if (fd_ >= 0) close(fd_);
}

bool RawHttp::Send(const std::string& bytes) {
  size_t sent = 0;
  while (fd_ >= 0 && sent < bytes.size()) {
    const ssize_t n = send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return fd_ >= 0;
}

std::string RawHttp::ReadAll(absl::Duration timeout) {
  std::string out;
  const absl::Time deadline = absl::Now() + timeout;
  char buf[65536];
  while (fd_ >= 0) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <= 0) continue;
    const ssize_t n = read(fd_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // closed, or reset
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

int HttpStatus(const std::string& response) {
  int status = 0;
  if (!absl::StartsWith(response, "HTTP/1.") || response.size() < 12 ||
      !absl::SimpleAtoi(response.substr(9, 3), &status)) {
    return 0;
  }
  return status;
}

std::string Scrape(const std::string& address) { return HttpGet(address, "/metrics"); }

double Sample(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StartsWith(line, series + " ")) {
      double v = 0;
      if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
    }
  }
  return NAN;
}

std::vector<pid_t> ProcessesUnder(const std::string& dir) {
  std::vector<pid_t> pids;
  if (dir.empty()) return pids;
  const std::string prefix = absl::StrCat(std::filesystem::absolute(dir).lexically_normal().string(), "/");
  DIR* d = opendir("/proc");
  if (d == nullptr) return pids;
  while (dirent* e = readdir(d)) {
    pid_t pid = 0;
    if (!absl::SimpleAtoi(e->d_name, &pid)) continue;
    for (const std::string& a : CommandLine(pid)) {
      if (NamesPathUnder(a, prefix)) {
        pids.push_back(pid);
        break;
      }
    }
  }
  closedir(d);
  return pids;
}

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(sa);
  if (bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return 0;
  }
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  close(fd);
  return ntohs(sa.sin_port);
}

RefusedAddress::RefusedAddress() : fd_(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(sa);
  // No SO_REUSEADDR: nobody else can bind the port while this holds it.
  if (fd_ < 0 || bind(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 ||
      getsockname(fd_, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    return;
  }
  address_ = absl::StrCat("127.0.0.1:", ntohs(sa.sin_port));
}

RefusedAddress::~RefusedAddress() {
  if (fd_ >= 0) close(fd_);
}

v1::JobSpec TinyJob(int64_t steps) {
  v1::JobSpec s = DemoJobSpec(2, steps);
  s.set_name("tiny");
  s.mutable_layout()->set_batch(4);
  // The demo leaves the bucket `auto`, chosen on the calibration of a worker
  // registered when the job is planned: pinned here, so that a plan made
  // before the cluster's worker has registered is the job's plan
  // (tests/auto_settings_test runs `auto` end to end).
  s.mutable_schedule()->mutable_offload_stream_adamw()->clear_bucket_params_auto();
  s.mutable_schedule()->mutable_offload_stream_adamw()->set_bucket_params(16384);
  return s;
}

Cluster::Cluster(const std::string& name, ClusterOptions options)
    : options_(std::move(options)), dir_(TempDir(name)) {
  ready_ = StartCoordinator(options_.listen);
  if (!ready_) return;
  ClientOptions co = options_.client;
  co.connection.address = api_;
  client_ = std::make_unique<Client>(co);
  if (options_.with_worker) StartWorker();
}

Cluster::~Cluster() {
  // Workers first: they stop their ranks; then the coordinator.
  for (auto& w : workers_) w->Stop();
  if (coordinator_) coordinator_->Stop();
}

bool Cluster::StartCoordinator(const std::string& listen) {
  const std::string ready_file = absl::StrCat(dir_, "/ready-", coordinator_starts_);
  std::vector<std::string> args = {"server/plateau_coordinator",
                                   "--state_dir=" + dir_ + "/state",
                                   "--listen=" + listen,
                                   "--metrics_address=127.0.0.1:0",
                                   "--ready_file=" + ready_file,
                                   absl::StrCat("--heartbeat_ms=", options_.heartbeat_ms)};
  if (options_.worker_timeout_s > 0) args.push_back(absl::StrCat("--worker_timeout_s=", options_.worker_timeout_s));
  args.insert(args.end(), options_.coordinator_flags.begin(), options_.coordinator_flags.end());
  coordinator_ = std::make_unique<Process>(args, absl::StrCat(dir_, "/coordinator-", coordinator_starts_));
  ++coordinator_starts_;
  if (!WaitFor([&] { return std::filesystem::exists(ready_file) || !coordinator_->Running(); })) return false;
  if (!std::filesystem::exists(ready_file)) return false;
  for (absl::string_view line : absl::StrSplit(ReadFile(ready_file), '\n')) {
    if (absl::StartsWith(line, "api=")) api_ = std::string(line.substr(4));
    if (absl::StartsWith(line, "metrics=")) metrics_ = std::string(line.substr(8));
  }
  return true;
}

Process* Cluster::StartWorker(const std::vector<std::string>& extra_flags,
                              const std::function<std::vector<std::string>(const std::vector<std::string>&)>& wrap) {
  const size_t n = workers_.size();
  std::vector<std::string> args = {"worker/plateau_worker",       "--coordinator=" + api_,
                                   "--devices=2",                 "--rank_binary=worker/plateau_rank",
                                   absl::StrCat("--work_dir=", dir_, "/work-", n), "--grace_s=3",
                                   "--device_peak_flops=1e11"};
  args.insert(args.end(), options_.worker_flags.begin(), options_.worker_flags.end());
  args.insert(args.end(), extra_flags.begin(), extra_flags.end());
  if (wrap) args = wrap(args);
  workers_.push_back(std::make_unique<Process>(args, absl::StrCat(dir_, "/worker-", n)));
  return workers_.back().get();
}

void Cluster::KillCoordinator(int sig) { coordinator_->Stop(sig); }

bool Cluster::RestartCoordinator() {
  // gRPC binds with SO_REUSEADDR: the old port is free again at once.
  ready_ = StartCoordinator(api_);
  return ready_;
}

std::string Cluster::Logs() const {
  std::string out;
  for (int i = 0; i < coordinator_starts_; ++i) {
    const std::string p = absl::StrCat(dir_, "/coordinator-", i);
    absl::StrAppend(&out, "--- coordinator ", i, ":\n", ReadFile(p + ".out"), ReadFile(p + ".err"));
  }
  for (size_t i = 0; i < workers_.size(); ++i) {
    absl::StrAppend(&out, "--- worker ", i, ":\n", workers_[i]->out(), workers_[i]->err());
  }
  return out;
}

std::vector<v1::JobEvent> Cluster::AllEvents(const std::string& id) {
  std::vector<v1::JobEvent> events;
  client_
      ->WatchJob(id, 0,
                 [&](const v1::JobEvent& e) {
                   events.push_back(e);
                   return true;
                 })
      .IgnoreError();
  return events;
}

v1::Job Cluster::WaitDone(const std::string& id) {
  v1::Job job;
  WaitFor([&] {
    auto j = client_->GetJob(id);
    if (j.ok()) job = *j;
    return j.ok() && (job.state() == v1::SUCCEEDED || job.state() == v1::FAILED || job.state() == v1::CANCELLED);
  });
  return job;
}

std::vector<pid_t> Cluster::RankPids(const std::string& id) const {
  std::vector<pid_t> pids;
  for (pid_t pid : ProcessesUnder(dir_)) {
    bool rank = false, job = false;
    for (const std::string& a : CommandLine(pid)) {
      rank = rank || absl::EndsWith(a, "/plateau_rank") || a == "plateau_rank";
      job = job || a == "--job_id=" + id;
    }
    if (rank && job) pids.push_back(pid);
  }
  return pids;
}

pid_t Cluster::RankPid(const std::string& id, int rank) const {
  for (pid_t p : RankPids(id)) {
    for (const std::string& a : CommandLine(p)) {
      if (a == absl::StrCat("--rank=", rank)) return p;
    }
  }
  return 0;
}

bool Cluster::WaitStep(const std::string& id, int64_t step) {
  bool reached = false;
  client_->WatchJob(id, 0, [&](const v1::JobEvent& e) {
             reached = e.has_job_step() && e.job_step().step() >= step;
             return !reached;
           })
      .IgnoreError();
  return reached;
}

}  // namespace testing_cluster
}  // namespace plateau
