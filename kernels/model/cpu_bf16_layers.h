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
#include "kernels/model/attention_shape.h"

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

void RopeBf16(Bf16* x, int64_t batch, int64_t len, int64_t heads, int64_t head_dim, int64_t pos0,
              float theta, bool inverse, CpuPool* pool = nullptr);
// Returns the sum of the valid rows' losses (double) and their count, as
// CrossEntropyForward.
double CrossEntropyForwardBf16(const Bf16* logits, const int32_t* targets, int64_t rows,
                               int64_t vocab, float* lse, int64_t* valid, CpuPool* pool = nullptr);
void CrossEntropyBackwardBf16(Bf16* logits_to_grad, const float* lse, const int32_t* targets,
                              int64_t rows, int64_t vocab, float scale, CpuPool* pool = nullptr);
void StripFoldBf16(const Bf16* logits, int64_t rows, int64_t width, int64_t col0,
                   const int32_t* targets, float* m, float* s, float* t, CpuPool* pool = nullptr);
void StripDeltaBf16(Bf16* logits_to_delta, int64_t rows, int64_t width, int64_t col0,
                    const int32_t* targets, const float* lse, float scale, CpuPool* pool = nullptr);

// Attention's block pairs (attention.h) on bf16 q, k, v, dO with fp32
// state and an fp32 dq (rounded by the caller once all blocks are in): the
// fp32 functions on the loaded inputs.
void AttentionForwardBlockBf16(const AttentionShape& s, const Bf16* q, const Bf16* k,
                               const Bf16* v, float* m, float* l, float* acc, float* work,
                               CpuPool* pool = nullptr);
void AttentionDeltaBf16(const AttentionShape& s, const float* o, const Bf16* dout, float* delta,
                        CpuPool* pool = nullptr);
void AttentionBackwardBlockBf16(const AttentionShape& s, const Bf16* q, const Bf16* k, const Bf16* v, const Bf16* dout,
                                const float* lse, const float* delta, float* dq, float* dk, float* dv, float* work,
                                CpuPool* pool = nullptr);

}  // namespace plateau::cpu

#endif  // PLATEAU_KERNELS_MODEL_CPU_BF16_LAYERS_H_
