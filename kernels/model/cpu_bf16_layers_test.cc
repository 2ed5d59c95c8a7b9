// The model kernels' bf16 ops on the CPU backend (cpu_bf16_layers.h),
// through ModelKernels: bitwise the fp32 function of layers.h on the loaded
// inputs with one rounding per stored bf16 element, and within stated
// bounds of a double reference on the same bf16 inputs: the fp32 work's own
// error (one unit of 2^-24 per fp32 addition or product in the chain) plus
// one bf16 rounding (2^-8 relative: bf16 keeps 8 significant bits).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/model/attention.h"
#include "kernels/model/config.h"
#include "kernels/model/layers.h"
#include "kernels/model/model_kernels.h"
#include "kernels/testing/device_side.h"
#include "kernels/testing/bf16_testing.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

constexpr double kBf16Unit = kBf16UnitRoundoff;

std::vector<int32_t> RandomIndex(int64_t n, int32_t below, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, below - 1);
  std::vector<int32_t> v(n);
  for (int32_t& x : v) x = dist(rng);
  return v;
}

class CpuBf16LayersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    BackendOptions o;
    o.device_memory_bytes = 64 << 20;
    auto b = Backend::Create(o);
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_TRUE(dev_.Init(std::move(*b)).ok());
    auto mk = ModelKernels::Create(dev_.b());
    ASSERT_TRUE(mk.ok()) << mk.status();
    mk_ = std::move(*mk);
  }
  int32_t* UploadIndex(const std::vector<int32_t>& v) {
    // int32 rows through the float upload (same 4 bytes, copied as bits).
    std::vector<float> f(v.size());
    std::memcpy(f.data(), v.data(), v.size() * sizeof(int32_t));
    return reinterpret_cast<int32_t*>(dev_.Upload(f));
  }
  DeviceSide dev_;
  std::unique_ptr<ModelKernels> mk_;
};

TEST_F(CpuBf16LayersTest, EmbeddingCopiesRowsAndItsGradientSumsInFp32RoundedOnce) {
  const int64_t vocab = 50, hidden = 200, rows = 300;  // 300 tokens over 50 ids: repeats
  const std::vector<Bf16> table = RandomBf16(vocab * hidden, 1), dout = RandomBf16(rows * hidden, 2),
                          dtable0 = RandomBf16(vocab * hidden, 3, 0.1f);
  std::vector<int32_t> tokens = RandomIndex(rows, vocab - 1, 4);  // id vocab-1 never used
  const int32_t* dtok = UploadIndex(tokens);
  Bf16* out = dev_.PoisonedBf16(rows * hidden);
  ASSERT_TRUE(mk_->EmbeddingBf16(dev_.s(), dev_.UploadBf16(table), vocab, dtok, rows, hidden, out).ok());
  const std::vector<Bf16> got = dev_.DownloadBf16(out, rows * hidden);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < hidden; ++c) {
      ASSERT_EQ(got[r * hidden + c].bits, table[tokens[r] * hidden + c].bits) << r << "," << c;
    }
  }
  Bf16* dtable = dev_.UploadBf16(dtable0);
  ASSERT_TRUE(mk_->EmbeddingBackwardBf16(dev_.s(), dev_.UploadBf16(dout), dtok, rows, hidden, dtable, vocab).ok());
  const std::vector<Bf16> dt = dev_.DownloadBf16(dtable, vocab * hidden);
  const std::vector<float> df = Loaded(dout);
  const std::vector<float> dt0 = Loaded(dtable0);
  std::vector<double> ref(dt0.begin(), dt0.end()), mag(vocab * hidden);
  std::vector<int64_t> count(vocab, 1);
  for (int64_t i = 0; i < vocab * hidden; ++i) mag[i] = std::fabs(ref[i]);
  for (int64_t r = 0; r < rows; ++r) {
    ++count[tokens[r]];
    for (int64_t c = 0; c < hidden; ++c) {
      ref[tokens[r] * hidden + c] += df[r * hidden + c];
      mag[tokens[r] * hidden + c] += std::fabs(df[r * hidden + c]);
    }
  }
  for (int64_t i = 0; i < vocab * hidden; ++i) {
    const double fp32_err = count[i / hidden] * kFp32Unit * mag[i];
    ASSERT_LE(std::fabs(Bf16ToFloat(dt[i]) - ref[i]), kBf16Unit * (std::fabs(ref[i]) + fp32_err) + fp32_err)
        << i;
  }
  // The unused row keeps its bits; the whole is the rounded fp32 gradient.
  for (int64_t c = 0; c < hidden; ++c) {
    ASSERT_EQ(dt[(vocab - 1) * hidden + c].bits, dtable0[(vocab - 1) * hidden + c].bits);
  }
  std::vector<float> want = Loaded(dtable0);
  EmbeddingBackward(df.data(), tokens.data(), rows, hidden, want.data());
  EXPECT_EQ(Bits(dt), RoundedBits(want));
}

TEST_F(CpuBf16LayersTest, DispatchRowsAreTheRoundedFp32RowsAndWithinBounds) {
  const int64_t src_rows = 40, width = 70, tokens = 25, k = 2;
  const std::vector<Bf16> src = RandomBf16(src_rows * width, 11);
  const std::vector<int32_t> pos = RandomIndex(tokens * k, src_rows, 12);
  std::vector<float> gates(tokens * k);
  {
    std::mt19937 rng(13);
    std::uniform_real_distribution<float> dist(0.0f, 1.0f);
    for (float& g : gates) g = dist(rng);
  }
  const std::vector<float> sf = Loaded(src);
  const Bf16* dsrc = dev_.UploadBf16(src);
  const int32_t* dpos = UploadIndex(pos);
  const float* dgates = dev_.Upload(gates);

  // Gather with scales: dst = rn(scale * src).
  Bf16* gathered = dev_.PoisonedBf16(tokens * k * width);
  ASSERT_TRUE(mk_->GatherRowsBf16(dev_.s(), dsrc, src_rows, dpos, dgates, tokens * k, width, gathered).ok());
  const std::vector<Bf16> g = dev_.DownloadBf16(gathered, tokens * k * width);
  std::vector<float> want(tokens * k * width);
  GatherRows(sf.data(), pos.data(), gates.data(), tokens * k, width, want.data());
  EXPECT_EQ(Bits(g), RoundedBits(want));
  for (int64_t i = 0; i < tokens * k; ++i) {
    for (int64_t c = 0; c < width; ++c) {
      const double ref = static_cast<double>(gates[i]) * sf[pos[i] * width + c];
      ASSERT_LE(std::fabs(Bf16ToFloat(g[i * width + c]) - ref), (kBf16Unit + 2 * kFp32Unit) * std::fabs(ref));
    }
  }

  // Scatter: exact row moves to distinct rows.
  std::vector<int32_t> perm(tokens);
  for (int64_t i = 0; i < tokens; ++i) perm[i] = static_cast<int32_t>((i * 7) % tokens);
  Bf16* scattered = dev_.PoisonedBf16(tokens * width);
  ASSERT_TRUE(mk_->ScatterRowsBf16(dev_.s(), gathered, tokens, UploadIndex(perm), width, scattered, tokens).ok());
  const std::vector<Bf16> sc = dev_.DownloadBf16(scattered, tokens * width);
  for (int64_t i = 0; i < tokens; ++i) {
    for (int64_t c = 0; c < width; ++c) ASSERT_EQ(sc[perm[i] * width + c].bits, g[i * width + c].bits);
  }

  // Combine: out += sum_j w_j src[pos_j], fp32 then one rounding.
  const std::vector<Bf16> out0 = RandomBf16(tokens * width, 14);
  Bf16* out = dev_.UploadBf16(out0);
  ASSERT_TRUE(mk_->CombineRowsBf16(dev_.s(), dsrc, src_rows, dpos, dgates, tokens, k, width, out).ok());
  const std::vector<Bf16> co = dev_.DownloadBf16(out, tokens * width);
  std::vector<float> want_c = Loaded(out0);
  CombineRows(sf.data(), pos.data(), gates.data(), tokens, k, width, want_c.data());
  EXPECT_EQ(Bits(co), RoundedBits(want_c));
  const std::vector<float> o0 = Loaded(out0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < width; ++c) {
      double ref = o0[t * width + c], mag = std::fabs(ref);
      for (int64_t j = 0; j < k; ++j) {
        const double term = static_cast<double>(gates[t * k + j]) * sf[pos[t * k + j] * width + c];
        ref += term;
        mag += std::fabs(term);
      }
      const double fp32_err = 2 * (k + 1) * kFp32Unit * mag;  // k products and k additions
      ASSERT_LE(std::fabs(Bf16ToFloat(co[t * width + c]) - ref), kBf16Unit * (std::fabs(ref) + fp32_err) + fp32_err);
    }
  }

  // RowDots: fp32 out (the gates' gradient), a double sum rounded once.
  const std::vector<Bf16> a = RandomBf16(tokens * width, 15);
  float* dots = dev_.Poisoned(tokens * k);
  ASSERT_TRUE(mk_->RowDotsBf16(dev_.s(), dev_.UploadBf16(a), dsrc, src_rows, dpos, tokens, k, width, dots).ok());
  const std::vector<float> d = dev_.Download(dots, tokens * k), af = Loaded(a);
  std::vector<float> want_d(tokens * k);
  RowDots(af.data(), sf.data(), pos.data(), tokens, k, width, want_d.data());
  EXPECT_EQ(d, want_d);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      double ref = 0, mag = 0;
      for (int64_t c = 0; c < width; ++c) {
        const double term = static_cast<double>(af[t * width + c]) * sf[pos[t * k + j] * width + c];
        ref += term;
        mag += std::fabs(term);
      }
      ASSERT_LE(std::fabs(d[t * k + j] - ref), kFp32Unit * std::fabs(ref) + 1e-12 * mag);
    }
  }
}

// Rope: bitwise the rounded fp32 rotation of the loaded values (the fp32
// rotation is tested against double in attention_test).
TEST_F(CpuBf16LayersTest, RopeIsTheRoundedFp32Rotation) {
  const int64_t batch = 2, len = 9, heads = 3, head_dim = 8, n = batch * len * heads * head_dim;
  const std::vector<Bf16> x = RandomBf16(n, 21);
  for (bool inverse : {false, true}) {
    Bf16* dx = dev_.UploadBf16(x);
    ASSERT_TRUE(mk_->RopeBf16(dev_.s(), dx, batch, len, heads, head_dim, 5, 10000.0f, inverse).ok());
    std::vector<float> want = Loaded(x);
    RopeApply(want.data(), batch, len, heads, head_dim, 5, 10000.0f, inverse);
    EXPECT_EQ(Bits(dev_.DownloadBf16(dx, n)), RoundedBits(want)) << "inverse " << inverse;
  }
}

// Cross-entropy on bf16 logits: lse and the loss sum are the fp32 function's
// on the loaded logits (no bf16 rounding: fp32 and double outputs), within
// 8u (|lse| + 1) of a double log-sum-exp; the gradient is the rounded fp32
// gradient, within 2^-8 |ref| + 8u scale of (softmax - onehot) scale. The
// Ring-DTP strips over two column ranges give the same lse within the same
// bound, and their deltas are the rounded fp32 deltas.
TEST_F(CpuBf16LayersTest, CrossEntropyAndStripsOnBf16Logits) {
  const int64_t rows = 13, vocab = 300;
  const std::vector<Bf16> logits = RandomBf16(rows * vocab, 31, 3.0f);
  std::vector<int32_t> targets = RandomIndex(rows, vocab, 32);
  targets[4] = kIgnoreIndex;
  const std::vector<float> lf = Loaded(logits);
  const int32_t* dt = UploadIndex(targets);
  float* lse = dev_.Poisoned(rows);
  double* stats = reinterpret_cast<double*>(dev_.Upload(std::vector<float>(4, 0.0f)));
  ASSERT_TRUE(mk_->CrossEntropyBf16(dev_.s(), dev_.UploadBf16(logits), dt, rows, vocab, lse, stats).ok());
  const std::vector<float> got_lse = dev_.Download(lse, rows);
  const std::vector<float> st = dev_.Download(reinterpret_cast<float*>(stats), 4);
  double got_stats[2];
  std::memcpy(got_stats, st.data(), sizeof(got_stats));
  std::vector<float> want_lse(rows);
  int64_t valid = 0;
  const double want_sum = CrossEntropyForward(lf.data(), targets.data(), rows, vocab, want_lse.data(), &valid);
  EXPECT_EQ(got_lse, want_lse);
  EXPECT_EQ(got_stats[0], want_sum);
  EXPECT_EQ(got_stats[1], static_cast<double>(valid));
  EXPECT_EQ(valid, rows - 1);
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] == kIgnoreIndex) continue;
    double mx = -INFINITY, sum = 0;
    for (int64_t c = 0; c < vocab; ++c) mx = std::max(mx, static_cast<double>(lf[r * vocab + c]));
    for (int64_t c = 0; c < vocab; ++c) sum += std::exp(lf[r * vocab + c] - mx);
    const double ref = mx + std::log(sum);
    ASSERT_LE(std::fabs(got_lse[r] - ref), 8 * kFp32Unit * (std::fabs(ref) + 1)) << r;
  }

  const float scale = 1.0f / static_cast<float>(valid);
  Bf16* grad = dev_.UploadBf16(logits);
  ASSERT_TRUE(mk_->CrossEntropyBackwardBf16(dev_.s(), grad, lse, dt, rows, vocab, scale).ok());
  const std::vector<Bf16> g = dev_.DownloadBf16(grad, rows * vocab);
  std::vector<float> want_g = lf;
  CrossEntropyBackward(want_g.data(), want_lse.data(), targets.data(), rows, vocab, scale);
  EXPECT_EQ(Bits(g), RoundedBits(want_g));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < vocab; ++c) {
      const double p = targets[r] == kIgnoreIndex ? 0.0 : std::exp(lf[r * vocab + c] - double{got_lse[r]});
      const double ref = targets[r] == kIgnoreIndex ? 0.0 : (p - (c == targets[r] ? 1.0 : 0.0)) * scale;
      ASSERT_LE(std::fabs(Bf16ToFloat(g[r * vocab + c]) - ref), kBf16Unit * std::fabs(ref) + 8 * kFp32Unit * scale)
          << r << "," << c;
    }
  }

  // Strips: columns [0, 120) and [120, 300), each a packed rows x width block.
  float* state = dev_.Poisoned(3 * rows);
  ASSERT_TRUE(mk_->StripInit(dev_.s(), state, rows).ok());
  std::vector<float> m(rows, -INFINITY), sm(rows, 0.0f), t(rows, 0.0f);
  std::vector<std::vector<Bf16>> strips;
  for (auto [col0, width] : {std::pair<int64_t, int64_t>{0, 120}, {120, 180}}) {
    std::vector<Bf16> strip(rows * width);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < width; ++c) strip[r * width + c] = logits[r * vocab + col0 + c];
    }
    ASSERT_TRUE(mk_->StripFoldBf16(dev_.s(), dev_.UploadBf16(strip), rows, width, col0, dt, state, rows).ok());
    const std::vector<float> sf = Loaded(strip);
    StripFold(sf.data(), rows, width, col0, targets.data(), m.data(), sm.data(), t.data());
    strips.push_back(strip);
  }
  std::vector<float> want_state = m;
  want_state.insert(want_state.end(), sm.begin(), sm.end());
  want_state.insert(want_state.end(), t.begin(), t.end());
  EXPECT_EQ(dev_.Download(state, 3 * rows), want_state);
  float* strip_lse = dev_.Poisoned(rows);
  double* strip_stats = reinterpret_cast<double*>(dev_.Upload(std::vector<float>(4, 0.0f)));
  ASSERT_TRUE(mk_->StripFinish(dev_.s(), state, dt, rows, strip_lse, strip_stats).ok());
  const std::vector<float> sl = dev_.Download(strip_lse, rows);
  for (int64_t r = 0; r < rows; ++r) {
    ASSERT_LE(std::fabs(double{sl[r]} - got_lse[r]), 16 * kFp32Unit * (std::fabs(got_lse[r]) + 1)) << r;
  }
  int64_t col0 = 0;
  for (const std::vector<Bf16>& strip : strips) {
    const int64_t width = static_cast<int64_t>(strip.size()) / rows;
    Bf16* d = dev_.UploadBf16(strip);
    ASSERT_TRUE(mk_->StripDeltaBf16(dev_.s(), d, rows, width, col0, dt, strip_lse, scale).ok());
    std::vector<float> want_d = Loaded(strip);
    StripDelta(want_d.data(), rows, width, col0, targets.data(), sl.data(), scale);
    EXPECT_EQ(Bits(dev_.DownloadBf16(d, rows * width)), RoundedBits(want_d)) << "col0 " << col0;
    col0 += width;
  }
}

// Ring attention's block pairs on bf16 q, k, v, dO: a rank's queries meet
// two K/V blocks (the previous rank's, then its own, causal), as two ring
// hops do. The fp32 state (m, l, acc), lse, delta, dq and the travelling
// dK / dV are bitwise the fp32 functions' on the loaded inputs (no bf16
// rounding: they stay fp32; ring attention rounds dq and dK / dV once, at
// the end, ring_attention_test). attention_test holds the fp32 functions to
// a double reference.
TEST_F(CpuBf16LayersTest, AttentionBlockPairsAreTheFp32OnesOnLoadedInputs) {
  const int64_t B = 2, T = 12, nh = 4, kvh = 2, d = 8;
  const int64_t nq = B * T * nh * d, nk = B * T * kvh * d, rows = B * T * nh;
  AttentionShape own{B, T, T, nh, kvh, d, T, T, 1.0f / std::sqrt(float(d))};
  AttentionShape prev = own;
  prev.kv_pos0 = 0;  // the block of the rank before: every key visible
  const std::vector<Bf16> q = RandomBf16(nq, 31), dout = RandomBf16(nq, 32),
                          dq0 = RandomBf16(nq, 33, 0.01f);
  const std::vector<Bf16> kp = RandomBf16(nk, 34), vp = RandomBf16(nk, 35), ko = RandomBf16(nk, 36),
                          vo = RandomBf16(nk, 37);
  const int64_t wf = AttentionWorkspaceFloats(own);
  // Device side.
  float* m = dev_.Poisoned(rows);
  float* l = dev_.Poisoned(rows);
  float* acc = dev_.Poisoned(nq);
  float* work = dev_.Poisoned(wf);
  const Bf16 *dqq = dev_.UploadBf16(q), *ddo = dev_.UploadBf16(dout);
  const Bf16 *dkp = dev_.UploadBf16(kp), *dvp = dev_.UploadBf16(vp), *dko = dev_.UploadBf16(ko),
             *dvo = dev_.UploadBf16(vo);
  ASSERT_TRUE(mk_->AttentionInit(dev_.s(), own, m, l, acc).ok());
  ASSERT_TRUE(mk_->AttentionForwardBlockBf16(dev_.s(), prev, dqq, dkp, dvp, m, l, acc, work).ok());
  ASSERT_TRUE(mk_->AttentionForwardBlockBf16(dev_.s(), own, dqq, dko, dvo, m, l, acc, work).ok());
  const std::vector<float> got_m = dev_.Download(m, rows), got_l = dev_.Download(l, rows);
  float* lse = dev_.Poisoned(rows);
  ASSERT_TRUE(mk_->AttentionFinalize(dev_.s(), own, m, l, acc, lse).ok());
  float* delta = dev_.Poisoned(rows);
  ASSERT_TRUE(mk_->AttentionDeltaBf16(dev_.s(), own, acc, ddo, delta).ok());
  float* dq = dev_.Upload(Loaded(dq0));  // fp32: the ring rounds it once, at the end
  float* dk = dev_.Upload(std::vector<float>(2 * nk, 0.0f));
  float* dv = dk + nk;
  ASSERT_TRUE(mk_->AttentionBackwardBlockBf16(dev_.s(), own, dqq, dko, dvo, ddo, lse, delta, dq, dk,
                                              dv, work).ok());
  const std::vector<float> dq_after_one = dev_.Download(dq, nq);
  const std::vector<float> dk_own = dev_.Download(dk, 2 * nk);
  ASSERT_TRUE(dev_.b().Fill(dev_.s(), dk, 2 * nk, 0.0f).ok());
  ASSERT_TRUE(mk_->AttentionBackwardBlockBf16(dev_.s(), prev, dqq, dkp, dvp, ddo, lse, delta, dq, dk,
                                              dv, work).ok());
  // Host side: the fp32 functions on the loaded values.
  const std::vector<float> qf = Loaded(q), df = Loaded(dout), kpf = Loaded(kp), vpf = Loaded(vp),
                           kof = Loaded(ko), vof = Loaded(vo);
  std::vector<float> wm(rows), wl(rows), wacc(nq), wwork(wf), wlse(rows), wdelta(rows);
  AttentionInitState(own, wm.data(), wl.data(), wacc.data());
  AttentionForwardBlock(prev, qf.data(), kpf.data(), vpf.data(), wm.data(), wl.data(), wacc.data(),
                        wwork.data());
  AttentionForwardBlock(own, qf.data(), kof.data(), vof.data(), wm.data(), wl.data(), wacc.data(),
                        wwork.data());
  EXPECT_EQ(got_m, wm);
  EXPECT_EQ(got_l, wl);
  AttentionFinalize(own, wm.data(), wl.data(), wacc.data(), wlse.data());
  EXPECT_EQ(dev_.Download(acc, nq), wacc);  // o stays fp32
  EXPECT_EQ(dev_.Download(lse, rows), wlse);
  AttentionDelta(own, wacc.data(), df.data(), wdelta.data());
  EXPECT_EQ(dev_.Download(delta, rows), wdelta);
  std::vector<float> wdq = Loaded(dq0), wdk(2 * nk, 0.0f);
  AttentionBackwardBlock(own, qf.data(), kof.data(), vof.data(), df.data(), wlse.data(),
                         wdelta.data(), wdq.data(), wdk.data(), wdk.data() + nk, wwork.data());
  EXPECT_EQ(dq_after_one, wdq);
  EXPECT_EQ(dk_own, wdk);
  // The second hop adds to the fp32 dq: nothing rounded between hops.
  std::fill(wdk.begin(), wdk.end(), 0.0f);
  AttentionBackwardBlock(prev, qf.data(), kpf.data(), vpf.data(), df.data(), wlse.data(),
                         wdelta.data(), wdq.data(), wdk.data(), wdk.data() + nk, wwork.data());
  EXPECT_EQ(dev_.Download(dq, nq), wdq);
  EXPECT_EQ(dev_.Download(dk, 2 * nk), wdk);
}

TEST_F(CpuBf16LayersTest, ArgumentsAreCheckedNamingTheOp) {
  Bf16 x[4] = {};
  int32_t idx[2] = {0, 1};
  EXPECT_THAT(mk_->GatherRowsBf16(dev_.s(), x, 2, idx, nullptr, 2, 2, nullptr).message(),
              HasSubstr("gather_rows_bf16: dst is null"));
  EXPECT_THAT(mk_->ScatterRowsBf16(dev_.s(), x, 2, idx, 2, x, 1).message(),
              HasSubstr("scatter_rows_bf16: dst_rows = 1 cannot hold 2 distinct rows"));
  EXPECT_THAT(mk_->EmbeddingBackwardBf16(dev_.s(), x, idx, 2, 2, x, 0).message(),
              HasSubstr("embedding_backward_bf16: vocab must be >= 1"));
  EXPECT_THAT(mk_->RopeBf16(dev_.s(), x, 1, 1, 1, 3, 0, 10000.0f, false).message(),
              HasSubstr("rope_bf16: head_dim must be even, got 3"));
  float st[3];
  EXPECT_THAT(mk_->StripFoldBf16(dev_.s(), x, 2, 2, 0, idx, st, 1).message(),
              HasSubstr("strip_fold_bf16: stride = 1 must be >= rows = 2"));
  AttentionShape bad{1, 2, 2, 3, 2, 4, 0, 0, 0.5f};
  EXPECT_THAT(mk_->AttentionForwardBlockBf16(dev_.s(), bad, x, x, x, st, st, st, st).message(),
              HasSubstr("attention_forward_block_bf16: kv_heads = 2 must divide heads = 3"));
  AttentionShape ok{1, 2, 2, 2, 2, 4, 0, 0, 0.5f};
  EXPECT_THAT(mk_->AttentionDeltaBf16(dev_.s(), ok, st, nullptr, st).message(),
              HasSubstr("attention_delta_bf16: dout is null"));
  EXPECT_THAT(mk_->AttentionBackwardBlockBf16(dev_.s(), ok, x, x, x, x, st, st, nullptr, st, st, st)
                  .message(),
              HasSubstr("attention_backward_block_bf16: dq is null"));
}

}  // namespace
}  // namespace plateau
