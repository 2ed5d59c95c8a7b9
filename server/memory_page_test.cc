// The memory page's request handling: the path and rank parsing, the
// status of every error (an unknown job, no timeline yet, a rank without
// one, a bad rank, another path), and the page of a known timeline.
#include "server/memory_page.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "timeline/timeline_testing.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

TEST(MemoryPageTest, ParsesTheJobAndRank) {
  auto r = ParseMemoryPagePath("/jobs/job-3/memory", "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->job_id, "job-3");
  EXPECT_EQ(r->rank, 0);
  r = ParseMemoryPagePath("/jobs/job-3/memory", "x=1&rank=2");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->rank, 2);
  EXPECT_EQ(ParseMemoryPagePath("/jobs/job-3/memory", "rank=-1").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ParseMemoryPagePath("/jobs/job-3/memory", "rank=x").status().message(), HasSubstr("rank"));
  EXPECT_EQ(ParseMemoryPagePath("/jobs/job-3", "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ParseMemoryPagePath("/jobs/job-3/memory/x", "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ParseMemoryPagePath("/jobs//memory", "").status().code(), absl::StatusCode::kNotFound);
}

TEST(MemoryPageTest, StatusOfEachOutcome) {
  int calls = 0;
  auto known = [&](const std::string& id) -> absl::StatusOr<v1::GetMemoryTimelineResponse> {
    ++calls;
    if (id == "job-7") return ExampleTimeline();
    if (id == "job-8") return absl::FailedPreconditionError("job-8 has no memory timeline yet");
    if (id == "bad") return absl::InvalidArgumentError("job_id: expected a job id like 'job-12'");
    return absl::NotFoundError(absl::StrCat("job '", id, "' not found"));
  };
  HttpResponse ok = MemoryPage("/jobs/job-7/memory", "rank=1", known);
  EXPECT_EQ(ok.status, 200);
  EXPECT_EQ(ok.content_type, "text/html; charset=utf-8");
  EXPECT_THAT(ok.body, HasSubstr("job-7 memory timeline, rank 1"));
  EXPECT_THAT(ok.body, HasSubstr("class=\"bound\" data-live-set=\"dispatch\""));
  HttpResponse yet = MemoryPage("/jobs/job-8/memory", "", known);
  EXPECT_EQ(yet.status, 404);
  EXPECT_THAT(yet.body, HasSubstr("job-8 has no memory timeline yet"));
  HttpResponse unknown = MemoryPage("/jobs/job-9/memory", "", known);
  EXPECT_EQ(unknown.status, 404);
  EXPECT_THAT(unknown.body, HasSubstr("job &#39;job-9&#39; not found"));
  EXPECT_EQ(MemoryPage("/jobs/bad/memory", "", known).status, 400);
  HttpResponse rank = MemoryPage("/jobs/job-7/memory", "rank=4", known);
  EXPECT_EQ(rank.status, 404);
  EXPECT_THAT(rank.body, HasSubstr("ranks with one: 0, 1"));
  const int before = calls;
  EXPECT_EQ(MemoryPage("/jobs/job-7/memory", "rank=z", known).status, 400);
  EXPECT_EQ(MemoryPage("/jobs/job-7/plan", "", known).status, 404);
  EXPECT_EQ(calls, before) << "a bad request reads nothing";
}

}  // namespace
}  // namespace plateau
