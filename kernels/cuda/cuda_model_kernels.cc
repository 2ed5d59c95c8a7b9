#include "kernels/cuda/cuda_model_kernels.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/cuda_attention_tc.h"
#include "kernels/cuda/cuda_attention_wgmma.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_model_ops.h"
#include "kernels/cuda/stream_errors.h"
#include "kernels/cuda/wgmma_attention_check.h"
#include "kernels/cuda/wgmma_probe.h"
#include "kernels/model/attention_tc.h"
#include "kernels/model/config.h"
#include "kernels/status_macros.h"

namespace plateau {
namespace {

static_assert(kIgnoreIndex == -1,
              "cuda_model_ops.cu hard-codes kIgnoreIndex as -1");

// The stream's cudaStream_t, with its device made current on this thread
// (the caller's thread may have another device current).
absl::StatusOr<cudaStream_t> Native(absl::string_view op, Stream& s) {
  auto stream = static_cast<cudaStream_t>(s.native_handle());
  if (stream == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": stream '", s.name(), "' does not belong to a CUDA backend"));
  }
  int device = 0;
  PLATEAU_CUDA_RETURN_IF_ERROR(cudaStreamGetDevice(stream, &device));
  PLATEAU_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  return stream;
}

cuda_model_ops::AttentionDims Dims(const AttentionShape& s) {
  return {s.batch,   s.q_len,    s.kv_len,  s.heads, s.kv_heads,
          s.head_dim, s.q_pos0, s.kv_pos0, s.scale};
}

// The attention kernels' tiles of one row must fit shared memory
// (cuda_model_ops::AttentionTile): head_dim up to about 3000.
absl::Status CheckHeadDim(absl::string_view op, const AttentionShape& s) {
  if (cuda_model_ops::AttentionTile(s.head_dim) > 0) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(
      op, " is not implemented on the cuda backend for head_dim = ",
      s.head_dim, " (its tiles do not fit 48 KiB of shared memory)"));
}

// Enqueues one kernel with the stream's sticky error (stream.h,
// stream_errors.h): a stream that has failed skips it; a launch that fails
// becomes the stream's error and is returned.
#define PLATEAU_LAUNCH(op, s, launcher, ...)                                \
  do {                                                                      \
    PLATEAU_ASSIGN_OR_RETURN(cudaStream_t native_, Native(op, s));          \
    if (!CudaStreamError(native_).ok()) return absl::OkStatus();            \
    const cudaError_t launch_error_ = launcher(native_, __VA_ARGS__);       \
    if (launch_error_ != cudaSuccess) {                                     \
      absl::Status launch_status_ =                                         \
          CudaStatus(launch_error_, #launcher, __FILE__, __LINE__);         \
      launch_status_ = absl::Status(                                        \
          launch_status_.code(), absl::StrCat("stream '", (s).name(), "': ", \
                                              launch_status_.message()));   \
      (void)FailCudaStream(native_, launch_status_);                        \
      return launch_status_;                                                \
    }                                                                       \
    return absl::OkStatus();                                                \
  } while (0)

// The tensor-core kernels load 16 bytes at a time.
bool Aligned16(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

class CudaModelKernels final : public ModelKernels {
 public:
  // `smem_optin`: the device's cudaDevAttrMaxSharedMemoryPerBlockOptin;
  // `stages64`, `stages128`: the tensor-core kernels' buffering at those
  // head_dims on it (ChooseAttentionTcStages) and whether they run on
  // wgmma; `wgmma_note`: why it does or does not, for Describe.
  CudaModelKernels(const ModelKernelsOptions& options, int smem_optin,
                   const cuda_model_ops::AttentionTcStages& stages64,
                   const cuda_model_ops::AttentionTcStages& stages128, std::string wgmma_note)
      : bf16_attention_(options.bf16_attention),
        smem_optin_(smem_optin),
        stages64_(stages64),
        stages128_(stages128),
        wgmma_note_(std::move(wgmma_note)) {}

  Bf16Attention Bf16AttentionFor(const AttentionShape& shape) const override {
    switch (bf16_attention_) {
      case Bf16Attention::kAuto:
        return TensorCoresTake(shape.head_dim) ? Bf16Attention::kTensorCore
                                               : Bf16Attention::kTiles;
      case Bf16Attention::kTiles:
      case Bf16Attention::kTensorCore:
        return bf16_attention_;
    }
    return Bf16Attention::kTiles;
  }

 protected:
  absl::Status DoEmbedding(Stream& s, const float* table, int64_t /*vocab*/,
                           const int32_t* tokens, int64_t rows, int64_t hidden,
                           float* out) override {
    PLATEAU_LAUNCH("embedding", s, cuda_model_ops::Embedding, table, tokens,
                   rows, hidden, out);
  }
  absl::Status DoEmbeddingBackward(Stream& s, const float* dout,
                                   const int32_t* tokens, int64_t rows,
                                   int64_t hidden, float* dtable) override {
    PLATEAU_LAUNCH("embedding_backward", s, cuda_model_ops::EmbeddingBackward,
                   dout, tokens, rows, hidden, dtable);
  }
  // The CPU's own expression (attention.cc), so both form the same angles.
  static cuda_model_ops::RopeFreqs RopeFreqsOf(int64_t head_dim, float theta) {
    cuda_model_ops::RopeFreqs freqs{};
    for (int64_t j = 0; j < head_dim / 2; ++j) {
      freqs.freq[j] = std::pow(theta, -2.0f * static_cast<float>(j) /
                                          static_cast<float>(head_dim));
    }
    return freqs;
  }
  absl::Status DoRope(Stream& s, float* x, int64_t batch, int64_t len,
                      int64_t heads, int64_t head_dim, int64_t pos0,
                      float theta, bool inverse) override {
    const int64_t half = head_dim / 2;
    if (half > cuda_model_ops::kMaxRopeHalf) {
      return absl::UnimplementedError(absl::StrCat(
          "rope is not implemented on the cuda backend for head_dim > ",
          2 * cuda_model_ops::kMaxRopeHalf, " (got ", head_dim, ")"));
    }
    const cuda_model_ops::RopeFreqs freqs = RopeFreqsOf(head_dim, theta);
    PLATEAU_LAUNCH("rope", s, cuda_model_ops::Rope, x, batch, len, heads,
                   head_dim, pos0, freqs, inverse);
  }
  // Attention: fp32 tiled kernels (cuda_model_ops.h). `work` is not used:
  // the kernels keep their tiles in shared memory and the state in the
  // caller's m, l and acc, so they need none of the scratch the budget plans
  // for the CPU twin.
  absl::Status DoAttentionInit(Stream& s, const AttentionShape& shape,
                               float* m, float* l, float* acc) override {
    PLATEAU_LAUNCH("attention_init", s, cuda_model_ops::AttentionInit,
                   Dims(shape), m, l, acc);
  }
  absl::Status DoAttentionForwardBlock(Stream& s, const AttentionShape& shape,
                                       const float* q, const float* k,
                                       const float* v, float* m, float* l,
                                       float* acc, float* /*work*/) override {
    PLATEAU_RETURN_IF_ERROR(CheckHeadDim("attention_forward_block", shape));
    PLATEAU_LAUNCH("attention_forward_block", s,
                   cuda_model_ops::AttentionForwardBlock, Dims(shape), q, k, v,
                   m, l, acc);
  }
  absl::Status DoAttentionFinalize(Stream& s, const AttentionShape& shape,
                                   const float* m, const float* l,
                                   float* acc_to_o, float* lse) override {
    PLATEAU_LAUNCH("attention_finalize", s, cuda_model_ops::AttentionFinalize,
                   Dims(shape), m, l, acc_to_o, lse);
  }
  absl::Status DoAttentionDelta(Stream& s, const AttentionShape& shape,
                                const float* o, const float* dout,
                                float* delta) override {
    PLATEAU_LAUNCH("attention_delta", s, cuda_model_ops::AttentionDelta,
                   Dims(shape), o, dout, delta);
  }
  absl::Status DoAttentionBackwardBlock(Stream& s, const AttentionShape& shape,
                                        const float* q, const float* k,
                                        const float* v, const float* dout,
                                        const float* lse, const float* delta,
                                        float* dq, float* dk, float* dv,
                                        float* /*work*/) override {
    PLATEAU_RETURN_IF_ERROR(CheckHeadDim("attention_backward_block", shape));
    PLATEAU_LAUNCH("attention_backward_block", s,
                   cuda_model_ops::AttentionBackwardBlock, Dims(shape), q, k,
                   v, dout, lse, delta, dq, dk, dv);
  }
  absl::Status DoRouter(Stream& s, const float* logits, int64_t rows,
                        int64_t experts, int64_t top_k, float* probs,
                        int32_t* chosen, float* gates) override {
    PLATEAU_LAUNCH("router", s, cuda_model_ops::Router, logits, rows, experts,
                   top_k, probs, chosen, gates);
  }
  absl::Status DoRouterBackward(Stream& s, const float* probs,
                                const int32_t* chosen, const float* gates,
                                const float* dgates, int64_t rows,
                                int64_t experts, int64_t top_k,
                                float* dlogits) override {
    PLATEAU_LAUNCH("router_backward", s, cuda_model_ops::RouterBackward, probs,
                   chosen, gates, dgates, rows, experts, top_k, dlogits);
  }
  absl::Status DoCrossEntropy(Stream& s, const float* logits,
                              const int32_t* targets, int64_t rows,
                              int64_t vocab, float* lse,
                              double* stats) override {
    PLATEAU_LAUNCH("cross_entropy", s, cuda_model_ops::CrossEntropy, logits,
                   targets, rows, vocab, lse, stats);
  }
  absl::Status DoCrossEntropyBackward(Stream& s, float* logits_to_grad,
                                      const float* lse, const int32_t* targets,
                                      int64_t rows, int64_t vocab,
                                      float scale) override {
    PLATEAU_LAUNCH("cross_entropy_backward", s,
                   cuda_model_ops::CrossEntropyBackward, logits_to_grad, lse,
                   targets, rows, vocab, scale);
  }
  absl::Status DoGatherRows(Stream& s, const float* src, int64_t /*src_rows*/,
                            const int32_t* index, const float* scales,
                            int64_t rows, int64_t width, float* dst) override {
    PLATEAU_LAUNCH("gather_rows", s, cuda_model_ops::GatherRows, src, index,
                   scales, rows, width, dst);
  }
  absl::Status DoScatterRows(Stream& s, const float* src, int64_t rows,
                             const int32_t* index, int64_t width, float* dst,
                             int64_t /*dst_rows*/) override {
    PLATEAU_LAUNCH("scatter_rows", s, cuda_model_ops::ScatterRows, src, rows,
                   index, width, dst);
  }
  absl::Status DoCombineRows(Stream& s, const float* src, const int32_t* pos,
                             const float* weights, int64_t tokens, int64_t k,
                             int64_t width, float* out) override {
    PLATEAU_LAUNCH("combine_rows", s, cuda_model_ops::CombineRows, src, pos,
                   weights, tokens, k, width, out);
  }
  absl::Status DoRowDots(Stream& s, const float* a, const float* b,
                         const int32_t* pos, int64_t tokens, int64_t k,
                         int64_t width, float* out) override {
    PLATEAU_LAUNCH("row_dots", s, cuda_model_ops::RowDots, a, b, pos, tokens,
                   k, width, out);
  }
  // bf16 mixed precision (cuda_model_ops.h): every bf16 op of ModelKernels.
  static const uint16_t* Bits(const Bf16* p) { return reinterpret_cast<const uint16_t*>(p); }
  static uint16_t* Bits(Bf16* p) { return reinterpret_cast<uint16_t*>(p); }
  absl::Status DoEmbeddingBf16(Stream& s, const Bf16* table, int64_t /*vocab*/,
                               const int32_t* tokens, int64_t rows, int64_t hidden,
                               Bf16* out) override {
    PLATEAU_LAUNCH("embedding_bf16", s, cuda_model_ops::EmbeddingBf16, Bits(table), tokens, rows,
                   hidden, Bits(out));
  }
  absl::Status DoEmbeddingBackwardBf16(Stream& s, const Bf16* dout, const int32_t* tokens,
                                       int64_t rows, int64_t hidden, Bf16* dtable,
                                       int64_t /*vocab*/) override {
    PLATEAU_LAUNCH("embedding_backward_bf16", s, cuda_model_ops::EmbeddingBackwardBf16,
                   Bits(dout), tokens, rows, hidden, Bits(dtable));
  }
  // Attention on bf16 q, k, v, dO, in the arithmetic Bf16AttentionFor
  // names: the tensor-core kernels (cuda_attention_tc.h), or the fp32
  // kernels' tiles and arithmetic on the loaded values. Under kAuto a
  // pointer off 16 bytes takes the tiled kernels; asked for tensor cores,
  // it is an error. `work` unused, as in fp32.
  absl::StatusOr<bool> UseTensorCores(absl::string_view op, const AttentionShape& shape,
                                      std::initializer_list<const void*> pointers) const {
    if (Bf16AttentionFor(shape) != Bf16Attention::kTensorCore) return false;
    if (!TensorCoreHeadDim(shape.head_dim)) {
      return absl::UnimplementedError(absl::StrCat(
          op, ": the tensor-core attention kernels take head_dim 64 or 128, not ",
          shape.head_dim, " (bf16_attention = tiles or auto runs the tiled kernels)"));
    }
    if (!TensorCoresTake(shape.head_dim)) {
      return absl::UnimplementedError(absl::StrCat(
          op, ": the tensor-core attention kernels need ",
          cuda_model_ops::AttentionTcSmemBytes(shape.head_dim),
          " bytes of shared memory per block at head_dim ", shape.head_dim,
          "; this device allows ", smem_optin_,
          " (bf16_attention = tiles or auto runs the tiled kernels)"));
    }
    if (Aligned16(pointers)) return true;
    if (bf16_attention_ == Bf16Attention::kAuto) return false;
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": the tensor-core attention kernels need 16-byte aligned q, k, v, dout and dq"));
  }
  // Kernels exist for the head_dim and fit the device's shared memory.
  bool TensorCoresTake(int64_t head_dim) const {
    return TensorCoreHeadDim(head_dim) &&
           cuda_model_ops::AttentionTcSmemBytes(head_dim) <= smem_optin_;
  }
  std::string Describe() const override {
    auto stages = [&](int64_t head_dim) {
      if (!TensorCoresTake(head_dim)) return std::string("none (tiled kernels)");
      const cuda_model_ops::AttentionTcStages& s = Stages(head_dim);
      return absl::StrCat(s.forward, "/", s.dq, "/", s.dkv);
    };
    return absl::StrCat("tensor-core attention buffers (forward/dQ/dKdV): head_dim 64 ", stages(64),
                        ", head_dim 128 ", stages(128), "; opt-in shared memory ", smem_optin_,
                        " bytes; on wgmma: ", wgmma_note_);
  }
  const cuda_model_ops::AttentionTcStages& Stages(int64_t head_dim) const {
    return head_dim == 64 ? stages64_ : stages128_;
  }
  absl::Status DoAttentionForwardBlockBf16(Stream& s, const AttentionShape& shape, const Bf16* q,
                                           const Bf16* k, const Bf16* v, float* m, float* l,
                                           float* acc, float* /*work*/) override {
    PLATEAU_ASSIGN_OR_RETURN(const bool tc,
                             UseTensorCores("attention_forward_block_bf16", shape, {q, k, v}));
    if (tc && Stages(shape.head_dim).wgmma) {
      PLATEAU_LAUNCH("attention_forward_block_bf16", s, cuda_model_ops::AttentionForwardBlockWg,
                     Dims(shape), Stages(shape.head_dim).forward, Bits(q), Bits(k), Bits(v), m, l,
                     acc);
    }
    if (tc) {
      PLATEAU_LAUNCH("attention_forward_block_bf16", s, cuda_model_ops::AttentionForwardBlockTc,
                     Dims(shape), Stages(shape.head_dim), Bits(q), Bits(k), Bits(v), m, l, acc);
    }
    PLATEAU_RETURN_IF_ERROR(CheckHeadDim("attention_forward_block_bf16", shape));
    PLATEAU_LAUNCH("attention_forward_block_bf16", s, cuda_model_ops::AttentionForwardBlockBf16,
                   Dims(shape), Bits(q), Bits(k), Bits(v), m, l, acc);
  }
  absl::Status DoAttentionDeltaBf16(Stream& s, const AttentionShape& shape, const float* o,
                                    const Bf16* dout, float* delta) override {
    PLATEAU_LAUNCH("attention_delta_bf16", s, cuda_model_ops::AttentionDeltaBf16, Dims(shape), o,
                   Bits(dout), delta);
  }
  absl::Status DoAttentionBackwardBlockBf16(Stream& s, const AttentionShape& shape, const Bf16* q, const Bf16* k,
                                            const Bf16* v, const Bf16* dout, const float* lse, const float* delta,
                                            float* dq, float* dk, float* dv, float* /*work*/) override {
    PLATEAU_ASSIGN_OR_RETURN(
        const bool tc,
        UseTensorCores("attention_backward_block_bf16", shape, {q, k, v, dout, dq}));
    if (tc && Stages(shape.head_dim).wgmma) {
      PLATEAU_LAUNCH("attention_backward_block_bf16", s, cuda_model_ops::AttentionBackwardBlockWg, Dims(shape),
                     Stages(shape.head_dim), Bits(q), Bits(k), Bits(v), Bits(dout), lse, delta, dq, dk, dv);
    }
    if (tc) {
      PLATEAU_LAUNCH("attention_backward_block_bf16", s, cuda_model_ops::AttentionBackwardBlockTc, Dims(shape),
                     Stages(shape.head_dim), Bits(q), Bits(k), Bits(v), Bits(dout), lse, delta, dq, dk, dv);
    }
    PLATEAU_RETURN_IF_ERROR(CheckHeadDim("attention_backward_block_bf16", shape));
    PLATEAU_LAUNCH("attention_backward_block_bf16", s, cuda_model_ops::AttentionBackwardBlockBf16, Dims(shape), Bits(q),
                   Bits(k), Bits(v), Bits(dout), lse, delta, dq, dk, dv);
  }
  absl::Status DoGatherRowsBf16(Stream& s, const Bf16* src, int64_t /*src_rows*/,
                                const int32_t* index, const float* scales, int64_t rows,
                                int64_t width, Bf16* dst) override {
    PLATEAU_LAUNCH("gather_rows_bf16", s, cuda_model_ops::GatherRowsBf16, Bits(src), index,
                   scales, rows, width, Bits(dst));
  }
  absl::Status DoScatterRowsBf16(Stream& s, const Bf16* src, int64_t rows, const int32_t* index,
                                 int64_t width, Bf16* dst, int64_t /*dst_rows*/) override {
    PLATEAU_LAUNCH("scatter_rows_bf16", s, cuda_model_ops::ScatterRowsBf16, Bits(src), rows,
                   index, width, Bits(dst));
  }
  absl::Status DoCombineRowsBf16(Stream& s, const Bf16* src, int64_t /*src_rows*/,
                                 const int32_t* pos, const float* weights, int64_t tokens,
                                 int64_t k, int64_t width, Bf16* out) override {
    PLATEAU_LAUNCH("combine_rows_bf16", s, cuda_model_ops::CombineRowsBf16, Bits(src), pos,
                   weights, tokens, k, width, Bits(out));
  }
  absl::Status DoRowDotsBf16(Stream& s, const Bf16* a, const Bf16* b, int64_t /*b_rows*/,
                             const int32_t* pos, int64_t tokens, int64_t k, int64_t width,
                             float* out) override {
    PLATEAU_LAUNCH("row_dots_bf16", s, cuda_model_ops::RowDotsBf16, Bits(a), Bits(b), pos,
                   tokens, k, width, out);
  }
  absl::Status DoRopeBf16(Stream& s, Bf16* x, int64_t batch, int64_t len, int64_t heads,
                          int64_t head_dim, int64_t pos0, float theta, bool inverse) override {
    if (head_dim / 2 > cuda_model_ops::kMaxRopeHalf) {
      return absl::UnimplementedError(absl::StrCat(
          "rope_bf16 is not implemented on the cuda backend for head_dim > ",
          2 * cuda_model_ops::kMaxRopeHalf, " (got ", head_dim, ")"));
    }
    const cuda_model_ops::RopeFreqs freqs = RopeFreqsOf(head_dim, theta);
    PLATEAU_LAUNCH("rope_bf16", s, cuda_model_ops::RopeBf16, Bits(x), batch, len, heads, head_dim,
                   pos0, freqs, inverse);
  }
  absl::Status DoCrossEntropyBf16(Stream& s, const Bf16* logits, const int32_t* targets,
                                  int64_t rows, int64_t vocab, float* lse,
                                  double* stats) override {
    PLATEAU_LAUNCH("cross_entropy_bf16", s, cuda_model_ops::CrossEntropyBf16, Bits(logits),
                   targets, rows, vocab, lse, stats);
  }
  absl::Status DoCrossEntropyBackwardBf16(Stream& s, Bf16* logits_to_grad, const float* lse,
                                          const int32_t* targets, int64_t rows, int64_t vocab,
                                          float scale) override {
    PLATEAU_LAUNCH("cross_entropy_backward_bf16", s, cuda_model_ops::CrossEntropyBackwardBf16,
                   Bits(logits_to_grad), lse, targets, rows, vocab, scale);
  }
  absl::Status DoStripFoldBf16(Stream& s, const Bf16* logits, int64_t rows, int64_t width,
                               int64_t col0, const int32_t* targets, float* state,
                               int64_t stride) override {
    PLATEAU_LAUNCH("strip_fold_bf16", s, cuda_model_ops::StripFoldBf16, Bits(logits), rows, width,
                   col0, targets, state, stride);
  }
  absl::Status DoStripDeltaBf16(Stream& s, Bf16* logits_to_delta, int64_t rows, int64_t width,
                                int64_t col0, const int32_t* targets, const float* lse,
                                float scale) override {
    PLATEAU_LAUNCH("strip_delta_bf16", s, cuda_model_ops::StripDeltaBf16, Bits(logits_to_delta),
                   rows, width, col0, targets, lse, scale);
  }
  absl::Status DoStripInit(Stream& s, float* state, int64_t rows) override {
    PLATEAU_LAUNCH("strip_init", s, cuda_model_ops::StripInit, state, rows);
  }
  absl::Status DoStripFold(Stream& s, const float* logits, int64_t rows,
                           int64_t width, int64_t col0, const int32_t* targets,
                           float* state, int64_t stride) override {
    PLATEAU_LAUNCH("strip_fold", s, cuda_model_ops::StripFold, logits, rows,
                   width, col0, targets, state, stride);
  }
  absl::Status DoStripFinish(Stream& s, const float* state,
                             const int32_t* targets, int64_t rows, float* lse,
                             double* stats) override {
    PLATEAU_LAUNCH("strip_finish", s, cuda_model_ops::StripFinish, state,
                   targets, rows, lse, stats);
  }
  absl::Status DoStripDelta(Stream& s, float* logits_to_delta, int64_t rows,
                            int64_t width, int64_t col0, const int32_t* targets,
                            const float* lse, float scale) override {
    PLATEAU_LAUNCH("strip_delta", s, cuda_model_ops::StripDelta,
                   logits_to_delta, rows, width, col0, targets, lse, scale);
  }

 private:
  const Bf16Attention bf16_attention_;  // as asked (Bf16AttentionFor resolves kAuto)
  const int smem_optin_;                // bytes a block may opt in to on this device
  const cuda_model_ops::AttentionTcStages stages64_, stages128_;
  const std::string wgmma_note_;
};

#undef PLATEAU_LAUNCH

// Whether a device runs the wgmma kernels, and with which buffers.
struct WgmmaChoice {
  bool agrees = false;
  std::string why;  // why not, where not
  cuda_model_ops::AttentionTcStages stages64, stages128;
};

// The wgmma kernels: an H100/H200 only (sm_90a code, the caller checks
// compute capability 9.0), and only where the probe's products agree with
// their reference on this device and the kernels' own outputs with the
// mma.sync kernels' (`mma64`, `mma128`; wgmma_probe.h,
// wgmma_attention_check.h): a misreading of the PTX ISA (which nothing
// without such a GPU can catch) then costs speed, never a wrong result.
// Decided once per device and buffering in a process: the check launches a
// few small kernels (milliseconds on a GPU; about three seconds on the
// CPU emulation, where tests create many backends).
absl::StatusOr<WgmmaChoice> ChooseWgmma(int device, int smem_optin, bool double_buffer,
                                        const cuda_model_ops::AttentionTcStages& mma64,
                                        const cuda_model_ops::AttentionTcStages& mma128) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* decided = new std::map<std::tuple<int, int, bool>, WgmmaChoice>;
  absl::MutexLock lock(&mu);
  const std::tuple<int, int, bool> key{device, smem_optin, double_buffer};
  if (auto it = decided->find(key); it != decided->end()) return it->second;
  WgmmaChoice c{false, "", mma64, mma128};
  // A CUDA error on the way that is not a device fault (a launch or load
  // refused) keeps mma.sync, as a disagreement does: the wgmma kernels are
  // a speed-up, and a refusal of theirs must not fail every bf16 step. A
  // device fault has poisoned the context and is returned.
  cudaError_t error = cudaSuccess;
  const char* failed = "";
  const auto ok = [&](cudaError_t e, const char* what) {
    if (e == cudaSuccess) return true;
    error = e;
    failed = what;
    return false;
  };
  if (ok(cuda_wgmma::WgmmaProbeCheck(&c.agrees, &c.why), "the wgmma probe")) {
    if (!c.agrees) c.why = absl::StrCat("the probe disagrees: ", c.why);
    if (c.agrees && ok(cuda_model_ops::LoadAttentionWgKernels(smem_optin), "loading the wgmma kernels")) {
      for (auto [head_dim, stages] : {std::pair{64, &c.stages64}, {128, &c.stages128}}) {
        if (!c.agrees || cuda_model_ops::AttentionTcSmemBytes(head_dim) > smem_optin) continue;
        stages->wgmma = true;
        if (!ok(cuda_model_ops::ChooseAttentionWgStages(head_dim, smem_optin, double_buffer, stages),
                "choosing the wgmma kernels' buffering") ||
            !ok(cuda_model_ops::CheckAttentionWgAgainstTc(head_dim, head_dim == 64 ? mma64 : mma128, *stages, &c.agrees,
                                                          &c.why),
                "checking the wgmma kernels against mma.sync")) {
          break;
        }
        if (!c.agrees) c.why = absl::StrCat("the kernels disagree with mma.sync: ", c.why);
      }
    }
  }
  if (error != cudaSuccess) {
    if (IsCudaDeviceFault(error)) return CudaStatus(error, failed, __FILE__, __LINE__);
    (void)cudaGetLastError();
    // An error IsCudaDeviceFault does not name may still have broken the
    // context (drivers differ in what they report): if the device no longer
    // synchronises once it is cleared, that is the result, not a fallback
    // to mma.sync whose first kernel of the step would take the blame.
    if (const cudaError_t sticky = cudaDeviceSynchronize(); sticky != cudaSuccess) {
      return CudaStatus(sticky, failed, __FILE__, __LINE__);
    }
    c.agrees = false;
    c.why = absl::StrCat(failed, " failed: ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
  }
  if (!c.agrees) {
    c.stages64 = mma64;
    c.stages128 = mma128;
    std::fprintf(stderr, "plateau: tensor-core attention stays on mma.sync: %s\n", c.why.c_str());
  }
  decided->emplace(key, c);
  return c;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelKernels>> CreateCudaModelKernels(
    Backend& backend, const ModelKernelsOptions& options) {
  if (backend.kind() != BackendKind::kCuda) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda model kernels: backend is ", BackendKindName(backend.kind()),
        ", not cuda"));
  }
  // The backend's device, made current on this thread (which may have had
  // another): the module loads, shared-memory opt-ins and buffering choice
  // below are the current device's, and the launches run on the backend's.
  PLATEAU_ASSIGN_OR_RETURN(const DeviceView view, backend.QueryDevice());
  const int device = view.device_index;
  PLATEAU_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  // Load every model kernel now, not at its first launch mid-step.
  PLATEAU_CUDA_RETURN_IF_ERROR(cuda_model_ops::LoadKernels());
  // What a block may opt in to (227 KiB on sm_90, 163 KiB on sm_80, 99 KiB
  // on sm_86/sm_89): the tensor-core kernels at head_dim 128 need 68.5 KiB
  // single-buffered, and double-buffer (up to 103 KiB) where that fits and
  // keeps as many blocks resident (ChooseAttentionTcStages).
  int smem_optin = 0;
  PLATEAU_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  PLATEAU_CUDA_RETURN_IF_ERROR(cuda_model_ops::LoadAttentionTcKernels(smem_optin));
  cuda_model_ops::AttentionTcStages stages64, stages128;
  for (auto [head_dim, stages] : {std::pair{64, &stages64}, {128, &stages128}}) {
    if (cuda_model_ops::AttentionTcSmemBytes(head_dim) > smem_optin) continue;  // never launched
    PLATEAU_CUDA_RETURN_IF_ERROR(cuda_model_ops::ChooseAttentionTcStages(
        head_dim, smem_optin, options.tc_double_buffer, stages));
  }
  int major = 0, minor = 0;
  PLATEAU_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  PLATEAU_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  std::string wgmma_note;
  // PLATEAU_TC_WGMMA=0 turns them off for the whole process, whatever the
  // options say: tools/device-check sets it for its later stages when the
  // wgmma probe's own test failed on the device.
  const char* env = std::getenv("PLATEAU_TC_WGMMA");
  if (!options.tc_wgmma) {
    wgmma_note = "no (turned off)";
  } else if (env != nullptr && std::string(env) == "0") {
    wgmma_note = "no (turned off by PLATEAU_TC_WGMMA=0)";
  } else if (options.bf16_attention == Bf16Attention::kTiles) {
    // Nothing would launch them: no probe, no check (model_kernels.h).
    wgmma_note = "no (not needed: bf16 attention on the tiled kernels, or an fp32 step)";
  } else if (major != 9 || minor != 0) {
    wgmma_note = absl::StrCat("no (compute capability ", major, ".", minor, ", not 9.0)");
  } else {
    PLATEAU_ASSIGN_OR_RETURN(
        const WgmmaChoice wg,
        ChooseWgmma(device, smem_optin, options.tc_double_buffer, stages64, stages128));
    stages64 = wg.stages64;
    stages128 = wg.stages128;
    wgmma_note = wg.agrees ? "yes (probe and kernels agree)" : absl::StrCat("no (", wg.why, ")");
  }
  return std::unique_ptr<ModelKernels>(std::make_unique<CudaModelKernels>(
      options, smem_optin, stages64, stages128, std::move(wgmma_note)));
}

}  // namespace plateau
