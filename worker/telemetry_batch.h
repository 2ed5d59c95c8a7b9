// The worker agent's telemetry outbox, cut into requests that stay well
// under the coordinator's --max_request_bytes (at least 1 MiB; 4 MiB by
// default). A coordinator unreachable for a while, or a rank that prints
// fast, can leave megabytes in the outbox; sent whole it would be refused
// with RESOURCE_EXHAUSTED and lost.
//
// Thread safety: a pure function.
#ifndef PLATEAU_WORKER_TELEMETRY_BATCH_H_
#define PLATEAU_WORKER_TELEMETRY_BATCH_H_

#include <cstddef>
#include <vector>

#include "plateau/v1/worker.pb.h"

namespace plateau {

// Half the smallest --max_request_bytes the coordinator accepts.
constexpr size_t kMaxTelemetryBatchBytes = 512 * 1024;

// Splits `all` into requests of at most `max_bytes` serialized (one entry
// larger than that goes alone; the agent cuts log lines at 64 KiB), keeping
// the order of the steps and of the log lines. worker_id is copied into
// each. An empty outbox gives no request.
std::vector<v1::TelemetryRequest> SplitTelemetry(v1::TelemetryRequest all,
                                                 size_t max_bytes = kMaxTelemetryBatchBytes);

}  // namespace plateau

#endif  // PLATEAU_WORKER_TELEMETRY_BATCH_H_
