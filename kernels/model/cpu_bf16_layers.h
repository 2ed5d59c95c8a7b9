// The CPU emulation of the model kernels' bf16 ops (ModelKernels::*Bf16):
// each is the fp32 function of layers.h on the exactly loaded inputs, its
// bf16 outputs rounded once per element (kernels/cpu_bf16_ops.h explains the
// scheme and its per-thread scratch). Row movement that does no arithmetic
// (embedding, scatter) copies the bf16 bits, which is the same thing.
//
// Arguments are assumed validated (model_kernels.cc).
#ifndef PLATEAU_KERNELS_MODEL_CPU_BF16_LAYERS_H_
#define PLATEAU_KERNELS_MODEL_CPU_BF16_LAYERS_H_

#include <cstdint>

#include "kernels/bf16.h"
#include "kernels/cpu_pool.h"

namespace plateau::cpu {

void EmbeddingForwardBf16(const Bf16* table, const int32_t* tokens, int64_t rows, int64_t hidden,
                          Bf16* out, CpuPool* pool = nullptr);
void EmbeddingBackwardBf16(const Bf16* dout, const int32_t* tokens, int64_t rows, int64_t hidden,
                           Bf16* dtable, int64_t vocab, CpuPool* pool = nullptr);
void GatherRowsBf16(const Bf16* src, int64_t src_rows, const int32_t* index, const float* scales,
                    int64_t rows, int64_t width, Bf16* dst, CpuPool* pool = nullptr);
void ScatterRowsBf16(const Bf16* src, int64_t rows, const int32_t* index, int64_t width, Bf16* dst,
                     CpuPool* pool = nullptr);
void CombineRowsBf16(const Bf16* src, int64_t src_rows, const int32_t* pos, const float* weights,
                     int64_t tokens, int64_t k, int64_t width, Bf16* out, CpuPool* pool = nullptr);
void RowDotsBf16(const Bf16* a, const Bf16* b, int64_t b_rows, const int32_t* pos, int64_t tokens,
                 int64_t k, int64_t width, float* out, CpuPool* pool = nullptr);

}  // namespace plateau::cpu

#endif  // PLATEAU_KERNELS_MODEL_CPU_BF16_LAYERS_H_
