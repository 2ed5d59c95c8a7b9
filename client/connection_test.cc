// The token and PEM files of client/connection.h. That the token reaches
// the coordinator on every call, and TLS, are tests/security_test.cc's.
#include "client/connection.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// $TEST_TMPDIR; run by hand, a directory of this process's own.
std::string TmpDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  if (tmp != nullptr) return tmp;
  const std::string own = "/tmp/plateau-test-" + std::to_string(getpid());
  std::filesystem::create_directories(own);
  return own;
}

std::string Write(const std::string& name, const std::string& text) {
  const std::string path = TmpDir() + "/" + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

TEST(ReadTokenFileTest, StripsTheTrailingNewlineAndSpaces) {
  auto t = ReadTokenFile("--token_file", Write("t1", "s3cr3t-Token_42 \n\n"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, "s3cr3t-Token_42");
}

TEST(ReadTokenFileTest, EmptyOrBlankFileNamesTheFlagAndPath) {
  for (const std::string& text : {std::string(), std::string(" \n\t\n")}) {
    const std::string path = Write("empty", text);
    auto t = ReadTokenFile("--token_file", path);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(t.status().message(), AllOf(HasSubstr("--token_file=" + path), HasSubstr("empty")));
  }
}

TEST(ReadTokenFileTest, UnreadableFileNamesTheFlagAndPath) {
  auto t = ReadTokenFile("--token_file", "/nonexistent/token");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("--token_file=/nonexistent/token: cannot read"));
  // A directory opens but cannot be read.
  auto d = ReadTokenFile("--token_file", TmpDir());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
}

// A directory where a file is expected says so (it read as "empty").
TEST(ReadTokenFileTest, ADirectoryIsNamedAsOne) {
  const std::string dir = std::filesystem::path(Write("in-a-dir", "x")).parent_path().string();
  auto t = ReadTokenFile("--token_file", dir);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(),
              HasSubstr("--token_file=" + dir + ": is a directory, expected a file"));
}

TEST(ReadTokenFileTest, RefusesBytesAHeaderCannotCarry) {
  for (const std::string& text : {std::string("two words\n"), std::string("tab\there"), std::string("caf\xc3\xa9")}) {
    auto t = ReadTokenFile("--token_file", Write("odd", text));
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(t.status().message(), HasSubstr("visible ASCII")) << text;
  }
}

TEST(OpenChannelTest, NamesTheFileThatCannotBeRead) {
  auto c = OpenChannel({"127.0.0.1:1", "/nonexistent/token", ""});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("--token_file=/nonexistent/token"));
  c = OpenChannel({"127.0.0.1:1", "", Write("notpem", "hello\n")});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), AllOf(HasSubstr("--tls_ca_file="), HasSubstr("PEM")));
  EXPECT_EQ(OpenChannel({"", "", ""}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(OpenChannel({"127.0.0.1:1", Write("ok", "tok\n"), ""}).ok());
}

// gRPC takes a port past 65535 modulo 65536 (127.0.0.1:99553 dials 34017),
// so every address a flag gives is checked first.
TEST(CheckAddressTest, PortsOutsideTheirRangeAndMalformedAddressesAreRefused) {
  for (const std::string& bad :
       {"127.0.0.1:99553", "127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.1:", "127.0.0.1", ":7070",
        "localhost:7070x", "localhost:+7070", "[::1]7070", "[::1]:", "", "host:0"}) {
    const absl::Status s = CheckAddress("--coordinator", bad, /*listen=*/false);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_THAT(s.message(), HasSubstr("--coordinator=" + bad +
                                       ": expected HOST:PORT (or [IPV6]:PORT) with a port "
                                       "1-65535"))
        << bad;
  }
  for (const std::string& good :
       {"127.0.0.1:1", "localhost:65535", "[::1]:7070", "coordinator.example:443",
        "unix:/run/plateau.sock", "dns:///coordinator:7070"}) {
    EXPECT_TRUE(CheckAddress("--coordinator", good, /*listen=*/false).ok()) << good;
  }
  EXPECT_TRUE(CheckAddress("--listen", "127.0.0.1:0", /*listen=*/true).ok());
  EXPECT_THAT(
      CheckAddress("--listen", "127.0.0.1:99999", /*listen=*/true).message(),
      HasSubstr(
          "--listen=127.0.0.1:99999: expected HOST:PORT (or [IPV6]:PORT) with a port 0-65535"));
  auto c = OpenChannel({"127.0.0.1:99553", "", ""});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("--coordinator=127.0.0.1:99553"));
}

}  // namespace
}  // namespace plateau
