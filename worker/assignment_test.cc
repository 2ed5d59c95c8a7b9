#include "worker/assignment.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
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

// Paths under an allowed directory pass, links resolved: a link inside
// that points outside, a "..", a sibling that shares the prefix are out.
TEST(AssignmentTest, SpecPathsMustLieUnderTheAllowedDirectories) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::filesystem::path base = std::filesystem::path(tmp != nullptr ? tmp : "/tmp") / "allowed";
  std::filesystem::remove_all(base);
  std::filesystem::create_directories(base / "data");
  std::filesystem::create_directories(base / "data2");
  std::filesystem::create_directories(base / "secret");
  std::ofstream(base / "data" / "a.txt") << "x";
  std::ofstream(base / "secret" / "key") << "x";
  std::filesystem::create_symlink(base / "secret" / "key", base / "data" / "innocent.txt");
  auto allowed = AllowedPaths((base / "data").string() + "/,/nonexistent/ckpt");
  ASSERT_TRUE(allowed.ok()) << allowed.status();
  ASSERT_EQ(allowed->size(), 2u);
  EXPECT_EQ((*allowed)[0], std::filesystem::weakly_canonical(base / "data").string());

  auto with = [](const std::string& text, const std::string& checkpoint) {
    v1::JobSpec s;
    s.mutable_data()->mutable_text()->set_path(text);
    if (!checkpoint.empty()) s.mutable_checkpoint()->set_directory(checkpoint);
    return s;
  };
  EXPECT_TRUE(CheckSpecPaths(with((base / "data" / "a.txt").string(), "/nonexistent/ckpt/job-1"), *allowed).ok());
  for (const std::string& bad :
       {(base / "data" / "innocent.txt").string(), (base / "data2" / "b.txt").string(), std::string("/etc/passwd")}) {
    const absl::Status s = CheckSpecPaths(with(bad, ""), *allowed);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << bad;
    EXPECT_THAT(s.message(), HasSubstr("data.text.path=" + bad)) << bad;
    EXPECT_THAT(s.message(), HasSubstr("outside this worker's --allowed_paths")) << bad;
  }
  const absl::Status ckpt =
      CheckSpecPaths(with((base / "data" / "a.txt").string(), "/nonexistent/ckpt-other"), *allowed);
  EXPECT_THAT(ckpt.message(), HasSubstr("checkpoint.directory=/nonexistent/ckpt-other: outside"));
  v1::JobSpec shards;
  shards.mutable_data()->mutable_shards()->add_paths((base / "data" / "a.txt").string());
  shards.mutable_data()->mutable_shards()->add_paths((base / "secret" / "key").string());
  EXPECT_THAT(CheckSpecPaths(shards, *allowed).message(), HasSubstr("data.shards.paths[1]="));
  // A '..' (here after a part that does not exist yet, which resolution
  // would take lexically, past the link it crosses), '.' or '//' is
  // refused whatever it resolves to.
  std::filesystem::create_directory_symlink(base / "secret", base / "data" / "evil");
  for (const std::string& odd :
       {(base / "data" / "new" / ".." / "evil" / "ckpt").string(), (base / "data" / ".." / "secret" / "key").string(),
        (base / "data" / "." / "a.txt").string(), (base / "data").string() + "//a.txt"}) {
    const absl::Status s = CheckSpecPaths(with(odd, ""), *allowed);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << odd;
    EXPECT_THAT(s.message(), HasSubstr("expected an absolute path without '.', '..' or '//' components")) << odd;
  }
  EXPECT_TRUE(
      CheckSpecPaths(with((base / "data" / "a.txt").string(), (base / "data").string() + "/ckpt/"), *allowed).ok());
  // No list: no limit.
  EXPECT_TRUE(CheckSpecPaths(with("/etc/passwd", ""), {}).ok());
  EXPECT_THAT(AllowedPaths("relative/dir").status().message(),
              HasSubstr("--allowed_paths: expected absolute directories separated by commas, got 'relative/dir'"));
}

}  // namespace
}  // namespace plateau
