// The SIMT emulation's stand-in for cuBLAS's <cublas_v2.h>: everything is
// in cublas_api.h (the real header's `_v2` renaming is not needed here).
#ifndef PLATEAU_KERNELS_CUDA_EMULATED_CUBLAS_V2_H_
#define PLATEAU_KERNELS_CUDA_EMULATED_CUBLAS_V2_H_

#include "kernels/cuda/emulated/cublas_api.h"

#endif  // PLATEAU_KERNELS_CUDA_EMULATED_CUBLAS_V2_H_
