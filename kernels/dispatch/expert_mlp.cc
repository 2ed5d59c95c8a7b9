#include "kernels/dispatch/expert_mlp.h"

#include <vector>

#include "kernels/status_macros.h"

namespace plateau {

absl::Status ExpertMlpForward(Backend& backend, Stream& stream, int64_t H, int64_t F,
                              absl::Span<const ExpertGroup> groups, const float* x,
                              float* gate, float* up, float* act, float* y) {
  std::vector<GemmArgs> gate_up, down;
  int64_t row = 0;
  for (const ExpertGroup& g : groups) {
    const int64_t n = g.rows;
    const float* xe = x + row * H;
    gate_up.push_back({false, false, n, F, H, 1.0f, xe, H, g.w_gate, F, 0.0f, gate + row * F, F});
    gate_up.push_back({false, false, n, F, H, 1.0f, xe, H, g.w_up, F, 0.0f, up + row * F, F});
    down.push_back({false, false, n, H, F, 1.0f, act + row * F, F, g.w_down, H, 0.0f, y + row * H, H});
    row += n;
  }
  PLATEAU_RETURN_IF_ERROR(backend.GroupedGemm(stream, gate_up));
  PLATEAU_RETURN_IF_ERROR(backend.SwiGluForward(stream, act, gate, up, row * F));
  return backend.GroupedGemm(stream, down);
}

absl::Status ExpertMlpBackward(Backend& backend, Stream& stream, int64_t H, int64_t F,
                               absl::Span<const ExpertGroup> groups, const float* x,
                               const float* dy, const float* gate, const float* up, float* act,
                               float* dact, float* dgate, float* dup, float* dx) {
  // Three grouped calls, each of GEMMs with disjoint outputs; the order
  // between them is what the data needs (SwiGLU's backward overwrites act
  // only after dWd read it; dx's second term adds to its first).
  std::vector<GemmArgs> first, second, third;
  int64_t row = 0;
  for (const ExpertGroup& g : groups) {
    const int64_t n = g.rows;
    const float* xe = x + row * H;
    const float* dye = dy + row * H;
    // dA = dY Wd^T; dWd (+)= A^T dY.
    first.push_back({false, true, n, F, H, 1.0f, dye, H, g.w_down, H, 0.0f, dact + row * F, F});
    first.push_back(
        {true, false, F, H, n, 1.0f, act + row * F, F, dye, H, g.dw_beta, g.dw_down, H});
    // dWg (+)= X^T dG; dWu (+)= X^T dU; dX = dG Wg^T + dU Wu^T.
    second.push_back(
        {true, false, H, F, n, 1.0f, xe, H, dgate + row * F, F, g.dw_beta, g.dw_gate, F});
    second.push_back({true, false, H, F, n, 1.0f, xe, H, dup + row * F, F, g.dw_beta, g.dw_up, F});
    second.push_back(
        {false, true, n, H, F, 1.0f, dgate + row * F, F, g.w_gate, F, 0.0f, dx + row * H, H});
    third.push_back(
        {false, true, n, H, F, 1.0f, dup + row * F, F, g.w_up, F, 1.0f, dx + row * H, H});
    row += n;
  }
  PLATEAU_RETURN_IF_ERROR(backend.GroupedGemm(stream, first));
  PLATEAU_RETURN_IF_ERROR(backend.SwiGluBackward(stream, dgate, dup, dact, gate, up, row * F));
  PLATEAU_RETURN_IF_ERROR(backend.GroupedGemm(stream, second));
  return backend.GroupedGemm(stream, third);
}

}  // namespace plateau
