#include "worker/telemetry_batch.h"

#include <utility>

#include "google/protobuf/io/coded_stream.h"

namespace plateau {
namespace {

// Bytes an entry adds to the request: its tag, its length, itself.
size_t FieldBytes(const google::protobuf::Message& m) {
  const size_t n = m.ByteSizeLong();
  return 1 + google::protobuf::io::CodedOutputStream::VarintSize64(n) + n;
}

}  // namespace

std::vector<v1::TelemetryRequest> SplitTelemetry(v1::TelemetryRequest all, size_t max_bytes) {
  std::vector<v1::TelemetryRequest> out;
  if (all.steps_size() == 0 && all.logs_size() == 0) return out;
  v1::TelemetryRequest head;
  head.set_worker_id(all.worker_id());
  const size_t empty = head.ByteSizeLong();
  v1::TelemetryRequest batch = head;
  size_t bytes = empty;
  auto room = [&](size_t n) {
    if (bytes > empty && bytes + n > max_bytes) {
      out.push_back(std::move(batch));
      batch = head;
      bytes = empty;
    }
    bytes += n;
  };
  for (v1::TelemetryRequest::Step& s : *all.mutable_steps()) {
    room(FieldBytes(s));
    batch.add_steps()->Swap(&s);
  }
  for (v1::LogEntry& l : *all.mutable_logs()) {
    room(FieldBytes(l));
    batch.add_logs()->Swap(&l);
  }
  if (bytes > empty) out.push_back(std::move(batch));
  return out;
}

}  // namespace plateau
