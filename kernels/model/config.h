// The model's configuration and the parallel layout, as defined in
// docs/MODEL.md, with the validation that refuses an inconsistent spec before
// anything is allocated.
#ifndef PLATEAU_KERNELS_MODEL_CONFIG_H_
#define PLATEAU_KERNELS_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace plateau {

inline constexpr int32_t kIgnoreIndex = -1;

struct ModelConfig {
  int64_t vocab_size = 256;
  int64_t hidden = 128;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  int64_t experts = 4;
  int64_t top_k = 2;
  int64_t expert_ffn = 256;
  int64_t seq_len = 256;
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  float init_std = 0.02f;

  int64_t head_dim() const { return hidden / heads; }
};

// How the global batch and the weights are laid out over P ranks.
struct LayoutConfig {
  int64_t ranks = 1;       // P
  int64_t batch = 1;       // B sequences in the global batch
};

// One weight tensor of the model: its checkpoint name and shape.
struct WeightSpec {
  std::string name;
  std::vector<int64_t> shape;
  float init_std = 0.0f;  // 0: initialised to ones (norm weights)
  bool expert = false;    // lives on its owner rank, not ZeRO-sharded

  int64_t numel() const;
};

// Every field checked; the error names the field and what was expected.
absl::Status ValidateModelConfig(const ModelConfig& m);
absl::Status ValidateLayout(const ModelConfig& m, const LayoutConfig& l);

// The weights in checkpoint order, with the shapes of docs/MODEL.md.
std::vector<WeightSpec> ModelWeights(const ModelConfig& m);

// Θ (all parameters) and the parameters active for one token (k experts).
int64_t ParameterCount(const ModelConfig& m);
int64_t ActiveParameterCount(const ModelConfig& m);

// Tokens per rank: N = B * T / P.
int64_t TokensPerRank(const ModelConfig& m, const LayoutConfig& l);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_CONFIG_H_
