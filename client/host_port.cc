#include "client/host_port.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"

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

}  // namespace plateau
