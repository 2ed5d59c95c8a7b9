// The worker registry: the registered workers (capabilities, heartbeat
// clock, devices in use, the assignments and cancellations waiting for their
// next heartbeat), their ids, and when each counts as lost. It knows nothing
// of jobs: what a lost worker means for the attempts placed on it is the
// Coordinator's job state machine (ExpireWorkers).
//
// Thread safety: not synchronized by itself; the Coordinator owns it and
// calls it under its mutex (mu_), like its other parts. Ownership: returned
// Worker references and pointers stay valid until that worker is Removed.
#ifndef PLATEAU_SERVER_WORKER_REGISTRY_H_
#define PLATEAU_SERVER_WORKER_REGISTRY_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "plateau/v1/worker.pb.h"
#include "server/placement.h"

namespace plateau {

struct Worker {
  std::string id;
  v1::WorkerCapabilities caps;
  absl::Time last_heartbeat;
  absl::Time registered;  // its latest registration
  absl::Time expires;  // lost when now passes this
  // False for a worker a restarted coordinator expects to register again
  // (it has ranks of a live job); it gets no new work until it does.
  bool attached = true;
  // Said it is shutting down (HeartbeatRequest.leaving): no new work, and
  // "left" rather than lost once its heartbeats stop. Cleared when it
  // registers again.
  bool leaving = false;
  int used_devices = 0;
  std::vector<v1::Assignment> assignments;  // not yet sent
  // Sent in the answer to heartbeat `beat` and not yet known to have
  // arrived: the answer may have been lost (the agent gave up waiting, the
  // connection dropped). Acknowledged by a rank's status or by a later
  // heartbeat that lists the attempt; a later heartbeat that does not list
  // it, with no status from its ranks, means it never arrived, and it is
  // sent again (Coordinator::Heartbeat). `withdrawn`: its attempt ended
  // meanwhile; it is not sent again, and if it never arrived its ranks
  // count as gone.
  struct Sent {
    std::string job_id;
    int attempt = 0;
    int64_t beat = 0;
    bool withdrawn = false;
  };
  std::vector<Sent> unacknowledged;
  std::vector<v1::Cancellation> cancellations;
  // The last telemetry batch stored from this worker's agent
  // (TelemetryRequest.sender, .batch).
  uint64_t batch_sender = 0;
  int64_t batch_stored = 0;
};

class WorkerRegistry {
 public:
  // worker_timeout: how long an attached worker may stay silent;
  // reattach_timeout: how long a restarted coordinator waits for a worker
  // it expects to register again (CoordinatorOptions).
  WorkerRegistry(absl::Duration worker_timeout, absl::Duration reattach_timeout)
      : worker_timeout_(worker_timeout), reattach_timeout_(reattach_timeout) {}
  WorkerRegistry(const WorkerRegistry&) = delete;
  WorkerRegistry& operator=(const WorkerRegistry&) = delete;

  // INVALID_ARGUMENT naming the field of capabilities a worker cannot register with.
  static absl::Status CheckCapabilities(const v1::WorkerCapabilities& c);

  // The fencing lease sent with every heartbeat (HeartbeatResponse.lease_ms;
  // docs/SERVICE.md "Partitions and fencing"): three quarters of the shorter
  // of the two timeouts after which this coordinator re-places a silent
  // worker's jobs. The agent counts it from when it sent the answered
  // heartbeat, which is no later than when the coordinator received it, so
  // the agent has frozen its ranks at least a quarter of that timeout before
  // the coordinator can declare it lost and start the job's next attempt.
  absl::Duration lease() const { return std::min(worker_timeout_, reattach_timeout_) * 3 / 4; }

  // A worker registering, with the id it asks for ("" for a new one). It
  // keeps that id when nobody else holds it, when it is the expected worker
  // of that id, or when the attached worker of that id has the same name
  // and rank address (the same agent, restarted before it was declared
  // lost: it persists its id in its work dir); otherwise it gets a fresh
  // "worker-N". Its heartbeat clock starts at `now`. *expected: its ranks
  // are to be re-attached from what it says it runs (a restart left ranks
  // of live jobs on it, or the agent itself restarted): its devices in use,
  // assignments and cancellations start empty and the caller rebuilds them.
  // *restarted (may be null): the last case, an attached worker's agent
  // registering again.
  Worker& Attach(const std::string& asked, const v1::WorkerCapabilities& caps, absl::Time now, bool* expected,
                 bool* restarted = nullptr);
  // After a restart: a worker a live attempt was placed on, expected to
  // register again within reattach_timeout of `now` (unattached until then).
  Worker& Expect(const std::string& id, absl::Time now);
  // A heartbeat: the worker is lost worker_timeout after `now`.
  void Beat(Worker& w, absl::Time now);

  // nullptr when unknown (lost, or never registered).
  Worker* Find(const std::string& id);
  // nullptr unless registered and attached (what a request may come from).
  Worker* FindAttached(const std::string& id);
  Worker& at(const std::string& id) { return workers_.at(id); }
  // Every worker, attached or expected, by id.
  const std::map<std::string, Worker>& all() const { return workers_; }
  // The attached workers that are not leaving and their free devices, as
  // placement sees them.
  std::vector<WorkerSlots> Slots() const;

  // The workers whose time ran out at `now`, by id. Each stays registered
  // until Remove, so that the caller handles one loss at a time.
  std::vector<std::string> Expired(absl::Time now) const;
  // Forgets the worker; returns why it was lost at `now` ("sent no
  // heartbeat for 2.3 s", "did not register again within 10s of the
  // coordinator's restart").
  std::string Remove(const std::string& id, absl::Time now);

 private:
  const absl::Duration worker_timeout_;
  const absl::Duration reattach_timeout_;
  int64_t next_worker_ = 1;
  std::map<std::string, Worker> workers_;
};

}  // namespace plateau

#endif  // PLATEAU_SERVER_WORKER_REGISTRY_H_
