// The SIMT emulation's stand-in for cuBLAS's <cublas_api.h>: the part of
// cuBLAS the CUDA backend calls (kernels/cuda/cuda_backend.cc,
// kernels/cuda/cuda_check.cc), on the CPU (emulated/cublas.cc). Names,
// signatures and enum values are CUDA 12's; the `_v2` aliasing is left out.
//
// What it models:
//   - handles: a stream (the legacy default stream until cublasSetStream),
//     a workspace and a math mode; calls on a destroyed or unknown handle
//     return CUBLAS_STATUS_NOT_INITIALIZED;
//   - cublasGemmEx and cublasGemmGroupedBatchedEx as column-major GEMMs,
//     C = alpha op(A) op(B) + beta C, with CUBLAS_COMPUTE_32F only and the
//     type combinations cuBLAS takes (cublas.cc lists them), host pointer
//     mode (alpha and beta read during the call), argument checks as cuBLAS
//     documents them, and the work put on the handle's stream: it runs when
//     the stream runs (emulation.h), reading A, B, C (and the grouped call's
//     device pointer arrays) then;
//   - the grouped call's bf16 matrices: a pointer (from the device pointer
//     arrays) not 16-byte aligned is a device fault. cuBLAS cannot check
//     these pointers (they are in device memory) and documents alignment
//     rules for them; the emulation asks for 16 bytes always, stricter than
//     the rule (which depends on k), so that code relying on the rule's
//     letter is caught here too;
//   - the arithmetic: each dot product summed exactly enough (in double)
//     and rounded once to fp32, then alpha * sum + beta * C in fp32, a bf16
//     C rounded once more (to nearest even). cuBLAS's own summation order is
//     unknown and varies with the kernel it picks; the twin tests'
//     tolerances cover any order.
// Not modelled: the math mode's effect (TF32 or BF16x9 would round inputs;
// the emulation never does), the workspace's use, device pointer mode,
// timing.
#ifndef PLATEAU_KERNELS_CUDA_EMULATED_CUBLAS_API_H_
#define PLATEAU_KERNELS_CUDA_EMULATED_CUBLAS_API_H_

#include "kernels/cuda/emulated/cuda_runtime_api.h"
#include "kernels/cuda/emulated/library_types.h"

// The cuBLAS release whose API this models (cublasGemmGroupedBatchedEx is
// 12.5's).
#define CUBLAS_VER_MAJOR 12
#define CUBLAS_VER_MINOR 5
#define CUBLAS_VER_PATCH 0
#define CUBLAS_VERSION (CUBLAS_VER_MAJOR * 10000 + CUBLAS_VER_MINOR * 100 + CUBLAS_VER_PATCH)

typedef enum {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_INTERNAL_ERROR = 14,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
  CUBLAS_STATUS_LICENSE_ERROR = 16
} cublasStatus_t;

typedef enum {
  CUBLAS_OP_N = 0,
  CUBLAS_OP_T = 1,
  CUBLAS_OP_C = 2,  // for real types the same as CUBLAS_OP_T
} cublasOperation_t;

typedef enum {
  CUBLAS_GEMM_DFALT = -1,
  CUBLAS_GEMM_DEFAULT = -1,
  CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99,
  CUBLAS_GEMM_DFALT_TENSOR_OP = 99,
} cublasGemmAlgo_t;

typedef enum {
  CUBLAS_DEFAULT_MATH = 0,
  CUBLAS_TENSOR_OP_MATH = 1,
  CUBLAS_PEDANTIC_MATH = 2,
  CUBLAS_TF32_TENSOR_OP_MATH = 3,
  CUBLAS_FP32_EMULATED_BF16X9_MATH = 4,
  CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION = 16,
} cublasMath_t;

typedef enum {
  CUBLAS_COMPUTE_16F = 64,
  CUBLAS_COMPUTE_16F_PEDANTIC = 65,
  CUBLAS_COMPUTE_32F = 68,
  CUBLAS_COMPUTE_32F_PEDANTIC = 69,
  CUBLAS_COMPUTE_32F_FAST_16F = 74,
  CUBLAS_COMPUTE_32F_FAST_16BF = 75,
  CUBLAS_COMPUTE_32F_FAST_TF32 = 77,
  CUBLAS_COMPUTE_64F = 70,
  CUBLAS_COMPUTE_64F_PEDANTIC = 71,
  CUBLAS_COMPUTE_32I = 72,
  CUBLAS_COMPUTE_32I_PEDANTIC = 73,
} cublasComputeType_t;

typedef struct cublasContext* cublasHandle_t;

// On the calling thread's current device (emulation.h's CurrentDevice).
cublasStatus_t cublasCreate(cublasHandle_t* handle);
// Synchronises the handle's device first (all its streams), as cuBLAS
// documents: a host read after cublasDestroy sees the results on a GPU, and
// a destroy waits for every stream's work, collectives included.
cublasStatus_t cublasDestroy(cublasHandle_t handle);
// Also resets the workspace to cuBLAS's own, as cuBLAS does.
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream);
// The workspace must be 256-byte aligned (CUBLAS_STATUS_INVALID_VALUE
// otherwise), as cuBLAS requires; the emulation does not use it.
cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void* workspace,
                                  size_t workspace_size_in_bytes);
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode);

const char* cublasGetStatusName(cublasStatus_t status);
const char* cublasGetStatusString(cublasStatus_t status);

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo);

// group_count groups; group g has group_size[g] problems sharing transa,
// transb, m, n, k, alpha, lda, ldb, beta, ldc (host arrays, one entry per
// group, read during the call). Aarray, Barray and Carray are device arrays
// of one pointer per problem, read when the work runs.
cublasStatus_t cublasGemmGroupedBatchedEx(
    cublasHandle_t handle, const cublasOperation_t transa_array[],
    const cublasOperation_t transb_array[], const int m_array[], const int n_array[],
    const int k_array[], const void* alpha_array, const void* const Aarray[], cudaDataType_t Atype,
    const int lda_array[], const void* const Barray[], cudaDataType_t Btype, const int ldb_array[],
    const void* beta_array, void* const Carray[], cudaDataType_t Ctype, const int ldc_array[],
    int group_count, const int group_size[], cublasComputeType_t computeType);

#endif  // PLATEAU_KERNELS_CUDA_EMULATED_CUBLAS_API_H_
