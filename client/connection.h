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

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace plateau {

// Reads the bearer tokens of a token file: each line that is not blank is
// one, with its trailing whitespace (and the newline an editor leaves)
// stripped. A coordinator accepts every one of them, a client sends the
// first: two lines let a token be rotated without refusing anyone
// (docs/SERVICE.md "Rotating the token"). An unreadable file, one without
// a token, or a line with characters an HTTP/2 header cannot carry is
// INVALID_ARGUMENT naming `flag` ("--token_file"), the path and the line.
absl::StatusOr<std::vector<std::string>> ReadTokenFile(const std::string& flag, const std::string& path);

// A token file that is read again when it changes, so that a long-lived
// process (the coordinator, a worker agent, a rank) follows a rotation
// without a restart. A change is noticed by the file's identity (device,
// inode, size, modification and status-change times), looked at no more than once per
// `recheck` when the tokens are asked for; a read that fails or finds no
// token keeps the tokens of the last good one (reported once) and is tried
// again at every look until one succeeds, so a half-written file never
// locks anyone out for longer than it stays half-written. Write the new file beside the old and
// rename it over: then no reader sees it half-written. One caller at a time
// looks at the file, outside the lock: the others meanwhile get the tokens
// in force, so a slow file system delays no check but that caller's (a look
// that never returns leaves the tokens in force as they are for good).
//
// Thread safety: thread-safe.
class TokenFile {
 public:
  // Told of each change after the first read: a read of a changed file, or
  // a failure that began, ended or became another; with the read's status
  // and how many tokens are in force after it (the new ones, or on an error
  // those kept).
  using Listener = std::function<void(const absl::Status& read, size_t tokens)>;
  // How the file is read: ReadTokenFile, unless a test gives one that fails
  // on demand (a failure the file's identity does not show).
  using Reader =
      std::function<absl::StatusOr<std::vector<std::string>>(const std::string& flag, const std::string& path)>;

  // Reads the file (ReadTokenFile's errors).
  static absl::StatusOr<std::shared_ptr<TokenFile>> Open(const std::string& flag, const std::string& path,
                                                         absl::Duration recheck = absl::Seconds(1),
                                                         Listener on_reload = nullptr, Reader read = nullptr);

  // The tokens in force; never empty.
  std::shared_ptr<const std::vector<std::string>> Tokens() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Identity {
    uint64_t device = 0, inode = 0;
    // ctime too: a chmod or chown (which a failed read may have waited
    // for) changes only it.
    int64_t size = -1, mtime_ns = 0, ctime_ns = 0;
    bool operator==(const Identity& o) const {
      return device == o.device && inode == o.inode && size == o.size && mtime_ns == o.mtime_ns &&
             ctime_ns == o.ctime_ns;
    }
  };
  TokenFile(std::string flag, std::string path, absl::Duration recheck, Listener on_reload, Reader read)
      : flag_(std::move(flag)),
        path_(std::move(path)),
        recheck_(recheck),
        on_reload_(std::move(on_reload)),
        read_(read ? std::move(read) : Reader(ReadTokenFile)) {}
  // The file's identity; size -1 when it cannot be looked at.
  Identity Look() const;

  const std::string flag_, path_;
  const absl::Duration recheck_;
  const Listener on_reload_;
  const Reader read_;
  absl::Mutex mu_;
  std::shared_ptr<const std::vector<std::string>> tokens_ ABSL_GUARDED_BY(mu_);
  Identity seen_ ABSL_GUARDED_BY(mu_);
  // When the file was last looked at: the steady clock's, which a step of
  // the wall clock cannot hold back.
  std::chrono::steady_clock::time_point looked_ ABSL_GUARDED_BY(mu_);
  bool looking_ ABSL_GUARDED_BY(mu_) = false;  // a caller is looking at the file (Tokens)
  std::string failed_ ABSL_GUARDED_BY(mu_);    // why the last read failed; "" when it did not
};

// The files a process shows the coordinator: the same four flags in every
// binary that calls it (plateauctl, plateau_worker, plateau_rank), which a
// worker passes on to its ranks. Empty: not used.
struct ConnectionFiles {
  std::string token_file;   // the bearer token (TokenFile: its first, as it is now); empty: send none
  std::string tls_ca_file;  // PEM CA that signed the coordinator's certificate; empty: plaintext
  // This client's own certificate chain and key (PEM), sent in the TLS
  // handshake, for a coordinator that requires one (--tls_client_ca_file):
  // both or neither, and only with tls_ca_file. Empty: none sent.
  std::string tls_client_cert_file;
  std::string tls_client_key_file;
};

// The four flags' names, without "--", in ConnectionFiles' order.
inline constexpr const char* kConnectionFileFlags[] = {"token_file", "tls_ca_file", "tls_client_cert_file",
                                                       "tls_client_key_file"};
// The files that parsed flags name (a name `flags` lacks: empty).
ConnectionFiles ConnectionFilesFromFlags(const std::map<std::string, std::string>& flags);
// "--token_file=PATH", ... for each of the four, in kConnectionFileFlags'
// order (an empty one too, so that a child's command line always says).
std::vector<std::string> ConnectionFileArgs(const ConnectionFiles& files);
// Each path given made absolute (AbsoluteFilePath): for a process whose
// children read the same files from another working directory.
ConnectionFiles AbsoluteConnectionFiles(ConnectionFiles files);

struct ConnectionOptions {
  std::string address;  // HOST:PORT of the coordinator
  ConnectionFiles files;
  // How often the TLS files are read again: a CA, certificate or key
  // replaced on disk is used from the next connection on, no restart.
  absl::Duration tls_reload = absl::Seconds(30);
  // A connection with calls open is pinged this often and is dead (its calls
  // UNAVAILABLE) when a ping goes unanswered this long: a coordinator that
  // froze, or whose host vanished without closing the connection, would
  // otherwise hold a watch or a rank's long poll forever.
  absl::Duration keepalive = absl::Seconds(20);
  // Told when files.token_file is read again (TokenFile::Listener); may be null.
  TokenFile::Listener on_token_reload;
  // Who says "WARNING: ... the bearer token crosses the network in
  // plaintext" on stderr when a token goes to a coordinator that is not on
  // loopback without TLS ("plateauctl", "plateau_worker"); empty: nobody
  // (the ranks, whose agent has said it).
  std::string warn_plaintext_as;
};

// Reads a PEM file (certificate, key, CA): INVALID_ARGUMENT naming `flag`
// and the path when it cannot be read or holds no PEM block.
absl::StatusOr<std::string> ReadPemFile(const std::string& flag, const std::string& path);

// Checks at start that `key_pem` is the private key of the first
// certificate of `cert_pem` (and both parse): INVALID_ARGUMENT naming both
// flags and paths otherwise. gRPC reads TLS files again as they change
// (TlsFiles), so a mismatched pair would otherwise start and then fail every
// handshake.
absl::Status CheckKeyOfCertificate(const std::string& cert_flag, const std::string& cert_path,
                                   const std::string& cert_pem, const std::string& key_flag,
                                   const std::string& key_path, const std::string& key_pem);

// Reads a certificate and its key (ReadPemFile) and checks that they are a
// pair (CheckKeyOfCertificate): what every TLS identity is checked with at
// start, the coordinator's and a client's.
absl::Status CheckCertificateAndKeyFiles(const std::string& cert_flag, const std::string& cert_path,
                                         const std::string& key_flag, const std::string& key_path);

// `path` made absolute and lexically normal (as given when that fails, ""
// as ""): for gRPC's file-watching TLS credentials, which read it from a
// thread of their own, and for a worker's ranks (AbsoluteConnectionFiles).
std::string AbsoluteFilePath(const std::string& path);

// Checks an address a flag gives (`flag`: "--coordinator", "--listen"):
// HOST:PORT or [IPV6]:PORT with a port 1-65535, 0-65535 when `listen` (0:
// the system picks). Addresses in gRPC's own schemes (unix:PATH,
// dns:///HOST:PORT, ipv4:..., ...) are passed on unchecked. INVALID_ARGUMENT
// "<flag>=<address>: expected ..." otherwise: gRPC itself takes a port past
// 65535 modulo 65536, so 127.0.0.1:99553 would reach port 34017.
absl::Status CheckAddress(const std::string& flag, const std::string& address, bool listen);

// A channel to options.address (CheckAddress'd as --coordinator): TLS verified against tls_ca_file
// when set, else plaintext; this client's certificate (tls_client_cert_file, tls_client_key_file) in the
// handshake when set; the token of token_file on every call when set (read again when the
// file changes: TokenFile). Files are read here; their errors are INVALID_ARGUMENT naming the flag
// (--token_file, --tls_ca_file, --tls_client_cert_file, --tls_client_key_file) and the path. The channel connects
// lazily: an unreachable coordinator shows as UNAVAILABLE on the first call.
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
