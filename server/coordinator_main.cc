// plateau_coordinator: the coordinator daemon. Serves JobService and
// WorkerService over gRPC (with health checking and server reflection),
// keeps jobs, events and logs in SQLite under --state_dir, and serves
// Prometheus metrics on --metrics_address. Listens on loopback by default.
//
//   plateau_coordinator --state_dir=/var/lib/plateau
//       [--listen=127.0.0.1:7070] [--metrics_address=127.0.0.1:9464]
//       [--ready_file=PATH] [--heartbeat_ms=1000] [--worker_timeout_s=2 x heartbeat]
//       [--reattach_timeout_s=10]
//
// Port 0 picks a free port; the bound addresses are printed and, with
// --ready_file, written there ("api=HOST:PORT" and "metrics=HOST:PORT"
// lines) once both are serving. SIGINT/SIGTERM shut it down cleanly.
#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "kernels/named_flags.h"
#include "server/coordinator.h"
#include "server/job_store.h"
#include "server/metrics.h"
#include "server/services.h"

namespace plateau {
namespace {

constexpr char kUsage[] = R"(usage: plateau_coordinator --state_dir=DIR [--name=value ...]

  --state_dir=DIR                  jobs, events and logs (SQLite, WAL); created if missing
  --listen=127.0.0.1:7070          gRPC API address (port 0: any free port)
  --metrics_address=127.0.0.1:9464 Prometheus /metrics (port 0: any free port)
  --ready_file=PATH                written once serving: api=HOST:PORT, metrics=HOST:PORT
  --heartbeat_ms=1000              heartbeat interval asked of workers
  --worker_timeout_s=0             a worker silent this long is lost (0: two heartbeat intervals)
  --reattach_timeout_s=10          after a restart, the time the workers of live jobs have to
                                   register again before they count as lost
)";

int Fail(const std::string& msg) {
  std::fprintf(stderr, "plateau_coordinator: %s\n", msg.c_str());
  return 2;
}

std::string HostOf(const std::string& address) {
  size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

int Main(int argc, char** argv) {
  std::map<std::string, std::string> flags = {{"state_dir", ""},
                                              {"listen", "127.0.0.1:7070"},
                                              {"metrics_address", "127.0.0.1:9464"},
                                              {"ready_file", ""},
                                              {"worker_timeout_s", "0"},
                                              {"reattach_timeout_s", "10"},
                                              {"heartbeat_ms", "1000"}};
  absl::StatusOr<bool> help = ParseNamedFlags(argc, argv, &flags);
  if (!help.ok()) return Fail(std::string(help.status().message()));
  if (*help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (flags["state_dir"].empty()) return Fail("--state_dir: expected a directory (see --help)");
  CoordinatorOptions options;
  double timeout_s = 0;
  int64_t heartbeat_ms = 0;
  double reattach_s = 0;
  if (!absl::SimpleAtod(flags["worker_timeout_s"], &timeout_s) || !(timeout_s >= 0)) {
    return Fail("--worker_timeout_s: expected a number of seconds >= 0");
  }
  if (!absl::SimpleAtod(flags["reattach_timeout_s"], &reattach_s) || !(reattach_s > 0)) {
    return Fail("--reattach_timeout_s: expected a number of seconds > 0");
  }
  if (!absl::SimpleAtoi(flags["heartbeat_ms"], &heartbeat_ms) || heartbeat_ms < 10) {
    return Fail("--heartbeat_ms: expected an integer >= 10");
  }
  options.heartbeat_interval = absl::Milliseconds(heartbeat_ms);
  // One missed heartbeat is tolerated; the second makes the worker lost.
  options.worker_timeout = timeout_s > 0 ? absl::Seconds(timeout_s) : 2 * options.heartbeat_interval;
  if (options.worker_timeout <= options.heartbeat_interval) {
    return Fail("--worker_timeout_s: expected more than one heartbeat interval (--heartbeat_ms)");
  }
  options.reattach_timeout = absl::Seconds(reattach_s);

  // Signals are taken by sigwait below; every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  std::error_code ec;
  std::filesystem::create_directories(flags["state_dir"], ec);
  if (ec) return Fail(absl::StrCat("--state_dir=", flags["state_dir"], ": ", ec.message()));
  auto store = JobStore::Open(flags["state_dir"] + "/plateau.db");
  if (!store.ok()) return Fail(std::string(store.status().message()));
  auto metrics = Metrics::Create(flags["metrics_address"]);
  if (!metrics.ok()) return Fail(std::string(metrics.status().message()));
  Coordinator coordinator(store->get(), metrics->get(), options);
  if (absl::Status s = coordinator.Start(); !s.ok()) return Fail(s.ToString());

  JobServiceImpl jobs(&coordinator);
  WorkerServiceImpl workers(&coordinator);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(flags["listen"], grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&jobs);
  builder.RegisterService(&workers);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) return Fail(absl::StrCat("--listen=", flags["listen"], ": cannot listen there"));
  server->GetHealthCheckService()->SetServingStatus("plateau.v1.JobService", true);
  server->GetHealthCheckService()->SetServingStatus("plateau.v1.WorkerService", true);

  const std::string api = absl::StrCat(HostOf(flags["listen"]), ":", port);
  const std::string mx = absl::StrCat(HostOf(flags["metrics_address"]), ":", (*metrics)->port());
  std::printf("plateau_coordinator: API on %s, metrics on http://%s/metrics, state in %s\n", api.c_str(),
              mx.c_str(), flags["state_dir"].c_str());
  std::fflush(stdout);
  if (!flags["ready_file"].empty()) {
    const std::string tmp = flags["ready_file"] + ".tmp";
    {
      std::ofstream out(tmp);
      out << "api=" << api << "\nmetrics=" << mx << "\n";
    }
    std::filesystem::rename(tmp, flags["ready_file"], ec);
    if (ec) return Fail(absl::StrCat("--ready_file: ", ec.message()));
  }
  int sig = 0;
  sigwait(&signals, &sig);
  std::printf("plateau_coordinator: signal %d, shutting down\n", sig);
  std::fflush(stdout);
  coordinator.Stop();  // wakes streaming calls
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}

}  // namespace
}  // namespace plateau

int main(int argc, char** argv) { return plateau::Main(argc, argv); }
