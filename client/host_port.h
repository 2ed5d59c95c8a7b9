// The one parser of HOST:PORT addresses that flags give (--coordinator,
// --listen, --metrics_address), so that every flag takes the same grammar.
//
// Thread safety: a pure function.
#ifndef PLATEAU_CLIENT_HOST_PORT_H_
#define PLATEAU_CLIENT_HOST_PORT_H_

#include <string>

#include "absl/strings/string_view.h"

namespace plateau {

// Splits HOST:PORT or [IPV6]:PORT into the host (without the brackets; empty
// for ":9464") and the port: decimal digits only (no sign or spaces, which
// absl::SimpleAtoi would take) and at most 65535 (gRPC would take a larger
// one modulo 65536). False when `address` is not of that form, an IPv6
// host without its brackets ("::1:7070") included.
bool SplitHostPort(absl::string_view address, std::string* host, int* port);

// Whether an address (a --listen or --coordinator) is this machine's only:
// 127.0.0.0/8, ::1 (and ::ffff:127.x), "localhost", or a unix: socket. Any
// other host name counts as not loopback (it may resolve to anything).
bool IsLoopbackAddress(const std::string& address);

}  // namespace plateau

#endif  // PLATEAU_CLIENT_HOST_PORT_H_
