// A rank's recorded memory timeline (kernels/memory_timeline.h) as the
// plateau.v1.MemoryTimeline it reports with its step (StepTelemetry field
// memory_timeline), and the check that the report fits one RankOutput line
// (worker/rank_protocol.h kMaxRankOutputLineBytes).
#ifndef PLATEAU_WORKER_MEMORY_TIMELINE_PROTO_H_
#define PLATEAU_WORKER_MEMORY_TIMELINE_PROTO_H_

#include <cstdint>

#include "kernels/memory_timeline.h"
#include "plateau/v1/job.pb.h"

namespace plateau {

// Every live set in LiveSet order (live_sets names them), device and host.
v1::MemoryTimeline MemoryTimelineToProto(const MemoryTimelineRecorder& recorder, int rank, int64_t step,
                                         int attempt, int64_t device_cap_bytes, int64_t host_cap_bytes);

}  // namespace plateau

#endif  // PLATEAU_WORKER_MEMORY_TIMELINE_PROTO_H_
