// The token and PEM files of client/connection.h. That the token reaches
// the coordinator on every call, and TLS, are tests/security_test.cc's.
#include "client/connection.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "plateau/v1/worker.grpc.pb.h"

namespace plateau {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::EndsWith;
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
  EXPECT_THAT(*t, ElementsAre("s3cr3t-Token_42"));
}

// Each line that is not blank is a token (a rotation's old and new), in order.
TEST(ReadTokenFileTest, ReadsOneTokenPerLine) {
  auto t = ReadTokenFile("--token_file", Write("t2", "tok-new\r\n\n  \ntok-old\n"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(*t, ElementsAre("tok-new", "tok-old"));
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
    EXPECT_THAT(t.status().message(), AllOf(HasSubstr("line 1: "), HasSubstr("visible ASCII"))) << text;
  }
  auto t = ReadTokenFile("--token_file", Write("odd", "tok-ok\n\ntok bad\n"));
  EXPECT_THAT(t.status().message(), HasSubstr("line 3: expected a token of visible ASCII"));
}

// Replaces `name` the way docs/SERVICE.md says to: a new file renamed over it.
void Replace(const std::string& name, const std::string& text) {
  const std::string path = Write(name + ".next", text);
  std::filesystem::rename(path, TmpDir() + "/" + name);
}

TEST(TokenFileTest, ReadsTheFileAgainWhenItChangesAndKeepsTheLastGoodTokens) {
  const std::string path = Write("rotating", "tok-a\n");
  std::vector<std::string> heard;
  auto file = TokenFile::Open("--token_file", path, absl::ZeroDuration(), [&](const absl::Status& s, size_t n) {
    heard.push_back(absl::StrCat(s.ok() ? "ok" : std::string(s.message()), " ", n));
  });
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_THAT(*(*file)->Tokens(), ElementsAre("tok-a"));
  EXPECT_THAT(heard, ElementsAre()) << "an unchanged file is not read again";
  Replace("rotating", "tok-b\ntok-a\n");
  EXPECT_THAT(*(*file)->Tokens(), ElementsAre("tok-b", "tok-a"));
  Replace("rotating", "");  // half-written: the tokens in force stay
  EXPECT_THAT(*(*file)->Tokens(), ElementsAre("tok-b", "tok-a"));
  EXPECT_THAT(*(*file)->Tokens(), ElementsAre("tok-b", "tok-a"));
  std::filesystem::remove(path);  // gone: the same
  EXPECT_THAT(*(*file)->Tokens(), ElementsAre("tok-b", "tok-a"));
  Replace("rotating", "tok-b\n");
  EXPECT_THAT(*(*file)->Tokens(), ElementsAre("tok-b"));
  // Blank (no token), then mended in place at the same size with its
  // modification time put back: at most the status-change time shows it (on
  // a coarse clock not even that, where the retry after a failed read finds
  // it: AFailedReadIsTriedAgainAtEveryLook).
  Replace("rotating", "    \n");
  EXPECT_THAT(*(*file)->Tokens(), ElementsAre("tok-b"));
  EXPECT_THAT(*(*file)->Tokens(), ElementsAre("tok-b"));  // failed again: not told twice
  struct stat before {};
  ASSERT_EQ(stat(path.c_str(), &before), 0);
  std::ofstream(path, std::ios::binary | std::ios::in) << "tok\n";
  const timespec times[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), times, 0), 0) << std::strerror(errno);
  EXPECT_THAT(*(*file)->Tokens(), ElementsAre("tok"));
  // Each change is told once, failures with what was kept.
  ASSERT_EQ(heard.size(), 6u);
  EXPECT_EQ(heard[0], "ok 2");
  EXPECT_THAT(heard[1], AllOf(HasSubstr("the file is empty"), EndsWith(" 2")));
  EXPECT_THAT(heard[2], AllOf(HasSubstr("cannot look at the file (No such file or directory)"), EndsWith(" 2")));
  EXPECT_EQ(heard[3], "ok 1");
  EXPECT_THAT(heard[4], AllOf(HasSubstr("the file is empty"), EndsWith(" 1")));
  EXPECT_EQ(heard[5], "ok 1");
}

// A failed read is tried again at every look, even where nothing the file's
// identity holds has changed (a chmod within one tick of a coarse clock):
// here the reader fails on demand while the file stays as it is.
TEST(TokenFileTest, AFailedReadIsTriedAgainAtEveryLook) {
  const std::string path = Write("mended", "tok-a\n");
  bool failing = false;
  int reads = 0;
  std::vector<std::string> heard;
  auto file = TokenFile::Open(
      "--token_file", path, absl::ZeroDuration(),
      [&](const absl::Status& s, size_t n) { heard.push_back(absl::StrCat(s.ok() ? "ok" : s.message(), " ", n)); },
      [&](const std::string& flag, const std::string& p) -> absl::StatusOr<std::vector<std::string>> {
        ++reads;
        if (failing) return absl::InvalidArgumentError("unreadable");
        return ReadTokenFile(flag, p);
      });
  ASSERT_TRUE(file.ok()) << file.status();
  failing = true;
  Replace("mended", "tok-b\n");  // changed, but unreadable
  EXPECT_THAT(*(*file)->Tokens(), ElementsAre("tok-a"));
  EXPECT_THAT(*(*file)->Tokens(), ElementsAre("tok-a"));  // unchanged: read again, failing the same
  EXPECT_EQ(reads, 3);
  failing = false;  // mended: nothing about the file changes
  EXPECT_THAT(*(*file)->Tokens(), ElementsAre("tok-b"));
  EXPECT_THAT(*(*file)->Tokens(), ElementsAre("tok-b"));  // read, good: not read again
  EXPECT_EQ(reads, 4);
  EXPECT_THAT(heard, ElementsAre("unreadable 1", "ok 1"));
}

// One caller at a time looks at the file, and the others are not held up by
// it: a FIFO renamed into the file's place blocks the looker's open until
// something writes it, while the other call returns the tokens in force.
TEST(TokenFileTest, ACallerLookingAtASlowFileHoldsUpNoOtherCall) {
  const std::string path = Write("slow-fs", "tok-a\n");
  auto file = TokenFile::Open("--token_file", path, absl::ZeroDuration());
  ASSERT_TRUE(file.ok()) << file.status();
  const std::string fifo = TmpDir() + "/slow-fs.fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  std::filesystem::rename(fifo, path);
  std::vector<std::string> got[2];
  std::atomic<int> done{0};
  auto call = [&](int i) {
    got[i] = *(*file)->Tokens();
    ++done;
  };
  std::thread first(call, 0);
  absl::SleepFor(absl::Milliseconds(300));  // one of the two is the looker, blocked in open
  std::thread second(call, 1);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (done.load() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(done.load(), 1) << "the call that did not look waited for the one that did";
  {
    std::ofstream(path) << "tok-b\n";  // opens the FIFO: the looker's open returns
  }
  first.join();
  second.join();
  std::vector<std::vector<std::string>> both = {got[0], got[1]};
  std::sort(both.begin(), both.end());
  EXPECT_THAT(both, ElementsAre(ElementsAre("tok-a"), ElementsAre("tok-b")));
}

// The file is looked at no more than once per recheck: a call's cost is a
// lock, not a stat.
TEST(TokenFileTest, LooksAtTheFileAtMostOncePerRecheck) {
  const std::string path = Write("slow", "tok-a\n");
  auto file = TokenFile::Open("--token_file", path, absl::Hours(1));
  ASSERT_TRUE(file.ok()) << file.status();
  Replace("slow", "tok-b\n");
  EXPECT_THAT(*(*file)->Tokens(), ElementsAre("tok-a"));
}

TEST(OpenChannelTest, NamesTheFileThatCannotBeRead) {
  auto c = OpenChannel({"127.0.0.1:1", {"/nonexistent/token", ""}});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("--token_file=/nonexistent/token"));
  c = OpenChannel({"127.0.0.1:1", {"", Write("notpem", "hello\n")}});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), AllOf(HasSubstr("--tls_ca_file="), HasSubstr("PEM")));
  EXPECT_EQ(OpenChannel({"", {"", ""}}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(OpenChannel({"127.0.0.1:1", {Write("ok", "tok\n"), ""}}).ok());
}

// A client certificate is a pair, sent only over TLS, and each of its files
// is named when it is not PEM. (The handshake itself, with certificates a CA
// signed: tests/security_test ClientCertificatesSignedByTheClientCa...)
TEST(OpenChannelTest, AClientCertificateNeedsItsKeyAndTls) {
  const std::string pem = Write("pem", "-----BEGIN CERTIFICATE-----\nnot really\n-----END CERTIFICATE-----\n");
  const std::string junk = Write("junk", "hello\n");
  auto open = [](const std::string& ca, const std::string& cert, const std::string& key) {
    ConnectionOptions o;
    o.address = "127.0.0.1:1";
    o.files.tls_ca_file = ca;
    o.files.tls_client_cert_file = cert;
    o.files.tls_client_key_file = key;
    return OpenChannel(o).status();
  };
  EXPECT_THAT(open(pem, pem, "").message(), HasSubstr("a client certificate needs both --tls_client_cert_file and "
                                                      "--tls_client_key_file; --tls_client_key_file is missing"));
  EXPECT_THAT(open(pem, "", pem).message(), HasSubstr("--tls_client_cert_file is missing"));
  EXPECT_THAT(open("", pem, pem).message(), HasSubstr("give --tls_ca_file too"));
  EXPECT_THAT(open(pem, junk, pem).message(), HasSubstr("--tls_client_cert_file=" + junk + ": expected a PEM file"));
  EXPECT_THAT(open(pem, pem, junk).message(), HasSubstr("--tls_client_key_file=" + junk + ": expected a PEM file"));
  for (const absl::Status& s : {open(pem, pem, ""), open(pem, "", pem), open("", pem, pem), open(pem, junk, pem)}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  }
}

// A throwaway self-signed test certificate (P-256, valid until 2126), its
// key, and another key: made once with openssl for this test, never used
// anywhere else.
constexpr char kTestCert[] = R"(-----BEGIN CERTIFICATE-----
MIIBnDCCAUGgAwIBAgIUAd95a2gozz5Oyyel53qw+OJ74B4wCgYIKoZIzj0EAwIw
IjEgMB4GA1UEAwwXcGxhdGVhdS1jb25uZWN0aW9uLXRlc3QwIBcNMjYxMjA2MTkx
ODMzWhgPMjEyNjExMTIxOTE4MzNaMCIxIDAeBgNVBAMMF3BsYXRlYXUtY29ubmVj
dGlvbi10ZXN0MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE0Ltew9lWe5mHtcwq
KFPuJgxuFbJ5MmiSKmiOGKxbW2I7xQlZeHr+TV+pg6xkCQsWW7MxpRDwX9BFn0c3
xz9smaNTMFEwHQYDVR0OBBYEFDB7JmKWiUzLV+vKuDbNwVXJpKNEMB8GA1UdIwQY
MBaAFDB7JmKWiUzLV+vKuDbNwVXJpKNEMA8GA1UdEwEB/wQFMAMBAf8wCgYIKoZI
zj0EAwIDSQAwRgIhAOUHT05LCsfOCuAznGF6scAANl3CplXC3SiJEEzX7OWDAiEA
4kd+mcbd0BOH+TEsBxTboMMYDOg52mVujhGBHYCwzQ8=
-----END CERTIFICATE-----
)";
constexpr char kTestKey[] = R"(-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgoKb/hgdiZFNpFktq
WJlg/1Cnx1WJqa3Tq31WIgUMqEChRANCAATQu17D2VZ7mYe1zCooU+4mDG4Vsnky
aJIqaI4YrFtbYjvFCVl4ev5NX6mDrGQJCxZbszGlEPBf0EWfRzfHP2yZ
-----END PRIVATE KEY-----
)";
constexpr char kOtherKey[] = R"(-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgbpvZ6q6I2N1jqEpT
maYh02QKS3KpTLnjiLi8P1/HndahRANCAARG1+vRS+IUf5Myi81Wnxfnq8w4EbN7
/2ba7r73Kngjn2LzpIbM1HVp7H98+8gQH9O7mpDOSF7nOr0gH+UAODAy
-----END PRIVATE KEY-----
)";

// kTestKey under the passphrase "plateau".
constexpr char kEncryptedKey[] = R"(-----BEGIN ENCRYPTED PRIVATE KEY-----
MIHsMFcGCSqGSIb3DQEFDTBKMCkGCSqGSIb3DQEFDDAcBAh43p8JQ1NKXAICCAAw
DAYIKoZIhvcNAgkFADAdBglghkgBZQMEASoEEMihr4kPd+qf9QOBMTHthSMEgZA1
0FqqRLeTw+OdW+O1UD1yYgHd0SfzsXq9geJKWtLeqGi0zTNxXl4GgYnW2h+8lqnv
p/ctj/b6dEIQzKE5pxkN3z5UUztfCKI3R/LD/Z7ziA2x0LYph+hhnnz6dmpCZgml
rbLMWAvXCHcwMTrDeKaAfmErISPtTxuRh0nhxj6rmHPU/TQ3TifED+UyCvXH2zs=
-----END ENCRYPTED PRIVATE KEY-----
)";

// The check at start that a key belongs to its certificate (gRPC, reading
// the files as they change, would otherwise fail every handshake instead).
TEST(CheckKeyOfCertificateTest, NamesBothFilesWhenTheKeyIsNotTheCertificates) {
  EXPECT_TRUE(CheckKeyOfCertificate("--cert", "c.pem", kTestCert, "--key", "k.pem", kTestKey).ok());
  absl::Status s = CheckKeyOfCertificate("--cert", "c.pem", kTestCert, "--key", "o.pem", kOtherKey);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "--key=o.pem is not the private key of --cert=c.pem");
  s = CheckKeyOfCertificate("--cert", "c.pem", kTestKey, "--key", "k.pem", kTestKey);
  EXPECT_EQ(s.message(), "--cert=c.pem: expected a PEM certificate (-----BEGIN CERTIFICATE-----)");
  s = CheckKeyOfCertificate("--cert", "c.pem", kTestCert, "--key", "k.pem", kTestCert);
  EXPECT_EQ(s.message(), "--key=k.pem: expected a PEM private key without a passphrase");
  // Refused at once: OpenSSL's default would ask for the passphrase on the
  // terminal and wait.
  s = CheckKeyOfCertificate("--cert", "c.pem", kTestCert, "--key", "e.pem", kEncryptedKey);
  EXPECT_EQ(s.message(), "--key=e.pem: expected a PEM private key without a passphrase");
}

// A TCP socket bound to 127.0.0.1 (SO_REUSEADDR) on a port the kernel
// picks, and that address; -1 on failure.
int BindLoopback(std::string* address) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  const int one = 1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
      bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(fd);
    return -1;
  }
  *address = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  return fd;
}

// A server on `address` whose methods all answer UNIMPLEMENTED: a call that
// gets that answer got through. `service` must outlive it.
std::unique_ptr<grpc::Server> ServeUnimplemented(const std::string& address,
                                                 v1::WorkerService::Service* service) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials());
  builder.RegisterService(service);
  return builder.BuildAndStart();
}

// A connect attempt that reaches a peer which accepts and never answers
// (no HTTP/2 SETTINGS) holds every call waiting on the channel until the
// attempt times out. OpenChannel bounds that at 3 s (gRPC's default is 20 s),
// so a coordinator that comes up behind such an attempt is reached within
// an agent's heartbeat deadline, not after its re-attach window.
TEST(OpenChannelTest, AnAttemptStuckInItsHandshakeIsAbandonedWithinSeconds) {
  // The silent peer: a listener on a port of the kernel's choosing.
  std::string address;
  const int listener = BindLoopback(&address);
  ASSERT_GE(listener, 0);
  ASSERT_EQ(listen(listener, 4), 0);

  auto channel = OpenChannel({address, {"", ""}});
  ASSERT_TRUE(channel.ok()) << channel.status();
  (*channel)->GetState(/*try_to_connect=*/true);
  // Accept the attempt and keep it open, silent; then stop listening, so a
  // real server can take the port (SO_REUSEADDR on both: an accepted
  // connection does not block the bind, a listener would).
  const int stuck = accept(listener, nullptr, nullptr);
  ASSERT_GE(stuck, 0);
  close(listener);
  ASSERT_EQ((*channel)->GetState(false), GRPC_CHANNEL_CONNECTING);

  v1::WorkerService::Service unimplemented;
  std::unique_ptr<grpc::Server> server = ServeUnimplemented(address, &unimplemented);
  ASSERT_NE(server, nullptr) << "cannot listen on " << address;

  auto stub = v1::WorkerService::NewStub(*channel);
  grpc::ClientContext ctx;
  ctx.set_wait_for_ready(
      true);  // wait through the stuck attempt, as an RPC on a connecting channel does
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::HeartbeatRequest req;
  v1::HeartbeatResponse resp;
  const absl::Time start = absl::Now();
  const grpc::Status s = stub->Heartbeat(&ctx, req, &resp);
  // gRPC's 20 s default would end this call at its 10 s deadline.
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED)
      << s.error_message() << " after " << absl::Now() - start;
  close(stuck);
  server->Shutdown();
}

// The pause's contract: it returns once a server that was away answers, and
// sleeps it out on a connected channel. (Here the server's own threads poll
// the process's sockets too, so this cannot show that the pause polls where
// nothing else does: tests/fault_test's coordinator restart shows that.)
TEST(PauseBeforeRetryTest, ReturnsOnceARestartedServerAnswers) {
  // A port that nobody listens on, for now.
  std::string address;
  const int probe = BindLoopback(&address);
  ASSERT_GE(probe, 0);
  close(probe);

  auto channel = OpenChannel({address, {"", ""}});
  ASSERT_TRUE(channel.ok()) << channel.status();
  auto stub = v1::WorkerService::NewStub(*channel);
  {
    grpc::ClientContext ctx;
    v1::HeartbeatRequest req;
    v1::HeartbeatResponse resp;
    EXPECT_EQ(stub->Heartbeat(&ctx, req, &resp).error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  EXPECT_FALSE(PauseBeforeRetry(**channel, absl::Milliseconds(300)));

  v1::WorkerService::Service unimplemented;
  std::unique_ptr<grpc::Server> server = ServeUnimplemented(address, &unimplemented);
  ASSERT_NE(server, nullptr) << "cannot listen on " << address;
  // Reconnect backoff is at most 1 s (OpenChannel).
  const absl::Time start = absl::Now();
  EXPECT_TRUE(PauseBeforeRetry(**channel, absl::Seconds(3)));
  EXPECT_EQ((*channel)->GetState(false), GRPC_CHANNEL_READY) << "after " << absl::Now() - start;
  // Connected: the pause is a plain wait (a call that failed there must not
  // be retried at once).
  const absl::Time again = absl::Now();
  EXPECT_FALSE(PauseBeforeRetry(**channel, absl::Milliseconds(200)));
  EXPECT_GE(absl::Now() - again, absl::Milliseconds(200));
  server->Shutdown();
}

// gRPC takes a port past 65535 modulo 65536 (127.0.0.1:99553 dials 34017),
// so every address a flag gives is checked first.
TEST(CheckAddressTest, PortsOutsideTheirRangeAndMalformedAddressesAreRefused) {
  for (const std::string bad :
       {"127.0.0.1:99553", "127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.1:", "127.0.0.1", ":7070", "localhost:7070x",
        "localhost:+7070", "[::1]7070", "[::1]:", "", "host:0", "::1:7070"}) {
    const absl::Status s = CheckAddress("--coordinator", bad, /*listen=*/false);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_THAT(s.message(), HasSubstr("--coordinator=" + bad +
                                       ": expected HOST:PORT (or [IPV6]:PORT) with a port "
                                       "1-65535"))
        << bad;
  }
  for (const char* good :
       {"127.0.0.1:1", "localhost:65535", "[::1]:7070", "coordinator.example:443",
        "unix:/run/plateau.sock", "dns:///coordinator:7070"}) {
    EXPECT_TRUE(CheckAddress("--coordinator", good, /*listen=*/false).ok()) << good;
  }
  EXPECT_TRUE(CheckAddress("--listen", "127.0.0.1:0", /*listen=*/true).ok());
  EXPECT_THAT(
      CheckAddress("--listen", "127.0.0.1:99999", /*listen=*/true).message(),
      HasSubstr(
          "--listen=127.0.0.1:99999: expected HOST:PORT (or [IPV6]:PORT) with a port 0-65535"));
  auto c = OpenChannel({"127.0.0.1:99553", {"", ""}});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("--coordinator=127.0.0.1:99553"));
}

}  // namespace
}  // namespace plateau
