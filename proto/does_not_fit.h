// An admission refusal for memory as a typed status (plateau.v1.DoesNotFit):
// the coordinator attaches it as the status' payload, the service sends it
// in the gRPC status' details (GrpcStatusDetails below), the client puts it
// back as the payload (PayloadsFromGrpcStatusDetails), and plateauctl's
// exit 5 reads it, so that no side keys on the message's words.
#ifndef PLATEAU_PROTO_DOES_NOT_FIT_H_
#define PLATEAU_PROTO_DOES_NOT_FIT_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/string_view.h"
#include "plateau/v1/job.pb.h"
#include "plateau/v1/rpc_status.pb.h"

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

// The gRPC status details of `s` (grpc::Status' error_details, sent as the
// grpc-status-details-bin trailer): by gRPC's convention a serialized
// google.rpc.Status {code, message, details: [Any]} (v1::RpcStatus is its
// wire twin, rpc_status.proto), which standard clients parse. The
// DoesNotFit `s` carries is its one detail; "" (no details) for any other
// status, whose payloads (internal ones) stay on this side.
inline std::string GrpcStatusDetails(const absl::Status& s) {
  const auto payload = s.GetPayload(kDoesNotFitUrl);
  if (!payload.has_value()) return "";
  v1::RpcStatus status;
  status.set_code(static_cast<int>(s.code()));
  status.set_message(std::string(s.message()));
  google::protobuf::Any* detail = status.add_details();
  detail->set_type_url(std::string(kDoesNotFitUrl));
  detail->set_value(std::string(*payload));
  return status.SerializeAsString();
}

// Puts the DoesNotFit of gRPC status details `details` (GrpcStatusDetails)
// back on `out` as its payload, if it is RESOURCE_EXHAUSTED and they carry
// one. A coordinator from before google.rpc.Status sent the DoesNotFit
// itself as the details: read too. The two cannot be mistaken for each
// other: a DoesNotFit's cap (field 1, a string) is not an RpcStatus' code
// (field 1, a varint), so it parses as an RpcStatus without details, and an
// RpcStatus parses as a DoesNotFit without a cap.
inline void PayloadsFromGrpcStatusDetails(absl::string_view details, absl::Status* out) {
  if (out->code() != absl::StatusCode::kResourceExhausted || details.empty()) return;
  v1::RpcStatus status;
  if (status.ParseFromArray(details.data(), static_cast<int>(details.size()))) {
    for (const google::protobuf::Any& detail : status.details()) {
      v1::DoesNotFit d;
      if (detail.type_url() == kDoesNotFitUrl && d.ParseFromString(detail.value()) && !d.cap().empty()) {
        out->SetPayload(kDoesNotFitUrl, absl::Cord(detail.value()));
        return;
      }
    }
  }
  v1::DoesNotFit d;
  if (d.ParseFromArray(details.data(), static_cast<int>(details.size())) && !d.cap().empty()) {
    out->SetPayload(kDoesNotFitUrl, absl::Cord(d.SerializeAsString()));
  }
}

}  // namespace plateau

#endif  // PLATEAU_PROTO_DOES_NOT_FIT_H_
