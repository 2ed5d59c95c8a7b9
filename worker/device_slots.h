// Which GPU each rank of a worker gets (issue 17).
//
// An agent started with --devices=N has N rank slots, slot i being the
// agent's i-th visible GPU. A rank is given the lowest slot that no live
// rank of this agent holds (a rank holds its slot until its process has
// exited), so two jobs on one worker never share a GPU, and a job started
// after another finished reuses its GPUs.
//
// A CUDA rank sees exactly one GPU: the agent starts it with
// CUDA_VISIBLE_DEVICES naming that slot's GPU, and --device_index=0. Chosen
// over an explicit device index into the agent's own list because then
// neither the rank's CUDA context nor NCCL can touch (or allocate context
// memory on) another rank's GPU, and NCCL still finds its peers on the node
// by PCI bus id. When the agent itself was started with
// CUDA_VISIBLE_DEVICES (a container, a Kubernetes device plugin), slot i is
// the i-th entry of that list, so the agent's view and its ranks' agree. A
// CPU rank gets its slot as --device_index and no environment change (the
// CPU backend ignores the index).
//
// Pure functions: the agent calls them under its own lock.
#ifndef PLATEAU_WORKER_DEVICE_SLOTS_H_
#define PLATEAU_WORKER_DEVICE_SLOTS_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace plateau {

// `count` slots in [0, slots) not in `in_use`, lowest first.
// RESOURCE_EXHAUSTED (naming the slots taken) when fewer are free.
absl::StatusOr<std::vector<int>> FreeDeviceSlots(int slots, const std::vector<int>& in_use, int count);

// The CUDA_VISIBLE_DEVICES value for a rank on `slot`: the slot-th entry of
// the agent's own CUDA_VISIBLE_DEVICES (`agent_visible`, as read from its
// environment; unset or empty: every GPU, so the slot number itself).
// INVALID_ARGUMENT when the agent's list has no slot-th entry (--devices
// larger than the GPUs it may use).
absl::StatusOr<std::string> RankVisibleDevices(const std::optional<std::string>& agent_visible, int slot);

// `env` ("NAME=value" entries) with CUDA_VISIBLE_DEVICES set to `visible`
// (replaced where present, appended otherwise).
std::vector<std::string> WithVisibleDevices(const std::vector<std::string>& env, const std::string& visible);

// The environment a CUDA rank on `slot` starts with, made from the agent's
// `env` ("NAME=value" entries): CUDA_VISIBLE_DEVICES naming the slot's GPU
// alone (RankVisibleDevices of env's own CUDA_VISIBLE_DEVICES; *visible
// gets it), and CUDA_MODULE_LOADING=EAGER unless env sets it: every kernel
// loaded with the context, from the rank's first CUDA call on
// (kernels/cuda/cuda_backend.cc says why). RankVisibleDevices' error.
absl::StatusOr<std::vector<std::string>> CudaRankEnvironment(const std::vector<std::string>& env, int slot,
                                                             std::string* visible);

// This process's environment ("NAME=value" entries), what the agent's
// children start from.
std::vector<std::string> ProcessEnvironment();

}  // namespace plateau

#endif  // PLATEAU_WORKER_DEVICE_SLOTS_H_
