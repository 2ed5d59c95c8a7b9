#include "kernels/cpu_ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>

namespace plateau::cpu {

void Gemm(const GemmArgs& g) {
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) {  // C = beta * C; BLAS would do the same, but be explicit
    for (int64_t i = 0; i < g.m; ++i) {
      float* row = g.c + i * g.ldc;
      for (int64_t j = 0; j < g.n; ++j) row[j] = g.beta == 0.0f ? 0.0f : g.beta * row[j];
    }
    return;
  }
  cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans,
              g.trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(g.m),
              static_cast<int>(g.n), static_cast<int>(g.k), g.alpha, g.a,
              static_cast<int>(g.lda), g.b, static_cast<int>(g.ldb), g.beta,
              g.c, static_cast<int>(g.ldc));
}

void Fill(float* x, int64_t n, float value) { std::fill(x, x + n, value); }

void Scale(float* x, int64_t n, float alpha) {
  for (int64_t i = 0; i < n; ++i) x[i] *= alpha;
}

void Axpy(float* y, const float* x, int64_t n, float alpha) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void Add(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void Mul(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] * b[i];
}

namespace {
inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
}  // namespace

void SwiGluForward(float* out, const float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float g = gate[i];
    out[i] = g * Sigmoid(g) * up[i];
  }
}

void SwiGluBackward(float* dgate, float* dup, const float* dout,
                    const float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float g = gate[i], s = Sigmoid(g), d = dout[i];
    float silu = g * s;
    // silu'(g) = s * (1 + g * (1 - s))
    dgate[i] = d * up[i] * s * (1.0f + g * (1.0f - s));
    dup[i] = d * silu;
  }
}

void RmsNormForward(float* out, float* rstd, const float* x,
                    const float* weight, int64_t rows, int64_t cols,
                    float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    double ss = 0.0;
    for (int64_t c = 0; c < cols; ++c) ss += static_cast<double>(xr[c]) * xr[c];
    float rs = static_cast<float>(1.0 / std::sqrt(ss / cols + eps));
    rstd[r] = rs;
    float* orow = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) orow[c] = xr[c] * rs * weight[c];
  }
}

void RmsNormBackward(float* dx, float* dweight, const float* dout,
                     const float* x, const float* weight, const float* rstd,
                     int64_t rows, int64_t cols) {
  // y = x * r * w with r = (mean x^2 + eps)^-1/2:
  // dx = r * (dout*w) - x * r^3 / cols * sum_c (dout*w*x).
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    const float* dr = dout + r * cols;
    float rs = rstd[r];
    double dot = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      dot += static_cast<double>(dr[c]) * weight[c] * xr[c];
    }
    float coef = static_cast<float>(dot * rs * rs * rs / cols);
    float* dxr = dx + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      dweight[c] += dr[c] * xr[c] * rs;
      dxr[c] = rs * dr[c] * weight[c] - xr[c] * coef;
    }
  }
}

void SoftmaxRows(float* y, const float* x, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    float mx = -INFINITY;
    for (int64_t c = 0; c < cols; ++c) mx = std::max(mx, xr[c]);
    double sum = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      float e = std::exp(xr[c] - mx);
      yr[c] = e;
      sum += e;
    }
    float inv = static_cast<float>(1.0 / sum);
    for (int64_t c = 0; c < cols; ++c) yr[c] *= inv;
  }
}

void LogSumExpRows(float* out, const float* x, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    float mx = -INFINITY;
    for (int64_t c = 0; c < cols; ++c) mx = std::max(mx, xr[c]);
    double sum = 0.0;
    for (int64_t c = 0; c < cols; ++c) sum += std::exp(static_cast<double>(xr[c] - mx));
    out[r] = cols == 0 ? -INFINITY : static_cast<float>(mx + std::log(sum));
  }
}

void Sum(float* out, const float* x, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += x[i];
  out[0] = static_cast<float>(s);
}

void SumSquares(float* out, const float* x, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  out[0] = static_cast<float>(s);
}

void AdamW(float* param, const float* grad, float* m, float* v, int64_t n,
           const AdamWArgs& a) {
  // Bias corrections in double, as torch computes them (Python floats).
  const double bc1 = 1.0 - std::pow(static_cast<double>(a.beta1), a.step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(a.beta2), a.step);
  const float step_size = static_cast<float>(a.lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float decay = 1.0f - a.lr * a.weight_decay;
  for (int64_t i = 0; i < n; ++i) {
    float g = grad[i] * a.grad_scale;
    float p = param[i] * decay;
    float mi = a.beta1 * m[i] + (1.0f - a.beta1) * g;
    float vi = a.beta2 * v[i] + (1.0f - a.beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    param[i] = p - step_size * mi / (std::sqrt(vi) / bc2_sqrt + a.eps);
  }
}

}  // namespace plateau::cpu
