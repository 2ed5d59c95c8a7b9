// The rendezvous key-value store the ranks of an attempt meet through (Gloo's
// store, NCCL's unique id; worker/grpc_store.h is the client). Keys live under
// "job-N/attempt-A/" (AttemptPrefix), are written through to the JobStore so
// that ranks meeting across a coordinator restart still find each other, and
// are deleted, in memory and in the store, when the attempt ends.
//
// Thread safety: not synchronized by itself. It is guarded by the mutex of
// its owner (the Coordinator's mu_), which every call must hold; Get releases
// that mutex while it waits, so a Set from another thread wakes it. Ownership:
// the JobStore is borrowed and must outlive this object.
#ifndef PLATEAU_SERVER_RENDEZVOUS_STORE_H_
#define PLATEAU_SERVER_RENDEZVOUS_STORE_H_

#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/job_store.h"

namespace plateau {

// The namespace of an attempt's keys: "job-N/attempt-A" (sent to the ranks
// as Assignment.kv_prefix; its keys are under "job-N/attempt-A/").
std::string AttemptPrefix(const std::string& job_id, int attempt);

class RendezvousStore {
 public:
  static constexpr size_t kMaxKey = 4096;
  static constexpr size_t kMaxValue = 1 << 20;
  // The longest a Get waits, whatever it asks: a long poll, not a hang.
  static constexpr absl::Duration kMaxWait = absl::Seconds(10);

  explicit RendezvousStore(JobStore* store) : store_(store) {}
  RendezvousStore(const RendezvousStore&) = delete;
  RendezvousStore& operator=(const RendezvousStore&) = delete;

  // INVALID_ARGUMENT naming `key` or `value` when out of bounds; needs no lock.
  static absl::Status CheckKey(const std::string& key);
  static absl::Status CheckValue(const std::string& value);

  // Replaces the keys in memory with those in the store (a restart).
  absl::Status Load();
  // Writes the key to the store, then to memory: a failed write changes
  // nothing here and is returned (the owner decides what it means).
  absl::Status Set(const std::string& key, const std::string& value);
  // The key's value; waits on `mu` (held by the caller, released while
  // waiting) up to min(wait, kMaxWait) for a Set, or until *stop becomes true.
  // NOT_FOUND naming the key when it is still unset.
  absl::StatusOr<std::string> Get(absl::Mutex& mu, const std::string& key, absl::Duration wait,
                                  const bool* stop) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Whether every key is set.
  bool Contains(const std::vector<std::string>& keys) const;
  // Records that `rank` of the attempt (nullopt: a rank not named) has
  // begun to meet (written or read a key), as a key of the store's own under
  // the attempt's prefix (".met/RANK", ".met/any"): it survives a restart
  // and leaves with the attempt. Written once per rank.
  absl::Status MarkMet(const std::string& job_id, int attempt, std::optional<int> rank);
  // Whether `rank` (nullopt: a rank not named) is marked as having met.
  bool Met(const std::string& job_id, int attempt, std::optional<int> rank) const;
  // Whether one of `ranks` of the attempt, or a rank not named, has begun to
  // meet. An attempt with keys and no mark at all (written by a coordinator
  // before the marks) counts as met by every rank.
  bool AnyMet(const std::string& job_id, int attempt, const std::vector<int>& ranks) const;
  // Whether `key` is under an attempt's ".met/" (the store's own).
  static bool IsOwnKey(const std::string& key);
  // What the attempt's keys hold now, AttemptPrefix(job_id, attempt) + "/"
  // and below, the store's own marks included.
  struct Usage {
    int64_t keys = 0;
    int64_t bytes = 0;  // keys and values
  };
  Usage AttemptUsage(const std::string& job_id, int attempt) const;
  // Forgets every key under AttemptPrefix(job_id, attempt) + "/" (the
  // attempt has ended; its keys are of no further use). Memory forgets them
  // even when the store's delete fails; that failure is returned.
  absl::Status DeleteAttempt(const std::string& job_id, int attempt);
  // The same for every attempt of the job (job_id + "/"): a job whose
  // attempt is not known (a record replaced at a restart) or deleted.
  absl::Status DeleteJob(const std::string& job_id);

  size_t size() const { return kv_.size(); }

 private:
  absl::Status DeletePrefix(const std::string& prefix);

  JobStore* const store_;
  std::map<std::string, std::string> kv_;
};

}  // namespace plateau

#endif  // PLATEAU_SERVER_RENDEZVOUS_STORE_H_
