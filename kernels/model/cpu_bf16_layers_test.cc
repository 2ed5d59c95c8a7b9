// The model kernels' bf16 ops on the CPU backend (cpu_bf16_layers.h),
// through ModelKernels: bitwise the fp32 function of layers.h on the loaded
// inputs with one rounding per stored bf16 element, and within stated
// bounds of a double reference on the same bf16 inputs: the fp32 work's own
// error (one unit of 2^-24 per fp32 addition or product in the chain) plus
// one bf16 rounding (2^-8 relative: bf16 keeps 8 significant bits).
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
#include "kernels/model/layers.h"
#include "kernels/model/model_kernels.h"
#include "kernels/testing/device_side.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

constexpr double kFp32Unit = 1.0 / (1 << 24);
constexpr double kBf16Unit = kBf16UnitRoundoff;

std::vector<Bf16> RandomBf16(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<Bf16> v(n);
  for (Bf16& x : v) x = FloatToBf16(dist(rng));
  return v;
}
std::vector<float> Loaded(const std::vector<Bf16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = Bf16ToFloat(v[i]);
  return f;
}
std::vector<uint16_t> RoundedBits(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = FloatToBf16(v[i]).bits;
  return b;
}
std::vector<uint16_t> Bits(const std::vector<Bf16>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = v[i].bits;
  return b;
}
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

TEST_F(CpuBf16LayersTest, ArgumentsAreCheckedNamingTheOp) {
  Bf16 x[4] = {};
  int32_t idx[2] = {0, 1};
  EXPECT_THAT(mk_->GatherRowsBf16(dev_.s(), x, 2, idx, nullptr, 2, 2, nullptr).message(),
              HasSubstr("gather_rows_bf16: dst is null"));
  EXPECT_THAT(mk_->ScatterRowsBf16(dev_.s(), x, 2, idx, 2, x, 1).message(),
              HasSubstr("scatter_rows_bf16: dst_rows = 1 cannot hold 2 distinct rows"));
  EXPECT_THAT(mk_->EmbeddingBackwardBf16(dev_.s(), x, idx, 2, 2, x, 0).message(),
              HasSubstr("embedding_backward_bf16: vocab must be >= 1"));
}

}  // namespace
}  // namespace plateau
