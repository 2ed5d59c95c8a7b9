#include "kernels/model/config.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

void ExpectInvalid(const absl::Status& s, absl::string_view field,
                   absl::string_view expected) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr(field), HasSubstr(expected))) << s;
}

TEST(ModelConfigTest, DefaultsAreValid) {
  EXPECT_TRUE(ValidateModelConfig(ModelConfig{}).ok());
  EXPECT_TRUE(ValidateLayout(ModelConfig{}, LayoutConfig{2, 1}).ok());
}

TEST(ModelConfigTest, RefusesInconsistentFieldsByName) {
  ModelConfig m;
  m.heads = 3;  // 128 % 3 != 0
  ExpectInvalid(ValidateModelConfig(m), "model.heads", "a divisor of model.hidden = 128");
  m = {};
  m.kv_heads = 3;
  ExpectInvalid(ValidateModelConfig(m), "model.kv_heads", "a divisor of model.heads = 4");
  m = {};
  m.top_k = 5;
  ExpectInvalid(ValidateModelConfig(m), "model.top_k", "<= model.experts = 4");
  m = {};
  m.vocab_size = 1;
  ExpectInvalid(ValidateModelConfig(m), "model.vocab_size", ">= 2");
  m = {};
  m.hidden = 12;
  m.heads = 4;  // head_dim 3: rotary needs pairs
  m.kv_heads = 2;
  ExpectInvalid(ValidateModelConfig(m), "model.heads", "even");
  m = {};
  m.layers = 0;
  ExpectInvalid(ValidateModelConfig(m), "model.layers", ">= 1");
  m = {};
  m.norm_eps = 0.0f;
  ExpectInvalid(ValidateModelConfig(m), "model.norm_eps", "> 0");
  m = {};
  m.rope_theta = std::numeric_limits<float>::quiet_NaN();
  ExpectInvalid(ValidateModelConfig(m), "model.rope_theta", "finite");
}

TEST(ModelConfigTest, RefusesLayoutsThatDoNotDivide) {
  ModelConfig m;
  m.experts = 6;
  ExpectInvalid(ValidateLayout(m, LayoutConfig{4, 1}), "model.experts",
                "a multiple of layout.ranks = 4");
  m = {};
  m.seq_len = 250;
  ExpectInvalid(ValidateLayout(m, LayoutConfig{4, 1}), "model.seq_len",
                "a multiple of layout.ranks = 4");
  ExpectInvalid(ValidateLayout(ModelConfig{}, LayoutConfig{0, 1}), "layout.ranks", ">= 1");
  ExpectInvalid(ValidateLayout(ModelConfig{}, LayoutConfig{1, 0}), "layout.batch", ">= 1");
}

TEST(ModelConfigTest, ParameterCountMatchesTheClosedForm) {
  ModelConfig m;
  m.vocab_size = 300;
  m.hidden = 64;
  m.layers = 3;
  m.heads = 8;
  m.kv_heads = 2;
  m.experts = 8;
  m.top_k = 2;
  m.expert_ffn = 96;
  const int64_t V = 300, H = 64, L = 3, nh = 8, nkv = 2, d = 8, E = 8, k = 2, F = 96;
  // docs/MODEL.md: Θ = 2VH + L(2H + H(n_h + 2 n_kv)d + n_h d H + H E + 3 E H F) + H
  const int64_t theta =
      2 * V * H + L * (2 * H + H * (nh + 2 * nkv) * d + nh * d * H + H * E + 3 * E * H * F) + H;
  EXPECT_EQ(ParameterCount(m), theta);
  const int64_t active =
      2 * V * H + L * (2 * H + H * (nh + 2 * nkv) * d + nh * d * H + H * E + 3 * k * H * F) + H;
  EXPECT_EQ(ActiveParameterCount(m), active);
}

TEST(ModelConfigTest, WeightNamesShapesAndInit) {
  ModelConfig m;
  m.layers = 2;
  std::vector<WeightSpec> w = ModelWeights(m);
  ASSERT_EQ(w.size(), 1u + 2 * 10 + 2);
  EXPECT_EQ(w.front().name, "embed.weight");
  EXPECT_EQ(w[3].name, "layers.0.attn.wk");
  EXPECT_EQ(w[3].shape, (std::vector<int64_t>{128, 2 * 32}));
  EXPECT_EQ(w[8].name, "layers.0.experts.w_gate");
  EXPECT_TRUE(w[8].expert);
  EXPECT_EQ(w[8].shape, (std::vector<int64_t>{4, 128, 256}));
  EXPECT_EQ(w[1].init_std, 0.0f);  // norm weights start at one
  EXPECT_FLOAT_EQ(w[5].init_std, 0.02f / 2.0f);  // wo: sigma / sqrt(2L), L = 2
  EXPECT_EQ(w.back().name, "lm_head.weight");
  EXPECT_EQ(TokensPerRank(m, LayoutConfig{4, 3}), 3 * 256 / 4);
}

}  // namespace
}  // namespace plateau
