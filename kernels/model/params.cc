#include "kernels/model/params.h"

#include <algorithm>
#include <cstdlib>

#include "kernels/model/init.h"

namespace plateau {
namespace {

float InitValue(const WeightSpec& w, uint64_t key, int64_t index) {
  if (w.init_std == 0.0f) return 1.0f;
  return static_cast<float>(w.init_std * StandardNormal(key, index));
}

}  // namespace

int ExpertWhich(const std::string& name) {
  if (name.size() >= 6 && name.compare(name.size() - 6, 6, "w_gate") == 0) return 0;
  if (name.size() >= 4 && name.compare(name.size() - 4, 4, "w_up") == 0) return 1;
  return 2;
}

int64_t ExpertLayer(const std::string& name) { return std::atoll(name.c_str() + 7); }

int64_t VocabShardBegin(int64_t vocab, int64_t ranks, int64_t shard) {
  return shard * (vocab / ranks) + std::min(shard, vocab % ranks);
}

int64_t MaxVocabShardRows(int64_t vocab, int64_t ranks) { return (vocab + ranks - 1) / ranks; }

ParamLayout::ParamLayout(const ModelConfig& m, int64_t ranks, LmHeadLayout lm_head)
    : model_(m), ranks_(ranks), lm_head_(lm_head), weights_(ModelWeights(m)) {
  const int lm = lm_head_weight();
  for (int i = 0; i < static_cast<int>(weights_.size()); ++i) {
    if (weights_[i].expert) continue;
    if (i == lm && lm_head_ == LmHeadLayout::kVocabularySharded) continue;
    dense_.push_back({i, dense_numel_, weights_[i].numel()});
    dense_numel_ += weights_[i].numel();
  }
  shard_ = (dense_numel_ + ranks_ - 1) / ranks_;
}

int ParamLayout::lm_head_weight() const {
  for (int i = 0; i < static_cast<int>(weights_.size()); ++i) {
    if (weights_[i].name == "lm_head.weight") return i;
  }
  std::abort();  // a programming error: the names are fixed by ModelWeights()
}

int64_t ParamLayout::lm_head_shard_numel() const {
  if (lm_head_ != LmHeadLayout::kVocabularySharded) return 0;
  return MaxVocabShardRows(model_.vocab_size, ranks_) * model_.hidden;
}

int64_t ParamLayout::DenseOffset(const std::string& name) const {
  for (const Dense& d : dense_) {
    if (weights_[d.weight].name == name) return d.offset;
  }
  std::abort();  // a programming error: the names are fixed by ModelWeights()
}

std::vector<float> ParamLayout::InitDenseShard(int64_t rank, uint64_t seed) const {
  std::vector<float> shard(shard_, 0.0f);
  ForEachDenseRun(rank, 0, shard_, [&](const Run& r) {
    const WeightSpec& w = weights_[r.weight];
    const uint64_t key = WeightKey(seed, w.name);
    for (int64_t i = 0; i < r.numel; ++i) shard[r.part_offset + i] = InitValue(w, key, r.tensor_offset + i);
  });
  return shard;
}

std::vector<float> ParamLayout::InitOwned(int64_t rank, uint64_t seed) const {
  std::vector<float> out(owned_numel_per_rank(), 0.0f);
  ForEachOwnedRun(rank, 0, owned_numel_per_rank(), [&](const Run& r) {
    const WeightSpec& w = weights_[r.weight];
    const uint64_t key = WeightKey(seed, w.name);
    for (int64_t i = 0; i < r.numel; ++i) out[r.part_offset + i] = InitValue(w, key, r.tensor_offset + i);
  });
  return out;
}

void ParamLayout::ShardFrom(const std::vector<std::vector<float>>& full, int64_t rank,
                            std::vector<float>* dense_shard,
                            std::vector<float>* owned) const {
  dense_shard->assign(shard_, 0.0f);
  ForEachDenseRun(rank, 0, shard_, [&](const Run& r) {
    std::copy_n(&full[r.weight][r.tensor_offset], r.numel, &(*dense_shard)[r.part_offset]);
  });
  owned->assign(owned_numel_per_rank(), 0.0f);
  ForEachOwnedRun(rank, 0, owned_numel_per_rank(), [&](const Run& r) {
    std::copy_n(&full[r.weight][r.tensor_offset], r.numel, &(*owned)[r.part_offset]);
  });
}

std::vector<std::vector<float>> ParamLayout::Assemble(const std::vector<float>& dense_full,
                                                      const std::vector<float>& owned_all) const {
  std::vector<std::vector<float>> full;
  for (const WeightSpec& w : weights_) full.emplace_back(w.numel());
  const int64_t X = owned_numel_per_rank();
  for (int64_t rank = 0; rank < ranks_; ++rank) {
    ForEachDenseRun(rank, 0, shard_, [&](const Run& r) {
      std::copy_n(&dense_full[rank * shard_ + r.part_offset], r.numel, &full[r.weight][r.tensor_offset]);
    });
    ForEachOwnedRun(rank, 0, X, [&](const Run& r) {
      std::copy_n(&owned_all[rank * X + r.part_offset], r.numel, &full[r.weight][r.tensor_offset]);
    });
  }
  return full;
}

}  // namespace plateau
