#include "kernels/testing/local_world.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/kv_store.h"

namespace plateau {

std::string FreshStoreDir(const std::string& tag) {
  static std::atomic<int> counter{0};
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/plateau-world-", getpid(), "-", tag, "-",
                      counter.fetch_add(1));
}

absl::Status RunLocalWorld(
    int ranks, int64_t device_bytes, const std::string& dir,
    const std::function<absl::Status(int, Backend&, Communicator&)>& fn) {
  BackendOptions bo;
  bo.device_memory_bytes = device_bytes;
  return RunLocalWorld(ranks, bo, dir, fn);
}

BackendOptions LocalWorldBackend(BackendKind kind, int64_t device_bytes) {
  BackendOptions bo;
  bo.kind = kind;
  bo.device_memory_bytes = device_bytes;
  return bo;
}

absl::Status RunLocalWorld(
    int ranks, const BackendOptions& backend_options, const std::string& dir,
    const std::function<absl::Status(int, Backend&, Communicator&)>& fn) {
  auto store = FileStore::Create(dir);
  if (!store.ok()) return store.status();
  std::shared_ptr<KeyValueStore> shared = std::move(*store);
  std::vector<absl::Status> status(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      BackendOptions bo = backend_options;
      if (bo.kind == BackendKind::kCuda) bo.device_index += r;
      auto backend = Backend::Create(bo);
      if (!backend.ok()) {
        status[r] = backend.status();
        return;
      }
      CommunicatorOptions co;
      co.backend = bo.kind;
      co.device_index = bo.device_index;
      co.rank = r;
      co.size = ranks;
      co.store = shared;
      co.prefix = "local";
      co.timeout = absl::Seconds(60);
      auto world = CreateCommunicator(co);
      if (!world.ok()) {
        status[r] = world.status();
        return;
      }
      status[r] = fn(r, **backend, **world);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) {
    if (!status[r].ok()) {
      return absl::Status(status[r].code(), absl::StrCat("rank ", r, ": ", status[r].message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace plateau
