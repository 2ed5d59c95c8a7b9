#include "kernels/projection/dense_projection.h"

#include "kernels/status_macros.h"

namespace plateau {

absl::StatusOr<std::unique_ptr<DenseProjection>> DenseProjection::Create(
    Backend& backend, ModelKernels& kernels, Stream& stream, int64_t rows, int64_t hidden,
    int64_t vocab) {
  PLATEAU_ASSIGN_OR_RETURN(Buffer logits, backend.device().Allocate(
                                              LiveSet::kProjection, rows * vocab * sizeof(float)));
  PLATEAU_ASSIGN_OR_RETURN(Buffer lse, backend.device().Allocate(LiveSet::kProjection,
                                                                 rows * sizeof(float)));
  return std::unique_ptr<DenseProjection>(new DenseProjection(
      backend, kernels, stream, rows, hidden, vocab, std::move(logits), std::move(lse)));
}

absl::Status DenseProjection::Forward(const float* z, const float* w, const int32_t* targets,
                                      double* stats) {
  Stream& s = stream_;
  PLATEAU_RETURN_IF_ERROR(backend_.Gemm(s, {false, true, rows_, vocab_, hidden_, 1.0f, z, hidden_,
                                            w, hidden_, 0.0f, logits_.as<float>(), vocab_}));
  return kernels_.CrossEntropy(s, logits_.as<float>(), targets, rows_, vocab_, lse_.as<float>(),
                               stats);
}

absl::Status DenseProjection::Backward(const float* z, const float* w, const int32_t* targets,
                                       float scale, float* dz, float* dw) {
  Stream& s = stream_;
  float* dlogits = logits_.as<float>();
  PLATEAU_RETURN_IF_ERROR(kernels_.CrossEntropyBackward(s, dlogits, lse_.as<float>(), targets,
                                                        rows_, vocab_, scale));
  PLATEAU_RETURN_IF_ERROR(backend_.Gemm(s, {false, false, rows_, hidden_, vocab_, 1.0f, dlogits,
                                            vocab_, w, hidden_, 0.0f, dz, hidden_}));
  return backend_.Gemm(s, {true, false, vocab_, hidden_, rows_, 1.0f, dlogits, vocab_, z, hidden_,
                           1.0f, dw, hidden_});
}

}  // namespace plateau
