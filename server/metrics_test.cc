#include "server/metrics.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster.h"

namespace plateau {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;
using testing_cluster::HttpGet;
using testing_cluster::HttpStatus;

TEST(MetricsTest, ServesMetricsAndProbesOnOnePort) {
  auto m = Metrics::Create("127.0.0.1:0");
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*m)->port());
  (*m)->OnJobState("job-7", v1::RUNNING);
  const std::string scrape = HttpGet(address, "/metrics");
  EXPECT_EQ(HttpStatus(scrape), 200);
  EXPECT_THAT(scrape, HasSubstr("plateau_job_state{job_id=\"job-7\",state=\"RUNNING\"} 1"));
  EXPECT_EQ(scrape.substr(scrape.find("\r\n\r\n") + 4), (*m)->Text());
  EXPECT_EQ(HttpStatus(HttpGet(address, "/healthz")), 200);
  EXPECT_EQ(HttpStatus(HttpGet(address, "/")), 404);
}

TEST(MetricsTest, ReadyzFollowsSetReadinessInOneLine) {
  auto m = Metrics::Create("127.0.0.1:0");
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*m)->port());
  std::string r = HttpGet(address, "/readyz");
  EXPECT_EQ(HttpStatus(r), 503) << "not ready before anyone said so";
  EXPECT_THAT(r, EndsWith("\r\n\r\nnot ready: starting\n"));
  (*m)->SetReadiness(absl::UnavailableError("store\nbroken"));
  r = HttpGet(address, "/readyz");
  EXPECT_EQ(HttpStatus(r), 503);
  EXPECT_THAT(r, EndsWith("\r\n\r\nnot ready: store broken\n"));
  EXPECT_EQ(HttpStatus(HttpGet(address, "/healthz")), 200) << "liveness does not follow readiness";
  (*m)->SetReadiness(absl::OkStatus());
  r = HttpGet(address, "/readyz");
  EXPECT_EQ(HttpStatus(r), 200);
  EXPECT_THAT(r, EndsWith("\r\n\r\nready\n"));
}

TEST(MetricsTest, AnAddressItCannotListenOnIsAnError) {
  auto m = Metrics::Create("127.0.0.1:99999");
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(), HasSubstr("--metrics_address=127.0.0.1:99999"));
}

}  // namespace
}  // namespace plateau
