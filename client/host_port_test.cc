#include "client/host_port.h"

#include <string>

#include "gtest/gtest.h"

namespace plateau {
namespace {

TEST(SplitHostPortTest, HostsAndPortsAsFlagsGiveThem) {
  std::string host;
  int port = -1;
  ASSERT_TRUE(SplitHostPort("127.0.0.1:7070", &host, &port));
  EXPECT_EQ(host, "127.0.0.1");
  EXPECT_EQ(port, 7070);
  ASSERT_TRUE(SplitHostPort("[::1]:0", &host, &port));
  EXPECT_EQ(host, "::1");
  EXPECT_EQ(port, 0);
  ASSERT_TRUE(SplitHostPort(":9464", &host, &port));
  EXPECT_EQ(host, "");
  EXPECT_EQ(port, 9464);
  // A port past 65535 (gRPC would wrap it), signs and spaces SimpleAtoi
  // would take, and shapes that are not HOST:PORT.
  for (const char* bad : {"h:65536", "h:99553", "h:+80", "h: 80", "h:-1", "h:", "h", "[::1]80", "[::1]:", "h:080800",
                          "::1:7070", "fe80::1:80"}) {
    EXPECT_FALSE(SplitHostPort(bad, &host, &port)) << bad;
  }
}

TEST(IsLoopbackAddressTest, OnlyThisMachine) {
  for (const char* a : {"127.0.0.1:7070", "127.1.2.3:0", "localhost:7070", "LOCALHOST:1", "[::1]:7070",
                        "[::ffff:127.0.0.1]:7070", "unix:/run/plateau.sock", "unix-abstract:plateau",
                        "dns:///localhost:7070", "ipv4:127.0.0.1:7070", "ipv6:[::1]:7070"}) {
    EXPECT_TRUE(IsLoopbackAddress(a)) << a;
  }
  for (const char* a : {"0.0.0.0:7070", "[::]:7070", ":7070", "10.1.2.3:7070", "example.com:7070", "128.0.0.1:1",
                        "[::1:7070", "[::ffff:10.0.0.1]:1", "dns:///example.com:7070", "ipv4:127.0.0.1:1,10.0.0.1:1"}) {
    EXPECT_FALSE(IsLoopbackAddress(a)) << a;
  }
}

}  // namespace
}  // namespace plateau
