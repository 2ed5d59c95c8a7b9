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

}  // namespace
}  // namespace plateau
