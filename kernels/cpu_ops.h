// The CPU twins of the backend's primitives: plain synchronous loops, run by
// the CPU backend on a stream's thread and used as the reference that every
// CUDA kernel is compared against. Semantics are those documented in
// kernels/backend.h; arguments are assumed validated.
//
// Reductions accumulate in double in a fixed order, so they are deterministic
// and accurate enough to serve as references.
//
// `pool`: the CPU backend passes its thread pool (kernels/cpu_pool.h); the
// work is split by the problem's size only (blocks of elements, of rows or of
// columns), so the result is the same bits with or without a pool and for
// any pool size (kernels/model/cpu_threads_test.cc checks 1, 2 and 3 threads). Sum and
// SumSquares add blocks of 256K elements, each in double, in block order.
//
// Gemm splits C's rows into tasks fixed by m (GemmRowsPerTask), one
// single-threaded cblas_sgemm call per task: the CPU backend sets OpenBLAS
// to one thread, so the pool's threads are the only ones and OpenBLAS's
// idle workers do not spin (sched_yield) against the other kernels.
#ifndef PLATEAU_KERNELS_CPU_OPS_H_
#define PLATEAU_KERNELS_CPU_OPS_H_

#include <cstdint>

#include "kernels/backend.h"
#include "kernels/cpu_pool.h"

namespace plateau::cpu {

// OpenBLAS cblas_sgemm, row-major, rows of C split over the pool.
void Gemm(const GemmArgs& g, CpuPool* pool = nullptr);
// Rows of C per Gemm task: depends on m alone.
int64_t GemmRowsPerTask(int64_t m);
// A GEMM's flops, for PoolFor: below kPoolMinWork its row blocks run on the
// calling thread (the same sgemm calls).
inline int64_t GemmWork(int64_t m, int64_t n, int64_t k) { return 2 * m * n * k; }

void Fill(float* x, int64_t n, float value, CpuPool* pool = nullptr);
void Scale(float* x, int64_t n, float alpha, CpuPool* pool = nullptr);
void Axpy(float* y, const float* x, int64_t n, float alpha, CpuPool* pool = nullptr);
void Add(float* out, const float* a, const float* b, int64_t n, CpuPool* pool = nullptr);
void Mul(float* out, const float* a, const float* b, int64_t n, CpuPool* pool = nullptr);
void SwiGluForward(float* out, const float* gate, const float* up, int64_t n, CpuPool* pool = nullptr);
void SwiGluBackward(float* dgate, float* dup, const float* dout,
                    const float* gate, const float* up, int64_t n, CpuPool* pool = nullptr);
void RmsNormForward(float* out, float* rstd, const float* x,
                    const float* weight, int64_t rows, int64_t cols,
                    float eps, CpuPool* pool = nullptr);
void RmsNormBackward(float* dx, float* dweight, const float* dout,
                     const float* x, const float* weight, const float* rstd,
                     int64_t rows, int64_t cols, CpuPool* pool = nullptr);
void SoftmaxRows(float* y, const float* x, int64_t rows, int64_t cols, CpuPool* pool = nullptr);
void LogSumExpRows(float* out, const float* x, int64_t rows, int64_t cols, CpuPool* pool = nullptr);
void Sum(float* out, const float* x, int64_t n, CpuPool* pool = nullptr);
void SumSquares(float* out, const float* x, int64_t n, CpuPool* pool = nullptr);
void AdamW(float* param, const float* grad, float* m, float* v, int64_t n,
           const AdamWArgs& args, CpuPool* pool = nullptr);

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
