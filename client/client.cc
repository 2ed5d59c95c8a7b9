#include "client/client.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/connection.h"
#include "proto/does_not_fit.h"
#include "proto/streams.h"

namespace plateau {

namespace {

ClientOptions At(std::string address, absl::Duration timeout) {
  ClientOptions options;
  options.connection.address = std::move(address);
  options.timeout = timeout;
  return options;
}

}  // namespace

Client::Client(std::string address, absl::Duration timeout) : Client(At(std::move(address), timeout)) {}

Client::Client(ClientOptions options)
    : address_(options.connection.address),
      timeout_(options.timeout),
      reconnect_for_(options.reconnect_for),
      on_reconnecting_(std::move(options.on_reconnecting)) {
  const ConnectionFiles& files = options.connection.files;
  if (!files.tls_ca_file.empty()) {
    tls_hint_ = files.tls_client_cert_file.empty()
                    ? " (over TLS: is --tls_ca_file the CA of its certificate? If it requires client certificates "
                      "(its --tls_client_ca_file), give --tls_client_cert_file and --tls_client_key_file)"
                    : " (over TLS: is --tls_ca_file the CA of its certificate, and did a CA of its "
                      "--tls_client_ca_file sign --tls_client_cert_file?)";
  }
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = OpenChannel(options.connection);
  if (!channel.ok()) {
    status_ = channel.status();
    return;  // stub_ stays null: every call returns status_
  }
  channel_ = *std::move(channel);
  stub_ = v1::JobService::NewStub(channel_);
}

absl::Status Client::Convert(const grpc::Status& s) const {
  if (s.ok()) return absl::OkStatus();
  // gRPC's own words for a request over the coordinator's limit name
  // neither side; say whose limit it is.
  if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
      absl::StrContains(absl::AsciiStrToLower(s.error_message()), "larger than max")) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request is larger than the coordinator at ", address_,
        " accepts (its --max_request_bytes): ", s.error_message()));
  }
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
      (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && s.error_message() == "Deadline Exceeded")) {
    // A TLS handshake the coordinator refused reads as a closed socket: say
    // which files to check (not when nothing listens there at all).
    const bool refused = absl::StrContains(s.error_message(), "Connection refused");
    return absl::UnavailableError(
        absl::StrCat("cannot reach the coordinator at ", address_, ": ", s.error_message(), refused ? "" : tls_hint_));
  }
  absl::Status out(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  // An admission refusal for memory: its type back as the payload
  // (proto/does_not_fit.h), from the google.rpc.Status of the details.
  PayloadsFromGrpcStatusDetails(s.error_details(), &out);
  return out;
}

std::unique_ptr<grpc::ClientContext> Client::Context() const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout_));
  return ctx;
}

absl::StatusOr<v1::SubmitJobResponse> Client::SubmitJob(const v1::JobSpec& spec, bool validate_only) {
  v1::SubmitJobRequest req;
  *req.mutable_spec() = spec;
  req.set_validate_only(validate_only);
  return SubmitJob(req);
}

absl::StatusOr<v1::SubmitJobResponse> Client::SubmitJob(const v1::SubmitJobRequest& req) {
  if (!status_.ok()) return status_;
  v1::SubmitJobResponse resp;
  auto ctx = Context();
  absl::Status s = Convert(stub_->SubmitJob(ctx.get(), req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::Job> Client::GetJob(const std::string& id) {
  v1::GetJobRequest req;
  req.set_job_id(id);
  if (!status_.ok()) return status_;
  v1::Job resp;
  auto ctx = Context();
  absl::Status s = Convert(stub_->GetJob(ctx.get(), req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::ListJobsResponse> Client::ListJobs(const v1::ListJobsRequest& req) {
  if (!status_.ok()) return status_;
  v1::ListJobsResponse resp;
  auto ctx = Context();
  absl::Status s = Convert(stub_->ListJobs(ctx.get(), req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::Job> Client::CancelJob(const std::string& id) {
  v1::CancelJobRequest req;
  req.set_job_id(id);
  if (!status_.ok()) return status_;
  v1::Job resp;
  auto ctx = Context();
  absl::Status s = Convert(stub_->CancelJob(ctx.get(), req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::GetMemoryTimelineResponse> Client::GetMemoryTimeline(const std::string& id) {
  v1::GetMemoryTimelineRequest req;
  req.set_job_id(id);
  if (!status_.ok()) return status_;
  v1::GetMemoryTimelineResponse resp;
  auto ctx = Context();
  absl::Status s = Convert(stub_->GetMemoryTimeline(ctx.get(), req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::ListWorkersResponse> Client::ListWorkers() {
  if (!status_.ok()) return status_;
  v1::ListWorkersResponse resp;
  auto ctx = Context();
  absl::Status s = Convert(stub_->ListWorkers(ctx.get(), v1::ListWorkersRequest(), &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::Status Client::DeleteJob(const std::string& id) {
  v1::DeleteJobRequest req;
  req.set_job_id(id);
  if (!status_.ok()) return status_;
  v1::DeleteJobResponse resp;
  auto ctx = Context();
  return Convert(stub_->DeleteJob(ctx.get(), req, &resp));
}

absl::StatusOr<v1::PlanJobResponse> Client::PlanJob(const v1::JobSpec& spec) {
  v1::PlanJobRequest req;
  *req.mutable_spec() = spec;
  if (!status_.ok()) return status_;
  v1::PlanJobResponse resp;
  auto ctx = Context();
  absl::Status s = Convert(stub_->PlanJob(ctx.get(), req, &resp));
  if (!s.ok()) return s;
  return resp;
}

namespace {

// A stream's heartbeat (job.proto WatchHeartbeat) says the stream is
// alive; it is no row of the job: never shown, and it moves no resume point.
bool IsHeartbeat(const v1::JobEvent& e) { return e.has_heartbeat(); }
bool IsHeartbeat(const v1::LogEntry& l) { return l.has_heartbeat(); }

// The wait before retry `attempt` (0, 1, ...) of a stream the coordinator
// refused for its watch limit: 0.5 s doubling up to 8 s, each a random
// 50-100% of that, so that the clients of one host, all refused at once,
// do not all come back at the same instant (the Python client's backoff).
absl::Duration Backoff(int attempt) {
  thread_local std::mt19937 rng{std::random_device{}()};
  const double full = std::min(8.0, 0.5 * std::pow(2.0, std::min(attempt, 16)));
  return absl::Seconds(full * std::uniform_real_distribution<double>(0.5, 1.0)(rng));
}

// Reads a server stream of indexed rows from `from`; when the stream breaks
// because the coordinator went away (UNAVAILABLE: a restart), opens it
// again from the next index for up to `reconnect_for`, so the caller sees
// every row once, in order. A coordinator never reached is retried for a
// few seconds only (a connect can fail transiently on a loaded machine), so
// that a wrong address still fails fast. A stream the coordinator refused
// for its limit of open streams per client host (RESOURCE_EXHAUSTED,
// --max_watches_per_client) is opened again too, with backoff, for up to
// `reconnect_for`: a place frees as soon as one of that host's streams
// ends, so the refusal is for now, not for good.
template <typename Row, typename OpenFn, typename Convert>
absl::Status ReadResuming(grpc::Channel& channel, int64_t from, absl::Duration reconnect_for,
                          const std::function<void(const absl::Status&)>& on_reconnecting,
                          OpenFn open, const std::function<bool(const Row&)>& on_row,
                          Convert convert) {
  absl::Time broke = absl::InfiniteFuture();
  bool connected = false;
  // The coordinator refused a try (its watch limit): it was reached, so a
  // later break (a restart) is a reconnect, as after `connected`, not a
  // coordinator never reached.
  bool was_refused = false;
  int refusals = 0;  // in a row, for the backoff
  while (true) {
    grpc::ClientContext ctx;
    auto reader = open(&ctx, from);
    // Open once the coordinator says so (proto/streams.h), rows or not: a
    // stream that stays quiet (a pending job, an idle job's logs) resumes
    // after a restart as patiently as a busy one.
    reader->WaitForInitialMetadata();
    if (ctx.GetServerInitialMetadata().count(kStreamOpenMetadata)) {
      broke = absl::InfiniteFuture();
      connected = true;
      refusals = 0;
    }
    Row row;
    while (reader->Read(&row)) {
      broke = absl::InfiniteFuture();
      connected = true;
      refusals = 0;
      if (IsHeartbeat(row)) continue;
      from = row.index() + 1;
      if (!on_row(row)) {
        ctx.TryCancel();
        reader->Finish().ok();
        return absl::OkStatus();
      }
    }
    grpc::Status s = reader->Finish();
    // The coordinator answered: too many streams of this host are open.
    // (Its other RESOURCE_EXHAUSTEDs cannot come here: a stream's request
    // is never near --max_request_bytes, and DoesNotFit is a submit's.)
    const bool refused = s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
    was_refused = was_refused || refused;
    // UNAVAILABLE: the coordinator went away (or says it is shutting down).
    // CANCELLED too, though this client cancels nothing here (its own
    // cancel returned above): a stream opened while the coordinator shuts
    // down is cancelled by the server (gRPC's "CANCELLED"), and the stream
    // it replaced had just ended UNAVAILABLE.
    if (!refused && s.error_code() != grpc::StatusCode::UNAVAILABLE && s.error_code() != grpc::StatusCode::CANCELLED) {
      return convert(s);
    }
    const absl::Time now = absl::Now();
    if (broke == absl::InfiniteFuture()) {
      broke = now;
      // Once per outage, and only once the stream was open (its metadata
      // or rows came) or refused: a coordinator never reached is an error,
      // not a reconnect.
      if ((connected || was_refused) && on_reconnecting) on_reconnecting(convert(s));
    }
    // `broke` dates from the outage's first failure: its patience is the
    // reconnect window once the coordinator was reached (it answered or
    // refused), whatever this failure's code.
    const absl::Duration patience =
        connected || was_refused ? reconnect_for : std::min(reconnect_for, absl::Seconds(3));
    if (now - broke >= patience) return convert(s);
    if (refused) {
      absl::SleepFor(std::min(Backoff(refusals++), broke + patience - now));
    } else {
      PauseBeforeRetry(channel, absl::Milliseconds(250));
    }
  }
}

}  // namespace

absl::Status Client::WatchJob(const std::string& id, int64_t from,
                              const std::function<bool(const v1::JobEvent&)>& on_event, bool per_rank) {
  if (!status_.ok()) return status_;
  return ReadResuming<v1::JobEvent>(
      *channel_, from, reconnect_for_, on_reconnecting_,
      [&](grpc::ClientContext* ctx, int64_t at) {
        v1::WatchJobRequest req;
        req.set_job_id(id);
        req.set_from_index(at);
        req.set_per_rank(per_rank);
        // Skipped below (IsHeartbeat); they keep a proxy from cutting a
        // quiet watch.
        req.set_heartbeats(true);
        return stub_->WatchJob(ctx, req);
      },
      on_event, [this](const grpc::Status& s) { return Convert(s); });
}

absl::Status Client::GetJobLogs(const std::string& id, bool follow, int64_t from,
                                const std::function<bool(const v1::LogEntry&)>& on_line) {
  if (!status_.ok()) return status_;
  return ReadResuming<v1::LogEntry>(
      *channel_, from, reconnect_for_, on_reconnecting_,
      [&](grpc::ClientContext* ctx, int64_t at) {
        v1::GetJobLogsRequest req;
        req.set_job_id(id);
        req.set_follow(follow);
        req.set_from_index(at);
        // Skipped in ReadResuming (IsHeartbeat), as a watch's: they keep a
        // proxy from cutting a quiet follow. (A read without follow gets
        // none.)
        req.set_heartbeats(true);
        return stub_->GetJobLogs(ctx, req);
      },
      on_line, [this](const grpc::Status& s) { return Convert(s); });
}

}  // namespace plateau
