// The sticky-error registry alone (plain C++, no GPU): the first error of a
// stream wins, streams are independent, a forgotten handle starts clean, and
// concurrent failures keep exactly one first error.
#include "kernels/cuda/stream_errors.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

TEST(StreamErrorsTest, FirstErrorWinsAndStreamsAreIndependent) {
  int a = 0, b = 0;  // stand-ins for two cudaStream_t handles
  EXPECT_TRUE(CudaStreamError(&a).ok());
  EXPECT_EQ(FailCudaStream(&a, absl::DeadlineExceededError("first")).message(),
            "first");
  absl::Status held = FailCudaStream(&a, absl::InternalError("second"));
  EXPECT_EQ(held.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(CudaStreamError(&a).message(), "first");
  EXPECT_TRUE(CudaStreamError(&b).ok());
  EXPECT_TRUE(FailCudaStream(&b, absl::OkStatus()).ok());  // OK is no error
  EXPECT_TRUE(CudaStreamError(&b).ok());
  ForgetCudaStream(&a);
  EXPECT_TRUE(CudaStreamError(&a).ok());
}

TEST(StreamErrorsTest, ConcurrentFailuresKeepOneFirstError) {
  int s = 0;
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&s, i] {
      (void)FailCudaStream(&s, absl::AbortedError(absl::StrCat("thread ", i)));
    });
  }
  for (auto& t : threads) t.join();
  const absl::Status first = CudaStreamError(&s);
  EXPECT_EQ(first.code(), absl::StatusCode::kAborted);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(CudaStreamError(&s), first);
  ForgetCudaStream(&s);
}

}  // namespace
}  // namespace plateau
