// CUDA kernels for the backend's primitives. Each mirrors its CPU twin in
// kernels/cpu_ops.cc expression for expression (the same fp32 operations in
// the same order per element, the same double accumulators for reductions),
// so the two agree to fp32 rounding; only the order in which reductions add
// their terms differs, and that order is fixed (see cuda_ops.h).
//
// Every kernel runs blocks of kThreads threads. Elementwise kernels and the
// row kernels use grid-stride loops, so any size runs on a bounded grid.
#include "kernels/cuda/cuda_ops.h"

#include "kernels/cuda/cuda_device_utils.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace plateau::cuda_ops {
namespace {

using cuda_device::BlockReduce;
using cuda_device::ElementwiseGrid;
using cuda_device::GlobalThread;
using cuda_device::GridThreads;
using cuda_device::kMaxGrid;
using cuda_device::kThreads;
using cuda_device::MaxOp;
using cuda_device::RowGrid;
using cuda_device::SumOp;

// Sum/SumSquares: at most this many per-block partials, each block's threads
// taking at least kItemsPerThread elements first.
constexpr int64_t kReduceBlocks = 1024;
constexpr int64_t kItemsPerThread = 16;
// RmsNormBackward's dweight: rows are split into at most kMaxChunks chunks of
// at least kRowsPerChunk rows, each chunk's column sums a partial.
constexpr int64_t kRowsPerChunk = 32;
constexpr int64_t kMaxChunks = 1024;

static_assert(kReduceBlocks * sizeof(double) <= kScratchBytes,
              "Sum's partials must fit in the scratch");

__device__ __forceinline__ float Sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

// The element types of the kernels templated on T (float, or bf16 for bf16
// mixed precision: kernels/bf16.h): Load is exact, StoreAs rounds an fp32
// result once to nearest even (__float2bfloat16_rn, the CPU emulation's
// FloatToBf16). For T = float both are the identity, so the fp32 kernels
// compute exactly what they computed before they were templated.
using Bf16 = __nv_bfloat16;
__device__ __forceinline__ float Load(float x) { return x; }
__device__ __forceinline__ float Load(Bf16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T StoreAs(float x);
template <>
__device__ __forceinline__ float StoreAs<float>(float x) { return x; }
template <>
__device__ __forceinline__ Bf16 StoreAs<Bf16>(float x) { return __float2bfloat16_rn(x); }

// ---------------------------------------------------------------------------
// Elementwise: one functor per primitive, applied at every index. Outputs may
// alias inputs: each index is read before it is written, by the same thread.

template <typename Op>
__global__ void __launch_bounds__(kThreads) ElementwiseKernel(int64_t n, Op op) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) op(i);
}

template <typename Op>
cudaError_t LaunchElementwise(cudaStream_t stream, int64_t n, Op op) {
  PLATEAU_KERNEL_LAUNCH(ElementwiseGrid(n), kThreads, 0, stream, ElementwiseKernel<Op>)(n, op);
  return cudaGetLastError();
}

struct FillOp {
  float* x;
  float value;
  __device__ void operator()(int64_t i) const { x[i] = value; }
};

struct ScaleOp {
  float* x;
  float alpha;
  __device__ void operator()(int64_t i) const { x[i] *= alpha; }
};

struct AxpyOp {
  float* y;
  const float* x;
  float alpha;
  __device__ void operator()(int64_t i) const { y[i] += alpha * x[i]; }
};

struct AddOp {
  float* out;
  const float* a;
  const float* b;
  __device__ void operator()(int64_t i) const { out[i] = a[i] + b[i]; }
};

// bf16: x = rn(value) (+0 for 0); out = rn(a + b) of the loaded values,
// one fp32 add rounded once (the CPU emulation's AddBf16).
struct FillBf16Op {
  Bf16* x;
  float value;
  __device__ void operator()(int64_t i) const { x[i] = __float2bfloat16_rn(value); }
};

struct AddBf16Op {
  Bf16* out;
  const Bf16* a;
  const Bf16* b;
  __device__ void operator()(int64_t i) const {
    out[i] = __float2bfloat16_rn(__fadd_rn(Load(a[i]), Load(b[i])));
  }
};

// out = rn(x_0 + x_1 + ... + x_{rows-1}) of the loaded rows, in row order,
// one fp32 add each (the CPU emulation's SumRowsBf16): each thread walks its
// element down the rows, so a warp reads each row coalesced.
struct SumRowsBf16Op {
  Bf16* out;
  const Bf16* x;
  int64_t rows, ld;
  __device__ void operator()(int64_t i) const {
    float acc = Load(x[i]);
    for (int64_t r = 1; r < rows; ++r) acc = __fadd_rn(acc, Load(x[r * ld + i]));
    out[i] = __float2bfloat16_rn(acc);
  }
};

// out = rn(out + x_rows[0] + ... + x_rows[count-1]) of the loaded values, in
// list order: AddRowsBf16. The rows are a copy in the kernel's arguments.
struct AddRowsBf16Op {
  Bf16* out;
  const Bf16* x;
  int64_t ld;
  int count;
  int32_t rows[kAddRowsPerLaunch];
  __device__ void operator()(int64_t i) const {
    float acc = Load(out[i]);
    for (int r = 0; r < count; ++r) acc = __fadd_rn(acc, Load(x[rows[r] * ld + i]));
    out[i] = __float2bfloat16_rn(acc);
  }
};

struct MulOp {
  float* out;
  const float* a;
  const float* b;
  __device__ void operator()(int64_t i) const { out[i] = a[i] * b[i]; }
};

template <typename T>
struct SwiGluForwardOp {
  T* out;
  const T* gate;
  const T* up;
  __device__ void operator()(int64_t i) const {
    const float g = Load(gate[i]);
    out[i] = StoreAs<T>(g * Sigmoid(g) * Load(up[i]));
  }
};

template <typename T>
struct SwiGluBackwardOp {
  T* dgate;
  T* dup;
  const T* dout;
  const T* gate;
  const T* up;
  __device__ void operator()(int64_t i) const {
    const float g = Load(gate[i]), s = Sigmoid(g), d = Load(dout[i]);
    const float silu = g * s;
    // silu'(g) = s * (1 + g * (1 - s))
    dgate[i] = StoreAs<T>(d * Load(up[i]) * s * (1.0f + g * (1.0f - s)));
    dup[i] = StoreAs<T>(d * silu);
  }
};

template <typename T>
struct ScaleMatrixOp {
  T* c;
  int64_t cols, ld;
  float beta;
  __device__ void operator()(int64_t i) const {
    T* p = c + (i / cols) * ld + (i % cols);
    *p = StoreAs<T>(beta == 0.0f ? 0.0f : beta * Load(*p));
  }
};

// bf16 mixed precision's conversions: the working copy of an fp32 master
// (one rounding) and an exact load.
struct ToBf16Op {
  Bf16* out;
  const float* x;
  __device__ void operator()(int64_t i) const { out[i] = __float2bfloat16_rn(x[i]); }
};

struct ToFloatOp {
  float* out;
  const Bf16* x;
  __device__ void operator()(int64_t i) const { out[i] = __bfloat162float(x[i]); }
};

// G: the gradient's type (float, or bf16 with a bf16 working copy written
// from the updated fp32 master: AdamWBf16).
template <typename G>
struct AdamWOp {
  float* param;
  const G* grad;
  float* m;
  float* v;
  Bf16* working;  // bf16 only
  AdamWScalars s;
  __device__ void operator()(int64_t i) const {
    const float g = Load(grad[i]) * s.grad_scale;
    const float p = param[i] * s.decay;
    const float mi = s.beta1 * m[i] + s.one_minus_beta1 * g;
    const float vi = s.beta2 * v[i] + s.one_minus_beta2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const float updated = p - s.step_size * mi / (sqrtf(vi) / s.bc2_sqrt + s.eps);
    param[i] = updated;
    if constexpr (!std::is_same<G, float>::value) working[i] = __float2bfloat16_rn(updated);
  }
};

// ---------------------------------------------------------------------------
// Row-wise: one block per row. Every thread of a block walks the same rows,
// so the barriers inside BlockReduce are reached by all of them.

template <typename T>
__global__ void __launch_bounds__(kThreads)
    RmsNormForwardKernel(T* out, float* rstd, const T* x,
                         const T* weight, int64_t rows, int64_t cols,
                         float eps) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    double ss = 0.0;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      const float xc = Load(xr[c]);
      ss += static_cast<double>(xc) * xc;
    }
    ss = BlockReduce(ss, SumOp());
    const float rs = static_cast<float>(1.0 / sqrt(ss / cols + eps));
    if (threadIdx.x == 0) rstd[r] = rs;
    // out may alias x: every thread has read its elements of the row before
    // the barrier in BlockReduce, and writes only those.
    T* orow = out + r * cols;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      orow[c] = StoreAs<T>(Load(xr[c]) * rs * Load(weight[c]));
    }
  }
}

// dx = r * (dout*w) - x * r^3 / cols * sum_c (dout*w*x), r = rstd[row].
template <typename T>
__global__ void __launch_bounds__(kThreads)
    RmsNormBackwardDxKernel(T* dx, const T* dout, const T* x,
                            const T* weight, const float* rstd,
                            int64_t rows, int64_t cols) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    const T* dr = dout + r * cols;
    const float rs = rstd[r];
    double dot = 0.0;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      dot += static_cast<double>(Load(dr[c])) * Load(weight[c]) * Load(xr[c]);
    }
    dot = BlockReduce(dot, SumOp());
    const float coef = static_cast<float>(dot * rs * rs * rs / cols);
    T* dxr = dx + r * cols;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      dxr[c] = StoreAs<T>(rs * Load(dr[c]) * Load(weight[c]) - Load(xr[c]) * coef);
    }
  }
}

// dweight[c] += sum_r dout[r,c] x[r,c] rstd[r], first pass: block (bx, by)
// sums rows [by * rows_per_chunk, ...) of columns [bx * kThreads, ...), rows
// in order, into partial[by * cols + c]. With partial == nullptr (a single
// chunk) it adds straight into dweight. Adjacent threads read adjacent
// columns, so each row's loads are coalesced.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    RmsNormDweightPartialKernel(double* partial, T* dweight,
                                const T* dout, const T* x,
                                const float* rstd, int64_t rows, int64_t cols,
                                int64_t rows_per_chunk) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= cols) return;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t end =
      begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
  double acc = 0.0;
  for (int64_t r = begin; r < end; ++r) {
    acc += static_cast<double>(Load(dout[r * cols + c])) * Load(x[r * cols + c]) * rstd[r];
  }
  if (partial != nullptr) {
    partial[blockIdx.y * cols + c] = acc;
  } else {
    dweight[c] = StoreAs<T>(static_cast<float>(Load(dweight[c]) + acc));
  }
}

// Second pass: each column's chunk partials, in chunk order.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    RmsNormDweightCombineKernel(T* dweight, const double* partial,
                                int64_t cols, int64_t chunks) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= cols) return;
  double acc = 0.0;
  for (int64_t j = 0; j < chunks; ++j) acc += partial[j * cols + c];
  dweight[c] = StoreAs<T>(static_cast<float>(Load(dweight[c]) + acc));
}

// Softmax and log-sum-exp shift by the row maximum so exp stays in range
// for any finite x (x - max may round to -inf, whose exp is 0).
__device__ float RowMax(const float* xr, int64_t cols) {
  float mx = -INFINITY;
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) mx = fmaxf(mx, xr[c]);
  return BlockReduce(mx, MaxOp());
}

__global__ void __launch_bounds__(kThreads)
    SoftmaxRowsKernel(float* y, const float* x, int64_t rows, int64_t cols) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    const float mx = RowMax(xr, cols);
    double sum = 0.0;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      sum += static_cast<double>(expf(xr[c] - mx));
    }
    sum = BlockReduce(sum, SumOp());
    const float inv = static_cast<float>(1.0 / sum);
    // y may alias x: see RmsNormForwardKernel.
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      yr[c] = expf(xr[c] - mx) * inv;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    LogSumExpRowsKernel(float* out, const float* x, int64_t rows,
                        int64_t cols) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * cols;
    const float mx = RowMax(xr, cols);
    double sum = 0.0;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      sum += exp(static_cast<double>(xr[c] - mx));
    }
    sum = BlockReduce(sum, SumOp());
    if (threadIdx.x == 0) out[r] = static_cast<float>(mx + log(sum));
  }
}

// ---------------------------------------------------------------------------
// Whole-array reductions: per-block partials, then one block combines them.

// T = float, or Bf16 (SumSquaresBf16: the loaded values, exact in double).
template <bool kSquare, typename T>
__global__ void __launch_bounds__(kThreads)
    ReducePartialKernel(double* partial, const T* x, int64_t n) {
  double acc = 0.0;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const double v = Load(x[i]);
    acc += kSquare ? v * v : v;
  }
  acc = BlockReduce(acc, SumOp());
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kThreads)
    ReduceFinishKernel(float* out, const double* partial, int64_t count) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) acc += partial[i];
  acc = BlockReduce(acc, SumOp());
  if (threadIdx.x == 0) out[0] = static_cast<float>(acc);
}

template <bool kSquare, typename T>
cudaError_t LaunchReduce(cudaStream_t stream, float* out, const T* x,
                         int64_t n, void* scratch) {
  const int64_t per_block = kThreads * kItemsPerThread;
  const int64_t blocks =
      std::clamp<int64_t>((n + per_block - 1) / per_block, 1, kReduceBlocks);
  auto* partial = static_cast<double*>(scratch);
  PLATEAU_KERNEL_LAUNCH(
      static_cast<int>(blocks), kThreads, 0, stream, ReducePartialKernel<kSquare, T>)(
      partial, x, n);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  PLATEAU_KERNEL_LAUNCH(1, kThreads, 0, stream, ReduceFinishKernel)(out, partial, blocks);
  return cudaGetLastError();
}

}  // namespace

cudaError_t Fill(cudaStream_t stream, float* x, int64_t n, float value) {
  return LaunchElementwise(stream, n, FillOp{x, value});
}

cudaError_t Scale(cudaStream_t stream, float* x, int64_t n, float alpha) {
  return LaunchElementwise(stream, n, ScaleOp{x, alpha});
}

cudaError_t Axpy(cudaStream_t stream, float* y, const float* x, int64_t n,
                 float alpha) {
  return LaunchElementwise(stream, n, AxpyOp{y, x, alpha});
}

cudaError_t Add(cudaStream_t stream, float* out, const float* a,
                const float* b, int64_t n) {
  return LaunchElementwise(stream, n, AddOp{out, a, b});
}

cudaError_t Mul(cudaStream_t stream, float* out, const float* a,
                const float* b, int64_t n) {
  return LaunchElementwise(stream, n, MulOp{out, a, b});
}

cudaError_t SwiGluForward(cudaStream_t stream, float* out, const float* gate,
                          const float* up, int64_t n) {
  return LaunchElementwise(stream, n, SwiGluForwardOp<float>{out, gate, up});
}

cudaError_t SwiGluBackward(cudaStream_t stream, float* dgate, float* dup,
                           const float* dout, const float* gate,
                           const float* up, int64_t n) {
  return LaunchElementwise(stream, n,
                           SwiGluBackwardOp<float>{dgate, dup, dout, gate, up});
}

cudaError_t ScaleMatrix(cudaStream_t stream, float* c, int64_t rows,
                        int64_t cols, int64_t ld, float beta) {
  return LaunchElementwise(stream, rows * cols,
                           ScaleMatrixOp<float>{c, cols, ld, beta});
}

namespace {

template <typename T>
cudaError_t RmsNormForwardT(cudaStream_t stream, T* out, float* rstd,
                            const T* x, const T* weight, int64_t rows,
                            int64_t cols, float eps) {
  PLATEAU_KERNEL_LAUNCH(RowGrid(rows), kThreads, 0, stream, RmsNormForwardKernel<T>)(
      out, rstd, x, weight, rows, cols, eps);
  return cudaGetLastError();
}

template <typename T>
cudaError_t RmsNormBackwardT(cudaStream_t stream, T* dx, T* dweight,
                             const T* dout, const T* x,
                             const T* weight, const float* rstd,
                             int64_t rows, int64_t cols, void* scratch) {
  // dweight first: it reads dout and x across rows, while the dx kernel
  // reads each row before writing it, so this order also stays right if a
  // caller passes dx aliasing dout or x (as the CPU twin tolerates).
  //
  // Row chunks for dweight: enough for parallelism, bounded by the scratch
  // (chunks * cols doubles). Depends only on (rows, cols).
  const int64_t capacity = static_cast<int64_t>(kScratchBytes / sizeof(double));
  int64_t chunks = std::min<int64_t>(
      {(rows + kRowsPerChunk - 1) / kRowsPerChunk, kMaxChunks, capacity / cols});
  chunks = std::max<int64_t>(chunks, 1);
  const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
  chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;  // none empty
  double* partial = chunks > 1 ? static_cast<double*>(scratch) : nullptr;

  const dim3 grid(static_cast<unsigned>((cols + kThreads - 1) / kThreads),
                  static_cast<unsigned>(chunks));
  PLATEAU_KERNEL_LAUNCH(grid, kThreads, 0, stream, RmsNormDweightPartialKernel<T>)(
      partial, dweight, dout, x, rstd, rows, cols, rows_per_chunk);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (partial != nullptr) {
    PLATEAU_KERNEL_LAUNCH(grid.x, kThreads, 0, stream, RmsNormDweightCombineKernel<T>)(
        dweight, partial, cols, chunks);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  PLATEAU_KERNEL_LAUNCH(RowGrid(rows), kThreads, 0, stream, RmsNormBackwardDxKernel<T>)(
      dx, dout, x, weight, rstd, rows, cols);
  return cudaGetLastError();
}

// The launchers' bf16 arguments are kernels/bf16.h's bits (this header is
// plain C++); __nv_bfloat16 has the same size and bits.
static_assert(sizeof(Bf16) == sizeof(uint16_t), "bf16 is 2 bytes");
Bf16* AsBf16(uint16_t* p) { return reinterpret_cast<Bf16*>(p); }
const Bf16* AsBf16(const uint16_t* p) { return reinterpret_cast<const Bf16*>(p); }

}  // namespace

cudaError_t RmsNormForward(cudaStream_t stream, float* out, float* rstd,
                           const float* x, const float* weight, int64_t rows,
                           int64_t cols, float eps) {
  return RmsNormForwardT(stream, out, rstd, x, weight, rows, cols, eps);
}

cudaError_t RmsNormBackward(cudaStream_t stream, float* dx, float* dweight,
                            const float* dout, const float* x,
                            const float* weight, const float* rstd,
                            int64_t rows, int64_t cols, void* scratch) {
  return RmsNormBackwardT(stream, dx, dweight, dout, x, weight, rstd, rows, cols, scratch);
}

// --- bf16 mixed precision ---------------------------------------------------

cudaError_t ConvertToBf16(cudaStream_t stream, uint16_t* out, const float* x, int64_t n) {
  return LaunchElementwise(stream, n, ToBf16Op{AsBf16(out), x});
}

cudaError_t ConvertToFloat(cudaStream_t stream, float* out, const uint16_t* x, int64_t n) {
  return LaunchElementwise(stream, n, ToFloatOp{out, AsBf16(x)});
}

cudaError_t ScaleMatrixBf16(cudaStream_t stream, uint16_t* c, int64_t rows, int64_t cols,
                            int64_t ld, float beta) {
  return LaunchElementwise(stream, rows * cols, ScaleMatrixOp<Bf16>{AsBf16(c), cols, ld, beta});
}

cudaError_t SwiGluForwardBf16(cudaStream_t stream, uint16_t* out, const uint16_t* gate,
                              const uint16_t* up, int64_t n) {
  return LaunchElementwise(stream, n, SwiGluForwardOp<Bf16>{AsBf16(out), AsBf16(gate), AsBf16(up)});
}

cudaError_t SwiGluBackwardBf16(cudaStream_t stream, uint16_t* dgate, uint16_t* dup,
                               const uint16_t* dout, const uint16_t* gate, const uint16_t* up,
                               int64_t n) {
  return LaunchElementwise(stream, n,
                           SwiGluBackwardOp<Bf16>{AsBf16(dgate), AsBf16(dup), AsBf16(dout),
                                                  AsBf16(gate), AsBf16(up)});
}

cudaError_t RmsNormForwardBf16(cudaStream_t stream, uint16_t* out, float* rstd,
                               const uint16_t* x, const uint16_t* weight, int64_t rows,
                               int64_t cols, float eps) {
  return RmsNormForwardT(stream, AsBf16(out), rstd, AsBf16(x), AsBf16(weight), rows, cols, eps);
}

cudaError_t RmsNormBackwardBf16(cudaStream_t stream, uint16_t* dx, uint16_t* dweight,
                                const uint16_t* dout, const uint16_t* x, const uint16_t* weight,
                                const float* rstd, int64_t rows, int64_t cols, void* scratch) {
  return RmsNormBackwardT(stream, AsBf16(dx), AsBf16(dweight), AsBf16(dout), AsBf16(x),
                          AsBf16(weight), rstd, rows, cols, scratch);
}

cudaError_t SoftmaxRows(cudaStream_t stream, float* y, const float* x,
                        int64_t rows, int64_t cols) {
  PLATEAU_KERNEL_LAUNCH(RowGrid(rows), kThreads, 0, stream, SoftmaxRowsKernel)(y, x, rows, cols);
  return cudaGetLastError();
}

cudaError_t LogSumExpRows(cudaStream_t stream, float* out, const float* x,
                          int64_t rows, int64_t cols) {
  PLATEAU_KERNEL_LAUNCH(RowGrid(rows), kThreads, 0, stream, LogSumExpRowsKernel)(
      out, x, rows, cols);
  return cudaGetLastError();
}

cudaError_t Sum(cudaStream_t stream, float* out, const float* x, int64_t n,
                void* scratch) {
  return LaunchReduce<false>(stream, out, x, n, scratch);
}

cudaError_t SumSquares(cudaStream_t stream, float* out, const float* x,
                       int64_t n, void* scratch) {
  return LaunchReduce<true>(stream, out, x, n, scratch);
}

cudaError_t FillBf16(cudaStream_t stream, uint16_t* x, int64_t n, float value) {
  return LaunchElementwise(stream, n, FillBf16Op{AsBf16(x), value});
}

cudaError_t AddBf16(cudaStream_t stream, uint16_t* out, const uint16_t* a, const uint16_t* b,
                    int64_t n) {
  return LaunchElementwise(stream, n, AddBf16Op{AsBf16(out), AsBf16(a), AsBf16(b)});
}

cudaError_t SumSquaresBf16(cudaStream_t stream, float* out, const uint16_t* x, int64_t n,
                           void* scratch) {
  return LaunchReduce<true>(stream, out, AsBf16(x), n, scratch);
}

cudaError_t SumRowsBf16(cudaStream_t stream, uint16_t* out, const uint16_t* x, int64_t rows, int64_t n, int64_t ld) {
  return LaunchElementwise(stream, n, SumRowsBf16Op{AsBf16(out), AsBf16(x), rows, ld});
}

cudaError_t AddRowsBf16(cudaStream_t stream, uint16_t* out, const uint16_t* x, const int32_t* rows, int count,
                        int64_t ld, int64_t n) {
  if (count < 1 || count > kAddRowsPerLaunch) return cudaErrorInvalidValue;
  AddRowsBf16Op op{AsBf16(out), AsBf16(x), ld, count, {}};
  for (int r = 0; r < count; ++r) op.rows[r] = rows[r];
  return LaunchElementwise(stream, n, op);
}

cudaError_t AdamW(cudaStream_t stream, float* param, const float* grad,
                  float* m, float* v, int64_t n, const AdamWScalars& s) {
  return LaunchElementwise(stream, n, AdamWOp<float>{param, grad, m, v, nullptr, s});
}

cudaError_t AdamWBf16(cudaStream_t stream, float* master, const uint16_t* grad, float* m,
                      float* v, uint16_t* working, int64_t n, const AdamWScalars& s) {
  return LaunchElementwise(stream, n,
                           AdamWOp<Bf16>{master, AsBf16(grad), m, v, AsBf16(working), s});
}

// Grouped GEMM pointer arrays: one launch per kPointersPerLaunch problems,
// the pointers passed by value in the kernel's arguments.
struct GemmPointerBatch {
  const void* a[kPointersPerLaunch];
  const void* b[kPointersPerLaunch];
  void* c[kPointersPerLaunch];
};

__global__ void StoreGemmPointersKernel(GemmPointerBatch batch, int n,
                                        const void** dst_a, const void** dst_b,
                                        void** dst_c) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < n) {
    dst_a[i] = batch.a[i];
    dst_b[i] = batch.b[i];
    dst_c[i] = batch.c[i];
  }
}

cudaError_t StoreGemmPointers(cudaStream_t stream, const void* const* a,
                              const void* const* b, void* const* c, int64_t n,
                              const void** dst_a, const void** dst_b,
                              void** dst_c) {
  for (int64_t off = 0; off < n; off += kPointersPerLaunch) {
    const int count =
        static_cast<int>(n - off < kPointersPerLaunch ? n - off : kPointersPerLaunch);
    GemmPointerBatch batch{};
    for (int i = 0; i < count; ++i) {
      batch.a[i] = a[off + i];
      batch.b[i] = b[off + i];
      batch.c[i] = c[off + i];
    }
    PLATEAU_KERNEL_LAUNCH(1, kPointersPerLaunch, 0, stream, StoreGemmPointersKernel)(
        batch, count, dst_a + off, dst_b + off, dst_c + off);
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  return cudaSuccess;
}

cudaError_t CheckKernelImage() {
  // Every kernel of this file, so that each is loaded now: with lazy
  // loading, a first launch mid-step could wait for the context to go idle.
  const void* kernels[] = {
      reinterpret_cast<const void*>(ElementwiseKernel<FillOp>),
      reinterpret_cast<const void*>(ElementwiseKernel<ScaleOp>),
      reinterpret_cast<const void*>(ElementwiseKernel<AxpyOp>),
      reinterpret_cast<const void*>(ElementwiseKernel<AddOp>),
      reinterpret_cast<const void*>(ElementwiseKernel<MulOp>),
      reinterpret_cast<const void*>(ElementwiseKernel<SwiGluForwardOp<float>>),
      reinterpret_cast<const void*>(ElementwiseKernel<SwiGluBackwardOp<float>>),
      reinterpret_cast<const void*>(ElementwiseKernel<ScaleMatrixOp<float>>),
      reinterpret_cast<const void*>(ElementwiseKernel<AdamWOp<float>>),
      reinterpret_cast<const void*>(ElementwiseKernel<AdamWOp<Bf16>>),
      reinterpret_cast<const void*>(RmsNormForwardKernel<float>),
      reinterpret_cast<const void*>(RmsNormBackwardDxKernel<float>),
      reinterpret_cast<const void*>(RmsNormDweightPartialKernel<float>),
      reinterpret_cast<const void*>(RmsNormDweightCombineKernel<float>),
      // bf16 mixed precision.
      reinterpret_cast<const void*>(ElementwiseKernel<ToBf16Op>),
      reinterpret_cast<const void*>(ElementwiseKernel<ToFloatOp>),
      reinterpret_cast<const void*>(ElementwiseKernel<ScaleMatrixOp<Bf16>>),
      reinterpret_cast<const void*>(ElementwiseKernel<SwiGluForwardOp<Bf16>>),
      reinterpret_cast<const void*>(ElementwiseKernel<SwiGluBackwardOp<Bf16>>),
      reinterpret_cast<const void*>(RmsNormForwardKernel<Bf16>),
      reinterpret_cast<const void*>(RmsNormBackwardDxKernel<Bf16>),
      reinterpret_cast<const void*>(RmsNormDweightPartialKernel<Bf16>),
      reinterpret_cast<const void*>(RmsNormDweightCombineKernel<Bf16>),
      reinterpret_cast<const void*>(SoftmaxRowsKernel),
      reinterpret_cast<const void*>(LogSumExpRowsKernel),
      reinterpret_cast<const void*>(ReducePartialKernel<false, float>),
      reinterpret_cast<const void*>(ReducePartialKernel<true, float>),
      reinterpret_cast<const void*>(ReducePartialKernel<true, Bf16>),
      reinterpret_cast<const void*>(ElementwiseKernel<FillBf16Op>),
      reinterpret_cast<const void*>(ElementwiseKernel<AddBf16Op>),
      reinterpret_cast<const void*>(ElementwiseKernel<SumRowsBf16Op>),
      reinterpret_cast<const void*>(ElementwiseKernel<AddRowsBf16Op>),
      reinterpret_cast<const void*>(ReduceFinishKernel),
      reinterpret_cast<const void*>(StoreGemmPointersKernel),
  };
  for (const void* kernel : kernels) {
    cudaFuncAttributes attributes;
    const cudaError_t e = cudaFuncGetAttributes(&attributes, kernel);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace plateau::cuda_ops
