// The gRPC layer over the Coordinator: JobService (public) and WorkerService
// (internal). Each handler validates the request, calls the coordinator and
// maps absl::Status onto the same canonical gRPC code. Every handler first
// admits the call (server/security.h): the bearer token, then, for a
// streaming watch, the per-client limit; only then does it read the request.
//
// Thread safety: gRPC calls the handlers from many threads; the coordinator
// is thread-safe.
#ifndef PLATEAU_SERVER_SERVICES_H_
#define PLATEAU_SERVER_SERVICES_H_

#include "grpcpp/grpcpp.h"
#include "plateau/v1/job.grpc.pb.h"
#include "plateau/v1/worker.grpc.pb.h"
#include "server/coordinator.h"
#include "server/security.h"

namespace plateau {

grpc::Status ToGrpc(const absl::Status& s);

// What the handlers check before anything else; owned by the caller and
// outliving the services. nullptr: no check.
struct ServiceGuards {
  // JobService's tokens, and WorkerService's too unless worker_auth is on.
  const BearerAuth* auth = nullptr;
  // WorkerService's tokens (the coordinator's --worker_token_file): when
  // on, a user's token cannot act as a worker (register as one, take its
  // assignments, read or set a job's rendezvous keys) nor a worker's token
  // as a user.
  const BearerAuth* worker_auth = nullptr;
  WatchLimiter* watches = nullptr;  // JobService's WatchJob and GetJobLogs
};

// How the row streams behave; the coordinator's flags.
struct StreamOptions {
  // A WatchJob stream that has sent nothing for this long sends a
  // JobEvent.heartbeat, and a GetJobLogs that follows a LogEntry.heartbeat,
  // when the request asked for them (--watch_heartbeat_s), so that a proxy
  // or load balancer that cuts idle streams does not cut a quiet watch or
  // log: those commonly time out after 60 s or more (AWS ALB's default
  // 60 s, Envoy's stream idle timeout 5 min). 0: none.
  absl::Duration watch_heartbeat = absl::Seconds(20);
};

class JobServiceImpl final : public v1::JobService::Service {
 public:
  explicit JobServiceImpl(Coordinator* c, ServiceGuards guards = {}, StreamOptions streams = {})
      : c_(c), guards_(guards), streams_(streams) {}
  grpc::Status SubmitJob(grpc::ServerContext*, const v1::SubmitJobRequest*, v1::SubmitJobResponse*) override;
  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest*, v1::Job*) override;
  grpc::Status ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*, v1::ListJobsResponse*) override;
  grpc::Status CancelJob(grpc::ServerContext*, const v1::CancelJobRequest*, v1::Job*) override;
  grpc::Status WatchJob(grpc::ServerContext*, const v1::WatchJobRequest*,
                        grpc::ServerWriter<v1::JobEvent>*) override;
  grpc::Status GetJobLogs(grpc::ServerContext*, const v1::GetJobLogsRequest*,
                          grpc::ServerWriter<v1::LogEntry>*) override;
  grpc::Status PlanJob(grpc::ServerContext*, const v1::PlanJobRequest*, v1::PlanJobResponse*) override;
  grpc::Status GetMemoryTimeline(grpc::ServerContext*, const v1::GetMemoryTimelineRequest*,
                                 v1::GetMemoryTimelineResponse*) override;
  grpc::Status ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*, v1::ListWorkersResponse*) override;
  grpc::Status DeleteJob(grpc::ServerContext*, const v1::DeleteJobRequest*, v1::DeleteJobResponse*) override;

 private:
  Coordinator* const c_;
  const ServiceGuards guards_;
  const StreamOptions streams_;
};

class WorkerServiceImpl final : public v1::WorkerService::Service {
 public:
  explicit WorkerServiceImpl(Coordinator* c, ServiceGuards guards = {}) : c_(c), guards_(guards) {}
  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest*, v1::RegisterResponse*) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*, v1::HeartbeatResponse*) override;
  grpc::Status ReportRankStatus(grpc::ServerContext*, const v1::RankStatusRequest*,
                                v1::RankStatusResponse*) override;
  grpc::Status ReportTelemetry(grpc::ServerContext*, const v1::TelemetryRequest*,
                               v1::TelemetryResponse*) override;
  grpc::Status KvSet(grpc::ServerContext*, const v1::KvSetRequest*, v1::KvSetResponse*) override;
  grpc::Status KvGet(grpc::ServerContext*, const v1::KvGetRequest*, v1::KvGetResponse*) override;
  grpc::Status KvCheck(grpc::ServerContext*, const v1::KvCheckRequest*, v1::KvCheckResponse*) override;

 private:
  Coordinator* const c_;
  const ServiceGuards guards_;
};

}  // namespace plateau

#endif  // PLATEAU_SERVER_SERVICES_H_
