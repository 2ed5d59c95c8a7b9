// The emulated cuBLAS (cublas_api.h): handles and the two GEMM entry points
// the CUDA backend uses, run on the CPU as work on the handle's stream
// (emulation.h).
//
// The type combinations taken with CUBLAS_COMPUTE_32F are cuBLAS's own, so
// that a call the emulation accepts is one a GPU accepts too:
//   cublasGemmEx:               A = B = fp32, C fp32; A = B = bf16, C bf16 or fp32;
//   cublasGemmGroupedBatchedEx: A = B = C = fp32;    A = B = C = bf16.
// Anything else (another compute type, fp16, mixed A and B) is
// CUBLAS_STATUS_NOT_SUPPORTED: fp16 would be legal on a GPU but nothing here
// uses it, and an fp16 path that was never emulated should not pass silently.
#include "kernels/cuda/emulated/cublas_api.h"

#include <pthread.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kernels/cuda/emulated/emulation.h"

struct cublasContext {
  int device = 0;
  cudaStream_t stream = nullptr;  // the legacy default stream
  void* workspace = nullptr;      // nullptr: cuBLAS's own pool
  size_t workspace_bytes = 0;
  cublasMath_t math_mode = CUBLAS_DEFAULT_MATH;
};

namespace plateau::cuda_emulation {
namespace {

// Live handles: a destroyed or made-up handle is answered with
// CUBLAS_STATUS_NOT_INITIALIZED instead of being dereferenced.
// Held with no other lock, never across a call into the runtime; Handles()
// is first made under it.
std::mutex handles_mu;
std::unordered_set<cublasContext*>& Handles() {
  static auto* handles = new std::unordered_set<cublasContext*>;
  return *handles;
}

// A fork takes handles_mu and both sides release it after, so that a child
// never inherits it held by a thread of its parent's in a cuBLAS call (see
// "Forks" in runtime.cc: held with no other, it cannot deadlock with the
// runtime's and the emulated NCCL's handlers).
void LockBeforeFork() { handles_mu.lock(); }
void UnlockAfterFork() { handles_mu.unlock(); }
// At load, before any thread of the library's callers exists.
const int fork_handlers = pthread_atfork(LockBeforeFork, UnlockAfterFork, UnlockAfterFork);

// A copy of the handle's state, taken under the lock, or false for a handle
// that is not live.
bool Snapshot(cublasHandle_t handle, cublasContext* out) {
  std::lock_guard<std::mutex> lock(handles_mu);
  if (handle == nullptr || Handles().count(handle) == 0) return false;
  *out = *handle;
  return true;
}

bool IsLegacyStream(cudaStream_t stream) { return stream == nullptr || stream == cudaStreamLegacy; }

// A handle belongs to the device current at cublasCreate; its kernels
// cannot be launched on another device's stream (on a GPU the launch fails).
bool StreamOnHandleDevice(const cublasContext& h) {
  if (IsLegacyStream(h.stream)) return true;
  const int device = StreamDevice(h.stream);
  return device < 0 || device == h.device;  // unknown: Enqueue says so
}

bool ValidOp(cublasOperation_t op) {
  return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C;
}

// What one GEMM needs besides its pointers; everything here is read at the
// call (host pointer mode).
struct Shape {
  bool trans_a = false, trans_b = false;  // CUBLAS_OP_T or _C: real types
  int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
  float alpha = 0, beta = 0;
};

// cuBLAS's argument checks: sizes >= 0 and leading dimensions that hold a
// column of the stored matrix (never below 1).
bool ValidShape(cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k, int lda,
                int ldb, int ldc) {
  if (!ValidOp(transa) || !ValidOp(transb)) return false;
  if (m < 0 || n < 0 || k < 0) return false;
  const int rows_a = transa == CUBLAS_OP_N ? m : k;
  const int rows_b = transb == CUBLAS_OP_N ? k : n;
  return lda >= std::max(1, rows_a) && ldb >= std::max(1, rows_b) && ldc >= std::max(1, m);
}

Shape MakeShape(cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k, int lda,
                int ldb, int ldc, float alpha, float beta) {
  return {transa != CUBLAS_OP_N, transb != CUBLAS_OP_N, m, n, k, lda, ldb, ldc, alpha, beta};
}

// Nothing to compute or write: an empty C, or C = 1 * C.
bool IsNoOp(const Shape& s) {
  return s.m == 0 || s.n == 0 || ((s.alpha == 0.0f || s.k == 0) && s.beta == 1.0f);
}

inline float Load(const float* p, int64_t i) { return p[i]; }
inline float Load(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
inline void Store(float* p, int64_t i, float v) { p[i] = v; }
inline void Store(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }

// C = alpha op(A) op(B) + beta C, column-major. Each dot product is summed
// in double, in order of k, and rounded once to fp32; then alpha * dot and
// beta * C are each rounded to fp32 and added in fp32, and a bf16 C is
// rounded once more. cuBLAS's own order (its kernels' tiling, split-K) is
// unknown; the products of fp32 (or bf16) operands are exact in double, so
// this is as close to the exact sum as one fp32 rounding allows, and the
// twin tests' tolerances cover any order a GPU uses. As in the reference
// BLAS, A and B are not read when alpha or k is 0, nor C when beta is 0 (it
// may hold NaN).
//
// The work runs in blocks (kColumns columns of C, kDepth steps of k at a
// time), op(A)'s rows and op(B)'s columns copied contiguously as doubles:
// the dot products then read memory in order whatever the transposes, and
// the copies stay small however large k is (a weight gradient's k is the
// token count).
template <typename In, typename Out>
void RunGemm(const Shape& s, const In* a, const In* b, Out* c) {
  constexpr int64_t kColumns = 64;
  constexpr int64_t kDepth = 256;
  const bool read_ab = s.alpha != 0.0f && s.k > 0;
  std::vector<double> acc, a_rows, b_cols;
  for (int64_t j0 = 0; j0 < s.n; j0 += kColumns) {
    const int64_t nb = std::min(kColumns, s.n - j0);
    acc.assign(static_cast<size_t>(s.m * nb), 0.0);
    for (int64_t l0 = 0; read_ab && l0 < s.k; l0 += kDepth) {
      const int64_t kb = std::min(kDepth, s.k - l0);
      // a_rows[i * kb + l] = op(A)(i, l0 + l); the loops follow A's storage.
      a_rows.resize(static_cast<size_t>(s.m * kb));
      if (s.trans_a) {  // op(A)(i, l) = A[l + i * lda]
        for (int64_t i = 0; i < s.m; ++i) {
          for (int64_t l = 0; l < kb; ++l) a_rows[i * kb + l] = Load(a, (l0 + l) + i * s.lda);
        }
      } else {  // op(A)(i, l) = A[i + l * lda]
        for (int64_t l = 0; l < kb; ++l) {
          for (int64_t i = 0; i < s.m; ++i) a_rows[i * kb + l] = Load(a, i + (l0 + l) * s.lda);
        }
      }
      // b_cols[j * kb + l] = op(B)(l0 + l, j0 + j).
      b_cols.resize(static_cast<size_t>(nb * kb));
      if (s.trans_b) {  // op(B)(l, j) = B[j + l * ldb]
        for (int64_t l = 0; l < kb; ++l) {
          for (int64_t j = 0; j < nb; ++j) {
            b_cols[j * kb + l] = Load(b, (j0 + j) + (l0 + l) * s.ldb);
          }
        }
      } else {  // op(B)(l, j) = B[l + j * ldb]
        for (int64_t j = 0; j < nb; ++j) {
          for (int64_t l = 0; l < kb; ++l) {
            b_cols[j * kb + l] = Load(b, (l0 + l) + (j0 + j) * s.ldb);
          }
        }
      }
      for (int64_t i = 0; i < s.m; ++i) {
        const double* ar = &a_rows[i * kb];
        double* acc_row = &acc[i * nb];
        int64_t j = 0;
        // Four dot products side by side: independent chains for the CPU,
        // each still summed in order of k.
        for (; j + 4 <= nb; j += 4) {
          const double* b0 = &b_cols[j * kb];
          const double* b1 = b0 + kb;
          const double* b2 = b1 + kb;
          const double* b3 = b2 + kb;
          double s0 = acc_row[j], s1 = acc_row[j + 1], s2 = acc_row[j + 2], s3 = acc_row[j + 3];
          for (int64_t l = 0; l < kb; ++l) {
            s0 += ar[l] * b0[l];
            s1 += ar[l] * b1[l];
            s2 += ar[l] * b2[l];
            s3 += ar[l] * b3[l];
          }
          acc_row[j] = s0;
          acc_row[j + 1] = s1;
          acc_row[j + 2] = s2;
          acc_row[j + 3] = s3;
        }
        for (; j < nb; ++j) {
          const double* bj = &b_cols[j * kb];
          double sum = acc_row[j];
          for (int64_t l = 0; l < kb; ++l) sum += ar[l] * bj[l];
          acc_row[j] = sum;
        }
      }
    }
    for (int64_t j = 0; j < nb; ++j) {
      for (int64_t i = 0; i < s.m; ++i) {
        const int64_t at = i + (j0 + j) * s.ldc;
        float value;
        if (!read_ab) {
          // The reference BLAS's alpha == 0 case: C = beta C (0 for beta 0).
          value = s.beta == 0.0f ? 0.0f : s.beta * Load(c, at);
        } else {
          const float dot = static_cast<float>(acc[i * nb + j]);
          const float scaled = s.alpha * dot;
          value = scaled;
          if (s.beta != 0.0f) {
            const float old = s.beta * Load(c, at);
            value = scaled + old;
          }
        }
        Store(c, at, value);
      }
    }
  }
}

// One GEMM with its operand types: the types were checked at the call.
// `what` names the call in a fault's message. False after a fault (a null
// pointer, which on a GPU is an illegal address).
bool RunTypedGemm(const char* what, const Shape& s, cudaDataType ab, cudaDataType c_type,
                  const void* a, const void* b, void* c) {
  if (IsNoOp(s)) return true;
  const bool read_ab = s.alpha != 0.0f && s.k > 0;
  if (read_ab && (a == nullptr || b == nullptr)) {
    Fault(std::string(what) + ": A or B is a null pointer (an illegal address on a GPU)");
    return false;
  }
  if (c == nullptr) {
    Fault(std::string(what) + ": C is a null pointer (an illegal address on a GPU)");
    return false;
  }
  if (ab == CUDA_R_32F) {
    RunGemm(s, static_cast<const float*>(a), static_cast<const float*>(b), static_cast<float*>(c));
  } else if (c_type == CUDA_R_32F) {
    RunGemm(s, static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(b),
            static_cast<float*>(c));
  } else {
    RunGemm(s, static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(b),
            static_cast<__nv_bfloat16*>(c));
  }
  return true;
}

bool GemmExTypesSupported(cudaDataType a, cudaDataType b, cudaDataType c) {
  if (a != b) return false;
  if (a == CUDA_R_32F) return c == CUDA_R_32F;
  if (a == CUDA_R_16BF) return c == CUDA_R_16BF || c == CUDA_R_32F;
  return false;
}

bool GroupedTypesSupported(cudaDataType a, cudaDataType b, cudaDataType c) {
  return a == b && b == c && (a == CUDA_R_32F || a == CUDA_R_16BF);
}

bool ValidAlgo(cublasGemmAlgo_t algo) {
  const int v = static_cast<int>(algo);
  // CUBLAS_GEMM_DEFAULT, CUBLAS_GEMM_ALGO0..23 and their _TENSOR_OP twins
  // (99..115): hints that cuBLAS may ignore, as the emulation does.
  return (v >= -1 && v <= 23) || (v >= 99 && v <= 115);
}

}  // namespace
}  // namespace plateau::cuda_emulation

using plateau::cuda_emulation::Enqueue;
namespace emu = plateau::cuda_emulation;

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  const int device = emu::CurrentDevice();
  if (device < 0) return CUBLAS_STATUS_NOT_INITIALIZED;
  auto* h = new cublasContext;
  h->device = device;
  std::lock_guard<std::mutex> lock(emu::handles_mu);
  emu::Handles().insert(h);
  *handle = h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  int device;
  {
    std::lock_guard<std::mutex> lock(emu::handles_mu);
    if (handle == nullptr || emu::Handles().erase(handle) == 0) {
      return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    device = handle->device;
    delete handle;
  }
  // The enqueued work holds copies of everything it needs, not the handle.
  // cuBLAS documents that cublasDestroy synchronises the device (all of
  // its streams, collectives included), so this waits for the handle's
  // device: a destroy while another stream holds work that cannot finish
  // waits as on a GPU. Errors (a faulted device) are the streams' to
  // report.
  int current = 0;
  (void)cudaGetDevice(&current);
  (void)cudaSetDevice(device);
  (void)cudaDeviceSynchronize();
  (void)cudaSetDevice(current);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(emu::handles_mu);
  if (handle == nullptr || emu::Handles().count(handle) == 0) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  handle->workspace = nullptr;
  handle->workspace_bytes = 0;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void* workspace,
                                  size_t workspace_size_in_bytes) {
  std::lock_guard<std::mutex> lock(emu::handles_mu);
  if (handle == nullptr || emu::Handles().count(handle) == 0) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0) return CUBLAS_STATUS_INVALID_VALUE;
  handle->workspace = workspace;
  handle->workspace_bytes = workspace == nullptr ? 0 : workspace_size_in_bytes;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  std::lock_guard<std::mutex> lock(emu::handles_mu);
  if (handle == nullptr || emu::Handles().count(handle) == 0) return CUBLAS_STATUS_NOT_INITIALIZED;
  // One mode, optionally with the DISALLOW_REDUCED_PRECISION_REDUCTION flag.
  // The mode is kept but changes nothing: the emulation never rounds inputs
  // (TF32, BF16x9) nor keeps partial sums in the output type.
  const int base = static_cast<int>(mode) & ~CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
  if (base != CUBLAS_DEFAULT_MATH && base != CUBLAS_TENSOR_OP_MATH &&
      base != CUBLAS_PEDANTIC_MATH && base != CUBLAS_TF32_TENSOR_OP_MATH &&
      base != CUBLAS_FP32_EMULATED_BF16X9_MATH) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  handle->math_mode = mode;
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "the handle is not initialised (not created, or destroyed)";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "a resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "an invalid value was passed as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "the device lacks a required architectural feature";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "an access to GPU memory failed";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "the GPU program failed to launch or execute";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "the requested functionality is not supported (by the emulated cuBLAS: see "
             "kernels/cuda/emulated/cublas.cc)";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "the requested functionality needs a license";
  }
  return "unknown cuBLAS status";
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo) {
  cublasContext h;
  if (!emu::Snapshot(handle, &h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!emu::ValidShape(transa, transb, m, n, k, lda, ldb, ldc) || alpha == nullptr ||
      beta == nullptr || !emu::ValidAlgo(algo)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (computeType != CUBLAS_COMPUTE_32F || !emu::GemmExTypesSupported(Atype, Btype, Ctype)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  // Host pointer mode: alpha and beta are read now, not when the work runs.
  const emu::Shape shape =
      emu::MakeShape(transa, transb, m, n, k, lda, ldb, ldc, *static_cast<const float*>(alpha),
                     *static_cast<const float*>(beta));
  if (emu::IsNoOp(shape)) return CUBLAS_STATUS_SUCCESS;
  if (!emu::StreamOnHandleDevice(h)) return CUBLAS_STATUS_EXECUTION_FAILED;
  const cudaError_t e = Enqueue(h.stream, [shape, A, B, C, Atype, Ctype] {
    (void)emu::RunTypedGemm("cublasGemmEx", shape, Atype, Ctype, A, B, C);
  });
  return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

cublasStatus_t cublasGemmGroupedBatchedEx(
    cublasHandle_t handle, const cublasOperation_t transa_array[],
    const cublasOperation_t transb_array[], const int m_array[], const int n_array[],
    const int k_array[], const void* alpha_array, const void* const Aarray[], cudaDataType_t Atype,
    const int lda_array[], const void* const Barray[], cudaDataType_t Btype, const int ldb_array[],
    const void* beta_array, void* const Carray[], cudaDataType_t Ctype, const int ldc_array[],
    int group_count, const int group_size[], cublasComputeType_t computeType) {
  cublasContext h;
  if (!emu::Snapshot(handle, &h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (group_count < 0) return CUBLAS_STATUS_INVALID_VALUE;
  if (computeType != CUBLAS_COMPUTE_32F || !emu::GroupedTypesSupported(Atype, Btype, Ctype)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (group_count == 0) return CUBLAS_STATUS_SUCCESS;
  // On a GPU a null host array would crash the call; here it is an argument
  // error.
  if (transa_array == nullptr || transb_array == nullptr || m_array == nullptr ||
      n_array == nullptr || k_array == nullptr || alpha_array == nullptr || lda_array == nullptr ||
      ldb_array == nullptr || beta_array == nullptr || ldc_array == nullptr ||
      group_size == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  // The host arrays (alpha and beta too: host pointer mode) are copied now;
  // the caller may reuse them as soon as the call returns.
  const float* alphas = static_cast<const float*>(alpha_array);
  const float* betas = static_cast<const float*>(beta_array);
  std::vector<std::pair<emu::Shape, int64_t>> groups;  // shape, problems
  groups.reserve(static_cast<size_t>(group_count));
  bool any_work = false;
  for (int g = 0; g < group_count; ++g) {
    if (group_size[g] < 0 ||
        !emu::ValidShape(transa_array[g], transb_array[g], m_array[g], n_array[g], k_array[g],
                         lda_array[g], ldb_array[g], ldc_array[g])) {
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    groups.emplace_back(
        emu::MakeShape(transa_array[g], transb_array[g], m_array[g], n_array[g], k_array[g],
                       lda_array[g], ldb_array[g], ldc_array[g], alphas[g], betas[g]),
        group_size[g]);
    any_work = any_work || (group_size[g] > 0 && !emu::IsNoOp(groups.back().first));
  }
  if (!any_work) return CUBLAS_STATUS_SUCCESS;
  if (!emu::StreamOnHandleDevice(h)) return CUBLAS_STATUS_EXECUTION_FAILED;
  // The pointer arrays are device memory, typically written by a kernel
  // enqueued just before on this stream: they are read when the work runs.
  const cudaError_t e =
      Enqueue(h.stream, [groups = std::move(groups), Aarray, Barray, Carray, Atype, Ctype] {
        if (Aarray == nullptr || Barray == nullptr || Carray == nullptr) {
          emu::Fault(
              "cublasGemmGroupedBatchedEx: a pointer array is a null pointer (an "
              "illegal address on a GPU)");
          return;
        }
        int64_t at = 0;
        for (const auto& [shape, count] : groups) {
          for (int64_t p = 0; p < count; ++p, ++at) {
            // cublas_api.h: bf16 matrices 16-byte aligned (stricter than
            // cuBLAS's documented rule; a misaligned address on a GPU).
            const uintptr_t any = reinterpret_cast<uintptr_t>(Aarray[at]) |
                                  reinterpret_cast<uintptr_t>(Barray[at]) |
                                  reinterpret_cast<uintptr_t>(Carray[at]);
            if (Atype == CUDA_R_16BF && any % 16 != 0) {
              emu::Fault("cublasGemmGroupedBatchedEx: GEMM " + std::to_string(at) +
                         " has a bf16 matrix not 16-byte aligned (a misaligned address on a GPU)");
              return;
            }
            if (!emu::RunTypedGemm("cublasGemmGroupedBatchedEx", shape, Atype, Ctype, Aarray[at],
                                   Barray[at], Carray[at])) {
              return;  // the device has faulted: nothing more runs
            }
          }
        }
      });
  return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}
