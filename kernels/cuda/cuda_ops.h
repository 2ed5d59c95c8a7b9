// CUDA kernels for the backend's primitives, one launcher per primitive.
//
// Semantics are those of kernels/backend.h and of the CPU twins in
// kernels/cpu_ops.cc, which are the reference these are tested against
// (kernels/cuda_twin_test.cc). Arguments are assumed validated (the Backend
// base does that once for every backend). Each launcher enqueues its kernels
// on `stream` and returns cudaGetLastError(): launch errors show at once,
// faults inside a kernel at the stream's next synchronisation.
//
// Determinism: no floating-point atomics anywhere. Reductions run on a grid
// whose shape depends only on the problem size, combine per-thread partials
// with a fixed tree inside each block, and combine per-block partials in a
// second kernel in a fixed order; so the same inputs give the same bits run
// to run (on the same GPU model). Sums accumulate in double, like the CPU
// twins.
//
// This header is plain C++ (no CUDA language extensions) so that the
// backend, compiled by the host compiler, can include it; the kernels are
// compiled by nvcc into a static library (see BUILD.bazel).
#ifndef PLATEAU_KERNELS_CUDA_CUDA_OPS_H_
#define PLATEAU_KERNELS_CUDA_CUDA_OPS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace plateau::cuda_ops {

// The scratch memory a stream lends to reductions that need a second pass:
// Sum and SumSquares use at most 8 KiB of it; RmsNormBackward's per-chunk
// dweight partials use up to all of it (fewer row chunks when cols is large).
// The amount is fixed, not taken from the device, so the reduction order, and
// with it the bits, do not depend on which GPU runs it.
inline constexpr size_t kScratchBytes = size_t{4} << 20;

// Loads every kernel of this library on the current device and returns
// cudaSuccess when the device can run them (sm_80 and sm_90 machine code,
// compute_90 PTX), an error such as cudaErrorNoKernelImageForDevice
// otherwise. Called at backend creation: a kernel first loaded mid-step
// (lazy loading) can wait for the context to go idle, behind a collective.
cudaError_t CheckKernelImage();

cudaError_t Fill(cudaStream_t stream, float* x, int64_t n, float value);
cudaError_t Scale(cudaStream_t stream, float* x, int64_t n, float alpha);
cudaError_t Axpy(cudaStream_t stream, float* y, const float* x, int64_t n,
                 float alpha);
cudaError_t Add(cudaStream_t stream, float* out, const float* a,
                const float* b, int64_t n);
cudaError_t Mul(cudaStream_t stream, float* out, const float* a,
                const float* b, int64_t n);
cudaError_t SwiGluForward(cudaStream_t stream, float* out, const float* gate,
                          const float* up, int64_t n);
cudaError_t SwiGluBackward(cudaStream_t stream, float* dgate, float* dup,
                           const float* dout, const float* gate,
                           const float* up, int64_t n);

// C[rows x cols] (row stride ld) = beta * C, with beta == 0 writing zeros
// (C is not read): a GEMM whose inner dimension k is 0.
cudaError_t ScaleMatrix(cudaStream_t stream, float* c, int64_t rows,
                        int64_t cols, int64_t ld, float beta);

cudaError_t RmsNormForward(cudaStream_t stream, float* out, float* rstd,
                           const float* x, const float* weight, int64_t rows,
                           int64_t cols, float eps);
// `scratch` (kScratchBytes, 256-byte aligned, device memory) must not be
// used by anything else until this work has run: stream order does that when
// it belongs to `stream`.
cudaError_t RmsNormBackward(cudaStream_t stream, float* dx, float* dweight,
                            const float* dout, const float* x,
                            const float* weight, const float* rstd,
                            int64_t rows, int64_t cols, void* scratch);
// bf16 mixed precision (kernels/bf16.h; uint16_t* = the bits of a Bf16):
// the same kernels as the fp32 ones above, templated on the element type, so
// they load exactly, compute the fp32 expressions and round each stored
// element once (__float2bfloat16_rn), the rounding points of the CPU
// emulation (kernels/cpu_bf16_ops.h). rstd stays fp32.
cudaError_t ConvertToBf16(cudaStream_t stream, uint16_t* out, const float* x, int64_t n);
cudaError_t ConvertToFloat(cudaStream_t stream, float* out, const uint16_t* x, int64_t n);
cudaError_t ScaleMatrixBf16(cudaStream_t stream, uint16_t* c, int64_t rows, int64_t cols,
                            int64_t ld, float beta);
cudaError_t SwiGluForwardBf16(cudaStream_t stream, uint16_t* out, const uint16_t* gate,
                              const uint16_t* up, int64_t n);
cudaError_t SwiGluBackwardBf16(cudaStream_t stream, uint16_t* dgate, uint16_t* dup,
                               const uint16_t* dout, const uint16_t* gate, const uint16_t* up,
                               int64_t n);
cudaError_t RmsNormForwardBf16(cudaStream_t stream, uint16_t* out, float* rstd,
                               const uint16_t* x, const uint16_t* weight, int64_t rows,
                               int64_t cols, float eps);
cudaError_t RmsNormBackwardBf16(cudaStream_t stream, uint16_t* dx, uint16_t* dweight,
                                const uint16_t* dout, const uint16_t* x, const uint16_t* weight,
                                const float* rstd, int64_t rows, int64_t cols, void* scratch);

cudaError_t SoftmaxRows(cudaStream_t stream, float* y, const float* x,
                        int64_t rows, int64_t cols);
cudaError_t LogSumExpRows(cudaStream_t stream, float* out, const float* x,
                          int64_t rows, int64_t cols);
cudaError_t Sum(cudaStream_t stream, float* out, const float* x, int64_t n,
                void* scratch);
cudaError_t SumSquares(cudaStream_t stream, float* out, const float* x,
                       int64_t n, void* scratch);
// bf16 (kernels/backend.h): x = rn(value); out = rn(a + b) of the loaded
// values (out may alias a or b); out[0] = SumSquares of the loaded values
// (the same double partials and tree as SumSquares, no bf16 rounding).
cudaError_t FillBf16(cudaStream_t stream, uint16_t* x, int64_t n, float value);
cudaError_t AddBf16(cudaStream_t stream, uint16_t* out, const uint16_t* a, const uint16_t* b,
                    int64_t n);
cudaError_t SumSquaresBf16(cudaStream_t stream, float* out, const uint16_t* x, int64_t n,
                           void* scratch);
// out[i] = rn(x[0][i] + ... + x[rows-1][i]) of the loaded values, row r at
// x + r * ld, added in fp32 in row order with __fadd_rn (never fused):
// bitwise the CPU's cpu::SumRowsBf16.
cudaError_t SumRowsBf16(cudaStream_t stream, uint16_t* out, const uint16_t* x, int64_t rows, int64_t n, int64_t ld);
// out[i] = rn(out[i] + x[rows[0] ld + i] + ... + x[rows[count-1] ld + i]) of
// the loaded values, added in that order with __fadd_rn: bitwise the CPU's
// cpu::AddRowsBf16. The row list travels in the kernel's arguments:
// 1 <= count <= kAddRowsPerLaunch (Backend::kBf16AddRowsPerCall).
inline constexpr int kAddRowsPerLaunch = 64;  // 256 bytes of kernel arguments
cudaError_t AddRowsBf16(cudaStream_t stream, uint16_t* out, const uint16_t* x, const int32_t* rows, int count,
                        int64_t ld, int64_t n);

// The scalars of one AdamW step, computed on the host exactly as the CPU
// twin computes them (cpu::AdamWStepScalars), so both apply one formula.
struct AdamWScalars {
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float grad_scale;
  float step_size;  // lr / (1 - beta1^step)
  float bc2_sqrt;   // sqrt(1 - beta2^step)
  float decay;      // 1 - lr * weight_decay
};
cudaError_t AdamW(cudaStream_t stream, float* param, const float* grad,
                  float* m, float* v, int64_t n, const AdamWScalars& s);
// bf16 mixed: AdamW's kernel with the bf16 gradient loaded exactly, then
// working = __float2bfloat16_rn(updated master) (kernels/backend.h).
cudaError_t AdamWBf16(cudaStream_t stream, float* master, const uint16_t* grad, float* m,
                      float* v, uint16_t* working, int64_t n, const AdamWScalars& s);

// The device arrays of pointers a grouped GEMM reads (cuBLAS takes A, B and
// C of every problem from device memory): a[i], b[i], c[i] for i < n into
// dst_a, dst_b, dst_c (device memory, n entries each). The pointers travel
// as kernel arguments, copied when the kernel is launched, so the host
// arrays may be reused as soon as this returns, and neither the host nor
// the stream waits (a copy from pageable host memory would). Launches
// ceil(n / kPointersPerLaunch) kernels.
inline constexpr int kPointersPerLaunch = 128;  // 3 KiB of kernel arguments
cudaError_t StoreGemmPointers(cudaStream_t stream, const void* const* a,
                              const void* const* b, void* const* c, int64_t n,
                              const void** dst_a, const void** dst_b,
                              void** dst_c);

}  // namespace plateau::cuda_ops

#endif  // PLATEAU_KERNELS_CUDA_CUDA_OPS_H_
