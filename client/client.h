// A small C++ client of the coordinator's JobService, used by plateauctl
// and the tests. Every error says what failed; a coordinator that cannot be
// reached is UNAVAILABLE "cannot reach the coordinator at HOST:PORT: ...".
// The channel (TLS, bearer token) is client/connection.h's; a token or CA
// file that cannot be read makes status() and every call fail with that
// error (INVALID_ARGUMENT naming the flag and the path).
//
// Thread safety: a Client may be shared by threads (gRPC stubs are).
#ifndef PLATEAU_CLIENT_CLIENT_H_
#define PLATEAU_CLIENT_CLIENT_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/connection.h"
#include "grpcpp/grpcpp.h"
#include "plateau/v1/job.grpc.pb.h"

namespace plateau {

// Where and how to reach the coordinator.
struct ClientOptions {
  // The address, the files (token, TLS), their reload and the keepalive.
  ConnectionOptions connection;
  absl::Duration timeout = absl::Seconds(10);  // per unary call
  // A watch or log stream broken by the coordinator going away (a restart)
  // is opened again from the next index for this long; one the coordinator
  // refused for its limit of open streams per client host
  // (RESOURCE_EXHAUSTED, its --max_watches_per_client) too, with backoff
  // (0.5 s doubling to 8 s, jittered), since a place frees as soon as
  // another of this host's streams ends. Then the call fails with that
  // status.
  absl::Duration reconnect_for = absl::Seconds(60);
  // Called once each time a watch or log stream breaks, or is refused for
  // the coordinator's limit, and is being opened again (a UI says
  // "reconnecting..."); not for a coordinator never reached.
  std::function<void(const absl::Status&)> on_reconnecting;
};

class Client {
 public:
  explicit Client(ClientOptions options);
  explicit Client(std::string address, absl::Duration timeout = absl::Seconds(10));

  const std::string& address() const { return address_; }
  // Whether the channel could be opened (the token and CA files read).
  const absl::Status& status() const { return status_; }

  absl::StatusOr<v1::SubmitJobResponse> SubmitJob(const v1::JobSpec& spec, bool validate_only);
  // The whole request: a request_id makes it safe to retry.
  absl::StatusOr<v1::SubmitJobResponse> SubmitJob(const v1::SubmitJobRequest& request);
  absl::StatusOr<v1::Job> GetJob(const std::string& id);
  absl::StatusOr<v1::ListJobsResponse> ListJobs(const v1::ListJobsRequest& request);
  absl::StatusOr<v1::Job> CancelJob(const std::string& id);
  absl::StatusOr<v1::PlanJobResponse> PlanJob(const v1::JobSpec& spec);
  // The latest memory timeline of each rank, with the job's plan.
  absl::StatusOr<v1::GetMemoryTimelineResponse> GetMemoryTimeline(const std::string& id);
  absl::StatusOr<v1::ListWorkersResponse> ListWorkers();
  // A finished job and everything of it; FAILED_PRECONDITION when live.
  absl::Status DeleteJob(const std::string& id);
  // Streams the job's events from `from` until the job's final state (or
  // until on_event returns false). No deadline: a watch lasts the job, and
  // it resumes across a coordinator restart (ClientOptions::reconnect_for).
  // It asks for the stream's heartbeats (WatchJobRequest.heartbeats), so
  // that a proxy that cuts idle streams keeps a quiet watch; they are not
  // events: skipped.
  // `per_rank`: each step event carries every rank's report
  // (WatchJobRequest.per_rank).
  absl::Status WatchJob(const std::string& id, int64_t from,
                        const std::function<bool(const v1::JobEvent&)>& on_event, bool per_rank = false);
  // Streams the job's log lines from `from`: those stored now, or with
  // `follow` until the job's final state (resuming as WatchJob does). It
  // asks for a follow's heartbeats (GetJobLogsRequest.heartbeats), which
  // are not lines: skipped.
  absl::Status GetJobLogs(const std::string& id, bool follow, int64_t from,
                          const std::function<bool(const v1::LogEntry&)>& on_line);

 private:
  absl::Status Convert(const grpc::Status& s) const;
  std::unique_ptr<grpc::ClientContext> Context() const;

  const std::string address_;
  const absl::Duration timeout_;
  const absl::Duration reconnect_for_;
  const std::function<void(const absl::Status&)> on_reconnecting_;
  std::string tls_hint_;  // appended to "cannot reach" over TLS: which files to check
  absl::Status status_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> stub_;
};

}  // namespace plateau

#endif  // PLATEAU_CLIENT_CLIENT_H_
