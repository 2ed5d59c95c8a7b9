// The coordinator's HTTP port (/metrics, /healthz, /readyz) against what a
// browser, a port scanner or a kubelet may send it, over real sockets to a
// real coordinator process. `GET /` used to kill the coordinator (a civetweb
// worker thread overflowed its stack: server/http_server.h); every request
// here must get its status code, and the coordinator must go on serving
// HTTP and gRPC.
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

using namespace testing_cluster;  // NOLINT: the harness is this file's vocabulary

struct OddRequest {
  std::string name;
  std::string bytes;
  int status;
};

std::string Get(const std::string& target, const std::string& method = "GET") {
  return absl::StrCat(method, " ", target, " HTTP/1.1\r\nHost: coordinator\r\nUser-Agent: odd/1\r\n\r\n");
}

std::vector<OddRequest> OddRequests() {
  std::mt19937 random(10);
  std::string garbage(4096, '\0');
  for (char& b : garbage) b = static_cast<char>(random());
  return {
      {"GET /", Get("/"), 404},
      {"GET //", Get("//"), 404},
      {"GET /favicon.ico", Get("/favicon.ico"), 404},
      {"GET /healthz", Get("/healthz"), 200},
      {"GET /healthz?verbose=1", Get("/healthz?verbose=1"), 200},
      {"GET /readyz", Get("/readyz"), 200},
      {"GET /metrics", Get("/metrics"), 200},
      {"GET /metrics/", Get("/metrics/"), 404},
      {"GET /metrics/../x", Get("/metrics/../x"), 404},
      {"GET /metrics/../metrics", Get("/metrics/../metrics"), 404},
      {"GET /%2e%2e/etc/passwd", Get("/%2e%2e/etc/passwd"), 404},
      {"GET 64 KiB path", Get("/" + std::string(64 * 1024, 'p')), 414},
      {"GET 64 KiB header", absl::StrCat("GET /metrics HTTP/1.1\r\nX-Big: ", std::string(64 * 1024, 'h'), "\r\n\r\n"),
       431},
      {"HEAD /", Get("/", "HEAD"), 404},
      {"HEAD /healthz", Get("/healthz", "HEAD"), 200},
      {"HEAD /readyz", Get("/readyz", "HEAD"), 200},
      {"HEAD /metrics", Get("/metrics", "HEAD"), 200},
      {"POST /", Get("/", "POST"), 404},
      {"POST /metrics with a body",
       "POST /metrics HTTP/1.1\r\nContent-Type: text/plain\r\nContent-Length: 11\r\n\r\nhello world", 405},
      {"POST /healthz", Get("/healthz", "POST"), 405},
      {"OPTIONS /", Get("/", "OPTIONS"), 404},
      {"OPTIONS /metrics", Get("/metrics", "OPTIONS"), 405},
      {"OPTIONS /readyz", Get("/readyz", "OPTIONS"), 405},
      {"OPTIONS *", Get("*", "OPTIONS"), 400},
      {"DELETE /metrics", Get("/metrics", "DELETE"), 405},
      {"request line without a version", "GET /metrics\r\n\r\n", 400},
      {"request line of one word", "GET\r\n\r\n", 400},
      {"request line with two spaces", "GET  /metrics HTTP/1.1\r\n\r\n", 400},
      {"absolute URI", Get("http://coordinator/metrics"), 400},
      {"HTTP/2.0", "GET /metrics HTTP/2.0\r\n\r\n", 505},
      {"empty lines only", "\r\n\r\n", 400},
      {"garbage bytes", garbage, 400},
      {"TLS ClientHello", std::string("\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03", 11), 400},
  };
}

TEST(MetricsHttpTest, OddRequestsGetTheirStatusAndTheCoordinatorKeepsServing) {
  ClusterOptions o;
  o.with_worker = false;
  Cluster c("metrics_http_odd", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  const absl::Time start = absl::Now();

  // Many connections at once: 150 that connect and send half a request
  // (more than the server keeps open), then 32 real clients in parallel.
  {
    std::vector<std::unique_ptr<RawHttp>> idle;
    for (int i = 0; i < 150; ++i) {
      idle.push_back(std::make_unique<RawHttp>(c.metrics()));
      idle.back()->Send("GET /metr");
    }
    std::vector<int> statuses(32, 0);
    std::vector<std::thread> clients;
    for (size_t i = 0; i < statuses.size(); ++i) {
      clients.emplace_back([&, i] {
        RawHttp h(c.metrics());
        h.Send(Get(i % 2 ? "/healthz" : "/metrics"));
        statuses[i] = HttpStatus(h.ReadAll());
      });
    }
    for (std::thread& t : clients) t.join();
    EXPECT_THAT(statuses, ::testing::Each(200));
  }
  ASSERT_TRUE(c.coordinator()->Running()) << c.Logs();

  // A slow client sends half a request and stalls for the rest of the test.
  RawHttp slow(c.metrics());
  ASSERT_TRUE(slow.Send("GET /metrics HTTP/1.1\r\nHo"));
  const absl::Time slow_since = absl::Now();

  for (const OddRequest& r : OddRequests()) {
    RawHttp h(c.metrics());
    ASSERT_TRUE(h.connected()) << r.name << ": the coordinator stopped listening\n" << c.Logs();
    h.Send(r.bytes);  // may fail part way: the server answers a long head early
    const std::string response = h.ReadAll();
    EXPECT_EQ(HttpStatus(response), r.status) << r.name << ":\n" << response.substr(0, 300);
    if (absl::StartsWith(r.name, "HEAD")) {
      EXPECT_TRUE(absl::EndsWith(response, "\r\n\r\n")) << r.name << ": a body after HEAD";
    }
    ASSERT_TRUE(c.coordinator()->Running()) << r.name << " killed the coordinator\n" << c.Logs();
  }
  const std::string readyz = HttpGet(c.metrics(), "/readyz");
  EXPECT_THAT(readyz, HasSubstr("\r\n\r\nready\n"));
  EXPECT_THAT(HttpGet(c.metrics(), "/"), HasSubstr("this port serves /healthz /metrics /readyz"));
  EXPECT_THAT(HttpGet(c.metrics(), "/metrics"), HasSubstr("Content-Type: text/plain; version=0.0.4"));

  // The slow client was never answered while the others were; it is closed
  // with 408 once the request timeout (10 s) has passed.
  EXPECT_EQ(HttpStatus(slow.ReadAll(absl::Seconds(30))), 408);
  EXPECT_GE(absl::Now() - slow_since, absl::Seconds(9));

  // Still up and serving gRPC.
  ASSERT_TRUE(c.coordinator()->Running()) << c.Logs();
  auto list = c.client().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok()) << list.status() << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(2), /*validate_only=*/true);
  EXPECT_TRUE(sub.ok()) << sub.status();
  EXPECT_EQ(HttpStatus(HttpGet(c.metrics(), "/healthz")), 200);
  EXPECT_THAT(c.Logs(), Not(HasSubstr("Segmentation")));
  std::printf("metrics_http_test: %zu odd requests, 150 idle and 32 parallel connections, in %.1f s\n",
              OddRequests().size(), absl::ToDoubleSeconds(absl::Now() - start));
}

}  // namespace
}  // namespace plateau
