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

#include <algorithm>
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

  // A stretch of values that are consecutive both in one tensor and in one
  // rank's part (its dense shard, or its owned vector).
  struct Run {
    int weight;             // index into weights()
    int64_t tensor_offset;  // of the first value, in the tensor
    int64_t part_offset;    // of the first value, in the part
    int64_t numel;
  };
  // Calls fn for the runs that cover [lo, hi) of rank `rank`'s dense shard
  // (offsets 0..S) or owned vector (0..owned_numel_per_rank()), in the
  // part's order. Padding (the dense vector's tail, the lm_head shard's
  // zero rows) belongs to no tensor and is in no run. This is the one map
  // between the parts and the full tensors: initialisation, ShardFrom,
  // Assemble and the streamed checkpoint (TrainingStep::StreamState) use it.
  template <typename Fn>
  void ForEachDenseRun(int64_t rank, int64_t lo, int64_t hi, Fn&& fn) const;
  template <typename Fn>
  void ForEachOwnedRun(int64_t rank, int64_t lo, int64_t hi, Fn&& fn) const;

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

// Which matrix of an expert layer the weight named `name` is: 0 gate, 1 up,
// 2 down; and its layer ("layers.<l>.").
int ExpertWhich(const std::string& name);
int64_t ExpertLayer(const std::string& name);

template <typename Fn>
void ParamLayout::ForEachDenseRun(int64_t rank, int64_t lo, int64_t hi, Fn&& fn) const {
  const int64_t base = rank * shard_;
  for (const Dense& d : dense_) {
    // The part [lo, hi) is flat [base + lo, base + hi) of the dense vector.
    const int64_t a = std::max(base + lo, d.offset), b = std::min(base + hi, d.offset + d.numel);
    if (a < b) fn(Run{d.weight, a - d.offset, a - base, b - a});
  }
}

template <typename Fn>
void ParamLayout::ForEachOwnedRun(int64_t rank, int64_t lo, int64_t hi, Fn&& fn) const {
  // One run of the part [begin, begin + n) that is tensor `weight` from
  // tensor_offset on, clipped to [lo, hi).
  auto clip = [&](int weight, int64_t tensor_offset, int64_t begin, int64_t n) {
    const int64_t a = std::max(lo, begin), b = std::min(hi, begin + n);
    if (a < b) fn(Run{weight, tensor_offset + (a - begin), a, b - a});
  };
  // The experts in the owned vector's order: layer, matrix, local expert.
  std::vector<int> by_slot(model_.layers * 3, -1);
  for (int wi = 0; wi < static_cast<int>(weights_.size()); ++wi) {
    if (weights_[wi].expert) by_slot[ExpertLayer(weights_[wi].name) * 3 + ExpertWhich(weights_[wi].name)] = wi;
  }
  const int64_t ep = experts_per_rank(), mat = expert_matrix();
  for (int64_t slot = 0; slot < model_.layers * 3; ++slot) {
    for (int64_t le = 0; le < ep; ++le) {
      clip(by_slot[slot], (rank * ep + le) * mat, ExpertOffset(slot / 3, static_cast<int>(slot % 3), le), mat);
    }
  }
  if (lm_head_ == LmHeadLayout::kVocabularySharded) {
    const int64_t H = model_.hidden, row = VocabShardBegin(model_.vocab_size, ranks_, rank),
                  rows = VocabShardBegin(model_.vocab_size, ranks_, rank + 1) - row;
    clip(lm_head_weight(), row * H, lm_head_shard_offset(), rows * H);
  }
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_PARAMS_H_
