// An admission refusal for memory as a typed status (plateau.v1.DoesNotFit):
// the coordinator attaches it as the status' payload, the service sends it
// as the gRPC status' details, the client puts it back as the payload, and
// plateauctl's exit 5 reads it, so that no side keys on the message's words.
#ifndef PLATEAU_PROTO_DOES_NOT_FIT_H_
#define PLATEAU_PROTO_DOES_NOT_FIT_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/string_view.h"
#include "plateau/v1/job.pb.h"

namespace plateau {

inline constexpr absl::string_view kDoesNotFitUrl = "type.googleapis.com/plateau.v1.DoesNotFit";

// RESOURCE_EXHAUSTED with `message`, carrying DoesNotFit{cap}.
inline absl::Status DoesNotFitError(absl::string_view cap, absl::string_view message) {
  absl::Status s = absl::ResourceExhaustedError(message);
  v1::DoesNotFit d;
  d.set_cap(std::string(cap));
  s.SetPayload(kDoesNotFitUrl, absl::Cord(d.SerializeAsString()));
  return s;
}

// The DoesNotFit a status carries, if any.
inline std::optional<v1::DoesNotFit> DoesNotFitOf(const absl::Status& s) {
  if (s.code() != absl::StatusCode::kResourceExhausted) return std::nullopt;
  const auto payload = s.GetPayload(kDoesNotFitUrl);
  v1::DoesNotFit d;
  if (!payload.has_value() || !d.ParseFromString(std::string(*payload))) return std::nullopt;
  return d;
}

}  // namespace plateau

#endif  // PLATEAU_PROTO_DOES_NOT_FIT_H_
