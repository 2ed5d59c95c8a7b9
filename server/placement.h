// Placement: where a pending job's ranks go, as a pure function of the job
// and the registered workers (no clock, no store, no lock), so that the
// scheduler's decisions are testable on their own (server/placement_test).
// The coordinator's Schedule() applies the decision: it records the
// placement, or the reason the job waits, or marks it unschedulable.
#ifndef PLATEAU_SERVER_PLACEMENT_H_
#define PLATEAU_SERVER_PLACEMENT_H_

#include <string>
#include <vector>

#include "plateau/v1/job.pb.h"
#include "plateau/v1/worker.pb.h"

namespace plateau {

// A registered, attached worker as placement sees it.
struct WorkerSlots {
  std::string id;
  v1::WorkerCapabilities caps;
  int free_devices = 0;  // caps.devices() minus the devices its ranks use
};

struct PlacementDecision {
  enum class Kind {
    kPlaced,         // `nodes`: one worker per node of the job, in rank order
    kWaiting,        // capacity that could host it exists but is busy
    kUnschedulable,  // no registered worker set could ever host it
  };
  Kind kind = Kind::kWaiting;
  std::vector<std::string> nodes;  // kPlaced: worker ids; node n runs ranks [n*per_node, (n+1)*per_node)
  std::string reason;              // kWaiting / kUnschedulable: what it needs and what is there
  // Not placed: what it waits for, as the job's reason while it is not (yet)
  // marked unschedulable (the coordinator holds marks back after a restart).
  std::string waiting_reason;
};

// Why a worker with `devices` devices cannot take one node's share of the
// job (`per_node` ranks); empty when it can. Given its free devices it says
// whether the job can be placed there now; given all of them, whether it
// could ever host it. Memory it reports (> 0) must hold the job's need: per
// device, its device_memory_bytes (or its device plan when 0); per node, the
// node's ranks times its host_memory_bytes (or its host plan when 0). Host
// memory other jobs on the node use is not subtracted: it is not reserved.
std::string WhyCannotHost(const v1::WorkerCapabilities& caps, int devices, const v1::Job& job,
                          int64_t per_node);

// Workers are taken most free devices first (ties in the given order), so
// that jobs spread over the nodes.
PlacementDecision Place(const v1::Job& job, const std::vector<WorkerSlots>& workers);

}  // namespace plateau

#endif  // PLATEAU_SERVER_PLACEMENT_H_
