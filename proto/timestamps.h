// google.protobuf.Timestamp from and to absl::Time: the one conversion the
// coordinator, its telemetry and the worker agent use.
#ifndef PLATEAU_PROTO_TIMESTAMPS_H_
#define PLATEAU_PROTO_TIMESTAMPS_H_

#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/timestamp.pb.h"

namespace plateau {

inline void SetTimestamp(google::protobuf::Timestamp* t, absl::Time time) {
  const int64_t ns = absl::ToUnixNanos(time);
  t->set_seconds(ns / 1000000000);
  t->set_nanos(static_cast<int32_t>(ns % 1000000000));
}

// Sets `t` to now.
inline void Now(google::protobuf::Timestamp* t) { SetTimestamp(t, absl::Now()); }

inline absl::Time TimeOf(const google::protobuf::Timestamp& t) {
  return absl::FromUnixSeconds(t.seconds()) + absl::Nanoseconds(t.nanos());
}

}  // namespace plateau

#endif  // PLATEAU_PROTO_TIMESTAMPS_H_
