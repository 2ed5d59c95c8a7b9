#include "client/json_output.h"

#include <string>

#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "plateau/v1/job.pb.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Reads `json` back with protobuf's own parser (which takes int64 as a
// number or a string): the output is valid proto3 JSON of the same message.
template <typename M>
M Parsed(const std::string& json) {
  M m;
  auto s = google::protobuf::util::JsonStringToMessage(json, &m);
  EXPECT_TRUE(s.ok()) << s << "\n" << json;
  return m;
}

TEST(JsonOutputTest, ZeroValuesArePrintedAndPresenceIsKept) {
  v1::JobEvent e;
  e.set_job_id("job-1");
  e.mutable_step()->set_rank(0);
  e.mutable_step()->set_step(1);
  const std::string json = ToJson(e);
  EXPECT_THAT(json, HasSubstr("\"index\":0"));
  EXPECT_THAT(json, HasSubstr("\"rank\":0"));
  EXPECT_THAT(json, HasSubstr("\"attempt\":0"));
  EXPECT_THAT(json, HasSubstr("\"loss\":0"));
  EXPECT_THAT(json, HasSubstr("\"peak\":[]"));
  EXPECT_THAT(json, HasSubstr("\"step\":{"));
  // Unset message fields and the other oneof member are absent, not null.
  EXPECT_THAT(json, Not(HasSubstr("state_change")));
  EXPECT_THAT(json, Not(HasSubstr("\"time\"")));
  EXPECT_THAT(json, Not(HasSubstr("memory_timeline")));
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(Parsed<v1::JobEvent>(json), e));

  v1::Job job;
  job.set_id("job-2");
  job.mutable_failure()->set_kind(v1::Failure::RANK_CRASHED);  // rank 0
  (*job.mutable_spec()->mutable_labels())["team"] = "nlp";
  job.mutable_spec()->mutable_model()->set_rope_theta(0);  // optional, set to 0
  job.mutable_create_time()->set_seconds(1764756000);
  const std::string j = ToJson(job);
  EXPECT_THAT(j, HasSubstr("\"failure\":{\"kind\":\"RANK_CRASHED\",\"message\":\"\",\"rank\":0,\"exit_code\":0"));
  EXPECT_THAT(j, HasSubstr("\"attempt\":0"));
  EXPECT_THAT(j, HasSubstr("\"state\":\"JOB_STATE_UNSPECIFIED\""));
  EXPECT_THAT(j, HasSubstr("\"labels\":{\"team\":\"nlp\"}"));
  EXPECT_THAT(j, HasSubstr("\"rope_theta\":0"));
  EXPECT_THAT(j, Not(HasSubstr("norm_eps"))) << "an unset optional is absent";
  EXPECT_THAT(j, HasSubstr("\"create_time\":\"2025-12-03T10:00:00Z\""));
  EXPECT_THAT(j, HasSubstr("\"placement\":[]"));
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(Parsed<v1::Job>(j), job));
}

TEST(JsonOutputTest, Int64IsANumberBelowTwoToThe53AndAStringAbove) {
  v1::MemoryPlan p;
  p.set_total_bytes((int64_t{1} << 53) - 1);
  p.set_launch_bytes(int64_t{1} << 53);
  p.set_host_total_bytes(-(int64_t{1} << 53) + 1);
  p.set_parameters(-(int64_t{1} << 53));
  const std::string json = ToJson(p);
  EXPECT_THAT(json, HasSubstr("\"total_bytes\":9007199254740991,"));
  EXPECT_THAT(json, HasSubstr("\"launch_bytes\":\"9007199254740992\""));
  EXPECT_THAT(json, HasSubstr("\"host_total_bytes\":-9007199254740991,"));
  EXPECT_THAT(json, HasSubstr("\"parameters\":\"-9007199254740992\""));
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(Parsed<v1::MemoryPlan>(json), p));

  v1::RecallData r;
  r.set_seed(~uint64_t{0});
  EXPECT_THAT(ToJson(r), HasSubstr("\"seed\":\"18446744073709551615\""));
}

TEST(JsonOutputTest, DoublesStringsAndErrors) {
  v1::Progress p;
  p.set_loss(0.1);
  p.set_first_loss(std::numeric_limits<double>::quiet_NaN());
  p.set_tokens_per_second(std::numeric_limits<double>::infinity());
  const std::string json = ToJson(p);
  EXPECT_THAT(json, HasSubstr("\"loss\":0.10000000000000001"));
  EXPECT_THAT(json, HasSubstr("\"first_loss\":\"NaN\""));
  EXPECT_THAT(json, HasSubstr("\"tokens_per_second\":\"Infinity\""));
  EXPECT_EQ(Parsed<v1::Progress>(json).loss(), 0.1);

  v1::LogEntry l;
  l.set_line("a \"quoted\"\\ line\twith\x01 control");
  EXPECT_EQ(Parsed<v1::LogEntry>(ToJson(l)).line(), l.line());

  EXPECT_EQ(ErrorJson(absl::NotFoundError("job 'job-9' not found"), 6),
            "{\"error\":{\"code\":\"NOT_FOUND\",\"message\":\"job 'job-9' not found\",\"exit_code\":6}}");
}

// A map's keys in order, whatever order protobuf keeps them in: the same
// labels print the same bytes.
TEST(JsonOutputTest, MapKeysAreSorted) {
  v1::JobSpec a, b;
  for (const char* k : {"zeta", "alpha", "mid", "beta"}) (*a.mutable_labels())[k] = std::string("v-") + k;
  for (const char* k : {"beta", "mid", "alpha", "zeta"}) (*b.mutable_labels())[k] = std::string("v-") + k;
  const std::string json = ToJson(a);
  EXPECT_EQ(json, ToJson(b));
  EXPECT_THAT(
      json, HasSubstr("\"labels\":{\"alpha\":\"v-alpha\",\"beta\":\"v-beta\",\"mid\":\"v-mid\",\"zeta\":\"v-zeta\"}"));
  EXPECT_EQ(Parsed<v1::JobSpec>(json).labels().at("mid"), "v-mid");
}

}  // namespace
}  // namespace plateau
