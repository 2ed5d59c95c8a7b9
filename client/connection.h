// How every Plateau process reaches the coordinator: plateauctl and the
// Client, the worker agent, and the ranks' rendezvous store. One function
// opens the channel, so that TLS and the bearer token work the same way in
// each of them (docs/SERVICE.md "Security").
//
// The token travels as "authorization: Bearer <token>" on every call, added
// by a client interceptor rather than by CallCredentials: gRPC refuses to
// send CallCredentials over a plaintext channel, and a token on loopback
// without TLS is a supported setup. No call site has to remember it.
//
// Thread safety: the functions are thread-safe; the channel is gRPC's.
#ifndef PLATEAU_CLIENT_CONNECTION_H_
#define PLATEAU_CLIENT_CONNECTION_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace plateau {

struct ConnectionOptions {
  std::string address;      // HOST:PORT of the coordinator
  std::string token_file;   // the bearer token; empty: send none
  std::string tls_ca_file;  // PEM CA that signed the coordinator's certificate; empty: plaintext
  // A connection with calls open is pinged this often and is dead (its calls
  // UNAVAILABLE) when a ping goes unanswered this long: a coordinator that
  // froze, or whose host vanished without closing the connection, would
  // otherwise hold a watch or a rank's long poll forever.
  absl::Duration keepalive = absl::Seconds(20);
};

// Reads a secret (a bearer token) from `path` once: trailing whitespace
// and the newline an editor leaves are stripped. An unreadable or empty
// file, or one with characters an HTTP/2 header cannot carry, is
// INVALID_ARGUMENT naming `flag` ("--token_file") and the path.
absl::StatusOr<std::string> ReadTokenFile(const std::string& flag, const std::string& path);

// Reads a PEM file (certificate, key, CA): INVALID_ARGUMENT naming `flag`
// and the path when it cannot be read or holds no PEM block.
absl::StatusOr<std::string> ReadPemFile(const std::string& flag, const std::string& path);

// Checks an address a flag gives (`flag`: "--coordinator", "--listen"):
// HOST:PORT or [IPV6]:PORT with a port 1-65535, 0-65535 when `listen` (0:
// the system picks). Addresses in gRPC's own schemes (unix:PATH,
// dns:///HOST:PORT, ipv4:..., ...) are passed on unchecked. INVALID_ARGUMENT
// "<flag>=<address>: expected ..." otherwise: gRPC itself takes a port past
// 65535 modulo 65536, so 127.0.0.1:99553 would reach port 34017.
absl::Status CheckAddress(const std::string& flag, const std::string& address, bool listen);

// A channel to options.address (CheckAddress'd as --coordinator): TLS verified against tls_ca_file
// when set, else plaintext; the token of token_file on every call when set. Files are read here,
// once; their errors are INVALID_ARGUMENT naming the flag
// (--token_file, --tls_ca_file) and the path. The channel connects lazily:
// an unreachable coordinator shows as UNAVAILABLE on the first call.
absl::StatusOr<std::shared_ptr<grpc::Channel>> OpenChannel(const ConnectionOptions& options);

// The pause before retrying a call that found the coordinator unreachable:
// waits up to `timeout` on the channel itself and returns true the moment
// it connects (false after the whole timeout, or at once-connected channels
// after sleeping it out). Not a sleep: gRPC sees a connect attempt end only
// while some thread polls the channel, and calls that fail fast leave that
// to its backup poller, every 5 s, so a sleeping retry loop found a
// restarted coordinator seconds late (2.2-6.4 s measured; once 10.1 s, a
// worker's whole re-attach window).
bool PauseBeforeRetry(grpc::Channel& channel, absl::Duration timeout);

}  // namespace plateau

#endif  // PLATEAU_CLIENT_CONNECTION_H_
