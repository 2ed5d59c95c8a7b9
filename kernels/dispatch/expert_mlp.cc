#include "kernels/dispatch/expert_mlp.h"

#include <vector>

#include "kernels/model/working_ops.h"
#include "kernels/status_macros.h"

namespace plateau {
namespace {

// One body for both precisions: WorkingOps<float> is the fp32 ops argument
// for argument, WorkingOps<Bf16> their bf16 twins.
template <typename W>
absl::Status Forward(Backend& backend, Stream& stream, int64_t H, int64_t F,
                     absl::Span<const ExpertGroupT<W>> groups, const W* x, W* gate, W* up, W* act,
                     W* y) {
  using Ops = WorkingOps<W>;
  std::vector<WorkingGemm<W>> gate_up, down;
  int64_t row = 0;
  for (const ExpertGroupT<W>& g : groups) {
    const int64_t n = g.rows;
    const W* xe = x + row * H;
    gate_up.push_back({false, false, n, F, H, 1.0f, xe, H, g.w_gate, F, 0.0f, gate + row * F, F});
    gate_up.push_back({false, false, n, F, H, 1.0f, xe, H, g.w_up, F, 0.0f, up + row * F, F});
    down.push_back({false, false, n, H, F, 1.0f, act + row * F, F, g.w_down, H, 0.0f, y + row * H, H});
    row += n;
  }
  PLATEAU_RETURN_IF_ERROR(Ops::GroupedGemm(backend, stream, gate_up));
  PLATEAU_RETURN_IF_ERROR(Ops::SwiGluForward(backend, stream, act, gate, up, row * F));
  return Ops::GroupedGemm(backend, stream, down);
}

template <typename W>
absl::Status Backward(Backend& backend, Stream& stream, int64_t H, int64_t F,
                      absl::Span<const ExpertGroupT<W>> groups, const W* x, const W* dy,
                      const W* gate, const W* up, W* act, W* dact, W* dgate, W* dup, W* dx) {
  using Ops = WorkingOps<W>;
  // Three grouped calls, each of GEMMs with disjoint outputs; the order
  // between them is what the data needs (SwiGLU's backward overwrites act
  // only after dWd read it; dx's second term adds to its first).
  std::vector<WorkingGemm<W>> first, second, third;
  // The weight gradients of groups with fp32 accumulators (bf16 only):
  // after `first` and `second` respectively, from the same inputs.
  std::vector<WorkingGemm<W, float>> first_fp32, second_fp32;
  int64_t row = 0;
  for (const ExpertGroupT<W>& g : groups) {
    const int64_t n = g.rows;
    const W* xe = x + row * H;
    const W* dye = dy + row * H;
    const bool fp32 = g.dw_gate_fp32 != nullptr;
    // dA = dY Wd^T; dWd (+)= A^T dY.
    first.push_back({false, true, n, F, H, 1.0f, dye, H, g.w_down, H, 0.0f, dact + row * F, F});
    if (fp32) {
      first_fp32.push_back({true, false, F, H, n, 1.0f, act + row * F, F, dye, H, g.dw_beta, g.dw_down_fp32, H});
    } else {
      first.push_back({true, false, F, H, n, 1.0f, act + row * F, F, dye, H, g.dw_beta, g.dw_down, H});
    }
    // dWg (+)= X^T dG; dWu (+)= X^T dU; dX = dG Wg^T + dU Wu^T.
    if (fp32) {
      second_fp32.push_back({true, false, H, F, n, 1.0f, xe, H, dgate + row * F, F, g.dw_beta, g.dw_gate_fp32, F});
      second_fp32.push_back({true, false, H, F, n, 1.0f, xe, H, dup + row * F, F, g.dw_beta, g.dw_up_fp32, F});
    } else {
      second.push_back({true, false, H, F, n, 1.0f, xe, H, dgate + row * F, F, g.dw_beta, g.dw_gate, F});
      second.push_back({true, false, H, F, n, 1.0f, xe, H, dup + row * F, F, g.dw_beta, g.dw_up, F});
    }
    second.push_back(
        {false, true, n, H, F, 1.0f, dgate + row * F, F, g.w_gate, F, 0.0f, dx + row * H, H});
    third.push_back(
        {false, true, n, H, F, 1.0f, dup + row * F, F, g.w_up, F, 1.0f, dx + row * H, H});
    row += n;
  }
  PLATEAU_RETURN_IF_ERROR(Ops::GroupedGemm(backend, stream, first));
  if (!first_fp32.empty()) PLATEAU_RETURN_IF_ERROR(Ops::GroupedGemmAccum(backend, stream, first_fp32));
  PLATEAU_RETURN_IF_ERROR(Ops::SwiGluBackward(backend, stream, dgate, dup, dact, gate, up, row * F));
  PLATEAU_RETURN_IF_ERROR(Ops::GroupedGemm(backend, stream, second));
  if (!second_fp32.empty()) PLATEAU_RETURN_IF_ERROR(Ops::GroupedGemmAccum(backend, stream, second_fp32));
  return Ops::GroupedGemm(backend, stream, third);
}

}  // namespace

absl::Status ExpertMlpForward(Backend& backend, Stream& stream, int64_t H, int64_t F,
                              absl::Span<const ExpertGroup> groups, const float* x,
                              float* gate, float* up, float* act, float* y) {
  return Forward<float>(backend, stream, H, F, groups, x, gate, up, act, y);
}

absl::Status ExpertMlpForward(Backend& backend, Stream& stream, int64_t H, int64_t F,
                              absl::Span<const ExpertGroupT<Bf16>> groups, const Bf16* x,
                              Bf16* gate, Bf16* up, Bf16* act, Bf16* y) {
  return Forward<Bf16>(backend, stream, H, F, groups, x, gate, up, act, y);
}

absl::Status ExpertMlpBackward(Backend& backend, Stream& stream, int64_t H, int64_t F,
                               absl::Span<const ExpertGroup> groups, const float* x,
                               const float* dy, const float* gate, const float* up, float* act,
                               float* dact, float* dgate, float* dup, float* dx) {
  return Backward<float>(backend, stream, H, F, groups, x, dy, gate, up, act, dact, dgate, dup, dx);
}

absl::Status ExpertMlpBackward(Backend& backend, Stream& stream, int64_t H, int64_t F,
                               absl::Span<const ExpertGroupT<Bf16>> groups, const Bf16* x,
                               const Bf16* dy, const Bf16* gate, const Bf16* up, Bf16* act,
                               Bf16* dact, Bf16* dgate, Bf16* dup, Bf16* dx) {
  return Backward<Bf16>(backend, stream, H, F, groups, x, dy, gate, up, act, dact, dgate, dup, dx);
}

}  // namespace plateau
