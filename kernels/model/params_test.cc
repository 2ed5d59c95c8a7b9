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

TEST(ParamLayoutTest, ShardsInitialiseExactlyAsTheFullModel) {
  const ModelConfig m = Small();
  const Tensors<float> want = InitWeights<float>(m, 77);
  for (int64_t P : {1, 2, 4}) {
    ParamLayout layout(m, P);
    EXPECT_EQ(layout.dense_padded() % P, 0);
    EXPECT_GE(layout.dense_padded(), layout.dense_numel());
    std::vector<float> dense_full, experts_all;
    for (int64_t r = 0; r < P; ++r) {
      std::vector<float> shard = layout.InitDenseShard(r, 77);
      dense_full.insert(dense_full.end(), shard.begin(), shard.end());
      std::vector<float> ex = layout.InitExperts(r, 77);
      experts_all.insert(experts_all.end(), ex.begin(), ex.end());
    }
    EXPECT_EQ(layout.Assemble(dense_full, experts_all), want) << "P = " << P;
    // ShardFrom is the inverse of Assemble.
    for (int64_t r = 0; r < P; ++r) {
      std::vector<float> shard, ex;
      layout.ShardFrom(want, r, &shard, &ex);
      EXPECT_EQ(shard, layout.InitDenseShard(r, 77));
      EXPECT_EQ(ex, layout.InitExperts(r, 77));
    }
  }
}

TEST(ParamLayoutTest, CountsAddUp) {
  const ModelConfig m = Small();
  ParamLayout layout(m, 2);
  EXPECT_EQ(layout.dense_numel() + 2 * layout.expert_numel_per_rank(), ParameterCount(m));
  EXPECT_EQ(layout.DenseOffset("embed.weight"), 0);
  EXPECT_EQ(layout.DenseOffset("layers.0.attn_norm.weight"), 13 * 8);
}

}  // namespace
}  // namespace plateau
