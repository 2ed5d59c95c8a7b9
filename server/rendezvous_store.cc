#include "server/rendezvous_store.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/status_macros.h"

namespace plateau {

std::string AttemptPrefix(const std::string& job_id, int attempt) {
  return absl::StrCat(job_id, "/attempt-", attempt);
}

absl::Status RendezvousStore::CheckKey(const std::string& key) {
  if (key.empty() || key.size() > kMaxKey) {
    return absl::InvalidArgumentError(absl::StrCat("key: expected 1 to ", kMaxKey, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status RendezvousStore::CheckValue(const std::string& value) {
  if (value.size() > kMaxValue) {
    return absl::InvalidArgumentError(absl::StrCat("value: expected at most ", kMaxValue, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status RendezvousStore::Load() {
  PLATEAU_ASSIGN_OR_RETURN(kv_, store_->KvAll());
  return absl::OkStatus();
}

absl::Status RendezvousStore::Set(const std::string& key, const std::string& value) {
  PLATEAU_RETURN_IF_ERROR(store_->KvPut(key, value));
  kv_[key] = value;
  return absl::OkStatus();
}

RendezvousStore::Usage RendezvousStore::AttemptUsage(const std::string& job_id, int attempt) const {
  const std::string prefix = AttemptPrefix(job_id, attempt) + "/";
  Usage u;
  for (auto it = kv_.lower_bound(prefix); it != kv_.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
    ++u.keys;
    u.bytes += static_cast<int64_t>(it->first.size() + it->second.size());
  }
  return u;
}

absl::StatusOr<std::string> RendezvousStore::Get(absl::Mutex& mu, const std::string& key, absl::Duration wait,
                                                 const bool* stop) {
  auto present = [this, &key, stop]() { return kv_.count(key) > 0 || *stop; };
  mu.AwaitWithTimeout(absl::Condition(&present), std::min(wait, kMaxWait));
  auto it = kv_.find(key);
  if (it == kv_.end()) return absl::NotFoundError(absl::StrCat("key '", key.substr(0, 256), "' is not set"));
  return it->second;
}

bool RendezvousStore::Contains(const std::vector<std::string>& keys) const {
  for (const std::string& k : keys) {
    if (kv_.count(k) == 0) return false;
  }
  return true;
}

namespace {
constexpr absl::string_view kMet = "/.met/";
std::string MetKey(const std::string& job_id, int attempt, std::optional<int> rank) {
  return absl::StrCat(AttemptPrefix(job_id, attempt), kMet, rank.has_value() ? absl::StrCat(*rank) : "any");
}
}  // namespace

bool RendezvousStore::IsOwnKey(const std::string& key) {
  // job-N/attempt-A/.met/...: the third part starts with ".met/".
  const size_t first = key.find('/');
  const size_t second = first == std::string::npos ? first : key.find('/', first + 1);
  return second != std::string::npos && absl::string_view(key).substr(second, kMet.size()) == kMet;
}

bool RendezvousStore::Met(const std::string& job_id, int attempt, std::optional<int> rank) const {
  return kv_.count(MetKey(job_id, attempt, rank)) > 0;
}

absl::Status RendezvousStore::MarkMet(const std::string& job_id, int attempt, std::optional<int> rank) {
  if (Met(job_id, attempt, rank)) return absl::OkStatus();
  return Set(MetKey(job_id, attempt, rank), "");
}

bool RendezvousStore::AnyMet(const std::string& job_id, int attempt, const std::vector<int>& ranks) const {
  if (Met(job_id, attempt, std::nullopt)) return true;
  for (int r : ranks) {
    if (Met(job_id, attempt, r)) return true;
  }
  // Keys without any mark: written before the coordinator kept them.
  const std::string prefix = AttemptPrefix(job_id, attempt) + "/";
  const std::string marks = AttemptPrefix(job_id, attempt) + std::string(kMet);
  auto it = kv_.lower_bound(prefix);
  const bool any_key = it != kv_.end() && absl::StartsWith(it->first, prefix);
  auto mark = kv_.lower_bound(marks);
  const bool any_mark = mark != kv_.end() && absl::StartsWith(mark->first, marks);
  return any_key && !any_mark;
}

absl::Status RendezvousStore::DeleteAttempt(const std::string& job_id, int attempt) {
  // The trailing slash keeps job-1/attempt-1 from matching job-1/attempt-10.
  return DeletePrefix(AttemptPrefix(job_id, attempt) + "/");
}

absl::Status RendezvousStore::DeleteJob(const std::string& job_id) {
  return DeletePrefix(job_id + "/");  // job-1/ never matches job-10/
}

absl::Status RendezvousStore::DeletePrefix(const std::string& prefix) {
  absl::Status s = store_->KvDeletePrefix(prefix);
  for (auto it = kv_.lower_bound(prefix); it != kv_.end() && absl::StartsWith(it->first, prefix);) {
    it = kv_.erase(it);
  }
  return s;
}

}  // namespace plateau
