// A small HTTP/1.1 server for the coordinator's operational endpoints
// (/metrics, /healthz, /readyz) and pages (/jobs/ID/memory): GET and HEAD of
// a fixed set of exact paths and of the paths below a few prefixes,
// 404 for any other path, 405 for any other method, 400 for what does not
// parse. One request per connection ("Connection: close").
//
// Why not prometheus-cpp's Exposer: it runs on civetweb, whose Debian build
// gives each worker thread a fixed 100 KiB stack (USE_STACK_SIZE) from which
// glibc also carves the process's static TLS (60 KiB of it OpenBLAS's, which
// the coordinator links through the step's memory plan). civetweb's 404 path
// needs ~40 KiB more than is left, so `GET /` overflowed the stack and killed
// the coordinator. Neither the stack nor the error path can be configured,
// and the Exposer serves only collectables (no 503 for /readyz).
//
// Robustness, by construction: one thread with its default (8 MiB) stack,
// non-blocking sockets and poll(), so no client can block another or the
// process; a request head is at most max_request_bytes (longer: 414 or 431);
// every connection is closed once request_timeout has passed since it was
// accepted (a slow client gets 408) or since its response was ready (a
// slow reader); at most max_connections are open, the oldest is closed to
// admit a new one, so a flood cannot keep a kubelet probe out.
//
// Thread safety: Start() and the destructor from one thread. Handlers run on
// the server's thread, one at a time, and must not block: read state that
// is kept current elsewhere (a registry, a status under a short lock).
#ifndef PLATEAU_SERVER_HTTP_SERVER_H_
#define PLATEAU_SERVER_HTTP_SERVER_H_

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace plateau {

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};
using HttpHandler = std::function<HttpResponse()>;
// A handler of every path below a prefix ("/jobs/" serves "/jobs/job-3/memory"):
// it gets the path and the query string (after '?', "" when none) and
// answers 404 itself for a path it does not serve.
using HttpPrefixHandler = std::function<HttpResponse(const std::string& path, const std::string& query)>;

struct HttpServerOptions {
  // Request line and headers together; a request body is never read.
  size_t max_request_bytes = 8 * 1024;
  absl::Duration request_timeout = absl::Seconds(10);
  int max_connections = 64;
};

class HttpServer {
 public:
  // Listens on `bind_address` ("HOST:PORT", "[V6]:PORT" or "PORT" for every
  // interface; port 0 picks a free one) and serves `routes` (exact paths,
  // e.g. "/metrics") and `prefix_routes` (every longer path starting with
  // the prefix, e.g. "/jobs/"; an exact route wins) until destroyed.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(
      const std::string& bind_address, std::map<std::string, HttpHandler> routes, HttpServerOptions options = {},
      std::map<std::string, HttpPrefixHandler> prefix_routes = {});
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }

 private:
  struct Connection;
  HttpServer(int listen_fd, int port, int wake_read, int wake_write, std::map<std::string, HttpHandler> routes,
             HttpServerOptions options, std::map<std::string, HttpPrefixHandler> prefix_routes);
  void Loop();
  // The response to a parsed request.
  std::string Respond(const std::string& method, const std::string& path, const std::string& query);

  const int listen_fd_;
  const int port_;
  const int wake_read_, wake_write_;  // a pipe: the destructor wakes Loop
  const std::map<std::string, HttpHandler> routes_;
  const std::map<std::string, HttpPrefixHandler> prefix_routes_;
  const HttpServerOptions options_;
  std::thread thread_;
};

// The response bytes of `status` (a status line, Content-Type,
// Content-Length, Connection: close, `extra_headers` each ending in CRLF),
// with `body` unless `head_only`.
std::string FormatHttpResponse(int status, const std::string& content_type, const std::string& body,
                               bool head_only, const std::string& extra_headers = "");

}  // namespace plateau

#endif  // PLATEAU_SERVER_HTTP_SERVER_H_
