// plateau_coordinator: the coordinator daemon. Serves JobService and
// WorkerService over gRPC (with health checking, and server reflection
// when no token is set), keeps jobs, events and logs in SQLite under
// --state_dir, and serves Prometheus metrics on --metrics_address (with
// /healthz and /readyz for probes: server/metrics.h). Listens
// on loopback by default; beyond loopback only with --token_file or
// client certificates (--tls_client_ca_file), or --insecure_listen_any.
// docs/SERVICE.md "Security".
//
//   plateau_coordinator --state_dir=/var/lib/plateau
//       [--listen=127.0.0.1:7070] [--metrics_address=127.0.0.1:9464]
//       [--ready_file=PATH] [--heartbeat_ms=1000] [--worker_timeout_s=2 x heartbeat]
//       [--reattach_timeout_s=10] [--metrics_retention_s=900] [--max_pending_s=600]
//       [--retention=30d]
//       [--token_file=PATH] [--tls_cert_file=PATH --tls_key_file=PATH [--tls_client_ca_file=PATH]]
//       [--tls_reload_s=30]
//       [--insecure_listen_any] [--max_request_bytes=4194304]
//       [--max_watches_per_client=64] [--watch_reports_per_read=4096]
//       [--watch_heartbeat_s=20]
//
// Port 0 picks a free port; the bound addresses are printed and, with
// --ready_file, written there ("api=HOST:PORT" and "metrics=HOST:PORT"
// lines) once both are serving. SIGINT/SIGTERM shut it down cleanly.
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/connection.h"
#include "client/host_port.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "kernels/named_flags.h"
#include "server/coordinator.h"
#include "server/job_store.h"
#include "server/memory_page.h"
#include "server/metrics.h"
#include "server/rpc_metrics.h"
#include "server/security.h"
#include "server/services.h"
#include "worker/dir_lock.h"

namespace plateau {
namespace {

constexpr char kUsage[] = R"(usage: plateau_coordinator --state_dir=DIR [--name=value ...]

  --state_dir=DIR                  jobs, events and logs (SQLite, WAL); created if missing
  --listen=127.0.0.1:7070          gRPC API address (port 0: any free port)
  --metrics_address=127.0.0.1:9464 HTTP: Prometheus /metrics, a job's memory timeline page
                                   /jobs/ID/memory, probes /healthz (process up) and
                                   /readyz (store recovered, gRPC API serving) (port 0: any free port)
  --ready_file=PATH                written once serving: api=HOST:PORT, metrics=HOST:PORT
  --heartbeat_ms=1000              heartbeat interval asked of workers
  --worker_timeout_s=0             a worker silent this long is lost (0: two heartbeat intervals)
  --reattach_timeout_s=10          after a restart, the time the workers of live jobs have to
                                   register again before they count as lost
  --metrics_retention_s=900        a finished job's metric series are removed this long after its
                                   final state (0: kept until the coordinator restarts)
  --max_pending_s=600              a job that no registered worker could host fails
                                   (UNSCHEDULABLE) after this long, unless its spec sets
                                   max_pending_s (0: it waits forever)
  --retention=30d                  a finished job's events, logs and memory timelines are removed
                                   this long after it ended (the job itself stays; `plateauctl
                                   delete` removes it): a number with d, h, m or s (0: keep forever)

security (docs/SERVICE.md "Security")
  --token_file=PATH                bearer token every JobService and WorkerService call must carry
                                   ("authorization: Bearer <token>"); one per line, each accepted;
                                   read again when it changes (rotation, no restart)
  --worker_token_file=PATH         the workers' own tokens (same format): WorkerService calls (agents,
                                   ranks) must carry one of these, JobService calls one of
                                   --token_file's, so that a user's token cannot act as a worker
                                   (take a worker's assignments, read or set a job's rendezvous
                                   keys). Without it --token_file admits both. No token in both files
  --tls_cert_file=PATH             PEM certificate chain: serve TLS (with --tls_key_file)
  --tls_key_file=PATH              PEM private key of that certificate
  --tls_client_ca_file=PATH        PEM CA(s) of the clients' certificates: every client (plateauctl,
                                   workers, ranks) must present a certificate one of them signed
                                   (mutual TLS; with --tls_cert_file). Beside --token_file or alone
  --tls_reload_s=30                the three TLS files are read again this often: a replaced
                                   certificate, key or client CA serves new connections, no restart
  --insecure_listen_any            allow a non-loopback --listen without --token_file or
                                   --tls_client_ca_file (anyone who reaches the port can run jobs;
                                   refused otherwise)
  --max_request_bytes=4194304      largest request accepted (larger: RESOURCE_EXHAUSTED);
                                   at least 1048576 (a worker's telemetry batch is <= 512 KiB)
  --max_watches_per_client=64      open WatchJob / GetJobLogs streams per client host
                                   (0: no limit)
  --watch_reports_per_read=4096    a per-rank WatchJob reads at most this many ranks' reports
                                   into memory at once (at least one step's)
  --watch_heartbeat_s=20           a WatchJob stream, or a GetJobLogs that follows, that has sent
                                   nothing for this long sends a heartbeat (JobEvent.heartbeat,
                                   LogEntry.heartbeat, which clients skip) if it asked for them,
                                   so that a proxy or load balancer that cuts idle streams does
                                   not cut a quiet watch or log; below their idle timeout (0: none)
Health checking (grpc.health.v1.Health) stays open for liveness probes; server
reflection is off when --token_file or --worker_token_file is set.
)";

// Below this a worker agent's telemetry batch (under 512 KiB: worker/
// agent.cc kBatchBytes plus one line of at most kMaxRankOutputLineBytes,
// worker/rank_protocol.h) might not fit.
constexpr int64_t kMinRequestBytes = 1 << 20;

// Loading gRPC's reflection library registers its plugin with every
// ServerBuilder (a static initializer), so leaving out the Init call is not
// enough to turn it off: this option takes the plugin out of the builder.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [](const auto& p) { return p->name() == "proto_server_reflection"; }),
                   plugins->end());
  }
};

int Fail(const std::string& msg) {
  std::fprintf(stderr, "%s plateau_coordinator: %s\n", LogTime().c_str(), msg.c_str());
  return 2;
}

std::string HostOf(const std::string& address) {
  size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

// "30d", "12h", "90m", "45s", "0": a retention period.
bool ParseRetention(const std::string& text, absl::Duration* out) {
  if (text == "0") {
    *out = absl::ZeroDuration();
    return true;
  }
  if (text.size() < 2) return false;
  double n = 0;
  if (!absl::SimpleAtod(text.substr(0, text.size() - 1), &n) || !(n >= 0) || n > 1e7) return false;
  switch (text.back()) {
    case 'd': *out = absl::Hours(24 * n); return true;
    case 'h': *out = absl::Hours(n); return true;
    case 'm': *out = absl::Minutes(n); return true;
    case 's': *out = absl::Seconds(n); return true;
    default: return false;
  }
}

// Whether --listen's port is free, asked before anything is created: gRPC
// finds it taken only in BuildAndStart, after the state directory and its
// database exist, and logs its own lines (chttp2_server ... errno 98) before
// ours. A bind of each address the host resolves to, as gRPC binds it
// (SO_REUSEADDR on, SO_REUSEPORT off), then closed; only "in use" is
// refused here: other errors (an IPv6 address on a host without IPv6) are
// gRPC's to judge, and a port taken between this check and gRPC's bind
// still fails there. Port 0 and unix: sockets are not checked.
absl::Status CheckListenPortFree(const std::string& listen) {
  std::string host;
  int port = 0;
  if (absl::StartsWith(listen, "unix:") || !SplitHostPort(listen, &host, &port) || port == 0) {
    return absl::OkStatus();
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found) != 0) {
    return absl::OkStatus();  // gRPC says what is wrong with the name
  }
  // A wildcard address is bound by gRPC as IPv6's [::] (both families)
  // where the host has IPv6: a listener of either family there is in use.
  addrinfo* wildcard6 = nullptr;
  if (host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]") {
    addrinfo v6 = hints;
    v6.ai_family = AF_INET6;
    if (getaddrinfo("::", service.c_str(), &v6, &wildcard6) != 0) wildcard6 = nullptr;
  }
  absl::Status status;
  for (addrinfo* list : {found, wildcard6}) {
    for (addrinfo* a = list; a != nullptr && status.ok(); a = a->ai_next) {
      const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      const int one = 1;
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 && errno == EADDRINUSE) {
        status = absl::UnavailableError(
            absl::StrCat("--listen=", listen, ": cannot listen there (in use: ", std::strerror(errno), ")"));
      }
      close(fd);
    }
  }
  freeaddrinfo(found);
  if (wildcard6 != nullptr) freeaddrinfo(wildcard6);
  return status;
}

int Main(int argc, char** argv) {
  std::map<std::string, std::string> flags = {{"state_dir", ""},
                                              {"listen", "127.0.0.1:7070"},
                                              {"metrics_address", "127.0.0.1:9464"},
                                              {"ready_file", ""},
                                              {"worker_timeout_s", "0"},
                                              {"reattach_timeout_s", "10"},
                                              {"metrics_retention_s", "900"},
                                              {"max_pending_s", "600"},
                                              {"retention", "30d"},
                                              {"heartbeat_ms", "1000"},
                                              {"token_file", ""},
                                              {"worker_token_file", ""},
                                              {"tls_cert_file", ""},
                                              {"tls_key_file", ""},
                                              {"tls_client_ca_file", ""},
                                              {"tls_reload_s", "30"},
                                              {"insecure_listen_any", "false"},
                                              {"max_request_bytes", "4194304"},
                                              {"max_watches_per_client", "64"},
                                              {"watch_reports_per_read", "4096"},
                                              {"watch_heartbeat_s", "20"}};
  absl::StatusOr<bool> help = ParseNamedFlags(argc, argv, &flags);
  if (!help.ok()) return Fail(std::string(help.status().message()));
  if (*help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (flags["state_dir"].empty()) return Fail("--state_dir: expected a directory (see --help)");
  if (!flags["ready_file"].empty()) {
    // Checked now, not after the API is up: the file is written last.
    std::error_code parent_ec;
    const std::filesystem::path parent = std::filesystem::path(flags["ready_file"]).parent_path();
    if (!parent.empty() && !std::filesystem::is_directory(parent, parent_ec)) {
      return Fail(absl::StrCat("--ready_file=", flags["ready_file"], ": ", parent.string(),
                               " is not a directory"));
    }
  }
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
  double retention_s = 0;
  if (!absl::SimpleAtod(flags["metrics_retention_s"], &retention_s) || !(retention_s >= 0)) {
    return Fail("--metrics_retention_s: expected a number of seconds >= 0");
  }
  options.metrics_retention = absl::Seconds(retention_s);
  double max_pending_s = 0;
  if (!absl::SimpleAtod(flags["max_pending_s"], &max_pending_s) || !(max_pending_s >= 0) ||
      max_pending_s > 7 * 24 * 3600) {
    return Fail("--max_pending_s: expected a number of seconds from 0 (wait forever) to 604800 (a week)");
  }
  options.default_max_pending = absl::Seconds(max_pending_s);
  if (!ParseRetention(flags["retention"], &options.retention)) {
    return Fail(absl::StrCat("--retention: expected a period like 30d, 12h, 90m or 45s (0: keep forever), got '",
                             flags["retention"], "'"));
  }

  // Security: every check before anything is opened or bound.
  int64_t max_request_bytes = 0, max_watches = 0;
  if (!absl::SimpleAtoi(flags["max_request_bytes"], &max_request_bytes) || max_request_bytes < kMinRequestBytes ||
      max_request_bytes > INT32_MAX) {
    return Fail(absl::StrCat("--max_request_bytes: expected an integer from ", kMinRequestBytes,
                             " (a worker's telemetry batch must fit) to ", INT32_MAX, ", got '",
                             flags["max_request_bytes"], "'"));
  }
  if (!absl::SimpleAtoi(flags["max_watches_per_client"], &max_watches) || max_watches < 0 ||
      max_watches > INT32_MAX) {
    return Fail(absl::StrCat("--max_watches_per_client: expected an integer >= 0 (0: no limit), got '",
                             flags["max_watches_per_client"], "'"));
  }
  if (!absl::SimpleAtoi(flags["watch_reports_per_read"], &options.per_rank_reports_per_read) ||
      options.per_rank_reports_per_read < 1) {
    return Fail(absl::StrCat("--watch_reports_per_read: expected an integer >= 1, got '",
                             flags["watch_reports_per_read"], "'"));
  }
  StreamOptions streams;
  double heartbeat_s = 0;
  if (!absl::SimpleAtod(flags["watch_heartbeat_s"], &heartbeat_s) || !(heartbeat_s >= 0) || heartbeat_s > 3600) {
    return Fail(absl::StrCat("--watch_heartbeat_s: expected seconds from 0 (no heartbeat) to 3600, got '",
                             flags["watch_heartbeat_s"], "'"));
  }
  streams.watch_heartbeat = absl::Seconds(heartbeat_s);
  if (flags["insecure_listen_any"] != "true" && flags["insecure_listen_any"] != "false") {
    return Fail(absl::StrCat("--insecure_listen_any: expected true or false, got '", flags["insecure_listen_any"],
                             "'"));
  }
  // Read again when it changes (a rotation needs no restart); each later
  // read is logged, and a failed one keeps the tokens in force.
  const auto open_tokens = [&](const std::string& flag) -> absl::StatusOr<std::shared_ptr<TokenFile>> {
    const std::string path = flags[flag];
    if (path.empty()) return nullptr;
    const std::string name = "--" + flag;
    return TokenFile::Open(name, path, absl::Seconds(1), [name, path](const absl::Status& read, size_t tokens) {
      if (read.ok()) {
        std::fprintf(stderr, "%s plateau_coordinator: %s=%s changed: %zu token(s) accepted\n", LogTime().c_str(),
                     name.c_str(), path.c_str(), tokens);
      } else {
        std::fprintf(stderr, "%s plateau_coordinator: WARNING: %s; still accepting the %zu token(s) read before\n",
                     LogTime().c_str(), std::string(read.message()).c_str(), tokens);
      }
    });
  };
  absl::StatusOr<std::shared_ptr<TokenFile>> token_file = open_tokens("token_file");
  if (!token_file.ok()) return Fail(std::string(token_file.status().message()));
  absl::StatusOr<std::shared_ptr<TokenFile>> worker_token_file = open_tokens("worker_token_file");
  if (!worker_token_file.ok()) return Fail(std::string(worker_token_file.status().message()));
  if (*token_file != nullptr && *worker_token_file != nullptr) {
    // One token in both would let its holder act as either: the split
    // would only look made. (Checked at start; a later edit is the
    // operator's.)
    for (const std::string& t : *(*worker_token_file)->Tokens()) {
      for (const std::string& u : *(*token_file)->Tokens()) {
        if (t == u) {
          return Fail(
              "--worker_token_file: a token of it is also in --token_file; the workers' tokens must be their "
              "own (a user holding one could act as a worker)");
        }
      }
    }
  }
  const bool tls = !flags["tls_cert_file"].empty() || !flags["tls_key_file"].empty();
  const bool client_certs = !flags["tls_client_ca_file"].empty();
  int64_t tls_reload_s = 0;
  if (!absl::SimpleAtoi(flags["tls_reload_s"], &tls_reload_s) || tls_reload_s < 1 || tls_reload_s > 86400) {
    return Fail(absl::StrCat("--tls_reload_s: expected seconds from 1 to 86400, got '", flags["tls_reload_s"], "'"));
  }
  if (client_certs && !tls) {
    return Fail(
        "--tls_client_ca_file needs TLS: give --tls_cert_file and --tls_key_file too (the clients check the "
        "coordinator's certificate as it checks theirs)");
  }
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (tls) {
    if (flags["tls_cert_file"].empty() || flags["tls_key_file"].empty()) {
      return Fail(absl::StrCat("TLS needs both --tls_cert_file and --tls_key_file; ",
                               flags["tls_cert_file"].empty() ? "--tls_cert_file" : "--tls_key_file",
                               " is missing"));
    }
    if (absl::Status s = CheckCertificateAndKeyFiles("--tls_cert_file", flags["tls_cert_file"], "--tls_key_file",
                                                     flags["tls_key_file"]);
        !s.ok()) {
      return Fail(std::string(s.message()));
    }
    if (client_certs) {
      absl::StatusOr<std::string> client_ca = ReadPemFile("--tls_client_ca_file", flags["tls_client_ca_file"]);
      if (!client_ca.ok()) return Fail(std::string(client_ca.status().message()));
      // A key or a request here would pass ReadPemFile and fail only in
      // gRPC, as a listen failure that names other flags.
      if (!absl::StrContains(*client_ca, "-----BEGIN CERTIFICATE-----")) {
        return Fail(absl::StrCat("--tls_client_ca_file=", flags["tls_client_ca_file"],
                                 ": expected PEM CA certificate(s) (-----BEGIN CERTIFICATE-----)"));
      }
    }
    // Served from the files, read again every --tls_reload_s: a replaced
    // certificate, key or client CA takes effect without a restart.
    auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        AbsoluteFilePath(flags["tls_key_file"]), AbsoluteFilePath(flags["tls_cert_file"]),
        AbsoluteFilePath(flags["tls_client_ca_file"]), static_cast<unsigned int>(tls_reload_s));
    grpc::experimental::TlsServerCredentialsOptions tls_options(provider);
    tls_options.watch_identity_key_cert_pairs();
    if (client_certs) {
      // A handshake without a certificate that chains to these CAs fails:
      // such a client never reaches a service, health checking included.
      tls_options.watch_root_certs();
      tls_options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    }
    credentials = grpc::experimental::TlsServerCredentials(tls_options);
  }
  if (absl::Status s = CheckAddress("--listen", flags["listen"], /*listen=*/true); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  const bool loopback = IsLoopbackAddress(flags["listen"]);
  if (!loopback && *token_file == nullptr && !client_certs) {
    if (flags["insecure_listen_any"] != "true") {
      return Fail(absl::StrCat("--listen=", flags["listen"],
                               " is not a loopback address and neither --token_file nor --tls_client_ca_file is "
                               "set: anyone who can reach it could run jobs and register workers. Give --token_file "
                               "(and --tls_cert_file/--tls_key_file), or client certificates (--tls_client_ca_file), "
                               "or --insecure_listen_any to accept that"));
    }
    std::fprintf(stderr,
                 "%s plateau_coordinator: WARNING: --insecure_listen_any: serving %s without a token or client "
                 "certificates; anyone who can reach it can run jobs and register workers\n",
                 LogTime().c_str(), flags["listen"].c_str());
  } else if (!loopback && !tls) {
    std::fprintf(stderr,
                 "%s plateau_coordinator: WARNING: --listen=%s is not loopback and TLS is off: the bearer token "
                 "and every request cross the network in plaintext (give --tls_cert_file and "
                 "--tls_key_file)\n",
                 LogTime().c_str(), flags["listen"].c_str());
  }

  if (absl::Status s = CheckListenPortFree(flags["listen"]); !s.ok()) {
    // Most often another coordinator on this very state: its lock names its
    // pid, which says more than "in use" (nothing is created to learn it).
    if (std::filesystem::is_directory(flags["state_dir"])) {
      absl::StatusOr<std::unique_ptr<DirLock>> held = DirLock::Acquire(
          flags["state_dir"], "--state_dir", "coordinator",
          "one state directory serves one coordinator; stop that one, or give this one another --state_dir");
      if (!held.ok()) return Fail(std::string(held.status().message()));
    }
    return Fail(std::string(s.message()));
  }

  // Signals are taken by sigwait below; every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  std::error_code ec;
  std::filesystem::create_directories(flags["state_dir"], ec);
  if (ec) return Fail(absl::StrCat("--state_dir=", flags["state_dir"], ": ", ec.message()));
  // Held until exit: a second coordinator on this state would schedule the
  // jobs it sees beside this one, split the workers' heartbeats and refuse
  // this one's cancels.
  absl::StatusOr<std::unique_ptr<DirLock>> state_lock = DirLock::Acquire(
      flags["state_dir"], "--state_dir", "coordinator",
      "one state directory serves one coordinator; stop that one, or give this one another "
      "--state_dir");
  if (!state_lock.ok()) return Fail(std::string(state_lock.status().message()));
  auto store = JobStore::Open(flags["state_dir"] + "/plateau.db");
  if (!store.ok()) return Fail(std::string(store.status().message()));
  auto metrics = Metrics::Create(flags["metrics_address"]);
  if (!metrics.ok()) return Fail(std::string(metrics.status().message()));
  Coordinator coordinator(store->get(), metrics->get(), options);
  // /readyz says which step start-up is in; /healthz is 200 throughout.
  (*metrics)->SetReadiness(absl::UnavailableError("recovering live jobs from the store"));
  if (absl::Status s = coordinator.Start(); !s.ok()) return Fail(s.ToString());
  // /jobs/ID/memory: withdrawn (below) before the coordinator is destroyed.
  (*metrics)->SetJobPages([&coordinator](const std::string& path, const std::string& query) {
    return MemoryPage(path, query, [&coordinator](const std::string& id) { return coordinator.GetMemoryTimeline(id); });
  });
  (*metrics)->SetReadiness(absl::UnavailableError("gRPC API not serving yet"));

  BearerAuth auth(*token_file);
  BearerAuth worker_auth(*worker_token_file, "--worker_token_file");
  WatchLimiter watches(static_cast<int>(max_watches));
  const ServiceGuards guards{&auth, &worker_auth, &watches};
  JobServiceImpl jobs(&coordinator, guards, streams);
  WorkerServiceImpl workers(&coordinator, guards);
  // Health stays open: liveness probes (kubelet, systemd, load balancers)
  // carry no token, and it reveals only SERVING or not.
  grpc::EnableDefaultHealthCheckService(true);
  // Reflection would be an RPC that answers without the token (gRPC runs
  // it outside our handlers): on only when no token is asked for. With a
  // token, tools read proto/plateau/v1/*.proto instead.
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  if (auth.enabled() || worker_auth.enabled()) builder.SetOption(std::make_unique<WithoutReflection>());
  int port = 0;
  builder.AddListeningPort(flags["listen"], credentials, &port);
  // gRPC sets SO_REUSEPORT by default: a second coordinator on this port
  // would then start too, and the kernel would split the clients and the
  // workers' heartbeats between the two. Off, the bind fails below.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // gRPC refuses a larger request with RESOURCE_EXHAUSTED before it is
  // parsed, so a huge SubmitJob costs no more than this much memory.
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_request_bytes));
  // Clients ping connections with calls open (client/connection.h
  // keepalive; 20 s, tests 1 s) so that a watch of a frozen coordinator
  // breaks: accept pings that often (gRPC's default answers pings closer
  // than 5 minutes with GOAWAY "too_many_pings" after two), but not a flood
  // (closer than 500 ms). And ping the clients, so that a watch whose
  // client vanished ends and frees its --max_watches_per_client slot.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60 * 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20 * 1000);
  // Every call counted and timed (plateau_rpcs_total, plateau_rpc_duration_seconds).
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  auto rpc_metrics = std::make_unique<RpcMetricsFactory>(metrics->get());
  const RpcMetricsFactory* const calls = rpc_metrics.get();  // the server owns it, and outlives its use
  interceptors.push_back(std::move(rpc_metrics));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  builder.RegisterService(&jobs);
  builder.RegisterService(&workers);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    return Fail(
        absl::StrCat("--listen=", flags["listen"], ": cannot listen there (in use, or not an address of this host)"));
  }
  server->GetHealthCheckService()->SetServingStatus("plateau.v1.JobService", true);
  server->GetHealthCheckService()->SetServingStatus("plateau.v1.WorkerService", true);
  // Ready, unless a store write already failed (the coordinator then keeps
  // /readyz at 503 with the reason itself: Coordinator::Written).
  (*metrics)->SetReadiness(coordinator.Health());

  const std::string api = absl::StrCat(HostOf(flags["listen"]), ":", port);
  const std::string mx = absl::StrCat(HostOf(flags["metrics_address"]), ":", (*metrics)->port());
  std::printf(
      "%s plateau_coordinator: API on %s (%s, %s), metrics on http://%s/metrics (probes /healthz, /readyz), "
      "state in %s\n",
      LogTime().c_str(), api.c_str(),
      !tls           ? "plaintext"
      : client_certs ? "TLS, client certificate required"
                     : "TLS",
      !auth.enabled() && !worker_auth.enabled() ? "no token"
      : !worker_auth.enabled()                  ? "bearer token required"
      : !auth.enabled()                         ? "workers' bearer token required"
                                                : "bearer token required, workers' their own",
      mx.c_str(), flags["state_dir"].c_str());
  std::fflush(stdout);
  if (!flags["ready_file"].empty()) {
    const std::string tmp = flags["ready_file"] + ".tmp";
    {
      std::ofstream out(tmp);
      out << "api=" << api << "\nmetrics=" << mx << "\n";
    }
    std::filesystem::rename(tmp, flags["ready_file"], ec);
    if (ec) return Fail(absl::StrCat("--ready_file=", flags["ready_file"], ": ", ec.message()));
  }
  int sig = 0;
  sigwait(&signals, &sig);
  std::printf("%s plateau_coordinator: signal %d, shutting down\n", LogTime().c_str(), sig);
  std::fflush(stdout);
  (*metrics)->SetReadiness(absl::UnavailableError("shutting down"));
  coordinator.Stop();  // wakes streaming calls
  // Shutdown(deadline) waits out the whole deadline while any client keeps
  // an idle connection open (agents and long-lived clients always do: 2 s
  // for every stop), even with no call left. So wait for the calls
  // in flight (a stream ends within milliseconds of Stop), at most the
  // grace, then shut down at once; a call that arrives meanwhile is
  // cancelled, and the clients retry it.
  const absl::Time grace_end = absl::Now() + absl::Seconds(2);
  while (calls->in_flight() > 0 && absl::Now() < grace_end) absl::SleepFor(absl::Milliseconds(5));
  server->Shutdown(std::chrono::system_clock::now());  // cancels what outlived the grace
  (*metrics)->SetJobPages(nullptr);  // waits for a page being served
  return 0;
}

}  // namespace
}  // namespace plateau

int main(int argc, char** argv) { return plateau::Main(argc, argv); }
