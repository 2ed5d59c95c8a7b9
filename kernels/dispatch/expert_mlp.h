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
// Precision: each function has an fp32 and a bf16 mixed form (W = Bf16:
// bf16 rows, weights and gradients, grouped bf16 GEMMs with fp32
// accumulation, one rounding per stored element: kernels/model/working_ops.h).
//
// Thread safety: plain functions; the work is enqueued on `stream`.
#ifndef PLATEAU_KERNELS_DISPATCH_EXPERT_MLP_H_
#define PLATEAU_KERNELS_DISPATCH_EXPERT_MLP_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/stream.h"

namespace plateau {

// One expert group: its rows, its weights ([H, F] gate and up, [F, H]
// down), and for backward where its weight gradients go, added to (beta 1)
// or overwritten (beta 0). W is the working type.
template <typename W>
struct ExpertGroupT {
  int64_t rows = 0;
  const W* w_gate = nullptr;
  const W* w_up = nullptr;
  const W* w_down = nullptr;
  W* dw_gate = nullptr;
  W* dw_up = nullptr;
  W* dw_down = nullptr;
  float dw_beta = 1.0f;
  // Under bf16, fp32 weight gradients instead of dw_* when set (all three):
  // an accumulator summing the expert's gradient over PipelinedLLEP's K > 1
  // chunks in fp32, rounded to bf16 once at the layer's end (a bf16 sum
  // rounded at every chunk stalls: adding 1.0 1,024 times gave 256).
  float* dw_gate_fp32 = nullptr;
  float* dw_up_fp32 = nullptr;
  float* dw_down_fp32 = nullptr;
};
using ExpertGroup = ExpertGroupT<float>;

// x [R, H] -> gate, up, act [R, F] and y [R, H] (R = the groups' rows).
absl::Status ExpertMlpForward(Backend& backend, Stream& stream, int64_t hidden, int64_t ffn,
                              absl::Span<const ExpertGroup> groups, const float* x,
                              float* gate, float* up, float* act, float* y);
absl::Status ExpertMlpForward(Backend& backend, Stream& stream, int64_t hidden, int64_t ffn,
                              absl::Span<const ExpertGroupT<Bf16>> groups, const Bf16* x,
                              Bf16* gate, Bf16* up, Bf16* act, Bf16* y);

// Given dy [R, H] and the forward's x, gate, up and act: the groups' weight
// gradients, and dx [R, H] (overwritten). dact and dup are [R, F] scratch;
// dgate [R, F] may be `act` itself (act is consumed by then).
absl::Status ExpertMlpBackward(Backend& backend, Stream& stream, int64_t hidden, int64_t ffn,
                               absl::Span<const ExpertGroup> groups, const float* x,
                               const float* dy, const float* gate, const float* up, float* act,
                               float* dact, float* dgate, float* dup, float* dx);
absl::Status ExpertMlpBackward(Backend& backend, Stream& stream, int64_t hidden, int64_t ffn,
                               absl::Span<const ExpertGroupT<Bf16>> groups, const Bf16* x,
                               const Bf16* dy, const Bf16* gate, const Bf16* up, Bf16* act,
                               Bf16* dact, Bf16* dgate, Bf16* dup, Bf16* dx);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_DISPATCH_EXPERT_MLP_H_
