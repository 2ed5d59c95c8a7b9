#include "server/services.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <optional>

#include "absl/strings/str_cat.h"
#include "proto/does_not_fit.h"
#include "proto/streams.h"
#include "proto/timestamps.h"

namespace plateau {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  // An admission refusal for memory keeps its type (proto/does_not_fit.h)
  // in the status' details: a google.rpc.Status holding the DoesNotFit in an
  // Any, as gRPC's clients expect of the grpc-status-details-bin trailer.
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()), GrpcStatusDetails(s));
}

namespace {

template <typename T>
grpc::Status Reply(absl::StatusOr<T> result, T* out) {
  if (!result.ok()) return ToGrpc(result.status());
  *out = std::move(*result);
  return grpc::Status::OK;
}

// Rows read from the store at a time.
constexpr int kRowsPerRead = 256;

// The rows a stream should have sent from `from` are gone: the retention
// sweep (or a delete, NOT_FOUND once done) removes a finished job's rows in
// parts, lowest index first. Ended OK, such a stream read as complete
// without its job's final state, or skipped rows (reviewer).
grpc::Status RowsRemoved(const v1::Job& job, const char* what, int64_t from) {
  return grpc::Status(
      grpc::StatusCode::FAILED_PRECONDITION,
      absl::StrCat("job ", job.id(), "'s ", what, " from index ", from, " were removed ",
                   job.has_events_deleted_time() ? "(the coordinator's retention, --retention, or a delete)"
                                                 : "while they were read (a retention sweep or a delete)",
                   "; it is ", v1::JobState_Name(job.state()), ": GetJob has its final state"));
}

// Streams rows of a job from `from` until the job is final and every row is
// sent (or, without follow, until the rows now stored are sent).
// `admitted` is asked again before every read: a token rotated out of the
// file ends the streams it opened (within a second), not only new calls.
// `stored` (when given) is how many rows the job has had (events:
// event_count), so that a final job whose rows are gone is told apart from
// one whose rows were all sent. Rows are numbered without gaps, so a gap
// or a missing row is one removed.
// `heartbeat` (when given) is sent, made for the next index `from`, once
// the stream has sent nothing for `heartbeat_every` while it waits.
template <typename Row, typename ReadFn>
grpc::Status StreamRows(Coordinator* c, grpc::ServerContext* ctx, const std::string& job_id, int64_t from, bool follow,
                        grpc::ServerWriter<Row>* writer, ReadFn read, const std::function<grpc::Status()>& admitted,
                        const char* what, const std::function<int64_t(const v1::Job&)>& stored,
                        const std::function<Row(int64_t from)>& heartbeat = nullptr,
                        absl::Duration heartbeat_every = absl::ZeroDuration()) {
  if (from < 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "from_index: expected >= 0");
  auto job = c->GetJob(job_id);
  if (!job.ok()) return ToGrpc(job.status());
  // Open before any row (proto/streams.h): a client resumes a quiet stream
  // that breaks as it does a busy one.
  ctx->AddInitialMetadata(kStreamOpenMetadata, "1");
  writer->SendInitialMetadata();
  const bool beats = heartbeat != nullptr && heartbeat_every > absl::ZeroDuration();
  absl::Time last_sent = absl::Now();  // the metadata is traffic too
  while (!ctx->IsCancelled()) {
    // UNAVAILABLE, not the refusal's UNAUTHENTICATED: a client whose file
    // already holds the new token (a rotation's step 2 before its step 3)
    // resumes as after a restart and sends it; one whose token is gone is
    // then refused at the reopen.
    if (grpc::Status s = admitted(); !s.ok()) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          absl::StrCat("this stream's token is no longer accepted (", s.error_message(),
                                       "); resume from index ", from, " with a token in force"));
    }
    const Coordinator::ChangeStamp version = c->JobVersion(job_id);
    // The state before the rows: a final state's rows are already stored.
    auto now = c->GetJob(job_id);
    if (!now.ok()) return ToGrpc(now.status());
    const bool final = IsTerminal(now->state());
    // Swept: nothing is left to send (a client that had every row before
    // the sweep ends as it would have).
    if (now->has_events_deleted_time() && (!stored || from < stored(*now))) return RowsRemoved(*now, what, from);
    absl::StatusOr<std::vector<Row>> rows = read(from);
    if (!rows.ok()) return ToGrpc(rows.status());
    if (!rows->empty() && rows->front().index() > from) return RowsRemoved(*now, what, from);
    if (rows->empty() && final && stored && from < stored(*now)) return RowsRemoved(*now, what, from);
    for (const Row& r : *rows) {
      if (!writer->Write(r)) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
      from = r.index() + 1;
    }
    if (!rows->empty()) last_sent = absl::Now();
    // Following, until a read finds nothing more: a read may hold fewer
    // rows than its limit with more stored (a per-rank watch read is bounded
    // by its reports). A one-off read (logs without follow) ends at a short
    // read, so that a job writing faster than the client reads cannot keep
    // it going.
    if (follow ? !rows->empty() : rows->size() == kRowsPerRead) continue;
    if (final || !follow) return grpc::Status::OK;
    // Shutting down (SIGTERM): the wait returns at once from here on, and
    // the loop spun until the server's 2 s grace cancelled the call, which
    // then read "cancelled by the client". Said now, so that the client
    // resumes elsewhere or after the restart.
    if (c->stopping()) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          absl::StrCat("the coordinator is shutting down; resume from index ", from));
    }
    absl::Duration wait = absl::Seconds(1);
    if (beats) {
      const absl::Time now = absl::Now();
      if (now - last_sent >= heartbeat_every) {
        if (!writer->Write(heartbeat(from))) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
        last_sent = now;
      }
      wait = std::min(wait, last_sent + heartbeat_every - now);
    }
    c->WaitForJobChange(job_id, version, wait);
  }
  return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
}

// A stream's heartbeat (job.proto WatchHeartbeat), for a stream that
// asked for them, else none: one builder for a watch's JobEvent and a
// followed log's LogEntry. Indexed as the last row sent, so that a client
// resuming from the index it read last + 1 resumes where it should. Only
// for a stream that asks: a client built before them shows each as a row
// (plateauctl's --output json did).
template <typename Row>
std::function<Row(int64_t)> HeartbeatsIfAsked(bool asked, const std::string& job_id) {
  if (!asked) return nullptr;
  return [job_id](int64_t from) {
    Row beat;
    beat.set_job_id(job_id);
    beat.set_index(from - 1);
    Now(beat.mutable_time());
    beat.mutable_heartbeat();
    return beat;
  };
}

// The rank a rendezvous request names (KvSetRequest.rank), if any.
template <typename Request>
std::optional<int> RankOf(const Request& req) {
  return req.has_rank() ? std::optional<int>(req.rank()) : std::nullopt;
}

bool On(const BearerAuth* auth) { return auth != nullptr && auth->enabled(); }

// The call's token checked against `mine`; one of `theirs` (the other
// service's tokens) is refused by name, PERMISSION_DENIED `misplaced`.
grpc::Status AdmitBy(const BearerAuth* mine, const BearerAuth* theirs, const grpc::ServerContext& ctx,
                     const char* misplaced) {
  if (!On(mine)) return grpc::Status::OK;
  grpc::Status s = mine->Check(ctx);
  if (!s.ok() && On(theirs) && theirs->Check(ctx).ok()) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, misplaced);
  }
  return s;
}

// The first line of every JobService handler: the bearer token, before the
// request is looked at. A worker's token is refused by name.
grpc::Status Admit(const ServiceGuards& guards, const grpc::ServerContext& ctx) {
  return AdmitBy(guards.auth, guards.worker_auth, ctx,
                 "a worker's token (the coordinator's --worker_token_file) cannot make JobService calls; "
                 "plateauctl and other clients take a token of its --token_file");
}

// The same for every WorkerService handler: the workers' tokens when the
// coordinator has them apart, a user's token refused by name.
grpc::Status AdmitWorker(const ServiceGuards& guards, const grpc::ServerContext& ctx) {
  if (!On(guards.worker_auth)) return Admit(guards, ctx);
  return AdmitBy(guards.worker_auth, guards.auth, ctx,
                 "a user's token (the coordinator's --token_file) cannot make WorkerService calls: agents and "
                 "ranks take a token of its --worker_token_file");
}

// Whether the caller still waits for the answer, for a handler that works
// in parts for its caller alone (a ListJobs scan, the shapes a PlanJob or a
// SubmitJob's plan searches): DEADLINE_EXCEEDED once its deadline has
// passed, CANCELLED once it cancelled or went away. Both ran on after their
// client gave up, for no one. A DeleteJob is not asked: it is wanted work
// whoever waits (coordinator.h).
StillWanted CallerWaits(const grpc::ServerContext& ctx) {
  return [&ctx]() -> absl::Status {
    // The deadline first: gRPC cancels a call whose deadline passed too.
    if (std::chrono::system_clock::now() >= ctx.deadline()) {
      return absl::DeadlineExceededError("the caller's deadline passed");
    }
    if (ctx.IsCancelled()) return absl::CancelledError("the caller cancelled the call or went away");
    return absl::OkStatus();
  };
}

}  // namespace

grpc::Status JobServiceImpl::SubmitJob(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                                       v1::SubmitJobResponse* out) {
  if (grpc::Status admit = Admit(guards_, *ctx); !admit.ok()) return admit;
  return Reply(c_->SubmitJob(*req, CallerOf(*ctx), CallerWaits(*ctx)), out);
}

grpc::Status JobServiceImpl::GetJob(grpc::ServerContext* ctx, const v1::GetJobRequest* req, v1::Job* out) {
  if (grpc::Status admit = Admit(guards_, *ctx); !admit.ok()) return admit;
  return Reply(c_->GetJob(req->job_id()), out);
}

grpc::Status JobServiceImpl::ListJobs(grpc::ServerContext* ctx, const v1::ListJobsRequest* req,
                                      v1::ListJobsResponse* out) {
  if (grpc::Status admit = Admit(guards_, *ctx); !admit.ok()) return admit;
  return Reply(c_->ListJobs(*req, CallerWaits(*ctx)), out);
}

grpc::Status JobServiceImpl::CancelJob(grpc::ServerContext* ctx, const v1::CancelJobRequest* req, v1::Job* out) {
  if (grpc::Status admit = Admit(guards_, *ctx); !admit.ok()) return admit;
  return Reply(c_->CancelJob(req->job_id(), CallerOf(*ctx)), out);
}

grpc::Status JobServiceImpl::PlanJob(grpc::ServerContext* ctx, const v1::PlanJobRequest* req,
                                     v1::PlanJobResponse* out) {
  if (grpc::Status admit = Admit(guards_, *ctx); !admit.ok()) return admit;
  return Reply(c_->PlanJob(*req, CallerWaits(*ctx)), out);
}

grpc::Status JobServiceImpl::GetMemoryTimeline(grpc::ServerContext* ctx, const v1::GetMemoryTimelineRequest* req,
                                               v1::GetMemoryTimelineResponse* out) {
  if (grpc::Status admit = Admit(guards_, *ctx); !admit.ok()) return admit;
  return Reply(c_->GetMemoryTimeline(req->job_id()), out);
}

grpc::Status JobServiceImpl::ListWorkers(grpc::ServerContext* ctx, const v1::ListWorkersRequest*,
                                         v1::ListWorkersResponse* out) {
  if (grpc::Status admit = Admit(guards_, *ctx); !admit.ok()) return admit;
  *out = c_->ListWorkers();
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::DeleteJob(grpc::ServerContext* ctx, const v1::DeleteJobRequest* req,
                                       v1::DeleteJobResponse*) {
  if (grpc::Status admit = Admit(guards_, *ctx); !admit.ok()) return admit;
  return ToGrpc(c_->DeleteJob(req->job_id(), CallerOf(*ctx)));
}

grpc::Status JobServiceImpl::WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                                      grpc::ServerWriter<v1::JobEvent>* writer) {
  if (grpc::Status admit = Admit(guards_, *ctx); !admit.ok()) return admit;
  // Held until this handler returns, however the stream ends.
  WatchLimiter::Lease lease;
  if (guards_.watches != nullptr) {
    if (grpc::Status s = guards_.watches->Acquire(PeerHost(ctx->peer()), &lease); !s.ok()) return s;
  }
  const std::string id = req->job_id();
  const bool per_rank = req->per_rank();
  return StreamRows<v1::JobEvent>(
      c_, ctx, id, req->from_index(), /*follow=*/true, writer,
      [&](int64_t from) { return c_->ReadEvents(id, from, kRowsPerRead, per_rank); },
      [&] { return Admit(guards_, *ctx); }, "events", [](const v1::Job& job) { return job.event_count(); },
      HeartbeatsIfAsked<v1::JobEvent>(req->heartbeats(), id), streams_.watch_heartbeat);
}

grpc::Status JobServiceImpl::GetJobLogs(grpc::ServerContext* ctx, const v1::GetJobLogsRequest* req,
                                        grpc::ServerWriter<v1::LogEntry>* writer) {
  if (grpc::Status admit = Admit(guards_, *ctx); !admit.ok()) return admit;
  // A plain read ends once the stored lines are sent, but a client that
  // stops reading a long log holds this thread as long as a follow: both
  // count.
  WatchLimiter::Lease lease;
  if (guards_.watches != nullptr) {
    if (grpc::Status s = guards_.watches->Acquire(PeerHost(ctx->peer()), &lease); !s.ok()) return s;
  }
  const std::string id = req->job_id();
  // A followed log of a quiet job (pending, a long step, a rank that
  // prints nothing) is as idle to a proxy as a quiet watch: the same
  // heartbeats, when asked. (A read without follow never waits: none.)
  return StreamRows<v1::LogEntry>(
      c_, ctx, id, req->from_index(), req->follow(), writer,
      [&](int64_t from) { return c_->store().ReadLogs(id, from, kRowsPerRead); }, [&] { return Admit(guards_, *ctx); },
      "log lines", nullptr, HeartbeatsIfAsked<v1::LogEntry>(req->heartbeats(), id), streams_.watch_heartbeat);
}

grpc::Status WorkerServiceImpl::Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req,
                                         v1::RegisterResponse* out) {
  if (grpc::Status admit = AdmitWorker(guards_, *ctx); !admit.ok()) return admit;
  return Reply(c_->Register(*req), out);
}

grpc::Status WorkerServiceImpl::Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                                          v1::HeartbeatResponse* out) {
  if (grpc::Status admit = AdmitWorker(guards_, *ctx); !admit.ok()) return admit;
  return Reply(c_->Heartbeat(*req), out);
}

grpc::Status WorkerServiceImpl::ReportRankStatus(grpc::ServerContext* ctx, const v1::RankStatusRequest* req,
                                                 v1::RankStatusResponse*) {
  if (grpc::Status admit = AdmitWorker(guards_, *ctx); !admit.ok()) return admit;
  return ToGrpc(c_->ReportRankStatus(*req));
}

grpc::Status WorkerServiceImpl::ReportTelemetry(grpc::ServerContext* ctx, const v1::TelemetryRequest* req,
                                                v1::TelemetryResponse*) {
  if (grpc::Status admit = AdmitWorker(guards_, *ctx); !admit.ok()) return admit;
  return ToGrpc(c_->ReportTelemetry(*req));
}

grpc::Status WorkerServiceImpl::KvSet(grpc::ServerContext* ctx, const v1::KvSetRequest* req,
                                      v1::KvSetResponse*) {
  if (grpc::Status admit = AdmitWorker(guards_, *ctx); !admit.ok()) return admit;
  return ToGrpc(c_->KvSet(req->key(), req->value(), RankOf(*req)));
}

grpc::Status WorkerServiceImpl::KvGet(grpc::ServerContext* ctx, const v1::KvGetRequest* req,
                                      v1::KvGetResponse* out) {
  if (grpc::Status admit = AdmitWorker(guards_, *ctx); !admit.ok()) return admit;
  if (req->wait_ms() < 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "wait_ms: expected >= 0");
  absl::Duration wait = absl::Milliseconds(req->wait_ms());
  // Never hold the call past the client's own deadline.
  const auto left = ctx->deadline() - std::chrono::system_clock::now();
  wait = std::max(std::min(wait, absl::FromChrono(left) - absl::Milliseconds(50)), absl::ZeroDuration());
  // In slices, so that a caller that went away (a rank killed during its
  // rendezvous) frees this thread within one, not after the whole wait:
  // a thousand-rank rendezvous cancelled held a thousand threads waiting.
  const absl::Time end = absl::Now() + wait;
  for (;;) {
    const absl::Duration slice = std::min(end - absl::Now(), absl::Milliseconds(250));
    auto v = c_->KvGet(req->key(), std::max(slice, absl::ZeroDuration()), RankOf(*req));
    if (v.ok()) {
      out->set_value(*v);
      return grpc::Status::OK;
    }
    if (!absl::IsNotFound(v.status()) || absl::Now() >= end || c_->stopping()) return ToGrpc(v.status());
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away");
  }
}

grpc::Status WorkerServiceImpl::KvCheck(grpc::ServerContext* ctx, const v1::KvCheckRequest* req,
                                        v1::KvCheckResponse* out) {
  if (grpc::Status admit = AdmitWorker(guards_, *ctx); !admit.ok()) return admit;
  absl::StatusOr<bool> all = c_->KvCheck({req->keys().begin(), req->keys().end()}, RankOf(*req));
  if (!all.ok()) return ToGrpc(all.status());
  out->set_all_set(*all);
  return grpc::Status::OK;
}

}  // namespace plateau
