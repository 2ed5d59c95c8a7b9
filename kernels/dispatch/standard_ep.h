// Standard expert parallelism: the dispatch baseline (DESIGN.md §1.1).
//
// Every route (token, choice) goes to the rank that owns its expert in one
// all-to-all-v, the owner runs its experts as one GEMM group per expert, and
// a reverse all-to-all-v brings the outputs back to be combined with the
// router's gates. Dropless: no capacity factor. Its receive buffers grow with
// the routes a rank is sent — R_d is unbounded in N and in routing skew — and
// that is exactly the peak PipelinedLLEP bounds (its worst case for the
// budget: standard_ep_plan.h, which counts exactly what Forward and Backward
// allocate). Buffers are allocated per
// layer call at their exact sizes in the kDispatch live set, so the measured
// peak shows the growth.
//
// One object serves one layer at a time: Forward keeps what Backward needs
// (the routes, the received rows and the expert intermediates) until Backward
// or Release. Deterministic: routes are ordered by (destination, expert,
// token, choice) and every sum has a fixed order.
//
// Precision: fp32, or bf16 mixed (the Bf16 overloads: rows, weights and
// gradients bf16, exchanged as kBfloat16 (moved, never summed, so exact);
// the gates, dgates and their send-order copy fp32). One template body
// serves both; the fp32 instantiation is the fp32 code. The buffers are
// the rows' element size (StandardEpPeakBytes with the step's ElementBytes).
//
// Thread safety: not thread-safe; one per rank.
#ifndef PLATEAU_KERNELS_DISPATCH_STANDARD_EP_H_
#define PLATEAU_KERNELS_DISPATCH_STANDARD_EP_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/memory.h"
#include "kernels/dispatch/expert_dispatch.h"
#include "kernels/dispatch/expert_mlp.h"
#include "kernels/model/config.h"
#include "kernels/model/model_kernels.h"

namespace plateau {

class StandardEp final : public ExpertDispatch {
 public:
  // `experts` is the expert group (experts partitioned E/P per rank);
  // `compute` and `comm` are the streams the work runs on.
  StandardEp(const ModelConfig& model, Backend& backend, ModelKernels& kernels,
             Communicator& experts, Stream& compute, Stream& comm);

  // out[N, H] += sum_j gates[t, j] * expert_{chosen[t, j]}(u[t]).
  absl::Status Forward(const float* u, const int32_t* chosen,
                       const float* gates, int64_t tokens,
                       const ExpertWeights& w, float* out) override;

  // Given dout = d loss / d out: du += d/du (through the experts; the router
  // path is the caller's), dgates = d loss / d gates, and the expert weight
  // gradients accumulate into g. Needs the preceding Forward's state.
  absl::Status Backward(const float* dout, const ExpertWeights& w,
                        float* du, float* dgates, const ExpertGrads& g) override;

  // The same in bf16 mixed precision.
  absl::Status Forward(const Bf16* u, const int32_t* chosen, const float* gates, int64_t tokens,
                       const ExpertWeightsT<Bf16>& w, Bf16* out) override;
  absl::Status Backward(const Bf16* dout, const ExpertWeightsT<Bf16>& w, Bf16* du, float* dgates,
                        const ExpertGradsT<Bf16>& g) override;

  // Frees the layer's dispatch buffers.
  void Release() override;

  // Rows this rank received in the last Forward (its R_d).
  int64_t received_rows() const { return recv_rows_; }

 private:
  // The local experts with rows this layer (expert_mlp.h), in expert order;
  // with `grads`, their gradients accumulate there.
  template <typename W>
  std::vector<ExpertGroupT<W>> Groups(const ExpertWeightsT<W>& w, const ExpertGradsT<W>* grads) const;
  template <typename W>
  absl::Status ForwardT(const W* u, const int32_t* chosen, const float* gates, int64_t tokens,
                        const ExpertWeightsT<W>& w, W* out);
  template <typename W>
  absl::Status BackwardT(const W* dout, const ExpertWeightsT<W>& w, W* du, float* dgates,
                         const ExpertGradsT<W>& g);
  absl::Status Plan(const int32_t* chosen, int64_t tokens);
  // Rows of H elements of type W.
  template <typename W>
  absl::Status Exchange(const W* send, W* recv, bool forward);
  // `count` elements of type T in the kDispatch live set.
  template <typename T>
  absl::StatusOr<Buffer> Alloc(int64_t count);
  absl::StatusOr<Buffer> AllocIndex(const std::vector<int32_t>& host);

  const ModelConfig model_;
  Backend& backend_;
  ModelKernels& kernels_;
  Communicator& comm_;
  Stream& compute_;
  Stream& comm_stream_;
  const int64_t local_experts_;

  // The plan of the current layer (host side).
  int64_t tokens_ = 0;
  int64_t recv_rows_ = 0;
  std::vector<int64_t> send_counts_, recv_counts_;  // rows per peer
  std::vector<int64_t> expert_rows_;                // rows per local expert
  // Device copies of the index vectors and the state Backward needs.
  Buffer send_index_;   // [N*k] route -> token row, in send order
  Buffer route_pos_;    // [N*k] route r = t*k + j -> position in send order
  Buffer route_at_pos_; // [N*k] position in send order -> route r
  Buffer perm_;         // [R] expert-major row -> received row
  Buffer inv_perm_;     // [R] received row -> expert-major row
  Buffer gates_sent_;   // [N*k] gate of each route, in send order
  Buffer x_, g_, u_, a_;  // expert inputs [R, H] and intermediates [R, F]
  Buffer returned_;     // [N*k, H] expert outputs back in send order
  std::unique_ptr<Event> ready_, landed_;  // compute -> comm -> compute
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_DISPATCH_STANDARD_EP_H_
