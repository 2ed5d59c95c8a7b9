// Uniformly random token and target ids for each rank of a local world: the
// inputs of the step tests and benchmarks that need some batch of the
// model's shape, not a particular one.
#ifndef PLATEAU_KERNELS_TESTING_RANDOM_TOKENS_H_
#define PLATEAU_KERNELS_TESTING_RANDOM_TOKENS_H_

#include <cstdint>
#include <random>
#include <vector>

namespace plateau {

struct RankBatches {
  std::vector<std::vector<int32_t>> tokens, targets;  // [rank][position]
};

// `tokens_per_rank` ids below `vocab` for each of `ranks`, drawn from one
// mt19937_64 seeded `seed`: rank by rank, a token then its target.
inline RankBatches UniformRankBatches(int ranks, int64_t tokens_per_rank, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  RankBatches b;
  b.tokens.resize(ranks);
  b.targets.resize(ranks);
  for (int r = 0; r < ranks; ++r) {
    for (int64_t i = 0; i < tokens_per_rank; ++i) {
      b.tokens[r].push_back(static_cast<int32_t>(rng() % vocab));
      b.targets[r].push_back(static_cast<int32_t>(rng() % vocab));
    }
  }
  return b;
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_TESTING_RANDOM_TOKENS_H_
