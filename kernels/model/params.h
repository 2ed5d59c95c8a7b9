// Where every parameter lives over P ranks (docs/MODEL.md, parallel layout).
//
// Two groups:
// - Dense weights (ZeRO): everything else, concatenated in ModelWeights()
//   order into one flat vector of D values, padded to a multiple of P: rank
//   p owns the shard [p*S, (p+1)*S), S = ceil(D/P), with its master copy and
//   AdamW state; the working weights are the all-gathered flat vector, and
//   gradients are reduce-scattered into the owners' shards.
// - Owned weights: parameters a rank holds whole and alone, whose gradient
//   is complete on that rank (no reduce-scatter, no all-gather; fp32, so
//   they are their own master). Rank p's owned vector is
//     [experts | lm_head shard]
//   experts: experts [p*E_p, (p+1)*E_p) of every layer, E_p = E/P, packed
//   per layer as w_gate [E_p, H, F], w_up [E_p, H, F], w_down [E_p, F, H];
//   lm_head shard (only when the lm_head is vocabulary-sharded, as under
//   Ring-DTP): rows [VocabShardBegin(V, P, p), VocabShardBegin(V, P, p+1))
//   of lm_head [V, H], padded with zero rows to MaxVocabShardRows(V, P) so
//   every rank's owned vector has the same length (zero rows get zero
//   gradients and stay zero under AdamW). Ring-DTP completes the gradient
//   of a rank's vocabulary shard on that rank, so the full V x H lm_head is
//   never gathered anywhere.
#ifndef PLATEAU_KERNELS_MODEL_PARAMS_H_
#define PLATEAU_KERNELS_MODEL_PARAMS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/model/config.h"

namespace plateau {

// Vocabulary shard s of V ids over P ranks: ids [VocabShardBegin(V, P, s),
// VocabShardBegin(V, P, s + 1)); the first V % P shards have one id more.
int64_t VocabShardBegin(int64_t vocab, int64_t ranks, int64_t shard);
// The largest shard: ceil(V / P).
int64_t MaxVocabShardRows(int64_t vocab, int64_t ranks);

enum class LmHeadLayout {
  kDense,             // in the ZeRO-sharded dense weights (the dense projection)
  kVocabularySharded  // rank p owns its vocabulary rows (Ring-DTP)
};

class ParamLayout {
 public:
  ParamLayout(const ModelConfig& m, int64_t ranks, LmHeadLayout lm_head = LmHeadLayout::kDense);

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

  LmHeadLayout lm_head_layout() const { return lm_head_; }
  // Owned values per rank: experts, then (vocabulary-sharded) the padded
  // lm_head shard.
  int64_t owned_numel_per_rank() const { return expert_numel_per_rank() + lm_head_shard_numel(); }
  // Offset of the lm_head shard in the owned vector, and its padded length
  // (0 under LmHeadLayout::kDense).
  int64_t lm_head_shard_offset() const { return expert_numel_per_rank(); }
  int64_t lm_head_shard_numel() const;

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

  // Values of this rank's initial dense shard / owned vector: exactly
  // InitWeights<float>() of the same seed, element for element.
  std::vector<float> InitDenseShard(int64_t rank, uint64_t seed) const;
  std::vector<float> InitOwned(int64_t rank, uint64_t seed) const;

  // Scatters full tensors (ModelWeights() order) into a rank's dense shard
  // and owned vector, and gathers them back from all ranks' parts
  // (dense_full: the P shards concatenated; owned_all: the P owned vectors).
  void ShardFrom(const std::vector<std::vector<float>>& full, int64_t rank,
                 std::vector<float>* dense_shard, std::vector<float>* owned) const;
  std::vector<std::vector<float>> Assemble(const std::vector<float>& dense_full,
                                           const std::vector<float>& owned_all) const;

 private:
  // Index into weights() of lm_head.weight.
  int lm_head_weight() const;

  ModelConfig model_;
  int64_t ranks_;
  LmHeadLayout lm_head_;
  std::vector<WeightSpec> weights_;
  std::vector<Dense> dense_;
  int64_t dense_numel_ = 0;
  int64_t shard_ = 0;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_PARAMS_H_
