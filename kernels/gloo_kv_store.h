// Gloo's rendezvous needs a gloo::rendezvous::Store; this adapter serves one
// from our KeyValueStore (a FileStore, or the coordinator's store), so that
// Gloo and NCCL rendezvous through the same place.
//
// Gloo's Store reports failure by throwing. The adapter throws
// KeyValueStoreError, a gloo::IoException that carries the store's
// absl::Status (e.g. DEADLINE_EXCEEDED naming the missing key), so the
// communicator that catches it can return that status unchanged.
//
// Thread safety: as the KeyValueStore it wraps.
#ifndef PLATEAU_KERNELS_GLOO_KV_STORE_H_
#define PLATEAU_KERNELS_GLOO_KV_STORE_H_

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gloo/common/error.h"
#include "gloo/rendezvous/store.h"
#include "kernels/kv_store.h"

namespace plateau {

class KeyValueStoreError : public gloo::IoException {
 public:
  explicit KeyValueStoreError(absl::Status status)
      : gloo::IoException(std::string(status.message())),
        status_(std::move(status)) {}
  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
};

// One adapter serves one rendezvous, and `timeout` bounds all of it: the
// deadline is set when the adapter is made, and every get() and wait() ends
// by it (a wait with Gloo's own timeout ends by the earlier of the two).
// Gloo's connectFullMesh waits for its peers' keys one at a time, each wait
// with the full timeout; without one deadline, peers that arrive just in
// time for each wait stretched a rendezvous to (P - 1) timeouts, where
// CreateCommunicator promises one.
class GlooStoreAdapter final : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(std::shared_ptr<KeyValueStore> store, absl::Duration timeout)
      : store_(std::move(store)), timeout_(timeout), deadline_(absl::Now() + timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  // Reads `key`, waiting until `deadline` at most (past the adapter's
  // deadline: that one's message).
  std::string Read(const std::string& key, absl::Time deadline);

  std::shared_ptr<KeyValueStore> store_;
  const absl::Duration timeout_;
  const absl::Time deadline_;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_GLOO_KV_STORE_H_
