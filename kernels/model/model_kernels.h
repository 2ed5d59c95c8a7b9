// The model-specific kernels the training step enqueues on streams, beside
// the generic primitives of kernels/backend.h: embedding, rotary embedding,
// tiled attention block pairs, the router and the dense cross-entropy.
//
// Same contract and shape as Backend (the NVI pattern): public calls validate
// their arguments once (INVALID_ARGUMENT naming the argument, nothing
// enqueued), then call the protected Do<Op>, and the work runs asynchronously
// on the stream. The CPU implementation (cpu_model_kernels.h) runs the
// functions of attention.h and layers.h on the stream's thread. The CUDA one
// (kernels/cuda/cuda_model_kernels.h, --config=cuda) has a kernel for every
// op; a shape one cannot take (rope or attention with a head_dim too large for
// its kernel) returns UNIMPLEMENTED naming the op, never a wrong answer.
//
// Thread safety: as Backend; an instance holds no mutable state.
#ifndef PLATEAU_KERNELS_MODEL_MODEL_KERNELS_H_
#define PLATEAU_KERNELS_MODEL_MODEL_KERNELS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/model/attention.h"
#include "kernels/model/precision.h"
#include "kernels/stream.h"

namespace plateau {

struct ModelKernelsOptions {
  // precision.h. kTiles launches no tensor-core kernel, so CUDA then skips
  // deciding about wgmma (its probe and check at creation launch sm_90a
  // kernels; a fault there would fail creation for a job that never needs
  // them). A caller that launches no bf16 attention op (an fp32 step)
  // passes kTiles for that reason.
  Bf16Attention bf16_attention = Bf16Attention::kAuto;
  // CUDA's tensor-core attention kernels (kernels/cuda/cuda_attention_tc.h)
  // double-buffer their streamed tiles where the device's shared memory
  // allows it without fewer resident blocks (ChooseAttentionTcStages);
  // false single-buffers them: the same bits, slower — the baseline
  // attention_bench measures the pipeline against, and what the twin test
  // holds to the same bits on a GPU that would double-buffer. The CPU
  // ignores it.
  bool tc_double_buffer = true;
  // On an H100/H200 (compute capability 9.0) the tensor-core kernels
  // (forward, dQ, dK/dV) run on wgmma (kernels/cuda/cuda_attention_wgmma.h)
  // where, at backend creation, the device's wgmma probe agrees with its
  // reference and the wgmma kernels with the mma.sync ones
  // (kernels/cuda/wgmma_attention_check.h); false keeps them on mma.sync:
  // the baseline attention_bench compares against, held to the same twin
  // by the twin test. The CPU ignores it.
  bool tc_wgmma = true;
};

class ModelKernels {
 public:
  // The implementation for backend.kind(): CPU always; CUDA in a build with
  // --config=cuda (UNIMPLEMENTED otherwise). Defined in kernels/factory (above both implementations).
  static absl::StatusOr<std::unique_ptr<ModelKernels>> Create(
      Backend& backend, const ModelKernelsOptions& options = {});
  virtual ~ModelKernels() = default;

  // The arithmetic the bf16 attention ops run in for this shape (never
  // kAuto): the options' choice, resolved.
  virtual Bf16Attention Bf16AttentionFor(const AttentionShape& shape) const = 0;

  // What the implementation chose at creation that a reader of its figures
  // needs to know ("" when nothing): on CUDA, the tensor-core attention
  // kernels' buffering per head_dim.
  virtual std::string Describe() const { return ""; }

  absl::Status Embedding(Stream& s, const float* table, int64_t vocab,
                         const int32_t* tokens, int64_t rows, int64_t hidden,
                         float* out);
  absl::Status EmbeddingBackward(Stream& s, const float* dout,
                                 const int32_t* tokens, int64_t rows,
                                 int64_t hidden, float* dtable);
  absl::Status Rope(Stream& s, float* x, int64_t batch, int64_t len,
                    int64_t heads, int64_t head_dim, int64_t pos0, float theta,
                    bool inverse);

  absl::Status AttentionInit(Stream& s, const AttentionShape& shape, float* m,
                             float* l, float* acc);
  // `work` holds AttentionWorkspaceFloats(shape) floats.
  absl::Status AttentionForwardBlock(Stream& s, const AttentionShape& shape,
                                     const float* q, const float* k,
                                     const float* v, float* m, float* l,
                                     float* acc, float* work);
  absl::Status AttentionFinalize(Stream& s, const AttentionShape& shape,
                                 const float* m, const float* l,
                                 float* acc_to_o, float* lse);
  absl::Status AttentionDelta(Stream& s, const AttentionShape& shape,
                              const float* o, const float* dout, float* delta);
  absl::Status AttentionBackwardBlock(Stream& s, const AttentionShape& shape,
                                      const float* q, const float* k,
                                      const float* v, const float* dout,
                                      const float* lse, const float* delta,
                                      float* dq, float* dk, float* dv,
                                      float* work);

  absl::Status Router(Stream& s, const float* logits, int64_t rows,
                      int64_t experts, int64_t top_k, float* probs,
                      int32_t* chosen, float* gates);
  absl::Status RouterBackward(Stream& s, const float* probs,
                              const int32_t* chosen, const float* gates,
                              const float* dgates, int64_t rows,
                              int64_t experts, int64_t top_k, float* dlogits);

  // stats[0] += the sum of the valid rows' losses, stats[1] += their count
  // (doubles, so that they can be all-reduced and divided exactly once).
  absl::Status CrossEntropy(Stream& s, const float* logits,
                            const int32_t* targets, int64_t rows,
                            int64_t vocab, float* lse, double* stats);
  absl::Status CrossEntropyBackward(Stream& s, float* logits_to_grad,
                                    const float* lse, const int32_t* targets,
                                    int64_t rows, int64_t vocab, float scale);

  // Dispatch row movement (layers.h); `index`/`pos` are int32 row indices
  // into src, each < src_rows.
  absl::Status GatherRows(Stream& s, const float* src, int64_t src_rows,
                          const int32_t* index, const float* scales,
                          int64_t rows, int64_t width, float* dst);
  // dst[index[i], :] = src[i, :] for i < rows; the indices are distinct and
  // each < dst_rows.
  absl::Status ScatterRows(Stream& s, const float* src, int64_t rows,
                           const int32_t* index, int64_t width, float* dst,
                           int64_t dst_rows);
  absl::Status CombineRows(Stream& s, const float* src, const int32_t* pos,
                           const float* weights, int64_t tokens, int64_t k,
                           int64_t width, float* out);
  absl::Status RowDots(Stream& s, const float* a, const float* b,
                       const int32_t* pos, int64_t tokens, int64_t k,
                       int64_t width, float* out);

  // Ring-DTP strips (layers.h). A state is [m | s | t] for `stride` rows
  // (m at state, s at state + stride, t at state + 2 * stride); a strip of
  // `rows` rows folds into the state's rows starting at `state`.
  absl::Status StripInit(Stream& s, float* state, int64_t rows);
  absl::Status StripFold(Stream& s, const float* logits, int64_t rows,
                         int64_t width, int64_t col0, const int32_t* targets,
                         float* state, int64_t stride);
  // lse from the state; stats[0] += sum of valid losses, stats[1] += count.
  absl::Status StripFinish(Stream& s, const float* state,
                           const int32_t* targets, int64_t rows, float* lse,
                           double* stats);
  absl::Status StripDelta(Stream& s, float* logits_to_delta, int64_t rows,
                          int64_t width, int64_t col0, const int32_t* targets,
                          const float* lse, float scale);

 // --- bf16 mixed precision (kernels/bf16.h; docs/RUNTIME.md) --------------
  // The same ops on bf16 working buffers (fp32 where the plan keeps fp32:
  // gates, RowDots' output): exact loads, fp32 arithmetic as the fp32 op,
  // one rounding per stored bf16 element. Validated as their fp32 twins; the
  // extra row counts (vocab, src_rows, b_rows) say how many rows the op may
  // read, which the CPU emulation loads. UNIMPLEMENTED where a backend has
  // no bf16 version (the CPU and CUDA backends have all of them).
  absl::Status EmbeddingBf16(Stream& s, const Bf16* table, int64_t vocab,
                             const int32_t* tokens, int64_t rows, int64_t hidden, Bf16* out);
  // dtable (vocab x hidden, a bf16 gradient) += the rows' fp32 sums, rounded once.
  absl::Status EmbeddingBackwardBf16(Stream& s, const Bf16* dout, const int32_t* tokens,
                                     int64_t rows, int64_t hidden, Bf16* dtable, int64_t vocab);
  // scales (the router's gates) stay fp32.
  absl::Status GatherRowsBf16(Stream& s, const Bf16* src, int64_t src_rows,
                              const int32_t* index, const float* scales, int64_t rows,
                              int64_t width, Bf16* dst);
  absl::Status ScatterRowsBf16(Stream& s, const Bf16* src, int64_t rows, const int32_t* index,
                               int64_t width, Bf16* dst, int64_t dst_rows);
  // out += sum_j w_j src[pos_j] in fp32 (on the loaded out), rounded once.
  absl::Status CombineRowsBf16(Stream& s, const Bf16* src, int64_t src_rows, const int32_t* pos,
                               const float* weights, int64_t tokens, int64_t k, int64_t width,
                               Bf16* out);
  // out (dgates: fp32) as RowDots on the loaded rows.
  absl::Status RowDotsBf16(Stream& s, const Bf16* a, const Bf16* b, int64_t b_rows,
                           const int32_t* pos, int64_t tokens, int64_t k, int64_t width,
                           float* out);
  // In place on bf16 q or k rows: fp32 rotation of the loaded values, rounded once.
  absl::Status RopeBf16(Stream& s, Bf16* x, int64_t batch, int64_t len, int64_t heads,
                        int64_t head_dim, int64_t pos0, float theta, bool inverse);
  // bf16 logits; lse (fp32) and stats (double) as CrossEntropy.
  absl::Status CrossEntropyBf16(Stream& s, const Bf16* logits, const int32_t* targets,
                                int64_t rows, int64_t vocab, float* lse, double* stats);
  // In place: the bf16 logits become their gradient, rounded once.
  absl::Status CrossEntropyBackwardBf16(Stream& s, Bf16* logits_to_grad, const float* lse,
                                        const int32_t* targets, int64_t rows, int64_t vocab,
                                        float scale);
  // Ring-DTP strips of bf16 logits; the state stays fp32.
  absl::Status StripFoldBf16(Stream& s, const Bf16* logits, int64_t rows, int64_t width,
                             int64_t col0, const int32_t* targets, float* state, int64_t stride);
  absl::Status StripDeltaBf16(Stream& s, Bf16* logits_to_delta, int64_t rows, int64_t width,
                              int64_t col0, const int32_t* targets, const float* lse, float scale);
  // Attention's block pairs on bf16 q, k, v and dO. The online-softmax state
  // (m, l and the running output acc, which AttentionFinalize turns into o
  // in place), lse, delta, the score panel `work` and the dK / dV
  // accumulators that travel the ring stay fp32 (precision.h), and so does
  // dq here: the block's contribution is added to an fp32 dq, which the
  // ring rounds to the working type once, after its last hop (a rounding
  // per block pair would be P roundings of one sum). Each is the fp32 op on
  // the loaded inputs; the fp32 AttentionInit / AttentionFinalize serve
  // both precisions.
  absl::Status AttentionForwardBlockBf16(Stream& s, const AttentionShape& shape, const Bf16* q,
                                         const Bf16* k, const Bf16* v, float* m, float* l,
                                         float* acc, float* work);
  // delta = rowsum(o * dO): the fp32 output o, the bf16 dO.
  absl::Status AttentionDeltaBf16(Stream& s, const AttentionShape& shape, const float* o,
                                  const Bf16* dout, float* delta);
  absl::Status AttentionBackwardBlockBf16(Stream& s, const AttentionShape& shape, const Bf16* q, const Bf16* k,
                                          const Bf16* v, const Bf16* dout, const float* lse, const float* delta,
                                          float* dq, float* dk, float* dv, float* work);

 protected:
  // Implementations: called only after the arguments were validated (and
  // never with rows == 0 / tokens == 0).
  virtual absl::Status DoEmbedding(Stream& s, const float* table, int64_t vocab, const int32_t* tokens, int64_t rows, int64_t hidden, float* out) = 0;
  virtual absl::Status DoEmbeddingBackward(Stream& s, const float* dout, const int32_t* tokens, int64_t rows, int64_t hidden, float* dtable) = 0;
  virtual absl::Status DoRope(Stream& s, float* x, int64_t batch, int64_t len, int64_t heads, int64_t head_dim, int64_t pos0, float theta, bool inverse) = 0;
  virtual absl::Status DoAttentionInit(Stream& s, const AttentionShape& shape, float* m, float* l, float* acc) = 0;
  virtual absl::Status DoAttentionForwardBlock(Stream& s, const AttentionShape& shape, const float* q, const float* k, const float* v, float* m, float* l, float* acc, float* work) = 0;
  virtual absl::Status DoAttentionFinalize(Stream& s, const AttentionShape& shape, const float* m, const float* l, float* acc_to_o, float* lse) = 0;
  virtual absl::Status DoAttentionDelta(Stream& s, const AttentionShape& shape, const float* o, const float* dout, float* delta) = 0;
  virtual absl::Status DoAttentionBackwardBlock(Stream& s, const AttentionShape& shape, const float* q, const float* k, const float* v, const float* dout, const float* lse, const float* delta, float* dq, float* dk, float* dv, float* work) = 0;
  virtual absl::Status DoRouter(Stream& s, const float* logits, int64_t rows, int64_t experts, int64_t top_k, float* probs, int32_t* chosen, float* gates) = 0;
  virtual absl::Status DoRouterBackward(Stream& s, const float* probs, const int32_t* chosen, const float* gates, const float* dgates, int64_t rows, int64_t experts, int64_t top_k, float* dlogits) = 0;
  virtual absl::Status DoCrossEntropy(Stream& s, const float* logits, const int32_t* targets, int64_t rows, int64_t vocab, float* lse, double* stats) = 0;
  virtual absl::Status DoCrossEntropyBackward(Stream& s, float* logits_to_grad, const float* lse, const int32_t* targets, int64_t rows, int64_t vocab, float scale) = 0;
  virtual absl::Status DoGatherRows(Stream& s, const float* src, int64_t src_rows, const int32_t* index, const float* scales, int64_t rows, int64_t width, float* dst) = 0;
  virtual absl::Status DoScatterRows(Stream& s, const float* src, int64_t rows, const int32_t* index, int64_t width, float* dst, int64_t dst_rows) = 0;
  virtual absl::Status DoCombineRows(Stream& s, const float* src, const int32_t* pos, const float* weights, int64_t tokens, int64_t k, int64_t width, float* out) = 0;
  virtual absl::Status DoRowDots(Stream& s, const float* a, const float* b, const int32_t* pos, int64_t tokens, int64_t k, int64_t width, float* out) = 0;
  virtual absl::Status DoStripInit(Stream& s, float* state, int64_t rows) = 0;
  virtual absl::Status DoStripFold(Stream& s, const float* logits, int64_t rows, int64_t width, int64_t col0, const int32_t* targets, float* state, int64_t stride) = 0;
  virtual absl::Status DoStripFinish(Stream& s, const float* state, const int32_t* targets, int64_t rows, float* lse, double* stats) = 0;
  // bf16: each defaults to UNIMPLEMENTED naming the op.
  virtual absl::Status DoEmbeddingBf16(Stream& s, const Bf16* table, int64_t vocab, const int32_t* tokens, int64_t rows, int64_t hidden, Bf16* out);
  virtual absl::Status DoEmbeddingBackwardBf16(Stream& s, const Bf16* dout, const int32_t* tokens, int64_t rows, int64_t hidden, Bf16* dtable, int64_t vocab);
  virtual absl::Status DoGatherRowsBf16(Stream& s, const Bf16* src, int64_t src_rows, const int32_t* index, const float* scales, int64_t rows, int64_t width, Bf16* dst);
  virtual absl::Status DoScatterRowsBf16(Stream& s, const Bf16* src, int64_t rows, const int32_t* index, int64_t width, Bf16* dst, int64_t dst_rows);
  virtual absl::Status DoCombineRowsBf16(Stream& s, const Bf16* src, int64_t src_rows, const int32_t* pos, const float* weights, int64_t tokens, int64_t k, int64_t width, Bf16* out);
  virtual absl::Status DoRowDotsBf16(Stream& s, const Bf16* a, const Bf16* b, int64_t b_rows, const int32_t* pos, int64_t tokens, int64_t k, int64_t width, float* out);
  virtual absl::Status DoRopeBf16(Stream& s, Bf16* x, int64_t batch, int64_t len, int64_t heads, int64_t head_dim, int64_t pos0, float theta, bool inverse);
  virtual absl::Status DoCrossEntropyBf16(Stream& s, const Bf16* logits, const int32_t* targets, int64_t rows, int64_t vocab, float* lse, double* stats);
  virtual absl::Status DoCrossEntropyBackwardBf16(Stream& s, Bf16* logits_to_grad, const float* lse, const int32_t* targets, int64_t rows, int64_t vocab, float scale);
  virtual absl::Status DoStripFoldBf16(Stream& s, const Bf16* logits, int64_t rows, int64_t width, int64_t col0, const int32_t* targets, float* state, int64_t stride);
  virtual absl::Status DoStripDeltaBf16(Stream& s, Bf16* logits_to_delta, int64_t rows, int64_t width, int64_t col0, const int32_t* targets, const float* lse, float scale);
  virtual absl::Status DoAttentionForwardBlockBf16(Stream& s, const AttentionShape& shape, const Bf16* q, const Bf16* k, const Bf16* v, float* m, float* l, float* acc, float* work);
  virtual absl::Status DoAttentionDeltaBf16(Stream& s, const AttentionShape& shape, const float* o, const Bf16* dout, float* delta);
  virtual absl::Status DoAttentionBackwardBlockBf16(Stream& s, const AttentionShape& shape, const Bf16* q,
                                                    const Bf16* k, const Bf16* v, const Bf16* dout, const float* lse,
                                                    const float* delta, float* dq, float* dk, float* dv, float* work);
  virtual absl::Status DoStripDelta(Stream& s, float* logits_to_delta, int64_t rows, int64_t width, int64_t col0, const int32_t* targets, const float* lse, float scale) = 0;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_MODEL_KERNELS_H_
