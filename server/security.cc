#include "server/security.h"

#include <arpa/inet.h>

#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "proto/utf8.h"

namespace plateau {

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // Every byte of b is visited whatever a holds; volatile keeps the
  // compiler from turning the loop back into an early exit.
  volatile unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < b.size(); ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    diff = diff | (x ^ static_cast<unsigned char>(b[i]));
  }
  return diff == 0;
}

grpc::Status BearerAuth::Check(const grpc::ServerContext& ctx) const {
  if (!enabled()) return grpc::Status::OK;
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return CheckHeader(nullptr);
  const absl::string_view value(it->second.data(), it->second.length());
  return CheckHeader(&value);
}

grpc::Status BearerAuth::CheckHeader(const absl::string_view* authorization) const {
  if (!enabled()) return grpc::Status::OK;
  constexpr absl::string_view kScheme = "bearer ";
  if (authorization == nullptr || authorization->size() < kScheme.size() ||
      !absl::EqualsIgnoreCase(authorization->substr(0, kScheme.size()), kScheme)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing bearer token: this coordinator requires 'authorization: Bearer <token>' on "
                        "every call (plateauctl --token_file or $PLATEAU_TOKEN_FILE; plateau_worker --token_file)");
  }
  const absl::string_view given = absl::StripAsciiWhitespace(authorization->substr(kScheme.size()));
  // Compared with every token (no early exit), so the time does not say
  // which one it was close to; `tokens` holds them for the loop, as a
  // reload on another thread may replace the file's own reference.
  const std::shared_ptr<const std::vector<std::string>> tokens = file_->Tokens();
  bool match = false;
  for (const std::string& token : *tokens) match = ConstantTimeEquals(given, token) || match;
  if (!match) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        absl::StrCat("wrong bearer token: it is not in the coordinator's ", flag_));
  }
  return grpc::Status::OK;
}

std::string PeerHost(const std::string& peer) {
  absl::string_view p = peer;
  if (!absl::ConsumePrefix(&p, "ipv4:") && !absl::ConsumePrefix(&p, "ipv6:")) return peer;
  if (absl::StartsWith(p, "[")) {
    const size_t close = p.find(']');
    if (close != absl::string_view::npos) return std::string(p.substr(1, close - 1));
  }
  const size_t colon = p.rfind(':');
  return std::string(colon == absl::string_view::npos ? p : p.substr(0, colon));
}

std::string CertificateName(absl::string_view name) {
  std::string out = ToValidUtf8(name);
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  }
  return std::string(Utf8Prefix(out, 128));
}

std::string CallerOf(const grpc::ServerContext& ctx) {
  std::string host = PeerHost(ctx.peer());
  if (host.empty()) host = "an unknown peer";
  const std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth == nullptr) return host;
  // The subject's common name, else (a certificate named by its subject
  // alternative names alone, as SPIFFE's are) the first of those.
  for (const auto& [property, label] : {std::pair<const char*, const char*>{GRPC_X509_CN_PROPERTY_NAME, "CN="},
                                        {GRPC_X509_SAN_PROPERTY_NAME, "SAN="}}) {
    for (const grpc::string_ref& value : auth->FindPropertyValues(property)) {
      if (value.empty()) continue;
      return absl::StrCat(label, CertificateName(absl::string_view(value.data(), value.size())), " at ", host);
    }
  }
  return host;
}

WatchLimiter::Lease::~Lease() {
  if (limiter_ != nullptr) limiter_->Release(host_);
}

grpc::Status WatchLimiter::Acquire(const std::string& host, Lease* lease) {
  absl::MutexLock lock(&mu_);
  int& n = open_[host];
  if (max_ > 0 && n >= max_) {
    if (n == 0) open_.erase(host);
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("too many open watches from ", host, ": ", n, " of at most ", max_,
                                     " (the coordinator's --max_watches_per_client) are open; retry with "
                                     "backoff: a place frees when one of them ends"));
  }
  ++n;
  lease->limiter_ = this;
  lease->host_ = host;
  return grpc::Status::OK;
}

int WatchLimiter::open(const std::string& host) const {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(host);
  return it == open_.end() ? 0 : it->second;
}

void WatchLimiter::Release(const std::string& host) {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(host);
  if (it == open_.end()) return;
  if (--it->second <= 0) open_.erase(it);
}

}  // namespace plateau
