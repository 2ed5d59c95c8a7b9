#include "kernels/model/params.h"

#include "gtest/gtest.h"
#include "kernels/model/reference.h"

namespace plateau {
namespace {

ModelConfig Small() {
  ModelConfig m;
  m.vocab_size = 13;
  m.hidden = 8;
  m.layers = 2;
  m.heads = 2;
  m.kv_heads = 1;
  m.experts = 4;
  m.top_k = 2;
  m.expert_ffn = 6;
  m.seq_len = 8;
  return m;
}

class ParamLayoutTest : public ::testing::TestWithParam<LmHeadLayout> {};

TEST_P(ParamLayoutTest, ShardsInitialiseExactlyAsTheFullModel) {
  const ModelConfig m = Small();  // V = 13: uneven vocabulary shards at P = 2, 4
  const Tensors<float> want = InitWeights<float>(m, 77);
  for (int64_t P : {1, 2, 4}) {
    ParamLayout layout(m, P, GetParam());
    EXPECT_EQ(layout.dense_padded() % P, 0);
    EXPECT_GE(layout.dense_padded(), layout.dense_numel());
    std::vector<float> dense_full, experts_all;
    for (int64_t r = 0; r < P; ++r) {
      std::vector<float> shard = layout.InitDenseShard(r, 77);
      dense_full.insert(dense_full.end(), shard.begin(), shard.end());
      std::vector<float> ex = layout.InitOwned(r, 77);
      experts_all.insert(experts_all.end(), ex.begin(), ex.end());
    }
    EXPECT_EQ(layout.Assemble(dense_full, experts_all), want) << "P = " << P;
    // ShardFrom is the inverse of Assemble.
    for (int64_t r = 0; r < P; ++r) {
      std::vector<float> shard, ex;
      layout.ShardFrom(want, r, &shard, &ex);
      EXPECT_EQ(shard, layout.InitDenseShard(r, 77));
      EXPECT_EQ(ex, layout.InitOwned(r, 77));
    }
  }
}

// The runs of every rank's parts, asked for in chunks of any size, name
// every value of every tensor exactly once, stay inside the chunk asked
// for, come in the part's order, and agree with ShardFrom.
TEST_P(ParamLayoutTest, RunsInAnyChunksCoverEveryValueOnce) {
  const ModelConfig m = Small();
  const Tensors<float> full = InitWeights<float>(m, 5);
  for (int64_t P : {1, 2, 4}) {
    ParamLayout layout(m, P, GetParam());
    for (int64_t chunk : {int64_t{1}, int64_t{7}, layout.shard_numel(), layout.owned_numel_per_rank()}) {
      std::vector<std::vector<int>> seen;
      for (const WeightSpec& w : layout.weights()) seen.emplace_back(w.numel(), 0);
      for (int64_t r = 0; r < P; ++r) {
        std::vector<float> shard, owned;
        layout.ShardFrom(full, r, &shard, &owned);
        for (bool is_owned : {false, true}) {
          const std::vector<float>& part = is_owned ? owned : shard;
          const int64_t n = static_cast<int64_t>(part.size());
          for (int64_t lo = 0; lo < n; lo += chunk) {
            const int64_t hi = std::min(n, lo + chunk);
            int64_t next = lo;
            auto check = [&](const ParamLayout::Run& run) {
              EXPECT_GE(run.part_offset, next) << "P = " << P << " rank " << r;
              EXPECT_LE(run.part_offset + run.numel, hi);
              next = run.part_offset + run.numel;
              for (int64_t i = 0; i < run.numel; ++i) {
                ++seen[run.weight][run.tensor_offset + i];
                ASSERT_EQ(part[run.part_offset + i], full[run.weight][run.tensor_offset + i]);
              }
            };
            if (is_owned) {
              layout.ForEachOwnedRun(r, lo, hi, check);
            } else {
              layout.ForEachDenseRun(r, lo, hi, check);
            }
          }
        }
      }
      for (size_t w = 0; w < seen.size(); ++w) {
        for (size_t i = 0; i < seen[w].size(); ++i) {
          ASSERT_EQ(seen[w][i], 1) << layout.weights()[w].name << "[" << i << "], P = " << P << ", chunk " << chunk;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(LmHead, ParamLayoutTest,
                         ::testing::Values(LmHeadLayout::kDense, LmHeadLayout::kVocabularySharded),
                         [](const auto& info) {
                           return info.param == LmHeadLayout::kDense ? "Dense" : "VocabularySharded";
                         });

TEST(ParamLayoutCountsTest, CountsAddUp) {
  const ModelConfig m = Small();
  ParamLayout layout(m, 2);
  EXPECT_EQ(layout.owned_numel_per_rank(), layout.expert_numel_per_rank());
  EXPECT_EQ(layout.dense_numel() + 2 * layout.expert_numel_per_rank(), ParameterCount(m));
  EXPECT_EQ(layout.DenseOffset("embed.weight"), 0);
  EXPECT_EQ(layout.DenseOffset("layers.0.attn_norm.weight"), 13 * 8);
}

// Vocabulary-sharded: lm_head leaves the dense vector for the owned ones,
// each padded to the largest shard, ceil(13 / 4) = 4 rows of H = 8.
TEST(ParamLayoutCountsTest, VocabularyShardedLmHeadIsOwned) {
  const ModelConfig m = Small();
  const ParamLayout dense(m, 4), sharded(m, 4, LmHeadLayout::kVocabularySharded);
  EXPECT_EQ(sharded.dense_numel(), dense.dense_numel() - 13 * 8);
  EXPECT_EQ(sharded.lm_head_shard_numel(), 4 * 8);
  EXPECT_EQ(sharded.owned_numel_per_rank(), dense.expert_numel_per_rank() + 4 * 8);
  EXPECT_EQ(sharded.lm_head_shard_offset(), dense.expert_numel_per_rank());
  // Shards [0, 4), [4, 7), [7, 10), [10, 13): rank 3's padding row is zero.
  EXPECT_EQ(VocabShardBegin(13, 4, 1), 4);
  EXPECT_EQ(VocabShardBegin(13, 4, 4), 13);
  const std::vector<float> owned = sharded.InitOwned(3, 77);
  const int64_t pad = sharded.lm_head_shard_offset() + 3 * 8;
  for (int64_t i = pad; i < pad + 8; ++i) EXPECT_EQ(owned[i], 0.0f) << i;
  EXPECT_NE(owned[pad - 1], 0.0f);
  // The step's whole-model state: every lm_head value on exactly one rank.
  EXPECT_EQ(sharded.dense_numel() + 4 * sharded.expert_numel_per_rank() + 13 * 8,
            ParameterCount(m));
}

}  // namespace
}  // namespace plateau
