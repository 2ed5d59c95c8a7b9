// The model's small layers on the CPU, as plain synchronous functions over
// row-major fp32 buffers: token embedding, the router (softmax, top-k,
// renormalise) and the dense cross-entropy of the projection baseline.
// Attention is in attention.h; GEMMs, RMSNorm and SwiGLU are backend
// primitives (kernels/backend.h). Every function is deterministic.
//
// `pool` (the CPU backend's, kernels/cpu_pool.h): rows, or for the
// reductions over rows (EmbeddingBackward) columns, are split into tasks by
// the problem's size only, so the result is the same bits without a pool and
// for any pool size. The exponentials use the vectorised exp of
// kernels/cpu_exp.h (within 2 ulps of std::exp).
#ifndef PLATEAU_KERNELS_MODEL_LAYERS_H_
#define PLATEAU_KERNELS_MODEL_LAYERS_H_

#include <cstdint>

#include "kernels/cpu_pool.h"

namespace plateau {

// out[r, :] = table[tokens[r], :]. Token ids must be in [0, vocab).
void EmbeddingForward(const float* table, const int32_t* tokens, int64_t rows,
                      int64_t hidden, float* out,
    CpuPool* pool = nullptr);
// dtable[tokens[r], :] += dout[r, :], in row order.
void EmbeddingBackward(const float* dout, const int32_t* tokens, int64_t rows,
                       int64_t hidden, float* dtable,
    CpuPool* pool = nullptr);

// Router forward from the router logits [rows, experts]: probs = softmax
// (kept for backward), the top_k experts by probability (ties to the lower
// index) in descending order, and their renormalised gates.
void RouterForward(const float* logits, int64_t rows, int64_t experts,
                   int64_t top_k, float* probs, int32_t* chosen, float* gates,
    CpuPool* pool = nullptr);
// d logits from d gates, through the renormalisation and the softmax. The
// top-k selection itself has no gradient.
void RouterBackward(const float* probs, const int32_t* chosen,
                    const float* gates, const float* dgates, int64_t rows,
                    int64_t experts, int64_t top_k, float* dlogits,
    CpuPool* pool = nullptr);

// Dense cross-entropy over full logits [rows, vocab]: per row
// loss = lse - logit[target] (0 for ignored rows, which get lse = 0 too).
// Returns the sum of the row losses in double, accumulated in row order, and
// the number of valid rows through `valid`.
double CrossEntropyForward(const float* logits, const int32_t* targets,
                           int64_t rows, int64_t vocab, float* lse,
                           int64_t* valid,
    CpuPool* pool = nullptr);
// In place: logits become d loss / d logits = (softmax - onehot) * scale for
// valid rows, 0 for ignored ones (scale = 1 / valid tokens of the global
// batch, for a mean loss).
void CrossEntropyBackward(float* logits_to_grad, const float* lse,
                          const int32_t* targets, int64_t rows, int64_t vocab,
                          float scale,
    CpuPool* pool = nullptr);

// Row movement for expert dispatch (rows of `width` floats):
// dst[i, :] = scale_i * src[index[i], :] with scale_i = scales ? scales[i] : 1.
void GatherRows(const float* src, const int32_t* index, const float* scales,
                int64_t rows, int64_t width, float* dst,
    CpuPool* pool = nullptr);
// dst[index[i], :] = src[i, :]: the inverse of GatherRows without scales,
// for a chunk of rows that is not contiguous in dst (PipelinedLLEP's strided
// chunks). The indices are distinct.
void ScatterRows(const float* src, int64_t rows, const int32_t* index,
                 int64_t width, float* dst,
    CpuPool* pool = nullptr);
// out[t, :] += sum_{j < k} w_{t,j} * src[pos[t*k + j], :] with
// w = weights ? weights[t*k + j] : 1, summed in j order.
void CombineRows(const float* src, const int32_t* pos, const float* weights,
                 int64_t tokens, int64_t k, int64_t width, float* out,
    CpuPool* pool = nullptr);
// out[t*k + j] = <a[t, :], b[pos[t*k + j], :]> (accumulated in double).
void RowDots(const float* a, const float* b, const int32_t* pos, int64_t tokens,
             int64_t k, int64_t width, float* out,
    CpuPool* pool = nullptr);

// Ring-DTP's strip kernels (kernels/projection/ring_dtp.h). A strip holds
// the logits of `rows` tokens for `width` consecutive vocabulary ids starting
// at `col0`. Rows whose target is kIgnoreIndex are skipped.
//
// Folds a strip into the running per-token state (max m, sum s of exp(x - m),
// target logit t): the online log-sum-exp, in fp32, strips in call order.
void StripFold(const float* logits, int64_t rows, int64_t width, int64_t col0,
               const int32_t* targets, float* m, float* s, float* t,
    CpuPool* pool = nullptr);
// lse = m + log(s); returns the sum of (lse - t) over valid rows (double,
// row order) and their count through `valid`; ignored rows get lse = 0.
double StripFinish(const float* m, const float* s, const float* t,
                   const int32_t* targets, int64_t rows, float* lse,
                   int64_t* valid);
// In place: logits become scale * (softmax - onehot) for valid rows (the
// softmax from the final lse), 0 for ignored rows.
void StripDelta(float* logits_to_delta, int64_t rows, int64_t width,
                int64_t col0, const int32_t* targets, const float* lse,
                float scale,
    CpuPool* pool = nullptr);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_LAYERS_H_
