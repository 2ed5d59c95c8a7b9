// One optimizer step of a step configuration on a local world whose device
// and host are capped: whether the plan's caps really hold the step (the
// N_max and auto-settings tests run a fitting configuration and one just
// past it).
#ifndef PLATEAU_KERNELS_STEP_CAPPED_STEP_TESTING_H_
#define PLATEAU_KERNELS_STEP_CAPPED_STEP_TESTING_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/model/config.h"
#include "kernels/step/step.h"
#include "kernels/testing/local_world.h"
#include "kernels/testing/random_tokens.h"

namespace plateau {

// Uniformly random tokens (seeded `seed`) on `ranks` rank threads, each with
// a device of `device_bytes` and a host of `host_bytes` (0: uncapped); the
// first rank's error, or OK. `tag` names the rendezvous directory.
inline absl::Status RunOneStepUnderCaps(const StepOptions& o, int ranks, int64_t device_bytes, int64_t host_bytes,
                                        uint64_t seed, const std::string& tag) {
  const RankBatches in = UniformRankBatches(ranks, TokensPerRank(o.model, o.layout), o.model.vocab_size, seed);
  BackendOptions bo;
  bo.device_memory_bytes = device_bytes;
  bo.host_memory_bytes = host_bytes;
  return RunLocalWorld(ranks, bo, FreshStoreDir(tag), [&](int r, Backend& be, Communicator& world) {
    auto step = TrainingStep::Create(o, be, world);
    if (!step.ok()) return step.status();
    return (*step)->Step(in.tokens[r], in.targets[r]).status();
  });
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_STEP_CAPPED_STEP_TESTING_H_
