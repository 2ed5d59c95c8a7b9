#include "server/http_server.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "client/host_port.h"

namespace plateau {
namespace {

// After its response a connection is read (and discarded) for at most this
// long and this much, so that a client still sending (a long path, a body)
// sees the response instead of a reset; then it is closed.
constexpr absl::Duration kLinger = absl::Seconds(2);
constexpr size_t kMaxLingerBytes = 1 << 20;
// Accepting stops this long when the process is out of descriptors.
constexpr absl::Duration kAcceptPause = absl::Milliseconds(100);

const char* Reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 414: return "URI Too Long";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Status";
  }
}

// RFC 9110 5.6.2: a method is a token.
bool IsTokenChar(char c) {
  return c != '\0' && (absl::ascii_isalnum(static_cast<unsigned char>(c)) ||
                       absl::string_view("!#$%&'*+-.^_`|~").find(c) != absl::string_view::npos);
}

// The request line "METHOD SP /target SP HTTP/1.x" (without its line end):
// 0 and the method, path and query (after '?', without a fragment), or the
// status to refuse it with.
int ParseRequestLine(absl::string_view line, std::string* method, std::string* path, std::string* query) {
  if (absl::EndsWith(line, "\r")) line.remove_suffix(1);
  std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
  if (parts.size() != 3 || parts[0].empty()) return 400;
  if (!std::all_of(parts[0].begin(), parts[0].end(), IsTokenChar)) return 400;
  const absl::string_view target = parts[1], version = parts[2];
  if (version.size() != 8 || !absl::StartsWith(version, "HTTP/") || !absl::ascii_isdigit(version[5]) ||
      version[6] != '.' || !absl::ascii_isdigit(version[7])) {
    return 400;
  }
  if (version[5] != '1') return 505;
  // Origin form only, printable ASCII (anything else must be percent-encoded).
  if (target.empty() || target[0] != '/') return 400;
  for (char c : target) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u >= 0x7f) return 400;
  }
  *method = std::string(parts[0]);
  const absl::string_view no_fragment = target.substr(0, target.find('#'));
  const size_t q = no_fragment.find('?');
  *path = std::string(no_fragment.substr(0, q));
  *query = q == absl::string_view::npos ? "" : std::string(no_fragment.substr(q + 1));
  return 0;
}

// The end of the request head (after its empty line), or npos.
size_t HeadEnd(const std::string& in) {
  size_t crlf = in.find("\r\n\r\n");
  size_t lf = in.find("\n\n");
  if (crlf != std::string::npos) crlf += 4;
  if (lf != std::string::npos) lf += 2;
  return std::min(crlf, lf);
}

// HOST:PORT, [IPV6]:PORT or a bare PORT (every address of this host).
absl::Status SplitAddress(const std::string& address, std::string* host, std::string* port) {
  int n = -1;
  const bool bare = address.find_first_of(":[") == std::string::npos;
  if (!SplitHostPort(bare ? ":" + address : address, host, &n)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "': expected HOST:PORT (or [IPV6]:PORT) with a port 0-65535"));
  }
  *port = std::to_string(n);
  return absl::OkStatus();
}

void CloseFd(int& fd) {
  if (fd >= 0) close(fd);
  fd = -1;
}

}  // namespace

std::string FormatHttpResponse(int status, const std::string& content_type, const std::string& body,
                               bool head_only, const std::string& extra_headers) {
  std::string out = absl::StrCat("HTTP/1.1 ", status, " ", Reason(status), "\r\nContent-Type: ", content_type,
                                 "\r\nContent-Length: ", body.size(),
                                 "\r\nCache-Control: no-store\r\nConnection: close\r\n", extra_headers, "\r\n");
  if (!head_only) out += body;
  return out;
}

struct HttpServer::Connection {
  enum class Phase { kReading, kWriting, kLingering };
  int fd = -1;
  Phase phase = Phase::kReading;
  absl::Time deadline;
  std::string in;   // the request head so far
  std::string out;  // the response
  size_t sent = 0;
  size_t discarded = 0;
};

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& bind_address,
                                                               std::map<std::string, HttpHandler> routes,
                                                               HttpServerOptions options,
                                                               std::map<std::string, HttpPrefixHandler> prefix_routes) {
  std::string host, port;
  if (absl::Status s = SplitAddress(bind_address, &host, &port); !s.ok()) return s;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("'", bind_address, "': ", gai_strerror(rc)));
  }
  int fd = -1;
  std::string error = "no address";
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      error = absl::StrCat("socket: ", strerror(errno));
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 128) != 0) {
      error = strerror(errno);
      CloseFd(fd);
    }
  }
  freeaddrinfo(found);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", bind_address, ": ", error));
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const int bound_port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                           : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  int wake[2];
  if (pipe2(wake, O_NONBLOCK | O_CLOEXEC) != 0) {
    const std::string why = strerror(errno);
    CloseFd(fd);
    return absl::UnavailableError(absl::StrCat("pipe: ", why));
  }
  std::unique_ptr<HttpServer> server(
      new HttpServer(fd, bound_port, wake[0], wake[1], std::move(routes), options, std::move(prefix_routes)));
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  return server;
}

HttpServer::HttpServer(int listen_fd, int port, int wake_read, int wake_write,
                       std::map<std::string, HttpHandler> routes, HttpServerOptions options,
                       std::map<std::string, HttpPrefixHandler> prefix_routes)
    : listen_fd_(listen_fd),
      port_(port),
      wake_read_(wake_read),
      wake_write_(wake_write),
      routes_(std::move(routes)),
      prefix_routes_(std::move(prefix_routes)),
      options_(options) {}

HttpServer::~HttpServer() {
  if (thread_.joinable()) {
    while (write(wake_write_, "x", 1) < 0 && errno == EINTR) {
    }
    thread_.join();
  }
  close(listen_fd_);
  close(wake_read_);
  close(wake_write_);
}

std::string HttpServer::Respond(const std::string& method, const std::string& path, const std::string& query) {
  auto route = routes_.find(path);
  if (route == routes_.end()) {
    // The longest prefix route that the path extends (a path below it).
    const HttpPrefixHandler* below = nullptr;
    size_t longest = 0;
    for (const auto& [prefix, handler] : prefix_routes_) {
      if (path.size() > prefix.size() && absl::StartsWith(path, prefix) && prefix.size() > longest) {
        below = &handler;
        longest = prefix.size();
      }
    }
    if (below != nullptr) {
      if (method != "GET" && method != "HEAD") {
        return FormatHttpResponse(405, "text/plain; charset=utf-8", "only GET and HEAD\n", false,
                                  "Allow: GET, HEAD\r\n");
      }
      HttpResponse r;
      try {
        r = (*below)(path, query);
      } catch (const std::exception& e) {
        r = HttpResponse{500, "text/plain; charset=utf-8", absl::StrCat("internal error: ", e.what(), "\n")};
      }
      return FormatHttpResponse(r.status, r.content_type, r.body, method == "HEAD");
    }
    std::string known;
    for (const auto& [p, handler] : routes_) absl::StrAppend(&known, " ", p);
    for (const auto& [p, handler] : prefix_routes_) absl::StrAppend(&known, " ", p, "...");
    return FormatHttpResponse(404, "text/plain; charset=utf-8", absl::StrCat("not found; this port serves", known, "\n"),
                              method == "HEAD");
  }
  if (method != "GET" && method != "HEAD") {
    return FormatHttpResponse(405, "text/plain; charset=utf-8", "only GET and HEAD\n", false,
                              "Allow: GET, HEAD\r\n");
  }
  HttpResponse r;
  try {
    r = route->second();
  } catch (const std::exception& e) {  // e.g. bad_alloc serialising a registry
    r = HttpResponse{500, "text/plain; charset=utf-8", absl::StrCat("internal error: ", e.what(), "\n")};
  }
  return FormatHttpResponse(r.status, r.content_type, r.body, method == "HEAD");
}

void HttpServer::Loop() {
  std::vector<std::unique_ptr<Connection>> conns;  // oldest first
  absl::Time accept_paused_until = absl::InfinitePast();
  std::vector<pollfd> fds;
  char buf[4096];
  for (;;) {
    absl::Time now = absl::Now();
    // Expired connections: a client that has not sent a whole request in
    // time gets 408 if its socket takes it at once; then each is closed.
    for (auto& c : conns) {
      if (now < c->deadline) continue;
      if (c->phase == Connection::Phase::kReading && !c->in.empty()) {
        const std::string r = FormatHttpResponse(408, "text/plain; charset=utf-8", "request timeout\n", false);
        (void)send(c->fd, r.data(), r.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      }
      CloseFd(c->fd);
    }
    conns.erase(std::remove_if(conns.begin(), conns.end(), [](const auto& c) { return c->fd < 0; }), conns.end());

    fds.clear();
    fds.push_back({wake_read_, POLLIN, 0});
    fds.push_back({now >= accept_paused_until ? listen_fd_ : -1, POLLIN, 0});
    absl::Time wake_at = now + absl::Seconds(1);
    if (now < accept_paused_until) wake_at = std::min(wake_at, accept_paused_until);
    for (const auto& c : conns) {
      fds.push_back({c->fd, static_cast<short>(c->phase == Connection::Phase::kWriting ? POLLOUT : POLLIN), 0});
      wake_at = std::min(wake_at, c->deadline);
    }
    const int timeout_ms = static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(wake_at - now) + 1));
    if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      // ENOMEM: try again shortly rather than spin or give up serving.
      poll(nullptr, 0, 10);
      continue;
    }
    if (fds[0].revents != 0) break;  // the destructor
    now = absl::Now();

    for (size_t i = 0; i < conns.size(); ++i) {
      Connection& c = *conns[i];
      const short ev = fds[i + 2].revents;
      if (ev == 0) continue;
      if (c.phase == Connection::Phase::kReading) {
        bool eof = false;
        while (c.in.size() <= options_.max_request_bytes) {
          const ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
          if (n > 0) {
            c.in.append(buf, static_cast<size_t>(n));
          } else if (n == 0) {
            eof = true;
            break;
          } else if (errno == EINTR) {
            continue;
          } else {
            eof = errno != EAGAIN && errno != EWOULDBLOCK;
            break;
          }
        }
        // Decide as early as the bytes allow: a method that is not a token
        // or a bad request line is refused before the headers arrive.
        int status = 0;
        std::string method, path, query;
        const size_t end = HeadEnd(c.in);
        const size_t line_end = c.in.find('\n');
        const size_t method_end = std::min(c.in.find(' '), c.in.size());
        if (!std::all_of(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(method_end), IsTokenChar)) {
          status = 400;
        } else if (line_end != std::string::npos && line_end <= options_.max_request_bytes) {
          status = ParseRequestLine(absl::string_view(c.in).substr(0, line_end), &method, &path, &query);
          const size_t head_bytes = end == std::string::npos ? c.in.size() : end;
          if (status == 0 && head_bytes > options_.max_request_bytes) {
            status = 431;
          } else if (status == 0 && end == std::string::npos && !eof) {
            continue;  // wait for the rest of the head
          }
        } else if (c.in.size() > options_.max_request_bytes) {
          status = 414;
        }
        if (status == 0 && method.empty()) {
          if (eof) CloseFd(c.fd);  // gone before its request line ended
          continue;
        }
        c.out = status != 0 ? FormatHttpResponse(status, "text/plain; charset=utf-8",
                                                 absl::StrCat(Reason(status), "\n"), false)
                            : Respond(method, path, query);
        c.in.clear();
        c.in.shrink_to_fit();
        c.phase = Connection::Phase::kWriting;
        c.deadline = now + options_.request_timeout;
        continue;  // written when the socket takes it
      }
      if (c.phase == Connection::Phase::kWriting) {
        while (c.sent < c.out.size()) {
          const ssize_t n = send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
          if (n > 0) {
            c.sent += static_cast<size_t>(n);
          } else if (n < 0 && errno == EINTR) {
            continue;
          } else {
            if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) CloseFd(c.fd);
            break;
          }
        }
        if (c.fd >= 0 && c.sent == c.out.size()) {
          shutdown(c.fd, SHUT_WR);
          c.out.clear();
          c.out.shrink_to_fit();
          c.phase = Connection::Phase::kLingering;
          c.deadline = std::min(c.deadline, now + kLinger);
        }
        continue;
      }
      // Lingering: discard what the client still sends until it closes.
      for (;;) {
        const ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
        if (n > 0) {
          c.discarded += static_cast<size_t>(n);
          if (c.discarded > kMaxLingerBytes) CloseFd(c.fd);
        } else if (n < 0 && errno == EINTR) {
          continue;
        } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
          CloseFd(c.fd);
        }
        if (c.fd < 0 || n < 0) break;
      }
    }
    conns.erase(std::remove_if(conns.begin(), conns.end(), [](const auto& c) { return c->fd < 0; }), conns.end());

    if (fds[1].revents & POLLIN) {
      for (int i = 0; i < options_.max_connections; ++i) {
        const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EINTR || errno == ECONNABORTED) continue;
          if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            accept_paused_until = now + kAcceptPause;
          }
          break;
        }
        if (static_cast<int>(conns.size()) >= options_.max_connections) {
          CloseFd(conns.front()->fd);
          conns.erase(conns.begin());
        }
        auto c = std::make_unique<Connection>();
        c->fd = fd;
        c->deadline = now + options_.request_timeout;
        conns.push_back(std::move(c));
      }
    }
  }
  for (auto& c : conns) CloseFd(c->fd);
}

}  // namespace plateau
