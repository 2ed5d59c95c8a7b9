#include "tests/netns.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/cluster.h"

namespace plateau {
namespace testing_cluster {
namespace {

// posix_spawn takes no PATH: the tools by their usual places.
std::string Tool(const std::string& name) {
  for (const char* dir : {"/usr/sbin", "/sbin", "/usr/bin", "/bin"}) {
    const std::string p = absl::StrCat(dir, "/", name);
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

// A child in a new network namespace, alive until killed or the thread
// that forked it (the test's main thread) ends: PR_SET_PDEATHSIG. Only
// async-signal-safe calls after fork (the test has threads).
absl::StatusOr<pid_t> HoldNamespace() {
  int ready[2];
  if (pipe2(ready, O_CLOEXEC) != 0) return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    char result = unshare(CLONE_NEWNET) == 0 ? 0 : static_cast<char>(errno);
    if (write(ready[1], &result, 1) != 1 || result != 0) _exit(1);
    while (true) pause();
  }
  close(ready[1]);
  char result = 1;
  const bool got = read(ready[0], &result, 1) == 1;
  close(ready[0]);
  if (!got || result != 0) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    return absl::PermissionDeniedError(absl::StrCat("unshare(CLONE_NEWNET) failed: ",
                                                    got ? std::strerror(result) : "the child died",
                                                    " (needs CAP_NET_ADMIN: run as root, outside a container "
                                                    "without it)"));
  }
  return pid;
}

}  // namespace

absl::Status TestNetwork::Ip(pid_t holder, const std::vector<std::string>& args) {
  std::vector<std::string> cmd;
  if (holder != 0) cmd = {Tool("nsenter"), absl::StrCat("--net=/proc/", holder, "/ns/net")};
  cmd.push_back(Tool("ip"));
  cmd.insert(cmd.end(), args.begin(), args.end());
  const Ran r = RunCommand(cmd, absl::StrCat(log_dir_, "/net-", commands_++));
  if (r.code == 0) return absl::OkStatus();
  // Not a permission problem: the namespaces exist, so this one has
  // CAP_NET_ADMIN; a failure here is the test's own, and fails it.
  return absl::InternalError(
      absl::StrCat("`", absl::StrJoin(cmd, " "), "` failed (exit ", r.code, "): ", r.err, r.out));
}

absl::StatusOr<std::unique_ptr<TestNetwork>> TestNetwork::Create(int hosts, const std::string& log_dir) {
  if (Tool("ip").empty() || Tool("nsenter").empty()) {
    return absl::FailedPreconditionError("needs `ip` (iproute2) and `nsenter` (util-linux)");
  }
  std::unique_ptr<TestNetwork> net(new TestNetwork());
  net->log_dir_ = log_dir;
  auto held = HoldNamespace();
  if (!held.ok()) return held.status();
  net->hub_ = *held;
  for (int i = 0; i < hosts; ++i) {
    auto h = HoldNamespace();
    if (!h.ok()) return h.status();
    net->hosts_.push_back({*h, ""});
  }
  // A subnet no route here covers, and a link name no other test shares
  // (interface names are at most 15 characters).
  std::mt19937 rng(std::random_device{}() ^ static_cast<unsigned>(getpid()));
  std::string routes = RunCommand({Tool("ip"), "-4", "route", "show", "table", "all"}, log_dir + "/routes").out;
  std::string prefix;
  for (int tries = 0; tries < 50 && prefix.empty(); ++tries) {
    const std::string p = absl::StrCat("10.", 200 + rng() % 50, ".", rng() % 256, ".");
    if (!absl::StrContains(routes, p)) prefix = p;
  }
  if (prefix.empty()) return absl::InternalError("no free 10.x.y.0/24 subnet for the test network");
  const std::string link = absl::StrCat("pl", getpid() % 100000, "x", rng() % 10000);
  net->hub_address_ = prefix + "1";
  const std::string hub = std::to_string(net->hub_);
  auto steps = [&]() -> absl::Status {
    if (absl::Status s = net->Ip(0, {"link", "add", link, "type", "veth", "peer", "name", "up0", "netns", hub});
        !s.ok()) {
      return s;
    }
    for (const std::vector<std::string>& a : std::vector<std::vector<std::string>>{
             {"addr", "add", net->hub_address_ + "/24", "dev", link}, {"link", "set", link, "up"}}) {
      if (absl::Status s = net->Ip(0, a); !s.ok()) return s;
    }
    for (const std::vector<std::string>& a : std::vector<std::vector<std::string>>{
             {"link", "set", "lo", "up"},
             {"link", "add", "br0", "type", "bridge"},
             {"link", "set", "br0", "up"},
             {"link", "set", "up0", "master", "br0"},
             {"link", "set", "up0", "up"}}) {
      if (absl::Status s = net->Ip(net->hub_, a); !s.ok()) return s;
    }
    for (size_t i = 0; i < net->hosts_.size(); ++i) {
      Host& h = net->hosts_[i];
      h.address = absl::StrCat(prefix, 10 + i);
      const std::string port = absl::StrCat("h", i);
      for (const std::vector<std::string>& a : std::vector<std::vector<std::string>>{
               {"link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", std::to_string(h.holder)},
               {"link", "set", port, "master", "br0"},
               {"link", "set", port, "up"}}) {
        if (absl::Status s = net->Ip(net->hub_, a); !s.ok()) return s;
      }
      for (const std::vector<std::string>& a : std::vector<std::vector<std::string>>{
               {"link", "set", "lo", "up"}, {"addr", "add", h.address + "/24", "dev", "eth0"}, {"link", "set", "eth0", "up"}}) {
        if (absl::Status s = net->Ip(h.holder, a); !s.ok()) return s;
      }
    }
    return absl::OkStatus();
  };
  if (absl::Status s = steps(); !s.ok()) return s;  // ~TestNetwork takes down what was made
  return net;
}

TestNetwork::~TestNetwork() {
  // The namespaces go with their holders, and every link with them.
  if (hub_ != 0) kill(hub_, SIGKILL);
  for (const Host& h : hosts_) kill(h.holder, SIGKILL);
  if (hub_ != 0) waitpid(hub_, nullptr, 0);
  for (const Host& h : hosts_) waitpid(h.holder, nullptr, 0);
}

std::vector<std::string> TestNetwork::InHost(int i, const std::vector<std::string>& args) const {
  std::vector<std::string> out = {Tool("nsenter"), absl::StrCat("--net=/proc/", hosts_.at(i).holder, "/ns/net"), "--"};
  out.insert(out.end(), args.begin(), args.end());
  return out;
}

absl::Status TestNetwork::Cut(int i) { return Ip(hub_, {"link", "set", absl::StrCat("h", i), "down"}); }
absl::Status TestNetwork::Restore(int i) { return Ip(hub_, {"link", "set", absl::StrCat("h", i), "up"}); }

}  // namespace testing_cluster
}  // namespace plateau
