// The CUDA model kernels against their CPU twins: each op with a CUDA kernel
// runs through ModelKernels on both backends, on the same random inputs, at
// shapes that stress the kernels' grids (3 x 1000, 1000 x 3, 17 x 4096, more
// rows than one grid), with ignored rows, targets inside and outside each
// strip and logits up to +-1e4; results are compared with the tolerances
// stated beside each test. Also: the CUDA results are the same bits run to
// run, the five attention ops (forward and backward block pairs in ring
// attention's flow, GQA, causal offsets, lengths off the tile), the shapes a
// CUDA kernel cannot take answer UNIMPLEMENTED naming the op, and
// Ring-DTP at P = 1 on CUDA (NCCL, one rank) matches the CPU backend's.
//
// Without a CUDA backend (the default build, or no GPU) every test skips and
// says why.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/kv_store.h"
#include "kernels/model/config.h"
#include "kernels/model/model_kernels.h"
#include "kernels/projection/ring_dtp.h"
#include "kernels/testing/device_side.h"
#include "kernels/testing/local_world.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

constexpr double kU = 1.0 / (1 << 24);  // fp32 unit roundoff

// One backend with a stream and its model kernels; buffers live in the
// device space and are filled and read back through Backend::Copy.
struct Side {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<ModelKernels> k;
  std::vector<Buffer> buffers;

  ~Side() {
    if (stream != nullptr) (void)stream->Synchronize();
    buffers.clear();
    k.reset();
    stream.reset();
  }

  template <typename T>
  T* Up(const std::vector<T>& host) {
    auto buf = backend->device().Allocate(LiveSet::kActivations,
                                          std::max<size_t>(host.size(), 1) * sizeof(T));
    EXPECT_TRUE(buf.ok()) << buf.status();
    if (!buf.ok()) return nullptr;
    T* d = buf->template as<T>();
    if (!host.empty()) {
      EXPECT_TRUE(backend->Copy(*stream, d, host.data(), host.size() * sizeof(T)).ok());
    }
    EXPECT_TRUE(stream->Synchronize().ok());
    buffers.push_back(std::move(*buf));
    return d;
  }
  template <typename T>
  std::vector<T> Down(const T* d, int64_t n) {
    std::vector<T> host(n);
    absl::Status st = stream->Synchronize();
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_TRUE(backend->Copy(*stream, host.data(), d, n * sizeof(T)).ok());
    st = stream->Synchronize();
    EXPECT_TRUE(st.ok()) << st;
    return host;
  }
};

absl::Status MakeSide(BackendKind kind, Side& side) {
  BackendOptions options;
  options.kind = kind;
  if (kind == BackendKind::kCpu) options.device_memory_bytes = int64_t{2} << 30;
  auto backend = Backend::Create(options);
  if (!backend.ok()) return backend.status();
  side.backend = std::move(*backend);
  auto stream = side.backend->CreateStream("compute");
  if (!stream.ok()) return stream.status();
  side.stream = std::move(*stream);
  auto k = ModelKernels::Create(*side.backend);
  if (!k.ok()) return k.status();
  side.k = std::move(*k);
  return absl::OkStatus();
}

std::vector<float> Uniform(int64_t n, uint32_t seed, float amp) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-amp, amp);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Targets in [0, vocab), about one in five ignored, the first row always
// valid and the last always ignored (when rows > 1).
std::vector<int32_t> Targets(int64_t rows, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> t(rows);
  for (int64_t r = 0; r < rows; ++r) t[r] = rng() % 5 == 0 ? kIgnoreIndex : dist(rng);
  t[0] = dist(rng);
  if (rows > 1) t[rows - 1] = kIgnoreIndex;
  return t;
}

// |got[i] - want[i]| <= tol(i) for every i; NaN never passes.
template <typename Tol>
::testing::AssertionResult Near(const std::vector<float>& got,
                                const std::vector<float>& want, Tol tol,
                                const std::string& what) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes";
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < want.size(); ++i) {
    const double err = std::abs(double{got[i]} - double{want[i]});
    if (!(err <= tol(i))) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << want.size() << " disagree; first [" << first
         << "]: cuda " << got[first] << ", cpu " << want[first] << ", tol " << tol(first);
}

template <typename T>
::testing::AssertionResult SameBits(const std::vector<T>& a, const std::vector<T>& b,
                                    const std::string& what) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << what << ": sizes";
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      return ::testing::AssertionFailure() << what << ": first difference at [" << i
                                           << "]: " << a[i] << " vs " << b[i];
    }
  }
  return ::testing::AssertionSuccess();
}

class CudaModelTwinTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::Status cuda = MakeSide(BackendKind::kCuda, cuda_);
    if (!cuda.ok() && NoCudaHere(cuda)) {
      GTEST_SKIP() << "no CUDA model kernels here: " << cuda;
    }
    ASSERT_TRUE(cuda.ok()) << "a GPU is visible but the CUDA side failed: "
                           << cuda;
    absl::Status cpu = MakeSide(BackendKind::kCpu, cpu_);
    ASSERT_TRUE(cpu.ok()) << cpu;
  }
  Side cpu_, cuda_;
};

// ---------------------------------------------------------------------------
// Ring-DTP strips: StripInit, StripFold over every strip, StripFinish.

struct StripCase {
  int64_t rows, vocab, strip;
  float amp;
};

struct StripOut {
  std::vector<float> state, lse;
  std::vector<double> stats;
};

StripOut RunStrips(Side& side, const StripCase& c, const std::vector<float>& logits,
                   const std::vector<int32_t>& targets) {
  // The strips of logits, each rows x width contiguous, as Ring-DTP's tile.
  const int64_t N = c.rows;
  int32_t* y = side.Up(targets);
  float* state = side.Up(std::vector<float>(3 * N, 7.0f));  // StripInit overwrites
  float* lse = side.Up(std::vector<float>(N, 7.0f));
  double* stats = side.Up(std::vector<double>{0.5, 2.0});  // += , not =
  EXPECT_TRUE(side.k->StripInit(*side.stream, state, N).ok());
  for (int64_t j0 = 0; j0 < c.vocab; j0 += c.strip) {
    const int64_t w = std::min(c.strip, c.vocab - j0);
    std::vector<float> tile(N * w);
    for (int64_t r = 0; r < N; ++r) {
      std::copy_n(&logits[r * c.vocab + j0], w, &tile[r * w]);
    }
    float* d = side.Up(tile);
    absl::Status st = side.k->StripFold(*side.stream, d, N, w, j0, y, state, N);
    EXPECT_TRUE(st.ok()) << st;
  }
  absl::Status st = side.k->StripFinish(*side.stream, state, y, N, lse, stats);
  EXPECT_TRUE(st.ok()) << st;
  StripOut out;
  out.state = side.Down(state, 3 * N);
  out.lse = side.Down(lse, N);
  out.stats = side.Down(stats, 2);
  side.buffers.clear();
  return out;
}

class CudaStripTest : public CudaModelTwinTest,
                      public ::testing::WithParamInterface<StripCase> {};

// Tolerances (u = 2^-24; CUDA's expf/logf are within 2 ulp = 4u, glibc's
// within 1). m (a max) and t (a copy) are exact: same bits. s: the CPU sums
// each strip's exps in fp32 left to right (error up to S u of the sum), the
// GPU in double (exact enough), each exp within 6u of the other side's, and
// the rescale of each strip adds ~10u: |ds| <= (S + 16 strips) 2u s.
// lse = m + log s: |dlse| <= ds/s + 8u log(V) (log s <= log V, logf on both
// sides) + 4u |lse| (the final add on both sides). The loss sum: the rows'
// |dlse| plus 2u of each term (the fp32 lse - t on both sides). The valid
// count: exact.
TEST_P(CudaStripTest, FoldAndFinishMatchCpu) {
  const StripCase c = GetParam();
  const std::vector<float> logits = Uniform(c.rows * c.vocab, 11, c.amp);
  const std::vector<int32_t> targets = Targets(c.rows, c.vocab, 12);
  const StripOut cpu = RunStrips(cpu_, c, logits, targets);
  const StripOut gpu = RunStrips(cuda_, c, logits, targets);
  const int64_t N = c.rows;
  const int64_t strips = (c.vocab + c.strip - 1) / c.strip;
  const double rel_s = (c.strip + 16.0 * strips) * 2 * kU;

  std::vector<float> m_cpu(cpu.state.begin(), cpu.state.begin() + N);
  std::vector<float> m_gpu(gpu.state.begin(), gpu.state.begin() + N);
  std::vector<float> t_cpu(cpu.state.begin() + 2 * N, cpu.state.end());
  std::vector<float> t_gpu(gpu.state.begin() + 2 * N, gpu.state.end());
  EXPECT_TRUE(SameBits(m_gpu, m_cpu, "m"));
  EXPECT_TRUE(SameBits(t_gpu, t_cpu, "t"));
  std::vector<float> s_cpu(cpu.state.begin() + N, cpu.state.begin() + 2 * N);
  std::vector<float> s_gpu(gpu.state.begin() + N, gpu.state.begin() + 2 * N);
  EXPECT_TRUE(Near(s_gpu, s_cpu, [&](size_t i) { return rel_s * s_cpu[i]; }, "s"));
  auto lse_tol = [&](size_t i) {
    return rel_s + 8 * kU * std::log(double(c.vocab)) + 4 * kU * std::abs(cpu.lse[i]) + 1e-30;
  };
  EXPECT_TRUE(Near(gpu.lse, cpu.lse, lse_tol, "lse"));
  double loss_tol = 0;
  int64_t valid = 0;
  for (int64_t r = 0; r < N; ++r) {
    if (targets[r] == kIgnoreIndex) {
      EXPECT_EQ(gpu.lse[r], 0.0f) << "ignored row " << r;
      continue;
    }
    ++valid;
    loss_tol += lse_tol(r) + 2 * kU * std::abs(double{cpu.lse[r]} - t_cpu[r]);
  }
  EXPECT_NEAR(gpu.stats[0], cpu.stats[0], loss_tol + 1e-12 * std::abs(cpu.stats[0]));
  EXPECT_EQ(gpu.stats[1], 2.0 + valid);
  EXPECT_EQ(cpu.stats[1], 2.0 + valid);

  // Determinism: a second CUDA run gives the same bits.
  const StripOut again = RunStrips(cuda_, c, logits, targets);
  EXPECT_TRUE(SameBits(again.state, gpu.state, "state, run 2"));
  EXPECT_TRUE(SameBits(again.lse, gpu.lse, "lse, run 2"));
  EXPECT_TRUE(SameBits(again.stats, gpu.stats, "stats, run 2"));
}

// StripDelta on each strip from the same (CPU) lse, so the comparison sees
// the kernel alone. Both sides compute the same fp32 x - lse; with
// e = exp(x - lse): the exps within 6u e of each other, the products with
// scale rounded on each side (2u e), the one-hot subtraction rounded on each
// side (2u |result|): |d| <= scale (8u e) + 2u |result|.
TEST_P(CudaStripTest, DeltaMatchesCpu) {
  const StripCase c = GetParam();
  const std::vector<float> logits = Uniform(c.rows * c.vocab, 21, c.amp);
  const std::vector<int32_t> targets = Targets(c.rows, c.vocab, 22);
  const StripOut ref = RunStrips(cpu_, c, logits, targets);
  const float scale = 1.0f / 3.0f;
  const int64_t N = c.rows;
  for (int64_t j0 = 0; j0 < c.vocab; j0 += c.strip) {
    const int64_t w = std::min(c.strip, c.vocab - j0);
    std::vector<float> tile(N * w);
    for (int64_t r = 0; r < N; ++r) std::copy_n(&logits[r * c.vocab + j0], w, &tile[r * w]);
    std::vector<std::vector<float>> outs;
    for (Side* side : {&cpu_, &cuda_, &cuda_}) {
      float* d = side->Up(tile);
      const int32_t* y = side->Up(targets);
      const float* lse = side->Up(ref.lse);
      absl::Status st = side->k->StripDelta(*side->stream, d, N, w, j0, y, lse, scale);
      EXPECT_TRUE(st.ok()) << st;
      outs.push_back(side->Down(d, N * w));
      side->buffers.clear();
    }
    const std::vector<float>& want = outs[0];
    EXPECT_TRUE(Near(outs[1], want,
                     [&](size_t i) {
                       const int64_t r = static_cast<int64_t>(i) / w;
                       const double e = std::exp(double(tile[i]) - double(ref.lse[r]));
                       return scale * 8 * kU * e + 2 * kU * std::abs(want[i]) + 1e-30;
                     },
                     absl::StrCat("delta of strip at ", j0)));
    EXPECT_TRUE(SameBits(outs[2], outs[1], absl::StrCat("delta run 2, strip at ", j0)));
    for (int64_t r = 0; r < N; ++r) {
      if (targets[r] != kIgnoreIndex) continue;
      for (int64_t cc = 0; cc < w; ++cc) ASSERT_EQ(outs[1][r * w + cc], 0.0f);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaStripTest,
    ::testing::Values(StripCase{3, 1000, 1000, 1.0f},    // one strip, wider than a block
                      StripCase{3, 1000, 300, 30.0f},    // a short last strip
                      StripCase{1000, 3, 2, 1e4f},       // narrow strips, many rows
                      StripCase{17, 4096, 1024, 1e4f},   // large logits
                      StripCase{17, 4096, 4096, 5.0f},
                      StripCase{70000, 5, 3, 10.0f}));   // more rows than one grid

// ---------------------------------------------------------------------------
// Dense cross-entropy: as the strips with one strip of the whole vocabulary.

class CudaCrossEntropyTest : public CudaModelTwinTest,
                             public ::testing::WithParamInterface<StripCase> {};

TEST_P(CudaCrossEntropyTest, ForwardAndBackwardMatchCpu) {
  const StripCase c = GetParam();
  const int64_t N = c.rows, V = c.vocab;
  const std::vector<float> logits = Uniform(N * V, 31, c.amp);
  const std::vector<int32_t> targets = Targets(N, V, 32);
  std::vector<std::vector<float>> lse;
  std::vector<std::vector<double>> stats;
  for (Side* side : {&cpu_, &cuda_, &cuda_}) {
    const float* x = side->Up(logits);
    const int32_t* y = side->Up(targets);
    float* l = side->Up(std::vector<float>(N, 7.0f));
    double* s = side->Up(std::vector<double>{0.5, 2.0});
    absl::Status st = side->k->CrossEntropy(*side->stream, x, y, N, V, l, s);
    EXPECT_TRUE(st.ok()) << st;
    lse.push_back(side->Down(l, N));
    stats.push_back(side->Down(s, 2));
    side->buffers.clear();
  }
  // As FoldAndFinishMatchCpu with one strip of width V.
  const double rel_s = (V + 16.0) * 2 * kU;
  auto lse_tol = [&](size_t i) {
    return rel_s + 8 * kU * std::log(double(V)) + 4 * kU * std::abs(lse[0][i]) + 1e-30;
  };
  EXPECT_TRUE(Near(lse[1], lse[0], lse_tol, "lse"));
  double loss_tol = 0;
  int64_t valid = 0;
  for (int64_t r = 0; r < N; ++r) {
    if (targets[r] == kIgnoreIndex) continue;
    ++valid;
    loss_tol += lse_tol(r) + 2 * kU * std::abs(lse[0][r] - logits[r * V + targets[r]]);
  }
  EXPECT_NEAR(stats[1][0], stats[0][0], loss_tol + 1e-12 * std::abs(stats[0][0]));
  EXPECT_EQ(stats[1][1], 2.0 + valid);
  EXPECT_TRUE(SameBits(lse[2], lse[1], "lse run 2"));
  EXPECT_TRUE(SameBits(stats[2], stats[1], "stats run 2"));

  // Backward from the CPU's lse: as DeltaMatchesCpu.
  const float scale = 0.25f;
  std::vector<std::vector<float>> grads;
  for (Side* side : {&cpu_, &cuda_}) {
    float* g = side->Up(logits);
    const int32_t* y = side->Up(targets);
    const float* l = side->Up(lse[0]);
    absl::Status st = side->k->CrossEntropyBackward(*side->stream, g, l, y, N, V, scale);
    EXPECT_TRUE(st.ok()) << st;
    grads.push_back(side->Down(g, N * V));
    side->buffers.clear();
  }
  EXPECT_TRUE(Near(grads[1], grads[0],
                   [&](size_t i) {
                     const double e = std::exp(double(logits[i]) - double(lse[0][i / V]));
                     return scale * 8 * kU * e + 2 * kU * std::abs(grads[0][i]) + 1e-30;
                   },
                   "grad"));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaCrossEntropyTest,
                         ::testing::Values(StripCase{3, 1000, 0, 1.0f},
                                           StripCase{1000, 3, 0, 1e4f},
                                           StripCase{17, 4096, 0, 1e4f}));

// ---------------------------------------------------------------------------
// Embedding and the dispatch row movement: copies and the CPU's own order of
// adds, so the same bits (RowDots: both sum exact products in double, and
// may round the double sum to a neighbouring float: 2u of sum |a b|).

// The gradient's kernel gives each table row to the block of its token's
// first row (kernels/cuda/cuda_model_ops.cu): hidden = 2100 takes two of its
// 2048-column chunks, the second partial; the tokens repeat; token 48's two
// rows lie past the first 256-row scan window, so the first-occurrence checks
// scan several windows (row 700's without a hit, row 800's to its hit at
// 700); token 49's rows span the whole input;
// rows 7..47 of the table are untouched.
TEST_F(CudaModelTwinTest, EmbeddingMatchesCpuBitwise) {
  const int64_t vocab = 50, hidden = 2100, rows = 1000;
  const std::vector<float> table = Uniform(vocab * hidden, 41, 1.0f);
  const std::vector<float> dout = Uniform(rows * hidden, 42, 1.0f);
  std::vector<int32_t> tokens(rows);
  std::mt19937 rng(43);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % 7);  // many repeats
  tokens[700] = tokens[800] = 48;
  tokens[3] = tokens[400] = tokens[999] = 49;
  std::vector<std::vector<float>> out, dtable;
  for (Side* side : {&cpu_, &cuda_}) {
    const float* tb = side->Up(table);
    const int32_t* tk = side->Up(tokens);
    float* o = side->Up(std::vector<float>(rows * hidden, 7.0f));
    const float* d = side->Up(dout);
    float* dt = side->Up(table);  // accumulates onto existing values
    EXPECT_TRUE(side->k->Embedding(*side->stream, tb, vocab, tk, rows, hidden, o).ok());
    EXPECT_TRUE(side->k->EmbeddingBackward(*side->stream, d, tk, rows, hidden, dt).ok());
    out.push_back(side->Down(o, rows * hidden));
    dtable.push_back(side->Down(dt, vocab * hidden));
    side->buffers.clear();
  }
  EXPECT_TRUE(SameBits(out[1], out[0], "embedding"));
  EXPECT_TRUE(SameBits(dtable[1], dtable[0], "embedding_backward"));
  // Not vacuous: every token's row changed, the untouched rows did not.
  for (int64_t v = 0; v < vocab; ++v) {
    const bool touched = std::find(tokens.begin(), tokens.end(), v) != tokens.end();
    int64_t changed = 0;
    for (int64_t c = 0; c < hidden; ++c) changed += dtable[0][v * hidden + c] != table[v * hidden + c];
    if (touched) {
      EXPECT_GT(changed, hidden / 2) << "table row " << v;
    } else {
      EXPECT_EQ(changed, 0) << "table row " << v;
    }
  }
}

TEST_F(CudaModelTwinTest, RowMovementMatchesCpu) {
  const int64_t src_rows = 37, width = 300, tokens = 29, k = 3;
  const std::vector<float> src = Uniform(src_rows * width, 51, 2.0f);
  const std::vector<float> a = Uniform(tokens * width, 52, 2.0f);
  const std::vector<float> scales = Uniform(tokens * k, 53, 1.0f);
  const std::vector<float> base = Uniform(tokens * width, 54, 1.0f);
  std::vector<int32_t> pos(tokens * k);
  std::mt19937 rng(55);
  for (auto& p : pos) p = static_cast<int32_t>(rng() % src_rows);
  // A permutation of src's rows for the scatter (distinct destinations).
  std::vector<int32_t> perm(src_rows);
  for (int64_t i = 0; i < src_rows; ++i) perm[i] = static_cast<int32_t>(i);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::vector<float>> gathered, scaled, combined, unweighted, dots, scattered;
  for (Side* side : {&cpu_, &cuda_}) {
    const float* s = side->Up(src);
    const float* av = side->Up(a);
    const int32_t* p = side->Up(pos);
    const float* sc = side->Up(scales);
    float* g1 = side->Up(std::vector<float>(tokens * k * width));
    float* g2 = side->Up(std::vector<float>(tokens * k * width));
    float* c1 = side->Up(base);
    float* c2 = side->Up(base);
    float* d = side->Up(std::vector<float>(tokens * k));
    const int32_t* pm = side->Up(perm);
    float* sc_out = side->Up(std::vector<float>(src_rows * width, -1.0f));
    Stream& st = *side->stream;
    EXPECT_TRUE(side->k->ScatterRows(st, s, src_rows - 3, pm, width, sc_out, src_rows).ok());
    EXPECT_TRUE(side->k->GatherRows(st, s, src_rows, p, nullptr, tokens * k, width, g1).ok());
    EXPECT_TRUE(side->k->GatherRows(st, s, src_rows, p, sc, tokens * k, width, g2).ok());
    EXPECT_TRUE(side->k->CombineRows(st, s, p, sc, tokens, k, width, c1).ok());
    EXPECT_TRUE(side->k->CombineRows(st, s, p, nullptr, tokens, k, width, c2).ok());
    EXPECT_TRUE(side->k->RowDots(st, av, s, p, tokens, k, width, d).ok());
    gathered.push_back(side->Down(g1, tokens * k * width));
    scaled.push_back(side->Down(g2, tokens * k * width));
    combined.push_back(side->Down(c1, tokens * width));
    unweighted.push_back(side->Down(c2, tokens * width));
    dots.push_back(side->Down(d, tokens * k));
    scattered.push_back(side->Down(sc_out, src_rows * width));
    side->buffers.clear();
  }
  EXPECT_TRUE(SameBits(gathered[1], gathered[0], "gather_rows"));
  EXPECT_TRUE(SameBits(scaled[1], scaled[0], "gather_rows with scales"));
  EXPECT_TRUE(SameBits(combined[1], combined[0], "combine_rows"));
  EXPECT_TRUE(SameBits(unweighted[1], unweighted[0], "combine_rows without weights"));
  EXPECT_TRUE(SameBits(scattered[1], scattered[0], "scatter_rows"));
  std::vector<double> mag(tokens * k, 0.0);
  for (int64_t i = 0; i < tokens * k; ++i) {
    for (int64_t c = 0; c < width; ++c) {
      mag[i] += std::abs(double{a[(i / k) * width + c]} * src[pos[i] * width + c]);
    }
  }
  EXPECT_TRUE(Near(dots[1], dots[0], [&](size_t i) { return 2 * kU * mag[i]; }, "row_dots"));
}

// Rotary embedding, forward and inverse, at positions near 0 and near 4000.
// Both sides form the same fp32 angles (the frequencies come from the host);
// sinf/cosf are within 2 ulp on the GPU, 1 on the host, and each side rounds
// two products and a sum: |d| <= 12u (|x1| + |x2|) of the pair.
TEST_F(CudaModelTwinTest, RopeMatchesCpu) {
  const int64_t batch = 2, len = 37, heads = 3, head_dim = 64, half = head_dim / 2;
  const std::vector<float> x = Uniform(batch * len * heads * head_dim, 71, 3.0f);
  std::vector<float> pair_mag(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t row = i / head_dim, j = i % head_dim % half;
    pair_mag[i] = std::abs(x[row * head_dim + j]) + std::abs(x[row * head_dim + j + half]);
  }
  for (int64_t pos0 : {int64_t{0}, int64_t{4000}}) {
    for (bool inverse : {false, true}) {
      std::vector<std::vector<float>> out;
      for (Side* side : {&cpu_, &cuda_, &cuda_}) {
        float* d = side->Up(x);
        absl::Status st =
            side->k->Rope(*side->stream, d, batch, len, heads, head_dim, pos0, 10000.0f, inverse);
        EXPECT_TRUE(st.ok()) << st;
        out.push_back(side->Down(d, static_cast<int64_t>(x.size())));
        side->buffers.clear();
      }
      const std::string what = absl::StrCat("rope pos0 ", pos0, inverse ? " inverse" : "");
      EXPECT_TRUE(Near(out[1], out[0], [&](size_t i) { return 12 * kU * pair_mag[i]; }, what));
      EXPECT_TRUE(SameBits(out[2], out[1], what + ", run 2"));
    }
  }
}

// The router: the same fp32 operations in the same order on both sides, only
// expf differs (6u between the sides), so probs within 16u p, gates within
// 32u, the same experts chosen (random logits: no near-ties), and the
// backward, from the CPU's forward outputs on both sides, the same bits up to
// 2u of the terms it sums.
TEST_F(CudaModelTwinTest, RouterMatchesCpu) {
  for (auto [rows, experts, top_k] : {std::tuple<int64_t, int64_t, int64_t>{300, 64, 4},
                                      {1000, 8, 2}, {5, 3, 3}}) {
    const std::vector<float> logits = Uniform(rows * experts, 81, 3.0f);
    const std::vector<float> dgates = Uniform(rows * top_k, 82, 1.0f);
    std::vector<std::vector<float>> probs, gates, dlogits;
    std::vector<std::vector<int32_t>> chosen;
    for (Side* side : {&cpu_, &cuda_, &cuda_}) {
      const float* lg = side->Up(logits);
      float* p = side->Up(std::vector<float>(rows * experts));
      int32_t* ch = side->Up(std::vector<int32_t>(rows * top_k));
      float* g = side->Up(std::vector<float>(rows * top_k));
      absl::Status st = side->k->Router(*side->stream, lg, rows, experts, top_k, p, ch, g);
      EXPECT_TRUE(st.ok()) << st;
      probs.push_back(side->Down(p, rows * experts));
      chosen.push_back(side->Down(ch, rows * top_k));
      gates.push_back(side->Down(g, rows * top_k));
      // Backward from the CPU's forward outputs.
      const float* p0 = side->Up(probs[0]);
      const int32_t* ch0 = side->Up(chosen[0]);
      const float* g0 = side->Up(gates[0]);
      const float* dg = side->Up(dgates);
      float* dl = side->Up(std::vector<float>(rows * experts, 7.0f));
      st = side->k->RouterBackward(*side->stream, p0, ch0, g0, dg, rows, experts, top_k, dl);
      EXPECT_TRUE(st.ok()) << st;
      dlogits.push_back(side->Down(dl, rows * experts));
      side->buffers.clear();
    }
    const std::string what = absl::StrCat("router ", rows, "x", experts, " top ", top_k);
    EXPECT_TRUE(Near(probs[1], probs[0], [&](size_t i) { return 16 * kU * probs[0][i]; },
                     what + " probs"));
    EXPECT_EQ(chosen[1], chosen[0]) << what;
    EXPECT_TRUE(Near(gates[1], gates[0], [&](size_t i) { return 32 * kU * gates[0][i]; },
                     what + " gates"));
    std::vector<double> mag(rows * experts);
    for (int64_t r = 0; r < rows; ++r) {
      double pdot = 0;
      for (int64_t e = 0; e < experts; ++e) {
        pdot += std::abs(double{dlogits[0][r * experts + e]});
      }
      for (int64_t e = 0; e < experts; ++e) {
        mag[r * experts + e] = std::abs(dlogits[0][r * experts + e]) + pdot + 1.0;
      }
    }
    EXPECT_TRUE(Near(dlogits[1], dlogits[0], [&](size_t i) { return 2 * kU * mag[i]; },
                     what + " dlogits"));
    EXPECT_TRUE(SameBits(probs[2], probs[1], what + " probs run 2"));
    EXPECT_TRUE(SameBits(dlogits[2], dlogits[1], what + " dlogits run 2"));
  }
}

// ---------------------------------------------------------------------------
// Attention: each of the five ops against its CPU twin, on identical inputs
// (the CPU's own intermediate results are uploaded to both sides), in the
// block-pair flow ring attention uses: the queries of one block fold the K/V
// blocks of several positions in arrival order (own block, earlier blocks,
// a block that lies wholly after the queries), then finalize, delta, and the
// backward of every block pair with dq, dk, dv accumulating (+=) on top of
// nonzero starting values.
//
// Tolerances (fp32 both sides; the CUDA kernels round every product and sum
// separately, as the CPU does): the elementwise ops use the same operations
// in the same order, so Init, Finalize's o and Delta are compared bit for
// bit, and lse within a few ulps (logf against glibc's log). The block ops
// sum their dot products in another order than the CPU's GEMM tiles (and
// use CUDA's expf, within 2 ulps): a dot of d terms differs by at most about
// d * u * sum |terms| between two orders, then exp turns a score's absolute
// error into a relative error of the probabilities. With |q|, |k|, |v| <= 1
// and d <= 128 that is ~1e-5 relative at worst, so m, l and acc must agree
// to 3e-5 of the tensor's largest magnitude; the backward's gradients,
// sums of many such products, to 2e-4 of their largest magnitude (the
// gradient tolerance the step's own tests use against a double reference,
// doubled). A fixed-order kernel also gives the same bits run to run, which
// the test checks on the CUDA side.

struct AttnCase {
  std::string name;
  int64_t batch, q_len, kv_len, heads, kv_heads, head_dim, q_pos0;
  std::vector<int64_t> kv_pos0s;  // the K/V blocks, in the order they fold
};

// Equal values (infinities included) pass; otherwise |got - want| <= tol.
::testing::AssertionResult AttnNear(const std::vector<float>& got,
                                    const std::vector<float>& want, double tol,
                                    const std::string& what) {
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
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << want.size() << " disagree; first [" << first
         << "]: cuda " << got[first] << ", cpu " << want[first] << ", tol " << tol;
}

double MaxAbsFinite(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) {
    if (std::isfinite(x)) m = std::max(m, double{std::abs(x)});
  }
  return m;
}

class CudaAttentionTest : public CudaModelTwinTest,
                          public ::testing::WithParamInterface<AttnCase> {
 protected:
  AttentionShape Shape(int64_t kv_pos0) const {
    const AttnCase& c = GetParam();
    AttentionShape s;
    s.batch = c.batch;
    s.q_len = c.q_len;
    s.kv_len = c.kv_len;
    s.heads = c.heads;
    s.kv_heads = c.kv_heads;
    s.head_dim = c.head_dim;
    s.q_pos0 = c.q_pos0;
    s.kv_pos0 = kv_pos0;
    s.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    return s;
  }
};

struct AttnState {
  std::vector<float> m, l, acc;
};

// Init, then ForwardBlock over every K/V block in order, on one side.
AttnState AttnForward(Side& side, const std::vector<AttentionShape>& shapes,
                      const std::vector<float>& q, const std::vector<std::vector<float>>& k,
                      const std::vector<std::vector<float>>& v) {
  const AttentionShape& s0 = shapes[0];
  const int64_t rows = s0.batch * s0.q_len * s0.heads;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float* m = side.Up(std::vector<float>(rows, nan));
  float* l = side.Up(std::vector<float>(rows, nan));
  float* acc = side.Up(std::vector<float>(rows * s0.head_dim, nan));
  const float* qd = side.Up(q);
  absl::Status st = side.k->AttentionInit(*side.stream, s0, m, l, acc);
  EXPECT_TRUE(st.ok()) << st;
  for (size_t j = 0; j < shapes.size(); ++j) {
    float* work = side.Up(std::vector<float>(
        std::max<int64_t>(AttentionWorkspaceFloats(shapes[j]), 1), nan));
    st = side.k->AttentionForwardBlock(*side.stream, shapes[j], qd, side.Up(k[j]),
                                       side.Up(v[j]), m, l, acc, work);
    EXPECT_TRUE(st.ok()) << st;
  }
  return {side.Down(m, rows), side.Down(l, rows), side.Down(acc, rows * s0.head_dim)};
}

struct AttnGrads {
  std::vector<float> dq;
  std::vector<std::vector<float>> dk, dv;
};

AttnGrads AttnBackward(Side& side, const std::vector<AttentionShape>& shapes,
                       const std::vector<float>& q, const std::vector<std::vector<float>>& k,
                       const std::vector<std::vector<float>>& v, const std::vector<float>& dout,
                       const std::vector<float>& lse, const std::vector<float>& delta,
                       const AttnGrads& start) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float* qd = side.Up(q);
  const float* ddout = side.Up(dout);
  const float* dlse = side.Up(lse);
  const float* ddelta = side.Up(delta);
  float* dq = side.Up(start.dq);
  AttnGrads out;
  std::vector<float*> dks, dvs;
  for (size_t j = 0; j < shapes.size(); ++j) {
    float* work = side.Up(std::vector<float>(
        std::max<int64_t>(AttentionWorkspaceFloats(shapes[j]), 1), nan));
    dks.push_back(side.Up(start.dk[j]));
    dvs.push_back(side.Up(start.dv[j]));
    absl::Status st = side.k->AttentionBackwardBlock(*side.stream, shapes[j], qd,
                                                     side.Up(k[j]), side.Up(v[j]), ddout, dlse,
                                                     ddelta, dq, dks[j], dvs[j], work);
    EXPECT_TRUE(st.ok()) << st;
  }
  out.dq = side.Down(dq, static_cast<int64_t>(q.size()));
  for (size_t j = 0; j < shapes.size(); ++j) {
    out.dk.push_back(side.Down(dks[j], static_cast<int64_t>(k[j].size())));
    out.dv.push_back(side.Down(dvs[j], static_cast<int64_t>(v[j].size())));
  }
  return out;
}

TEST_P(CudaAttentionTest, EveryOpMatchesCpu) {
  const AttnCase& c = GetParam();
  std::vector<AttentionShape> shapes;
  for (int64_t p : c.kv_pos0s) shapes.push_back(Shape(p));
  const AttentionShape& s0 = shapes[0];
  const int64_t rows = c.batch * c.q_len * c.heads, d = c.head_dim;
  const int64_t q_size = rows * d, kv_size = c.batch * c.kv_len * c.kv_heads * d;
  uint32_t seed = 900;
  const std::vector<float> q = Uniform(q_size, seed++, 1.0f);
  const std::vector<float> dout = Uniform(q_size, seed++, 1.0f);
  std::vector<std::vector<float>> k, v;
  for (size_t j = 0; j < shapes.size(); ++j) {
    k.push_back(Uniform(kv_size, seed++, 1.0f));
    v.push_back(Uniform(kv_size, seed++, 1.0f));
  }

  // Init alone: exact.
  {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<std::vector<float>> got[2];
    Side* sides[2] = {&cuda_, &cpu_};
    for (int i = 0; i < 2; ++i) {
      Side& side = *sides[i];
      float* m = side.Up(std::vector<float>(rows, nan));
      float* l = side.Up(std::vector<float>(rows, nan));
      float* acc = side.Up(std::vector<float>(q_size, nan));
      ASSERT_TRUE(side.k->AttentionInit(*side.stream, s0, m, l, acc).ok());
      got[i] = {side.Down(m, rows), side.Down(l, rows), side.Down(acc, q_size)};
    }
    EXPECT_TRUE(SameBits(got[0][0], got[1][0], "init m"));
    EXPECT_TRUE(SameBits(got[0][1], got[1][1], "init l"));
    EXPECT_TRUE(SameBits(got[0][2], got[1][2], "init acc"));
  }

  // Init + ForwardBlock over the blocks: the running state.
  const AttnState want = AttnForward(cpu_, shapes, q, k, v);
  const AttnState got = AttnForward(cuda_, shapes, q, k, v);
  EXPECT_TRUE(AttnNear(got.m, want.m, 3e-5 * MaxAbsFinite(want.m) + 1e-6, "m"));
  EXPECT_TRUE(AttnNear(got.l, want.l, 3e-5 * MaxAbsFinite(want.l), "l"));
  EXPECT_TRUE(AttnNear(got.acc, want.acc, 3e-5 * MaxAbsFinite(want.acc) + 1e-7, "acc"));
  const AttnState again = AttnForward(cuda_, shapes, q, k, v);
  EXPECT_TRUE(SameBits(again.m, got.m, "m run 2"));
  EXPECT_TRUE(SameBits(again.l, got.l, "l run 2"));
  EXPECT_TRUE(SameBits(again.acc, got.acc, "acc run 2"));

  // Finalize on the CPU's state: o bitwise, lse within logf's ulps.
  std::vector<float> o[2], lse[2];
  {
    Side* sides[2] = {&cuda_, &cpu_};
    for (int i = 0; i < 2; ++i) {
      Side& side = *sides[i];
      const float* m = side.Up(want.m);
      const float* l = side.Up(want.l);
      float* acc = side.Up(want.acc);
      float* dlse = side.Up(std::vector<float>(rows, std::numeric_limits<float>::quiet_NaN()));
      ASSERT_TRUE(side.k->AttentionFinalize(*side.stream, s0, m, l, acc, dlse).ok());
      o[i] = side.Down(acc, q_size);
      lse[i] = side.Down(dlse, rows);
    }
  }
  EXPECT_TRUE(SameBits(o[0], o[1], "o"));
  EXPECT_TRUE(AttnNear(lse[0], lse[1], 8 * kU * (MaxAbsFinite(lse[1]) + 1.0), "lse"));

  // Delta on the CPU's o: the same loop, bitwise.
  std::vector<float> delta[2];
  {
    Side* sides[2] = {&cuda_, &cpu_};
    for (int i = 0; i < 2; ++i) {
      Side& side = *sides[i];
      float* dd = side.Up(std::vector<float>(rows, std::numeric_limits<float>::quiet_NaN()));
      ASSERT_TRUE(side.k->AttentionDelta(*side.stream, s0, side.Up(o[1]), side.Up(dout), dd).ok());
      delta[i] = side.Down(dd, rows);
    }
  }
  EXPECT_TRUE(SameBits(delta[0], delta[1], "delta"));

  // Backward over every block pair on the CPU's lse and delta, dq/dk/dv
  // accumulating on nonzero starting values.
  AttnGrads start;
  start.dq = Uniform(q_size, seed++, 0.5f);
  for (size_t j = 0; j < shapes.size(); ++j) {
    start.dk.push_back(Uniform(kv_size, seed++, 0.5f));
    start.dv.push_back(Uniform(kv_size, seed++, 0.5f));
  }
  const AttnGrads gw = AttnBackward(cpu_, shapes, q, k, v, dout, lse[1], delta[1], start);
  const AttnGrads gg = AttnBackward(cuda_, shapes, q, k, v, dout, lse[1], delta[1], start);
  EXPECT_TRUE(AttnNear(gg.dq, gw.dq, 2e-4 * MaxAbsFinite(gw.dq), "dq"));
  for (size_t j = 0; j < shapes.size(); ++j) {
    const std::string b = absl::StrCat(" of block at ", c.kv_pos0s[j]);
    EXPECT_TRUE(AttnNear(gg.dk[j], gw.dk[j], 2e-4 * MaxAbsFinite(gw.dk[j]), "dk" + b));
    EXPECT_TRUE(AttnNear(gg.dv[j], gw.dv[j], 2e-4 * MaxAbsFinite(gw.dv[j]), "dv" + b));
  }
  const AttnGrads g2 = AttnBackward(cuda_, shapes, q, k, v, dout, lse[1], delta[1], start);
  EXPECT_TRUE(SameBits(g2.dq, gg.dq, "dq run 2"));
  for (size_t j = 0; j < shapes.size(); ++j) {
    EXPECT_TRUE(SameBits(g2.dk[j], gg.dk[j], "dk run 2"));
    EXPECT_TRUE(SameBits(g2.dv[j], gg.dv[j], "dv run 2"));
  }
}

// Tiles: 32 rows for head_dim <= 64, 16 for 128 (cuda_model_ops.h); every
// length below is a multiple of neither.
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaAttentionTest,
    ::testing::Values(
        // GQA 1: the own (diagonal) block, then the earlier one.
        AttnCase{"gqa1_ring", 2, 37, 37, 4, 4, 16, 37, {37, 0}},
        // GQA 3, key blocks shorter than the query block, the last one
        // overlapping the queries partly (keys 90..134, queries 90..159).
        AttnCase{"gqa3_offsets", 1, 70, 45, 6, 2, 32, 90, {90, 45, 0}},
        // GQA 2: an unaligned partly visible block and one wholly after
        // the queries (nothing to fold, nothing to add).
        AttnCase{"gqa2_after", 2, 50, 50, 4, 2, 64, 100, {100, 60, 150}},
        // GQA 8, head_dim 128, more keys than queries from position 0.
        AttnCase{"gqa8_d128", 1, 33, 40, 8, 1, 128, 0, {0}},
        // Queries that see no key at all: o = 0, lse = -inf, no gradient.
        AttnCase{"none_visible", 1, 20, 20, 2, 1, 8, 0, {40}}),
    [](const auto& info) { return info.param.name; });

// ---------------------------------------------------------------------------
// Ops without CUDA kernels say so, naming the op, and enqueue nothing.

TEST_F(CudaModelTwinTest, UnimplementedOpsSaySo) {
  float* f = cuda_.Up(std::vector<float>(4096, 0.0f));
  Stream& s = *cuda_.stream;
  ModelKernels& k = *cuda_.k;
  auto expect_unimplemented = [](const absl::Status& st, absl::string_view op) {
    EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented) << op << ": " << st;
    EXPECT_THAT(std::string(st.message()),
                HasSubstr(absl::StrCat(op, " is not implemented on the cuda backend")));
  };
  // Rope has a kernel up to head_dim 1024 only.
  expect_unimplemented(k.Rope(s, f, 1, 1, 1, 1026, 0, 10000.0f, false), "rope");
  // Attention's tiles of one row must fit shared memory (head_dim ~3000).
  AttentionShape shape;
  shape.head_dim = 4096;
  shape.q_len = shape.kv_len = 1;
  expect_unimplemented(k.AttentionForwardBlock(s, shape, f, f, f, f, f, f, f),
                       "attention_forward_block");
  expect_unimplemented(k.AttentionBackwardBlock(s, shape, f, f, f, f, f, f, f, f, f, f),
                       "attention_backward_block");
  // The bf16 block pairs use the same tiles: the same limit, their own names.
  Bf16* b = reinterpret_cast<Bf16*>(f);
  expect_unimplemented(k.AttentionForwardBlockBf16(s, shape, b, b, b, f, f, f, f),
                       "attention_forward_block_bf16");
  expect_unimplemented(k.AttentionBackwardBlockBf16(s, shape, b, b, b, b, f, f, f, f, f, f),
                       "attention_backward_block_bf16");
  expect_unimplemented(k.RopeBf16(s, b, 1, 1, 1, 1026, 0, 10000.0f, false), "rope_bf16");
  // Validation still comes first.
  EXPECT_EQ(k.Rope(s, f, 1, 1, 1, 3, 0, 10000.0f, false).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(s.Synchronize().ok());
}

// ---------------------------------------------------------------------------
// Ring-DTP at P = 1 on CUDA (NCCL, one rank): loss, dx, dw against the CPU
// backend's Ring-DTP (Gloo, one rank) on the same inputs. Tolerances: those
// ring_dtp_test.cc holds each side to against a double reference (1e-5
// relative loss, 1e-4 of the largest |dx| / |dw|), doubled.

struct RingOut {
  double loss = 0;
  std::vector<float> dx, dw;
};

absl::Status RunRingOn(BackendKind kind, RingDtpMode mode, int64_t N, int64_t H, int64_t V,
                       const std::vector<float>& x, const std::vector<float>& w,
                       const std::vector<int32_t>& y, RingOut* out) {
  Side side;
  if (absl::Status st = MakeSide(kind, side); !st.ok()) return st;
  auto comm_stream = side.backend->CreateStream("comm");
  if (!comm_stream.ok()) return comm_stream.status();
  auto store = FileStore::Create(FreshStoreDir(absl::StrCat("cuda_model_twin_", static_cast<int>(kind))));
  if (!store.ok()) return store.status();
  CommunicatorOptions co;
  co.backend = kind;
  co.rank = 0;
  co.size = 1;
  co.store = std::move(*store);
  co.prefix = "ring";
  auto world = CreateCommunicator(co);
  if (!world.ok()) return world.status();
  RingDtpConfig c{N, H, V, /*strip=*/8, mode, /*row_tile=*/10, /*chunk_rows=*/0};
  auto ring = RingDtp::Create(c, *side.backend, *side.k, **world, *side.stream, **comm_stream);
  if (!ring.ok()) return ring.status();
  const float* dx_in = side.Up(x);
  const float* dw_in = side.Up(w);
  const int32_t* dy = side.Up(y);
  float* ddx = side.Up(std::vector<float>(N * H, 7.0f));
  float* ddw = side.Up(std::vector<float>(V * H, 0.0f));
  double* stats = side.Up(std::vector<double>{0.0, 0.0});
  if (absl::Status st = (*ring)->Forward(dx_in, dw_in, dy, stats); !st.ok()) return st;
  const std::vector<double> s = side.Down(stats, 2);
  const float scale = static_cast<float>(1.0 / s[1]);
  if (absl::Status st = (*ring)->Backward(dx_in, dw_in, dy, scale, ddx, ddw); !st.ok()) return st;
  if (absl::Status st = (*comm_stream)->Synchronize(); !st.ok()) return st;
  out->loss = s[0] / s[1];
  out->dx = side.Down(ddx, N * H);
  out->dw = side.Down(ddw, V * H);
  ring->reset();
  world->reset();
  side.buffers.clear();
  return absl::OkStatus();
}

class CudaRingDtpTest : public ::testing::TestWithParam<RingDtpMode> {};

TEST_P(CudaRingDtpTest, MatchesCpuBackendAtOneRank) {
  const int64_t N = 24, H = 16, V = 53;
  const std::vector<float> x = Uniform(N * H, 61, 1.0f);
  const std::vector<float> w = Uniform(V * H, 62, 0.5f);
  const std::vector<int32_t> y = Targets(N, V, 63);
  RingOut gpu;
  absl::Status st = RunRingOn(BackendKind::kCuda, GetParam(), N, H, V, x, w, y, &gpu);
  // A kernel not written for CUDA yet is not a setup failure: it skips
  // (device-check counts every skip as a failure where a GPU is present).
  if (!st.ok() &&
      (NoCudaHere(st) || st.code() == absl::StatusCode::kUnimplemented)) {
    GTEST_SKIP() << "no CUDA Ring-DTP here: " << st;
  }
  ASSERT_TRUE(st.ok()) << st;
  RingOut cpu;
  st = RunRingOn(BackendKind::kCpu, GetParam(), N, H, V, x, w, y, &cpu);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_NEAR(gpu.loss, cpu.loss, 2e-5 * std::abs(cpu.loss));
  auto max_abs = [](const std::vector<float>& v) {
    double m = 0;
    for (float e : v) m = std::max(m, double{std::abs(e)});
    return m;
  };
  const double tx = 2e-4 * max_abs(cpu.dx) + 1e-9, tw = 2e-4 * max_abs(cpu.dw) + 1e-9;
  EXPECT_TRUE(Near(gpu.dx, cpu.dx, [&](size_t) { return tx; }, "dx"));
  EXPECT_TRUE(Near(gpu.dw, cpu.dw, [&](size_t) { return tw; }, "dw"));
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaRingDtpTest,
                         ::testing::Values(RingDtpMode::kActivations, RingDtpMode::kWeights),
                         [](const auto& info) {
                           return std::string(RingDtpModeName(info.param));
                         });

}  // namespace
}  // namespace plateau
