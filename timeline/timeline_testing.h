// A small, fully known GetMemoryTimelineResponse for the chart tests:
// job-7, ranks 0 and 1, three phases; device bounds weights 1000, grads
// 1000, dispatch 600, activations 400 (total 3000) under a 4000-byte cap;
// host bound optimizer 2000. In "forward 0" a 500-byte dispatch buffer
// comes and goes (a transient: peak of the sum 2800, 2300 at the end).
#ifndef PLATEAU_TIMELINE_TIMELINE_TESTING_H_
#define PLATEAU_TIMELINE_TIMELINE_TESTING_H_

#include <string>
#include <vector>

#include "plateau/v1/job.pb.h"

namespace plateau {

inline v1::GetMemoryTimelineResponse ExampleTimeline(bool with_host = true) {
  v1::GetMemoryTimelineResponse r;
  r.set_job_id("job-7");
  v1::MemoryPlan* plan = r.mutable_plan();
  auto bound = [](google::protobuf::RepeatedPtrField<v1::LiveSetBytes>* list, const char* set, int64_t bytes) {
    v1::LiveSetBytes* b = list->Add();
    b->set_live_set(set);
    b->set_bytes(bytes);
  };
  bound(plan->mutable_live_sets(), "weights", 1000);
  bound(plan->mutable_live_sets(), "grads", 1000);
  bound(plan->mutable_live_sets(), "dispatch", 600);
  bound(plan->mutable_live_sets(), "activations", 400);
  plan->set_total_bytes(3000);
  plan->set_device_memory_bytes(4000);
  if (with_host) {
    bound(plan->mutable_host_live_sets(), "optimizer", 2000);
    plan->set_host_total_bytes(2000);
  }
  const std::vector<std::string> sets = {"weights",  "grads",      "optimizer",   "checkpoints",
                                         "dispatch", "projection", "activations", "workspace"};
  for (int rank = 0; rank < 2; ++rank) {
    v1::MemoryTimeline* t = r.add_ranks();
    t->set_rank(rank);
    t->set_step(100);
    t->set_phases_seen(3);
    t->set_device_cap_bytes(4000);
    t->mutable_time()->set_seconds(1700000000);
    for (const std::string& s : sets) t->add_live_sets(s);
    struct P {
      const char* name;
      std::vector<int64_t> bytes, peak;
      int64_t total_peak;
    };
    const std::vector<P> phases = {
        {"embedding", {1000, 1000, 0, 0, 0, 0, 0, 0}, {1000, 1000, 0, 0, 0, 0, 0, 0}, 2000},
        {"forward 0", {1000, 1000, 0, 0, 0, 0, 300, 0}, {1000, 1000, 0, 0, 500, 0, 300, 0}, 2800},
        {"optimizer", {1000, 1000, 0, 0, 0, 0, 0, 0}, {1000, 1000, 0, 0, 0, 0, 300, 0}, 2300},
    };
    for (const P& p : phases) {
      v1::MemoryTimelinePhase* out = t->add_phases();
      out->set_name(p.name);
      out->set_merged(1);
      for (int i = 0; i < 8; ++i) {
        out->add_device_bytes(p.bytes[i]);
        out->add_device_peak_bytes(p.peak[i]);
        const int64_t host = with_host && i == 2 ? 2000 : 0;
        out->add_host_bytes(host);
        out->add_host_peak_bytes(host);
      }
      out->set_device_peak_total_bytes(p.total_peak);
      out->set_host_peak_total_bytes(with_host ? 2000 : 0);
    }
  }
  return r;
}

}  // namespace plateau

#endif  // PLATEAU_TIMELINE_TIMELINE_TESTING_H_
