#include "server/rpc_metrics.h"

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace plateau {
namespace {

const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    default: return "UNKNOWN";
  }
}

class RpcMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcMetricsInterceptor(Metrics* metrics, std::atomic<int64_t>* in_flight, std::string method)
      : metrics_(metrics), in_flight_(in_flight), method_(std::move(method)), start_(absl::Now()) {
    in_flight_->fetch_add(1);
  }
  ~RpcMetricsInterceptor() override { in_flight_->fetch_sub(1); }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const auto [service, method] = SplitRpcMethod(method_);
      metrics_->OnRpc(service, method, CodeName(methods->GetSendStatus().error_code()),
                      absl::ToDoubleSeconds(absl::Now() - start_));
    }
    methods->Proceed();
  }

 private:
  Metrics* const metrics_;
  std::atomic<int64_t>* const in_flight_;
  const std::string method_;
  const absl::Time start_;
};

}  // namespace

std::pair<std::string, std::string> SplitRpcMethod(const std::string& full) {
  if (full.size() > 1 && full[0] == '/') {
    const size_t slash = full.find('/', 1);
    if (slash != std::string::npos) return {full.substr(1, slash - 1), full.substr(slash + 1)};
  }
  return {"", full};
}

grpc::experimental::Interceptor* RpcMetricsFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new RpcMetricsInterceptor(metrics_, &in_flight_, info->method() != nullptr ? info->method() : "");
}

}  // namespace plateau
