// LLEP, least-loaded expert parallelism (arXiv 2601.17111; DESIGN.md §1.1):
// the compute-balancing dispatch baseline of PipelinedLLEP.
//
// Forward all-gathers every rank's per-expert route counts, and every rank
// computes the same assignment (AssignLlep, llep_plan.h): each expert's home
// rank keeps up to its capacity and the overflow goes to the least-loaded
// other ranks in pieces of at least min_piece routes. A helper receives the
// borrowed expert's weights ([gate | up | down], in the dispatch live set),
// computes its piece, and in Backward sends the weight gradients back to the
// owner, which adds them after its own. Dropless; the routes move by
// all-to-all-v as in standard EP.
//
// It balances compute but not memory: a rank's buffers still grow with the
// routes it is sent (R_d, up to P N k with borrowing) and with the experts it
// borrows. Buffers are allocated in Forward at the sizes of this layer's
// routes (LlepBuffers in llep_plan.h, exactly) and held until Backward ends:
// Backward reuses the forward's inputs, activations and outputs as standard
// EP does. So the measured peak is LlepPeakBytes of the realized sizes.
//
// Forward keeps a pointer to the caller's gates for Backward
// (expert_dispatch.h, Lifetimes). Deterministic: the assignment is a
// function of the counts, rows are ordered by (destination, expert, token,
// choice), and every sum has a fixed order (llep_chunk.h).
//
// Precision: fp32, or bf16 mixed (Create with kBf16MixedElements: the Bf16
// overloads, LlepBuffers at the bf16 element sizes; llep_chunk.h). One
// template body per call; the fp32 instantiation is the fp32 code.
//
// Thread safety: not thread-safe; one per rank.
#ifndef PLATEAU_KERNELS_DISPATCH_LLEP_H_
#define PLATEAU_KERNELS_DISPATCH_LLEP_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/model/step_options.h"
#include "kernels/dispatch/expert_dispatch.h"
#include "kernels/dispatch/llep_chunk.h"
#include "kernels/dispatch/llep_plan.h"
#include "kernels/memory.h"
#include "kernels/model/config.h"
#include "kernels/model/model_kernels.h"

namespace plateau {

class Llep final : public ExpertDispatch {
 public:
  // Validates the options (schedule.llep.*) and the shape; `experts` is the
  // expert group (E / P experts per rank); work runs on `compute` and `comm`.
  // e: the element sizes of the buffers (kBf16MixedElements: the Bf16
  // overloads run; llep_chunk.h).
  static absl::StatusOr<std::unique_ptr<Llep>> Create(const ModelConfig& model,
                                                      const LlepOptions& options, Backend& backend,
                                                      ModelKernels& kernels, Communicator& experts,
                                                      Stream& compute, Stream& comm,
                                                      const ElementBytes& e = kFp32Elements);

  absl::Status Forward(const float* u, const int32_t* chosen, const float* gates, int64_t tokens,
                       const ExpertWeights& w, float* out) override;
  absl::Status Backward(const float* dout, const ExpertWeights& w, float* du, float* dgates,
                        const ExpertGrads& g) override;
  // The same in bf16 mixed precision (Create with kBf16MixedElements).
  absl::Status Forward(const Bf16* u, const int32_t* chosen, const float* gates, int64_t tokens,
                       const ExpertWeightsT<Bf16>& w, Bf16* out) override;
  absl::Status Backward(const Bf16* dout, const ExpertWeightsT<Bf16>& w, Bf16* du, float* dgates,
                        const ExpertGradsT<Bf16>& g) override;
  void Release() override;

  // The last Forward's assignment and this rank's realized sizes (R_d, the
  // experts it borrowed and lent), for tests and benchmarks.
  const LlepAssignment& assignment() const { return assignment_; }
  const LlepChunkSizes& sizes() const { return sizes_; }

 private:
  Llep(const ModelConfig& model, const LlepOptions& options, Backend& backend,
       ModelKernels& kernels, Communicator& experts, Stream& compute, Stream& comm, bool bf16);
  // One body per call for both precisions; the runner and the chunk memory
  // of W.
  template <typename W>
  absl::Status ForwardT(const W* u, const int32_t* chosen, const float* gates, int64_t tokens,
                        const ExpertWeightsT<W>& w, W* out);
  template <typename W>
  absl::Status BackwardT(const W* dout, const ExpertWeightsT<W>& w, W* du, float* dgates,
                         const ExpertGradsT<W>& g);
  template <typename W>
  LlepChunkRunnerT<W>& Runner();
  template <typename W>
  LlepChunkMemoryT<W>& Mem();

  const ModelConfig model_;
  const LlepOptions options_;
  Backend& backend_;
  Communicator& comm_;
  Stream& compute_;
  Stream& comm_stream_;
  const bool bf16_;  // Create's e: bf16 rows
  LlepChunkRunner runner_;
  LlepChunkRunnerT<Bf16> runner_bf16_;

  // The layer between Forward and Backward.
  bool forward_done_ = false;
  const float* gates_ = nullptr;
  LlepAssignment assignment_;
  LlepRankPlan plan_;
  LlepChunkSizes sizes_;
  std::vector<Buffer> buffers_;  // LlepBuffers' list, in order
  LlepChunkMemory mem_;
  LlepChunkMemoryT<Bf16> mem_bf16_;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_DISPATCH_LLEP_H_
