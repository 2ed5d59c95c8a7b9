// WorkingOps<W> (working_ops.h), the one call surface of the step's and the
// schedules' template bodies: on the same bf16-representable inputs, each
// WorkingOps<Bf16> op is the WorkingOps<float> op rounded once per stored
// bf16 element, and bitwise equal to it where the plan keeps fp32 (rstd,
// attention state, fp32 GEMM outputs, norms, the AdamW master). That is
// the property the bf16 step's tolerance against the fp32 step is derived
// from (one rounding of 2^-8 relative per stored value), checked here op by
// op; a call forwarded with its arguments swapped or to the wrong op fails.
#include "kernels/model/working_ops.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/model/attention.h"
#include "kernels/model/model_kernels.h"
#include "kernels/testing/device_side.h"
#include "kernels/testing/bf16_testing.h"

namespace plateau {
namespace {

using F = WorkingOps<float>;
using B = WorkingOps<Bf16>;

class WorkingOpsTest : public ::testing::Test {
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
  // The same values on the device, as fp32 and as bf16.
  float* F32(const std::vector<float>& v) { return dev_.Upload(v); }
  Bf16* B16(const std::vector<float>& v) { return dev_.UploadBf16(Rounded(v)); }
  DeviceSide dev_;
  std::unique_ptr<ModelKernels> mk_;
};

TEST_F(WorkingOpsTest, GemmsAreTheFp32GemmRoundedOnceOrKeptFp32) {
  const int64_t m = 9, n = 7, k = 33;
  const std::vector<float> a = Representable(k * m, 1), b = Representable(k * n, 2),
                           c = Representable(m * n, 3);
  // C = 0.5 A^T B + C, stored in the working type.
  float* cf = F32(c);
  ASSERT_TRUE(F::Gemm(dev_.b(), dev_.s(), {true, false, m, n, k, 0.5f, F32(a), m, F32(b), n, 1.0f,
                                           cf, n}).ok());
  Bf16* cb = B16(c);
  ASSERT_TRUE(B::Gemm(dev_.b(), dev_.s(), {true, false, m, n, k, 0.5f, B16(a), m, B16(b), n, 1.0f,
                                           cb, n}).ok());
  const std::vector<float> want = dev_.Download(cf, m * n);
  EXPECT_EQ(Bits(dev_.DownloadBf16(cb, m * n)), RoundedBits(want));
  // An fp32 C (the router's logits): no rounding at all.
  float* acc = dev_.Poisoned(m * n);
  ASSERT_TRUE(B::GemmAccum(dev_.b(), dev_.s(), {true, false, m, n, k, 0.5f, B16(a), m, B16(b), n,
                                                0.0f, acc, n}).ok());
  float* acc32 = dev_.Poisoned(m * n);
  ASSERT_TRUE(F::GemmAccum(dev_.b(), dev_.s(), {true, false, m, n, k, 0.5f, F32(a), m, F32(b), n,
                                                0.0f, acc32, n}).ok());
  EXPECT_EQ(dev_.Download(acc, m * n), dev_.Download(acc32, m * n));
}

TEST_F(WorkingOpsTest, ElementwiseAndRowOpsAreTheFp32OnesRoundedOnce) {
  const int64_t rows = 6, cols = 40, n = rows * cols;
  const std::vector<float> x = Representable(n, 11), y = Representable(n, 12),
                           w = Representable(cols, 13);
  // SwiGLU.
  float* of = dev_.Poisoned(n);
  Bf16* ob = dev_.PoisonedBf16(n);
  ASSERT_TRUE(F::SwiGluForward(dev_.b(), dev_.s(), of, F32(x), F32(y), n).ok());
  ASSERT_TRUE(B::SwiGluForward(dev_.b(), dev_.s(), ob, B16(x), B16(y), n).ok());
  EXPECT_EQ(Bits(dev_.DownloadBf16(ob, n)), RoundedBits(dev_.Download(of, n)));
  // Add.
  ASSERT_TRUE(F::Add(dev_.b(), dev_.s(), of, F32(x), F32(y), n).ok());
  ASSERT_TRUE(B::Add(dev_.b(), dev_.s(), ob, B16(x), B16(y), n).ok());
  EXPECT_EQ(Bits(dev_.DownloadBf16(ob, n)), RoundedBits(dev_.Download(of, n)));
  // RMSNorm: rstd is fp32 in both and equal; the output rounded once.
  float *rf = dev_.Poisoned(rows), *rb = dev_.Poisoned(rows);
  ASSERT_TRUE(F::RmsNormForward(dev_.b(), dev_.s(), of, rf, F32(x), F32(w), rows, cols, 1e-5f).ok());
  ASSERT_TRUE(B::RmsNormForward(dev_.b(), dev_.s(), ob, rb, B16(x), B16(w), rows, cols, 1e-5f).ok());
  EXPECT_EQ(dev_.Download(rb, rows), dev_.Download(rf, rows));
  EXPECT_EQ(Bits(dev_.DownloadBf16(ob, n)), RoundedBits(dev_.Download(of, n)));
  // Rope in place.
  float* pf = F32(x);
  Bf16* pb = B16(x);
  ASSERT_TRUE(F::Rope(*mk_, dev_.s(), pf, 2, 3, 5, 8, 4, 10000.0f, false).ok());
  ASSERT_TRUE(B::Rope(*mk_, dev_.s(), pb, 2, 3, 5, 8, 4, 10000.0f, false).ok());
  EXPECT_EQ(Bits(dev_.DownloadBf16(pb, n)), RoundedBits(dev_.Download(pf, n)));
  // Sum of squares: an fp32 reduction in both, equal.
  float *sf = dev_.Poisoned(1), *sb = dev_.Poisoned(1);
  ASSERT_TRUE(F::SumSquares(dev_.b(), dev_.s(), sf, F32(x), n).ok());
  ASSERT_TRUE(B::SumSquares(dev_.b(), dev_.s(), sb, B16(x), n).ok());
  EXPECT_EQ(dev_.Download(sb, 1), dev_.Download(sf, 1));
  // Fill, and the conversions' round trip.
  ASSERT_TRUE(B::Fill(dev_.b(), dev_.s(), ob, n, 0.0f).ok());
  for (const Bf16& v : dev_.DownloadBf16(ob, n)) ASSERT_EQ(v.bits, 0);
  const std::vector<float> z = Representable(n, 14, 100.0f);
  ASSERT_TRUE(B::FromFloat(dev_.b(), dev_.s(), ob, F32(z), n).ok());
  float* back = dev_.Poisoned(n);
  ASSERT_TRUE(B::ToFloat(dev_.b(), dev_.s(), back, ob, n).ok());
  EXPECT_EQ(dev_.Download(back, n), z);  // representable: exact both ways
}

// The attention block keeps its state fp32: the bf16 instantiation's m, l
// and acc equal the fp32 one's on the same values, bit for bit.
TEST_F(WorkingOpsTest, AttentionStateIsFp32InBothPrecisions) {
  const int64_t Bt = 1, T = 10, nh = 2, kvh = 1, d = 8, nq = Bt * T * nh * d, nk = Bt * T * kvh * d;
  const AttentionShape sh{Bt, T, T, nh, kvh, d, 0, 0, 1.0f / std::sqrt(8.0f)};
  const std::vector<float> q = Representable(nq, 21), k = Representable(nk, 22),
                           v = Representable(nk, 23);
  std::vector<float> state[2];
  for (int p = 0; p < 2; ++p) {
    float *m = dev_.Poisoned(Bt * T * nh), *l = dev_.Poisoned(Bt * T * nh), *acc = dev_.Poisoned(nq);
    float* work = dev_.Poisoned(AttentionWorkspaceFloats(sh));
    ASSERT_TRUE(mk_->AttentionInit(dev_.s(), sh, m, l, acc).ok());
    if (p == 0) {
      ASSERT_TRUE(F::AttentionForwardBlock(*mk_, dev_.s(), sh, F32(q), F32(k), F32(v), m, l, acc, work).ok());
    } else {
      ASSERT_TRUE(B::AttentionForwardBlock(*mk_, dev_.s(), sh, B16(q), B16(k), B16(v), m, l, acc, work).ok());
    }
    state[p] = dev_.Download(acc, nq);
    for (float x : dev_.Download(m, Bt * T * nh)) state[p].push_back(x);
    for (float x : dev_.Download(l, Bt * T * nh)) state[p].push_back(x);
  }
  EXPECT_EQ(state[1], state[0]);
}

// AdamW: the fp32 master steps identically from the same gradient values;
// the bf16 working copy is rn(master), the fp32 one the master itself.
TEST_F(WorkingOpsTest, AdamWStepsTheSameMasterAndRoundsTheWorkingCopy) {
  const int64_t n = 300;
  const std::vector<float> p0 = Representable(n, 31), g = Representable(n, 32, 0.1f);
  const AdamWArgs args{1e-2f, 0.9f, 0.999f, 1e-8f, 0.01f, 1, 1.0f};
  float *mf = F32(p0), *m1 = F32(std::vector<float>(n, 0)), *v1 = F32(std::vector<float>(n, 0));
  float* wf = dev_.Poisoned(n);  // a working copy apart from the master
  ASSERT_TRUE(F::AdamW(dev_.b(), dev_.s(), mf, F32(g), m1, v1, wf, n, args).ok());
  float *mb = F32(p0), *m2 = F32(std::vector<float>(n, 0)), *v2 = F32(std::vector<float>(n, 0));
  Bf16* wb = dev_.PoisonedBf16(n);
  ASSERT_TRUE(B::AdamW(dev_.b(), dev_.s(), mb, B16(g), m2, v2, wb, n, args).ok());
  const std::vector<float> master = dev_.Download(mf, n);
  EXPECT_EQ(dev_.Download(mb, n), master);
  EXPECT_EQ(dev_.Download(wf, n), master);
  EXPECT_EQ(Bits(dev_.DownloadBf16(wb, n)), RoundedBits(master));
  EXPECT_NE(master, p0);  // it stepped
}

}  // namespace
}  // namespace plateau
