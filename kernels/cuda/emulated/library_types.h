// The SIMT emulation's stand-in for CUDA's <library_types.h>: the data type
// tags the emulated cuBLAS (cublas_api.h) takes. The values are the
// toolkit's, so that a tag printed or stored by the emulated build means the
// same as on a GPU.
#ifndef PLATEAU_KERNELS_CUDA_EMULATED_LIBRARY_TYPES_H_
#define PLATEAU_KERNELS_CUDA_EMULATED_LIBRARY_TYPES_H_

typedef enum cudaDataType_t {
  CUDA_R_32F = 0,
  CUDA_R_64F = 1,
  CUDA_R_16F = 2,
  CUDA_R_8I = 3,
  CUDA_R_32I = 10,
  CUDA_R_16BF = 14,
} cudaDataType;

#endif  // PLATEAU_KERNELS_CUDA_EMULATED_LIBRARY_TYPES_H_
