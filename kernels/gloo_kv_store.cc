#include "kernels/gloo_kv_store.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace plateau {

void GlooStoreAdapter::set(const std::string& key,
                           const std::vector<char>& data) {
  absl::Status s = store_->Set(key, std::string(data.begin(), data.end()));
  if (!s.ok()) throw KeyValueStoreError(std::move(s));
}

std::string GlooStoreAdapter::Read(const std::string& key, absl::Time deadline) {
  const absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
  absl::StatusOr<std::string> v = store_->Get(key, left);
  if (v.ok()) return *std::move(v);
  absl::Status s = v.status();
  if (absl::IsDeadlineExceeded(s) && deadline >= deadline_) {
    // The store's message counts only this wait's share of the time.
    s = absl::DeadlineExceededError(
        absl::StrCat(s.message(), " (the rendezvous's ", absl::FormatDuration(timeout_), " ran out waiting for it)"));
  }
  throw KeyValueStoreError(std::move(s));
}

std::vector<char> GlooStoreAdapter::get(const std::string& key) {
  const std::string v = Read(key, deadline_);
  return std::vector<char>(v.begin(), v.end());
}

void GlooStoreAdapter::wait(const std::vector<std::string>& keys) {
  for (const std::string& key : keys) Read(key, deadline_);
}

void GlooStoreAdapter::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  // Gloo passes zero for "no timeout"; ours is never unbounded.
  const absl::Time deadline =
      timeout.count() > 0 ? std::min(deadline_, absl::Now() + absl::FromChrono(timeout)) : deadline_;
  for (const std::string& key : keys) Read(key, deadline);
}

}  // namespace plateau
