#include "server/worker_registry.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "proto/utf8.h"

namespace plateau {
namespace {

// A worker's name and rank address at most.
constexpr size_t kMaxWorkerText = 1024;
// An id asked for is kept only below this number: "worker-9223372036854775806"
// made the next id's increment overflow.
constexpr int64_t kMaxWorkerNumber = int64_t{1} << 53;

}  // namespace

absl::Status WorkerRegistry::CheckCapabilities(const v1::WorkerCapabilities& c) {
  if (c.backend() != v1::BACKEND_CPU && c.backend() != v1::BACKEND_CUDA) {
    return absl::InvalidArgumentError("capabilities.backend: expected BACKEND_CPU or BACKEND_CUDA");
  }
  if (c.devices() < 1 || c.devices() > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("capabilities.devices: expected 1 to 4096, got ", c.devices()));
  }
  if (c.device_memory_bytes() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("capabilities.device_memory_bytes: expected >= 0, got ", c.device_memory_bytes()));
  }
  if (c.host_memory_bytes() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("capabilities.host_memory_bytes: expected >= 0, got ", c.host_memory_bytes()));
  }
  if (c.rank_address().empty()) {
    return absl::InvalidArgumentError("capabilities.rank_address: expected the address ranks listen on");
  }
  // Both are printed in the coordinator's log and by `plateauctl workers`:
  // a newline forged log lines, an escape sequence rewrote the terminal.
  for (const auto& [field, text] : {std::pair<const char*, const std::string&>{"capabilities.name", c.name()},
                                    {"capabilities.rank_address", c.rank_address()}}) {
    if (text.size() > kMaxWorkerText) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": expected at most ", kMaxWorkerText, " bytes, got ", text.size()));
    }
    if (const size_t at = FirstControlCharacter(text); at < text.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": expected printable text, got a control character at byte ", at));
    }
  }
  return absl::OkStatus();
}

Worker& WorkerRegistry::Attach(const std::string& asked, const v1::WorkerCapabilities& caps, absl::Time now,
                               bool* expected, bool* restarted) {
  std::string id;
  int64_t n = 0;
  auto it = workers_.find(asked);
  // The same agent restarted: an id alone could be a copied work dir on
  // another node, so its name and rank address must match too.
  const bool same_agent = it != workers_.end() && it->second.attached && !asked.empty() &&
                          it->second.caps.name() == caps.name() &&
                          it->second.caps.rank_address() == caps.rank_address();
  if (restarted != nullptr) *restarted = same_agent;
  if (same_agent) {
    Worker& w = it->second;
    *expected = true;
    w.used_devices = 0;
    w.leaving = false;
    w.assignments.clear();
    w.unacknowledged.clear();
    w.cancellations.clear();
    w.caps = caps;
    w.registered = now;
    Beat(w, now);
    return w;
  }
  if (it != workers_.end() && !it->second.attached) {
    id = asked;
  } else if (it == workers_.end() && absl::StartsWith(asked, "worker-") &&
             absl::SimpleAtoi(absl::StripPrefix(asked, "worker-"), &n) && n > 0 && n < kMaxWorkerNumber) {
    id = asked;
    next_worker_ = std::max(next_worker_, n + 1);
  } else {
    id = absl::StrCat("worker-", next_worker_++);
  }
  Worker& w = workers_[id];
  *expected = !w.id.empty() && !w.attached;
  w.id = id;
  w.attached = true;
  w.leaving = false;
  w.caps = caps;
  w.registered = now;
  Beat(w, now);
  return w;
}

Worker& WorkerRegistry::Expect(const std::string& id, absl::Time now) {
  Worker& w = workers_[id];
  if (w.id.empty()) {
    w.id = id;
    w.attached = false;
    w.last_heartbeat = now;
    w.expires = now + reattach_timeout_;
    // Ids are never handed out twice: a new worker gets a higher number.
    int64_t n = 0;
    if (absl::SimpleAtoi(absl::StripPrefix(w.id, "worker-"), &n) && n > 0 && n < kMaxWorkerNumber) {
      next_worker_ = std::max(next_worker_, n + 1);
    }
  }
  return w;
}

void WorkerRegistry::Beat(Worker& w, absl::Time now) {
  w.last_heartbeat = now;
  w.expires = now + worker_timeout_;
}

Worker* WorkerRegistry::Find(const std::string& id) {
  auto it = workers_.find(id);
  return it == workers_.end() ? nullptr : &it->second;
}

Worker* WorkerRegistry::FindAttached(const std::string& id) {
  Worker* w = Find(id);
  return w != nullptr && w->attached ? w : nullptr;
}

std::vector<WorkerSlots> WorkerRegistry::Slots() const {
  std::vector<WorkerSlots> slots;
  for (const auto& [id, w] : workers_) {
    if (w.attached && !w.leaving) slots.push_back({id, w.caps, w.caps.devices() - w.used_devices});
  }
  return slots;
}

std::vector<std::string> WorkerRegistry::Expired(absl::Time now) const {
  std::vector<std::string> lost;
  for (const auto& [id, w] : workers_) {
    if (now > w.expires) lost.push_back(id);
  }
  return lost;
}

std::string WorkerRegistry::Remove(const std::string& id, absl::Time now) {
  auto it = workers_.find(id);
  if (it == workers_.end()) return "";
  const Worker& w = it->second;
  const std::string silent = absl::StrFormat("%.1f", absl::ToDoubleSeconds(now - w.last_heartbeat));
  std::string why = w.leaving    ? absl::StrCat("left (its agent shut down; last heartbeat ", silent, " s ago)")
                    : w.attached ? absl::StrCat("sent no heartbeat for ", silent, " s")
                                 : absl::StrCat("did not register again within ",
                                                absl::FormatDuration(reattach_timeout_), " of the coordinator's restart");
  workers_.erase(it);
  return why;
}

}  // namespace plateau
