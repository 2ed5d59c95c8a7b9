// The ops of the step and its schedules on the working precision W (float
// for fp32, Bf16 for bf16 mixed; kernels/model/precision.h), so that one
// template body serves both (docs/RUNTIME.md, "bf16 mixed precision"):
// WorkingOps<float> forwards each call to the fp32 op of Backend /
// ModelKernels, argument for argument, so an fp32 instantiation is today's
// code bit for bit; WorkingOps<Bf16> forwards to the bf16 twin (exact
// loads, fp32 arithmetic, one rounding per stored bf16 element). What the
// plan keeps fp32 (precision.h: rstd, the online-softmax state and the
// running attention output, lse, delta, the travelling dK / dV, the
// router's logits, probabilities and gates, the norms) is `float` in both.
//
// Only the calls whose element type differs between the precisions are
// here; the fp32-only ops (AttentionInit / Finalize, Router, StripInit /
// Finish) are called directly.
//
// Thread safety: stateless; as the ops it calls.
#ifndef PLATEAU_KERNELS_MODEL_WORKING_OPS_H_
#define PLATEAU_KERNELS_MODEL_WORKING_OPS_H_

#include <cstdint>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/model/model_kernels.h"
#include "kernels/model/precision.h"

namespace plateau {

// One GEMM's shape on the working type: C (W, or fp32 for CAcc) =
// alpha op(A) op(B) + beta C with A, B of type W.
template <typename W, typename C = W>
struct WorkingGemm {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  float alpha = 1.0f;
  const W* a = nullptr;
  int64_t lda = 0;
  const W* b = nullptr;
  int64_t ldb = 0;
  float beta = 0.0f;
  C* c = nullptr;
  int64_t ldc = 0;
};

template <typename W>
struct WorkingOps;

template <>
struct WorkingOps<float> {
  using T = float;
  static constexpr Precision kPrecision = Precision::kFp32;

  static absl::Status Gemm(Backend& be, Stream& s, const WorkingGemm<float>& g) {
    return be.Gemm(s, {g.trans_a, g.trans_b, g.m, g.n, g.k, g.alpha, g.a, g.lda, g.b, g.ldb,
                       g.beta, g.c, g.ldc});
  }
  // C in fp32 (the router's logits): the same GEMM in fp32.
  static absl::Status GemmAccum(Backend& be, Stream& s, const WorkingGemm<float, float>& g) {
    return Gemm(be, s, g);
  }
  // The expert groups' GEMMs (Backend::GroupedGemm's rules).
  static absl::Status GroupedGemm(Backend& be, Stream& s, absl::Span<const WorkingGemm<float>> gs) {
    std::vector<GemmArgs> args;
    args.reserve(gs.size());
    for (const WorkingGemm<float>& g : gs) {
      args.push_back({g.trans_a, g.trans_b, g.m, g.n, g.k, g.alpha, g.a, g.lda, g.b, g.ldb, g.beta, g.c, g.ldc});
    }
    return be.GroupedGemm(s, args);
  }
  // Grouped GEMMs into fp32 C (accumulators the plan keeps fp32): in fp32,
  // GroupedGemm itself.
  static absl::Status GroupedGemmAccum(Backend& be, Stream& s, absl::Span<const WorkingGemm<float, float>> gs) {
    return GroupedGemm(be, s, gs);
  }
  static absl::Status Fill(Backend& be, Stream& s, float* x, int64_t n, float value) {
    return be.Fill(s, x, n, value);
  }
  static absl::Status Add(Backend& be, Stream& s, float* out, const float* a, const float* b,
                          int64_t n) {
    return be.Add(s, out, a, b, n);
  }
  static absl::Status SumSquares(Backend& be, Stream& s, float* out, const float* x, int64_t n) {
    return be.SumSquares(s, out, x, n);
  }
  // x (fp32) into the working type, and back: copies in fp32.
  static absl::Status FromFloat(Backend& be, Stream& s, float* out, const float* x, int64_t n) {
    return be.Copy(s, out, x, n * sizeof(float));
  }
  static absl::Status ToFloat(Backend& be, Stream& s, float* out, const float* x, int64_t n) {
    return be.Copy(s, out, x, n * sizeof(float));
  }
  static absl::Status SwiGluForward(Backend& be, Stream& s, float* out, const float* gate,
                                    const float* up, int64_t n) {
    return be.SwiGluForward(s, out, gate, up, n);
  }
  static absl::Status SwiGluBackward(Backend& be, Stream& s, float* dgate, float* dup,
                                     const float* dout, const float* gate, const float* up,
                                     int64_t n) {
    return be.SwiGluBackward(s, dgate, dup, dout, gate, up, n);
  }
  static absl::Status RmsNormForward(Backend& be, Stream& s, float* out, float* rstd,
                                     const float* x, const float* weight, int64_t rows,
                                     int64_t cols, float eps) {
    return be.RmsNormForward(s, out, rstd, x, weight, rows, cols, eps);
  }
  static absl::Status RmsNormBackward(Backend& be, Stream& s, float* dx, float* dweight,
                                      const float* dout, const float* x, const float* weight,
                                      const float* rstd, int64_t rows, int64_t cols) {
    return be.RmsNormBackward(s, dx, dweight, dout, x, weight, rstd, rows, cols);
  }
  // AdamW on the fp32 master; the working copy is the master itself in
  // fp32 (ElementBytes::working_is_master), copied when it lives apart.
  static absl::Status AdamW(Backend& be, Stream& s, float* master, const float* grad, float* m,
                            float* v, float* working, int64_t n, const AdamWArgs& args) {
    absl::Status st = be.AdamW(s, master, grad, m, v, n, args);
    if (!st.ok() || working == master) return st;
    return be.Copy(s, working, master, n * sizeof(float));
  }

  static absl::Status Embedding(ModelKernels& k, Stream& s, const float* table, int64_t vocab,
                                const int32_t* tokens, int64_t rows, int64_t hidden, float* out) {
    return k.Embedding(s, table, vocab, tokens, rows, hidden, out);
  }
  static absl::Status EmbeddingBackward(ModelKernels& k, Stream& s, const float* dout,
                                        const int32_t* tokens, int64_t rows, int64_t hidden,
                                        float* dtable, int64_t /*vocab*/) {
    return k.EmbeddingBackward(s, dout, tokens, rows, hidden, dtable);
  }
  static absl::Status Rope(ModelKernels& k, Stream& s, float* x, int64_t batch, int64_t len,
                           int64_t heads, int64_t head_dim, int64_t pos0, float theta,
                           bool inverse) {
    return k.Rope(s, x, batch, len, heads, head_dim, pos0, theta, inverse);
  }
  static absl::Status AttentionForwardBlock(ModelKernels& k, Stream& s, const AttentionShape& sh,
                                            const float* q, const float* kk, const float* v,
                                            float* m, float* l, float* acc, float* work) {
    return k.AttentionForwardBlock(s, sh, q, kk, v, m, l, acc, work);
  }
  static absl::Status AttentionDelta(ModelKernels& k, Stream& s, const AttentionShape& sh,
                                     const float* o, const float* dout, float* delta) {
    return k.AttentionDelta(s, sh, o, dout, delta);
  }
  static absl::Status AttentionBackwardBlock(ModelKernels& k, Stream& s, const AttentionShape& sh,
                                             const float* q, const float* kk, const float* v,
                                             const float* dout, const float* lse,
                                             const float* delta, float* dq, float* dk, float* dv,
                                             float* work) {
    return k.AttentionBackwardBlock(s, sh, q, kk, v, dout, lse, delta, dq, dk, dv, work);
  }
  static absl::Status GatherRows(ModelKernels& k, Stream& s, const float* src, int64_t src_rows,
                                 const int32_t* index, const float* scales, int64_t rows,
                                 int64_t width, float* dst) {
    return k.GatherRows(s, src, src_rows, index, scales, rows, width, dst);
  }
  static absl::Status ScatterRows(ModelKernels& k, Stream& s, const float* src, int64_t rows,
                                  const int32_t* index, int64_t width, float* dst,
                                  int64_t dst_rows) {
    return k.ScatterRows(s, src, rows, index, width, dst, dst_rows);
  }
  static absl::Status CombineRows(ModelKernels& k, Stream& s, const float* src,
                                  int64_t /*src_rows*/, const int32_t* pos, const float* weights,
                                  int64_t tokens, int64_t kk, int64_t width, float* out) {
    return k.CombineRows(s, src, pos, weights, tokens, kk, width, out);
  }
  static absl::Status RowDots(ModelKernels& k, Stream& s, const float* a, const float* b,
                              int64_t /*b_rows*/, const int32_t* pos, int64_t tokens, int64_t kk,
                              int64_t width, float* out) {
    return k.RowDots(s, a, b, pos, tokens, kk, width, out);
  }
  static absl::Status CrossEntropy(ModelKernels& k, Stream& s, const float* logits,
                                   const int32_t* targets, int64_t rows, int64_t vocab, float* lse,
                                   double* stats) {
    return k.CrossEntropy(s, logits, targets, rows, vocab, lse, stats);
  }
  static absl::Status CrossEntropyBackward(ModelKernels& k, Stream& s, float* logits_to_grad,
                                           const float* lse, const int32_t* targets, int64_t rows,
                                           int64_t vocab, float scale) {
    return k.CrossEntropyBackward(s, logits_to_grad, lse, targets, rows, vocab, scale);
  }
  static absl::Status StripFold(ModelKernels& k, Stream& s, const float* logits, int64_t rows,
                                int64_t width, int64_t col0, const int32_t* targets, float* state,
                                int64_t stride) {
    return k.StripFold(s, logits, rows, width, col0, targets, state, stride);
  }
  static absl::Status StripDelta(ModelKernels& k, Stream& s, float* logits_to_delta, int64_t rows,
                                 int64_t width, int64_t col0, const int32_t* targets,
                                 const float* lse, float scale) {
    return k.StripDelta(s, logits_to_delta, rows, width, col0, targets, lse, scale);
  }
};

template <>
struct WorkingOps<Bf16> {
  using T = Bf16;
  static constexpr Precision kPrecision = Precision::kBf16Mixed;

  static absl::Status Gemm(Backend& be, Stream& s, const WorkingGemm<Bf16>& g) {
    GemmBf16Args a{g.trans_a, g.trans_b, g.m, g.n, g.k, g.alpha, g.a, g.lda, g.b, g.ldb, g.beta,
                   g.c, nullptr, g.ldc};
    return be.GemmBf16(s, a);
  }
  static absl::Status GemmAccum(Backend& be, Stream& s, const WorkingGemm<Bf16, float>& g) {
    GemmBf16Args a{g.trans_a, g.trans_b, g.m, g.n, g.k, g.alpha, g.a, g.lda, g.b, g.ldb, g.beta,
                   nullptr, g.c, g.ldc};
    return be.GemmBf16(s, a);
  }
  static absl::Status GroupedGemm(Backend& be, Stream& s, absl::Span<const WorkingGemm<Bf16>> gs) {
    std::vector<GemmBf16Args> args;
    args.reserve(gs.size());
    for (const WorkingGemm<Bf16>& g : gs) {
      args.push_back({g.trans_a, g.trans_b, g.m, g.n, g.k, g.alpha, g.a, g.lda, g.b, g.ldb, g.beta, g.c,
                      nullptr, g.ldc});
    }
    return be.GroupedGemmBf16(s, args);
  }
  static absl::Status GroupedGemmAccum(Backend& be, Stream& s, absl::Span<const WorkingGemm<Bf16, float>> gs) {
    std::vector<GemmBf16Args> args;
    args.reserve(gs.size());
    for (const WorkingGemm<Bf16, float>& g : gs) {
      args.push_back(
          {g.trans_a, g.trans_b, g.m, g.n, g.k, g.alpha, g.a, g.lda, g.b, g.ldb, g.beta, nullptr, g.c, g.ldc});
    }
    return be.GroupedGemmBf16(s, args);
  }
  static absl::Status Fill(Backend& be, Stream& s, Bf16* x, int64_t n, float value) {
    return be.FillBf16(s, x, n, value);
  }
  static absl::Status Add(Backend& be, Stream& s, Bf16* out, const Bf16* a, const Bf16* b,
                          int64_t n) {
    return be.AddBf16(s, out, a, b, n);
  }
  static absl::Status SumSquares(Backend& be, Stream& s, float* out, const Bf16* x, int64_t n) {
    return be.SumSquaresBf16(s, out, x, n);
  }
  static absl::Status FromFloat(Backend& be, Stream& s, Bf16* out, const float* x, int64_t n) {
    return be.ConvertToBf16(s, out, x, n);
  }
  static absl::Status ToFloat(Backend& be, Stream& s, float* out, const Bf16* x, int64_t n) {
    return be.ConvertToFloat(s, out, x, n);
  }
  static absl::Status SwiGluForward(Backend& be, Stream& s, Bf16* out, const Bf16* gate,
                                    const Bf16* up, int64_t n) {
    return be.SwiGluForwardBf16(s, out, gate, up, n);
  }
  static absl::Status SwiGluBackward(Backend& be, Stream& s, Bf16* dgate, Bf16* dup,
                                     const Bf16* dout, const Bf16* gate, const Bf16* up,
                                     int64_t n) {
    return be.SwiGluBackwardBf16(s, dgate, dup, dout, gate, up, n);
  }
  static absl::Status RmsNormForward(Backend& be, Stream& s, Bf16* out, float* rstd,
                                     const Bf16* x, const Bf16* weight, int64_t rows,
                                     int64_t cols, float eps) {
    return be.RmsNormForwardBf16(s, out, rstd, x, weight, rows, cols, eps);
  }
  static absl::Status RmsNormBackward(Backend& be, Stream& s, Bf16* dx, Bf16* dweight,
                                      const Bf16* dout, const Bf16* x, const Bf16* weight,
                                      const float* rstd, int64_t rows, int64_t cols) {
    return be.RmsNormBackwardBf16(s, dx, dweight, dout, x, weight, rstd, rows, cols);
  }
  static absl::Status AdamW(Backend& be, Stream& s, float* master, const Bf16* grad, float* m,
                            float* v, Bf16* working, int64_t n, const AdamWArgs& args) {
    return be.AdamWBf16(s, master, grad, m, v, working, n, args);
  }

  static absl::Status Embedding(ModelKernels& k, Stream& s, const Bf16* table, int64_t vocab,
                                const int32_t* tokens, int64_t rows, int64_t hidden, Bf16* out) {
    return k.EmbeddingBf16(s, table, vocab, tokens, rows, hidden, out);
  }
  static absl::Status EmbeddingBackward(ModelKernels& k, Stream& s, const Bf16* dout,
                                        const int32_t* tokens, int64_t rows, int64_t hidden,
                                        Bf16* dtable, int64_t vocab) {
    return k.EmbeddingBackwardBf16(s, dout, tokens, rows, hidden, dtable, vocab);
  }
  static absl::Status Rope(ModelKernels& k, Stream& s, Bf16* x, int64_t batch, int64_t len,
                           int64_t heads, int64_t head_dim, int64_t pos0, float theta,
                           bool inverse) {
    return k.RopeBf16(s, x, batch, len, heads, head_dim, pos0, theta, inverse);
  }
  static absl::Status AttentionForwardBlock(ModelKernels& k, Stream& s, const AttentionShape& sh,
                                            const Bf16* q, const Bf16* kk, const Bf16* v,
                                            float* m, float* l, float* acc, float* work) {
    return k.AttentionForwardBlockBf16(s, sh, q, kk, v, m, l, acc, work);
  }
  static absl::Status AttentionDelta(ModelKernels& k, Stream& s, const AttentionShape& sh,
                                     const float* o, const Bf16* dout, float* delta) {
    return k.AttentionDeltaBf16(s, sh, o, dout, delta);
  }
  static absl::Status AttentionBackwardBlock(ModelKernels& k, Stream& s, const AttentionShape& sh, const Bf16* q,
                                             const Bf16* kk, const Bf16* v, const Bf16* dout, const float* lse,
                                             const float* delta, float* dq, float* dk, float* dv, float* work) {
    return k.AttentionBackwardBlockBf16(s, sh, q, kk, v, dout, lse, delta, dq, dk, dv, work);
  }
  static absl::Status GatherRows(ModelKernels& k, Stream& s, const Bf16* src, int64_t src_rows,
                                 const int32_t* index, const float* scales, int64_t rows,
                                 int64_t width, Bf16* dst) {
    return k.GatherRowsBf16(s, src, src_rows, index, scales, rows, width, dst);
  }
  static absl::Status ScatterRows(ModelKernels& k, Stream& s, const Bf16* src, int64_t rows,
                                  const int32_t* index, int64_t width, Bf16* dst,
                                  int64_t dst_rows) {
    return k.ScatterRowsBf16(s, src, rows, index, width, dst, dst_rows);
  }
  static absl::Status CombineRows(ModelKernels& k, Stream& s, const Bf16* src, int64_t src_rows,
                                  const int32_t* pos, const float* weights, int64_t tokens,
                                  int64_t kk, int64_t width, Bf16* out) {
    return k.CombineRowsBf16(s, src, src_rows, pos, weights, tokens, kk, width, out);
  }
  static absl::Status RowDots(ModelKernels& k, Stream& s, const Bf16* a, const Bf16* b,
                              int64_t b_rows, const int32_t* pos, int64_t tokens, int64_t kk,
                              int64_t width, float* out) {
    return k.RowDotsBf16(s, a, b, b_rows, pos, tokens, kk, width, out);
  }
  static absl::Status CrossEntropy(ModelKernels& k, Stream& s, const Bf16* logits,
                                   const int32_t* targets, int64_t rows, int64_t vocab, float* lse,
                                   double* stats) {
    return k.CrossEntropyBf16(s, logits, targets, rows, vocab, lse, stats);
  }
  static absl::Status CrossEntropyBackward(ModelKernels& k, Stream& s, Bf16* logits_to_grad,
                                           const float* lse, const int32_t* targets, int64_t rows,
                                           int64_t vocab, float scale) {
    return k.CrossEntropyBackwardBf16(s, logits_to_grad, lse, targets, rows, vocab, scale);
  }
  static absl::Status StripFold(ModelKernels& k, Stream& s, const Bf16* logits, int64_t rows,
                                int64_t width, int64_t col0, const int32_t* targets, float* state,
                                int64_t stride) {
    return k.StripFoldBf16(s, logits, rows, width, col0, targets, state, stride);
  }
  static absl::Status StripDelta(ModelKernels& k, Stream& s, Bf16* logits_to_delta, int64_t rows,
                                 int64_t width, int64_t col0, const int32_t* targets,
                                 const float* lse, float scale) {
    return k.StripDeltaBf16(s, logits_to_delta, rows, width, col0, targets, lse, scale);
  }
};

// The working type's bytes are the plan's (precision.h): the buffers the
// budget sizes hold exactly the values the ops write.
static_assert(sizeof(WorkingOps<float>::T) == ElementBytesOf(Precision::kFp32).working);
static_assert(sizeof(WorkingOps<Bf16>::T) == ElementBytesOf(Precision::kBf16Mixed).working);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_WORKING_OPS_H_
