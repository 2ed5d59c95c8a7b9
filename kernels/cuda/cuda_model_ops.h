// CUDA kernels for the model kernels (kernels/model/model_kernels.h), one
// launcher per op, fp32 and bf16 mixed precision. So far: Ring-DTP's strips (StripInit, StripFold,
// StripFinish, StripDelta), the dense cross-entropy and its backward, the
// embedding and its backward, the dispatch row movement (GatherRows,
// ScatterRows, CombineRows, RowDots), the rotary embedding, the router and
// attention (forward and backward block pairs). The semantics are those of the CPU functions in
// kernels/model/layers.h and attention.h, the references these are tested against
// (kernels/model/cuda_model_twin_test.cc).
//
// Arguments are assumed validated (ModelKernels' public methods do that) and
// rows/tokens > 0. All pointers are device memory, including `stats`. Each
// launcher enqueues on `stream` and returns cudaGetLastError().
//
// Determinism: no atomics. Per-row reductions run one block per row and
// combine per-thread partials in a fixed tree; the loss sums of StripFinish
// and CrossEntropy run in one block over the rows in a fixed assignment and a
// fixed tree; EmbeddingBackward gives each table row to the block of its
// token's first row, which adds the token's rows in row order (the CPU order,
// so it agrees with the CPU bitwise).
// The same inputs give the same bits run to run on the same GPU model.
//
// Plain C++ header (no CUDA extensions): the host compiler includes it.
#ifndef PLATEAU_KERNELS_CUDA_CUDA_MODEL_OPS_H_
#define PLATEAU_KERNELS_CUDA_CUDA_MODEL_OPS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace plateau::cuda_model_ops {

// state[0, rows) = -inf (m); state[rows, 3 * rows) = 0 (s and t).
// Loads every kernel of this library on the current device (see
// cuda_ops::CheckKernelImage: no lazy load mid-step); the first error.
cudaError_t LoadKernels();

cudaError_t StripInit(cudaStream_t stream, float* state, int64_t rows);
// Per row r (targets[r] != kIgnoreIndex): mnew = max(m, max_c x), s = s *
// exp(m - mnew) + sum_c exp(x - mnew), m = mnew, t = x[target - col0] when
// the target lies in [col0, col0 + width). m, s, t are state, state + stride,
// state + 2 * stride.
cudaError_t StripFold(cudaStream_t stream, const float* logits, int64_t rows,
                      int64_t width, int64_t col0, const int32_t* targets,
                      float* state, int64_t stride);
// lse = m + log(s) (0 for ignored rows); stats[0] += sum over valid rows of
// (double)(lse - t), stats[1] += their count.
cudaError_t StripFinish(cudaStream_t stream, const float* state,
                        const int32_t* targets, int64_t rows, float* lse,
                        double* stats);
// x = exp(x - lse) * scale, minus scale at the target; 0 for ignored rows.
cudaError_t StripDelta(cudaStream_t stream, float* logits_to_delta,
                       int64_t rows, int64_t width, int64_t col0,
                       const int32_t* targets, const float* lse, float scale);

cudaError_t CrossEntropy(cudaStream_t stream, const float* logits,
                         const int32_t* targets, int64_t rows, int64_t vocab,
                         float* lse, double* stats);
cudaError_t CrossEntropyBackward(cudaStream_t stream, float* logits_to_grad,
                                 const float* lse, const int32_t* targets,
                                 int64_t rows, int64_t vocab, float scale);

cudaError_t Embedding(cudaStream_t stream, const float* table,
                      const int32_t* tokens, int64_t rows, int64_t hidden,
                      float* out);
// dtable[token] += the rows with that token, in row order (the CPU's adds,
// bit for bit); untouched table rows are not written. The bf16 version's
// kernel (below; cuda_model_ops.cu gives the cost) with T = float: one block
// per row, the block of a token's first occurrence owning its table row.
cudaError_t EmbeddingBackward(cudaStream_t stream, const float* dout,
                              const int32_t* tokens, int64_t rows,
                              int64_t hidden, float* dtable);

cudaError_t GatherRows(cudaStream_t stream, const float* src,
                       const int32_t* index, const float* scales, int64_t rows,
                       int64_t width, float* dst);
cudaError_t ScatterRows(cudaStream_t stream, const float* src, int64_t rows,
                        const int32_t* index, int64_t width, float* dst);
cudaError_t CombineRows(cudaStream_t stream, const float* src,
                        const int32_t* pos, const float* weights,
                        int64_t tokens, int64_t k, int64_t width, float* out);
cudaError_t RowDots(cudaStream_t stream, const float* a, const float* b,
                    const int32_t* pos, int64_t tokens, int64_t k,
                    int64_t width, float* out);

// bf16 mixed precision (uint16_t* = kernels/bf16.h's Bf16 bits): the same
// kernels templated on the element type; exact loads, the fp32 expressions,
// one __float2bfloat16_rn per stored element (CombineRows sums in an fp32
// register); scales, weights and RowDots' out stay fp32.
cudaError_t EmbeddingBf16(cudaStream_t stream, const uint16_t* table, const int32_t* tokens,
                          int64_t rows, int64_t hidden, uint16_t* out);
// dtable[token] = its loaded value plus the fp32 sum, in row order, of the
// rows with that token, rounded once; untouched table rows are not written.
// The CPU twin's value bit for bit. One block per row; the block of a
// token's first occurrence owns its table row (no atomics, no scratch) and
// finds its rows by block-wide scans of the tokens (cuda_model_ops.cu gives
// the cost).
cudaError_t EmbeddingBackwardBf16(cudaStream_t stream, const uint16_t* dout,
                                  const int32_t* tokens, int64_t rows, int64_t hidden,
                                  uint16_t* dtable);
cudaError_t GatherRowsBf16(cudaStream_t stream, const uint16_t* src, const int32_t* index,
                           const float* scales, int64_t rows, int64_t width, uint16_t* dst);
cudaError_t ScatterRowsBf16(cudaStream_t stream, const uint16_t* src, int64_t rows,
                            const int32_t* index, int64_t width, uint16_t* dst);
cudaError_t CombineRowsBf16(cudaStream_t stream, const uint16_t* src, const int32_t* pos,
                            const float* weights, int64_t tokens, int64_t k, int64_t width,
                            uint16_t* out);
cudaError_t StripFoldBf16(cudaStream_t stream, const uint16_t* logits, int64_t rows,
                          int64_t width, int64_t col0, const int32_t* targets, float* state,
                          int64_t stride);
cudaError_t StripDeltaBf16(cudaStream_t stream, uint16_t* logits_to_delta, int64_t rows,
                           int64_t width, int64_t col0, const int32_t* targets, const float* lse,
                           float scale);
cudaError_t CrossEntropyBf16(cudaStream_t stream, const uint16_t* logits, const int32_t* targets,
                             int64_t rows, int64_t vocab, float* lse, double* stats);
cudaError_t CrossEntropyBackwardBf16(cudaStream_t stream, uint16_t* logits_to_grad,
                                     const float* lse, const int32_t* targets, int64_t rows,
                                     int64_t vocab, float scale);
cudaError_t RowDotsBf16(cudaStream_t stream, const uint16_t* a, const uint16_t* b,
                        const int32_t* pos, int64_t tokens, int64_t k, int64_t width,
                        float* out);

// The router, one thread per row (experts is small): softmax, top_k in
// descending probability with ties to the lower expert (the CPU's stable
// order), gates renormalised over the chosen; the same fp32 operations in the
// same order as the CPU, only expf differs.
cudaError_t Router(cudaStream_t stream, const float* logits, int64_t rows,
                   int64_t experts, int64_t top_k, float* probs,
                   int32_t* chosen, float* gates);
// One thread per row; dlogits doubles as the row's dp scratch.
cudaError_t RouterBackward(cudaStream_t stream, const float* probs,
                           const int32_t* chosen, const float* gates,
                           const float* dgates, int64_t rows, int64_t experts,
                           int64_t top_k, float* dlogits);

// The rotary embedding's frequencies, computed on the host exactly as the CPU
// (std::pow), travel in the launch's parameters: the GPU then forms the same
// fp32 angles, and only sinf/cosf differ from the host's. head_dim up to
// 2 * kMaxRopeHalf (UNIMPLEMENTED above, in cuda_model_kernels.cc).
inline constexpr int kMaxRopeHalf = 512;
struct RopeFreqs {
  float freq[kMaxRopeHalf];
};
cudaError_t Rope(cudaStream_t stream, float* x, int64_t batch, int64_t len,
                 int64_t heads, int64_t head_dim, int64_t pos0,
                 const RopeFreqs& freqs, bool inverse);
// bf16 (as the bf16 row ops above): in place, rounded once per element.
cudaError_t RopeBf16(cudaStream_t stream, uint16_t* x, int64_t batch, int64_t len, int64_t heads,
                     int64_t head_dim, int64_t pos0, const RopeFreqs& freqs, bool inverse);

// Attention (kernels/model/attention.h): the CPU's block-pair interface with
// its layouts and its running state (m, l, acc in the caller's buffers), as
// tiled kernels. AttentionDims mirrors AttentionShape (nvcc does not include
// kernels/model headers).
struct AttentionDims {
  int64_t batch, q_len, kv_len, heads, kv_heads, head_dim, q_pos0, kv_pos0;
  float scale;
};
// The square tile (query rows = key rows per tile) the attention kernels use
// for this head_dim, in both precisions: the largest power of two <= 32
// whose tiles fit 48 KiB of shared memory (no opt-in needed); 0 when not even a
// 1-row tile fits (head_dim above ~3000), which the caller reports as
// UNIMPLEMENTED.
int AttentionTile(int64_t head_dim);
// m = -inf, l = 0, acc = 0.
cudaError_t AttentionInit(cudaStream_t stream, const AttentionDims& s,
                          float* m, float* l, float* acc);
// Folds the K/V block into (m, l, acc): one block of threads per (sequence,
// head, query tile); K/V tiles pass through shared memory in key order, the
// scores of one tile x tile exist only in shared memory. No scratch beyond
// the state.
cudaError_t AttentionForwardBlock(cudaStream_t stream, const AttentionDims& s,
                                  const float* q, const float* k,
                                  const float* v, float* m, float* l,
                                  float* acc);
// o = acc / l, lse = m + log(l); o = 0 and lse = -inf where l = 0.
cudaError_t AttentionFinalize(cudaStream_t stream, const AttentionDims& s,
                              const float* m, const float* l, float* acc_to_o,
                              float* lse);
// delta = sum_c o * dout per row, in c order (the CPU's loop, bitwise).
cudaError_t AttentionDelta(cudaStream_t stream, const AttentionDims& s,
                           const float* o, const float* dout, float* delta);
// dq += this block pair's dQ; dk, dv += its dK, dV. Two kernels, no atomics:
// one block per (sequence, head, query tile) owns its dq rows; one block per
// (sequence, K/V head, key tile) owns its dk/dv rows and walks the group's
// query heads and the query tiles in a fixed order. Each recomputes the
// probabilities it needs, so the results are the same bits run to run.
cudaError_t AttentionBackwardBlock(cudaStream_t stream, const AttentionDims& s,
                                   const float* q, const float* k,
                                   const float* v, const float* dout,
                                   const float* lse, const float* delta,
                                   float* dq, float* dk, float* dv);

// bf16 mixed precision: the same kernels on bf16 q, k, v and dout, loaded
// exactly into the fp32 shared-memory tiles, so every product, sum, expf
// and rescale is the fp32 kernel's on the loaded values (same tile, same
// order). What the plan keeps fp32 stays fp32: m, l, acc (-> o), lse,
// delta, dk, dv, and dq: ring attention sums it across the hops in fp32
// and rounds it to bf16 once, after the last. So, bit for bit: the forward
// state, delta, dq, dk and dv equal the fp32 kernels' on the loaded inputs.
cudaError_t AttentionForwardBlockBf16(cudaStream_t stream, const AttentionDims& s,
                                      const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                      float* m, float* l, float* acc);
cudaError_t AttentionDeltaBf16(cudaStream_t stream, const AttentionDims& s, const float* o,
                               const uint16_t* dout, float* delta);
cudaError_t AttentionBackwardBlockBf16(cudaStream_t stream, const AttentionDims& s, const uint16_t* q,
                                       const uint16_t* k, const uint16_t* v, const uint16_t* dout, const float* lse,
                                       const float* delta, float* dq, float* dk, float* dv);

}  // namespace plateau::cuda_model_ops

#endif  // PLATEAU_KERNELS_CUDA_CUDA_MODEL_OPS_H_
