#include "worker/assignment.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

v1::Assignment Good() {
  v1::Assignment a;
  a.set_job_id("job-12");
  a.set_attempt(1);
  a.set_kv_prefix("job-12/attempt-1");
  a.mutable_spec()->mutable_layout()->set_ranks(4);
  a.add_ranks(2);
  a.add_ranks(3);
  return a;
}

TEST(AssignmentTest, TheCoordinatorsSpellingPasses) { EXPECT_TRUE(CheckAssignment(Good()).ok()); }

// Each field a forged assignment could use against the agent's files or
// its ranks is refused, naming it.
TEST(AssignmentTest, AnythingElseIsRefusedNamingTheField) {
  for (const std::string& id :
       {std::string("../x"), std::string("job-"), std::string("job-07"), std::string("job-1/../../etc"),
        std::string("job-1 "), std::string("JOB-1"), std::string("job-12345678901234567890"), std::string("")}) {
    v1::Assignment a = Good();
    a.set_job_id(id);
    const absl::Status s = CheckAssignment(a);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << id;
    EXPECT_THAT(s.message(), HasSubstr("assignment: job_id: expected 'job-N'")) << id;
  }
  v1::Assignment a = Good();
  a.set_attempt(-1);
  EXPECT_THAT(CheckAssignment(a).message(), HasSubstr("assignment: attempt: expected >= 0, got -1"));
  for (const std::string& prefix : {std::string(""), std::string("a b"), std::string("x\n"), std::string(1025, 'k')}) {
    a = Good();
    a.set_kv_prefix(prefix);
    EXPECT_THAT(CheckAssignment(a).message(), HasSubstr("assignment: kv_prefix")) << prefix.size();
  }
  for (int bad : {-1, 4, 3}) {  // 3: twice with the 3 already there
    a = Good();
    a.add_ranks(bad);
    EXPECT_THAT(CheckAssignment(a).message(),
                HasSubstr("assignment: ranks: expected distinct ranks of 0 to layout.ranks - 1 = 3, got " +
                          std::to_string(bad)));
  }
}

}  // namespace
}  // namespace plateau
