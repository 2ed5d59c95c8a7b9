// The CPU twins of the backend's primitives: plain synchronous loops, run by
// the CPU backend on a stream's thread and used as the reference that every
// CUDA kernel is compared against. Semantics are those documented in
// kernels/backend.h; arguments are assumed validated.
//
// Reductions accumulate in double in a fixed order, so they are deterministic
// and accurate enough to serve as references.
#ifndef PLATEAU_KERNELS_CPU_OPS_H_
#define PLATEAU_KERNELS_CPU_OPS_H_

#include <cstdint>

#include "kernels/backend.h"

namespace plateau::cpu {

void Gemm(const GemmArgs& g);  // OpenBLAS cblas_sgemm, row-major

void Fill(float* x, int64_t n, float value);
void Scale(float* x, int64_t n, float alpha);
void Axpy(float* y, const float* x, int64_t n, float alpha);
void Add(float* out, const float* a, const float* b, int64_t n);
void Mul(float* out, const float* a, const float* b, int64_t n);
void SwiGluForward(float* out, const float* gate, const float* up, int64_t n);
void SwiGluBackward(float* dgate, float* dup, const float* dout,
                    const float* gate, const float* up, int64_t n);
void RmsNormForward(float* out, float* rstd, const float* x,
                    const float* weight, int64_t rows, int64_t cols,
                    float eps);
void RmsNormBackward(float* dx, float* dweight, const float* dout,
                     const float* x, const float* weight, const float* rstd,
                     int64_t rows, int64_t cols);
void SoftmaxRows(float* y, const float* x, int64_t rows, int64_t cols);
void LogSumExpRows(float* out, const float* x, int64_t rows, int64_t cols);
void Sum(float* out, const float* x, int64_t n);
void SumSquares(float* out, const float* x, int64_t n);
void AdamW(float* param, const float* grad, float* m, float* v, int64_t n,
           const AdamWArgs& args);

// The per-step scalars of AdamW, computed once per call with the bias
// corrections in double as torch computes them (Python floats). The CUDA
// backend hands the same values to its kernel, so both apply one formula.
struct AdamWStepScalars {
  float step_size;  // lr / (1 - beta1^step)
  float bc2_sqrt;   // sqrt(1 - beta2^step)
  float decay;      // 1 - lr * weight_decay
};
AdamWStepScalars ComputeAdamWStepScalars(const AdamWArgs& args);

}  // namespace plateau::cpu

#endif  // PLATEAU_KERNELS_CPU_OPS_H_
