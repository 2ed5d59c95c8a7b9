#include "worker/grpc_store.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace plateau {
namespace {

// The pause after a get the coordinator answered NOT_FOUND long before the
// wait it was asked for.
constexpr absl::Duration kEarlyNotFoundPause = absl::Milliseconds(200);

absl::Status FromGrpc(const grpc::Status& s, const std::string& what) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

void SetDeadline(grpc::ClientContext& ctx, absl::Duration d) {
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d));
}

// Retries a call while the coordinator is unreachable, up to `budget`.
template <typename Fn>
grpc::Status Retry(grpc::Channel& channel, absl::Duration budget, Fn call) {
  const absl::Time end = absl::Now() + budget;
  while (true) {
    grpc::Status s = call();
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE || absl::Now() > end) return s;
    PauseBeforeRetry(channel, absl::Milliseconds(200));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcStore>> GrpcStore::Create(const ConnectionOptions& coordinator, int rank) {
  if (coordinator.address.empty()) return absl::InvalidArgumentError("coordinator: expected host:port");
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = OpenChannel(coordinator);
  if (!channel.ok()) return channel.status();
  return std::unique_ptr<GrpcStore>(new GrpcStore(coordinator.address, *std::move(channel), rank));
}

absl::Status GrpcStore::Set(const std::string& key, const std::string& value) {
  v1::KvSetRequest req;
  req.set_key(key);
  req.set_value(value);
  if (rank_ >= 0) req.set_rank(rank_);
  grpc::Status s = Retry(*channel_, absl::Seconds(30), [&] {
    grpc::ClientContext ctx;
    SetDeadline(ctx, absl::Seconds(10));
    v1::KvSetResponse resp;
    return stub_->KvSet(&ctx, req, &resp);
  });
  if (!s.ok()) return FromGrpc(s, absl::StrCat("rendezvous store at ", address_, ": set '", key, "'"));
  return absl::OkStatus();
}

absl::StatusOr<std::string> GrpcStore::Get(const std::string& key, absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  std::string unreachable;  // the last UNAVAILABLE: why the key may not have been seen
  while (true) {
    const absl::Duration left = end - absl::Now();
    v1::KvGetRequest req;
    req.set_key(key);
    if (rank_ >= 0) req.set_rank(rank_);
    req.set_wait_ms(std::max<int64_t>(0, std::min(absl::ToInt64Milliseconds(left), int64_t{5000})));
    grpc::ClientContext ctx;
    SetDeadline(ctx, absl::Milliseconds(req.wait_ms()) + absl::Seconds(5));
    v1::KvGetResponse resp;
    const absl::Time sent = absl::Now();
    grpc::Status s = stub_->KvGet(&ctx, req, &resp);
    if (s.ok()) return resp.value();
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
      unreachable = s.error_message();
      PauseBeforeRetry(*channel_, absl::Milliseconds(200));
    } else if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
      // The coordinator holds a get up to wait_ms; a NOT_FOUND well before
      // that (it answers at once while it stops) would otherwise send every
      // waiting rank's gets in a tight loop for the rest of its timeout.
      const absl::Duration held = absl::Now() - sent;
      if (held < absl::Milliseconds(req.wait_ms()) / 2) {
        absl::SleepFor(std::min(kEarlyNotFoundPause, end - absl::Now()));
      }
    } else if (s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      return FromGrpc(s, absl::StrCat("rendezvous store at ", address_, ": get '", key, "'"));
    }
    if (absl::Now() >= end) {
      if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
        return absl::DeadlineExceededError(absl::StrCat("rendezvous store at ", address_, ": key '", key,
                                                        "' could not be read within ", absl::FormatDuration(timeout),
                                                        ": the store was unavailable (", unreachable, ")"));
      }
      return absl::DeadlineExceededError(absl::StrCat("rendezvous store at ", address_, ": key '", key,
                                                      "' was not set within ", absl::FormatDuration(timeout)));
    }
  }
}

absl::StatusOr<bool> GrpcStore::Check(const std::vector<std::string>& keys) {
  v1::KvCheckRequest req;
  for (const std::string& k : keys) req.add_keys(k);
  if (rank_ >= 0) req.set_rank(rank_);
  v1::KvCheckResponse resp;
  grpc::Status s = Retry(*channel_, absl::Seconds(30), [&] {
    grpc::ClientContext ctx;
    SetDeadline(ctx, absl::Seconds(10));
    return stub_->KvCheck(&ctx, req, &resp);
  });
  if (!s.ok()) return FromGrpc(s, absl::StrCat("rendezvous store at ", address_, ": check"));
  return resp.all_set();
}

}  // namespace plateau
