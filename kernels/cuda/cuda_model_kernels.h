// ModelKernels on the CUDA backend: the ops of cuda_model_ops.h run as CUDA
// kernels on the stream's cudaStream_t (Ring-DTP's strips, the dense
// cross-entropy, the embedding, the dispatch row movement and the rotary
// embedding up to head_dim 1024, the router, the tiled attention block
// pairs), each in fp32 and in bf16 mixed precision (every *Bf16 op of
// ModelKernels); bf16 attention also on tensor cores (cuda_attention_tc.h). A shape a kernel cannot take (rope or attention with too
// large a head_dim) returns UNIMPLEMENTED naming the op. Built only with
// --config=cuda; ModelKernels::Create reaches it for a CUDA backend.
//
// Every pointer an op takes must be device memory of that backend (stats
// too); streams must come from it.
//
// Thread safety: as ModelKernels (no mutable state). Launches go straight
// onto the stream; none of these kernels uses the stream's workspace, so they
// need not take the backend's per-stream launch lock.
#ifndef PLATEAU_KERNELS_CUDA_CUDA_MODEL_KERNELS_H_
#define PLATEAU_KERNELS_CUDA_CUDA_MODEL_KERNELS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/model/model_kernels.h"

namespace plateau {

// INVALID_ARGUMENT unless backend.kind() is kCuda. options.bf16_attention
// picks the bf16 attention kernels (model_kernels.h): under kAuto the
// tensor-core ones (cuda_attention_tc.h) for head_dim 64 and 128.
absl::StatusOr<std::unique_ptr<ModelKernels>> CreateCudaModelKernels(
    Backend& backend, const ModelKernelsOptions& options = {});

}  // namespace plateau

#endif  // PLATEAU_KERNELS_CUDA_CUDA_MODEL_KERNELS_H_
