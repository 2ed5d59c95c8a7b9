// Where every parameter lives over P ranks (docs/MODEL.md, parallel layout).
//
// Dense weights (everything but the experts) are concatenated in
// ModelWeights() order into one flat vector of D values, padded to a
// multiple of P: rank p owns the shard [p*S, (p+1)*S), S = ceil(D/P), with
// its master copy and AdamW state; the working weights are the all-gathered
// flat vector. Expert weights live on their owner: rank p holds experts
// [p*E_p, (p+1)*E_p) of every layer, E_p = E/P, packed per layer as
// w_gate [E_p, H, F], w_up [E_p, H, F], w_down [E_p, F, H].
#ifndef PLATEAU_KERNELS_MODEL_PARAMS_H_
#define PLATEAU_KERNELS_MODEL_PARAMS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/model/config.h"

namespace plateau {

class ParamLayout {
 public:
  ParamLayout(const ModelConfig& m, int64_t ranks);

  struct Dense {
    int weight;      // index into ModelWeights()
    int64_t offset;  // into the flat dense vector
    int64_t numel;
  };

  const ModelConfig& model() const { return model_; }
  int64_t ranks() const { return ranks_; }
  const std::vector<WeightSpec>& weights() const { return weights_; }

  int64_t dense_numel() const { return dense_numel_; }       // D
  int64_t dense_padded() const { return shard_ * ranks_; }   // S * P
  int64_t shard_numel() const { return shard_; }             // S
  const std::vector<Dense>& dense() const { return dense_; }
  // Offset in the flat dense vector of the weight named `name` (must be dense).
  int64_t DenseOffset(const std::string& name) const;

  int64_t experts_per_rank() const { return model_.experts / ranks_; }
  int64_t expert_matrix() const { return model_.hidden * model_.expert_ffn; }  // H*F
  // Per rank: L layers x 3 matrices x E_p experts x H*F values.
  int64_t expert_numel_per_rank() const {
    return model_.layers * 3 * experts_per_rank() * expert_matrix();
  }
  // Offset of (layer, which = 0 gate / 1 up / 2 down, local expert) in a
  // rank's expert vector.
  int64_t ExpertOffset(int64_t layer, int which, int64_t local_expert) const {
    return ((layer * 3 + which) * experts_per_rank() + local_expert) * expert_matrix();
  }

  // Values of this rank's initial dense shard / expert vector: exactly
  // InitWeights<float>() of the same seed, element for element.
  std::vector<float> InitDenseShard(int64_t rank, uint64_t seed) const;
  std::vector<float> InitExperts(int64_t rank, uint64_t seed) const;

  // Scatters full tensors (ModelWeights() order) into a rank's dense shard
  // and expert vector, and gathers them back from all ranks' parts.
  void ShardFrom(const std::vector<std::vector<float>>& full, int64_t rank,
                 std::vector<float>* dense_shard, std::vector<float>* experts) const;
  std::vector<std::vector<float>> Assemble(const std::vector<float>& dense_full,
                                           const std::vector<float>& experts_all) const;

 private:
  ModelConfig model_;
  int64_t ranks_;
  std::vector<WeightSpec> weights_;
  std::vector<Dense> dense_;
  int64_t dense_numel_ = 0;
  int64_t shard_ = 0;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_PARAMS_H_
