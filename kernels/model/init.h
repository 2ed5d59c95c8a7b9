// Deterministic, counter-based weight initialisation (docs/MODEL.md,
// "Initialisation"). Element i of a weight is a pure function of (seed,
// weight name, i), so a rank can generate just its shard, and the result does
// not depend on the number of ranks or the order of generation.
#ifndef PLATEAU_KERNELS_MODEL_INIT_H_
#define PLATEAU_KERNELS_MODEL_INIT_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace plateau {

// splitmix64 finaliser: a bijective 64-bit mix.
uint64_t Mix64(uint64_t x);

// FNV-1a of the name, mixed with the seed.
uint64_t WeightKey(uint64_t seed, absl::string_view name);

// A standard normal sample for element `index` of the weight with `key`
// (Box-Muller on two 53-bit uniforms from Mix64(key + 2*index + {0,1})),
// in double.
double StandardNormal(uint64_t key, int64_t index);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_INIT_H_
