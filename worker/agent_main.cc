// plateau_worker: the node agent (worker/agent.h). One per node.
//
//   plateau_worker --coordinator=127.0.0.1:7070 [--backend=cpu] [--devices=2]
//       [--device_memory_bytes=1073741824] [--host_memory_bytes=0]
//       [--rank_address=127.0.0.1] [--device_peak_flops=0] [--name=HOST]
//       [--rank_binary=<plateau_rank beside this binary>] [--work_dir=DIR]
//       [--grace_s=5] [--token_file=PATH] [--tls_ca_file=PATH] [--calibrate=true]
//
// Before registering it measures its backend for the time model of the
// `auto` settings (worker/calibration.h; well under a second), or reads the
// measurement cached in --work_dir by an earlier start of the same binaries
// on the same backend, and registers with it.
//
// SIGINT/SIGTERM stop every rank it started (SIGTERM, then SIGKILL after
// the grace period) and exit once they are gone.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/connection.h"
#include "kernels/named_flags.h"
#include "kernels/backend.h"
#include "worker/agent.h"
#include "worker/calibration.h"

namespace plateau {
namespace {

constexpr char kUsage[] = R"(usage: plateau_worker --coordinator=HOST:PORT [--name=value ...]

  --coordinator=127.0.0.1:7070     the coordinator's API address
  --backend=cpu                    cpu or cuda
  --devices=2                      rank slots (GPUs; on the CPU, ranks it runs at once)
  --device_memory_bytes=1073741824 per device (CPU: the largest arena a rank may ask for)
  --host_memory_bytes=0            0: not reported
  --device_peak_flops=0            fp32 peak per device for the MFU metric; 0: unknown
  --rank_address=127.0.0.1         where this node's ranks listen for their peers
  --name=HOST                      shown in the coordinator's view
  --rank_binary=PATH               plateau_rank (default: beside this binary)
  --work_dir=DIR                   spec files of running jobs and the calibration cache
                                   (default: a temp dir, removed at exit)
  --grace_s=5                      SIGTERM to SIGKILL on cancel
  --token_file=PATH                the coordinator's bearer token (its --token_file), sent on every
                                   call; passed on to the ranks for their rendezvous calls
  --tls_ca_file=PATH               PEM CA of the coordinator's certificate: TLS on (ranks too)
  --calibrate=true                 measure the backend for the `auto` settings' time model (cached in
                                   --work_dir); false: register without, the coordinator's default curve
)";

int Fail(const std::string& msg) {
  std::fprintf(stderr, "plateau_worker: %s\n", msg.c_str());
  return 2;
}

// Sets o->capabilities.calibration from the cache in o->work_dir or a fresh
// measurement of the backend. A worker that cannot calibrate still works:
// it registers without one and says why.
void Calibrate(const std::string& self, AgentOptions* o) {
  BackendOptions bo;
  bo.kind = o->capabilities.backend() == v1::BACKEND_CUDA ? BackendKind::kCuda : BackendKind::kCpu;
  // Fixed, so that the backend's description (part of the cache's key)
  // does not change with the flags; the measurement needs under 48 MiB.
  if (bo.kind == BackendKind::kCpu) bo.device_memory_bytes = int64_t{64} << 20;
  std::error_code ec;
  std::filesystem::create_directories(o->work_dir, ec);
  absl::StatusOr<std::unique_ptr<Backend>> backend = Backend::Create(bo);
  bool measured = false;
  absl::StatusOr<v1::Calibration> c =
      backend.ok() ? LoadOrMeasureCalibration(
                         o->work_dir, bo.kind, (*backend)->Describe(), BinaryFingerprint({self, o->rank_binary}),
                         [&] { return MeasureCalibration(**backend); }, &measured)
                   : absl::StatusOr<v1::Calibration>(backend.status());
  if (!c.ok()) {
    std::fprintf(stderr, "plateau_worker: no calibration (%s): `auto` settings use the coordinator's default curve\n",
                 std::string(c.status().message()).c_str());
    return;
  }
  std::printf("plateau_worker: calibration %s (%s)\n",
              measured ? absl::StrCat("measured in ", absl::StrFormat("%.2f", c->measure_seconds()), " s").c_str()
                       : "read from the cache",
              CalibrationCachePath(o->work_dir, bo.kind).c_str());
  std::fflush(stdout);
  *o->capabilities.mutable_calibration() = *std::move(c);
}

int Main(int argc, char** argv) {
  char host[256] = "localhost";
  gethostname(host, sizeof(host) - 1);
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  std::map<std::string, std::string> f = {
      {"coordinator", "127.0.0.1:7070"},
      {"backend", "cpu"},
      {"devices", "2"},
      {"device_memory_bytes", "1073741824"},
      {"host_memory_bytes", "0"},
      {"device_peak_flops", "0"},
      {"rank_address", "127.0.0.1"},
      {"name", host},
      {"rank_binary", (self.parent_path() / "plateau_rank").string()},
      {"work_dir", (std::filesystem::temp_directory_path() / absl::StrCat("plateau-worker-", getpid())).string()},
      {"grace_s", "5"},
      {"token_file", ""},
      {"tls_ca_file", ""},
      {"calibrate", "true"}};
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
  double peak = 0, grace = 0;
  if (!absl::SimpleAtoi(f["devices"], &devices) || devices < 1) return Fail("--devices: expected an integer >= 1");
  if (!absl::SimpleAtoi(f["device_memory_bytes"], &dev_mem) || dev_mem < 0) {
    return Fail("--device_memory_bytes: expected an integer >= 0");
  }
  if (!absl::SimpleAtoi(f["host_memory_bytes"], &host_mem) || host_mem < 0) {
    return Fail("--host_memory_bytes: expected an integer >= 0");
  }
  if (!absl::SimpleAtod(f["device_peak_flops"], &peak) || peak < 0) {
    return Fail("--device_peak_flops: expected a number >= 0");
  }
  if (!absl::SimpleAtod(f["grace_s"], &grace) || !(grace >= 0)) return Fail("--grace_s: expected seconds >= 0");
  if (access(f["rank_binary"].c_str(), X_OK) != 0) {
    return Fail(absl::StrCat("--rank_binary: ", f["rank_binary"], " is not an executable"));
  }
  c.set_devices(devices);
  c.set_device_memory_bytes(dev_mem);
  c.set_host_memory_bytes(host_mem);
  c.set_device_peak_flops(peak);
  c.set_rank_address(f["rank_address"]);
  c.set_name(f["name"]);
  o.rank_binary = f["rank_binary"];
  o.work_dir = f["work_dir"];
  o.grace = absl::Seconds(grace);
  // Absolute: the ranks read the same files.
  for (const char* name : {"token_file", "tls_ca_file"}) {
    if (!f[name].empty()) f[name] = std::filesystem::absolute(f[name]).lexically_normal().string();
  }
  o.token_file = f["token_file"];
  o.tls_ca_file = f["tls_ca_file"];
  if (f["calibrate"] != "true" && f["calibrate"] != "false") {
    return Fail(absl::StrCat("--calibrate: expected true or false, got '", f["calibrate"], "'"));
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
  // After the mask: the BLAS library keeps the threads the measurement
  // starts.
  if (f["calibrate"] == "true") Calibrate(self.string(), &o);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      OpenChannel(ConnectionOptions{o.coordinator, o.token_file, o.tls_ca_file});
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
  // A work dir of the user's keeps the calibration cache for the next start.
  if (f["work_dir"] == defaults.at("work_dir")) std::filesystem::remove_all(o.work_dir, ec);
  if (!s.ok()) return Fail(std::string(s.message()));
  return 0;
}

}  // namespace
}  // namespace plateau

int main(int argc, char** argv) { return plateau::Main(argc, argv); }
