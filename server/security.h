// What the coordinator checks before it does anything for a call
// (docs/SERVICE.md "Security"): the bearer token of every JobService and
// WorkerService call, and how many streaming watches one client host may
// hold open. Also the loopback rule of --listen.
//
// gRPC's AuthMetadataProcessor only runs on TLS ports, and a server
// interceptor cannot refuse a call, so the services call Check() first in
// every handler (server/services.cc); tests/security_test.cc calls each RPC
// without and with a wrong token.
//
// Thread safety: BearerAuth and WatchLimiter are thread-safe.
#ifndef PLATEAU_SERVER_SECURITY_H_
#define PLATEAU_SERVER_SECURITY_H_

#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "client/connection.h"
#include "grpcpp/grpcpp.h"

namespace plateau {

// a == b in time that depends on b's length only, not on where the first
// difference is: a token cannot be guessed one byte at a time by timing.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

class BearerAuth {
 public:
  // No file turns the check off (every call is let in). The file's tokens
  // are those in force at each call (TokenFile: a rotation needs no
  // restart). `flag`: the coordinator's flag that named the file, for the
  // refusal's message.
  explicit BearerAuth(std::shared_ptr<TokenFile> file, std::string flag = "--token_file")
      : file_(std::move(file)), flag_(std::move(flag)) {}
  bool enabled() const { return file_ != nullptr; }

  // OK when the call carries "authorization: Bearer <a token of the
  // file>"; UNAUTHENTICATED "missing bearer token ..." when it carries none
  // (or another scheme), "wrong bearer token" when it is none of them.
  grpc::Status Check(const grpc::ServerContext& ctx) const;
  // The same on the header's value; nullptr: no header.
  grpc::Status CheckHeader(const absl::string_view* authorization) const;

 private:
  const std::shared_ptr<TokenFile> file_;
  const std::string flag_;
};

// The host part of ServerContext::peer(): "ipv4:127.0.0.1:5000" ->
// "127.0.0.1", "ipv6:[::1]:5000" -> "::1"; anything else as it is.
std::string PeerHost(const std::string& peer);

// Who made a call, for the record of who submitted, cancelled or deleted a
// job: "CN=<name> at <host>" when the caller presented a client certificate
// (--tls_client_ca_file; its subject's common name, or "SAN=<first subject
// alternative name>" for one without), else "<host>" (PeerHost; "an unknown
// peer" when gRPC gives none). Not an authorization: any authenticated
// caller may act on any job.
std::string CallerOf(const grpc::ServerContext& ctx);

// A certificate's name as it is recorded: whatever its CA wrote, made valid
// UTF-8 (a proto string), control characters as '?' (it reaches logs and
// terminals), at most 128 bytes.
std::string CertificateName(absl::string_view name);

// Counts the open streaming watches (WatchJob, GetJobLogs with follow) of
// each client host. A watch holds a server thread and a wakeup on every
// change for as long as its job lives, so one client must not be able to
// hold an unbounded number.
class WatchLimiter {
 public:
  // max_per_client 0: no limit.
  explicit WatchLimiter(int max_per_client) : max_(max_per_client) {}

  // Holds one watch of `host` until destroyed; ok() is false (and nothing
  // is held) when the host already has the maximum open.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& o) noexcept : limiter_(o.limiter_), host_(std::move(o.host_)) { o.limiter_ = nullptr; }
    Lease& operator=(Lease&&) = delete;
    Lease(const Lease&) = delete;
    ~Lease();

   private:
    friend class WatchLimiter;
    WatchLimiter* limiter_ = nullptr;
    std::string host_;
  };

  // RESOURCE_EXHAUSTED naming the limit and --max_watches_per_client when
  // `host` has the maximum open; otherwise OK and *lease holds one. The
  // refusal is for now: clients retry it with backoff (a place frees when
  // one of the host's streams ends), as they do UNAVAILABLE.
  grpc::Status Acquire(const std::string& host, Lease* lease);
  int open(const std::string& host) const;

 private:
  void Release(const std::string& host);

  const int max_;
  mutable absl::Mutex mu_;
  std::map<std::string, int> open_ ABSL_GUARDED_BY(mu_);
};

}  // namespace plateau

#endif  // PLATEAU_SERVER_SECURITY_H_
