#include "server/security.h"

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(ConstantTimeEqualsTest, EqualOnlyWhenEveryByteAndTheLengthAgree) {
  EXPECT_TRUE(ConstantTimeEquals("s3cret", "s3cret"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_FALSE(ConstantTimeEquals("s3cres", "s3cret"));
  EXPECT_FALSE(ConstantTimeEquals("s3cre", "s3cret"));     // a prefix
  EXPECT_FALSE(ConstantTimeEquals("s3cret!", "s3cret"));   // longer
  EXPECT_FALSE(ConstantTimeEquals("", "s3cret"));
  EXPECT_FALSE(ConstantTimeEquals("s3cret", ""));
  EXPECT_FALSE(ConstantTimeEquals(absl::string_view("s3cret\0", 7), "s3cret"));
}

std::string WriteTokens(const std::string& name, const std::string& text) {
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/" + name;
  const std::string next = path + ".next";
  std::ofstream(next, std::ios::binary) << text;
  std::filesystem::rename(next, path);  // as docs/SERVICE.md says to rotate
  return path;
}

std::shared_ptr<TokenFile> OpenTokens(const std::string& path) {
  // recheck 0: every call looks at the file, so a test sees a change at once.
  absl::StatusOr<std::shared_ptr<TokenFile>> file = TokenFile::Open("--token_file", path, absl::ZeroDuration());
  EXPECT_TRUE(file.ok()) << file.status();
  return file.ok() ? *file : nullptr;
}

grpc::Status Check(const BearerAuth& auth, std::optional<std::string> header) {
  if (!header) return auth.CheckHeader(nullptr);
  absl::string_view v = *header;
  return auth.CheckHeader(&v);
}

TEST(BearerAuthTest, MissingWrongAndRight) {
  BearerAuth auth(OpenTokens(WriteTokens("one", "tok-123\n")));
  ASSERT_TRUE(auth.enabled());
  for (auto h : std::vector<std::optional<std::string>>{std::nullopt, "", "tok-123", "Basic tok-123", "Bearer"}) {
    grpc::Status s = Check(auth, h);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << h.value_or("(none)");
    EXPECT_THAT(s.error_message(), HasSubstr("missing bearer token")) << h.value_or("(none)");
  }
  for (std::string h : {"Bearer tok-12", "Bearer tok-1234", "Bearer TOK-123", "Bearer "}) {
    grpc::Status s = Check(auth, h);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << h;
    EXPECT_THAT(s.error_message(), HasSubstr("wrong bearer token")) << h;
  }
  EXPECT_TRUE(Check(auth, "Bearer tok-123").ok());
  EXPECT_TRUE(Check(auth, "bearer tok-123").ok());  // the scheme is case-insensitive (RFC 7235)
  EXPECT_TRUE(BearerAuth(nullptr).CheckHeader(nullptr).ok()) << "no token: the check is off";
}

// A rotation as docs/SERVICE.md gives it: the new token beside the old,
// clients moved over, then the old one removed; no restart anywhere.
TEST(BearerAuthTest, FollowsTheFileThroughARotation) {
  const std::string path = WriteTokens("rotated", "tok-old\n");
  BearerAuth auth(OpenTokens(path));
  EXPECT_TRUE(Check(auth, "Bearer tok-old").ok());
  EXPECT_FALSE(Check(auth, "Bearer tok-new").ok());
  WriteTokens("rotated", "tok-old\ntok-new\n");
  EXPECT_TRUE(Check(auth, "Bearer tok-old").ok());
  EXPECT_TRUE(Check(auth, "Bearer tok-new").ok());
  WriteTokens("rotated", "tok-new\n");
  EXPECT_THAT(Check(auth, "Bearer tok-old").error_message(), HasSubstr("wrong bearer token"));
  EXPECT_TRUE(Check(auth, "Bearer tok-new").ok());
  // A file emptied (or half-written) keeps the tokens in force: nobody is
  // locked out, and the old one stays refused.
  WriteTokens("rotated", "\n");
  EXPECT_TRUE(Check(auth, "Bearer tok-new").ok());
  EXPECT_FALSE(Check(auth, "Bearer tok-old").ok());
}

// Checks on many threads while the file keeps changing (the coordinator's
// handler threads during a rotation): each check sees one whole set of
// tokens. Under ASan (--config=asan) this also catches a check that reads
// a set another thread's reload has freed.
TEST(BearerAuthTest, ChecksDuringReloadsOnOtherThreads) {
  const std::string path = WriteTokens("busy", "tok-kept\ntok-0\n");
  BearerAuth auth(OpenTokens(path));
  std::atomic<bool> stop{false};
  std::atomic<int> refused{0};
  std::vector<std::thread> checkers;
  for (int t = 0; t < 4; ++t) {
    checkers.emplace_back([&] {
      while (!stop.load()) {
        if (!Check(auth, "Bearer tok-kept").ok()) ++refused;
      }
    });
  }
  for (int i = 1; i <= 300; ++i) WriteTokens("busy", absl::StrCat("tok-kept\ntok-", i, "\n"));
  stop = true;
  for (std::thread& t : checkers) t.join();
  EXPECT_EQ(refused.load(), 0) << "the token in every version of the file was refused";
  // A last version of a size none had: its identity differs from every
  // earlier one's even where a file system reuses an inode within one tick
  // of a coarse clock.
  WriteTokens("busy", "tok-kept\ntok-the-last-one\n");
  EXPECT_TRUE(Check(auth, "Bearer tok-the-last-one").ok());
}

TEST(PeerHostTest, StripsThePort) {
  EXPECT_EQ(PeerHost("ipv4:127.0.0.1:43210"), "127.0.0.1");
  EXPECT_EQ(PeerHost("ipv6:[::1]:43210"), "::1");
  EXPECT_EQ(PeerHost("ipv6:[2001:db8::7]:1"), "2001:db8::7");
  EXPECT_EQ(PeerHost("unix:/tmp/s"), "unix:/tmp/s");
}

// A certificate's name reaches logs and terminals: no control characters,
// valid UTF-8, bounded.
TEST(CertificateNameTest, IsPrintableValidUtf8AndBounded) {
  EXPECT_EQ(CertificateName("worker-1"), "worker-1");
  EXPECT_EQ(CertificateName("alice\njob-9 SUCCEEDED\x1b[2J"), "alice?job-9 SUCCEEDED?[2J");
  EXPECT_EQ(CertificateName("caf\xc3\xa9 \xff"), "caf\xc3\xa9 \xef\xbf\xbd");
  const std::string longest = CertificateName(std::string(100, 'a') + std::string(20, '\xe2') + "\x82\xac");
  EXPECT_LE(longest.size(), 128u);
  EXPECT_EQ(longest.substr(0, 100), std::string(100, 'a'));
}

TEST(WatchLimiterTest, LimitsEachHostAndReleasesWhenTheLeaseEnds) {
  WatchLimiter limiter(2);
  {
    WatchLimiter::Lease a, b, c;
    ASSERT_TRUE(limiter.Acquire("10.0.0.1", &a).ok());
    ASSERT_TRUE(limiter.Acquire("10.0.0.1", &b).ok());
    grpc::Status s = limiter.Acquire("10.0.0.1", &c);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(s.error_message(),
                AllOf(HasSubstr("10.0.0.1"), HasSubstr("2"), HasSubstr("--max_watches_per_client")));
    EXPECT_EQ(limiter.open("10.0.0.1"), 2) << "a refused watch holds nothing";
    WatchLimiter::Lease other;
    EXPECT_TRUE(limiter.Acquire("10.0.0.2", &other).ok()) << "another host has its own count";
    {
      WatchLimiter::Lease moved(std::move(a));  // released once, by `moved`
    }
    EXPECT_EQ(limiter.open("10.0.0.1"), 1);
    WatchLimiter::Lease d;
    EXPECT_TRUE(limiter.Acquire("10.0.0.1", &d).ok());
  }
  EXPECT_EQ(limiter.open("10.0.0.1"), 0);
  EXPECT_EQ(limiter.open("10.0.0.2"), 0);

  WatchLimiter unlimited(0);
  std::vector<WatchLimiter::Lease> many(100);
  for (auto& l : many) EXPECT_TRUE(unlimited.Acquire("h", &l).ok());
}

}  // namespace
}  // namespace plateau
