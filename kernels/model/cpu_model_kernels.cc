#include "kernels/model/cpu_model_kernels.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cpu_stream.h"
#include "kernels/model/attention.h"
#include "kernels/model/attention_tc.h"
#include "kernels/model/cpu_bf16_layers.h"
#include "kernels/model/layers.h"

namespace plateau {
namespace {

class CpuModelKernels final : public ModelKernels {
 public:
  CpuModelKernels(std::shared_ptr<CpuPool> pool, const ModelKernelsOptions& options)
      : pool_(std::move(pool)), tensor_core_(options.bf16_attention == Bf16Attention::kTensorCore) {}

  Bf16Attention Bf16AttentionFor(const AttentionShape& /*shape*/) const override {
    return tensor_core_ ? Bf16Attention::kTensorCore : Bf16Attention::kTiles;
  }

 protected:
  absl::Status DoEmbedding(Stream& s, const float* table, int64_t vocab, const int32_t* tokens, int64_t rows, int64_t hidden, float* out) override {
    return Run(s, [=, p = pool_.get()] { EmbeddingForward(table, tokens, rows, hidden, out, p); });
  }

  absl::Status DoEmbeddingBackward(Stream& s, const float* dout, const int32_t* tokens, int64_t rows, int64_t hidden, float* dtable) override {
    return Run(s, [=, p = pool_.get()] { plateau::EmbeddingBackward(dout, tokens, rows, hidden, dtable, p); });
  }

  absl::Status DoRope(Stream& s, float* x, int64_t batch, int64_t len, int64_t heads, int64_t head_dim, int64_t pos0, float theta, bool inverse) override {
    return Run(s, [=, p = pool_.get()] { RopeApply(x, batch, len, heads, head_dim, pos0, theta, inverse, p); });
  }

  absl::Status DoAttentionInit(Stream& s, const AttentionShape& shape, float* m, float* l, float* acc) override {
    return Run(s, [=, p = pool_.get()] { AttentionInitState(shape, m, l, acc, p); });
  }

  absl::Status DoAttentionForwardBlock(Stream& s, const AttentionShape& shape, const float* q, const float* k, const float* v, float* m, float* l, float* acc, float* work) override {
    return Run(s, [=, p = pool_.get()] { plateau::AttentionForwardBlock(shape, q, k, v, m, l, acc, work, p); });
  }

  absl::Status DoAttentionFinalize(Stream& s, const AttentionShape& shape, const float* m, const float* l, float* acc_to_o, float* lse) override {
    return Run(s, [=, p = pool_.get()] { plateau::AttentionFinalize(shape, m, l, acc_to_o, lse, p); });
  }

  absl::Status DoAttentionDelta(Stream& s, const AttentionShape& shape, const float* o, const float* dout, float* delta) override {
    return Run(s, [=, p = pool_.get()] { plateau::AttentionDelta(shape, o, dout, delta, p); });
  }

  absl::Status DoAttentionBackwardBlock(Stream& s, const AttentionShape& shape, const float* q, const float* k, const float* v, const float* dout, const float* lse, const float* delta, float* dq, float* dk, float* dv, float* work) override {
    return Run(s, [=, p = pool_.get()] {
    plateau::AttentionBackwardBlock(shape, q, k, v, dout, lse, delta, dq, dk, dv, work, p);
  });
  }

  absl::Status DoRouter(Stream& s, const float* logits, int64_t rows, int64_t experts, int64_t top_k, float* probs, int32_t* chosen, float* gates) override {
    return Run(s, [=, p = pool_.get()] { RouterForward(logits, rows, experts, top_k, probs, chosen, gates, p); });
  }

  absl::Status DoRouterBackward(Stream& s, const float* probs, const int32_t* chosen, const float* gates, const float* dgates, int64_t rows, int64_t experts, int64_t top_k, float* dlogits) override {
    return Run(s, [=, p = pool_.get()] {
    plateau::RouterBackward(probs, chosen, gates, dgates, rows, experts, top_k, dlogits, p);
  });
  }

  absl::Status DoCrossEntropy(Stream& s, const float* logits, const int32_t* targets, int64_t rows, int64_t vocab, float* lse, double* stats) override {
    return Run(s, [=, p = pool_.get()] {
    int64_t valid = 0;
    stats[0] += CrossEntropyForward(logits, targets, rows, vocab, lse, &valid, p);
    stats[1] += static_cast<double>(valid);
  });
  }

  absl::Status DoCrossEntropyBackward(Stream& s, float* logits_to_grad, const float* lse, const int32_t* targets, int64_t rows, int64_t vocab, float scale) override {
    return Run(s, [=, p = pool_.get()] {
    plateau::CrossEntropyBackward(logits_to_grad, lse, targets, rows, vocab, scale, p);
  });
  }

  absl::Status DoGatherRows(Stream& s, const float* src, int64_t src_rows, const int32_t* index, const float* scales, int64_t rows, int64_t width, float* dst) override {
    return Run(s, [=, p = pool_.get()] { plateau::GatherRows(src, index, scales, rows, width, dst, p); });
  }

  absl::Status DoScatterRows(Stream& s, const float* src, int64_t rows, const int32_t* index, int64_t width, float* dst, int64_t /*dst_rows*/) override {
    return Run(s, [=, p = pool_.get()] { plateau::ScatterRows(src, rows, index, width, dst, p); });
  }

  absl::Status DoCombineRows(Stream& s, const float* src, const int32_t* pos, const float* weights, int64_t tokens, int64_t k, int64_t width, float* out) override {
    return Run(s, [=, p = pool_.get()] { plateau::CombineRows(src, pos, weights, tokens, k, width, out, p); });
  }

  absl::Status DoRowDots(Stream& s, const float* a, const float* b, const int32_t* pos, int64_t tokens, int64_t k, int64_t width, float* out) override {
    return Run(s, [=, p = pool_.get()] { plateau::RowDots(a, b, pos, tokens, k, width, out, p); });
  }

  absl::Status DoStripInit(Stream& s, float* state, int64_t rows) override {
    return Run(s, [=] {
    std::fill(state, state + rows, -INFINITY);
    std::fill(state + rows, state + 3 * rows, 0.0f);
  });
  }

  absl::Status DoStripFold(Stream& s, const float* logits, int64_t rows, int64_t width, int64_t col0, const int32_t* targets, float* state, int64_t stride) override {
    return Run(s, [=, p = pool_.get()] {
    plateau::StripFold(logits, rows, width, col0, targets, state, state + stride,
                       state + 2 * stride, p);
  });
  }

  absl::Status DoStripFinish(Stream& s, const float* state, const int32_t* targets, int64_t rows, float* lse, double* stats) override {
    return Run(s, [=] {
    int64_t valid = 0;
    stats[0] += plateau::StripFinish(state, state + rows, state + 2 * rows, targets, rows, lse,
                                     &valid);
    stats[1] += static_cast<double>(valid);
  });
  }

  absl::Status DoStripDelta(Stream& s, float* logits_to_delta, int64_t rows, int64_t width, int64_t col0, const int32_t* targets, const float* lse, float scale) override {
    return Run(s, [=, p = pool_.get()] {
    plateau::StripDelta(logits_to_delta, rows, width, col0, targets, lse, scale, p);
  });
  }

  // bf16 mixed precision: the emulation of cpu_bf16_layers.h.
  absl::Status DoEmbeddingBf16(Stream& s, const Bf16* table, int64_t /*vocab*/, const int32_t* tokens, int64_t rows, int64_t hidden, Bf16* out) override {
    return Run(s, [=, p = pool_.get()] { cpu::EmbeddingForwardBf16(table, tokens, rows, hidden, out, p); });
  }
  absl::Status DoEmbeddingBackwardBf16(Stream& s, const Bf16* dout, const int32_t* tokens, int64_t rows, int64_t hidden, Bf16* dtable, int64_t vocab) override {
    return Run(s, [=, p = pool_.get()] { cpu::EmbeddingBackwardBf16(dout, tokens, rows, hidden, dtable, vocab, p); });
  }
  absl::Status DoGatherRowsBf16(Stream& s, const Bf16* src, int64_t src_rows, const int32_t* index, const float* scales, int64_t rows, int64_t width, Bf16* dst) override {
    return Run(s, [=, p = pool_.get()] { cpu::GatherRowsBf16(src, src_rows, index, scales, rows, width, dst, p); });
  }
  absl::Status DoScatterRowsBf16(Stream& s, const Bf16* src, int64_t rows, const int32_t* index, int64_t width, Bf16* dst, int64_t /*dst_rows*/) override {
    return Run(s, [=, p = pool_.get()] { cpu::ScatterRowsBf16(src, rows, index, width, dst, p); });
  }
  absl::Status DoCombineRowsBf16(Stream& s, const Bf16* src, int64_t src_rows, const int32_t* pos, const float* weights, int64_t tokens, int64_t k, int64_t width, Bf16* out) override {
    return Run(s, [=, p = pool_.get()] { cpu::CombineRowsBf16(src, src_rows, pos, weights, tokens, k, width, out, p); });
  }
  absl::Status DoRowDotsBf16(Stream& s, const Bf16* a, const Bf16* b, int64_t b_rows, const int32_t* pos, int64_t tokens, int64_t k, int64_t width, float* out) override {
    return Run(s, [=, p = pool_.get()] { cpu::RowDotsBf16(a, b, b_rows, pos, tokens, k, width, out, p); });
  }
  absl::Status DoRopeBf16(Stream& s, Bf16* x, int64_t batch, int64_t len, int64_t heads, int64_t head_dim, int64_t pos0, float theta, bool inverse) override {
    return Run(s, [=, p = pool_.get()] { cpu::RopeBf16(x, batch, len, heads, head_dim, pos0, theta, inverse, p); });
  }
  absl::Status DoCrossEntropyBf16(Stream& s, const Bf16* logits, const int32_t* targets, int64_t rows, int64_t vocab, float* lse, double* stats) override {
    return Run(s, [=, p = pool_.get()] {
      int64_t valid = 0;
      stats[0] += cpu::CrossEntropyForwardBf16(logits, targets, rows, vocab, lse, &valid, p);
      stats[1] += static_cast<double>(valid);
    });
  }
  absl::Status DoCrossEntropyBackwardBf16(Stream& s, Bf16* logits_to_grad, const float* lse, const int32_t* targets, int64_t rows, int64_t vocab, float scale) override {
    return Run(s, [=, p = pool_.get()] { cpu::CrossEntropyBackwardBf16(logits_to_grad, lse, targets, rows, vocab, scale, p); });
  }
  absl::Status DoStripFoldBf16(Stream& s, const Bf16* logits, int64_t rows, int64_t width, int64_t col0, const int32_t* targets, float* state, int64_t stride) override {
    return Run(s, [=, p = pool_.get()] {
      cpu::StripFoldBf16(logits, rows, width, col0, targets, state, state + stride, state + 2 * stride, p);
    });
  }
  absl::Status DoStripDeltaBf16(Stream& s, Bf16* logits_to_delta, int64_t rows, int64_t width, int64_t col0, const int32_t* targets, const float* lse, float scale) override {
    return Run(s, [=, p = pool_.get()] { cpu::StripDeltaBf16(logits_to_delta, rows, width, col0, targets, lse, scale, p); });
  }
  absl::Status DoAttentionForwardBlockBf16(Stream& s, const AttentionShape& shape, const Bf16* q, const Bf16* k, const Bf16* v, float* m, float* l, float* acc, float* work) override {
    if (tensor_core_) {
      return Run(s, [=] { TensorCoreAttentionForward(shape, q, k, v, m, l, acc); });
    }
    return Run(s, [=, p = pool_.get()] { cpu::AttentionForwardBlockBf16(shape, q, k, v, m, l, acc, work, p); });
  }
  absl::Status DoAttentionDeltaBf16(Stream& s, const AttentionShape& shape, const float* o, const Bf16* dout, float* delta) override {
    return Run(s, [=, p = pool_.get()] { cpu::AttentionDeltaBf16(shape, o, dout, delta, p); });
  }
  absl::Status DoAttentionBackwardBlockBf16(Stream& s, const AttentionShape& shape, const Bf16* q, const Bf16* k,
                                            const Bf16* v, const Bf16* dout, const float* lse, const float* delta,
                                            float* dq, float* dk, float* dv, float* work) override {
    if (tensor_core_) {
      return Run(s, [=] { TensorCoreAttentionBackward(shape, q, k, v, dout, lse, delta, dq, dk, dv, work); });
    }
    return Run(s, [=, p = pool_.get()] { cpu::AttentionBackwardBlockBf16(shape, q, k, v, dout, lse, delta, dq, dk, dv, work, p); });
  }

 private:
  // Runs `fn` on the stream in order with the rest of its work.
  static absl::Status Run(Stream& s, std::function<void()> fn) {
    auto* cs = dynamic_cast<CpuStream*>(&s);
    if (cs == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("stream '", s.name(), "' does not belong to the CPU backend"));
    }
    cs->Enqueue([fn = std::move(fn)] {
      fn();
      return absl::OkStatus();
    });
    return absl::OkStatus();
  }

  // The backend's pool (kernels/cpu_pool.h); may be null (serial).
  const std::shared_ptr<CpuPool> pool_;
  const bool tensor_core_;  // bf16 attention in attention_tc.h's arithmetic
};

}  // namespace

std::unique_ptr<ModelKernels> CreateCpuModelKernels(std::shared_ptr<CpuPool> pool,
                                                    const ModelKernelsOptions& options) {
  return std::make_unique<CpuModelKernels>(std::move(pool), options);
}

}  // namespace plateau
