// The small MoE model the step's tests run: 2 layers, hidden 16, 4 heads /
// 2 KV heads, 4 experts top-2 with FFN 24, vocabulary 32, sequences of 16,
// init σ 0.3 (strong enough that routing and attention matter). Tests that
// need another size change a field of it.
#ifndef PLATEAU_KERNELS_TESTING_TINY_MODEL_H_
#define PLATEAU_KERNELS_TESTING_TINY_MODEL_H_

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/model/config.h"

namespace plateau {

inline ModelConfig TinyModel() {
  ModelConfig m;
  m.vocab_size = 32;
  m.hidden = 16;
  m.layers = 2;
  m.heads = 4;
  m.kv_heads = 2;
  m.experts = 4;
  m.top_k = 2;
  m.expert_ffn = 24;
  m.seq_len = 16;
  m.init_std = 0.3f;
  return m;
}

// A global batch of B sequences of m.seq_len random tokens and targets,
// every fifth target (i % 5 == 2) kIgnoreIndex; the same for a seed
// everywhere (the step tests compare runs of one batch across backends,
// precisions and rank counts). Rank p's part is RankSlice (rank_slice.h).
struct GlobalBatch {
  std::vector<int32_t> tokens, targets;  // [B, T]
};

inline GlobalBatch MakeBatch(const ModelConfig& m, int64_t B, uint64_t seed) {
  std::mt19937_64 rng(seed);
  GlobalBatch g;
  for (int64_t i = 0; i < B * m.seq_len; ++i) {
    g.tokens.push_back(static_cast<int32_t>(rng() % m.vocab_size));
    g.targets.push_back(i % 5 == 2 ? kIgnoreIndex : static_cast<int32_t>(rng() % m.vocab_size));
  }
  return g;
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_TESTING_TINY_MODEL_H_
