// The experts' SwiGLU MLPs over a rank's received rows, shared by standard
// EP and the LLEP chunk runner: y = (silu(x Wg) * (x Wu)) Wd per expert
// group, and its backward. Rows are expert-major: group g owns rows
// [sum of earlier groups' rows, + rows) of every row buffer.
//
// Each step is one Backend::GroupedGemm over every group (on CUDA one
// cublasGemmGroupedBatchedEx call instead of a GEMM per expert) and one
// SwiGLU over all the rows:
//   forward   gate and up of every group; act = swiglu(gate, up); y
//   backward  d act and dWd; d gate, d up = swiglu'; dWg, dWu and
//             dx = d gate Wg^T; dx += d up Wu^T
// Every output is the same GEMM (or element op) on the same inputs as one
// call per expert would make, so on the CPU the bits are those of the
// per-expert loop.
//
// Thread safety: plain functions; the work is enqueued on `stream`.
#ifndef PLATEAU_KERNELS_DISPATCH_EXPERT_MLP_H_
#define PLATEAU_KERNELS_DISPATCH_EXPERT_MLP_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/stream.h"

namespace plateau {

// One expert group: its rows, its weights ([H, F] gate and up, [F, H]
// down), and for backward where its weight gradients go, added to (beta 1)
// or overwritten (beta 0).
struct ExpertGroup {
  int64_t rows = 0;
  const float* w_gate = nullptr;
  const float* w_up = nullptr;
  const float* w_down = nullptr;
  float* dw_gate = nullptr;
  float* dw_up = nullptr;
  float* dw_down = nullptr;
  float dw_beta = 1.0f;
};

// x [R, H] -> gate, up, act [R, F] and y [R, H] (R = the groups' rows).
absl::Status ExpertMlpForward(Backend& backend, Stream& stream, int64_t hidden, int64_t ffn,
                              absl::Span<const ExpertGroup> groups, const float* x,
                              float* gate, float* up, float* act, float* y);

// Given dy [R, H] and the forward's x, gate, up and act: the groups' weight
// gradients, and dx [R, H] (overwritten). dact and dup are [R, F] scratch;
// dgate [R, F] may be `act` itself (act is consumed by then).
absl::Status ExpertMlpBackward(Backend& backend, Stream& stream, int64_t hidden, int64_t ffn,
                               absl::Span<const ExpertGroup> groups, const float* x,
                               const float* dy, const float* gate, const float* up, float* act,
                               float* dact, float* dgate, float* dup, float* dx);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_DISPATCH_EXPERT_MLP_H_
