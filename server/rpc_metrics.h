// A gRPC server interceptor that counts every call the coordinator serves
// and times it (Metrics::OnRpc: plateau_rpcs_total{service,method,code},
// plateau_rpc_duration_seconds{service,method}). An interceptor rather than
// a line in each handler: a handler added later is counted without anyone
// remembering to, and a call refused before its handler runs (a missing
// token, a request over the size limit) is counted too. It also knows how
// many calls are in flight, for a shutdown that need not wait out its grace
// (coordinator_main.cc).
//
// Thread safety: gRPC creates one interceptor per call; the factory and
// Metrics are shared and thread-safe.
#ifndef PLATEAU_SERVER_RPC_METRICS_H_
#define PLATEAU_SERVER_RPC_METRICS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "grpcpp/support/server_interceptor.h"
#include "server/metrics.h"

namespace plateau {

// "/plateau.v1.JobService/SubmitJob" -> {"plateau.v1.JobService", "SubmitJob"};
// anything else -> {"", the whole name}.
std::pair<std::string, std::string> SplitRpcMethod(const std::string& full);

class RpcMetricsFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcMetricsFactory(Metrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override;

  // Calls begun and not yet ended (their interceptor is destroyed once the
  // call is done, after its status was sent).
  int64_t in_flight() const { return in_flight_.load(); }

 private:
  Metrics* const metrics_;
  std::atomic<int64_t> in_flight_{0};
};

}  // namespace plateau

#endif  // PLATEAU_SERVER_RPC_METRICS_H_
