// The dense vocabulary projection and cross-entropy: the projection baseline
// (DESIGN.md §1.2). The full N x V logits of a rank's tokens are
// materialised in the kProjection live set (allocated at launch, N x V
// floats) and held from the forward to the backward, which turns them into
// their gradient in place. That N x V buffer is the peak Ring-DTP removes.
//
// Precision: fp32, or bf16 mixed (Create with kBf16MixedElements): bf16
// logits (the GEMM's one rounding per stored logit; its gradient rounds once
// in place), fp32 log-sum-exp, double loss sums; one template body, whose
// fp32 instantiation is the fp32 code.
#ifndef PLATEAU_KERNELS_PROJECTION_DENSE_PROJECTION_H_
#define PLATEAU_KERNELS_PROJECTION_DENSE_PROJECTION_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/memory.h"
#include "kernels/model/model_kernels.h"
#include "kernels/projection/projection_plan.h"
#include "kernels/projection/vocab_projection.h"

namespace plateau {

class DenseProjection final : public VocabProjection {
 public:
  // Bytes of the kProjection live set for `rows` tokens: logits + lse
  // (kernels/projection/projection_plan.h).
  static int64_t BoundBytes(int64_t rows, int64_t vocab) {
    return DenseProjectionBoundBytes(rows, vocab);
  }

  // Its work runs on `stream`; logits of e.working bytes each
  // (DenseProjectionBoundBytes(rows, vocab, e) in all).
  static absl::StatusOr<std::unique_ptr<DenseProjection>> Create(
      Backend& backend, ModelKernels& kernels, Stream& stream, int64_t rows,
      int64_t hidden, int64_t vocab, const ElementBytes& e = kFp32Elements);

  int64_t FirstWeightRow() const override { return 0; }

  // logits = z W^T for z [rows, H], W [V, H]; stats[0] += sum of valid row
  // losses, stats[1] += valid rows (doubles).
  absl::Status Forward(const float* z, const float* w, const int32_t* targets,
                       double* stats) override;
  // With scale = 1 / (valid tokens of the global batch): dz = dlogits W
  // (overwritten), dw += dlogits^T z.
  absl::Status Backward(const float* z, const float* w, const int32_t* targets,
                        float scale, float* dz, float* dw) override;
  // The same in bf16 mixed precision (Create with kBf16MixedElements).
  absl::Status Forward(const Bf16* z, const Bf16* w, const int32_t* targets,
                       double* stats) override;
  absl::Status Backward(const Bf16* z, const Bf16* w, const int32_t* targets,
                        float scale, Bf16* dz, Bf16* dw) override;

 private:
  template <typename W>
  absl::Status ForwardT(const W* z, const W* w, const int32_t* targets, double* stats);
  template <typename W>
  absl::Status BackwardT(const W* z, const W* w, const int32_t* targets, float scale, W* dz, W* dw);
  // INTERNAL unless the logits were allocated for W.
  template <typename W>
  absl::Status CheckElement() const;

  DenseProjection(Backend& backend, ModelKernels& kernels, Stream& stream,
                  int64_t rows, int64_t hidden, int64_t vocab, Buffer logits,
                  Buffer lse)
      : backend_(backend), kernels_(kernels), stream_(stream), rows_(rows),
        hidden_(hidden), vocab_(vocab), logits_(std::move(logits)),
        lse_(std::move(lse)) {}

  Backend& backend_;
  ModelKernels& kernels_;
  Stream& stream_;
  const int64_t rows_, hidden_, vocab_;
  Buffer logits_;  // [rows, V] of the working type
  Buffer lse_;     // [rows]
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_PROJECTION_DENSE_PROJECTION_H_
