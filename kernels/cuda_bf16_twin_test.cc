// The CUDA backend's bf16 mixed-precision ops against the CPU emulation
// (kernels/cpu_bf16_ops.h), through the Backend interface, on the same bf16
// inputs. Both sides load exactly, compute in fp32 and round each stored
// element once to nearest even at the same points, so:
// - the conversions are bitwise equal (one rounding of the same fp32 value);
// - every other op agrees within its fp32 twin's tolerance (cuda_twin_test:
//   expf, the GEMM's summation order) plus one bf16 unit in the last place,
//   2^-7 relative: two fp32 values that close can still straddle a rounding
//   boundary and round to neighbouring bf16 values.
//
// The model kernels' bf16 ops (ModelKernels::*Bf16) are held to the same
// rule, and where the CUDA kernel is the fp32 kernel on loaded values
// (attention's tiled kernels, bf16_attention = kTiles; the tensor-core ones
// are cuda_attention_tc_twin_test's) also to the CUDA fp32 kernel, bit for bit; the grouped bf16
// GEMM of the expert groups to the CPU's GemmBf16 bound.
//
// Without a CUDA backend (the default build, or no GPU) every test skips and
// says why; where a GPU is visible a setup failure fails.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <iterator>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/model/attention.h"
#include "kernels/model/model_kernels.h"
#include "kernels/testing/device_side.h"

namespace plateau {
namespace {

constexpr double kU = 1.0 / (1 << 24);  // fp32's unit roundoff
constexpr double kBf16Ulp = 1.0 / 128;  // one bf16 unit in the last place, relative

std::vector<Bf16> RandomBf16(int64_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<Bf16> v(n);
  for (Bf16& x : v) x = FloatToBf16(dist(rng));
  return v;
}

std::vector<float> Loaded(const std::vector<Bf16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = Bf16ToFloat(v[i]);
  return f;
}

// |cuda[i] - cpu[i]| <= tol[i] + 2^-7 |cpu[i]| for every i; NaN never passes.
::testing::AssertionResult AgreeBf16(const std::vector<float>& cuda, const std::vector<float>& cpu,
                                     const std::vector<double>& tol) {
  if (cuda.size() != cpu.size() || cpu.size() != tol.size()) {
    return ::testing::AssertionFailure() << "sizes differ";
  }
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double err = std::abs(double{cuda[i]} - double{cpu[i]});
    if (!(err <= tol[i] + kBf16Ulp * std::abs(cpu[i]))) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << cpu.size()
                                       << " elements disagree; first [" << first << "]: cuda "
                                       << cuda[first] << ", cpu " << cpu[first] << ", tol "
                                       << tol[first];
}

class CudaBf16TwinTest : public ::testing::Test {
 protected:
  void SetUp() override {
    BackendOptions options;
    options.kind = BackendKind::kCuda;
    auto cuda = Backend::Create(options);
    if (!cuda.ok() && NoCudaHere(cuda.status())) {
      GTEST_SKIP() << "no CUDA backend here: " << cuda.status();
    }
    ASSERT_TRUE(cuda.ok()) << "a GPU is visible but the CUDA backend failed: " << cuda.status();
    BackendOptions cpu_options;
    cpu_options.device_memory_bytes = int64_t{1} << 30;
    auto cpu = Backend::Create(cpu_options);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    ASSERT_TRUE(cpu_.Init(std::move(*cpu)).ok());
    ASSERT_TRUE(cuda_.Init(std::move(*cuda)).ok());
  }
  DeviceSide cpu_, cuda_;
};

TEST_F(CudaBf16TwinTest, ConversionsAreBitwiseEqual) {
  std::vector<float> x(100003);
  std::mt19937 rng(1);
  std::uniform_int_distribution<uint32_t> bits;
  for (float& v : x) {
    const uint32_t u = bits(rng);  // every kind of float: NaNs, infs, subnormals, ties
    std::memcpy(&v, &u, sizeof(v));
  }
  auto run = [&](DeviceSide& side) {
    Bf16* b = side.PoisonedBf16(static_cast<int64_t>(x.size()));
    float* back = side.Poisoned(static_cast<int64_t>(x.size()));
    const int64_t n = static_cast<int64_t>(x.size());
    EXPECT_TRUE(side.b().ConvertToBf16(side.s(), b, side.Upload(x), n).ok());
    EXPECT_TRUE(side.b().ConvertToFloat(side.s(), back, b, n).ok());
    std::vector<Bf16> out = side.DownloadBf16(b, n);
    std::vector<uint32_t> all(out.size());
    for (size_t i = 0; i < out.size(); ++i) all[i] = out[i].bits;
    const std::vector<float> f = side.Download(back, n);
    for (float v : f) {
      uint32_t u;
      std::memcpy(&u, &v, sizeof(u));
      all.push_back(u);
    }
    return all;
  };
  EXPECT_EQ(run(cuda_), run(cpu_));
}

struct GemmCase {
  bool ta, tb;
  int64_t m, n, k;
  float beta;
};

// cublasGemmEx with bf16 A and B and CUBLAS_COMPUTE_32F against the CPU's
// sgemm on the loaded values: 4 k u (|alpha| sum |a b| + |beta c|), as the
// fp32 twin, plus one bf16 unit for a bf16 C.
TEST_F(CudaBf16TwinTest, GemmMatchesCpu) {
  const GemmCase cases[] = {{false, false, 37, 29, 53, 0.75f}, {true, false, 37, 29, 53, 0.0f},
                            {false, true, 17, 1024, 64, -1.0f}, {true, true, 257, 129, 300, 0.5f},
                            {false, false, 6, 5, 0, -0.5f}};
  for (const GemmCase& gc : cases) {
    for (bool bf16_c : {true, false}) {
      SCOPED_TRACE(::testing::Message() << gc.m << "x" << gc.n << "x" << gc.k << " ta=" << gc.ta
                                        << " tb=" << gc.tb << (bf16_c ? " bf16 C" : " fp32 C"));
      const int64_t lda = gc.ta ? gc.m : gc.k, ldb = gc.tb ? gc.k : gc.n;
      const std::vector<Bf16> a = RandomBf16(std::max<int64_t>(gc.m * gc.k, 1), 2),
                              b = RandomBf16(std::max<int64_t>(gc.k * gc.n, 1), 3),
                              c0 = RandomBf16(gc.m * gc.n, 4);
      const std::vector<float> af = Loaded(a), bf = Loaded(b), cf = Loaded(c0);
      auto run = [&](DeviceSide& side) {
        GemmBf16Args g;
        g.trans_a = gc.ta;
        g.trans_b = gc.tb;
        g.m = gc.m;
        g.n = gc.n;
        g.k = gc.k;
        g.alpha = 1.5f;
        g.beta = gc.beta;
        g.a = side.UploadBf16(a);
        g.lda = std::max<int64_t>(lda, 1);
        g.b = side.UploadBf16(b);
        g.ldb = std::max<int64_t>(ldb, 1);
        g.ldc = gc.n;
        // beta == 0: C must not be read, so start from NaNs.
        if (bf16_c) {
          g.c = gc.beta == 0.0f ? side.PoisonedBf16(gc.m * gc.n) : side.UploadBf16(c0);
          EXPECT_TRUE(side.b().GemmBf16(side.s(), g).ok());
          return Loaded(side.DownloadBf16(g.c, gc.m * gc.n));
        }
        g.c_fp32 = gc.beta == 0.0f ? side.Poisoned(gc.m * gc.n) : side.Upload(cf);
        EXPECT_TRUE(side.b().GemmBf16(side.s(), g).ok());
        return side.Download(g.c_fp32, gc.m * gc.n);
      };
      const std::vector<float> cpu = run(cpu_), cuda = run(cuda_);
      std::vector<double> tol(cpu.size());
      for (int64_t i = 0; i < gc.m; ++i) {
        for (int64_t j = 0; j < gc.n; ++j) {
          double mag = 0;
          for (int64_t p = 0; p < gc.k; ++p) {
            const double av = gc.ta ? af[p * lda + i] : af[i * lda + p];
            const double bv = gc.tb ? bf[j * ldb + p] : bf[p * ldb + j];
            mag += std::abs(av * bv);
          }
          mag = 1.5 * mag + (gc.beta == 0.0f ? 0.0 : std::abs(gc.beta * cf[i * gc.n + j]));
          tol[i * gc.n + j] = 4.0 * std::max<int64_t>(gc.k, 1) * kU * mag;
        }
      }
      if (bf16_c) {
        EXPECT_TRUE(AgreeBf16(cuda, cpu, tol));
      } else {
        for (size_t i = 0; i < cpu.size(); ++i) {
          ASSERT_LE(std::abs(double{cuda[i]} - cpu[i]), tol[i]) << "C[" << i << "]";
        }
      }
    }
  }
}

double SigmoidD(double g) { return 1.0 / (1.0 + std::exp(-g)); }

// The fp32 twin's SwiGLU bounds (cuda_twin_test) plus one bf16 unit.
TEST_F(CudaBf16TwinTest, SwiGluMatchesCpu) {
  for (int64_t n : {1, 1000, 300001}) {
    std::vector<Bf16> gate = RandomBf16(n, 6, -8, 8);
    const float extremes[] = {-1000.0f, -100.0f, -88.5f, 0.0f, 88.5f, 1000.0f};
    for (int i = 0; i < 6 && i < n; ++i) gate[i] = FloatToBf16(extremes[i]);
    const std::vector<Bf16> up = RandomBf16(n, 7, -3, 3), dout = RandomBf16(n, 8);
    auto run = [&](DeviceSide& side) {
      const Bf16* dg = side.UploadBf16(gate);
      const Bf16* du = side.UploadBf16(up);
      Bf16* out = side.PoisonedBf16(n);
      Bf16* dgate = side.PoisonedBf16(n);
      Bf16* dup = side.PoisonedBf16(n);
      EXPECT_TRUE(side.b().SwiGluForwardBf16(side.s(), out, dg, du, n).ok());
      EXPECT_TRUE(
          side.b().SwiGluBackwardBf16(side.s(), dgate, dup, side.UploadBf16(dout), dg, du, n).ok());
      std::vector<float> all = Loaded(side.DownloadBf16(out, n));
      for (const Bf16* p : {dgate, dup}) {
        const std::vector<float> part = Loaded(side.DownloadBf16(p, n));
        all.insert(all.end(), part.begin(), part.end());
      }
      return all;
    };
    const std::vector<float> cpu = run(cpu_), cuda = run(cuda_);
    std::vector<double> tol(3 * n);
    for (int64_t i = 0; i < n; ++i) {
      const double g = Bf16ToFloat(gate[i]), s = SigmoidD(g), u = Bf16ToFloat(up[i]),
                   d = Bf16ToFloat(dout[i]);
      tol[i] = 24 * kU * std::abs(g * s * u) + 1e-37;
      tol[n + i] = 24 * kU * std::abs(d * u) * s * (1 + std::abs(g)) + 1e-37;
      tol[2 * n + i] = 24 * kU * std::abs(d * g * s) + 1e-37;
    }
    EXPECT_TRUE(AgreeBf16(cuda, cpu, tol)) << "n = " << n;
  }
}

// The fp32 twin's RMSNorm bounds (cuda_twin_test) plus one bf16 unit; rstd
// (fp32, not rounded to bf16) within the fp32 bound alone.
TEST_F(CudaBf16TwinTest, RmsNormMatchesCpu) {
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1}, {3, 1000}, {64, 257}, {40000, 8}};
  for (const auto& [rows, cols] : shapes) {
    const std::vector<Bf16> x = RandomBf16(rows * cols, 9, -2, 2), w = RandomBf16(cols, 10, 0.5, 1.5),
                            dout = RandomBf16(rows * cols, 11), dw0 = RandomBf16(cols, 12);
    std::vector<float> rstd_cpu, rstd_cuda;
    auto run = [&](DeviceSide& side, std::vector<float>* rstd_out) {
      const Bf16* dx_in = side.UploadBf16(x);
      const Bf16* dw = side.UploadBf16(w);
      Bf16* out = side.PoisonedBf16(rows * cols);
      float* rstd = side.Poisoned(rows);
      Bf16* dx = side.PoisonedBf16(rows * cols);
      Bf16* dweight = side.UploadBf16(dw0);
      EXPECT_TRUE(side.b().RmsNormForwardBf16(side.s(), out, rstd, dx_in, dw, rows, cols, 1e-5f).ok());
      EXPECT_TRUE(side.b()
                      .RmsNormBackwardBf16(side.s(), dx, dweight, side.UploadBf16(dout), dx_in, dw,
                                           rstd, rows, cols)
                      .ok());
      *rstd_out = side.Download(rstd, rows);
      std::vector<float> all = Loaded(side.DownloadBf16(out, rows * cols));
      for (const auto& [p, n] : {std::pair<const Bf16*, int64_t>{dx, rows * cols}, {dweight, cols}}) {
        const std::vector<float> part = Loaded(side.DownloadBf16(p, n));
        all.insert(all.end(), part.begin(), part.end());
      }
      return all;
    };
    const std::vector<float> cpu = run(cpu_, &rstd_cpu), cuda = run(cuda_, &rstd_cuda);
    for (int64_t r = 0; r < rows; ++r) {
      ASSERT_LE(std::abs(double{rstd_cuda[r]} - rstd_cpu[r]), 8 * kU * rstd_cpu[r]) << "rstd " << r;
    }
    const std::vector<float> xf = Loaded(x), wf = Loaded(w), df = Loaded(dout), dw0f = Loaded(dw0);
    std::vector<double> tol(cpu.size());
    for (int64_t i = 0; i < rows * cols; ++i) tol[i] = 8 * kU * std::abs(cpu[i]);
    double* tol_dx = tol.data() + rows * cols;
    double* tol_dw = tol_dx + rows * cols;
    for (int64_t c = 0; c < cols; ++c) tol_dw[c] = 4 * kU * std::abs(dw0f[c]);
    for (int64_t r = 0; r < rows; ++r) {
      const double rs = rstd_cpu[r];
      double abs_dot = 0;
      for (int64_t c = 0; c < cols; ++c) abs_dot += std::abs(double{df[r * cols + c]} * wf[c] * xf[r * cols + c]);
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t k = r * cols + c;
        tol_dx[k] = 2e-5 * (rs * std::abs(double{df[k]} * wf[c]) +
                            std::abs(xf[k]) * rs * rs * rs * abs_dot / cols);
        tol_dw[c] += 2e-5 * std::abs(double{df[k]} * xf[k] * rs);
      }
    }
    EXPECT_TRUE(AgreeBf16(cuda, cpu, tol)) << rows << " x " << cols;
  }
}

// Ten steps, as cuda_twin_test's fp32 AdamW: master within 8u t |p| + 2e-4
// lr, m within 8u (|m| + max|g|), v within 16u |v| + 1e-30; the working copy
// (a rounding of the master) within the master's bound plus one bf16 unit.
TEST_F(CudaBf16TwinTest, AdamWMatchesCpuOverSeveralSteps) {
  const int64_t n = 100003;
  AdamWArgs args;
  args.lr = 2e-3f;
  args.beta2 = 0.95f;
  args.weight_decay = 0.1f;
  args.grad_scale = 0.25f;
  const std::vector<float> p0 = Loaded(RandomBf16(n, 15));
  DeviceSide* sides[2] = {&cpu_, &cuda_};
  float* master[2];
  float* m[2];
  float* v[2];
  Bf16* working[2];
  for (int i = 0; i < 2; ++i) {
    master[i] = sides[i]->Upload(p0);
    m[i] = sides[i]->Upload(std::vector<float>(n, 0.0f));
    v[i] = sides[i]->Upload(std::vector<float>(n, 0.0f));
    working[i] = sides[i]->PoisonedBf16(n);
  }
  double max_g = 0;
  for (int64_t t = 1; t <= 10; ++t) {
    SCOPED_TRACE(::testing::Message() << "step " << t);
    const std::vector<Bf16> grad = RandomBf16(n, 100 + t, -3, 3);
    for (Bf16 g : grad) max_g = std::max(max_g, std::abs(Bf16ToFloat(g) * 0.25));
    args.step = t;
    std::vector<float> got[2];
    for (int i = 0; i < 2; ++i) {
      DeviceSide& side = *sides[i];
      ASSERT_TRUE(side.b()
                      .AdamWBf16(side.s(), master[i], side.UploadBf16(grad), m[i], v[i],
                                 working[i], n, args)
                      .ok());
      got[i] = side.Download(master[i], n);
      for (const float* p : {m[i], v[i]}) {
        const std::vector<float> part = side.Download(p, n);
        got[i].insert(got[i].end(), part.begin(), part.end());
      }
      const std::vector<float> w = Loaded(side.DownloadBf16(working[i], n));
      got[i].insert(got[i].end(), w.begin(), w.end());
    }
    std::vector<double> tol(4 * n);
    for (int64_t j = 0; j < n; ++j) {
      tol[j] = 8 * kU * t * std::abs(got[0][j]) + 2e-4 * args.lr;
      tol[n + j] = 8 * kU * (std::abs(got[0][n + j]) + max_g);
      tol[2 * n + j] = 16 * kU * got[0][2 * n + j] + 1e-30;
      tol[3 * n + j] = tol[j];
    }
    // AgreeBf16 adds one bf16 unit to every bound; only the working copy
    // (the last n) may use it.
    for (int64_t j = 0; j < 3 * n; ++j) {
      ASSERT_LE(std::abs(double{got[1][j]} - got[0][j]), tol[j]) << "element " << j;
    }
    EXPECT_TRUE(AgreeBf16(std::vector<float>(got[1].begin() + 3 * n, got[1].end()),
                          std::vector<float>(got[0].begin() + 3 * n, got[0].end()),
                          std::vector<double>(tol.begin() + 3 * n, tol.end())));
  }
}

// The model kernels' bf16 row ops (ModelKernels::*Bf16) on both backends.
// Gather (one fp32 product per element), scatter, embedding (copies) and
// combine (fp32 products and sums in j order, separately rounded on both
// sides) compute the same fp32 value before the one rounding, so they are
// bitwise equal; RowDots sums in double in another order and agrees within
// 2u |out| + 1e-9: the products are exact in double, the two double sums
// differ by at most about width * 2^-53 * sum |a b| (< 1e-10 here: 257
// terms of size < 20), then one fp32 rounding each.
TEST_F(CudaBf16TwinTest, ModelRowOpsMatchCpu) {
  const int64_t src_rows = 300, width = 257, tokens = 200, k = 2, vocab = 64;
  const std::vector<Bf16> src = RandomBf16(src_rows * width, 41), out0 = RandomBf16(tokens * width, 42),
                          a = RandomBf16(tokens * width, 43), table = RandomBf16(vocab * width, 44);
  std::mt19937 rng(45);
  std::vector<int32_t> pos(tokens * k), tok(tokens), perm(tokens);
  for (int32_t& p : pos) p = static_cast<int32_t>(rng() % src_rows);
  for (int32_t& t : tok) t = static_cast<int32_t>(rng() % vocab);
  for (int64_t i = 0; i < tokens; ++i) perm[i] = static_cast<int32_t>((i * 7) % tokens);
  std::vector<float> gates(tokens * k);
  for (float& g : gates) g = static_cast<float>(rng() % 1000) / 1000.0f;
  auto ints = [](DeviceSide& side, const std::vector<int32_t>& v) {
    std::vector<float> f(v.size());
    std::memcpy(f.data(), v.data(), v.size() * sizeof(int32_t));
    return reinterpret_cast<int32_t*>(side.Upload(f));
  };
  auto run = [&](DeviceSide& side, std::vector<float>* dots) {
    auto mk = ModelKernels::Create(side.b());
    EXPECT_TRUE(mk.ok()) << mk.status();
    const Bf16* dsrc = side.UploadBf16(src);
    const int32_t* dpos = ints(side, pos);
    const float* dg = side.Upload(gates);
    Bf16* gathered = side.PoisonedBf16(tokens * k * width);
    EXPECT_TRUE((*mk)->GatherRowsBf16(side.s(), dsrc, src_rows, dpos, dg, tokens * k, width, gathered).ok());
    Bf16* scattered = side.PoisonedBf16(tokens * width);
    EXPECT_TRUE((*mk)->ScatterRowsBf16(side.s(), gathered, tokens, ints(side, perm), width, scattered, tokens).ok());
    Bf16* out = side.UploadBf16(out0);
    EXPECT_TRUE((*mk)->CombineRowsBf16(side.s(), dsrc, src_rows, dpos, dg, tokens, k, width, out).ok());
    Bf16* emb = side.PoisonedBf16(tokens * width);
    EXPECT_TRUE((*mk)->EmbeddingBf16(side.s(), side.UploadBf16(table), vocab, ints(side, tok), tokens, width, emb).ok());
    float* d = side.Poisoned(tokens * k);
    EXPECT_TRUE((*mk)->RowDotsBf16(side.s(), side.UploadBf16(a), dsrc, src_rows, dpos, tokens, k, width, d).ok());
    *dots = side.Download(d, tokens * k);
    std::vector<uint16_t> bits;
    for (const auto& [p, n] : {std::pair<const Bf16*, int64_t>{gathered, tokens * k * width},
                               {scattered, tokens * width}, {out, tokens * width}, {emb, tokens * width}}) {
      for (Bf16 b : side.DownloadBf16(p, n)) bits.push_back(b.bits);
    }
    return bits;
  };
  std::vector<float> cpu_dots, cuda_dots;
  const std::vector<uint16_t> cpu = run(cpu_, &cpu_dots), cuda = run(cuda_, &cuda_dots);
  EXPECT_EQ(cuda, cpu);
  for (size_t i = 0; i < cpu_dots.size(); ++i) {
    ASSERT_LE(std::abs(double{cuda_dots[i]} - cpu_dots[i]), 2 * kU * std::abs(cpu_dots[i]) + 1e-9) << i;
  }
}

// Rope, the dense cross-entropy and the Ring-DTP strips on bf16 logits, as
// cuda_model_twin_test's fp32 bounds on the same loaded values, plus one
// bf16 unit where the output is bf16 (rope, the gradient, the deltas): lse
// within (V + 16) 2u + 8u log V + 4u |lse|; the loss sum within the sum of
// those and 2u |lse - logit[target]|; the gradient / delta within
// scale 8u e^(x - lse) + 2u |g|; rope within 12u (|x1| + |x2|) of the pair.
// The strips are folded with the CPU's final lse, so each side's deltas use
// the same lse.
TEST_F(CudaBf16TwinTest, RopeCrossEntropyAndStripsMatchCpu) {
  const int64_t rows = 17, vocab = 1000, strip = 300;
  const std::vector<Bf16> logits = RandomBf16(rows * vocab, 51, -30, 30);
  const std::vector<float> lf = Loaded(logits);
  std::vector<int32_t> targets(rows);
  for (int64_t r = 0; r < rows; ++r) targets[r] = static_cast<int32_t>((r * 37) % vocab);
  targets[3] = -1;  // kIgnoreIndex
  auto ints = [](DeviceSide& side, const std::vector<int32_t>& v) {
    std::vector<float> f(v.size());
    std::memcpy(f.data(), v.data(), v.size() * sizeof(int32_t));
    return reinterpret_cast<int32_t*>(side.Upload(f));
  };
  const float scale = 0.25f;
  struct Out {
    std::vector<float> lse, strip_state, grad, deltas;
    double stats[2];
  };
  std::vector<float> cpu_lse;  // the CPU's lse, given to both sides' deltas
  auto run = [&](DeviceSide& side) {
    Out o;
    auto mk = ModelKernels::Create(side.b());
    EXPECT_TRUE(mk.ok()) << mk.status();
    const int32_t* y = ints(side, targets);
    float* lse = side.Poisoned(rows);
    double* stats = reinterpret_cast<double*>(side.Upload(std::vector<float>(4, 0.0f)));
    EXPECT_TRUE((*mk)->CrossEntropyBf16(side.s(), side.UploadBf16(logits), y, rows, vocab, lse, stats).ok());
    o.lse = side.Download(lse, rows);
    const std::vector<float> st = side.Download(reinterpret_cast<float*>(stats), 4);
    std::memcpy(o.stats, st.data(), sizeof(o.stats));
    if (cpu_lse.empty()) cpu_lse = o.lse;
    const float* ref_lse = side.Upload(cpu_lse);
    Bf16* g = side.UploadBf16(logits);
    EXPECT_TRUE((*mk)->CrossEntropyBackwardBf16(side.s(), g, ref_lse, y, rows, vocab, scale).ok());
    o.grad = Loaded(side.DownloadBf16(g, rows * vocab));
    float* state = side.Poisoned(3 * rows);
    EXPECT_TRUE((*mk)->StripInit(side.s(), state, rows).ok());
    for (int64_t j0 = 0; j0 < vocab; j0 += strip) {
      const int64_t w = std::min(strip, vocab - j0);
      std::vector<Bf16> tile(rows * w);
      for (int64_t r = 0; r < rows; ++r) std::copy_n(&logits[r * vocab + j0], w, &tile[r * w]);
      const Bf16* dt = side.UploadBf16(tile);
      EXPECT_TRUE((*mk)->StripFoldBf16(side.s(), dt, rows, w, j0, y, state, rows).ok());
      Bf16* d = side.UploadBf16(tile);
      EXPECT_TRUE((*mk)->StripDeltaBf16(side.s(), d, rows, w, j0, y, ref_lse, scale).ok());
      const std::vector<float> part = Loaded(side.DownloadBf16(d, rows * w));
      o.deltas.insert(o.deltas.end(), part.begin(), part.end());
    }
    o.strip_state = side.Download(state, 3 * rows);
    return o;
  };
  const Out cpu = run(cpu_), cuda = run(cuda_);
  const double rel_s = (vocab + 16.0) * 2 * kU;
  auto lse_tol = [&](int64_t r) {
    return rel_s + 8 * kU * std::log(double(vocab)) + 4 * kU * std::abs(cpu.lse[r]) + 1e-30;
  };
  double loss_tol = 0;
  for (int64_t r = 0; r < rows; ++r) {
    ASSERT_LE(std::abs(double{cuda.lse[r]} - cpu.lse[r]), lse_tol(r)) << "lse " << r;
    if (targets[r] < 0) continue;
    loss_tol += lse_tol(r) + 2 * kU * std::abs(cpu.lse[r] - lf[r * vocab + targets[r]]);
  }
  EXPECT_NEAR(cuda.stats[0], cpu.stats[0], loss_tol + 1e-12 * std::abs(cpu.stats[0]));
  EXPECT_EQ(cuda.stats[1], cpu.stats[1]);
  std::vector<double> tol(rows * vocab);
  for (int64_t i = 0; i < rows * vocab; ++i) {
    const double e = std::exp(double(lf[i]) - double(cpu_lse[i / vocab]));
    tol[i] = scale * 8 * kU * e + 2 * kU * std::abs(cpu.grad[i]) + 1e-30;
  }
  EXPECT_TRUE(AgreeBf16(cuda.grad, cpu.grad, tol)) << "cross-entropy gradient";
  // The deltas are laid out strip by strip: the same per-element bound.
  std::vector<double> dtol;
  for (int64_t j0 = 0; j0 < vocab; j0 += strip) {
    const int64_t w = std::min(strip, vocab - j0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < w; ++c) dtol.push_back(tol[r * vocab + j0 + c]);
    }
  }
  EXPECT_TRUE(AgreeBf16(cuda.deltas, cpu.deltas, dtol)) << "strip deltas";
  // The fold state: m is a max of the same loaded values (exact), t a loaded
  // logit (exact), s an exp-sum within the lse bound relative to itself.
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] < 0) continue;
    EXPECT_EQ(cuda.strip_state[r], cpu.strip_state[r]) << "m " << r;
    EXPECT_EQ(cuda.strip_state[2 * rows + r], cpu.strip_state[2 * rows + r]) << "t " << r;
    EXPECT_LE(std::abs(double{cuda.strip_state[rows + r]} - cpu.strip_state[rows + r]),
              lse_tol(r) * cpu.strip_state[rows + r]) << "s " << r;
  }

  // Rope, forward and inverse, near position 0 and 4000.
  const int64_t batch = 2, len = 37, heads = 3, head_dim = 64, half = head_dim / 2;
  const std::vector<Bf16> x = RandomBf16(batch * len * heads * head_dim, 71, -3, 3);
  const std::vector<float> xf = Loaded(x);
  std::vector<double> rtol(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t row = i / head_dim, j = i % head_dim % half;
    rtol[i] = 12 * kU * (std::abs(xf[row * head_dim + j]) + std::abs(xf[row * head_dim + j + half]));
  }
  for (int64_t pos0 : {int64_t{0}, int64_t{4000}}) {
    for (bool inverse : {false, true}) {
      auto rope = [&](DeviceSide& side) {
        auto mk = ModelKernels::Create(side.b());
        EXPECT_TRUE(mk.ok()) << mk.status();
        Bf16* d = side.UploadBf16(x);
        EXPECT_TRUE((*mk)->RopeBf16(side.s(), d, batch, len, heads, head_dim, pos0, 10000.0f, inverse).ok());
        return Loaded(side.DownloadBf16(d, static_cast<int64_t>(x.size())));
      };
      EXPECT_TRUE(AgreeBf16(rope(cuda_), rope(cpu_), rtol)) << "rope pos0 " << pos0 << (inverse ? " inverse" : "");
    }
  }
}

// FillBf16 and AddBf16 (one rounding of the same fp32 value, aliasing
// allowed) are bitwise equal; SumSquaresBf16 sums the loaded values' exact
// squares in double on both sides, in other orders, and rounds once: within
// 2u |result| + 1e-12 sum x^2, as the fp32 twin's SumSquares. n = 2^20 + 3
// spans more than one reduction block sweep; the operands reach 2^20 so
// that sums round.
TEST_F(CudaBf16TwinTest, FillAddAndSumSquaresMatchCpu) {
  const int64_t n = (int64_t{1} << 20) + 3;
  const std::vector<Bf16> a = RandomBf16(n, 91, -1, 1), b = RandomBf16(n, 92, -1024, 1024);
  struct Out {
    std::vector<uint16_t> bits;
    float sumsq = 0;
  };
  auto run = [&](DeviceSide& side) {
    Out o;
    Bf16* filled = side.PoisonedBf16(n);
    EXPECT_TRUE(side.b().FillBf16(side.s(), filled, n, 0.1f).ok());  // 0.1 rounds
    Bf16* sum = side.PoisonedBf16(n);
    const Bf16* da = side.UploadBf16(a);
    Bf16* db = side.UploadBf16(b);
    EXPECT_TRUE(side.b().AddBf16(side.s(), sum, da, db, n).ok());
    EXPECT_TRUE(side.b().AddBf16(side.s(), db, da, db, n).ok());  // in place
    float* sq = side.Poisoned(1);
    EXPECT_TRUE(side.b().SumSquaresBf16(side.s(), sq, db, n).ok());
    for (const Bf16* p : {static_cast<const Bf16*>(filled), static_cast<const Bf16*>(sum),
                          static_cast<const Bf16*>(db)}) {
      for (Bf16 v : side.DownloadBf16(p, n)) o.bits.push_back(v.bits);
    }
    o.sumsq = side.Download(sq, 1)[0];
    return o;
  };
  const Out cpu = run(cpu_), cuda = run(cuda_);
  EXPECT_EQ(cuda.bits, cpu.bits);
  EXPECT_EQ(cpu.bits[0], FloatToBf16(0.1f).bits);
  double sq = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = Bf16ToFloat(Bf16{cpu.bits[2 * n + i]});
    sq += v * v;
  }
  EXPECT_LE(std::abs(double{cuda.sumsq} - cpu.sumsq), 2 * kU * std::abs(cpu.sumsq) + 1e-12 * sq);
}

// SumRowsBf16 (the bf16 ZeRO gradient reduce's sum over the ranks' rows) is
// bitwise the CPU: both add the loaded rows in fp32 in row order, one
// unfused add each, and round once. Rows at a padded stride (ld > n, the
// padding poisoned) of alike-sign terms of one magnitude per column (sums
// that round) and of mixed signs over 2^20 (cancellations); 1, 3 and 16
// rows; n spans more than one grid sweep of the elementwise launch.
TEST_F(CudaBf16TwinTest, SumRowsIsBitwiseCpu) {
  const int64_t n = (int64_t{1} << 17) + 3, ld = n + 5;
  for (int64_t rows : {int64_t{1}, int64_t{3}, int64_t{16}}) {
    for (bool alike : {true, false}) {
      std::vector<Bf16> x =
          alike ? RandomBf16(rows * ld, 93 + rows, 1, 2) : RandomBf16(rows * ld, 95 + rows, -1 << 20, 1 << 20);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = n; i < ld; ++i) x[r * ld + i] = Bf16{0x7FC1};  // never read
      }
      auto run = [&](DeviceSide& side) {
        Bf16* out = side.PoisonedBf16(n);
        EXPECT_TRUE(side.b().SumRowsBf16(side.s(), out, side.UploadBf16(x), rows, n, ld).ok());
        std::vector<uint16_t> bits;
        for (Bf16 v : side.DownloadBf16(out, n)) bits.push_back(v.bits);
        return bits;
      };
      const std::vector<uint16_t> cpu = run(cpu_), cuda = run(cuda_);
      EXPECT_EQ(cuda, cpu) << rows << " rows, " << (alike ? "alike" : "mixed") << " terms";
      // The CPU's bits are the row-order fp32 sum rounded once.
      int64_t wrong = 0;
      for (int64_t i = 0; i < n; ++i) {
        float acc = Bf16ToFloat(x[i]);
        for (int64_t r = 1; r < rows; ++r) acc += Bf16ToFloat(x[r * ld + i]);
        wrong += FloatToBf16(acc).bits != cpu[i];
      }
      EXPECT_EQ(wrong, 0) << rows << " rows";
    }
  }
}

// AddRowsBf16 (LLEP's owner adding its helpers' gradients of an expert) is
// bitwise the CPU: out's loaded value, then the listed rows in list order,
// fp32 adds, one rounding. Lists of 1, 5 (out of order, a repeat) and
// kBf16AddRowsPerCall + 3 rows (two launches); alike and mixed terms; rows
// at a padded stride, the padding and an unlisted row poisoned.
TEST_F(CudaBf16TwinTest, AddRowsIsBitwiseCpu) {
  const int64_t n = (int64_t{1} << 17) + 3, ld = n + 5, rows_in_x = 7;
  std::vector<int32_t> long_list(Backend::kBf16AddRowsPerCall + 3);
  for (size_t r = 0; r < long_list.size(); ++r) long_list[r] = static_cast<int32_t>((r * 5) % 6);
  for (const std::vector<int32_t>& list : {std::vector<int32_t>{3}, std::vector<int32_t>{5, 0, 2, 5, 1}, long_list}) {
    for (bool alike : {true, false}) {
      std::vector<Bf16> x =
          alike ? RandomBf16(rows_in_x * ld, 97, 1, 2) : RandomBf16(rows_in_x * ld, 98, -1 << 20, 1 << 20);
      for (int64_t r = 0; r < rows_in_x; ++r) {
        for (int64_t i = n; i < ld; ++i) x[r * ld + i] = Bf16{0x7FC1};  // never read
      }
      for (int64_t i = 0; i < n; ++i) x[6 * ld + i] = Bf16{0x7FC1};  // row 6 is never listed
      const std::vector<Bf16> start = alike ? RandomBf16(n, 99, 1, 2) : RandomBf16(n, 100, -1 << 20, 1 << 20);
      auto run = [&](DeviceSide& side) {
        Bf16* out = side.UploadBf16(start);
        EXPECT_TRUE(side.b().AddRowsBf16(side.s(), out, side.UploadBf16(x), list, ld, n).ok());
        std::vector<uint16_t> bits;
        for (Bf16 v : side.DownloadBf16(out, n)) bits.push_back(v.bits);
        return bits;
      };
      const std::vector<uint16_t> cpu = run(cpu_), cuda = run(cuda_);
      EXPECT_EQ(cuda, cpu) << list.size() << " rows, " << (alike ? "alike" : "mixed") << " terms";
      int64_t changed = 0;
      for (int64_t i = 0; i < n; ++i) changed += cpu[i] != start[i].bits;
      EXPECT_GT(changed, n / 2) << "the rows were added";
    }
  }
}

// ---------------------------------------------------------------------------
// The bf16 embedding gradient: every touched table row is its loaded value
// plus the fp32 sum of its rows' gradients in row order, rounded once, on
// both sides (the CUDA kernel's first-occurrence block walks the rows in
// order, as the CPU's loop): bitwise equal, untouched rows included (the
// CPU rounds them back to their own bits; the kernel leaves them alone).
// hidden = 2100 takes two of the kernel's column chunks, the second partial;
// the tokens repeat (vocab 64 over 1000 rows), and three rows carry the
// table's last token.
TEST_F(CudaBf16TwinTest, EmbeddingBackwardIsBitwiseCpu) {
  const int64_t rows = 1000, hidden = 2100, vocab = 70;
  const std::vector<Bf16> dout = RandomBf16(rows * hidden, 61, -2, 2),
                          table0 = RandomBf16(vocab * hidden, 62);
  std::mt19937 rng(63);
  std::vector<int32_t> tok(rows);
  for (int32_t& t : tok) t = static_cast<int32_t>(rng() % 64);  // rows 64..67 untouched
  tok[5] = tok[500] = tok[999] = static_cast<int32_t>(vocab - 1);
  // A token whose only row is past the first 256-row scan window: its
  // first-occurrence check must scan several windows without a hit.
  tok[700] = 68;
  auto run = [&](DeviceSide& side) {
    auto mk = ModelKernels::Create(side.b());
    EXPECT_TRUE(mk.ok()) << mk.status();
    std::vector<float> f(tok.size());
    std::memcpy(f.data(), tok.data(), tok.size() * sizeof(int32_t));
    const int32_t* dt = reinterpret_cast<int32_t*>(side.Upload(f));
    Bf16* table = side.UploadBf16(table0);
    EXPECT_TRUE((*mk)->EmbeddingBackwardBf16(side.s(), side.UploadBf16(dout), dt, rows, hidden,
                                             table, vocab).ok());
    std::vector<uint16_t> bits;
    for (Bf16 b : side.DownloadBf16(table, vocab * hidden)) bits.push_back(b.bits);
    return bits;
  };
  const std::vector<uint16_t> cpu = run(cpu_), cuda = run(cuda_);
  EXPECT_EQ(cuda, cpu);
  EXPECT_EQ(run(cuda_), cuda) << "run to run";
  // Not vacuous: the gradient changed the touched rows.
  int64_t changed = 0;
  for (int64_t i = 0; i < vocab * hidden; ++i) changed += cpu[i] != table0[i].bits;
  EXPECT_GT(changed, 60 * hidden);
}

// The grouped bf16 GEMM (the expert groups): cuBLAS's grouped call for the
// bf16-C entries, GemmBf16 for the k = 0 and fp32-C ones, against the CPU
// on the same entries with GemmMatchesCpu's bound (4 k u |alpha| sum |a b|
// + |beta c|, plus one bf16 unit for a bf16 C). Entries 0 and 1 share their
// parameters (one cuBLAS group), entry 3 has k = 0, entry 4 an fp32 C,
// entry 5 its A and C one element past a 16-byte boundary (a slice at an
// odd row of a matrix whose width is not a multiple of 8: the grouped call
// must not take it; the emulated one faults on it); C starts as NaN where
// beta = 0 (it must not be read).
TEST_F(CudaBf16TwinTest, GroupedGemmMatchesCpu) {
  struct Entry {
    bool ta, tb;
    int64_t m, n, k;
    float beta;
    bool fp32_c;
    bool misaligned = false;
  };
  const Entry entries[] = {
      {false, true, 40, 96, 64, 0.0f, false},  {false, true, 40, 96, 64, 0.0f, false},
      {true, false, 17, 33, 129, 1.0f, false}, {false, false, 9, 12, 0, 0.5f, false},
      {false, true, 23, 31, 48, 0.0f, true},   {false, true, 40, 96, 64, 0.0f, false, true}};
  struct Data {
    std::vector<Bf16> a, b, c;
  };
  std::vector<Data> data;
  uint32_t seed = 80;
  for (const Entry& e : entries) {
    data.push_back({RandomBf16(std::max<int64_t>(e.m * e.k, 1), seed++),
                    RandomBf16(std::max<int64_t>(e.k * e.n, 1), seed++),
                    RandomBf16(e.m * e.n, seed++)});
  }
  auto run = [&](DeviceSide& side) {
    std::vector<GemmBf16Args> gemms;
    for (size_t i = 0; i < std::size(entries); ++i) {
      const Entry& e = entries[i];
      GemmBf16Args g;
      g.trans_a = e.ta;
      g.trans_b = e.tb;
      g.m = e.m;
      g.n = e.n;
      g.k = e.k;
      g.alpha = 0.75f;
      g.beta = e.beta;
      // A misaligned entry's A and C start one element into an upload.
      const int64_t skew = e.misaligned ? 1 : 0;
      std::vector<Bf16> a = data[i].a;
      a.insert(a.begin(), skew, Bf16{0});
      g.a = side.UploadBf16(a) + skew;
      g.lda = std::max<int64_t>(e.ta ? e.m : e.k, 1);
      g.b = side.UploadBf16(data[i].b);
      g.ldb = std::max<int64_t>(e.tb ? e.k : e.n, 1);
      g.ldc = e.n;
      if (e.fp32_c) {
        g.c_fp32 = e.beta == 0.0f ? side.Poisoned(e.m * e.n) : side.Upload(Loaded(data[i].c));
      } else {
        std::vector<Bf16> c =
            e.beta == 0.0f ? std::vector<Bf16>(e.m * e.n, Bf16{0x7fc0}) : data[i].c;  // NaN
        c.insert(c.begin(), skew, Bf16{0});
        g.c = side.UploadBf16(c) + skew;
      }
      gemms.push_back(g);
    }
    const absl::Status st = side.b().GroupedGemmBf16(side.s(), gemms);
    EXPECT_TRUE(st.ok()) << st;
    std::vector<std::vector<float>> out;
    for (size_t i = 0; i < gemms.size(); ++i) {
      const int64_t n = entries[i].m * entries[i].n;
      out.push_back(gemms[i].c != nullptr ? Loaded(side.DownloadBf16(gemms[i].c, n))
                                          : side.Download(gemms[i].c_fp32, n));
    }
    return out;
  };
  const auto cpu = run(cpu_), cuda = run(cuda_);
  for (size_t i = 0; i < std::size(entries); ++i) {
    SCOPED_TRACE(::testing::Message() << "entry " << i);
    const Entry& e = entries[i];
    const std::vector<float> af = Loaded(data[i].a), bf = Loaded(data[i].b),
                             cf = Loaded(data[i].c);
    const int64_t lda = e.ta ? e.m : e.k, ldb = e.tb ? e.k : e.n;
    std::vector<double> tol(e.m * e.n);
    for (int64_t r = 0; r < e.m; ++r) {
      for (int64_t c = 0; c < e.n; ++c) {
        double mag = 0;
        for (int64_t p = 0; p < e.k; ++p) {
          const double av = e.ta ? af[p * lda + r] : af[r * lda + p];
          const double bv = e.tb ? bf[c * ldb + p] : bf[p * ldb + c];
          mag += std::abs(av * bv);
        }
        mag = 0.75 * mag + (e.beta == 0.0f ? 0.0 : std::abs(e.beta * cf[r * e.n + c]));
        tol[r * e.n + c] = 4.0 * std::max<int64_t>(e.k, 1) * kU * mag;
      }
    }
    if (e.fp32_c) {
      for (size_t j = 0; j < tol.size(); ++j) {
        ASSERT_LE(std::abs(double{cuda[i][j]} - cpu[i][j]), tol[j]) << "C[" << j << "]";
      }
    } else {
      EXPECT_TRUE(AgreeBf16(cuda[i], cpu[i], tol));
    }
  }
}

// ---------------------------------------------------------------------------
// Attention's bf16 block pairs (bf16 q, k, v, dO; fp32 m, l, acc, lse,
// delta, dq, dK, dV: ring attention rounds dq once, after its last hop),
// two ways:
// - against the CPU emulation (the fp32 functions on the loaded inputs):
//   cuda_model_twin_test's fp32 attention tolerances (3e-5 of the largest
//   magnitude for the state, 2e-4 for the gradients; the dot products sum
//   in another order), delta bitwise (the same loop on both sides);
// - against the CUDA fp32 kernels on the loaded values, bit for bit: the
//   bf16 kernels are the same kernels with exact loads into the same fp32
//   tiles.
// Each side also gives the same bits run to run. Causal offsets, GQA 1 to 8,
// head_dim 8 to 176 (at 176 the tile is 16 rows: the largest shared memory
// of the tiled kernels), lengths off the tile, and rows that see no key.

struct AttnBf16Case {
  const char* name;
  int64_t batch, q_len, kv_len, heads, kv_heads, head_dim, q_pos0;
  std::vector<int64_t> kv_pos0s;  // the K/V blocks, in the order they fold
};

// Failures name the case, not its bytes.
void PrintTo(const AttnBf16Case& c, std::ostream* os) { *os << c.name; }

class CudaAttentionBf16Test : public CudaBf16TwinTest,
                              public ::testing::WithParamInterface<AttnBf16Case> {};

double MaxAbsFinite(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) {
    if (std::isfinite(x)) m = std::max(m, double{std::abs(x)});
  }
  return m;
}

// Equal values (infinities included) pass; otherwise |got - want| <= tol.
::testing::AssertionResult Within(const std::vector<float>& got, const std::vector<float>& want,
                                  double tol, const char* what) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes";
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] == want[i]) continue;
    if (!(std::abs(double{got[i]} - double{want[i]}) <= tol)) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << want.size()
                                       << " disagree; first [" << first << "]: " << got[first]
                                       << " vs " << want[first] << ", tol " << tol;
}

template <typename T>
::testing::AssertionResult Bitwise(const std::vector<T>& a, const std::vector<T>& b,
                                   const char* what) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << what << ": sizes";
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      return ::testing::AssertionFailure() << what << ": first difference at [" << i << "]";
    }
  }
  return ::testing::AssertionSuccess();
}

struct AttnBf16Data {
  std::vector<AttentionShape> shapes;
  int64_t rows = 0, q_size = 0, kv_size = 0;
  std::vector<Bf16> q, dout, dq0;
  std::vector<std::vector<Bf16>> k, v;
  std::vector<std::vector<float>> dk0, dv0;
};

struct AttnBf16Out {
  std::vector<float> m, l, acc, o, lse, delta, dq;
  std::vector<std::vector<float>> dk, dv;
};

// Init, ForwardBlock over the blocks, Finalize, Delta and BackwardBlock over
// the blocks on one side, in bf16 (`fp32` false) or on the loaded values
// with the fp32 ops (`fp32` true). dq is fp32 in both (ring attention rounds
// it once, after its last hop). Delta and the backward use `ref` (o, lse;
// the CPU's) when given, so both sides differentiate the same state.
AttnBf16Out AttnRun(DeviceSide& side, const AttnBf16Data& d, bool fp32, const AttnBf16Out* ref) {
  AttnBf16Out out;
  // The tiled kernels (on CUDA, kAuto would take the tensor-core ones at
  // head_dim 64 and 128: cuda_attention_tc_twin_test holds those).
  ModelKernelsOptions options;
  options.bf16_attention = Bf16Attention::kTiles;
  auto mk = ModelKernels::Create(side.b(), options);
  EXPECT_TRUE(mk.ok()) << mk.status();
  if (!mk.ok()) return out;
  ModelKernels& k = **mk;
  const AttentionShape& s0 = d.shapes[0];
  float* m = side.Poisoned(d.rows);
  float* l = side.Poisoned(d.rows);
  float* acc = side.Poisoned(d.q_size);
  EXPECT_TRUE(k.AttentionInit(side.s(), s0, m, l, acc).ok());
  const Bf16* qb = side.UploadBf16(d.q);
  const float* qf = side.Upload(Loaded(d.q));
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    float* work = side.Poisoned(std::max<int64_t>(AttentionWorkspaceFloats(d.shapes[j]), 1));
    absl::Status st =
        fp32 ? k.AttentionForwardBlock(side.s(), d.shapes[j], qf, side.Upload(Loaded(d.k[j])),
                                       side.Upload(Loaded(d.v[j])), m, l, acc, work)
             : k.AttentionForwardBlockBf16(side.s(), d.shapes[j], qb, side.UploadBf16(d.k[j]),
                                           side.UploadBf16(d.v[j]), m, l, acc, work);
    EXPECT_TRUE(st.ok()) << st;
  }
  out.m = side.Download(m, d.rows);
  out.l = side.Download(l, d.rows);
  out.acc = side.Download(acc, d.q_size);
  float* lse = side.Poisoned(d.rows);
  EXPECT_TRUE(k.AttentionFinalize(side.s(), s0, m, l, acc, lse).ok());
  out.o = side.Download(acc, d.q_size);
  out.lse = side.Download(lse, d.rows);
  const float* o_in = side.Upload(ref != nullptr ? ref->o : out.o);
  const float* lse_in = side.Upload(ref != nullptr ? ref->lse : out.lse);
  float* delta = side.Poisoned(d.rows);
  EXPECT_TRUE((fp32 ? k.AttentionDelta(side.s(), s0, o_in, side.Upload(Loaded(d.dout)), delta)
                    : k.AttentionDeltaBf16(side.s(), s0, o_in, side.UploadBf16(d.dout), delta))
                  .ok());
  out.delta = side.Download(delta, d.rows);
  const float* delta_in = side.Upload(ref != nullptr ? ref->delta : out.delta);
  const Bf16* doutb = side.UploadBf16(d.dout);
  const float* doutf = side.Upload(Loaded(d.dout));
  float* dq = side.Upload(Loaded(d.dq0));
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    float* work = side.Poisoned(std::max<int64_t>(AttentionWorkspaceFloats(d.shapes[j]), 1));
    float* dk = side.Upload(d.dk0[j]);
    float* dv = side.Upload(d.dv0[j]);
    if (fp32) {
      EXPECT_TRUE(k.AttentionBackwardBlock(side.s(), d.shapes[j], qf, side.Upload(Loaded(d.k[j])),
                                           side.Upload(Loaded(d.v[j])), doutf, lse_in, delta_in, dq, dk, dv, work)
                      .ok());
    } else {
      EXPECT_TRUE(k.AttentionBackwardBlockBf16(side.s(), d.shapes[j], qb, side.UploadBf16(d.k[j]),
                                               side.UploadBf16(d.v[j]), doutb, lse_in, delta_in, dq, dk, dv, work)
                      .ok());
    }
    out.dk.push_back(side.Download(dk, d.kv_size));
    out.dv.push_back(side.Download(dv, d.kv_size));
  }
  out.dq = side.Download(dq, d.q_size);
  return out;
}

TEST_P(CudaAttentionBf16Test, MatchesCpuAndTheFp32Kernels) {
  const AttnBf16Case& c = GetParam();
  AttnBf16Data d;
  for (int64_t p : c.kv_pos0s) {
    AttentionShape s;
    s.batch = c.batch;
    s.q_len = c.q_len;
    s.kv_len = c.kv_len;
    s.heads = c.heads;
    s.kv_heads = c.kv_heads;
    s.head_dim = c.head_dim;
    s.q_pos0 = c.q_pos0;
    s.kv_pos0 = p;
    s.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    d.shapes.push_back(s);
  }
  d.rows = c.batch * c.q_len * c.heads;
  d.q_size = d.rows * c.head_dim;
  d.kv_size = c.batch * c.kv_len * c.kv_heads * c.head_dim;
  uint32_t seed = 700;
  d.q = RandomBf16(d.q_size, seed++);
  d.dout = RandomBf16(d.q_size, seed++);
  d.dq0 = RandomBf16(d.q_size, seed++, -0.5f, 0.5f);
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    d.k.push_back(RandomBf16(d.kv_size, seed++));
    d.v.push_back(RandomBf16(d.kv_size, seed++));
    d.dk0.push_back(Loaded(RandomBf16(d.kv_size, seed++, -0.5f, 0.5f)));
    d.dv0.push_back(Loaded(RandomBf16(d.kv_size, seed++, -0.5f, 0.5f)));
  }

  const AttnBf16Out cpu = AttnRun(cpu_, d, /*fp32=*/false, nullptr);
  const AttnBf16Out cuda = AttnRun(cuda_, d, /*fp32=*/false, &cpu);

  // Against the CPU emulation.
  EXPECT_TRUE(Within(cuda.m, cpu.m, 3e-5 * MaxAbsFinite(cpu.m) + 1e-6, "m"));
  EXPECT_TRUE(Within(cuda.l, cpu.l, 3e-5 * MaxAbsFinite(cpu.l), "l"));
  EXPECT_TRUE(Within(cuda.acc, cpu.acc, 3e-5 * MaxAbsFinite(cpu.acc) + 1e-7, "acc"));
  EXPECT_TRUE(Bitwise(cuda.delta, cpu.delta, "delta"));
  EXPECT_TRUE(Within(cuda.dq, cpu.dq, 2e-4 * MaxAbsFinite(cpu.dq), "dq"));
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    EXPECT_TRUE(Within(cuda.dk[j], cpu.dk[j], 2e-4 * MaxAbsFinite(cpu.dk[j]), "dk"));
    EXPECT_TRUE(Within(cuda.dv[j], cpu.dv[j], 2e-4 * MaxAbsFinite(cpu.dv[j]), "dv"));
  }
  // Not vacuous: the pairs moved dq away from its start somewhere (unless
  // no query sees any key).
  if (MaxAbsFinite(cpu.l) > 0) {
    EXPECT_NE(cpu.dq, Loaded(d.dq0));
  }

  // Against the CUDA fp32 kernels on the loaded values, bit for bit.
  const AttnBf16Out f32 = AttnRun(cuda_, d, /*fp32=*/true, &cpu);
  EXPECT_TRUE(Bitwise(cuda.m, f32.m, "m vs fp32 kernel"));
  EXPECT_TRUE(Bitwise(cuda.l, f32.l, "l vs fp32 kernel"));
  EXPECT_TRUE(Bitwise(cuda.acc, f32.acc, "acc vs fp32 kernel"));
  EXPECT_TRUE(Bitwise(cuda.delta, f32.delta, "delta vs fp32 kernel"));
  EXPECT_TRUE(Bitwise(cuda.dq, f32.dq, "dq vs fp32 kernel"));
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    EXPECT_TRUE(Bitwise(cuda.dk[j], f32.dk[j], "dk vs fp32 kernel"));
    EXPECT_TRUE(Bitwise(cuda.dv[j], f32.dv[j], "dv vs fp32 kernel"));
  }

  // Run to run.
  const AttnBf16Out again = AttnRun(cuda_, d, /*fp32=*/false, &cpu);
  EXPECT_TRUE(Bitwise(again.acc, cuda.acc, "acc run 2"));
  EXPECT_TRUE(Bitwise(again.dq, cuda.dq, "dq run 2"));
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    EXPECT_TRUE(Bitwise(again.dk[j], cuda.dk[j], "dk run 2"));
    EXPECT_TRUE(Bitwise(again.dv[j], cuda.dv[j], "dv run 2"));
  }
}

// Tiles (cuda_model_ops.h): 32 rows for head_dim <= 64, 16 for 128 and
// 176; no length below is a multiple of either.
INSTANTIATE_TEST_SUITE_P(Shapes, CudaAttentionBf16Test,
                         ::testing::Values(
                             // GQA 1: the own (diagonal) block, then the earlier one.
                             AttnBf16Case{"gqa1_ring", 2, 37, 37, 4, 4, 16, 37, {37, 0}},
                             // GQA 3, key blocks shorter than the queries, the last overlapping
                             // the queries partly.
                             AttnBf16Case{"gqa3_offsets", 1, 70, 45, 6, 2, 32, 90, {90, 45, 0}},
                             // GQA 2: a partly visible block and one wholly after the queries.
                             AttnBf16Case{"gqa2_after", 2, 50, 50, 4, 2, 64, 100, {100, 60, 150}},
                             // GQA 8, head_dim 128, more keys than queries from position 0.
                             AttnBf16Case{"gqa8_d128", 1, 33, 40, 8, 1, 128, 0, {0}},
                             // GQA 2, head_dim 176: 16-row tiles, the most shared memory (47,488
                             // bytes for dK/dV); the own block, then the earlier one.
                             AttnBf16Case{"gqa2_d176", 1, 21, 21, 4, 2, 176, 21, {21, 0}},
                             // Queries that see no key: o = 0, lse = -inf, dq unchanged.
                             AttnBf16Case{"none_visible", 1, 20, 20, 2, 1, 8, 0, {40}}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace plateau
