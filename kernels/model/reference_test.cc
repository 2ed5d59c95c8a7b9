#include "kernels/model/reference.h"

#include <cmath>
#include <random>

#include "gtest/gtest.h"
#include "kernels/model/init.h"

namespace plateau {
namespace {

ModelConfig Tiny() {
  ModelConfig m;
  m.vocab_size = 11;
  m.hidden = 8;
  m.layers = 2;
  m.heads = 2;
  m.kv_heads = 1;  // grouped-query: both heads share one K/V head
  m.experts = 4;
  m.top_k = 2;
  m.expert_ffn = 6;
  m.seq_len = 5;
  m.init_std = 0.5f;  // large enough that every path carries signal
  return m;
}

struct Batch {
  std::vector<int32_t> tokens, targets;
};

Batch MakeBatch(const ModelConfig& m, int64_t batch, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Batch b;
  for (int64_t i = 0; i < batch * m.seq_len; ++i) {
    b.tokens.push_back(static_cast<int32_t>(rng() % m.vocab_size));
    b.targets.push_back(i % 4 == 3 ? kIgnoreIndex
                                   : static_cast<int32_t>(rng() % m.vocab_size));
  }
  return b;
}

TEST(InitTest, CountersGiveStandardNormalsIndependentOfOrder) {
  const uint64_t key = WeightKey(7, "layers.0.attn.wq");
  EXPECT_NE(key, WeightKey(7, "layers.0.attn.wk"));
  EXPECT_NE(key, WeightKey(8, "layers.0.attn.wq"));
  double sum = 0, sum2 = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    double x = StandardNormal(key, i);
    ASSERT_TRUE(std::isfinite(x));
    sum += x;
    sum2 += x * x;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sum2 / n, 1.0, 0.01);
  EXPECT_EQ(StandardNormal(key, 12345), StandardNormal(key, 12345));
}

TEST(ReferenceTest, InitialLossIsNearLogVocab) {
  ModelConfig m = Tiny();
  m.init_std = 0.02f;  // the default: logits near zero, loss near ln V
  Tensors<double> w = InitWeights<double>(m, 1);
  Batch b = MakeBatch(m, 2, 3);
  double loss = ReferenceLossAndGrads(m, w, b.tokens, b.targets, 2, nullptr);
  EXPECT_NEAR(loss, std::log(11.0), 0.01 * std::log(11.0));
}

// Every gradient of the whole model, in double, against central finite
// differences: this checks every layer's backward (embedding, RMSNorm,
// rotary, grouped-query causal attention, router softmax/top-k/renormalise,
// SwiGLU experts, projection, cross-entropy with ignored targets).
TEST(ReferenceTest, EveryGradientMatchesFiniteDifferences) {
  const ModelConfig m = Tiny();
  Tensors<double> w = InitWeights<double>(m, 42);
  Batch b = MakeBatch(m, 2, 5);
  Tensors<double> g;
  ReferenceLossAndGrads(m, w, b.tokens, b.targets, 2, &g);
  const std::vector<WeightSpec> specs = ModelWeights(m);
  const double h = 1e-5;
  int checked = 0;
  double worst = 0;
  for (size_t t = 0; t < w.size(); ++t) {
    for (size_t i = 0; i < w[t].size(); ++i) {
      const double saved = w[t][i];
      w[t][i] = saved + h;
      const double up = ReferenceLossAndGrads(m, w, b.tokens, b.targets, 2, nullptr);
      w[t][i] = saved - h;
      const double down = ReferenceLossAndGrads(m, w, b.tokens, b.targets, 2, nullptr);
      w[t][i] = saved;
      const double fd = (up - down) / (2 * h);
      const double err = std::abs(fd - g[t][i]);
      const double tol = 1e-8 + 1e-6 * std::max(std::abs(fd), std::abs(g[t][i]));
      worst = std::max(worst, err);
      ASSERT_LE(err, tol) << specs[t].name << "[" << i << "]: analytic " << g[t][i]
                          << " vs finite difference " << fd;
      ++checked;
    }
  }
  EXPECT_EQ(checked, ParameterCount(m));
  // The gradients are not trivially zero: every tensor carries signal.
  for (size_t t = 0; t < g.size(); ++t) {
    double norm = 0;
    for (double x : g[t]) norm += x * x;
    EXPECT_GT(norm, 1e-12) << specs[t].name;
  }
}

TEST(ReferenceTest, FloatAgreesWithDouble) {
  const ModelConfig m = Tiny();
  Tensors<double> wd = InitWeights<double>(m, 9);
  Tensors<float> wf = InitWeights<float>(m, 9);
  Batch b = MakeBatch(m, 3, 11);
  Tensors<double> gd;
  Tensors<float> gf;
  double ld = ReferenceLossAndGrads(m, wd, b.tokens, b.targets, 3, &gd);
  float lf = ReferenceLossAndGrads(m, wf, b.tokens, b.targets, 3, &gf);
  EXPECT_NEAR(lf, ld, 1e-5 * std::abs(ld));
  for (size_t t = 0; t < gd.size(); ++t) {
    double scale = 0;
    for (double x : gd[t]) scale = std::max(scale, std::abs(x));
    for (size_t i = 0; i < gd[t].size(); ++i) {
      ASSERT_NEAR(gf[t][i], gd[t][i], 1e-4 * scale + 1e-7) << t << "[" << i << "]";
    }
  }
}

TEST(ReferenceTest, AllTargetsIgnoredGivesZeroLossAndGradients) {
  const ModelConfig m = Tiny();
  Tensors<double> w = InitWeights<double>(m, 1);
  Batch b = MakeBatch(m, 1, 2);
  std::fill(b.targets.begin(), b.targets.end(), kIgnoreIndex);
  Tensors<double> g;
  EXPECT_EQ(ReferenceLossAndGrads(m, w, b.tokens, b.targets, 1, &g), 0.0);
  for (const auto& t : g) {
    for (double x : t) ASSERT_EQ(x, 0.0);
  }
}

}  // namespace
}  // namespace plateau
