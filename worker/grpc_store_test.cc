// GrpcStore against a fake coordinator: a WorkerService whose KvGet answers
// as the test says and counts the calls.
#include "worker/grpc_store.h"

#include <atomic>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "plateau/v1/worker.grpc.pb.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

// Answers every KvGet NOT_FOUND at once, as the coordinator does while it
// stops, until the `answer_at`-th (0: never), which gets the value.
class FakeCoordinator final : public v1::WorkerService::Service {
 public:
  explicit FakeCoordinator(int answer_at = 0) : answer_at_(answer_at) {}

  grpc::Status KvGet(grpc::ServerContext*, const v1::KvGetRequest* req, v1::KvGetResponse* resp) override {
    const int n = ++gets;
    if (answer_at_ > 0 && n >= answer_at_) {
      resp->set_value(absl::StrCat("value of ", req->key()));
      return grpc::Status::OK;
    }
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "the coordinator is stopping");
  }

  std::atomic<int> gets{0};

 private:
  const int answer_at_;
};

// The fake on a port of the kernel's choosing; `address` is where it is.
std::unique_ptr<grpc::Server> Serve(FakeCoordinator* service, std::string* address) {
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  *address = absl::StrCat("127.0.0.1:", port);
  return server;
}

std::unique_ptr<GrpcStore> Connect(const std::string& address) {
  ConnectionOptions options;
  options.address = address;
  auto store = GrpcStore::Create(options, /*rank=*/0);
  EXPECT_TRUE(store.ok()) << store.status();
  return std::move(store).value();
}

// Before: every NOT_FOUND was followed by the next get at once, thousands
// of calls a second from every waiting rank for its whole timeout.
TEST(GrpcStoreTest, AnImmediateNotFoundIsRetriedAfterAPauseNotAtOnce) {
  FakeCoordinator fake;
  std::string address;
  auto server = Serve(&fake, &address);
  ASSERT_NE(server, nullptr);
  auto store = Connect(address);
  const absl::Duration timeout = absl::Seconds(1);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> v = store->Get("job1/attempt-0/world/0", timeout);
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded) << v.status();
  EXPECT_THAT(std::string(v.status().message()), HasSubstr("'job1/attempt-0/world/0' was not set within 1s"));
  EXPECT_GE(took, timeout);
  EXPECT_LT(took, timeout + absl::Seconds(1));
  // One get per 100 ms at most, and the first and the last.
  EXPECT_LE(fake.gets.load(), timeout / absl::Milliseconds(100) + 2);
  EXPECT_GE(fake.gets.load(), 2);
  server->Shutdown();
}

// The pauses do not stop a key that appears from being read.
TEST(GrpcStoreTest, AKeySetWhileGetsWereAnsweredNotFoundIsRead) {
  FakeCoordinator fake(/*answer_at=*/3);
  std::string address;
  auto server = Serve(&fake, &address);
  ASSERT_NE(server, nullptr);
  auto store = Connect(address);
  absl::StatusOr<std::string> v = store->Get("k", absl::Seconds(10));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "value of k");
  EXPECT_EQ(fake.gets.load(), 3);
  server->Shutdown();
}

}  // namespace
}  // namespace plateau
