// ModelKernels on the CPU backend: each op runs the function of attention.h
// or layers.h on the stream's worker thread, in order with the stream's other
// work. These are the references the CUDA kernels are tested against
// (kernels/model/cuda_model_twin_test.cc).
//
// Thread safety: as ModelKernels (no mutable state of its own; the pool is
// safe to share, kernels/cpu_pool.h).
#ifndef PLATEAU_KERNELS_MODEL_CPU_MODEL_KERNELS_H_
#define PLATEAU_KERNELS_MODEL_CPU_MODEL_KERNELS_H_

#include <memory>

#include "kernels/cpu_pool.h"
#include "kernels/model/model_kernels.h"

namespace plateau {

// `pool` is the CPU backend's (CpuBackendPool); the kernels split their work
// over it with a fixed split (same bits for any pool size, or none).
// options.bf16_attention = kTensorCore runs attention_tc.h's reference for
// the bf16 attention block pairs (single-threaded).
std::unique_ptr<ModelKernels> CreateCpuModelKernels(std::shared_ptr<CpuPool> pool = nullptr,
                                                    const ModelKernelsOptions& options = {});

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_CPU_MODEL_KERNELS_H_
