#include "kernels/model/attention.h"

#include <cmath>
#include <iostream>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu_pool.h"

namespace plateau {
namespace {

struct Problem {
  int64_t batch, len, heads, kv_heads, d;
  std::vector<float> q, k, v, dout;
};

Problem Make(int64_t batch, int64_t len, int64_t heads, int64_t kv_heads,
             int64_t d, uint64_t seed) {
  Problem p{batch, len, heads, kv_heads, d, {}, {}, {}, {}};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  auto fill = [&](std::vector<float>& x, int64_t count) {
    x.resize(count);
    for (auto& e : x) e = n(rng);
  };
  fill(p.q, batch * len * heads * d);
  fill(p.k, batch * len * kv_heads * d);
  fill(p.v, batch * len * kv_heads * d);
  fill(p.dout, batch * len * heads * d);
  return p;
}

// Naive causal GQA attention and its gradients, in double, from the
// definition (docs/MODEL.md).
struct Naive {
  std::vector<double> o, dq, dk, dv;
};

Naive NaiveAttention(const Problem& p) {
  const int64_t B = p.batch, T = p.len, nh = p.heads, nkv = p.kv_heads, d = p.d;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Naive r;
  r.o.assign(B * T * nh * d, 0.0);
  r.dq.assign(B * T * nh * d, 0.0);
  r.dk.assign(B * T * nkv * d, 0.0);
  r.dv.assign(B * T * nkv * d, 0.0);
  auto Q = [&](int64_t b, int64_t t, int64_t h) { return &p.q[((b * T + t) * nh + h) * d]; };
  auto K = [&](int64_t b, int64_t t, int64_t g) { return &p.k[((b * T + t) * nkv + g) * d]; };
  auto Vv = [&](int64_t b, int64_t t, int64_t g) { return &p.v[((b * T + t) * nkv + g) * d]; };
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t g = h / (nh / nkv);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<double> P(t + 1);
        double mx = -INFINITY;
        for (int64_t s = 0; s <= t; ++s) {
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += double(Q(b, t, h)[c]) * K(b, s, g)[c];
          P[s] = dot * scale;
          mx = std::max(mx, P[s]);
        }
        double sum = 0;
        for (auto& x : P) sum += (x = std::exp(x - mx));
        for (auto& x : P) x /= sum;
        double* o = &r.o[((b * T + t) * nh + h) * d];
        for (int64_t s = 0; s <= t; ++s)
          for (int64_t c = 0; c < d; ++c) o[c] += P[s] * Vv(b, s, g)[c];
        const float* dO = &p.dout[((b * T + t) * nh + h) * d];
        std::vector<double> dP(t + 1);
        double dsum = 0;
        for (int64_t s = 0; s <= t; ++s) {
          double acc = 0;
          for (int64_t c = 0; c < d; ++c) {
            acc += double(dO[c]) * Vv(b, s, g)[c];
            r.dv[((b * T + s) * nkv + g) * d + c] += P[s] * dO[c];
          }
          dP[s] = acc;
          dsum += acc * P[s];
        }
        for (int64_t s = 0; s <= t; ++s) {
          const double ds = P[s] * (dP[s] - dsum) * scale;
          for (int64_t c = 0; c < d; ++c) {
            r.dq[((b * T + t) * nh + h) * d + c] += ds * K(b, s, g)[c];
            r.dk[((b * T + s) * nkv + g) * d + c] += ds * Q(b, t, h)[c];
          }
        }
      }
    }
  }
  return r;
}

double MaxAbs(const std::vector<double>& x) {
  double m = 0;
  for (double e : x) m = std::max(m, std::abs(e));
  return m;
}

void ExpectClose(const std::vector<float>& got, const std::vector<double>& want,
                 double rel, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  const double tol = rel * MaxAbs(want);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tol) << what << "[" << i << "]";
  }
}

// Cuts the sequence into `ranks` slices as the layout does, and for each
// "rank" folds every K/V slice in ring order (own first, then p-1, p-2, ...),
// as ring attention delivers them. ranks = 1 is plain tiled attention.
void RingAttention(const Problem& p, int64_t ranks, std::vector<float>* o, std::vector<float>* dq,
                   std::vector<float>* dk, std::vector<float>* dv, CpuPool* pool = nullptr) {
  const int64_t B = p.batch, T = p.len, nh = p.heads, nkv = p.kv_heads, d = p.d;
  const int64_t n = T / ranks;
  auto slice = [&](const std::vector<float>& x, int64_t width, int64_t r) {
    std::vector<float> out(B * n * width);
    for (int64_t b = 0; b < B; ++b)
      std::copy_n(&x[(b * T + r * n) * width], n * width, &out[b * n * width]);
    return out;
  };
  auto unslice = [&](std::vector<float>& x, int64_t width, int64_t r, const std::vector<float>& part) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < n * width; ++i) x[(b * T + r * n) * width + i] += part[b * n * width + i];
  };
  o->assign(B * T * nh * d, 0.0f);
  dq->assign(B * T * nh * d, 0.0f);
  dk->assign(B * T * nkv * d, 0.0f);
  dv->assign(B * T * nkv * d, 0.0f);
  for (int64_t r = 0; r < ranks; ++r) {
    std::vector<float> q = slice(p.q, nh * d, r), dout = slice(p.dout, nh * d, r);
    std::vector<float> m(B * n * nh), l(B * n * nh), acc(B * n * nh * d), lse(B * n * nh),
        delta(B * n * nh), dqr(B * n * nh * d, 0.0f);
    AttentionShape s{B, n, n, nh, nkv, d, r * n, 0, 1.0f / std::sqrt(float(d))};
    std::vector<float> work(AttentionWorkspaceFloats(s));
    AttentionInitState(s, m.data(), l.data(), acc.data(), pool);
    for (int64_t step = 0; step < ranks; ++step) {
      const int64_t src = (r - step + ranks) % ranks;
      s.kv_pos0 = src * n;
      std::vector<float> k = slice(p.k, nkv * d, src), v = slice(p.v, nkv * d, src);
      AttentionForwardBlock(s, q.data(), k.data(), v.data(), m.data(), l.data(), acc.data(), work.data(), pool);
    }
    AttentionFinalize(s, m.data(), l.data(), acc.data(), lse.data(), pool);
    AttentionDelta(s, acc.data(), dout.data(), delta.data(), pool);
    for (int64_t step = 0; step < ranks; ++step) {
      const int64_t src = (r - step + ranks) % ranks;
      s.kv_pos0 = src * n;
      std::vector<float> k = slice(p.k, nkv * d, src), v = slice(p.v, nkv * d, src);
      std::vector<float> dkb(k.size(), 0.0f), dvb(v.size(), 0.0f);
      AttentionBackwardBlock(s, q.data(), k.data(), v.data(), dout.data(), lse.data(), delta.data(), dqr.data(),
                             dkb.data(), dvb.data(), work.data(), pool);
      unslice(*dk, nkv * d, src, dkb);
      unslice(*dv, nkv * d, src, dvb);
    }
    unslice(*o, nh * d, r, acc);
    unslice(*dq, nh * d, r, dqr);
  }
}

class AttentionTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(AttentionTest, MatchesNaiveForwardAndBackward) {
  const int64_t ranks = GetParam();
  // 2 sequences of 300 tokens: slices of 300, 150, 75 and 60 rows, so that
  // 128-row panels are whole, ragged and single; 4 query heads over 2 K/V
  // heads.
  Problem p = Make(2, 300, 4, 2, 16, 7);
  Naive want = NaiveAttention(p);
  std::vector<float> o, dq, dk, dv;
  RingAttention(p, ranks, &o, &dq, &dk, &dv);
  ExpectClose(o, want.o, 1e-5, "o");
  ExpectClose(dq, want.dq, 1e-4, "dq");
  ExpectClose(dk, want.dk, 1e-4, "dk");
  ExpectClose(dv, want.dv, 1e-4, "dv");
}

INSTANTIATE_TEST_SUITE_P(Ranks, AttentionTest, ::testing::Values(1, 2, 4, 5));

TEST(AttentionTest, DeterministicBits) {
  Problem p = Make(1, 260, 2, 1, 8, 3);
  std::vector<float> o1, dq1, dk1, dv1, o2, dq2, dk2, dv2;
  RingAttention(p, 2, &o1, &dq1, &dk1, &dv1);
  RingAttention(p, 2, &o2, &dq2, &dk2, &dv2);
  EXPECT_EQ(o1, o2);
  EXPECT_EQ(dq1, dq2);
  EXPECT_EQ(dk1, dk2);
  EXPECT_EQ(dv1, dv2);
}

// The tile products' instruction sets (scalar, AVX2, AVX-512 where the CPU
// has it) compute each element as the same chain of fused multiply-adds, so
// they must agree bit for bit, and each must match the naive reference.
// head_dim 44 = two whole 16-column panels and a 12-column tail (and K/V
// packs of 5 x 8 columns and a 4-column rest); 300 rows in
// 2 slices of 150 give ragged key tiles (150 = 2 x 64 + 22: a panel and a
// 6-column tail); 4 query heads over 2 K/V heads.
TEST(AttentionTest, EveryTileInstructionSetGivesTheSameBits) {
  Problem p = Make(1, 300, 4, 2, 44, 11);
  Naive want = NaiveAttention(p);
  std::vector<AttentionTileIsa> isas = {AttentionTileIsa::kScalar, AttentionTileIsa::kAvx2,
                                        AttentionTileIsa::kAvx512};
  std::vector<float> o0, dq0, dk0, dv0;
  int ran = 0;
  for (AttentionTileIsa isa : isas) {
    if (!AttentionTileIsaAvailable(isa)) {
      // Not a skip of the comparison: the remaining ones still run.
      std::cout << "tile ISA " << static_cast<int>(isa) << " not available here\n";
      continue;
    }
    SetAttentionTileIsaForTesting(isa);
    ASSERT_EQ(AttentionActiveTileIsa(), isa);
    std::vector<float> o, dq, dk, dv;
    RingAttention(p, 2, &o, &dq, &dk, &dv);
    SetAttentionTileIsaForTesting(AttentionTileIsa::kAuto);
    // The tolerances of MatchesNaiveForwardAndBackward: float chains of 44
    // (scores) and up to 300 (sums over keys/queries) terms against double.
    ExpectClose(o, want.o, 1e-5, "o");
    ExpectClose(dq, want.dq, 1e-4, "dq");
    ExpectClose(dk, want.dk, 1e-4, "dk");
    ExpectClose(dv, want.dv, 1e-4, "dv");
    if (ran++ == 0) {
      o0 = o, dq0 = dq, dk0 = dk, dv0 = dv;
      continue;
    }
    EXPECT_EQ(o, o0) << static_cast<int>(isa);
    EXPECT_EQ(dq, dq0) << static_cast<int>(isa);
    EXPECT_EQ(dk, dk0) << static_cast<int>(isa);
    EXPECT_EQ(dv, dv0) << static_cast<int>(isa);
  }
  // The scalar path always runs; on any x86-64-v3 build so does AVX2.
  EXPECT_GE(ran, 2);
}

// Shapes at the kernels' edges, each against the naive reference and, with
// a pool of 3 threads and under every tile instruction set, bit for bit the
// pool-less scalar result: one token and one head of head_dim 2 (below the
// 8-column packs: the scalar packing), 8 query heads over 1 K/V head at
// head_dim 6 (GQA ratio 8; slices of 13 rows at 5 ranks), and 6 over 3 at
// head_dim 14 with 130 rows (a 64-row tile, another, and a 2-row tail; 7
// columns past a pack). At 2 and more ranks every rank also folds blocks
// that start after its queries (wholly masked).
TEST(AttentionTest, EdgeShapesMatchNaiveWithAndWithoutAPoolOnEveryIsa) {
  struct Case {
    int64_t batch, len, heads, kv_heads, d, ranks;
  };
  CpuPool pool(3);
  for (const Case& c :
       {Case{1, 1, 1, 1, 2, 1}, Case{1, 65, 8, 1, 6, 5}, Case{2, 130, 6, 3, 14, 2}, Case{1, 8, 8, 1, 2, 4}}) {
    SCOPED_TRACE(testing::Message() << "batch " << c.batch << ", len " << c.len << ", heads " << c.heads << "/"
                                    << c.kv_heads << ", d " << c.d << ", ranks " << c.ranks);
    const Problem p = Make(c.batch, c.len, c.heads, c.kv_heads, c.d, 17);
    const Naive want = NaiveAttention(p);
    SetAttentionTileIsaForTesting(AttentionTileIsa::kScalar);
    std::vector<float> o0, dq0, dk0, dv0;
    RingAttention(p, c.ranks, &o0, &dq0, &dk0, &dv0);
    SetAttentionTileIsaForTesting(AttentionTileIsa::kAuto);
    ExpectClose(o0, want.o, 1e-5, "o");
    ExpectClose(dq0, want.dq, 1e-4, "dq");
    ExpectClose(dk0, want.dk, 1e-4, "dk");
    ExpectClose(dv0, want.dv, 1e-4, "dv");
    for (AttentionTileIsa isa : {AttentionTileIsa::kScalar, AttentionTileIsa::kAvx2, AttentionTileIsa::kAvx512}) {
      if (!AttentionTileIsaAvailable(isa)) continue;
      SetAttentionTileIsaForTesting(isa);
      std::vector<float> o, dq, dk, dv;
      RingAttention(p, c.ranks, &o, &dq, &dk, &dv, &pool);
      SetAttentionTileIsaForTesting(AttentionTileIsa::kAuto);
      EXPECT_EQ(o, o0) << "isa " << static_cast<int>(isa);
      EXPECT_EQ(dq, dq0) << "isa " << static_cast<int>(isa);
      EXPECT_EQ(dk, dk0) << "isa " << static_cast<int>(isa);
      EXPECT_EQ(dv, dv0) << "isa " << static_cast<int>(isa);
    }
  }
}

TEST(AttentionTest, ExtremeScoresStayFinite) {
  Problem p = Make(1, 140, 2, 2, 8, 5);
  for (auto& x : p.q) x *= 300.0f;  // scores in the thousands
  std::vector<float> o, dq, dk, dv;
  RingAttention(p, 1, &o, &dq, &dk, &dv);
  for (float x : o) ASSERT_TRUE(std::isfinite(x));
  for (float x : dq) ASSERT_TRUE(std::isfinite(x));
  for (float x : dk) ASSERT_TRUE(std::isfinite(x));
}

TEST(RopeTest, MatchesTheDefinitionAndInverts) {
  const int64_t B = 2, T = 5, H = 3, d = 8, pos0 = 17;
  std::vector<float> x(B * T * H * d);
  std::mt19937_64 rng(1);
  std::normal_distribution<float> n;
  for (auto& e : x) e = n(rng);
  std::vector<float> y = x;
  RopeApply(y.data(), B, T, H, d, pos0, 10000.0f, false);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t j = 0; j < d / 2; ++j) {
          const double freq = std::pow(10000.0, -2.0 * j / d);
          const double a = (pos0 + t) * freq;
          const float* v = &x[((b * T + t) * H + h) * d];
          const float* w = &y[((b * T + t) * H + h) * d];
          EXPECT_NEAR(w[j], v[j] * std::cos(a) - v[j + d / 2] * std::sin(a), 1e-4);
          EXPECT_NEAR(w[j + d / 2], v[j + d / 2] * std::cos(a) + v[j] * std::sin(a), 1e-4);
        }
  RopeApply(y.data(), B, T, H, d, pos0, 10000.0f, true);
  for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(y[i], x[i], 1e-5);
}

}  // namespace
}  // namespace plateau
