// The compute backend: memory spaces, streams, copies, GEMM and the
// elementwise and reduction primitives the training step is built from.
//
// Two implementations share this interface: the CPU backend (OpenBLAS sgemm,
// one worker thread per stream, a capped heap arena as the "device") and the
// CUDA backend (cuBLAS, CUDA streams, cudaMalloc'd device memory and
// cudaHostAlloc'd pinned host memory; built with --config=cuda).
//
// Conventions for every operation below:
// - fp32, contiguous, row-major; sizes are element counts.
// - The call validates its arguments (here, once for every backend) and
//   returns INVALID_ARGUMENT naming the argument before anything is
//   enqueued; the work itself runs asynchronously on `stream`. Pointers must
//   stay valid until it has run.
// - Outputs may alias inputs of the same shape where a comment says so.
// - Reductions run in a fixed order: the same inputs give the same bits, run
//   to run. The CPU and CUDA twins agree to fp32 rounding, not bitwise.
//
// Thread safety: a Backend may be used from several threads at once.
#ifndef PLATEAU_KERNELS_BACKEND_H_
#define PLATEAU_KERNELS_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/bf16.h"
#include "kernels/memory.h"
#include "kernels/stream.h"

namespace plateau {

enum class BackendKind { kCpu, kCuda };
absl::string_view BackendKindName(BackendKind kind);  // "cpu" or "cuda"
absl::StatusOr<BackendKind> ParseBackendKind(absl::string_view name);

struct BackendOptions {
  BackendKind kind = BackendKind::kCpu;
  // Device memory cap in bytes. On the CPU backend this is the size of the
  // device arena and must be > 0. On CUDA, 0 means "what the GPU has"; a
  // positive value caps the job below that.
  int64_t device_memory_bytes = 0;
  // Host (pinned on CUDA) memory cap in bytes; 0 means uncapped.
  int64_t host_memory_bytes = 0;
  // CUDA device ordinal; ignored on the CPU.
  int device_index = 0;
  // For tests of copy/compute ordering (CPU backend only; ignored on CUDA):
  // every copy between the device and the host space waits this many
  // microseconds on its stream before it copies, so that work wrongly
  // ordered against it sees stale or half-written memory.
  int64_t copy_delay_us_for_testing = 0;
  // CPU backend only: threads of the pool its non-GEMM kernels share
  // (kernels/cpu_pool.h); 0 means one per core. Results are the same bits
  // for any value (the work is split by the problem's size only).
  int cpu_threads = 0;
};

// Row-major C[m x n] = alpha * op(A) * op(B) + beta * C, where op(A) is
// m x k and op(B) is k x n. A is stored m x k (k x m when trans_a), B is
// stored k x n (n x k when trans_b). lda/ldb/ldc are row strides in elements.
struct GemmArgs {
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  float alpha = 1.0f;
  const float* a = nullptr;
  int64_t lda = 0;
  const float* b = nullptr;
  int64_t ldb = 0;
  float beta = 0.0f;
  float* c = nullptr;
  int64_t ldc = 0;
};
// Checks shapes and strides; the message names the offending field.
absl::Status ValidateGemm(const GemmArgs& g);

// torch.optim.AdamW, one step over a contiguous shard:
//   g = grad * grad_scale            (grad_scale carries global-norm clipping)
//   param *= 1 - lr * weight_decay
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g^2
//   param -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
struct AdamWArgs {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
  int64_t step = 1;  // 1-based, as torch counts
  float grad_scale = 1.0f;
};
absl::Status ValidateAdamW(const AdamWArgs& a);

// The device as its driver sees it (issue 17's CUDA telemetry), beside the
// live-set accounting of device(): used = total - free counts everything on
// the card (other processes, the CUDA context, NCCL's and cuBLAS's buffers,
// the pool's cached blocks), so it is at least the tracked bytes, never equal
// to them by construction.
struct DeviceView {
  int device_index = 0;  // the CUDA device (BackendOptions::device_index)
  std::string name;      // cudaDeviceProp::name
  int cc_major = 0, cc_minor = 0;
  int64_t total_bytes = 0;
  int64_t free_bytes = 0;           // cudaMemGetInfo
  int64_t pool_reserved_bytes = 0;  // the stream-ordered pool's reservation
};

// The bf16 GEMM of bf16 mixed precision (cuBLASLt / cublasGemmEx with bf16
// A and B and CUBLAS_COMPUTE_32F): the products and their sum in fp32, then
// C = alpha * sum + beta * C in fp32 and one rounding per stored element.
// Shapes and strides as GemmArgs. Exactly one output: `c` (bf16: working
// activations and gradients) or `c_fp32` (what the plan keeps in fp32: the
// router's logits, a score panel).
struct GemmBf16Args {
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  float alpha = 1.0f;
  const Bf16* a = nullptr;
  int64_t lda = 0;
  const Bf16* b = nullptr;
  int64_t ldb = 0;
  float beta = 0.0f;
  Bf16* c = nullptr;
  float* c_fp32 = nullptr;
  int64_t ldc = 0;
};
// As ValidateGemm (the message names the field, op "gemm_bf16"), and
// exactly one of c and c_fp32 set.
absl::Status ValidateGemmBf16(const GemmBf16Args& g);

// What a stream is for (Backend::CreateStream).
enum class StreamUse { kCompute, kCopy };

class Backend {
 public:
  // Creates the backend named by options.kind. CUDA needs a build with
  // --config=cuda and a visible GPU; otherwise FAILED_PRECONDITION says so.
  static absl::StatusOr<std::unique_ptr<Backend>> Create(
      const BackendOptions& options);

  virtual ~Backend() = default;
  virtual BackendKind kind() const = 0;
  // "cpu (2 threads, OpenBLAS 0.3.21)" / "cuda (NVIDIA H200, sm_90)".
  virtual std::string Describe() const = 0;
  // Whether the model kernels compute bf16 mixed precision (bf16 working
  // weights and activations, fp32 master and reductions). Both backends do:
  // the CPU's bf16 ops are exact emulations of what the CUDA kernels compute
  // (cpu_bf16_ops.h), and cuda_step_twin_test holds the CUDA bf16 step to
  // the CPU's (it has not yet run on a GPU: issue 17's device-check).
  // TrainingStep::Create refuses a bf16 step on a backend without it.
  virtual bool computes_bf16() const { return false; }

  // The device's own view of its memory (CUDA: cudaMemGetInfo and the
  // pool's reserved bytes). UNIMPLEMENTED where there is no such view (the
  // CPU backend: its "device" is an arena in host memory).
  virtual absl::StatusOr<DeviceView> QueryDevice() {
    return absl::UnimplementedError("backend: no device view (cpu)");
  }

  virtual MemorySpace& device() = 0;
  virtual MemorySpace& host() = 0;

  // A stream for `use`: kCompute runs anything; kCopy runs copies, events
  // and waits only (a GEMM or a reduction on it is FAILED_PRECONDITION), and
  // on CUDA has no cuBLAS handle or workspace, which no plan counts (32 MiB
  // a stream on Hopper). The CPU backend's streams are all alike.
  // (Every override declares the same default.)
  virtual absl::StatusOr<std::unique_ptr<Stream>> CreateStream(absl::string_view name,
                                                               StreamUse use = StreamUse::kCompute) = 0;
  virtual absl::StatusOr<std::unique_ptr<Event>> CreateEvent() = 0;
  // An event that also keeps when its point ran, for Event::SecondsSince
  // (the step's phase clock, kernels/phase_clock.h). CreateEvent's events do
  // without: on CUDA a timing event costs a timestamp at every Record.
  virtual absl::StatusOr<std::unique_ptr<Event>> CreateTimingEvent() {
    return absl::UnimplementedError("backend: no timing events");
  }

  // Copies `bytes` between any two spaces of this backend (device or host,
  // either direction), asynchronously on `stream`. The ranges must not
  // overlap. With memory of the caller's own on either side (a std::vector,
  // a stack array: not in one of the backend's spaces) the copy is complete
  // when Copy returns, as cudaMemcpyAsync is with pageable memory, so the
  // caller may reuse or free it on any path; it then also returns the
  // stream's error. (A Buffer, likewise, goes back to its space only once no
  // queued work can touch it: memory.h.)
  absl::Status Copy(Stream& stream, void* dst, const void* src,
                            size_t bytes);

  absl::Status Gemm(Stream& stream, const GemmArgs& args);
  // Independent GEMMs enqueued as one operation (the expert groups of a
  // dispatch chunk: one GEMM per expert, each with its own rows, weights
  // and output). On CUDA one cublasGemmGroupedBatchedEx call (per 1024
  // GEMMs), on the CPU the GEMMs in order in one task. Every entry is
  // checked as Gemm checks it (the message names gemms[i]); no entry's C
  // may overlap another entry's A, B or C, since they may run at once. Each
  // C is what Gemm gives for that entry: bitwise on the CPU; on CUDA to fp32
  // rounding (cuBLAS's grouped kernels may sum in another order).
  absl::Status GroupedGemm(Stream& stream, absl::Span<const GemmArgs> gemms);

  // --- Elementwise (n elements) ------------------------------------------
  absl::Status Fill(Stream& s, float* x, int64_t n, float value);
  // x *= alpha
  absl::Status Scale(Stream& s, float* x, int64_t n, float alpha);
  // y += alpha * x
  absl::Status Axpy(Stream& s, float* y, const float* x, int64_t n,
                            float alpha);
  // out = a + b; out may alias a or b.
  absl::Status Add(Stream& s, float* out, const float* a,
                           const float* b, int64_t n);
  // out = a * b; out may alias a or b.
  absl::Status Mul(Stream& s, float* out, const float* a,
                           const float* b, int64_t n);
  // out = silu(gate) * up, silu(x) = x / (1 + exp(-x)).
  absl::Status SwiGluForward(Stream& s, float* out, const float* gate,
                                     const float* up, int64_t n);
  // dgate = dout * up * silu'(gate); dup = dout * silu(gate).
  absl::Status SwiGluBackward(Stream& s, float* dgate, float* dup,
                                      const float* dout, const float* gate,
                                      const float* up, int64_t n);

  // --- Row-wise (rows x cols) -------------------------------------------
  // rstd[r] = 1 / sqrt(mean_c x[r,c]^2 + eps); out = x * rstd[r] * weight[c].
  // out may alias x.
  absl::Status RmsNormForward(Stream& s, float* out, float* rstd,
                                      const float* x, const float* weight,
                                      int64_t rows, int64_t cols,
                                      float eps);
  // Overwrites dx; adds into dweight (so a caller can accumulate over
  // chunks). Uses the rstd saved by the forward.
  absl::Status RmsNormBackward(Stream& s, float* dx, float* dweight,
                                       const float* dout, const float* x,
                                       const float* weight, const float* rstd,
                                       int64_t rows, int64_t cols);
  // y[r,:] = softmax(x[r,:]); y may alias x.
  absl::Status SoftmaxRows(Stream& s, float* y, const float* x,
                                   int64_t rows, int64_t cols);
  // out[r] = log(sum_c exp(x[r,c])), stable for any finite x.
  absl::Status LogSumExpRows(Stream& s, float* out, const float* x,
                                     int64_t rows, int64_t cols);

  // --- Reductions (result written to out[0], in the space of x) ----------
  absl::Status Sum(Stream& s, float* out, const float* x,
                           int64_t n);
  absl::Status SumSquares(Stream& s, float* out, const float* x,
                                  int64_t n);

  // --- Optimizer -----------------------------------------------------------
  absl::Status AdamW(Stream& s, float* param, const float* grad,
                             float* m, float* v, int64_t n,
                             const AdamWArgs& args);

  // --- bf16 mixed precision (backend_bf16.cc; kernels/bf16.h) -------------
  // Every op loads its bf16 inputs exactly, computes in fp32 as its fp32
  // twin above does, and rounds each stored bf16 element once to nearest
  // even (__float2bfloat16_rn); fp32 arguments (rstd) stay fp32. So on the
  // CPU each is bitwise the fp32 op on the loaded inputs, rounded on store.
  // A backend without bf16 kernels returns UNIMPLEMENTED naming the op.
  absl::Status GemmBf16(Stream& stream, const GemmBf16Args& args);
  // The expert groups' GEMMs in bf16, checked as GroupedGemm checks its
  // entries (the message names gemms[i]); each C is what GemmBf16 gives.
  // Default: GemmBf16 on each entry in order; the CPU runs them in order as
  // one task; CUDA as cuBLAS grouped calls (cuda_backend.cc: EnqueueGrouped
  // says which entries go one by one instead).
  absl::Status GroupedGemmBf16(Stream& stream, absl::Span<const GemmBf16Args> gemms);
  // out = rn(x): the working copy of an fp32 master.
  absl::Status ConvertToBf16(Stream& s, Bf16* out, const float* x, int64_t n);
  // out = x, exactly.
  absl::Status ConvertToFloat(Stream& s, float* out, const Bf16* x, int64_t n);
  absl::Status SwiGluForwardBf16(Stream& s, Bf16* out, const Bf16* gate,
                                 const Bf16* up, int64_t n);
  absl::Status SwiGluBackwardBf16(Stream& s, Bf16* dgate, Bf16* dup,
                                  const Bf16* dout, const Bf16* gate,
                                  const Bf16* up, int64_t n);
  // rstd in fp32 (a reduction: the plan's accum precision). out may alias x.
  absl::Status RmsNormForwardBf16(Stream& s, Bf16* out, float* rstd,
                                  const Bf16* x, const Bf16* weight,
                                  int64_t rows, int64_t cols, float eps);
  // dweight (a bf16 gradient) += the fp32 column sums, rounded once.
  absl::Status RmsNormBackwardBf16(Stream& s, Bf16* dx, Bf16* dweight,
                                   const Bf16* dout, const Bf16* x,
                                   const Bf16* weight, const float* rstd,
                                   int64_t rows, int64_t cols);
  // AdamW on the fp32 master (`master`, m and v exactly as AdamW above) with
  // the bf16 gradient loaded exactly, then the working copy
  // working = rn(master) from the updated master: one pass, so the master
  // never leaves fp32 and the working weights are its one rounding.
  absl::Status AdamWBf16(Stream& s, float* master, const Bf16* grad, float* m,
                         float* v, Bf16* working, int64_t n,
                         const AdamWArgs& args);
  // x = rn(value) everywhere (zeroing a bf16 gradient: value 0 gives +0).
  absl::Status FillBf16(Stream& s, Bf16* x, int64_t n, float value);
  // out = rn(a + b), the fp32 sum of the loaded values rounded once (the
  // residual stream's gradients); out may alias a or b.
  absl::Status AddBf16(Stream& s, Bf16* out, const Bf16* a, const Bf16* b,
                       int64_t n);
  // out[0] (fp32) = SumSquares of the loaded values: the gradient norm of
  // bf16 gradients is an fp32 reduction (no bf16 rounding).
  absl::Status SumSquaresBf16(Stream& s, float* out, const Bf16* x, int64_t n);
  // out[i] = rn(x[0][i] + x[1][i] + ... + x[rows-1][i]) for i < n, row r at
  // x + r * ld: the loaded values summed in fp32 in row order (from row 0,
  // left to right, no fused or reassociated adds) and rounded once, so the
  // CPU and CUDA give the same bits. The ZeRO gradient reduce of bf16 mixed
  // precision (kernels/step/grad_reduce.h): a sum over ranks that rounds
  // once, not once per ring hop. rows >= 1, ld >= n; out must not overlap x.
  absl::Status SumRowsBf16(Stream& s, Bf16* out, const Bf16* x, int64_t rows, int64_t n, int64_t ld);
  // out[i] = rn(out[i] + x[rows[0] ld + i] + ... + x[rows[r-1] ld + i]) for
  // i < n: out's own value, then the listed rows of x in list order, loaded
  // and added in fp32 and rounded once, as SumRowsBf16 adds (bitwise between
  // the CPU and CUDA). LLEP's owner adding its helpers' gradients of one
  // expert (kernels/dispatch/llep_chunk.h): a sum that rounds once, not once
  // per helper. The rows go kBf16AddRowsPerCall at a time (CUDA passes them
  // in the kernel's arguments): a longer list rounds once per group, on both
  // backends. An empty list leaves out as it is; ld >= n; out must not
  // overlap the rows read.
  static constexpr int64_t kBf16AddRowsPerCall = 64;
  absl::Status AddRowsBf16(Stream& s, Bf16* out, const Bf16* x, absl::Span<const int32_t> rows, int64_t ld, int64_t n);

 protected:
  // Implementations: called only after the arguments were validated.
  virtual absl::Status DoCopy(Stream& stream, void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status DoGemm(Stream& stream, const GemmArgs& args) = 0;
  // The entries with m, n > 0 (validated). Default: DoGemm on each, in order.
  virtual absl::Status DoGroupedGemm(Stream& stream, absl::Span<const GemmArgs> gemms);
  virtual absl::Status DoFill(Stream& s, float* x, int64_t n, float value) = 0;
  virtual absl::Status DoScale(Stream& s, float* x, int64_t n, float alpha) = 0;
  virtual absl::Status DoAxpy(Stream& s, float* y, const float* x, int64_t n, float alpha) = 0;
  virtual absl::Status DoAdd(Stream& s, float* out, const float* a, const float* b, int64_t n) = 0;
  virtual absl::Status DoMul(Stream& s, float* out, const float* a, const float* b, int64_t n) = 0;
  virtual absl::Status DoSwiGluForward(Stream& s, float* out, const float* gate, const float* up, int64_t n) = 0;
  virtual absl::Status DoSwiGluBackward(Stream& s, float* dgate, float* dup, const float* dout, const float* gate, const float* up, int64_t n) = 0;
  virtual absl::Status DoRmsNormForward(Stream& s, float* out, float* rstd, const float* x, const float* weight, int64_t rows, int64_t cols, float eps) = 0;
  virtual absl::Status DoRmsNormBackward(Stream& s, float* dx, float* dweight, const float* dout, const float* x, const float* weight, const float* rstd, int64_t rows, int64_t cols) = 0;
  virtual absl::Status DoSoftmaxRows(Stream& s, float* y, const float* x, int64_t rows, int64_t cols) = 0;
  virtual absl::Status DoLogSumExpRows(Stream& s, float* out, const float* x, int64_t rows, int64_t cols) = 0;
  virtual absl::Status DoSum(Stream& s, float* out, const float* x, int64_t n) = 0;
  virtual absl::Status DoSumSquares(Stream& s, float* out, const float* x, int64_t n) = 0;
  virtual absl::Status DoAdamW(Stream& s, float* param, const float* grad, float* m, float* v, int64_t n, const AdamWArgs& args) = 0;
  // bf16 mixed: each defaults to UNIMPLEMENTED naming the op and the backend.
  virtual absl::Status DoGemmBf16(Stream& s, const GemmBf16Args& args);
  // The entries with m, n > 0 (validated). Default: DoGemmBf16 on each, in order.
  virtual absl::Status DoGroupedGemmBf16(Stream& s, absl::Span<const GemmBf16Args> gemms);
  virtual absl::Status DoConvertToBf16(Stream& s, Bf16* out, const float* x, int64_t n);
  virtual absl::Status DoConvertToFloat(Stream& s, float* out, const Bf16* x, int64_t n);
  virtual absl::Status DoSwiGluForwardBf16(Stream& s, Bf16* out, const Bf16* gate, const Bf16* up, int64_t n);
  virtual absl::Status DoSwiGluBackwardBf16(Stream& s, Bf16* dgate, Bf16* dup, const Bf16* dout, const Bf16* gate, const Bf16* up, int64_t n);
  virtual absl::Status DoRmsNormForwardBf16(Stream& s, Bf16* out, float* rstd, const Bf16* x, const Bf16* weight, int64_t rows, int64_t cols, float eps);
  virtual absl::Status DoRmsNormBackwardBf16(Stream& s, Bf16* dx, Bf16* dweight, const Bf16* dout, const Bf16* x, const Bf16* weight, const float* rstd, int64_t rows, int64_t cols);
  virtual absl::Status DoAdamWBf16(Stream& s, float* master, const Bf16* grad, float* m, float* v, Bf16* working, int64_t n, const AdamWArgs& args);
  virtual absl::Status DoFillBf16(Stream& s, Bf16* x, int64_t n, float value);
  virtual absl::Status DoAddBf16(Stream& s, Bf16* out, const Bf16* a, const Bf16* b, int64_t n);
  virtual absl::Status DoSumSquaresBf16(Stream& s, float* out, const Bf16* x, int64_t n);
  virtual absl::Status DoSumRowsBf16(Stream& s, Bf16* out, const Bf16* x, int64_t rows, int64_t n, int64_t ld);
  // 1 to kBf16AddRowsPerCall rows, each in [0, max row], n > 0.
  virtual absl::Status DoAddRowsBf16(Stream& s, Bf16* out, const Bf16* x, absl::Span<const int32_t> rows, int64_t ld,
                                     int64_t n);
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_BACKEND_H_
