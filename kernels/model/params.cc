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

// Which matrix of an expert layer a weight is: 0 gate, 1 up, 2 down.
int ExpertWhich(const std::string& name) {
  if (name.size() >= 6 && name.compare(name.size() - 6, 6, "w_gate") == 0) return 0;
  if (name.size() >= 4 && name.compare(name.size() - 4, 4, "w_up") == 0) return 1;
  return 2;
}

}  // namespace

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
  const int64_t lo = rank * shard_, hi = lo + shard_;
  for (const Dense& d : dense_) {
    const int64_t a = std::max(lo, d.offset), b = std::min(hi, d.offset + d.numel);
    if (a >= b) continue;
    const WeightSpec& w = weights_[d.weight];
    const uint64_t key = WeightKey(seed, w.name);
    for (int64_t i = a; i < b; ++i) shard[i - lo] = InitValue(w, key, i - d.offset);
  }
  return shard;
}

std::vector<float> ParamLayout::InitOwned(int64_t rank, uint64_t seed) const {
  std::vector<float> out(owned_numel_per_rank(), 0.0f);
  const int64_t ep = experts_per_rank(), mat = expert_matrix();
  for (const WeightSpec& w : weights_) {
    if (!w.expert) continue;
    const int64_t layer = std::atoll(w.name.c_str() + 7);  // "layers.<l>."
    const int which = ExpertWhich(w.name);
    const uint64_t key = WeightKey(seed, w.name);
    for (int64_t le = 0; le < ep; ++le) {
      const int64_t global = (rank * ep + le) * mat;
      float* dst = &out[ExpertOffset(layer, which, le)];
      for (int64_t i = 0; i < mat; ++i) dst[i] = InitValue(w, key, global + i);
    }
  }
  if (lm_head_ == LmHeadLayout::kVocabularySharded) {
    const WeightSpec& w = weights_[lm_head_weight()];
    const uint64_t key = WeightKey(seed, w.name);
    const int64_t H = model_.hidden, lo = VocabShardBegin(model_.vocab_size, ranks_, rank) * H,
                  hi = VocabShardBegin(model_.vocab_size, ranks_, rank + 1) * H;
    float* dst = &out[lm_head_shard_offset()];
    for (int64_t i = lo; i < hi; ++i) dst[i - lo] = InitValue(w, key, i);
  }
  return out;
}

void ParamLayout::ShardFrom(const std::vector<std::vector<float>>& full, int64_t rank,
                            std::vector<float>* dense_shard,
                            std::vector<float>* owned) const {
  dense_shard->assign(shard_, 0.0f);
  const int64_t lo = rank * shard_, hi = lo + shard_;
  for (const Dense& d : dense_) {
    const int64_t a = std::max(lo, d.offset), b = std::min(hi, d.offset + d.numel);
    for (int64_t i = a; i < b; ++i) (*dense_shard)[i - lo] = full[d.weight][i - d.offset];
  }
  owned->assign(owned_numel_per_rank(), 0.0f);
  const int64_t ep = experts_per_rank(), mat = expert_matrix();
  for (size_t wi = 0; wi < weights_.size(); ++wi) {
    const WeightSpec& w = weights_[wi];
    if (!w.expert) continue;
    const int64_t layer = std::atoll(w.name.c_str() + 7);
    const int which = ExpertWhich(w.name);
    for (int64_t le = 0; le < ep; ++le) {
      std::copy_n(&full[wi][(rank * ep + le) * mat], mat,
                  &(*owned)[ExpertOffset(layer, which, le)]);
    }
  }
  if (lm_head_ == LmHeadLayout::kVocabularySharded) {
    const int64_t H = model_.hidden, lo = VocabShardBegin(model_.vocab_size, ranks_, rank) * H,
                  hi = VocabShardBegin(model_.vocab_size, ranks_, rank + 1) * H;
    std::copy(full[lm_head_weight()].begin() + lo, full[lm_head_weight()].begin() + hi,
              owned->begin() + lm_head_shard_offset());
  }
}

std::vector<std::vector<float>> ParamLayout::Assemble(const std::vector<float>& dense_full,
                                                      const std::vector<float>& owned_all) const {
  std::vector<std::vector<float>> full;
  for (const WeightSpec& w : weights_) full.emplace_back(w.numel());
  for (const Dense& d : dense_) {
    std::copy_n(&dense_full[d.offset], d.numel, full[d.weight].begin());
  }
  const int64_t ep = experts_per_rank(), mat = expert_matrix(), per_rank = owned_numel_per_rank();
  for (size_t wi = 0; wi < weights_.size(); ++wi) {
    const WeightSpec& w = weights_[wi];
    if (!w.expert) continue;
    const int64_t layer = std::atoll(w.name.c_str() + 7);
    const int which = ExpertWhich(w.name);
    for (int64_t r = 0; r < ranks_; ++r) {
      for (int64_t le = 0; le < ep; ++le) {
        std::copy_n(&owned_all[r * per_rank + ExpertOffset(layer, which, le)], mat,
                    &full[wi][(r * ep + le) * mat]);
      }
    }
  }
  if (lm_head_ == LmHeadLayout::kVocabularySharded) {
    const int64_t H = model_.hidden;
    for (int64_t r = 0; r < ranks_; ++r) {
      const int64_t lo = VocabShardBegin(model_.vocab_size, ranks_, r) * H,
                    hi = VocabShardBegin(model_.vocab_size, ranks_, r + 1) * H;
      std::copy_n(&owned_all[r * per_rank + lm_head_shard_offset()], hi - lo,
                  &full[lm_head_weight()][lo]);
    }
  }
  return full;
}

}  // namespace plateau
