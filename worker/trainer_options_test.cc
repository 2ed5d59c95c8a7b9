#include "worker/trainer_options.h"

#include "gtest/gtest.h"
#include "kernels/model/config.h"

namespace plateau {
namespace {

// ModelFlopsPerStep against the step's matrix products counted one by one
// (docs/MODEL.md): per token and layer, the Q, K, V and O projections
// (K and V over the kv_heads), the router, and top_k experts of three
// GEMMs each; the lm_head per token; 2 m n k each forward and twice that
// backward. Attention: per layer, sequence and query head, QK^T and PV are
// 2 T^2 d each, half of them under the causal mask, forward; twice that
// backward. The embedding (a lookup) and the norms' weights (elementwise)
// do no matrix products. Exact in double at these sizes.
double CountedFlops(const ModelConfig& m, int64_t batch) {
  const double H = m.hidden, d = m.head_dim(), T = m.seq_len, B = batch;
  const double tokens = B * T;
  const double per_token_layer = 2 * H * m.heads * d                    // Q
                                 + 2 * 2 * H * m.kv_heads * d           // K, V
                                 + 2 * m.heads * d * H                  // O
                                 + 2 * H * m.experts                    // router
                                 + m.top_k * 3 * 2 * H * m.expert_ffn;  // gate, up, down
  const double forward_gemms = tokens * (m.layers * per_token_layer + 2 * H * m.vocab_size);
  const double forward_attention = m.layers * B * m.heads * (2 * 2 * T * T * d) / 2;
  return 3 * (forward_gemms + forward_attention);
}

TEST(TrainerOptionsTest, ModelFlopsAreTheMatrixProductsCountedOneByOne) {
  ModelConfig small;  // the demo's shape
  small.hidden = 64;
  small.layers = 2;
  small.heads = 4;
  small.kv_heads = 2;
  small.experts = 4;
  small.top_k = 2;
  small.expert_ffn = 128;
  small.vocab_size = 24;
  small.seq_len = 32;
  EXPECT_DOUBLE_EQ(ModelFlopsPerStep(small, 32), CountedFlops(small, 32));

  ModelConfig large;  // a long-context MoE of the paper's kind
  large.hidden = 4096;
  large.layers = 32;
  large.heads = 32;
  large.kv_heads = 8;
  large.experts = 64;
  large.top_k = 8;
  large.expert_ffn = 1408;
  large.vocab_size = 131072;
  large.seq_len = 131072;
  EXPECT_DOUBLE_EQ(ModelFlopsPerStep(large, 1), CountedFlops(large, 1));
  EXPECT_DOUBLE_EQ(AttentionFlopsPerStep(large, 1), 3.0 * 32 * 32 * (2 * 131072.0 * 131072 * 128));
  EXPECT_DOUBLE_EQ(ProjectionFlopsPerStep(large, 1), 6.0 * 131072 * 4096 * 131072);
}

}  // namespace
}  // namespace plateau
