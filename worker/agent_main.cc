// plateau_worker: the node agent (worker/agent.h). One per node.
//
//   plateau_worker --coordinator=127.0.0.1:7070 [--backend=cpu] [--devices=2]
//       [--device_memory_bytes=auto] [--host_memory_bytes=0]
//       [--rank_address=127.0.0.1] [--device_peak_flops=0] [--device_peak_bf16_flops=0] [--name=HOST]
//       [--rank_binary=<plateau_rank beside this binary>] [--work_dir=DIR]
//       [--grace_s=5] [--teardown_s=60] [--token_file=PATH]
//       [--tls_ca_file=PATH [--tls_client_cert_file=PATH --tls_client_key_file=PATH]] [--calibrate=true]
//
// Before registering it measures its backend for the time model of the
// `auto` settings (worker/calibration.h; well under a second), or reads the
// measurement cached in --work_dir by an earlier start of the same binaries
// on the same backend, and registers with it.
//
// SIGINT/SIGTERM stop every rank it started (SIGTERM, then SIGKILL after
// the grace period) and exit once they are gone.
#include <fcntl.h>
#include <netdb.h>
#include <signal.h>
#include <spawn.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/connection.h"
#include "google/protobuf/text_format.h"
#include "kernels/backend.h"  // BackendKind
#include "kernels/named_flags.h"
#include "worker/agent.h"
#include "worker/assignment.h"
#include "worker/calibration.h"
#include "worker/device_slots.h"
#include "worker/dir_lock.h"

namespace plateau {
namespace {

// What a CPU worker's `auto` offers: the largest arena one of its ranks
// may ask for.
constexpr int64_t kCpuDeviceMemoryBytes = int64_t{1} << 30;

constexpr char kUsage[] = R"(usage: plateau_worker --coordinator=HOST:PORT [--name=value ...]

  --coordinator=127.0.0.1:7070     the coordinator's API address
  --backend=cpu                    cpu or cuda
  --devices=2                      rank slots (GPUs; on the CPU, ranks it runs at once)
  --device_memory_bytes=auto       per device; auto: CUDA, the smallest GPU's memory less a reserve
                                   of a sixteenth of it, at least 2 GiB (read at start); CPU, 1 GiB
                                   (the largest arena a rank may ask for)
  --host_memory_bytes=0            0: not reported
  --device_peak_flops=0            fp32 peak FLOP/s per device, MFU of fp32 steps; 0: by device name (cuda)
  --device_peak_bf16_flops=0       bf16 dense peak FLOP/s per device, MFU of bf16 steps; 0: by device name
  --rank_address=127.0.0.1         where this node's ranks listen for their peers
  --name=HOST                      shown in the coordinator's view
  --rank_binary=PATH               plateau_rank (default: beside this binary)
  --work_dir=DIR                   spec files of running jobs and the calibration cache
                                   (default: a temp dir, removed at exit)
  --grace_s=5                      SIGTERM to SIGKILL on cancel
  --teardown_s=60                  a rank that said it is exiting (its work over, its error reported) and
                                   is still tearing down this long after is killed; its exit is reported
                                   with the code it said
  --token_file=PATH                the coordinator's bearer token (its --token_file; the first line),
                                   sent on every call, read again when it changes;
                                   passed on to the ranks for their rendezvous calls
  --tls_ca_file=PATH               PEM CA of the coordinator's certificate: TLS on (ranks too)
  --tls_client_cert_file=PATH      PEM certificate chain of this worker, for a coordinator that
                                   requires client certificates (its --tls_client_ca_file); ranks too
  --tls_client_key_file=PATH       PEM private key of that certificate
  --allowed_paths=DIR,DIR          the directories a job's data and checkpoint paths must lie in
                                   (links resolved); a job naming another fails INVALID. Empty (the
                                   default): any path this agent's user can reach
  --calibrate=true                 measure the backend for the `auto` settings' time model (cached in
                                   --work_dir); false: register without, the coordinator's default curve
)";

int Fail(const std::string& msg) {
  std::fprintf(stderr, "plateau_worker: %s\n", msg.c_str());
  return 2;
}

// Runs plateau_rank with `args` (argv[0] first) in `env` ("NAME=value"
// entries; empty: this process's environment), its stdout and stderr into
// `log`, for at most `limit`: "" when it exits 0, else why not. What it
// said is left in *said, its last newline dropped.
std::string RunRankBinary(std::vector<std::string> args, std::vector<std::string> env, const std::string& log,
                          absl::Duration limit, std::string* said) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), env.empty() ? environ : envp.data());
  posix_spawn_file_actions_destroy(&fa);
  std::string why;
  if (spawned != 0) {
    why = absl::StrCat("cannot start ", args[0], ": ", strerror(spawned));
  } else {
    int status = 0;
    const absl::Time deadline = absl::Now() + limit;
    bool killed = false;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (absl::Now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        killed = true;
        break;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    if (killed) {
      why = absl::StrCat("it did not finish in ", absl::FormatDuration(limit));
    } else if (WIFSIGNALED(status)) {
      why = absl::StrCat("it was killed by signal ", WTERMSIG(status));
    } else if (WEXITSTATUS(status) != 0) {
      why = absl::StrCat("it exited with code ", WEXITSTATUS(status));
    }
  }
  std::ifstream in(log);
  said->assign((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!said->empty() && said->back() == '\n') said->pop_back();
  return why;
}

// Sets o->capabilities.calibration: plateau_rank --calibrate_dir measures
// the backend (or finds its cache in the work dir still valid) and leaves
// the result in the cache file, which this reads. The rank binary measures
// because it is the one that trains, and so that the agent links no
// compute (tools/check-deps). A worker that cannot calibrate still works:
// it registers without one and says why.
void Calibrate(AgentOptions* o) {
  std::error_code ec;
  std::filesystem::create_directories(o->work_dir, ec);
  const bool cuda = o->capabilities.backend() == v1::BACKEND_CUDA;
  std::string said;
  std::vector<std::string> args = {o->rank_binary, absl::StrCat("--calibrate_dir=", o->work_dir),
                                   absl::StrCat("--backend=", cuda ? "cuda" : "cpu")};
  // What one rank has when the slots are all busy: on the CPU its share of
  // the cores (measured with all of them, a rank's GEMM rate was the node's,
  // its slots' ranks' times too fast by their count); on CUDA the GPU of
  // slot 0 as its ranks see it (CUDA_VISIBLE_DEVICES naming it), not
  // whatever device 0 of the agent's environment is.
  std::vector<std::string> env;
  if (!cuda) {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    args.push_back(absl::StrCat("--calibrate_threads=", std::max(1, cores / o->capabilities.devices())));
  } else {
    const std::vector<std::string> base_env = ProcessEnvironment();
    std::string visible;
    absl::StatusOr<std::vector<std::string>> slot0 = CudaRankEnvironment(base_env, 0, &visible);
    if (slot0.ok()) env = *std::move(slot0);
  }
  // Well under a second when it measures; a minute means it is stuck.
  std::string why = RunRankBinary(std::move(args), std::move(env), absl::StrCat(o->work_dir, "/calibration.log"),
                                  absl::Seconds(60), &said);
  if (!why.empty()) why = absl::StrCat("the measurement failed (", why, ")");
  v1::Calibration c;
  if (why.empty()) {
    const std::string path = CalibrationCachePath(o->work_dir, cuda ? BackendKind::kCuda : BackendKind::kCpu);
    std::ifstream cache(path);
    std::string text((std::istreambuf_iterator<char>(cache)), std::istreambuf_iterator<char>());
    if (!google::protobuf::TextFormat::ParseFromString(text, &c) || !CalibrationFromProto(c).ok()) {
      why = absl::StrCat("cannot read ", path);
    } else {
      std::printf("plateau_worker: calibration %s (%s)\n", said.c_str(), path.c_str());
      std::fflush(stdout);
      *o->capabilities.mutable_calibration() = std::move(c);
      return;
    }
  }
  std::fprintf(stderr, "plateau_worker: no calibration (%s: %s): `auto` settings use the coordinator's default curve\n",
               why.c_str(), said.c_str());
}

// The device memory a CUDA worker offers per GPU when --device_memory_bytes
// is `auto`: the smallest of its GPUs' memory less a reserve. Each slot's
// GPU is read as its ranks will see it, by plateau_rank --probe_devices=1
// in the environment a rank of that slot gets (CUDA_VISIBLE_DEVICES naming
// that one GPU: worker/device_slots.h), which prints "device 0: NAME,
// TOTAL bytes"; its log is probe-SLOT.log in the work dir. One process per
// slot, as the ranks are: a process may see only one MIG instance.
//
// The reserve is what the plan leaves beside the step's buffers: the CUDA
// context, NCCL's and cuBLAS's buffers, the pool's fragmentation
// (kernels/cuda/cuda_backend.h). A sixteenth of the card, at least 2 GiB: an
// H200's 140.4 GiB offers 131.6, above the 128 GiB docs/FRONTIER.md plans
// with. A setting, not a measurement (issue 17's device check will
// measure the libraries' share); --device_memory_bytes=N overrides it.
constexpr int64_t kAutoReserveDivisor = 16;
constexpr int64_t kAutoReserveMinBytes = int64_t{2} << 30;
int64_t OfferedDeviceMemory(int64_t total) {
  return std::max<int64_t>(0, total - std::max(total / kAutoReserveDivisor, kAutoReserveMinBytes));
}

absl::StatusOr<int64_t> ProbeDeviceMemory(const AgentOptions& o) {
  const std::vector<std::string> base_env = ProcessEnvironment();
  const std::string fix = "; give --devices at most the GPUs this worker may use, or --device_memory_bytes as a number";
  int64_t smallest = -1;
  for (int slot = 0; slot < o.capabilities.devices(); ++slot) {
    std::string visible;
    absl::StatusOr<std::vector<std::string>> env = CudaRankEnvironment(base_env, slot, &visible);
    if (!env.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--device_memory_bytes=auto: cannot read the GPUs' memory: ", env.status().message(), fix));
    }
    std::string said;
    const std::string why = RunRankBinary({o.rank_binary, "--backend=cuda", "--probe_devices=1"}, *std::move(env),
                                          absl::StrCat(o.work_dir, "/probe-", slot, ".log"), absl::Seconds(60), &said);
    // Its line among anything else the runtime or the backend printed.
    int64_t total = 0;
    bool read = false;
    for (absl::string_view line : absl::StrSplit(said, '\n')) {
      const size_t comma = line.rfind(", ");
      if (absl::StartsWith(line, "device 0: ") && comma != absl::string_view::npos) {
        read = absl::SimpleAtoi(absl::StripSuffix(line.substr(comma + 2), " bytes"), &total) && total > 0;
      }
    }
    read = read && why.empty();
    if (!read) {
      return absl::FailedPreconditionError(absl::StrCat("--device_memory_bytes=auto: cannot read the memory of slot ",
                                                        slot, "'s GPU (CUDA_VISIBLE_DEVICES=", visible, "; ",
                                                        why.empty() ? "it said no size" : why, "): ", said, fix));
    }
    smallest = smallest < 0 ? total : std::min(smallest, total);
  }
  const int64_t offered = OfferedDeviceMemory(smallest);
  // 0 would tell the coordinator "not said", which it places anything on.
  if (offered <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--device_memory_bytes=auto: the smallest GPU has ", smallest, " bytes, not more than the ",
                     kAutoReserveMinBytes,
                     " bytes kept for the CUDA context and the libraries; give --device_memory_bytes "
                     "as a number to offer some of it"));
  }
  return offered;
}

// Ranks bind their collectives to --rank_address: one that does not
// resolve, or is not an address of this host, would fail every job at its
// ranks' rendezvous (RANK_CRASHED, restarted for nothing). Checked by
// binding a socket there, as a rank will.
absl::Status CheckRankAddress(const std::string& address) {
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(address.c_str(), nullptr, &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--rank_address=", address,
                                                   ": cannot resolve it (", gai_strerror(rc),
                                                   "); expected an address or name of this host"));
  }
  std::string why;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const bool bound =
        bind(fd, a->ai_addr, a->ai_addrlen) == 0;  // port 0 in the address: any free port
    if (!bound) why = strerror(errno);
    close(fd);
    if (bound) {
      freeaddrinfo(found);
      return absl::OkStatus();
    }
  }
  freeaddrinfo(found);
  return absl::InvalidArgumentError(
      absl::StrCat("--rank_address=", address, ": not an address of this host (",
                   why.empty() ? "no socket" : why, "); the ranks listen there for their peers"));
}

int Main(int argc, char** argv) {
  // Every plateau_rank this agent starts checks that its parent is this
  // process (worker/rank_main.cc): by pid, since in a container the agent
  // may itself be pid 1, the pid an orphan's parent becomes. Set before
  // any thread starts (setenv is not thread-safe).
  setenv("PLATEAU_AGENT_PID", absl::StrCat(getpid()).c_str(), /*overwrite=*/1);
  char host[256] = "localhost";
  gethostname(host, sizeof(host) - 1);
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  std::map<std::string, std::string> f = {
      {"coordinator", "127.0.0.1:7070"},
      {"backend", "cpu"},
      {"devices", "2"},
      {"device_memory_bytes", "auto"},
      {"host_memory_bytes", "0"},
      {"device_peak_flops", "0"},
      {"device_peak_bf16_flops", "0"},
      {"rank_address", "127.0.0.1"},
      {"name", host},
      {"rank_binary", (self.parent_path() / "plateau_rank").string()},
      {"work_dir", (std::filesystem::temp_directory_path() / absl::StrCat("plateau-worker-", getpid())).string()},
      {"grace_s", "5"},
      {"teardown_s", "60"},
      {"calibrate", "true"},
      {"allowed_paths", ""}};
  for (const char* name : kConnectionFileFlags) f[name] = "";
  const std::map<std::string, std::string> defaults = f;
  absl::StatusOr<bool> help = ParseNamedFlags(argc, argv, &f);
  if (!help.ok()) return Fail(std::string(help.status().message()));
  if (*help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  AgentOptions o;
  o.coordinator = f["coordinator"];
  v1::WorkerCapabilities& c = o.capabilities;
  if (f["backend"] == "cpu") {
    c.set_backend(v1::BACKEND_CPU);
  } else if (f["backend"] == "cuda") {
    c.set_backend(v1::BACKEND_CUDA);
  } else {
    return Fail(absl::StrCat("--backend: expected cpu or cuda, got '", f["backend"], "'"));
  }
  int32_t devices = 0;
  int64_t dev_mem = 0, host_mem = 0;
  double peak = 0, grace = 0, teardown = 0;
  // The coordinator's limit (WorkerRegistry::CheckCapabilities), named by
  // this flag rather than refused at registration.
  if (!absl::SimpleAtoi(f["devices"], &devices) || devices < 1 || devices > 4096) {
    return Fail(
        absl::StrCat("--devices: expected an integer from 1 to 4096, got '", f["devices"], "'"));
  }
  // -1 until the probe (after the work dir, which its log goes to).
  if (f["device_memory_bytes"] == "auto") {
    dev_mem = c.backend() == v1::BACKEND_CUDA ? -1 : kCpuDeviceMemoryBytes;
  } else if (!absl::SimpleAtoi(f["device_memory_bytes"], &dev_mem) || dev_mem < 0) {
    return Fail(
        absl::StrCat("--device_memory_bytes: expected auto or an integer >= 0, got '", f["device_memory_bytes"], "'"));
  }
  if (!absl::SimpleAtoi(f["host_memory_bytes"], &host_mem) || host_mem < 0) {
    return Fail("--host_memory_bytes: expected an integer >= 0");
  }
  if (!absl::SimpleAtod(f["device_peak_flops"], &peak) || peak < 0) {
    return Fail("--device_peak_flops: expected a number >= 0");
  }
  double peak_bf16 = 0;
  if (!absl::SimpleAtod(f["device_peak_bf16_flops"], &peak_bf16) || peak_bf16 < 0) {
    return Fail("--device_peak_bf16_flops: expected a number >= 0");
  }
  if (!absl::SimpleAtod(f["grace_s"], &grace) || !(grace >= 0)) return Fail("--grace_s: expected seconds >= 0");
  if (!absl::SimpleAtod(f["teardown_s"], &teardown) || !(teardown > 0) || teardown > 86400) {
    return Fail(absl::StrCat("--teardown_s: expected seconds > 0 and at most 86400, got '", f["teardown_s"], "'"));
  }
  if (access(f["rank_binary"].c_str(), X_OK) != 0) {
    return Fail(absl::StrCat("--rank_binary: ", f["rank_binary"], " is not an executable"));
  }
  c.set_devices(devices);
  c.set_device_memory_bytes(dev_mem);
  c.set_host_memory_bytes(host_mem);
  c.set_device_peak_flops(peak);
  c.set_device_peak_bf16_flops(peak_bf16);
  if (absl::Status s = CheckAddress("--coordinator", f["coordinator"], /*listen=*/false); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  if (absl::Status s = CheckRankAddress(f["rank_address"]); !s.ok())
    return Fail(std::string(s.message()));
  c.set_rank_address(f["rank_address"]);
  // Ranks bind their collectives to --rank_address and peers on other
  // nodes connect to it: loopback only works while every worker of a job
  // shares this host. Said at start, not discovered as a rendezvous timeout.
  {
    const std::string host = f["coordinator"].substr(0, f["coordinator"].rfind(':'));
    const auto loopback = [](const std::string& h) {
      return h == "localhost" || h.rfind("127.", 0) == 0 || h == "::1" || h == "[::1]";
    };
    if (loopback(f["rank_address"]) && !loopback(host)) {
      std::fprintf(stderr,
                   "plateau_worker: WARNING: --rank_address=%s is loopback but the coordinator is at %s: ranks of a "
                   "job placed across nodes could not reach this node's ranks; set --rank_address to this node's "
                   "address on the network the other workers share\n",
                   f["rank_address"].c_str(), f["coordinator"].c_str());
    }
  }
  c.set_name(f["name"]);
  o.rank_binary = f["rank_binary"];
  absl::StatusOr<std::vector<std::string>> allowed = AllowedPaths(f["allowed_paths"]);
  if (!allowed.ok()) return Fail(std::string(allowed.status().message()));
  o.allowed_paths = *std::move(allowed);
  o.work_dir = f["work_dir"];
  o.grace = absl::Seconds(grace);
  o.teardown = absl::Seconds(teardown);
  // Absolute: the ranks read the same files.
  o.files = AbsoluteConnectionFiles(ConnectionFilesFromFlags(f));
  if (f["calibrate"] != "true" && f["calibrate"] != "false") {
    return Fail(absl::StrCat("--calibrate: expected true or false, got '", f["calibrate"], "'"));
  }
  // Held until exit, from before the calibration (whose cache is here):
  // two agents on one work dir would register as one worker, the second's
  // calibration replacing the first's, and share their spec files.
  // A default work dir is this process's own: removed at every exit from
  // here on, a failed start's too. A work dir of the user's keeps the
  // calibration cache for the next start.
  bool temporary_work_dir = false;
  absl::Cleanup remove_temporary_work_dir = [&] {
    std::error_code removing;
    if (temporary_work_dir) std::filesystem::remove_all(o.work_dir, removing);
  };
  if (f["work_dir"] == defaults.at("work_dir")) {
    // The default: a new directory of its own (mkdtemp), never one a
    // killed agent of a reused pid left behind with its worker id.
    std::string pattern = (std::filesystem::temp_directory_path() / "plateau-worker-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) {
      return Fail(absl::StrCat("cannot make a temporary work dir (", pattern, "): ", strerror(errno)));
    }
    o.work_dir = pattern;
    temporary_work_dir = true;
  }
  std::filesystem::create_directories(o.work_dir, ec);
  if (ec) return Fail(absl::StrCat("--work_dir=", o.work_dir, ": ", ec.message()));
  // The agent writes its worker id, calibration and every job's spec there
  // (which its ranks then run): a directory another user made (in /tmp
  // before this agent, a predictable name) would let them swap a spec or
  // plant a link. Not a link, and this user's; one of ours that others can
  // write (a umask of 002, a Kubernetes emptyDir's 0777) is closed to them
  // here, said once.
  {
    struct stat st;
    if (lstat(o.work_dir.c_str(), &st) != 0) {
      return Fail(absl::StrCat("--work_dir=", o.work_dir, ": ", strerror(errno)));
    }
    if (S_ISLNK(st.st_mode)) {
      return Fail(absl::StrCat("--work_dir=", o.work_dir, ": is a symbolic link; give the directory itself"));
    }
    if (st.st_uid != geteuid()) {
      return Fail(absl::StrCat("--work_dir=", o.work_dir, ": owned by uid ", st.st_uid, ", not this agent's (",
                               geteuid(), "); give the agent a directory of its own"));
    }
    if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
      const mode_t closed = st.st_mode & 07777 & ~(S_IWGRP | S_IWOTH);
      if (chmod(o.work_dir.c_str(), closed) != 0) {
        return Fail(absl::StrCat(
            "--work_dir=", o.work_dir,
            absl::StrFormat(": writable by group or others (mode %04o) and cannot be closed: ", st.st_mode & 07777),
            strerror(errno)));
      }
      std::printf("plateau_worker: --work_dir=%s was writable by group or others (mode %04o): now %04o\n",
                  o.work_dir.c_str(), static_cast<unsigned>(st.st_mode & 07777), static_cast<unsigned>(closed));
    }
  }
  absl::StatusOr<std::unique_ptr<DirLock>> work_lock = DirLock::Acquire(
      o.work_dir, "--work_dir", "worker agent",
      "a work dir holds one agent's worker id, calibration and job specs; give each agent its own");
  if (!work_lock.ok()) return Fail(std::string(work_lock.status().message()));

  // Before the signal mask, which a child would inherit.
  if (f["calibrate"] == "true") Calibrate(&o);
  if (c.device_memory_bytes() < 0) {
    absl::StatusOr<int64_t> probed = ProbeDeviceMemory(o);
    if (!probed.ok()) return Fail(std::string(probed.status().message()));
    c.set_device_memory_bytes(*probed);
    std::printf(
        "plateau_worker: --device_memory_bytes=auto: %lld bytes per GPU (%.1f GiB: the smallest card's "
        "memory less a reserve of a sixteenth, at least 2 GiB, for the CUDA context and the libraries' "
        "buffers)\n",
        static_cast<long long>(*probed), static_cast<double>(*probed) / (1 << 30));
    std::fflush(stdout);
  }
  // SIGINT/SIGTERM are taken by sigwait below. Blocked before the channel
  // is opened: gRPC starts its threads there, every thread inherits the
  // mask, and one without it would take the signal's default action (the
  // agent killed at once, its ranks left to the parent-death signal).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  ConnectionOptions connection;
  connection.address = o.coordinator;
  connection.files = o.files;
  connection.warn_plaintext_as = "plateau_worker";
  // A rotated token is sent from the next call on (client/connection.h
  // TokenFile); each later read is logged, a failed one keeps the token.
  connection.on_token_reload = [path = o.files.token_file](const absl::Status& read, size_t) {
    if (read.ok()) {
      std::printf("plateau_worker: --token_file=%s changed: sending its first token from now on\n", path.c_str());
    } else {
      std::printf("plateau_worker: WARNING: %s; still sending the token read before\n",
                  std::string(read.message()).c_str());
    }
    std::fflush(stdout);
  };
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = OpenChannel(connection);
  if (!channel.ok()) return Fail(std::string(channel.status().message()));
  o.channel = *channel;

  Agent agent(o);
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    std::printf("plateau_worker: signal %d, stopping every rank\n", sig);
    std::fflush(stdout);
    agent.RequestStop();
  });
  waiter.detach();
  absl::Status s = agent.Run();
  if (!s.ok()) return Fail(std::string(s.message()));
  return 0;
}

}  // namespace
}  // namespace plateau

int main(int argc, char** argv) { return plateau::Main(argc, argv); }
