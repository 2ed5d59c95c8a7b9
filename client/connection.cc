#include "client/connection.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/host_port.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "grpcpp/support/client_interceptor.h"
#include "openssl/bio.h"
#include "openssl/err.h"
#include "openssl/pem.h"
#include "openssl/x509.h"

namespace plateau {
namespace {

absl::StatusOr<std::string> ReadWhole(const std::string& flag, const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": expected a file path"));
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, "=", path, ": is a directory, expected a file"));
  }
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  const int open_error = errno;
  std::stringstream text;
  if (in) text << in.rdbuf();
  if (!in || in.bad()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, "=", path, ": cannot read the file",
                     open_error != 0 ? absl::StrCat(" (", std::strerror(open_error), ")") : ""));
  }
  return text.str();
}

// Adds the bearer token (the token file's first, as it is when the call
// starts) to the initial metadata of every call on the channel.
class BearerInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(std::string header) : header_(std::move(header)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace("authorization", header_);
    }
    methods->Proceed();
  }

 private:
  const std::string header_;
};

class BearerInterceptorFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerInterceptorFactory(std::shared_ptr<TokenFile> file) : file_(std::move(file)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new BearerInterceptor(absl::StrCat("Bearer ", file_->Tokens()->front()));
  }

 private:
  const std::shared_ptr<TokenFile> file_;
};

}  // namespace

absl::StatusOr<std::vector<std::string>> ReadTokenFile(const std::string& flag, const std::string& path) {
  absl::StatusOr<std::string> text = ReadWhole(flag, path);
  if (!text.ok()) return text.status();
  std::vector<std::string> tokens;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    ++line_number;
    const absl::string_view token = absl::StripTrailingAsciiWhitespace(line);
    if (token.empty()) continue;  // a blank line
    // Visible ASCII only: what an HTTP/2 header value carries unchanged,
    // and what "Bearer <token>" (RFC 6750) allows. A stray byte would
    // otherwise surface as a confusing per-call failure.
    for (unsigned char ch : token) {
      if (ch < 0x21 || ch > 0x7e) {
        return absl::InvalidArgumentError(
            absl::StrCat(flag, "=", path, ": line ", line_number,
                         ": expected a token of visible ASCII characters (no spaces), one per line; found byte ",
                         static_cast<int>(ch)));
      }
    }
    tokens.emplace_back(token);
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, ": the file is empty; expected the bearer token"));
  }
  return tokens;
}

absl::StatusOr<std::shared_ptr<TokenFile>> TokenFile::Open(const std::string& flag, const std::string& path,
                                                           absl::Duration recheck, Listener on_reload, Reader read) {
  std::shared_ptr<TokenFile> file(new TokenFile(flag, path, recheck, std::move(on_reload), std::move(read)));
  // The identity before the read: a change during it is seen next time.
  const Identity identity = file->Look();
  absl::StatusOr<std::vector<std::string>> tokens = file->read_(flag, path);
  if (!tokens.ok()) return tokens.status();
  absl::MutexLock lock(&file->mu_);
  file->tokens_ = std::make_shared<const std::vector<std::string>>(*std::move(tokens));
  file->seen_ = identity;
  file->looked_ = std::chrono::steady_clock::now();
  return file;
}

TokenFile::Identity TokenFile::Look() const {
  struct stat st {};
  Identity id;
  if (stat(path_.c_str(), &st) != 0) return id;
  id.device = st.st_dev;
  id.inode = st.st_ino;
  id.size = st.st_size;
  id.mtime_ns = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  id.ctime_ns = int64_t{st.st_ctim.tv_sec} * 1000000000 + st.st_ctim.tv_nsec;
  return id;
}

std::shared_ptr<const std::vector<std::string>> TokenFile::Tokens() {
  Identity seen;
  std::string failed;
  {
    absl::MutexLock lock(&mu_);
    const auto now = std::chrono::steady_clock::now();
    if (looking_ || now - looked_ < absl::ToChronoNanoseconds(recheck_)) return tokens_;
    looked_ = now;
    looking_ = true;
    seen = seen_;
    failed = failed_;
  }
  // One caller looks, without the lock: a slow or hung file system holds
  // up that call alone, while every other call checks against the tokens
  // in force.
  const Identity identity = Look();
  const int look_error = errno;
  std::optional<absl::StatusOr<std::vector<std::string>>> read;
  // Read when the file changed, and after a failed read at every look: what
  // failed may be mended by something the identity may not show (a chmod
  // within one tick of a coarse clock).
  if (!(identity == seen) || !failed.empty()) {
    read = identity.size < 0 ? absl::InvalidArgumentError(absl::StrCat(flag_, "=", path_, ": cannot look at the file (",
                                                                       std::strerror(look_error), ")"))
                             : read_(flag_, path_);
  }
  std::shared_ptr<const std::vector<std::string>> tokens;
  bool tell = false;
  {
    absl::MutexLock lock(&mu_);
    looking_ = false;
    seen_ = identity;
    if (read.has_value()) {
      const std::string now_failed = read->ok() ? "" : std::string(read->status().message());
      // Each change is told once: a read of a changed file, or a failure
      // that ended or became another.
      tell = !(identity == seen) || now_failed != failed_;
      failed_ = now_failed;
      if (read->ok()) tokens_ = std::make_shared<const std::vector<std::string>>(**std::move(read));
    }
    tokens = tokens_;
  }
  if (tell && on_reload_) on_reload_(read->status(), tokens->size());
  return tokens;
}

absl::StatusOr<std::string> ReadPemFile(const std::string& flag, const std::string& path) {
  absl::StatusOr<std::string> text = ReadWhole(flag, path);
  if (!text.ok()) return text.status();
  if (!absl::StrContains(*text, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, ": expected a PEM file (-----BEGIN ...)"));
  }
  return text;
}

absl::Status CheckKeyOfCertificate(const std::string& cert_flag, const std::string& cert_path,
                                   const std::string& cert_pem, const std::string& key_flag,
                                   const std::string& key_path, const std::string& key_pem) {
  std::unique_ptr<BIO, decltype(&BIO_free)> cert_bio(
      BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size())), &BIO_free);
  std::unique_ptr<BIO, decltype(&BIO_free)> key_bio(BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size())),
                                                    &BIO_free);
  if (cert_bio == nullptr || key_bio == nullptr) return absl::ResourceExhaustedError("TLS check: out of memory");
  std::unique_ptr<X509, decltype(&X509_free)> cert(PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr),
                                                   &X509_free);
  if (cert == nullptr) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat(cert_flag, "=", cert_path, ": expected a PEM certificate (-----BEGIN CERTIFICATE-----)"));
  }
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      // A callback that gives no passphrase: OpenSSL's default would prompt
      // on the terminal and wait (gRPC itself gives none either).
      PEM_read_bio_PrivateKey(
          key_bio.get(), nullptr, [](char*, int, int, void*) { return 0; }, nullptr),
      &EVP_PKEY_free);
  if (key == nullptr) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat(key_flag, "=", key_path, ": expected a PEM private key without a passphrase"));
  }
  const bool match = X509_check_private_key(cert.get(), key.get()) == 1;
  ERR_clear_error();  // OpenSSL 3's decoders may queue errors on success too
  if (!match) {
    return absl::InvalidArgumentError(
        absl::StrCat(key_flag, "=", key_path, " is not the private key of ", cert_flag, "=", cert_path));
  }
  return absl::OkStatus();
}

absl::Status CheckCertificateAndKeyFiles(const std::string& cert_flag, const std::string& cert_path,
                                         const std::string& key_flag, const std::string& key_path) {
  absl::StatusOr<std::string> cert = ReadPemFile(cert_flag, cert_path);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPemFile(key_flag, key_path);
  if (!key.ok()) return key.status();
  return CheckKeyOfCertificate(cert_flag, cert_path, *cert, key_flag, key_path, *key);
}

ConnectionFiles ConnectionFilesFromFlags(const std::map<std::string, std::string>& flags) {
  auto get = [&](const char* name) {
    auto it = flags.find(name);
    return it == flags.end() ? std::string() : it->second;
  };
  return ConnectionFiles{get(kConnectionFileFlags[0]), get(kConnectionFileFlags[1]), get(kConnectionFileFlags[2]),
                         get(kConnectionFileFlags[3])};
}

std::vector<std::string> ConnectionFileArgs(const ConnectionFiles& files) {
  return {absl::StrCat("--", kConnectionFileFlags[0], "=", files.token_file),
          absl::StrCat("--", kConnectionFileFlags[1], "=", files.tls_ca_file),
          absl::StrCat("--", kConnectionFileFlags[2], "=", files.tls_client_cert_file),
          absl::StrCat("--", kConnectionFileFlags[3], "=", files.tls_client_key_file)};
}

ConnectionFiles AbsoluteConnectionFiles(ConnectionFiles files) {
  for (std::string* path :
       {&files.token_file, &files.tls_ca_file, &files.tls_client_cert_file, &files.tls_client_key_file}) {
    *path = AbsoluteFilePath(*path);
  }
  return files;
}

std::string AbsoluteFilePath(const std::string& path) {
  if (path.empty()) return path;
  std::error_code ec;
  const std::filesystem::path absolute = std::filesystem::absolute(path, ec);
  return ec ? path : absolute.lexically_normal().string();
}

absl::Status CheckAddress(const std::string& flag, const std::string& address, bool listen) {
  const int lowest = listen ? 0 : 1;
  const std::string expected = absl::StrCat(
      flag, "=", address, ": expected HOST:PORT (or [IPV6]:PORT) with a port ", lowest, "-65535");
  // gRPC's target schemes: left to gRPC, which says what it cannot resolve.
  for (absl::string_view scheme : {"unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:"}) {
    if (absl::StartsWith(address, scheme)) return absl::OkStatus();
  }
  std::string host;
  int port = -1;
  if (!SplitHostPort(address, &host, &port) || host.empty() || port < lowest) {
    return absl::InvalidArgumentError(expected);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> OpenChannel(const ConnectionOptions& options) {
  if (absl::Status s = CheckAddress("--coordinator", options.address, /*listen=*/false); !s.ok())
    return s;
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  const bool has_cert = !options.files.tls_client_cert_file.empty(),
             has_key = !options.files.tls_client_key_file.empty();
  if (has_cert != has_key) {
    return absl::InvalidArgumentError(
        absl::StrCat("a client certificate needs both --tls_client_cert_file and --tls_client_key_file; ",
                     has_cert ? "--tls_client_key_file" : "--tls_client_cert_file", " is missing"));
  }
  if (has_cert && options.files.tls_ca_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_client_cert_file is sent only over TLS: give --tls_ca_file too (the CA of the coordinator's "
        "certificate)");
  }
  if (!options.files.tls_ca_file.empty()) {
    // Read here for clear errors at start; gRPC then reads the files again
    // every tls_reload, so a replaced CA, certificate or key is used for
    // the next connection without a restart.
    absl::StatusOr<std::string> ca = ReadPemFile("--tls_ca_file", options.files.tls_ca_file);
    if (!ca.ok()) return ca.status();
    if (has_cert) {
      if (absl::Status s = CheckCertificateAndKeyFiles("--tls_client_cert_file", options.files.tls_client_cert_file,
                                                       "--tls_client_key_file", options.files.tls_client_key_file);
          !s.ok()) {
        return s;
      }
    }
    const unsigned int reload_s =
        static_cast<unsigned int>(std::max<int64_t>(1, absl::ToInt64Seconds(options.tls_reload)));
    // Empty key and certificate paths: no identity is watched (gRPC's own
    // CA-only constructor passes the same).
    auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        AbsoluteFilePath(options.files.tls_client_key_file), AbsoluteFilePath(options.files.tls_client_cert_file),
        AbsoluteFilePath(options.files.tls_ca_file), reload_s);
    grpc::experimental::TlsChannelCredentialsOptions tls;
    tls.set_certificate_provider(provider);
    tls.watch_root_certs();
    if (has_cert) tls.watch_identity_key_cert_pairs();
    // The coordinator's certificate must name the address dialled.
    // gRPC 1.51 installs this verifier when none is set; set here so that
    // the check does not hang on that default.
    tls.set_certificate_verifier(std::make_shared<grpc::experimental::HostNameCertificateVerifier>());
    credentials = grpc::experimental::TlsCredentials(tls);
  }
  if (!options.warn_plaintext_as.empty() && !options.files.token_file.empty() && options.files.tls_ca_file.empty() &&
      !IsLoopbackAddress(options.address)) {
    std::fprintf(stderr,
                 "%s: WARNING: --coordinator=%s is not loopback and TLS is off (no --tls_ca_file): the bearer "
                 "token and every request cross the network in plaintext\n",
                 options.warn_plaintext_as.c_str(), options.address.c_str());
  }
  grpc::ChannelArguments args;
  // Replies come from the coordinator, which bounds what it accepts with
  // its own --max_request_bytes; a receive limit here (gRPC's default is
  // 4 MiB) would only break, e.g., an assignment whose spec the coordinator
  // accepted under a larger limit, or a long ListJobs page.
  // Reconnect within a second of a restarted coordinator answering (gRPC's
  // default backoff grows to minutes): its workers have reattach_timeout
  // (10 s by default) to register again, and watches resume.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // gRPC takes this as the connect timeout too (20 s by default). Calls
  // wait on an attempt that is connecting, so one attempt stuck in its
  // handshake (a peer that accepts and never answers) held heartbeats for
  // two 5 s deadlines and cost a worker its re-attach window. 3 s is ample
  // for TCP and TLS handshakes on a cluster network.
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 3000);
  // A long-lived client's channel holds a dead coordinator's connection
  // until something polls it, and its next call goes out on it and fails
  // (UNAVAILABLE, "Socket closed") although a restarted coordinator is
  // back. Calls that only read are sent again then; calls that change
  // something are not (a cancel whose first answer was lost would be
  // retried into "already finished"; plateauctl retries its submit itself,
  // under its request id).
  args.SetServiceConfigJSON(R"json({"methodConfig": [{
    "name": [{"service": "plateau.v1.JobService", "method": "GetJob"},
             {"service": "plateau.v1.JobService", "method": "ListJobs"},
             {"service": "plateau.v1.JobService", "method": "PlanJob"},
             {"service": "plateau.v1.JobService", "method": "GetMemoryTimeline"},
             {"service": "plateau.v1.JobService", "method": "ListWorkers"}],
    "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s",
                    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]})json");
  args.SetMaxReceiveMessageSize(-1);
  // Pinged while calls are open, quiet streams included (gRPC stops after
  // two pings without data by default); the coordinator accepts pings this
  // often (coordinator_main.cc).
  const int keepalive_ms =
      static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(options.keepalive), 1, INT32_MAX));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, keepalive_ms);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, keepalive_ms);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  if (!options.files.token_file.empty()) {
    absl::StatusOr<std::shared_ptr<TokenFile>> file =
        TokenFile::Open("--token_file", options.files.token_file, absl::Seconds(1), options.on_token_reload);
    if (!file.ok()) return file.status();
    interceptors.push_back(std::make_unique<BearerInterceptorFactory>(*std::move(file)));
  }
  return grpc::experimental::CreateCustomChannelWithInterceptors(options.address, credentials, args,
                                                                  std::move(interceptors));
}

bool PauseBeforeRetry(grpc::Channel& channel, absl::Duration timeout) {
  if (channel.GetState(/*try_to_connect=*/false) == GRPC_CHANNEL_READY) {
    // Connected, yet the call failed (the coordinator was slow, or is going
    // away): no connection to wait for.
    absl::SleepFor(timeout);
    return false;
  }
  return channel.WaitForConnected(absl::ToChronoTime(absl::Now() + timeout));
}

}  // namespace plateau
