// ModelKernels on the CPU backend: each op runs the function of attention.h
// or layers.h on the stream's worker thread, in order with the stream's other
// work. These are the references the CUDA kernels are tested against
// (kernels/model/cuda_model_twin_test.cc).
//
// Thread safety: as ModelKernels (no mutable state).
#ifndef PLATEAU_KERNELS_MODEL_CPU_MODEL_KERNELS_H_
#define PLATEAU_KERNELS_MODEL_CPU_MODEL_KERNELS_H_

#include <memory>

#include "kernels/model/model_kernels.h"

namespace plateau {

std::unique_ptr<ModelKernels> CreateCpuModelKernels();

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_CPU_MODEL_KERNELS_H_
