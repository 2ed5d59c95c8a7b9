// The rendezvous key-value store: how the ranks of a job find each other
// (Gloo pair addresses, the NCCL unique id) before any connection exists.
//
// The interface is deliberately small so that the coordinator can serve it
// over gRPC later; FileStore is the implementation for one machine (or a
// shared file system): one file per key in a directory, published by an
// atomic rename so that a reader never sees half a value, from any process.
//
// Values are written once per key in practice; a second Set replaces the
// value atomically. Keys are arbitrary strings (a job attempt namespaces its
// keys with a prefix, e.g. "job7/attempt2/world/...").
//
// Thread safety: every method may be called from any thread and any process
// at once.
#ifndef PLATEAU_KERNELS_KV_STORE_H_
#define PLATEAU_KERNELS_KV_STORE_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace plateau {

class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;

  // Publishes `value` under `key` (replacing any previous value).
  virtual absl::Status Set(const std::string& key,
                           const std::string& value) = 0;

  // Returns the value of `key`, waiting up to `timeout` for it to be set.
  // DEADLINE_EXCEEDED names the key when it did not appear in time.
  virtual absl::StatusOr<std::string> Get(const std::string& key,
                                          absl::Duration timeout) = 0;

  // True when every key in `keys` is set now; never waits.
  virtual absl::StatusOr<bool> Check(const std::vector<std::string>& keys) = 0;
};

// One file per key in `directory`. File names are the keys escaped
// (characters outside [A-Za-z0-9._-] become %XX; over-long names end in a
// hash), so any key is safe and two keys never share a file.
class FileStore final : public KeyValueStore {
 public:
  // Creates `directory` (and its parents) when missing.
  static absl::StatusOr<std::unique_ptr<FileStore>> Create(
      const std::string& directory);

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override;
  absl::StatusOr<bool> Check(const std::vector<std::string>& keys) override;

  const std::string& directory() const { return directory_; }
  // The file that holds `key` (exposed for tests and debugging).
  std::string PathOf(const std::string& key) const;

  // Tests: where Set takes the names of its temporaries (file names in the
  // directory) instead of TemporaryName().
  void SetTemporaryNamesForTesting(std::function<std::string()> next) { temporary_names_ = std::move(next); }

  // A fresh temporary's file name: "t_<host>_<pid>_<64 random bits>_<n>".
  // Writers on several hosts share the directory on a shared file system,
  // where pids and counters repeat; the host and the random bits keep their
  // names apart (and Set takes another name if one is taken all the same).
  static std::string TemporaryName();

 private:
  explicit FileStore(std::string directory)
      : directory_(std::move(directory)) {}
  // The value of `key`, or NOT_FOUND when it is not set yet.
  absl::StatusOr<std::string> TryRead(const std::string& key) const;

  const std::string directory_;
  std::function<std::string()> temporary_names_ = TemporaryName;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_KV_STORE_H_
