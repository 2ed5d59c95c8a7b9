#include "kernels/gloo_kv_store.h"

#include <algorithm>
#include <utility>

namespace plateau {

void GlooStoreAdapter::set(const std::string& key,
                           const std::vector<char>& data) {
  absl::Status s = store_->Set(key, std::string(data.begin(), data.end()));
  if (!s.ok()) throw KeyValueStoreError(std::move(s));
}

std::vector<char> GlooStoreAdapter::get(const std::string& key) {
  absl::StatusOr<std::string> v = store_->Get(key, timeout_);
  if (!v.ok()) throw KeyValueStoreError(v.status());
  return std::vector<char>(v->begin(), v->end());
}

void GlooStoreAdapter::wait(const std::vector<std::string>& keys) {
  wait(keys, std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
}

void GlooStoreAdapter::wait(const std::vector<std::string>& keys,
                            const std::chrono::milliseconds& timeout) {
  // One deadline for all keys: waiting for them in turn with the time left.
  // Gloo passes zero for "no timeout"; ours is never unbounded.
  const absl::Duration bound =
      timeout.count() > 0 ? absl::FromChrono(timeout) : timeout_;
  const absl::Time deadline = absl::Now() + bound;
  for (const std::string& key : keys) {
    absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
    absl::StatusOr<std::string> v = store_->Get(key, left);
    if (!v.ok()) throw KeyValueStoreError(v.status());
  }
}

}  // namespace plateau
