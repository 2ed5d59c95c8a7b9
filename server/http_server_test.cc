#include "server/http_server.h"

#include <atomic>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing_cluster::HttpStatus;
using testing_cluster::RawHttp;

class HttpServerTest : public ::testing::Test {
 protected:
  void Serve(HttpServerOptions options = {}) {
    std::map<std::string, HttpHandler> routes = {
        {"/hello", [] { return HttpResponse{200, "text/plain", "hello\n"}; }},
        {"/busy", [] { return HttpResponse{503, "text/plain", "not ready: busy\n"}; }},
        {"/throws", []() -> HttpResponse { throw std::runtime_error("boom"); }},
    };
    std::map<std::string, HttpPrefixHandler> prefixes = {
        {"/jobs/",
         [](const std::string& path, const std::string& query) {
           return HttpResponse{path == "/jobs/none" ? 404 : 200, "text/plain", absl::StrCat(path, "|", query, "\n")};
         }},
    };
    auto s = HttpServer::Start("127.0.0.1:0", std::move(routes), options, std::move(prefixes));
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    address_ = absl::StrCat("127.0.0.1:", server_->port());
  }
  std::string Exchange(const std::string& request) {
    RawHttp c(address_);
    EXPECT_TRUE(c.connected());
    c.Send(request);
    return c.ReadAll();
  }

  std::unique_ptr<HttpServer> server_;
  std::string address_;
};

// A prefix route gets every path below its prefix with the query string
// (no fragment); the prefix itself is not below it; other methods are 405.
TEST_F(HttpServerTest, PrefixRoutesGetThePathAndQuery) {
  Serve();
  const std::string get = Exchange("GET /jobs/job-3/memory?rank=1#top HTTP/1.1\r\n\r\n");
  EXPECT_EQ(HttpStatus(get), 200);
  EXPECT_THAT(get, HasSubstr("\r\n\r\n/jobs/job-3/memory|rank=1\n"));
  EXPECT_THAT(Exchange("GET /jobs/x HTTP/1.1\r\n\r\n"), HasSubstr("\r\n\r\n/jobs/x|\n"));
  EXPECT_EQ(HttpStatus(Exchange("GET /jobs/none HTTP/1.1\r\n\r\n")), 404);
  EXPECT_EQ(HttpStatus(Exchange("GET /jobs/ HTTP/1.1\r\n\r\n")), 404);
  EXPECT_EQ(HttpStatus(Exchange("GET /jobs HTTP/1.1\r\n\r\n")), 404);
  EXPECT_EQ(HttpStatus(Exchange("POST /jobs/x HTTP/1.1\r\n\r\n")), 405);
  const std::string head = Exchange("HEAD /jobs/x HTTP/1.1\r\n\r\n");
  EXPECT_EQ(HttpStatus(head), 200);
  EXPECT_THAT(head, Not(HasSubstr("/jobs/x|")));
  EXPECT_THAT(Exchange("GET /nothing HTTP/1.1\r\n\r\n"), HasSubstr("/jobs/..."));
}

TEST_F(HttpServerTest, ServesExactPathsWithGetAndHead) {
  Serve();
  const std::string get = Exchange("GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(HttpStatus(get), 200);
  EXPECT_THAT(get, HasSubstr("Content-Length: 6\r\n"));
  EXPECT_THAT(get, HasSubstr("Connection: close\r\n"));
  EXPECT_THAT(get, HasSubstr("\r\n\r\nhello\n"));
  const std::string head = Exchange("HEAD /hello HTTP/1.0\r\n\r\n");
  EXPECT_EQ(HttpStatus(head), 200);
  EXPECT_THAT(head, HasSubstr("Content-Length: 6\r\n"));
  EXPECT_THAT(head, Not(HasSubstr("hello")));
  EXPECT_EQ(HttpStatus(Exchange("GET /hello?x=1 HTTP/1.1\r\n\r\n")), 200);
  EXPECT_EQ(HttpStatus(Exchange("GET /hello HTTP/1.0\n\n")), 200) << "bare LF line ends";
  EXPECT_EQ(HttpStatus(Exchange("GET /busy HTTP/1.1\r\n\r\n")), 503);
}

TEST_F(HttpServerTest, RefusesWhatItDoesNotServe) {
  Serve();
  EXPECT_EQ(HttpStatus(Exchange("GET / HTTP/1.1\r\n\r\n")), 404);
  EXPECT_EQ(HttpStatus(Exchange("GET /hello/ HTTP/1.1\r\n\r\n")), 404);
  EXPECT_EQ(HttpStatus(Exchange("GET //hello HTTP/1.1\r\n\r\n")), 404);
  EXPECT_EQ(HttpStatus(Exchange("GET /x/../hello HTTP/1.1\r\n\r\n")), 404) << "no path normalisation";
  const std::string post = Exchange("POST /hello HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello");
  EXPECT_EQ(HttpStatus(post), 405);
  EXPECT_THAT(post, HasSubstr("Allow: GET, HEAD\r\n"));
  EXPECT_EQ(HttpStatus(Exchange("POST /nowhere HTTP/1.1\r\n\r\n")), 404);
  EXPECT_EQ(HttpStatus(Exchange("GET /hello HTTP/2.0\r\n\r\n")), 505);
  EXPECT_EQ(HttpStatus(Exchange("GET /hello\r\n\r\n")), 400) << "HTTP/0.9";
  EXPECT_EQ(HttpStatus(Exchange("GET  /hello HTTP/1.1\r\n\r\n")), 400);
  EXPECT_EQ(HttpStatus(Exchange("GET http://x/hello HTTP/1.1\r\n\r\n")), 400);
  EXPECT_EQ(HttpStatus(Exchange("GET /he\x01llo HTTP/1.1\r\n\r\n")), 400);
  EXPECT_EQ(HttpStatus(Exchange(std::string("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 11))), 400)
      << "a TLS ClientHello is refused at its first byte, not after a timeout";
  const std::string thrown = Exchange("GET /throws HTTP/1.1\r\n\r\n");
  EXPECT_EQ(HttpStatus(thrown), 500);
  EXPECT_THAT(thrown, HasSubstr("boom"));
}

TEST_F(HttpServerTest, BoundsTheRequestHead) {
  Serve();
  EXPECT_EQ(HttpStatus(Exchange(absl::StrCat("GET /", std::string(64 * 1024, 'a'), " HTTP/1.1\r\n\r\n"))), 414);
  EXPECT_EQ(HttpStatus(Exchange(absl::StrCat("GET /hello HTTP/1.1\r\nX: ", std::string(64 * 1024, 'b'),
                                             "\r\n\r\n"))),
            431);
  EXPECT_EQ(HttpStatus(Exchange(absl::StrCat("GET /hello HTTP/1.1\r\nX: ", std::string(8 * 1024, 'c'),
                                             "\r\n\r\n"))),
            431)
      << "a head just over the bound, complete in one read";
  EXPECT_EQ(HttpStatus(Exchange(absl::StrCat("GET /hello HTTP/1.1\r\nX: ", std::string(8000, 'c'), "\r\n\r\n"))),
            200);
  EXPECT_EQ(HttpStatus(Exchange("GET /hello HTTP/1.1\r\n\r\n")), 200);
}

TEST_F(HttpServerTest, ASlowClientTimesOutWithoutHoldingUpOthers) {
  HttpServerOptions o;
  o.request_timeout = absl::Seconds(2);
  Serve(o);
  // The server's 2 s start at its accept, after this and before `start`.
  const absl::Time before_connect = absl::Now();
  RawHttp slow(address_);
  ASSERT_TRUE(slow.Send("GET /hello HT"));
  const absl::Time start = absl::Now();
  for (int i = 0; i < 5; ++i) EXPECT_EQ(HttpStatus(Exchange("GET /hello HTTP/1.1\r\n\r\n")), 200);
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(1500)) << "served while the slow client stalls";
  EXPECT_EQ(HttpStatus(slow.ReadAll(absl::Seconds(10))), 408);
  EXPECT_GE(absl::Now() - before_connect, absl::Seconds(2));
  // A client that connects and never sends anything is closed silently.
  RawHttp idle(address_);
  EXPECT_EQ(idle.ReadAll(absl::Seconds(10)), "");
}

TEST_F(HttpServerTest, AFloodEvictsTheOldestConnections) {
  HttpServerOptions o;
  o.max_connections = 8;
  Serve(o);
  std::vector<std::unique_ptr<RawHttp>> idle;
  for (int i = 0; i < 20; ++i) {
    idle.push_back(std::make_unique<RawHttp>(address_));
    idle.back()->Send("GET /hel");
  }
  // The newest connection is admitted and served at once.
  EXPECT_EQ(HttpStatus(Exchange("GET /hello HTTP/1.1\r\n\r\n")), 200);
  // The oldest were closed to make room (the last 8 may still be open).
  EXPECT_EQ(idle[0]->ReadAll(absl::Seconds(5)), "");
}

TEST_F(HttpServerTest, StopsWithConnectionsOpen) {
  Serve();
  RawHttp stalled(address_);
  stalled.Send("GET /");
  const absl::Time start = absl::Now();
  server_.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  EXPECT_EQ(stalled.ReadAll(absl::Seconds(5)), "");
}

TEST(HttpServerStartTest, SaysWhyItCannotListen) {
  auto bad = HttpServer::Start("127.0.0.1:http", {});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("port 0-65535"));
  auto first = HttpServer::Start("127.0.0.1:0", {});
  ASSERT_TRUE(first.ok()) << first.status();
  auto taken = HttpServer::Start(absl::StrCat("127.0.0.1:", (*first)->port()), {});
  ASSERT_FALSE(taken.ok());
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(taken.status().message(), HasSubstr("Address already in use"));
  auto v6 = HttpServer::Start("[::1]:0", {});
  if (v6.ok()) {  // where the machine has IPv6 loopback
    EXPECT_GT((*v6)->port(), 0);
  }
}

}  // namespace
}  // namespace plateau
