// The rendezvous KeyValueStore (kernels/kv_store.h) served by the
// coordinator over WorkerService's KvSet/KvGet/KvCheck: how the ranks of a
// job on any number of nodes find each other (Gloo's store, NCCL's unique
// id). Get long-polls the coordinator in slices of a few seconds up to the
// caller's timeout; a coordinator that is briefly unreachable is retried
// until then, and one that answers NOT_FOUND at once (as it does while it
// stops) is asked again after a pause, not in a tight loop. The channel is client/connection.h's: TLS and the bearer
// token when the coordinator asks for them (UNAUTHENTICATED is not retried).
//
// Thread safety: every method may be called from any thread at once.
#ifndef PLATEAU_WORKER_GRPC_STORE_H_
#define PLATEAU_WORKER_GRPC_STORE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/connection.h"
#include "grpcpp/grpcpp.h"
#include "kernels/kv_store.h"
#include "plateau/v1/worker.grpc.pb.h"

namespace plateau {

class GrpcStore final : public KeyValueStore {
 public:
  // `coordinator.address` is the coordinator's "host:port"; an unreadable
  // token or CA file is INVALID_ARGUMENT naming the flag. `rank` (>= 0):
  // the attempt's rank using it, sent with each call (KvSetRequest.rank);
  // -1: none.
  static absl::StatusOr<std::unique_ptr<GrpcStore>> Create(const ConnectionOptions& coordinator, int rank = -1);

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override;
  absl::StatusOr<bool> Check(const std::vector<std::string>& keys) override;

 private:
  GrpcStore(std::string address, std::shared_ptr<grpc::Channel> channel, int rank)
      : address_(std::move(address)),
        channel_(std::move(channel)),
        stub_(v1::WorkerService::NewStub(channel_)),
        rank_(rank) {}
  const std::string address_;
  const std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::WorkerService::Stub> stub_;
  const int rank_;
};

}  // namespace plateau

#endif  // PLATEAU_WORKER_GRPC_STORE_H_
