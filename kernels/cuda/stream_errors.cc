#include "kernels/cuda/stream_errors.h"

#include <atomic>
#include <map>

#include "absl/synchronization/mutex.h"

namespace plateau {
namespace {

struct Registry {
  absl::Mutex mu;
  std::map<const void*, absl::Status> errors ABSL_GUARDED_BY(mu);
  // errors.size(), readable without the lock: every enqueue asks, and almost
  // always no stream has failed.
  std::atomic<int> failed{0};
};

Registry& Get() {
  // Never destroyed: a stream destroyed during static destruction still
  // calls ForgetCudaStream.
  static Registry* registry = new Registry();
  return *registry;
}

}  // namespace

absl::Status FailCudaStream(const void* stream, const absl::Status& error) {
  if (error.ok()) return CudaStreamError(stream);
  Registry& r = Get();
  absl::MutexLock lock(&r.mu);
  auto [it, inserted] = r.errors.try_emplace(stream, error);
  if (inserted) r.failed.store(static_cast<int>(r.errors.size()),
                               std::memory_order_release);
  return it->second;
}

absl::Status CudaStreamError(const void* stream) {
  Registry& r = Get();
  if (r.failed.load(std::memory_order_acquire) == 0) return absl::OkStatus();
  absl::MutexLock lock(&r.mu);
  auto it = r.errors.find(stream);
  return it == r.errors.end() ? absl::OkStatus() : it->second;
}

void ForgetCudaStream(const void* stream) {
  Registry& r = Get();
  absl::MutexLock lock(&r.mu);
  r.errors.erase(stream);
  r.failed.store(static_cast<int>(r.errors.size()), std::memory_order_release);
}

}  // namespace plateau
