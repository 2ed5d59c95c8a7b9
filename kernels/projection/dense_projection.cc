#include "kernels/projection/dense_projection.h"

#include "absl/strings/str_cat.h"
#include "kernels/model/working_ops.h"
#include "kernels/status_macros.h"

namespace plateau {

absl::StatusOr<std::unique_ptr<DenseProjection>> DenseProjection::Create(
    Backend& backend, ModelKernels& kernels, Stream& stream, int64_t rows, int64_t hidden,
    int64_t vocab, const ElementBytes& e) {
  PLATEAU_ASSIGN_OR_RETURN(Buffer logits, backend.device().Allocate(
                                              LiveSet::kProjection, rows * vocab * e.working));
  PLATEAU_ASSIGN_OR_RETURN(Buffer lse, backend.device().Allocate(LiveSet::kProjection,
                                                                 rows * e.accum));
  return std::unique_ptr<DenseProjection>(new DenseProjection(
      backend, kernels, stream, rows, hidden, vocab, std::move(logits), std::move(lse)));
}

template <typename W>
absl::Status DenseProjection::CheckElement() const {
  const int64_t want = rows_ * vocab_ * static_cast<int64_t>(sizeof(W));
  if (static_cast<int64_t>(logits_.bytes()) == want) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("dense projection: its logits hold ", logits_.bytes(),
                                          " bytes, the call's precision needs ", want));
}

template <typename W>
absl::Status DenseProjection::ForwardT(const W* z, const W* w, const int32_t* targets,
                                       double* stats) {
  using Ops = WorkingOps<W>;
  PLATEAU_RETURN_IF_ERROR(CheckElement<W>());
  Stream& s = stream_;
  W* logits = logits_.as<W>();
  PLATEAU_RETURN_IF_ERROR(Ops::Gemm(backend_, s, {false, true, rows_, vocab_, hidden_, 1.0f, z, hidden_, w,
                                                  hidden_, 0.0f, logits, vocab_}));
  return Ops::CrossEntropy(kernels_, s, logits, targets, rows_, vocab_, lse_.as<float>(), stats);
}

template <typename W>
absl::Status DenseProjection::BackwardT(const W* z, const W* w, const int32_t* targets,
                                        float scale, W* dz, W* dw) {
  using Ops = WorkingOps<W>;
  PLATEAU_RETURN_IF_ERROR(CheckElement<W>());
  Stream& s = stream_;
  W* dlogits = logits_.as<W>();
  PLATEAU_RETURN_IF_ERROR(Ops::CrossEntropyBackward(kernels_, s, dlogits, lse_.as<float>(), targets,
                                                    rows_, vocab_, scale));
  PLATEAU_RETURN_IF_ERROR(Ops::Gemm(backend_, s, {false, false, rows_, hidden_, vocab_, 1.0f, dlogits,
                                                  vocab_, w, hidden_, 0.0f, dz, hidden_}));
  return Ops::Gemm(backend_, s, {true, false, vocab_, hidden_, rows_, 1.0f, dlogits, vocab_, z, hidden_,
                                 1.0f, dw, hidden_});
}

absl::Status DenseProjection::Forward(const float* z, const float* w, const int32_t* targets,
                                      double* stats) {
  return ForwardT<float>(z, w, targets, stats);
}

absl::Status DenseProjection::Forward(const Bf16* z, const Bf16* w, const int32_t* targets,
                                      double* stats) {
  return ForwardT<Bf16>(z, w, targets, stats);
}

absl::Status DenseProjection::Backward(const float* z, const float* w, const int32_t* targets,
                                       float scale, float* dz, float* dw) {
  return BackwardT<float>(z, w, targets, scale, dz, dw);
}

absl::Status DenseProjection::Backward(const Bf16* z, const Bf16* w, const int32_t* targets,
                                       float scale, Bf16* dz, Bf16* dw) {
  return BackwardT<Bf16>(z, w, targets, scale, dz, dw);
}

}  // namespace plateau
