#include "client/host_port.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"

namespace plateau {

bool SplitHostPort(absl::string_view address, std::string* host, int* port) {
  absl::string_view h, p;
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos || close + 1 >= address.size() ||
        address[close + 1] != ':') {
      return false;
    }
    h = address.substr(1, close - 1);
    p = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos) return false;
    h = address.substr(0, colon);
    p = address.substr(colon + 1);
    // An IPv6 address needs its brackets: "::1:7070" could be ::1 port 7070
    // or ::1:7070 with no port (gRPC reads it the second way).
    if (absl::StrContains(h, ':')) return false;
  }
  int n = -1;
  if (p.empty() || p.size() > 5 ||
      !std::all_of(p.begin(), p.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      !absl::SimpleAtoi(p, &n) || n > 65535) {
    return false;
  }
  *host = std::string(h);
  *port = n;
  return true;
}

bool IsLoopbackAddress(const std::string& address) {
  absl::string_view a = address;
  // A unix socket is reachable only through this machine's file system.
  if (absl::StartsWith(a, "unix:") || absl::StartsWith(a, "unix-abstract:")) return true;
  // gRPC's own target schemes around a HOST:PORT (dns:///h:p, dns:h:p,
  // ipv4:h:p, ipv6:[h]:p); a comma list of several is not looked into.
  for (absl::string_view scheme : {"dns:///", "dns:", "ipv4:", "ipv6:"}) {
    if (absl::ConsumePrefix(&a, scheme)) break;
  }
  if (absl::StrContains(a, ',')) return false;
  absl::string_view host = a;
  if (absl::StartsWith(a, "[")) {
    const size_t close = a.find(']');
    if (close == absl::string_view::npos) return false;
    host = a.substr(1, close - 1);
  } else {
    const size_t colon = a.rfind(':');
    if (colon != absl::string_view::npos) host = a.substr(0, colon);
  }
  if (absl::EqualsIgnoreCase(host, "localhost")) return true;
  const std::string h(host);
  in_addr v4{};
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, h.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    // ::ffff:127.x.x.x, an IPv4 loopback address in IPv6 form.
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  return false;
}

}  // namespace plateau
