#include "kernels/model/model_kernels.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/arg_checks.h"
#include "kernels/status_macros.h"

namespace plateau {
namespace {

absl::Status CheckShape(absl::string_view op, const AttentionShape& s) {
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "batch", s.batch));
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "q_len", s.q_len));
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "kv_len", s.kv_len));
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "heads", s.heads));
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "kv_heads", s.kv_heads));
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "head_dim", s.head_dim));
  if (s.heads % s.kv_heads != 0) {
    return ArgError(op, absl::StrCat("kv_heads = ", s.kv_heads, " must divide heads = ", s.heads));
  }
  if (s.q_pos0 < 0 || s.kv_pos0 < 0) return ArgError(op, "positions must be >= 0");
  if (!(s.scale > 0.0f)) return ArgError(op, "scale must be > 0");
  return absl::OkStatus();
}

}  // namespace

// The argument checks of the ops that have a bf16 twin, shared by both
// precisions (the element type does not change what is checked). Each
// returns OK with *skip set when there is nothing to do (no rows).
namespace {

absl::Status CheckEmbedding(absl::string_view op, const void* table, int64_t vocab,
                            const int32_t* tokens, int64_t rows, int64_t hidden, const void* out,
                            bool* skip) {
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "hidden", hidden));
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "vocab", vocab));
  *skip = rows == 0;
  if (*skip) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "rows", rows));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "table", table));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "tokens", tokens));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "out", out));
  // Token ids come from data the loader already checked against the vocabulary.
  return absl::OkStatus();
}

absl::Status CheckEmbeddingBackward(absl::string_view op, const void* dout,
                                    const int32_t* tokens, int64_t rows, int64_t hidden,
                                    const void* dtable, bool* skip) {
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "hidden", hidden));
  *skip = rows == 0;
  if (*skip) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "rows", rows));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "dout", dout));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "tokens", tokens));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "dtable", dtable));
  return absl::OkStatus();
}

}  // namespace

absl::Status ModelKernels::Embedding(Stream& s, const float* table, int64_t vocab,
                                     const int32_t* tokens, int64_t rows, int64_t hidden,
                                     float* out) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(
      CheckEmbedding("embedding", table, vocab, tokens, rows, hidden, out, &skip));
  return skip ? absl::OkStatus() : DoEmbedding(s, table, vocab, tokens, rows, hidden, out);
}

absl::Status ModelKernels::EmbeddingBackward(Stream& s, const float* dout,
                                             const int32_t* tokens, int64_t rows,
                                             int64_t hidden, float* dtable) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(
      CheckEmbeddingBackward("embedding_backward", dout, tokens, rows, hidden, dtable, &skip));
  return skip ? absl::OkStatus() : DoEmbeddingBackward(s, dout, tokens, rows, hidden, dtable);
}

namespace {
absl::Status CheckRope(absl::string_view op, const void* x, int64_t batch, int64_t len,
                       int64_t heads, int64_t head_dim, int64_t pos0, float theta) {
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "batch", batch));
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "len", len));
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "heads", heads));
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "head_dim", head_dim));
  if (head_dim % 2 != 0) return ArgError(op, absl::StrCat("head_dim must be even, got ", head_dim));
  if (pos0 < 0) return ArgError(op, "pos0 must be >= 0");
  if (!(theta > 1.0f)) return ArgError(op, "theta must be > 1");
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "x", x));
  return absl::OkStatus();
}
}  // namespace

absl::Status ModelKernels::Rope(Stream& s, float* x, int64_t batch, int64_t len,
                                int64_t heads, int64_t head_dim, int64_t pos0,
                                float theta, bool inverse) {
  PLATEAU_RETURN_IF_ERROR(CheckRope("rope", x, batch, len, heads, head_dim, pos0, theta));
  return DoRope(s, x, batch, len, heads, head_dim, pos0, theta, inverse);
}

absl::Status ModelKernels::AttentionInit(Stream& s, const AttentionShape& shape, float* m,
                                         float* l, float* acc) {
  PLATEAU_RETURN_IF_ERROR(CheckShape("attention_init", shape));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("attention_init", "m", m));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("attention_init", "l", l));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull("attention_init", "acc", acc));
  return DoAttentionInit(s, shape, m, l, acc);
}

absl::Status ModelKernels::AttentionForwardBlock(Stream& s, const AttentionShape& shape,
                                                 const float* q, const float* k,
                                                 const float* v, float* m, float* l,
                                                 float* acc, float* work) {
  constexpr absl::string_view op = "attention_forward_block";
  PLATEAU_RETURN_IF_ERROR(CheckShape(op, shape));
  for (auto [name, p] : {std::pair<const char*, const void*>{"q", q}, {"k", k}, {"v", v},
                         {"m", m}, {"l", l}, {"acc", acc}, {"work", work}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return DoAttentionForwardBlock(s, shape, q, k, v, m, l, acc, work);
}

absl::Status ModelKernels::AttentionFinalize(Stream& s, const AttentionShape& shape,
                                             const float* m, const float* l,
                                             float* acc_to_o, float* lse) {
  constexpr absl::string_view op = "attention_finalize";
  PLATEAU_RETURN_IF_ERROR(CheckShape(op, shape));
  for (auto [name, p] : {std::pair<const char*, const void*>{"m", m}, {"l", l},
                         {"acc", acc_to_o}, {"lse", lse}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return DoAttentionFinalize(s, shape, m, l, acc_to_o, lse);
}

absl::Status ModelKernels::AttentionDelta(Stream& s, const AttentionShape& shape,
                                          const float* o, const float* dout, float* delta) {
  constexpr absl::string_view op = "attention_delta";
  PLATEAU_RETURN_IF_ERROR(CheckShape(op, shape));
  for (auto [name, p] : {std::pair<const char*, const void*>{"o", o}, {"dout", dout},
                         {"delta", delta}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return DoAttentionDelta(s, shape, o, dout, delta);
}

absl::Status ModelKernels::AttentionBackwardBlock(Stream& s, const AttentionShape& shape,
                                                  const float* q, const float* k,
                                                  const float* v, const float* dout,
                                                  const float* lse, const float* delta,
                                                  float* dq, float* dk, float* dv, float* work) {
  constexpr absl::string_view op = "attention_backward_block";
  PLATEAU_RETURN_IF_ERROR(CheckShape(op, shape));
  for (auto [name, p] : {std::pair<const char*, const void*>{"q", q}, {"k", k}, {"v", v},
                         {"dout", dout}, {"lse", lse}, {"delta", delta}, {"dq", dq},
                         {"dk", dk}, {"dv", dv}, {"work", work}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return DoAttentionBackwardBlock(s, shape, q, k, v, dout, lse, delta, dq, dk, dv, work);
}

absl::Status ModelKernels::Router(Stream& s, const float* logits, int64_t rows,
                                  int64_t experts, int64_t top_k, float* probs,
                                  int32_t* chosen, float* gates) {
  constexpr absl::string_view op = "router";
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "experts", experts));
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "top_k", top_k));
  if (top_k > experts) {
    return ArgError(op, absl::StrCat("top_k = ", top_k, " must be <= experts = ", experts));
  }
  if (rows == 0) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "rows", rows));
  for (auto [name, p] : {std::pair<const char*, const void*>{"logits", logits},
                         {"probs", probs}, {"chosen", chosen}, {"gates", gates}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return DoRouter(s, logits, rows, experts, top_k, probs, chosen, gates);
}

absl::Status ModelKernels::RouterBackward(Stream& s, const float* probs, const int32_t* chosen,
                                          const float* gates, const float* dgates,
                                          int64_t rows, int64_t experts, int64_t top_k,
                                          float* dlogits) {
  constexpr absl::string_view op = "router_backward";
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "experts", experts));
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "top_k", top_k));
  if (top_k > experts) {
    return ArgError(op, absl::StrCat("top_k = ", top_k, " must be <= experts = ", experts));
  }
  if (rows == 0) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "rows", rows));
  for (auto [name, p] : {std::pair<const char*, const void*>{"probs", probs},
                         {"chosen", chosen}, {"gates", gates}, {"dgates", dgates},
                         {"dlogits", dlogits}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return DoRouterBackward(s, probs, chosen, gates, dgates, rows, experts, top_k, dlogits);
}

namespace {

absl::Status CheckCrossEntropy(absl::string_view op, const void* logits, const int32_t* targets,
                               int64_t rows, int64_t vocab, const float* lse,
                               const double* stats, bool* skip) {
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "vocab", vocab));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "stats", stats));
  *skip = rows == 0;
  if (*skip) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "rows", rows));
  for (auto [name, p] : {std::pair<const char*, const void*>{"logits", logits},
                         {"targets", targets}, {"lse", lse}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return absl::OkStatus();
}

absl::Status CheckCrossEntropyBackward(absl::string_view op, const void* logits_to_grad,
                                       const float* lse, const int32_t* targets, int64_t rows,
                                       int64_t vocab, bool* skip) {
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "vocab", vocab));
  *skip = rows == 0;
  if (*skip) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "rows", rows));
  for (auto [name, p] : {std::pair<const char*, const void*>{"logits", logits_to_grad},
                         {"lse", lse}, {"targets", targets}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ModelKernels::CrossEntropy(Stream& s, const float* logits, const int32_t* targets,
                                        int64_t rows, int64_t vocab, float* lse,
                                        double* stats) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(
      CheckCrossEntropy("cross_entropy", logits, targets, rows, vocab, lse, stats, &skip));
  return skip ? absl::OkStatus() : DoCrossEntropy(s, logits, targets, rows, vocab, lse, stats);
}

absl::Status ModelKernels::CrossEntropyBackward(Stream& s, float* logits_to_grad,
                                                const float* lse, const int32_t* targets,
                                                int64_t rows, int64_t vocab, float scale) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(CheckCrossEntropyBackward("cross_entropy_backward", logits_to_grad, lse,
                                                    targets, rows, vocab, &skip));
  return skip ? absl::OkStatus()
              : DoCrossEntropyBackward(s, logits_to_grad, lse, targets, rows, vocab, scale);
}

namespace {

absl::Status CheckGatherRows(absl::string_view op, const void* src, int64_t src_rows,
                             const int32_t* index, int64_t rows, int64_t width, const void* dst,
                             bool* skip) {
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "width", width));
  *skip = rows == 0;
  if (*skip) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "rows", rows));
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "src_rows", src_rows));
  for (auto [name, p] : {std::pair<const char*, const void*>{"src", src}, {"index", index},
                         {"dst", dst}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return absl::OkStatus();
}

absl::Status CheckScatterRows(absl::string_view op, const void* src, int64_t rows,
                              const int32_t* index, int64_t width, const void* dst,
                              int64_t dst_rows, bool* skip) {
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "width", width));
  *skip = rows == 0;
  if (*skip) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "rows", rows));
  if (dst_rows < rows) {
    return ArgError(op, absl::StrCat("dst_rows = ", dst_rows, " cannot hold ", rows,
                                     " distinct rows"));
  }
  for (auto [name, p] : {std::pair<const char*, const void*>{"src", src}, {"index", index},
                         {"dst", dst}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return absl::OkStatus();
}

absl::Status CheckCombineRows(absl::string_view op, const void* src, const int32_t* pos,
                              int64_t tokens, int64_t k, int64_t width, const void* out,
                              bool* skip) {
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "width", width));
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "k", k));
  *skip = tokens == 0;
  if (*skip) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "tokens", tokens));
  for (auto [name, p] : {std::pair<const char*, const void*>{"src", src}, {"pos", pos},
                         {"out", out}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return absl::OkStatus();
}

absl::Status CheckRowDots(absl::string_view op, const void* a, const void* b,
                          const int32_t* pos, int64_t tokens, int64_t k, int64_t width,
                          const float* out, bool* skip) {
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "width", width));
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "k", k));
  *skip = tokens == 0;
  if (*skip) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "tokens", tokens));
  for (auto [name, p] : {std::pair<const char*, const void*>{"a", a}, {"b", b}, {"pos", pos},
                         {"out", out}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ModelKernels::GatherRows(Stream& s, const float* src, int64_t src_rows,
                                      const int32_t* index, const float* scales,
                                      int64_t rows, int64_t width, float* dst) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(
      CheckGatherRows("gather_rows", src, src_rows, index, rows, width, dst, &skip));
  return skip ? absl::OkStatus() : DoGatherRows(s, src, src_rows, index, scales, rows, width, dst);
}

absl::Status ModelKernels::ScatterRows(Stream& s, const float* src, int64_t rows,
                                       const int32_t* index, int64_t width, float* dst,
                                       int64_t dst_rows) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(
      CheckScatterRows("scatter_rows", src, rows, index, width, dst, dst_rows, &skip));
  return skip ? absl::OkStatus() : DoScatterRows(s, src, rows, index, width, dst, dst_rows);
}

absl::Status ModelKernels::CombineRows(Stream& s, const float* src, const int32_t* pos,
                                       const float* weights, int64_t tokens, int64_t k,
                                       int64_t width, float* out) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(
      CheckCombineRows("combine_rows", src, pos, tokens, k, width, out, &skip));
  return skip ? absl::OkStatus() : DoCombineRows(s, src, pos, weights, tokens, k, width, out);
}

absl::Status ModelKernels::RowDots(Stream& s, const float* a, const float* b,
                                   const int32_t* pos, int64_t tokens, int64_t k,
                                   int64_t width, float* out) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(CheckRowDots("row_dots", a, b, pos, tokens, k, width, out, &skip));
  return skip ? absl::OkStatus() : DoRowDots(s, a, b, pos, tokens, k, width, out);
}

absl::Status ModelKernels::StripInit(Stream& s, float* state, int64_t rows) {
  constexpr absl::string_view op = "strip_init";
  if (rows == 0) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "rows", rows));
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "state", state));
  return DoStripInit(s, state, rows);
}

namespace {

absl::Status CheckStripFold(absl::string_view op, const void* logits, int64_t rows,
                            int64_t width, int64_t col0, const int32_t* targets,
                            const float* state, int64_t stride, bool* skip) {
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "width", width));
  if (stride < rows) {
    return ArgError(op, absl::StrCat("stride = ", stride, " must be >= rows = ", rows));
  }
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "col0", col0));
  *skip = rows == 0;
  if (*skip) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "rows", rows));
  for (auto [name, p] : {std::pair<const char*, const void*>{"logits", logits},
                         {"targets", targets}, {"state", state}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return absl::OkStatus();
}

absl::Status CheckStripDelta(absl::string_view op, const void* logits_to_delta, int64_t rows,
                             int64_t width, int64_t col0, const int32_t* targets,
                             const float* lse, bool* skip) {
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "width", width));
  PLATEAU_RETURN_IF_ERROR(CheckNonNegative(op, "col0", col0));
  *skip = rows == 0;
  if (*skip) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "rows", rows));
  for (auto [name, p] : {std::pair<const char*, const void*>{"logits", logits_to_delta},
                         {"targets", targets}, {"lse", lse}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ModelKernels::StripFold(Stream& s, const float* logits, int64_t rows,
                                     int64_t width, int64_t col0, const int32_t* targets,
                                     float* state, int64_t stride) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(
      CheckStripFold("strip_fold", logits, rows, width, col0, targets, state, stride, &skip));
  return skip ? absl::OkStatus()
              : DoStripFold(s, logits, rows, width, col0, targets, state, stride);
}

absl::Status ModelKernels::StripFinish(Stream& s, const float* state, const int32_t* targets,
                                       int64_t rows, float* lse, double* stats) {
  constexpr absl::string_view op = "strip_finish";
  PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, "stats", stats));
  if (rows == 0) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckPositive(op, "rows", rows));
  for (auto [name, p] : {std::pair<const char*, const void*>{"state", state},
                         {"targets", targets}, {"lse", lse}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return DoStripFinish(s, state, targets, rows, lse, stats);
}

absl::Status ModelKernels::StripDelta(Stream& s, float* logits_to_delta, int64_t rows,
                                      int64_t width, int64_t col0, const int32_t* targets,
                                      const float* lse, float scale) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(
      CheckStripDelta("strip_delta", logits_to_delta, rows, width, col0, targets, lse, &skip));
  return skip ? absl::OkStatus()
              : DoStripDelta(s, logits_to_delta, rows, width, col0, targets, lse, scale);
}

// --- bf16 mixed precision ---------------------------------------------------

namespace {
absl::Status NoBf16(absl::string_view op) {
  return absl::UnimplementedError(absl::StrCat(op, ": these model kernels have no bf16 version"));
}
}  // namespace

absl::Status ModelKernels::EmbeddingBf16(Stream& s, const Bf16* table, int64_t vocab,
                                         const int32_t* tokens, int64_t rows, int64_t hidden,
                                         Bf16* out) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(
      CheckEmbedding("embedding_bf16", table, vocab, tokens, rows, hidden, out, &skip));
  return skip ? absl::OkStatus() : DoEmbeddingBf16(s, table, vocab, tokens, rows, hidden, out);
}

absl::Status ModelKernels::EmbeddingBackwardBf16(Stream& s, const Bf16* dout,
                                                 const int32_t* tokens, int64_t rows,
                                                 int64_t hidden, Bf16* dtable, int64_t vocab) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(CheckEmbeddingBackward("embedding_backward_bf16", dout, tokens, rows,
                                                 hidden, dtable, &skip));
  PLATEAU_RETURN_IF_ERROR(CheckPositive("embedding_backward_bf16", "vocab", vocab));
  return skip ? absl::OkStatus()
              : DoEmbeddingBackwardBf16(s, dout, tokens, rows, hidden, dtable, vocab);
}

absl::Status ModelKernels::GatherRowsBf16(Stream& s, const Bf16* src, int64_t src_rows,
                                          const int32_t* index, const float* scales,
                                          int64_t rows, int64_t width, Bf16* dst) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(
      CheckGatherRows("gather_rows_bf16", src, src_rows, index, rows, width, dst, &skip));
  return skip ? absl::OkStatus()
              : DoGatherRowsBf16(s, src, src_rows, index, scales, rows, width, dst);
}

absl::Status ModelKernels::ScatterRowsBf16(Stream& s, const Bf16* src, int64_t rows,
                                           const int32_t* index, int64_t width, Bf16* dst,
                                           int64_t dst_rows) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(
      CheckScatterRows("scatter_rows_bf16", src, rows, index, width, dst, dst_rows, &skip));
  return skip ? absl::OkStatus() : DoScatterRowsBf16(s, src, rows, index, width, dst, dst_rows);
}

absl::Status ModelKernels::CombineRowsBf16(Stream& s, const Bf16* src, int64_t src_rows,
                                           const int32_t* pos, const float* weights,
                                           int64_t tokens, int64_t k, int64_t width, Bf16* out) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(
      CheckCombineRows("combine_rows_bf16", src, pos, tokens, k, width, out, &skip));
  PLATEAU_RETURN_IF_ERROR(CheckPositive("combine_rows_bf16", "src_rows", src_rows));
  return skip ? absl::OkStatus()
              : DoCombineRowsBf16(s, src, src_rows, pos, weights, tokens, k, width, out);
}

absl::Status ModelKernels::RowDotsBf16(Stream& s, const Bf16* a, const Bf16* b, int64_t b_rows,
                                       const int32_t* pos, int64_t tokens, int64_t k,
                                       int64_t width, float* out) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(CheckRowDots("row_dots_bf16", a, b, pos, tokens, k, width, out, &skip));
  PLATEAU_RETURN_IF_ERROR(CheckPositive("row_dots_bf16", "b_rows", b_rows));
  return skip ? absl::OkStatus() : DoRowDotsBf16(s, a, b, b_rows, pos, tokens, k, width, out);
}

absl::Status ModelKernels::RopeBf16(Stream& s, Bf16* x, int64_t batch, int64_t len, int64_t heads,
                                    int64_t head_dim, int64_t pos0, float theta, bool inverse) {
  PLATEAU_RETURN_IF_ERROR(CheckRope("rope_bf16", x, batch, len, heads, head_dim, pos0, theta));
  return DoRopeBf16(s, x, batch, len, heads, head_dim, pos0, theta, inverse);
}

absl::Status ModelKernels::CrossEntropyBf16(Stream& s, const Bf16* logits, const int32_t* targets,
                                            int64_t rows, int64_t vocab, float* lse,
                                            double* stats) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(
      CheckCrossEntropy("cross_entropy_bf16", logits, targets, rows, vocab, lse, stats, &skip));
  return skip ? absl::OkStatus() : DoCrossEntropyBf16(s, logits, targets, rows, vocab, lse, stats);
}

absl::Status ModelKernels::CrossEntropyBackwardBf16(Stream& s, Bf16* logits_to_grad,
                                                    const float* lse, const int32_t* targets,
                                                    int64_t rows, int64_t vocab, float scale) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(CheckCrossEntropyBackward("cross_entropy_backward_bf16", logits_to_grad,
                                                    lse, targets, rows, vocab, &skip));
  return skip ? absl::OkStatus()
              : DoCrossEntropyBackwardBf16(s, logits_to_grad, lse, targets, rows, vocab, scale);
}

absl::Status ModelKernels::StripFoldBf16(Stream& s, const Bf16* logits, int64_t rows,
                                         int64_t width, int64_t col0, const int32_t* targets,
                                         float* state, int64_t stride) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(CheckStripFold("strip_fold_bf16", logits, rows, width, col0, targets,
                                         state, stride, &skip));
  return skip ? absl::OkStatus()
              : DoStripFoldBf16(s, logits, rows, width, col0, targets, state, stride);
}

absl::Status ModelKernels::StripDeltaBf16(Stream& s, Bf16* logits_to_delta, int64_t rows,
                                          int64_t width, int64_t col0, const int32_t* targets,
                                          const float* lse, float scale) {
  bool skip = false;
  PLATEAU_RETURN_IF_ERROR(CheckStripDelta("strip_delta_bf16", logits_to_delta, rows, width, col0,
                                          targets, lse, &skip));
  return skip ? absl::OkStatus()
              : DoStripDeltaBf16(s, logits_to_delta, rows, width, col0, targets, lse, scale);
}

absl::Status ModelKernels::AttentionForwardBlockBf16(Stream& s, const AttentionShape& shape,
                                                     const Bf16* q, const Bf16* k, const Bf16* v,
                                                     float* m, float* l, float* acc, float* work) {
  constexpr absl::string_view op = "attention_forward_block_bf16";
  PLATEAU_RETURN_IF_ERROR(CheckShape(op, shape));
  for (auto [name, p] : {std::pair<const char*, const void*>{"q", q}, {"k", k}, {"v", v},
                         {"m", m}, {"l", l}, {"acc", acc}, {"work", work}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return DoAttentionForwardBlockBf16(s, shape, q, k, v, m, l, acc, work);
}

absl::Status ModelKernels::AttentionDeltaBf16(Stream& s, const AttentionShape& shape,
                                              const float* o, const Bf16* dout, float* delta) {
  constexpr absl::string_view op = "attention_delta_bf16";
  PLATEAU_RETURN_IF_ERROR(CheckShape(op, shape));
  for (auto [name, p] : {std::pair<const char*, const void*>{"o", o}, {"dout", dout},
                         {"delta", delta}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return DoAttentionDeltaBf16(s, shape, o, dout, delta);
}

absl::Status ModelKernels::AttentionBackwardBlockBf16(Stream& s, const AttentionShape& shape, const Bf16* q,
                                                      const Bf16* k, const Bf16* v, const Bf16* dout, const float* lse,
                                                      const float* delta, float* dq, float* dk, float* dv,
                                                      float* work) {
  constexpr absl::string_view op = "attention_backward_block_bf16";
  PLATEAU_RETURN_IF_ERROR(CheckShape(op, shape));
  for (auto [name, p] : {std::pair<const char*, const void*>{"q", q}, {"k", k}, {"v", v},
                         {"dout", dout}, {"lse", lse}, {"delta", delta}, {"dq", dq},
                         {"dk", dk}, {"dv", dv}, {"work", work}}) {
    PLATEAU_RETURN_IF_ERROR(CheckNotNull(op, name, p));
  }
  return DoAttentionBackwardBlockBf16(s, shape, q, k, v, dout, lse, delta, dq, dk, dv, work);
}

absl::Status ModelKernels::DoAttentionForwardBlockBf16(Stream&, const AttentionShape&, const Bf16*,
                                                       const Bf16*, const Bf16*, float*, float*,
                                                       float*, float*) {
  return NoBf16("attention_forward_block_bf16");
}
absl::Status ModelKernels::DoAttentionDeltaBf16(Stream&, const AttentionShape&, const float*,
                                                const Bf16*, float*) {
  return NoBf16("attention_delta_bf16");
}
absl::Status ModelKernels::DoAttentionBackwardBlockBf16(Stream&, const AttentionShape&, const Bf16*, const Bf16*,
                                                        const Bf16*, const Bf16*, const float*, const float*, float*,
                                                        float*, float*, float*) {
  return NoBf16("attention_backward_block_bf16");
}
absl::Status ModelKernels::DoRopeBf16(Stream&, Bf16*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                      float, bool) {
  return NoBf16("rope_bf16");
}
absl::Status ModelKernels::DoCrossEntropyBf16(Stream&, const Bf16*, const int32_t*, int64_t,
                                              int64_t, float*, double*) {
  return NoBf16("cross_entropy_bf16");
}
absl::Status ModelKernels::DoCrossEntropyBackwardBf16(Stream&, Bf16*, const float*,
                                                      const int32_t*, int64_t, int64_t, float) {
  return NoBf16("cross_entropy_backward_bf16");
}
absl::Status ModelKernels::DoStripFoldBf16(Stream&, const Bf16*, int64_t, int64_t, int64_t,
                                           const int32_t*, float*, int64_t) {
  return NoBf16("strip_fold_bf16");
}
absl::Status ModelKernels::DoStripDeltaBf16(Stream&, Bf16*, int64_t, int64_t, int64_t,
                                            const int32_t*, const float*, float) {
  return NoBf16("strip_delta_bf16");
}
absl::Status ModelKernels::DoEmbeddingBf16(Stream&, const Bf16*, int64_t, const int32_t*, int64_t,
                                           int64_t, Bf16*) {
  return NoBf16("embedding_bf16");
}
absl::Status ModelKernels::DoEmbeddingBackwardBf16(Stream&, const Bf16*, const int32_t*, int64_t,
                                                   int64_t, Bf16*, int64_t) {
  return NoBf16("embedding_backward_bf16");
}
absl::Status ModelKernels::DoGatherRowsBf16(Stream&, const Bf16*, int64_t, const int32_t*,
                                            const float*, int64_t, int64_t, Bf16*) {
  return NoBf16("gather_rows_bf16");
}
absl::Status ModelKernels::DoScatterRowsBf16(Stream&, const Bf16*, int64_t, const int32_t*,
                                             int64_t, Bf16*, int64_t) {
  return NoBf16("scatter_rows_bf16");
}
absl::Status ModelKernels::DoCombineRowsBf16(Stream&, const Bf16*, int64_t, const int32_t*,
                                             const float*, int64_t, int64_t, int64_t, Bf16*) {
  return NoBf16("combine_rows_bf16");
}
absl::Status ModelKernels::DoRowDotsBf16(Stream&, const Bf16*, const Bf16*, int64_t,
                                         const int32_t*, int64_t, int64_t, int64_t, float*) {
  return NoBf16("row_dots_bf16");
}

}  // namespace plateau
