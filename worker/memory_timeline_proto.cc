#include "worker/memory_timeline_proto.h"

#include <string>

namespace plateau {

v1::MemoryTimeline MemoryTimelineToProto(const MemoryTimelineRecorder& recorder, int rank, int64_t step,
                                         int attempt, int64_t device_cap_bytes, int64_t host_cap_bytes) {
  v1::MemoryTimeline t;
  t.set_rank(rank);
  t.set_step(step);
  t.set_attempt(attempt);
  for (int i = 0; i < kNumLiveSets; ++i) t.add_live_sets(std::string(LiveSetName(static_cast<LiveSet>(i))));
  for (const TimelinePhase& p : recorder.phases()) {
    v1::MemoryTimelinePhase* out = t.add_phases();
    out->set_name(p.name());
    out->set_merged(p.merged);
    for (int i = 0; i < kNumLiveSets; ++i) {
      out->add_device_bytes(p.device.current[i]);
      out->add_device_peak_bytes(p.device.peak[i]);
      out->add_host_bytes(p.host.current[i]);
      out->add_host_peak_bytes(p.host.peak[i]);
    }
    out->set_device_peak_total_bytes(p.device.total_peak);
    out->set_host_peak_total_bytes(p.host.total_peak);
  }
  t.set_phases_seen(recorder.phases_seen());
  t.set_device_cap_bytes(device_cap_bytes);
  t.set_host_cap_bytes(host_cap_bytes);
  return t;
}

}  // namespace plateau
