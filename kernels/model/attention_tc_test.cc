// The tensor-core attention arithmetic (attention_tc.h) on the CPU, through
// ModelKernels with bf16_attention = kTensorCore, over ring attention's
// block pairs (own block, earlier blocks, a block after the queries), GQA,
// causal offsets, several key tiles, lengths off the tile, head_dim 16 to
// 128:
// - against exact attention in double (attention_tc_testing.h): every output
//   within 2^-6 of its magnitude (o: the rounded p and their sum l, two bf16
//   units; gradients 2^-5: lse's, delta's and dS's roundings on top), dq
//   within one more bf16 unit of its value per block pair (it is rounded once
//   per pair), plus an fp32 floor;
// - not the fp32 arithmetic in disguise: o is further from exact than
//   fp32 rounding could take it (2^-12 of its magnitude somewhere), and the
//   kTiles path of the same data is within fp32 reach of exact;
// - the same bits as calling attention_tc.h directly, and run to run.
// The CUDA kernels are held to this reference in cuda_attention_tc_twin_test
// (on a GPU) and cuda_attention_tc_emulated_test (their source, emulated).
#include "kernels/model/attention_tc.h"

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/model/attention.h"
#include "kernels/model/model_kernels.h"
#include "kernels/testing/attention_tc_testing.h"

namespace plateau {
namespace {

class AttentionTcTest : public ::testing::TestWithParam<AttnTcCase> {
 protected:
  void SetUp() override {
    BackendOptions options;
    options.device_memory_bytes = int64_t{1} << 30;
    auto backend = Backend::Create(options);
    ASSERT_TRUE(backend.ok()) << backend.status();
    ASSERT_TRUE(side_.Init(std::move(*backend)).ok());
  }
  std::unique_ptr<ModelKernels> Kernels(Bf16Attention a) {
    ModelKernelsOptions options;
    options.bf16_attention = a;
    auto k = ModelKernels::Create(side_.b(), options);
    EXPECT_TRUE(k.ok()) << k.status();
    return k.ok() ? std::move(*k) : nullptr;
  }
  DeviceSide side_;
};

TEST_P(AttentionTcTest, WithinBf16OfExactAttention) {
  const AttnTcData d = MakeAttnTcData(GetParam(), 900);
  auto tc = Kernels(Bf16Attention::kTensorCore);
  ASSERT_NE(tc, nullptr);
  EXPECT_EQ(tc->Bf16AttentionFor(d.shapes[0]), Bf16Attention::kTensorCore);
  const AttnTcOut out = RunAttnTc(side_, *tc, d);
  const AttnExact x = ExactAttention(d);

  double worst_o = 0;
  ExpectNearExact(out, d, x, &worst_o);
  // Not vacuous: the probabilities were rounded (o moved further than fp32
  // arithmetic could move it) wherever any query sees a key.
  if (MaxAbsFinite(x.mag_o) > 0) {
    EXPECT_GT(worst_o, 0x1p-12) << "o is within fp32 reach of exact: p was not rounded";
    // ... and the fp32 tiles on the same data stay within fp32 reach.
    auto tiles = Kernels(Bf16Attention::kTiles);
    ASSERT_NE(tiles, nullptr);
    const AttnTcOut t = RunAttnTc(side_, *tiles, d);
    double worst_tiles = 0;
    EXPECT_TRUE(WithinMagnitude(t.o, x.o, x.mag_o, 0x1p-6, 1e-6 * MaxAbsFinite(x.mag_o), "tiles o",
                                &worst_tiles));
    EXPECT_LT(worst_tiles, 0x1p-14);
    std::printf("%s: |o - exact| / magnitude at most %.3g (tensor-core arithmetic), %.3g (tiles)\n",
                GetParam().name, worst_o, worst_tiles);
  }
}

TEST_P(AttentionTcTest, ModelKernelsRunAttentionTcBitForBitAndRunToRun) {
  const AttnTcData d = MakeAttnTcData(GetParam(), 950);
  auto tc = Kernels(Bf16Attention::kTensorCore);
  ASSERT_NE(tc, nullptr);
  const AttnTcOut a = RunAttnTc(side_, *tc, d);
  const AttnTcOut b = RunAttnTc(side_, *tc, d);
  EXPECT_EQ(a.dq, b.dq);
  EXPECT_EQ(a.o, b.o);  // no NaN here: the ops wrote every element
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    EXPECT_EQ(a.dk[j], b.dk[j]);
    EXPECT_EQ(a.dv[j], b.dv[j]);
  }

  // Direct calls on host memory: the forward state, then the backward with
  // the ModelKernels run's lse and delta.
  std::vector<float> m(d.rows), l(d.rows), acc(d.q_size);
  const AttentionShape& s0 = d.shapes[0];
  AttentionInitState(s0, m.data(), l.data(), acc.data());
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    TensorCoreAttentionForward(d.shapes[j], d.q.data(), d.k[j].data(), d.v[j].data(), m.data(),
                               l.data(), acc.data());
  }
  EXPECT_EQ(m, a.m);
  EXPECT_EQ(l, a.l);
  std::vector<float> dq = Loaded(d.dq0);
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    std::vector<float> dk = d.dk0[j], dv = d.dv0[j];
    std::vector<float> work(std::max<int64_t>(AttentionWorkspaceFloats(d.shapes[j]), 1));
    TensorCoreAttentionBackward(d.shapes[j], d.q.data(), d.k[j].data(), d.v[j].data(),
                                d.dout.data(), a.lse.data(), a.delta.data(), dq.data(), dk.data(),
                                dv.data(), work.data());
    EXPECT_EQ(dk, a.dk[j]);
    EXPECT_EQ(dv, a.dv[j]);
  }
  EXPECT_EQ(dq, a.dq);
}

TEST(AttentionTcOptionsTest, TheCpuRunsTilesUnlessAskedForTensorCores) {
  BackendOptions options;
  options.device_memory_bytes = int64_t{1} << 26;
  auto backend = Backend::Create(options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  AttentionShape shape;
  shape.head_dim = 128;
  for (auto [asked, runs] : {std::pair{Bf16Attention::kAuto, Bf16Attention::kTiles},
                             {Bf16Attention::kTiles, Bf16Attention::kTiles},
                             {Bf16Attention::kTensorCore, Bf16Attention::kTensorCore}}) {
    ModelKernelsOptions o;
    o.bf16_attention = asked;
    auto k = ModelKernels::Create(**backend, o);
    ASSERT_TRUE(k.ok()) << k.status();
    EXPECT_EQ((*k)->Bf16AttentionFor(shape), runs) << Bf16AttentionName(asked);
  }
  EXPECT_STREQ(Bf16AttentionName(Bf16Attention::kTensorCore), "tensor_core");
}

// Key tiles are 64 keys: several of them, and lengths off the tile.
INSTANTIATE_TEST_SUITE_P(Shapes, AttentionTcTest,
                         ::testing::Values(
                             // GQA 1, head_dim 16: the own (diagonal) block, then the earlier one.
                             AttnTcCase{"gqa1_ring", 2, 37, 37, 4, 4, 16, 37, {37, 0}},
                             // GQA 2, head_dim 64: 150 keys (three tiles, the last partial),
                             // queries past the first tile, a block wholly after the queries.
                             AttnTcCase{"gqa2_d64_tiles", 1, 70, 150, 4, 2, 64, 150, {150, 0, 300}},
                             // GQA 4, head_dim 128, more keys than queries from position 0.
                             AttnTcCase{"gqa4_d128", 1, 33, 80, 8, 2, 128, 0, {0}},
                             // Queries that see no key: o = 0, lse = -inf, dq, dk, dv unchanged.
                             AttnTcCase{"none_visible", 1, 20, 20, 2, 1, 64, 0, {40}}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace plateau
