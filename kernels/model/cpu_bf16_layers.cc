#include "kernels/model/cpu_bf16_layers.h"

#include <algorithm>

#include "kernels/cpu_bf16_ops.h"
#include "kernels/model/attention.h"
#include "kernels/model/layers.h"

namespace plateau::cpu {

void EmbeddingForwardBf16(const Bf16* table, const int32_t* tokens, int64_t rows, int64_t hidden,
                          Bf16* out, CpuPool* pool) {
  ParallelBlocks(pool, rows, RowsPerTask(hidden), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      std::copy_n(table + static_cast<int64_t>(tokens[r]) * hidden, hidden, out + r * hidden);
    }
  });
}

void EmbeddingBackwardBf16(const Bf16* dout, const int32_t* tokens, int64_t rows, int64_t hidden,
                           Bf16* dtable, int64_t vocab, CpuPool* pool) {
  const float* d = LoadToScratch(0, dout, rows * hidden, pool);
  // The whole table: rows a token never touches load and round back to
  // their own bits.
  float* t = Bf16Scratch(1, vocab * hidden);
  ConvertToFloat(t, dtable, vocab * hidden, pool);
  plateau::EmbeddingBackward(d, tokens, rows, hidden, t, pool);
  ConvertToBf16(dtable, t, vocab * hidden, pool);
}

void GatherRowsBf16(const Bf16* src, int64_t src_rows, const int32_t* index, const float* scales,
                    int64_t rows, int64_t width, Bf16* dst, CpuPool* pool) {
  const float* s = LoadToScratch(0, src, src_rows * width, pool);
  float* d = Bf16Scratch(1, rows * width);
  plateau::GatherRows(s, index, scales, rows, width, d, pool);
  ConvertToBf16(dst, d, rows * width, pool);
}

void ScatterRowsBf16(const Bf16* src, int64_t rows, const int32_t* index, int64_t width, Bf16* dst,
                     CpuPool* pool) {
  ParallelBlocks(pool, rows, RowsPerTask(width), [=](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      std::copy_n(src + i * width, width, dst + static_cast<int64_t>(index[i]) * width);
    }
  });
}

void CombineRowsBf16(const Bf16* src, int64_t src_rows, const int32_t* pos, const float* weights,
                     int64_t tokens, int64_t k, int64_t width, Bf16* out, CpuPool* pool) {
  const float* s = LoadToScratch(0, src, src_rows * width, pool);
  float* o = Bf16Scratch(1, tokens * width);
  ConvertToFloat(o, out, tokens * width, pool);
  plateau::CombineRows(s, pos, weights, tokens, k, width, o, pool);
  ConvertToBf16(out, o, tokens * width, pool);
}

void RowDotsBf16(const Bf16* a, const Bf16* b, int64_t b_rows, const int32_t* pos, int64_t tokens,
                 int64_t k, int64_t width, float* out, CpuPool* pool) {
  const float* x = LoadToScratch(0, a, tokens * width, pool);
  const float* y = LoadToScratch(1, b, b_rows * width, pool);
  plateau::RowDots(x, y, pos, tokens, k, width, out, pool);
}

void RopeBf16(Bf16* x, int64_t batch, int64_t len, int64_t heads, int64_t head_dim, int64_t pos0,
              float theta, bool inverse, CpuPool* pool) {
  const int64_t n = batch * len * heads * head_dim;
  float* f = Bf16Scratch(0, n);
  ConvertToFloat(f, x, n, pool);
  RopeApply(f, batch, len, heads, head_dim, pos0, theta, inverse, pool);
  ConvertToBf16(x, f, n, pool);
}

double CrossEntropyForwardBf16(const Bf16* logits, const int32_t* targets, int64_t rows,
                               int64_t vocab, float* lse, int64_t* valid, CpuPool* pool) {
  const float* f = LoadToScratch(0, logits, rows * vocab, pool);
  return CrossEntropyForward(f, targets, rows, vocab, lse, valid, pool);
}

void CrossEntropyBackwardBf16(Bf16* logits_to_grad, const float* lse, const int32_t* targets,
                              int64_t rows, int64_t vocab, float scale, CpuPool* pool) {
  float* f = Bf16Scratch(0, rows * vocab);
  ConvertToFloat(f, logits_to_grad, rows * vocab, pool);
  plateau::CrossEntropyBackward(f, lse, targets, rows, vocab, scale, pool);
  ConvertToBf16(logits_to_grad, f, rows * vocab, pool);
}

void StripFoldBf16(const Bf16* logits, int64_t rows, int64_t width, int64_t col0,
                   const int32_t* targets, float* m, float* s, float* t, CpuPool* pool) {
  const float* f = LoadToScratch(0, logits, rows * width, pool);
  plateau::StripFold(f, rows, width, col0, targets, m, s, t, pool);
}

void StripDeltaBf16(Bf16* logits_to_delta, int64_t rows, int64_t width, int64_t col0,
                    const int32_t* targets, const float* lse, float scale, CpuPool* pool) {
  float* f = Bf16Scratch(0, rows * width);
  ConvertToFloat(f, logits_to_delta, rows * width, pool);
  plateau::StripDelta(f, rows, width, col0, targets, lse, scale, pool);
  ConvertToBf16(logits_to_delta, f, rows * width, pool);
}

namespace {
int64_t QueryFloats(const AttentionShape& s) { return s.batch * s.q_len * s.heads * s.head_dim; }
int64_t KeyFloats(const AttentionShape& s) { return s.batch * s.kv_len * s.kv_heads * s.head_dim; }
}  // namespace

void AttentionForwardBlockBf16(const AttentionShape& s, const Bf16* q, const Bf16* k,
                               const Bf16* v, float* m, float* l, float* acc, float* work,
                               CpuPool* pool) {
  const float* qf = LoadToScratch(0, q, QueryFloats(s), pool);
  const float* kf = LoadToScratch(1, k, KeyFloats(s), pool);
  const float* vf = LoadToScratch(2, v, KeyFloats(s), pool);
  plateau::AttentionForwardBlock(s, qf, kf, vf, m, l, acc, work, pool);
}

void AttentionDeltaBf16(const AttentionShape& s, const float* o, const Bf16* dout, float* delta,
                        CpuPool* pool) {
  const float* d = LoadToScratch(0, dout, QueryFloats(s), pool);
  plateau::AttentionDelta(s, o, d, delta, pool);
}

void AttentionBackwardBlockBf16(const AttentionShape& s, const Bf16* q, const Bf16* k, const Bf16* v, const Bf16* dout,
                                const float* lse, const float* delta, float* dq, float* dk, float* dv, float* work,
                                CpuPool* pool) {
  const int64_t nq = QueryFloats(s), nk = KeyFloats(s);
  const float* qf = LoadToScratch(0, q, nq, pool);
  const float* kf = LoadToScratch(1, k, nk, pool);
  const float* vf = LoadToScratch(2, v, nk, pool);
  const float* df = LoadToScratch(3, dout, nq, pool);
  plateau::AttentionBackwardBlock(s, qf, kf, vf, df, lse, delta, dq, dk, dv, work, pool);
}

}  // namespace plateau::cpu
