#include "kernels/model/layers.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/model/config.h"

namespace plateau {
namespace {

std::vector<float> Randn(int64_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> x(n);
  for (auto& e : x) e = d(rng);
  return x;
}

TEST(EmbeddingTest, GathersAndScatterAdds) {
  const int64_t V = 5, H = 3;
  std::vector<float> table = Randn(V * H, 1);
  std::vector<int32_t> tok = {4, 0, 4, 2};
  std::vector<float> out(4 * H);
  EmbeddingForward(table.data(), tok.data(), 4, H, out.data());
  for (int64_t c = 0; c < H; ++c) {
    EXPECT_EQ(out[0 * H + c], table[4 * H + c]);
    EXPECT_EQ(out[3 * H + c], table[2 * H + c]);
  }
  std::vector<float> dout = Randn(4 * H, 2), dt(V * H, 0.0f);
  EmbeddingBackward(dout.data(), tok.data(), 4, H, dt.data());
  for (int64_t c = 0; c < H; ++c) {
    EXPECT_FLOAT_EQ(dt[4 * H + c], dout[0 * H + c] + dout[2 * H + c]);
    EXPECT_EQ(dt[1 * H + c], 0.0f);
  }
}

TEST(RouterTest, TopKRenormalisedWithTiesToLowerIndex) {
  // Row 0: experts 1 and 3 tie for first; row 1: all equal.
  std::vector<float> lg = {0.0f, 2.0f, 1.0f, 2.0f, 5.0f, 5.0f, 5.0f, 5.0f};
  std::vector<float> p(8), g(4);
  std::vector<int32_t> ch(4);
  RouterForward(lg.data(), 2, 4, 2, p.data(), ch.data(), g.data());
  EXPECT_EQ(ch[0], 1);
  EXPECT_EQ(ch[1], 3);
  EXPECT_FLOAT_EQ(g[0], 0.5f);
  EXPECT_EQ(ch[2], 0);
  EXPECT_EQ(ch[3], 1);
  EXPECT_NEAR(p[0] + p[1] + p[2] + p[3], 1.0f, 1e-6);
}

// The router's backward against central finite differences of
// L(logits) = sum_j w_j g_j(logits), in double-checked float (the routing
// must not flip under the perturbation, so the logits are well separated).
TEST(RouterTest, BackwardMatchesFiniteDifferences) {
  const int64_t R = 3, E = 6, K = 3;
  std::vector<float> lg = {0.1f, 1.3f, -0.7f, 2.2f, 0.6f, -1.5f,
                           1.0f, -0.2f, 0.4f, -1.1f, 2.5f, 0.9f,
                           -0.5f, 0.3f, 1.8f, 1.2f, -2.0f, 0.0f};
  std::vector<float> w = Randn(R * K, 3);
  auto loss = [&](const std::vector<float>& x) {
    std::vector<float> p(R * E), g(R * K);
    std::vector<int32_t> ch(R * K);
    RouterForward(x.data(), R, E, K, p.data(), ch.data(), g.data());
    double l = 0;
    for (int64_t i = 0; i < R * K; ++i) l += double(w[i]) * g[i];
    return l;
  };
  std::vector<float> p(R * E), g(R * K), dl(R * E);
  std::vector<int32_t> ch(R * K);
  RouterForward(lg.data(), R, E, K, p.data(), ch.data(), g.data());
  RouterBackward(p.data(), ch.data(), g.data(), w.data(), R, E, K, dl.data());
  const float h = 1e-2f;
  for (int64_t i = 0; i < R * E; ++i) {
    std::vector<float> up = lg, dn = lg;
    up[i] += h;
    dn[i] -= h;
    const double fd = (loss(up) - loss(dn)) / (2 * h);
    EXPECT_NEAR(dl[i], fd, 2e-3 * std::max(1.0, std::abs(fd))) << i;
  }
}

TEST(CrossEntropyTest, LossAndGradientMatchTheDefinition) {
  const int64_t R = 4, V = 7;
  std::vector<float> lg = Randn(R * V, 5, 3.0f);
  std::vector<int32_t> tg = {3, kIgnoreIndex, 0, 6};
  std::vector<float> lse(R);
  int64_t valid = 0;
  double total = CrossEntropyForward(lg.data(), tg.data(), R, V, lse.data(), &valid);
  EXPECT_EQ(valid, 3);
  double want = 0;
  for (int64_t r : {0, 2, 3}) {
    double s = 0;
    for (int64_t c = 0; c < V; ++c) s += std::exp(double(lg[r * V + c]));
    want += std::log(s) - lg[r * V + tg[r]];
  }
  EXPECT_NEAR(total, want, 1e-5 * want);
  std::vector<float> grad = lg;
  CrossEntropyBackward(grad.data(), lse.data(), tg.data(), R, V, 1.0f / 3);
  for (int64_t c = 0; c < V; ++c) EXPECT_EQ(grad[1 * V + c], 0.0f);
  double row_sum = 0;
  for (int64_t c = 0; c < V; ++c) row_sum += grad[0 * V + c];
  EXPECT_NEAR(row_sum, 0.0, 1e-7);  // softmax - onehot sums to zero
  double s = 0;
  for (int64_t c = 0; c < V; ++c) s += std::exp(double(lg[c]));
  EXPECT_NEAR(grad[3], (std::exp(double(lg[3])) / s - 1.0) / 3, 1e-6);
}

TEST(CrossEntropyTest, ExtremeLogitsDoNotOverflow) {
  std::vector<float> lg = {1e30f, -1e30f, 0.0f, 88.0f, 89.0f, -100.0f};
  std::vector<int32_t> tg = {1, 2};
  std::vector<float> lse(2);
  int64_t valid = 0;
  double total = CrossEntropyForward(lg.data(), tg.data(), 2, 3, lse.data(), &valid);
  EXPECT_TRUE(std::isfinite(total));
  CrossEntropyBackward(lg.data(), lse.data(), tg.data(), 2, 3, 0.5f);
  for (float x : lg) EXPECT_TRUE(std::isfinite(x));
}

TEST(DispatchRowsTest, GatherCombineAndDots) {
  const int64_t W = 3;
  std::vector<float> src = {0, 1, 2, 10, 11, 12, 20, 21, 22};  // 3 rows
  std::vector<int32_t> idx = {2, 0, 2};
  std::vector<float> scales = {1.0f, 2.0f, -1.0f}, dst(9);
  GatherRows(src.data(), idx.data(), scales.data(), 3, W, dst.data());
  EXPECT_EQ(dst, (std::vector<float>{20, 21, 22, 0, 2, 4, -20, -21, -22}));
  GatherRows(src.data(), idx.data(), nullptr, 3, W, dst.data());
  EXPECT_EQ(dst, (std::vector<float>{20, 21, 22, 0, 1, 2, 20, 21, 22}));
  // Two tokens, k = 2: token 0 <- rows 1 (w .5) and 2 (w .25); token 1 <- row 0 twice.
  std::vector<int32_t> pos = {1, 2, 0, 0};
  std::vector<float> w = {0.5f, 0.25f, 1.0f, 3.0f}, out(6, 1.0f);
  CombineRows(src.data(), pos.data(), w.data(), 2, 2, W, out.data());
  EXPECT_EQ(out, (std::vector<float>{1 + 5 + 5, 1 + 5.5f + 5.25f, 1 + 6 + 5.5f, 1, 1 + 4, 1 + 8}));
  std::vector<float> a = {1, 0, 0, 0, 1, 1}, dots(4);
  RowDots(a.data(), src.data(), pos.data(), 2, 2, W, dots.data());
  EXPECT_EQ(dots, (std::vector<float>{10, 20, 3, 3}));
  // Scatter is the inverse of an unscaled gather: rows 0 and 1 go to rows 2
  // and 0 of a 3-row dst; row 1 of dst is untouched.
  std::vector<int32_t> to = {2, 0};
  std::vector<float> scattered(9, -1.0f);
  ScatterRows(src.data(), 2, to.data(), W, scattered.data());
  EXPECT_EQ(scattered, (std::vector<float>{10, 11, 12, -1, -1, -1, 0, 1, 2}));
}

}  // namespace
}  // namespace plateau
