#include "kernels/cpu_bf16_ops.h"

#include <algorithm>
#include <cstddef>
#include <vector>

#include "kernels/cpu_ops.h"

namespace plateau::cpu {
namespace {

// Elements per task of the conversions (as cpu_ops.cc's elementwise ops):
// the split depends on n only, so the bits do not depend on the pool.
constexpr int64_t kElemsPerTask = 1 << 16;

float* Slot(int i, int64_t n) { return Bf16Scratch(i, n); }

// Loads rows x cols of a matrix at row stride ld into a packed fp32 copy.
const float* LoadMatrix(int slot, const Bf16* src, int64_t rows, int64_t cols, int64_t ld) {
  float* dst = Slot(slot, rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    const Bf16* s = src + r * ld;
    float* d = dst + r * cols;
    for (int64_t c = 0; c < cols; ++c) d[c] = Bf16ToFloat(s[c]);
  }
  return dst;
}

const float* Load(int slot, const Bf16* src, int64_t n, CpuPool* pool) {
  return LoadToScratch(slot, src, n, pool);
}

}  // namespace

float* Bf16Scratch(int slot, int64_t n) {
  // A call uses its slots one after another and never two calls at once on
  // one thread (a stream runs its tasks one at a time).
  thread_local std::vector<float> slots[kBf16ScratchSlots];
  std::vector<float>& v = slots[slot];
  if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
  return v.data();
}

const float* LoadToScratch(int slot, const Bf16* src, int64_t n, CpuPool* pool) {
  float* dst = Bf16Scratch(slot, n);
  ConvertToFloat(dst, src, n, pool);
  return dst;
}

void ConvertToBf16(Bf16* out, const float* x, int64_t n, CpuPool* pool) {
  ParallelBlocks(pool, n, kElemsPerTask, [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[i] = FloatToBf16(x[i]);
  });
}

void ConvertToFloat(float* out, const Bf16* x, int64_t n, CpuPool* pool) {
  ParallelBlocks(pool, n, kElemsPerTask, [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[i] = Bf16ToFloat(x[i]);
  });
}

void FillBf16(Bf16* x, int64_t n, float value, CpuPool* pool) {
  const Bf16 v = FloatToBf16(value);
  ParallelBlocks(pool, n, kElemsPerTask, [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) x[i] = v;
  });
}

void AddBf16(Bf16* out, const Bf16* a, const Bf16* b, int64_t n, CpuPool* pool) {
  const float* x = Load(0, a, n, pool);
  const float* y = Load(1, b, n, pool);
  float* o = Slot(2, n);
  Add(o, x, y, n, pool);
  ConvertToBf16(out, o, n, pool);
}

void SumSquaresBf16(float* out, const Bf16* x, int64_t n, CpuPool* pool) {
  SumSquares(out, Load(0, x, n, pool), n, pool);
}

void SumRowsBf16(Bf16* out, const Bf16* x, int64_t rows, int64_t n, int64_t ld, CpuPool* pool) {
  ParallelBlocks(pool, n, kElemsPerTask, [=](int64_t b, int64_t e) {
    // Row by row over a stack block of fp32 sums (the rows may be far
    // apart): each element still adds its rows in order 0, 1, ..., rows - 1.
    constexpr int64_t kBlock = 1024;
    float acc[kBlock];
    for (int64_t s = b; s < e; s += kBlock) {
      const int64_t m = std::min(kBlock, e - s);
      for (int64_t j = 0; j < m; ++j) acc[j] = Bf16ToFloat(x[s + j]);
      for (int64_t r = 1; r < rows; ++r) {
        const Bf16* row = x + r * ld + s;
        for (int64_t j = 0; j < m; ++j) acc[j] += Bf16ToFloat(row[j]);
      }
      for (int64_t j = 0; j < m; ++j) out[s + j] = FloatToBf16(acc[j]);
    }
  });
}

void AddRowsBf16(Bf16* out, const Bf16* x, const int32_t* rows, int64_t count, int64_t ld, int64_t n, CpuPool* pool) {
  ParallelBlocks(pool, n, kElemsPerTask, [=](int64_t b, int64_t e) {
    constexpr int64_t kBlock = 1024;  // as SumRowsBf16: row by row over a block of fp32 sums
    float acc[kBlock];
    for (int64_t s = b; s < e; s += kBlock) {
      const int64_t m = std::min(kBlock, e - s);
      for (int64_t j = 0; j < m; ++j) acc[j] = Bf16ToFloat(out[s + j]);
      for (int64_t r = 0; r < count; ++r) {
        const Bf16* row = x + rows[r] * ld + s;
        for (int64_t j = 0; j < m; ++j) acc[j] += Bf16ToFloat(row[j]);
      }
      for (int64_t j = 0; j < m; ++j) out[s + j] = FloatToBf16(acc[j]);
    }
  });
}

void GemmBf16(const GemmBf16Args& g) {
  if (g.m == 0 || g.n == 0) return;
  // Stored shapes, as GemmArgs: A is m x k (k x m transposed), B k x n
  // (n x k transposed). Packed copies keep the transposes (lda = columns).
  const int64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
  const int64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
  GemmArgs f;
  f.trans_a = g.trans_a;
  f.trans_b = g.trans_b;
  f.m = g.m;
  f.n = g.n;
  f.k = g.k;
  f.alpha = g.alpha;
  if (g.k > 0) {
    f.a = LoadMatrix(0, g.a, a_rows, a_cols, g.lda);
    f.lda = a_cols;
    f.b = LoadMatrix(1, g.b, b_rows, b_cols, g.ldb);
    f.ldb = b_cols;
  }
  if (g.c_fp32 != nullptr) {
    f.beta = g.beta;
    f.c = g.c_fp32;
    f.ldc = g.ldc;
    Gemm(f);
    return;
  }
  // bf16 C: the fp32 sum alpha * AB into scratch, then the epilogue in fp32
  // and one rounding per element (cuBLASLt's order: alpha * acc + beta * C).
  float* acc = Slot(2, g.m * g.n);
  f.beta = 0.0f;
  f.c = acc;
  f.ldc = g.n;
  Gemm(f);
  for (int64_t i = 0; i < g.m; ++i) {
    Bf16* row = g.c + i * g.ldc;
    const float* ar = acc + i * g.n;
    for (int64_t j = 0; j < g.n; ++j) {
      // beta == 0 ignores C (it may be uninitialised), as BLAS does.
      const float v = g.beta == 0.0f ? ar[j] : ar[j] + g.beta * Bf16ToFloat(row[j]);
      row[j] = FloatToBf16(v);
    }
  }
}

void SwiGluForwardBf16(Bf16* out, const Bf16* gate, const Bf16* up, int64_t n, CpuPool* pool) {
  const float* g = Load(0, gate, n, pool);
  const float* u = Load(1, up, n, pool);
  float* o = Slot(2, n);
  SwiGluForward(o, g, u, n, pool);
  ConvertToBf16(out, o, n, pool);
}

void SwiGluBackwardBf16(Bf16* dgate, Bf16* dup, const Bf16* dout, const Bf16* gate,
                        const Bf16* up, int64_t n, CpuPool* pool) {
  const float* d = Load(0, dout, n, pool);
  const float* g = Load(1, gate, n, pool);
  const float* u = Load(2, up, n, pool);
  float* dg = Slot(3, n);
  float* du = Slot(4, n);
  SwiGluBackward(dg, du, d, g, u, n, pool);
  ConvertToBf16(dgate, dg, n, pool);
  ConvertToBf16(dup, du, n, pool);
}

void RmsNormForwardBf16(Bf16* out, float* rstd, const Bf16* x, const Bf16* weight, int64_t rows,
                        int64_t cols, float eps, CpuPool* pool) {
  const float* xf = Load(0, x, rows * cols, pool);
  const float* w = Load(1, weight, cols, pool);
  float* o = Slot(2, rows * cols);
  RmsNormForward(o, rstd, xf, w, rows, cols, eps, pool);
  ConvertToBf16(out, o, rows * cols, pool);  // after the load: out may alias x
}

void RmsNormBackwardBf16(Bf16* dx, Bf16* dweight, const Bf16* dout, const Bf16* x,
                         const Bf16* weight, const float* rstd, int64_t rows, int64_t cols,
                         CpuPool* pool) {
  const float* d = Load(0, dout, rows * cols, pool);
  const float* xf = Load(1, x, rows * cols, pool);
  const float* w = Load(2, weight, cols, pool);
  float* dw = Slot(3, cols);
  ConvertToFloat(dw, dweight, cols, pool);
  float* dxf = Slot(4, rows * cols);
  RmsNormBackward(dxf, dw, d, xf, w, rstd, rows, cols, pool);
  ConvertToBf16(dx, dxf, rows * cols, pool);
  ConvertToBf16(dweight, dw, cols, pool);
}

void AdamWBf16(float* master, const Bf16* grad, float* m, float* v, Bf16* working, int64_t n,
               const AdamWArgs& args, CpuPool* pool) {
  const float* g = Load(0, grad, n, pool);
  AdamW(master, g, m, v, n, args, pool);
  ConvertToBf16(working, master, n, pool);
}

}  // namespace plateau::cpu
