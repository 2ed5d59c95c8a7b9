// The expert-dispatch schedule point (DESIGN.md §1.1): the routes of a
// rank's tokens to the experts that own them, the experts' SwiGLU MLPs, and
// the combine back into the token rows; then the same in backward. Standard
// EP (standard_ep.h) is the baseline, LLEP (llep.h) balances compute, and
// PipelinedLLEP (pipelined_llep.h) bounds the receive buffers. The
// step holds one, made from its options by CreateSchedules
// (kernels/step/schedules.h); a new dispatch schedule is one more
// implementation plus one line there, and its bound in a *_plan library for
// the budget.
//
// Lifetimes: Forward may keep pointers to the caller's u, chosen and gates
// (LLEP and PipelinedLLEP do: their Backward recomputes or rescales from
// them), so the caller keeps those three valid and unchanged from Forward
// until the matching Backward or Release; the step does (the layer's
// recompute runs Forward right before Backward).
//
// Precision: each call has an fp32 form (float working rows) and a bf16
// mixed one (Bf16 rows, weights and gradients; the gates and dgates stay
// fp32: precision.h), which a schedule that computes bf16 overrides; the
// others answer UNIMPLEMENTED (the step refuses a bf16 step with such a
// schedule before it runs: kernels/step/schedules.cc).
//
// Thread safety: one per rank; Forward and Backward are collective over the
// expert group.
#ifndef PLATEAU_KERNELS_DISPATCH_EXPERT_DISPATCH_H_
#define PLATEAU_KERNELS_DISPATCH_EXPERT_DISPATCH_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/bf16.h"

namespace plateau {

// The local experts of one layer on this rank: [E_p, H, F] gate and up,
// [E_p, F, H] down (and their gradients in Backward), in the working
// precision W.
template <typename W>
struct ExpertWeightsT {
  const W* w_gate = nullptr;
  const W* w_up = nullptr;
  const W* w_down = nullptr;
};
template <typename W>
struct ExpertGradsT {
  W* w_gate = nullptr;
  W* w_up = nullptr;
  W* w_down = nullptr;
};
using ExpertWeights = ExpertWeightsT<float>;
using ExpertGrads = ExpertGradsT<float>;

class ExpertDispatch {
 public:
  virtual ~ExpertDispatch() = default;

  // out[N, H] += sum_j gates[t, j] * expert_{chosen[t, j]}(u[t]) for the
  // `tokens` rows of u; keeps what Backward needs (possibly u, chosen and
  // gates themselves: see Lifetimes above).
  virtual absl::Status Forward(const float* u, const int32_t* chosen, const float* gates,
                               int64_t tokens, const ExpertWeights& w, float* out) = 0;
  // Forward for a caller that needs the Backward after it but not `out`
  // (the step's recompute of a layer, whose output is already in the
  // boundary store): `out` is left unspecified, and Backward gives exactly
  // what it gives after Forward. A schedule whose Backward recomputes its
  // expert forward itself (PipelinedLLEP's chunk replay) only plans here;
  // the others keep what Backward reads, so they run Forward.
  virtual absl::Status ForwardForBackward(const float* u, const int32_t* chosen,
                                          const float* gates, int64_t tokens,
                                          const ExpertWeights& w, float* out) {
    return Forward(u, chosen, gates, tokens, w, out);
  }
  // Names the step's layer (0 .. model.layers - 1) that the next Forward or
  // ForwardForBackward computes; that call forgets it, so a call without it
  // names none (every caller but the step). A schedule may keep what layer
  // l's Forward planned from collectives and reuse it in the recompute's
  // ForwardForBackward of layer l, whose routing is bitwise the forward's
  // (PipelinedLLEP: its routing counts, one host-blocking all-gather per
  // layer and step fewer). Default: ignored.
  virtual void SetLayer(int64_t layer) {}
  // Given dout = d loss / d out: du += d/du through the experts, dgates = d
  // loss / d gates, and the expert weight gradients accumulate into g.
  // FAILED_PRECONDITION without the layer's Forward.
  virtual absl::Status Backward(const float* dout, const ExpertWeights& w, float* du,
                                float* dgates, const ExpertGrads& g) = 0;
  // Gives back what Forward kept (a layer whose Backward will not run).
  virtual void Release() = 0;

  // bf16 mixed precision: the same contracts on bf16 rows (gates, dgates
  // fp32). Default: UNIMPLEMENTED naming the schedule.
  virtual absl::Status Forward(const Bf16* u, const int32_t* chosen, const float* gates,
                               int64_t tokens, const ExpertWeightsT<Bf16>& w, Bf16* out) {
    return NoBf16();
  }
  virtual absl::Status ForwardForBackward(const Bf16* u, const int32_t* chosen,
                                          const float* gates, int64_t tokens,
                                          const ExpertWeightsT<Bf16>& w, Bf16* out) {
    return Forward(u, chosen, gates, tokens, w, out);
  }
  virtual absl::Status Backward(const Bf16* dout, const ExpertWeightsT<Bf16>& w, Bf16* du,
                                float* dgates, const ExpertGradsT<Bf16>& g) {
    return NoBf16();
  }

 private:
  static absl::Status NoBf16() {
    return absl::UnimplementedError("dispatch: this schedule does not compute bf16 mixed precision yet (issue 17)");
  }
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_DISPATCH_EXPERT_DISPATCH_H_
