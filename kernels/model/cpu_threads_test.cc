// The CPU kernels split their work by the problem's size only, so every
// output is the same bits without a pool and with pools of 1, 2 and 3
// threads (kernels/cpu_pool.h). Shapes are chosen so that every kernel
// splits into several tasks with a ragged last one.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu_ops.h"
#include "kernels/cpu_pool.h"
#include "kernels/model/attention.h"
#include "kernels/model/config.h"
#include "kernels/model/layers.h"

namespace plateau {
namespace {

std::vector<float> Randn(int64_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> x(n);
  for (float& e : x) e = d(rng);
  return x;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// Runs `kernel` (which fills `outputs` from fixed inputs) with no pool and
// with pools of 1, 2 and 3 threads; every run must give the same bits.
void ExpectSameForAnyPool(const std::string& what,
                          const std::function<std::vector<std::vector<float>>(CpuPool*)>& kernel) {
  const std::vector<std::vector<float>> want = kernel(nullptr);
  for (int threads : {1, 2, 3}) {
    CpuPool pool(threads);
    for (int rep = 0; rep < 2; ++rep) {  // and run to run
      const std::vector<std::vector<float>> got = kernel(&pool);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(SameBits(got[i], want[i]))
            << what << ": output " << i << " differs with " << threads << " threads";
      }
    }
  }
}

TEST(CpuThreadsTest, ElementwiseAndOptimizerOps) {
  const int64_t n = 200003;  // several 64K-element tasks, ragged
  const std::vector<float> a = Randn(n, 1), b = Randn(n, 2), c = Randn(n, 3, 4.0f);
  ExpectSameForAnyPool("swiglu", [&](CpuPool* p) {
    std::vector<float> out(n), dg(n), du(n);
    cpu::SwiGluForward(out.data(), c.data(), b.data(), n, p);
    cpu::SwiGluBackward(dg.data(), du.data(), a.data(), c.data(), b.data(), n, p);
    return std::vector<std::vector<float>>{out, dg, du};
  });
  ExpectSameForAnyPool("axpy/add/mul/scale/fill", [&](CpuPool* p) {
    std::vector<float> y = a, s(n), m(n), f(n);
    cpu::Axpy(y.data(), b.data(), n, 0.5f, p);
    cpu::Add(s.data(), a.data(), b.data(), n, p);
    cpu::Mul(m.data(), a.data(), b.data(), n, p);
    cpu::Scale(m.data(), n, 3.0f, p);
    cpu::Fill(f.data(), n, 2.0f, p);
    return std::vector<std::vector<float>>{y, s, m, f};
  });
  ExpectSameForAnyPool("adamw", [&](CpuPool* p) {
    std::vector<float> param = a, m(n, 0.1f), v(n, 0.2f);
    AdamWArgs args;
    args.step = 3;
    cpu::AdamW(param.data(), b.data(), m.data(), v.data(), n, args, p);
    return std::vector<std::vector<float>>{param, m, v};
  });
}

// GEMMs split C's rows into tasks fixed by m (2 tasks for m = 1100: 560
// rows and a ragged 540), one sgemm each; every transpose, beta != 0.
// Also checked against a double reference: OpenBLAS's float sums over k =
// 300 products of N(0, 1) values, within 1e-4 of the largest |C|.
TEST(CpuThreadsTest, GemmAndSums) {
  const int64_t m = 1100, n = 70, k = 300;
  ASSERT_EQ(cpu::GemmRowsPerTask(m), 560);
  ASSERT_GE(cpu::GemmWork(m, n, k), kPoolMinWork);  // the pool runs it (PoolFor)
  const std::vector<float> a = Randn(m * k, 21), b = Randn(k * n, 22), c0 = Randn(m * n, 23);
  for (int trans = 0; trans < 4; ++trans) {
    const bool ta = trans & 1, tb = trans & 2;
    GemmArgs g{ta, tb, m, n, k, 0.75f, a.data(), ta ? m : k, b.data(), tb ? k : n, 0.5f,
               nullptr, n};
    std::vector<double> want(m * n);
    double mag = 0;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t p = 0; p < k; ++p) {
          acc += double{ta ? a[p * m + i] : a[i * k + p]} * (tb ? b[j * k + p] : b[p * n + j]);
        }
        want[i * n + j] = 0.75 * acc + 0.5 * c0[i * n + j];
        mag = std::max(mag, std::abs(want[i * n + j]));
      }
    }
    ExpectSameForAnyPool("gemm " + std::to_string(trans), [&](CpuPool* p) {
      std::vector<float> c = c0;
      GemmArgs gc = g;
      gc.c = c.data();
      cpu::Gemm(gc, p);
      return std::vector<std::vector<float>>{c};
    });
    std::vector<float> c = c0;
    g.c = c.data();
    CpuPool pool(2);
    cpu::Gemm(g, &pool);
    for (int64_t i = 0; i < m * n; ++i) ASSERT_NEAR(c[i], want[i], 1e-4 * mag) << trans << " " << i;
  }
  // Sums: 4 blocks of 256K elements and a ragged fifth.
  const int64_t len = 4 * (int64_t{1} << 18) + 12345;
  const std::vector<float> x = Randn(len, 24);
  double sum = 0, sq = 0;
  for (float e : x) sum += e, sq += double{e} * e;
  ExpectSameForAnyPool("sums", [&](CpuPool* p) {
    std::vector<float> out(2);
    cpu::Sum(&out[0], x.data(), len, p);
    cpu::SumSquares(&out[1], x.data(), len, p);
    // Double accumulation, rounded once: within a float ulp of the reference.
    EXPECT_NEAR(out[0], sum, 1e-6 * std::abs(sum) + 1e-6);
    EXPECT_NEAR(out[1], sq, 1e-6 * sq);
    return std::vector<std::vector<float>>{out};
  });
}

TEST(CpuThreadsTest, RowOps) {
  const int64_t rows = 203, cols = 515;
  const std::vector<float> x = Randn(rows * cols, 4), w = Randn(cols, 5), dout = Randn(rows * cols, 6);
  ExpectSameForAnyPool("rmsnorm", [&](CpuPool* p) {
    std::vector<float> out(rows * cols), rstd(rows), dx(rows * cols), dw(cols, 0.5f);
    cpu::RmsNormForward(out.data(), rstd.data(), x.data(), w.data(), rows, cols, 1e-5f, p);
    cpu::RmsNormBackward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), rows,
                         cols, p);
    return std::vector<std::vector<float>>{out, rstd, dx, dw};
  });
  ExpectSameForAnyPool("softmax/lse", [&](CpuPool* p) {
    std::vector<float> y(rows * cols), lse(rows);
    cpu::SoftmaxRows(y.data(), x.data(), rows, cols, p);
    cpu::LogSumExpRows(lse.data(), x.data(), rows, cols, p);
    return std::vector<std::vector<float>>{y, lse};
  });
}

TEST(CpuThreadsTest, ModelLayers) {
  const int64_t rows = 301, vocab = 1000, hidden = 300, experts = 8, top_k = 2;
  const std::vector<float> logits = Randn(rows * vocab, 7, 3.0f), table = Randn(vocab * hidden, 8),
                           dh = Randn(rows * hidden, 9), rl = Randn(rows * experts, 10),
                           dg = Randn(rows * top_k, 11);
  std::vector<int32_t> targets(rows), tokens(rows), perm(rows);
  for (int64_t r = 0; r < rows; ++r) {
    targets[r] = r % 7 == 3 ? kIgnoreIndex : static_cast<int32_t>((r * 37) % vocab);
    tokens[r] = static_cast<int32_t>((r * r) % 50);  // repeats: the backward's hard case
    perm[r] = static_cast<int32_t>((r * 17) % rows);  // distinct (17 and 301 are coprime)
  }
  ExpectSameForAnyPool("cross_entropy", [&](CpuPool* p) {
    std::vector<float> lse(rows), g = logits;
    int64_t valid = 0;
    const double loss = CrossEntropyForward(logits.data(), targets.data(), rows, vocab,
                                            lse.data(), &valid, p);
    CrossEntropyBackward(g.data(), lse.data(), targets.data(), rows, vocab, 0.01f, p);
    return std::vector<std::vector<float>>{lse, g, {static_cast<float>(loss)}};
  });
  ExpectSameForAnyPool("ring_dtp strips", [&](CpuPool* p) {
    std::vector<float> m(rows, -INFINITY), s(rows, 0.0f), t(rows, 0.0f), lse(rows), d;
    for (int64_t c0 = 0; c0 < vocab; c0 += 256) {
      const int64_t w = std::min<int64_t>(256, vocab - c0);
      std::vector<float> strip(rows * w);
      for (int64_t r = 0; r < rows; ++r)
        std::copy_n(&logits[r * vocab + c0], w, &strip[r * w]);
      StripFold(strip.data(), rows, w, c0, targets.data(), m.data(), s.data(), t.data(), p);
    }
    int64_t valid = 0;
    StripFinish(m.data(), s.data(), t.data(), targets.data(), rows, lse.data(), &valid);
    std::vector<float> strip(logits.begin(), logits.begin() + rows * 256);
    StripDelta(strip.data(), rows, 256, 0, targets.data(), lse.data(), 0.5f, p);
    return std::vector<std::vector<float>>{m, s, t, lse, strip};
  });
  ExpectSameForAnyPool("embedding", [&](CpuPool* p) {
    std::vector<float> out(rows * hidden), dtable(vocab * hidden, 0.25f);
    EmbeddingForward(table.data(), tokens.data(), rows, hidden, out.data(), p);
    EmbeddingBackward(dh.data(), tokens.data(), rows, hidden, dtable.data(), p);
    return std::vector<std::vector<float>>{out, dtable};
  });
  ExpectSameForAnyPool("router", [&](CpuPool* p) {
    std::vector<float> probs(rows * experts), gates(rows * top_k), dl(rows * experts);
    std::vector<int32_t> chosen(rows * top_k);
    RouterForward(rl.data(), rows, experts, top_k, probs.data(), chosen.data(), gates.data(), p);
    RouterBackward(probs.data(), chosen.data(), gates.data(), dg.data(), rows, experts, top_k,
                   dl.data(), p);
    std::vector<float> ch(chosen.begin(), chosen.end());
    return std::vector<std::vector<float>>{probs, gates, dl, ch};
  });
  ExpectSameForAnyPool("row movement", [&](CpuPool* p) {
    std::vector<float> g(rows * hidden), sc(rows * hidden, 0.0f), comb(rows / 2 * hidden, 1.0f),
        dots(rows / 2 * 2);
    GatherRows(dh.data(), perm.data(), logits.data(), rows, hidden, g.data(), p);
    ScatterRows(dh.data(), rows, perm.data(), hidden, sc.data(), p);
    CombineRows(dh.data(), perm.data(), logits.data(), rows / 2, 2, hidden, comb.data(), p);
    RowDots(dh.data(), g.data(), perm.data(), rows / 2, 2, hidden, dots.data(), p);
    return std::vector<std::vector<float>>{g, sc, comb, dots};
  });
}

TEST(CpuThreadsTest, AttentionAndRope) {
  // Two sequences of 150 rows: 3 query tiles (the last ragged) per head, 4
  // heads over 2 K/V heads; the K/V block starts 40 positions before the
  // queries, so diagonal tiles are partly masked.
  AttentionShape s{2, 150, 190, 4, 2, 32, 40, 0, 1.0f / std::sqrt(32.0f)};
  // Large enough that the pool runs both (PoolFor).
  ASSERT_GE(AttentionForwardFlops(s), kPoolMinWork);
  ASSERT_GE(AttentionBackwardFlops(s), kPoolMinWork);
  const std::vector<float> q = Randn(2 * 150 * 4 * 32, 12), k = Randn(2 * 190 * 2 * 32, 13),
                           v = Randn(2 * 190 * 2 * 32, 14), dout = Randn(2 * 150 * 4 * 32, 15);
  ExpectSameForAnyPool("attention", [&](CpuPool* p) {
    const int64_t rows = 2 * 150 * 4;
    std::vector<float> m(rows), l(rows), o(rows * 32), lse(rows), delta(rows),
        work(AttentionWorkspaceFloats(s)), dq(q.size(), 0.0f), dk(k.size(), 0.0f),
        dv(v.size(), 0.0f);
    AttentionInitState(s, m.data(), l.data(), o.data(), p);
    AttentionForwardBlock(s, q.data(), k.data(), v.data(), m.data(), l.data(), o.data(),
                          work.data(), p);
    AttentionFinalize(s, m.data(), l.data(), o.data(), lse.data(), p);
    AttentionDelta(s, o.data(), dout.data(), delta.data(), p);
    AttentionBackwardBlock(s, q.data(), k.data(), v.data(), dout.data(), lse.data(), delta.data(),
                           dq.data(), dk.data(), dv.data(), work.data(), p);
    std::vector<float> r = q;
    RopeApply(r.data(), 2, 150, 4, 32, 7, 10000.0f, false, p);
    return std::vector<std::vector<float>>{o, lse, delta, dq, dk, dv, r};
  });
}

}  // namespace
}  // namespace plateau
