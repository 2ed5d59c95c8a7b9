// Protobuf messages as JSON for scripts (`plateauctl --output json`): the
// proto3 JSON mapping with the field names of the .proto (`job_id`, not
// `jobId`), but with every field that has no presence printed even when it
// is zero (`"rank": 0`, `"index": 0`, `"attempt": 0`, `"labels": {}`), and
// 64-bit integers as JSON numbers when a double holds them exactly
// (|v| < 2^53), as strings otherwise (the proto3 mapping's form, which every
// JSON parser reads without losing digits).
//
// Fields with presence appear only when set: a message field (`failure`), a
// oneof's member (`state_change` or `step`), a proto3 `optional` scalar
// (`rope_theta`): their absence is the answer. Enums print as names,
// Timestamps as RFC 3339 strings, non-finite doubles as "NaN", "Infinity",
// "-Infinity" (all as protobuf's own printer does).
#ifndef PLATEAU_CLIENT_JSON_OUTPUT_H_
#define PLATEAU_CLIENT_JSON_OUTPUT_H_

#include <string>

#include "absl/status/status.h"
#include "google/protobuf/message.h"

namespace plateau {

// One line, no trailing newline.
std::string ToJson(const google::protobuf::Message& m);

// {"error":{"code":"NOT_FOUND","message":"...","exit_code":7}}: how
// plateauctl reports an error under --output json.
std::string ErrorJson(const absl::Status& s, int exit_code);

// A JSON string literal (quotes included).
std::string JsonString(const std::string& s);

}  // namespace plateau

#endif  // PLATEAU_CLIENT_JSON_OUTPUT_H_
