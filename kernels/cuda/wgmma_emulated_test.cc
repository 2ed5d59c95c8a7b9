// The wgmma probe's kernel (wgmma_probe_kernels.inc, what nvcc compiles for
// sm_90a) on the SIMT emulation's warpgroup MMA, against a double
// reference, in every operand layout, with the tensor cores' results landing
// at the wait or at the issue and the copies at their wait or their issue;
// and the emulation's own rules: a missing proxy fence, a missing wait, a
// descriptor it does not model fail the block. The emulation's wgmma and
// this file's kernel read the PTX ISA the same way, so agreement here does
// not prove the reading right: wgmma_probe_test checks it on an H100/H200.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
// After the host headers: the emulation defines CUDA's keywords.
#include "kernels/cuda/simt_emulator.h"
// Then the kernels' headers, which use it.
#include "kernels/cuda/cp_async.h"
#include "kernels/cuda/mma_layout.h"
#include "kernels/cuda/wgmma_instructions.h"
#include "kernels/cuda/wgmma_layout.h"
#include "kernels/cuda/wgmma_probe.h"

namespace plateau::cuda_wgmma {
namespace {

#include "kernels/cuda/wgmma_probe_kernels.inc"

struct Data {
  std::vector<Bf16> a, b, bt;  // [64][32], [32][64], [64][32]
  std::vector<double> ref;     // [64][64]
};

Bf16 ToBf16(float x) { return __float2bfloat16_rn(x); }

Data MakeData(uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  Data d;
  d.a.resize(64 * kProbeK);
  d.b.resize(kProbeK * 64);
  d.bt.resize(64 * kProbeK);
  for (Bf16& x : d.a) x = ToBf16(u(rng));
  for (int k = 0; k < kProbeK; ++k) {
    for (int n = 0; n < 64; ++n) d.bt[n * kProbeK + k] = d.b[k * 64 + n] = ToBf16(u(rng));
  }
  d.ref.assign(64 * 64, 0.0);
  for (int m = 0; m < 64; ++m) {
    for (int n = 0; n < 64; ++n) {
      for (int k = 0; k < kProbeK; ++k) {
        d.ref[m * 64 + n] += double{__bfloat162float(d.a[m * kProbeK + k])} *
                             double{__bfloat162float(d.b[k * 64 + n])};
      }
    }
  }
  return d;
}

std::string RunProbe(const Data& data, bool a_smem, int b_layout, std::vector<float>* out) {
  out->assign(64 * 64, std::nanf(""));
  void (*kernels[2][kProbeBLayouts])(const Bf16*, const Bf16*, const Bf16*, float*) = {
      {WgmmaProbeKernel<false, kProbeBKMajor>, WgmmaProbeKernel<false, kProbeBMnMajor>,
       WgmmaProbeKernel<false, kProbeBMnKFastest>},
      {WgmmaProbeKernel<true, kProbeBKMajor>, WgmmaProbeKernel<true, kProbeBMnMajor>,
       WgmmaProbeKernel<true, kProbeBMnKFastest>}};
  auto kernel = kernels[a_smem][b_layout];
  return simt::RunGrid({1, 1, 1}, wgmma::kThreads, kProbeSmem, simt::Schedule::kShuffled,
                       [&] { kernel(data.a.data(), data.b.data(), data.bt.data(), out->data()); });
}

TEST(WgmmaEmulatedTest, ProbeMatchesTheReferenceInEveryLayoutAndTiming) {
  for (bool a_smem : {false, true}) {
    for (int b_layout = 0; b_layout < kProbeBLayouts; ++b_layout) {
      for (auto completion : {simt::WgmmaCompletion::kAtWait, simt::WgmmaCompletion::kAtIssue}) {
        for (auto landing : {simt::CopyLanding::kAtWait, simt::CopyLanding::kAtIssue}) {
          SCOPED_TRACE(std::string(a_smem ? "A shared" : "A registers") + ", B layout " +
                       std::to_string(b_layout) +
                       (completion == simt::WgmmaCompletion::kAtWait ? ", at wait" : ", at issue"));
          const Data data = MakeData(77 + 3 * a_smem + b_layout);
          simt::SetWgmmaCompletion(completion);
          const simt::ScopedCopyLanding scoped(landing);
          std::vector<float> out;
          EXPECT_EQ(RunProbe(data, a_smem, b_layout, &out), "");
          simt::SetWgmmaCompletion(simt::WgmmaCompletion::kAtWait);
          for (int i = 0; i < 64 * 64; ++i) {
            ASSERT_NEAR(out[i], data.ref[i], 1e-5 * (1.0 + std::fabs(data.ref[i])))
                << "element " << i;
          }
        }
      }
    }
  }
}

// A kernel of the probe's shape with one rule broken per variant.
enum class Break {
  kNone,
  kNoProxyFence,
  kNoBarrier,
  kNoWgmmaFence,
  kNoWait,
  kReadBeforeWait,
  kSwizzled
};
template <Break kBreak>
void BrokenKernel(const Bf16* bt, float* d) {
  PLATEAU_DYNAMIC_SHARED(unsigned char, smem);
  const int t = threadIdx.x;
  for (int i = t; i < 256; i += wgmma::kThreads) {
    const int n = i / 4, k = (i % 4) * 8;
    cuda_async::CpAsync16(smem + wgmma::KMajorOffset(n, k, 64), bt + n * kProbeK + k, 16);
  }
  cuda_async::CpAsyncCommit();
  cuda_async::CpAsyncWait<0>();
  if (kBreak != Break::kNoProxyFence) wgmma::FenceProxyAsync();
  if (kBreak != Break::kNoBarrier) __syncthreads();
  float acc[wgmma::kDFloats] = {};
  uint32_t af[4] = {0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u};  // A = 1
  uint64_t desc = wgmma::TileDescriptor(wgmma::SharedAddress(smem), 64, 0);
  if (kBreak == Break::kSwizzled) desc |= uint64_t{1} << 62;
  if (kBreak != Break::kNoWgmmaFence) wgmma::Fence();
  wgmma::MmaRs<false>(acc, af, desc, false);
  wgmma::Commit();
  if (kBreak == Break::kReadBeforeWait) d[t] = acc[0];
  if (kBreak != Break::kNoWait) wgmma::Wait<0>();
  if (kBreak != Break::kReadBeforeWait) d[t] = acc[0];
}

template <Break kBreak>
std::string RunBroken(const Data& data, std::vector<float>* out) {
  out->assign(wgmma::kThreads, std::nanf(""));
  return simt::RunGrid({1, 1, 1}, wgmma::kThreads, kProbeTileBytes, simt::Schedule::kInOrder,
                       [&] { BrokenKernel<kBreak>(data.bt.data(), out->data()); });
}

TEST(WgmmaEmulatedTest, BrokenOrderFailsTheBlock) {
  const Data data = MakeData(5);
  std::vector<float> good, out;
  ASSERT_EQ(RunBroken<Break::kNone>(data, &good), "");
  EXPECT_FALSE(std::isnan(good[0]));
  EXPECT_NE(RunBroken<Break::kNoProxyFence>(data, &out).find("fence.proxy.async"),
            std::string::npos);
  EXPECT_NE(RunBroken<Break::kNoBarrier>(data, &out).find("no block barrier"), std::string::npos);
  EXPECT_NE(RunBroken<Break::kNoWgmmaFence>(data, &out).find("no wgmma.fence"), std::string::npos);
  EXPECT_NE(RunBroken<Break::kNoWait>(data, &out).find("never waited"), std::string::npos);
  EXPECT_NE(RunBroken<Break::kSwizzled>(data, &out).find("swizzled"), std::string::npos);
  // Read before the wait: the old accumulator (0) where the results land
  // at the wait; the product where they land at the issue.
  EXPECT_EQ(RunBroken<Break::kReadBeforeWait>(data, &out), "");
  EXPECT_EQ(out[0], 0.0f);
  simt::SetWgmmaCompletion(simt::WgmmaCompletion::kAtIssue);
  EXPECT_EQ(RunBroken<Break::kReadBeforeWait>(data, &out), "");
  simt::SetWgmmaCompletion(simt::WgmmaCompletion::kAtWait);
  EXPECT_EQ(out[0], good[0]);
}

TEST(WgmmaEmulatedTest, AWarpgroupMustIssueTogether) {
  const Data data = MakeData(6);
  std::vector<float> out(64 * 64);
  // 96 threads: not a whole warpgroup.
  const std::string e = simt::RunGrid({1, 1, 1}, 96, kProbeSmem, simt::Schedule::kInOrder, [&] {
    WgmmaProbeKernel<false, kProbeBKMajor>(data.a.data(), data.b.data(), data.bt.data(),
                                           out.data());
  });
  EXPECT_NE(e.find("whole warpgroups"), std::string::npos) << e;
}

}  // namespace
}  // namespace plateau::cuda_wgmma
