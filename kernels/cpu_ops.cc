#include "kernels/cpu_ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu_exp.h"

namespace plateau::cpu {
namespace {

// Reductions use kLanes interleaved partial sums (lane j takes elements
// i = j mod kLanes) combined in a fixed tree at the end. The order depends
// only on n, so results are the same bits run to run; and the lanes are
// independent, so the compiler keeps them in vector registers instead of
// waiting on one chain of dependent adds (about 4.5x faster on 1M floats
// here than the plain loop).
constexpr int kLanes = 8;

double CombineLanes(const double (&acc)[kLanes]) {
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) +
         ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// sum_{i < n} term(i), accumulated in double.
template <typename Term>
double LaneSum(int64_t n, Term term) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += term(i + j);
  }
  for (int j = 0; i < n; ++i, ++j) acc[j] += term(i);
  return CombineLanes(acc);
}

// max_{i < n} x[i] (-inf when n == 0). Max is exact, so lanes change nothing
// but speed.
float LaneMax(const float* x, int64_t n) {
  float mx[kLanes];
  for (float& m : mx) m = -INFINITY;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) mx[j] = std::max(mx[j], x[i + j]);
  }
  for (int j = 0; i < n; ++i, ++j) mx[j] = std::max(mx[j], x[i]);
  float m = mx[0];
  for (int j = 1; j < kLanes; ++j) m = std::max(m, mx[j]);
  return m;
}

}  // namespace

int64_t GemmRowsPerTask(int64_t m) {
  // OpenBLAS packs all of B in every call, so a task of r rows adds about
  // 1 / (2 r) of B's packing per flop (~3% of the GEMM at r = 512 on Zen 4):
  // few, large tasks. 2 or 4 of them (never 3) keep 2 and 4 cores evenly
  // busy; below 64 rows one call.
  const int64_t tasks = m < 64 ? 1 : m < 2048 ? 2 : 4;
  const int64_t rows = (m + tasks - 1) / tasks;
  return (rows + 15) / 16 * 16;
}

void Gemm(const GemmArgs& g, CpuPool* pool) {
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) {  // C = beta * C; BLAS would do the same, but be explicit
    // beta = 1 leaves C as it is (1 * x is x, NaN and -0 included): an
    // expert without tokens accumulating its three weight gradients walked
    // all of them on one thread (3 x 235 MB at H = 4,096, F = 14,336).
    if (g.beta == 1.0f) return;
    const int64_t rows_per_task = std::max<int64_t>(1, (int64_t{1} << 16) / g.n);  // kElemsPerTask below
    ParallelBlocks(PoolFor(pool, g.m * g.n), g.m, rows_per_task, [&g](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) {
        float* row = g.c + i * g.ldc;
        for (int64_t j = 0; j < g.n; ++j) row[j] = g.beta == 0.0f ? 0.0f : g.beta * row[j];
      }
    });
    return;
  }
  // Rows of C in tasks fixed by m alone, each one sgemm call, with or
  // without a pool: the same calls whatever runs them, so the same bits.
  // Row i of op(A) starts at a + i * lda, or at a + i when A is transposed.
  // A small GEMM runs its tasks here (kPoolMinWork).
  ParallelBlocks(PoolFor(pool, GemmWork(g.m, g.n, g.k)), g.m, GemmRowsPerTask(g.m), [&g](int64_t r0, int64_t r1) {
    const float* a = g.trans_a ? g.a + r0 : g.a + r0 * g.lda;
    cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans,
                g.trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(r1 - r0),
                static_cast<int>(g.n), static_cast<int>(g.k), g.alpha, a,
                static_cast<int>(g.lda), g.b, static_cast<int>(g.ldb), g.beta,
                g.c + r0 * g.ldc, static_cast<int>(g.ldc));
  });
}

namespace {

// Elements per task of the elementwise ops (256 KiB of floats: large enough
// that waking a worker costs little against it, small enough to balance);
// the row-wise ops take whole rows of about a quarter of it (RowsPerTask).
constexpr int64_t kElemsPerTask = 1 << 16;

}  // namespace

void Fill(float* x, int64_t n, float value, CpuPool* pool) {
  ParallelBlocks(pool, n, kElemsPerTask, [=](int64_t b, int64_t e) { std::fill(x + b, x + e, value); });
}

void Scale(float* x, int64_t n, float alpha, CpuPool* pool) {
  ParallelBlocks(pool, n, kElemsPerTask, [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) x[i] *= alpha;
  });
}

void Axpy(float* y, const float* x, int64_t n, float alpha, CpuPool* pool) {
  ParallelBlocks(pool, n, kElemsPerTask, [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) y[i] += alpha * x[i];
  });
}

void Add(float* out, const float* a, const float* b, int64_t n, CpuPool* pool) {
  ParallelBlocks(pool, n, kElemsPerTask, [=](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) out[i] = a[i] + b[i];
  });
}

void Mul(float* out, const float* a, const float* b, int64_t n, CpuPool* pool) {
  ParallelBlocks(pool, n, kElemsPerTask, [=](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) out[i] = a[i] * b[i];
  });
}

namespace {
// sigmoid(x) = 1 / (1 + exp(-x)) with the vectorised exp (cpu_exp.h); the
// scalar and 8-lane forms do the same operations, so the bits do not depend
// on where a block's tail falls.
inline float Sigmoid(float x) { return 1.0f / (1.0f + Exp(-x)); }
#ifdef PLATEAU_EXP_AVX2
inline __m256 Sigmoid8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, Exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}
#endif
}  // namespace

void SwiGluForward(float* out, const float* gate, const float* up, int64_t n, CpuPool* pool) {
  ParallelBlocks(pool, n, kElemsPerTask, [=](int64_t b, int64_t e) {
    int64_t i = b;
#ifdef PLATEAU_EXP_AVX2
    for (; i + 8 <= e; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, Sigmoid8(g)), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < e; ++i) {
      const float g = gate[i];
      out[i] = g * Sigmoid(g) * up[i];
    }
  });
}

void SwiGluBackward(float* dgate, float* dup, const float* dout,
                    const float* gate, const float* up, int64_t n, CpuPool* pool) {
  // silu'(g) = s * (1 + g * (1 - s)); dgate = ((d * up) * s) * (1 + g (1 - s)).
  ParallelBlocks(pool, n, kElemsPerTask, [=](int64_t b, int64_t e) {
    int64_t i = b;
#ifdef PLATEAU_EXP_AVX2
    // The tail goes through the same lanes (padded), since the compiler may
    // fuse the scalar form's multiply-adds: one formula for every element.
    const __m256 one = _mm256_set1_ps(1.0f);
    auto body = [&](const float* gp, const float* dp, const float* upp, float* dgp, float* dupp) {
      const __m256 g = _mm256_loadu_ps(gp), d = _mm256_loadu_ps(dp);
      const __m256 s = Sigmoid8(g);
      const __m256 t = _mm256_add_ps(one, _mm256_mul_ps(g, _mm256_sub_ps(one, s)));
      _mm256_storeu_ps(dgp, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(d, _mm256_loadu_ps(upp)), s), t));
      _mm256_storeu_ps(dupp, _mm256_mul_ps(d, _mm256_mul_ps(g, s)));
    };
    for (; i + 8 <= e; i += 8) body(gate + i, dout + i, up + i, dgate + i, dup + i);
    if (i < e) {
      float g8[8] = {}, d8[8] = {}, u8[8] = {}, dg8[8], du8[8];
      std::copy(gate + i, gate + e, g8);
      std::copy(dout + i, dout + e, d8);
      std::copy(up + i, up + e, u8);
      body(g8, d8, u8, dg8, du8);
      std::copy(dg8, dg8 + (e - i), dgate + i);
      std::copy(du8, du8 + (e - i), dup + i);
      i = e;
    }
#endif
    for (; i < e; ++i) {
      const float g = gate[i], s = Sigmoid(g), d = dout[i];
      const float silu = g * s;
      dgate[i] = d * up[i] * s * (1.0f + g * (1.0f - s));
      dup[i] = d * silu;
    }
  });
}

void RmsNormForward(float* out, float* rstd, const float* x,
                    const float* weight, int64_t rows, int64_t cols,
                    float eps, CpuPool* pool) {
  ParallelBlocks(pool, rows, RowsPerTask(cols), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * cols;
      const double ss = LaneSum(cols, [xr](int64_t c) {
        return static_cast<double>(xr[c]) * xr[c];
      });
      float rs = static_cast<float>(1.0 / std::sqrt(ss / cols + eps));
      rstd[r] = rs;
      float* orow = out + r * cols;
      for (int64_t c = 0; c < cols; ++c) orow[c] = xr[c] * rs * weight[c];
    }
  });
}

void RmsNormBackward(float* dx, float* dweight, const float* dout,
                     const float* x, const float* weight, const float* rstd,
                     int64_t rows, int64_t cols, CpuPool* pool) {
  // y = x * r * w with r = (mean x^2 + eps)^-1/2:
  // dx = r * (dout*w) - x * r^3 / cols * sum_c (dout*w*x).
  ParallelBlocks(pool, rows, RowsPerTask(cols), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * cols;
      const float* dr = dout + r * cols;
      const float rs = rstd[r];
      const double dot = LaneSum(cols, [=](int64_t c) {
        return static_cast<double>(dr[c]) * weight[c] * xr[c];
      });
      const float coef = static_cast<float>(dot * rs * rs * rs / cols);
      float* dxr = dx + r * cols;
      for (int64_t c = 0; c < cols; ++c) dxr[c] = rs * dr[c] * weight[c] - xr[c] * coef;
    }
  });
  // dweight[c] += sum_r dout*x*r is a reduction over rows: split by columns
  // instead, so each column is still summed in double over rows in order and
  // added to dweight once (a float running sum would lose ~rows ulps on long
  // sequences) whatever the pool.
  constexpr int64_t kColsPerTask = 64;
  ParallelFor(pool, TaskCount(cols, kColsPerTask), [=](int64_t t, int) {
    const int64_t c0 = t * kColsPerTask, c1 = std::min(cols, c0 + kColsPerTask);
    double dw[kColsPerTask] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * cols;
      const float* dr = dout + r * cols;
      const float rs = rstd[r];
      for (int64_t c = c0; c < c1; ++c) dw[c - c0] += static_cast<double>(dr[c]) * xr[c] * rs;
    }
    for (int64_t c = c0; c < c1; ++c) dweight[c] = static_cast<float>(dweight[c] + dw[c - c0]);
  });
}

void SoftmaxRows(float* y, const float* x, int64_t rows, int64_t cols, CpuPool* pool) {
  ParallelBlocks(pool, rows, RowsPerTask(cols), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * cols;
      float* yr = y + r * cols;
      const float mx = LaneMax(xr, cols);
      // y may alias x: each element is read before it is overwritten.
      ExpShiftScale(xr, mx, 1.0f, yr, cols);
      const double sum = LaneSum(cols, [yr](int64_t c) { return double{yr[c]}; });
      const float inv = static_cast<float>(1.0 / sum);
      for (int64_t c = 0; c < cols; ++c) yr[c] *= inv;
    }
  });
}

void LogSumExpRows(float* out, const float* x, int64_t rows, int64_t cols, CpuPool* pool) {
  ParallelBlocks(pool, rows, RowsPerTask(cols), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * cols;
      // Shifting by the row maximum keeps exp in range for any finite x (the
      // difference may round to -inf, whose exp is 0).
      const float mx = LaneMax(xr, cols);
      const double sum = LaneSum(cols, [xr, mx](int64_t c) {
        return std::exp(static_cast<double>(xr[c] - mx));
      });
      out[r] = static_cast<float>(mx + std::log(sum));
    }
  });
}

namespace {

// sum_{i < n} term(i) in double: a LaneSum per block of kSumBlock elements
// on the pool, the blocks' sums added in block order (fixed by n).
constexpr int64_t kSumBlock = 1 << 18;

template <typename Term>
double BlockedSum(int64_t n, CpuPool* pool, Term term) {
  const int64_t tasks = TaskCount(n, kSumBlock);
  if (tasks == 1) return LaneSum(n, term);
  std::vector<double> part(tasks);
  ParallelFor(pool, tasks, [&](int64_t t, int) {
    const int64_t b = t * kSumBlock, e = std::min(n, b + kSumBlock);
    part[t] = LaneSum(e - b, [&](int64_t i) { return term(b + i); });
  });
  double acc = 0.0;
  for (double p : part) acc += p;
  return acc;
}

}  // namespace

void Sum(float* out, const float* x, int64_t n, CpuPool* pool) {
  out[0] = static_cast<float>(BlockedSum(n, pool, [x](int64_t i) { return double{x[i]}; }));
}

void SumSquares(float* out, const float* x, int64_t n, CpuPool* pool) {
  out[0] = static_cast<float>(BlockedSum(n, pool, [x](int64_t i) {
    return static_cast<double>(x[i]) * x[i];
  }));
}

AdamWStepScalars ComputeAdamWStepScalars(const AdamWArgs& a) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(a.beta1), a.step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(a.beta2), a.step);
  AdamWStepScalars s;
  s.step_size = static_cast<float>(a.lr / bc1);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.decay = 1.0f - a.lr * a.weight_decay;
  return s;
}

void AdamW(float* param, const float* grad, float* m, float* v, int64_t n,
           const AdamWArgs& a, CpuPool* pool) {
  const AdamWStepScalars sc = ComputeAdamWStepScalars(a);
  const float step_size = sc.step_size, bc2_sqrt = sc.bc2_sqrt,
              decay = sc.decay;
  ParallelBlocks(pool, n, kElemsPerTask, [=, &a](int64_t b, int64_t e) {
    int64_t i = b;
#ifdef PLATEAU_EXP_AVX2
    // Eight lanes, the scalar loop's operations in its order without fused
    // multiply-adds; the tail goes through the same lanes, padded, so every
    // element gets one formula whatever the split (bucketed optimizers
    // compare bitwise with the unbucketed one).
    const __m256 gs = _mm256_set1_ps(a.grad_scale), dc = _mm256_set1_ps(decay),
                 b1 = _mm256_set1_ps(a.beta1), c1 = _mm256_set1_ps(1.0f - a.beta1),
                 b2 = _mm256_set1_ps(a.beta2), c2 = _mm256_set1_ps(1.0f - a.beta2),
                 ss = _mm256_set1_ps(step_size), bc = _mm256_set1_ps(bc2_sqrt),
                 ep = _mm256_set1_ps(a.eps);
    auto body = [&](float* pp, const float* gp, float* mp, float* vp) {
      const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(gp), gs);
      const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(pp), dc);
      const __m256 mi = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_loadu_ps(mp)), _mm256_mul_ps(c1, g));
      const __m256 vi = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_loadu_ps(vp)),
                                      _mm256_mul_ps(_mm256_mul_ps(c2, g), g));
      _mm256_storeu_ps(mp, mi);
      _mm256_storeu_ps(vp, vi);
      const __m256 den = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc), ep);
      _mm256_storeu_ps(pp, _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(ss, mi), den)));
    };
    for (; i + 8 <= e; i += 8) body(param + i, grad + i, m + i, v + i);
    if (i < e) {  // the tail through the same lanes, padded (one formula everywhere)
      float p8[8] = {}, g8[8] = {}, m8[8] = {}, v8[8] = {};
      std::copy(param + i, param + e, p8);
      std::copy(grad + i, grad + e, g8);
      std::copy(m + i, m + e, m8);
      std::copy(v + i, v + e, v8);
      body(p8, g8, m8, v8);
      std::copy(p8, p8 + (e - i), param + i);
      std::copy(m8, m8 + (e - i), m + i);
      std::copy(v8, v8 + (e - i), v + i);
      i = e;
    }
#endif
    for (; i < e; ++i) {
      float g = grad[i] * a.grad_scale;
      float p = param[i] * decay;
      float mi = a.beta1 * m[i] + (1.0f - a.beta1) * g;
      float vi = a.beta2 * v[i] + (1.0f - a.beta2) * g * g;
      m[i] = mi;
      v[i] = vi;
      param[i] = p - step_size * mi / (std::sqrt(vi) / bc2_sqrt + a.eps);
    }
  });
}

}  // namespace plateau::cpu
