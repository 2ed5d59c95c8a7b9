// PipelinedLLEP: expert dispatch whose receive buffers do not grow with the
// routing's skew (DESIGN.md §1.1; the paper's §3.1, Eq. 1 and App. B.1).
//
// LLEP's dispatch, split into K chunks. In each chunk every source rank
// sends at most c tokens (c k routes), so a rank receives at most P c k rows
// per chunk whatever the routing (Eq. 1), and borrows at most
// min(E - E_p, P c k / min_piece) experts (llep_plan.h). Per chunk: the LLEP
// assignment over the chunk's loads, dispatch (all-to-all-v), the expert
// GEMMs over own and borrowed experts, the combine back, accumulated into
// the caller's token rows.
//
// K is agreed collectively in Forward: K = ceil(max_p N_p / c) from an
// all-reduce (max) of the ranks' token counts, so at small N, K = 1, and
// ranks with different N run the same chunks (a short rank's late chunks are
// empty). When the launch allows one chunk at most (c >= its tokens per
// rank), K is 0 or 1 whatever the ranks' N, so the all-reduce is skipped and
// the group's largest N is read off the gathered counts (N_p = a rank's
// routes / k): one host wait fewer per Forward, the same plans. Chunk
// membership is strided by default (chunk j takes a source's
// tokens j, j+K, j+2K, ...) or contiguous blocks; either way a source's chunk
// has at most ceil(N / K) <= c tokens.
//
// Memory: every buffer of the bound (PipelinedLlepBuffers in llep_plan.h) is
// allocated once by Create, sized from the launch (c, P, k, H, F, E and the
// launch's tokens per rank N_max), and reused chunk to chunk in stream order
// (llep_chunk.h), so the measured kDispatch peak is the bound in Forward and
// in Backward, and no chunk allocates device memory or waits on the host.
// The host does wait twice per Forward (once with one chunk at most),
// before the first chunk: for the all-reduced N and for the all-gathered
// per-chunk counts from which it plans every chunk and stages their index
// vectors in pinned host memory (one asynchronous copy per chunk); in the
// step's recompute of a layer it waits only for the routes (below).
//
// Host memory is launch-sized too (PipelinedLlepHostBytes, the budget's
// host plan): the index staging, the kept counts, and the planner's arrays
// (the layer's routes and the gathered counts). No plan outlives its
// chunk: Plan makes each chunk's plan to stage its index words and check it
// fits, then frees it; Forward and Backward make it again from the same
// arrays as they run the chunk (the same pure function of the same counts
// and routes: the same plan). So a layer's other host memory is one
// chunk's planning at a time, O(P E + P c k) words whatever N is; keeping
// K plans from Forward to Backward grew with N (K = N / c). Re-planning is
// host work of the same order between a chunk's enqueues (no wait: on a
// GPU it overlaps the previous chunk's kernels); on the CPU it did not
// show in dispatch_bench at K = 256 (BENCHMARKS.md, session 30).
//
// The recompute plans without collectives. A Forward of a layer the step
// named (SetLayer) keeps that layer's K and gathered counts in host memory
// (PipelinedLlepKeptCountWords; part of the host plan). The step's
// recompute of the layer (ForwardForBackward) routes bitwise as its forward
// did, so it takes K and the counts from there instead of the all-reduce and
// the all-gather: one host-blocking round trip fewer per layer and step (two
// with K > 1). The plans are then exactly what the exchange would give: each
// rank checks that its own recomputed counts are the kept ones (INTERNAL
// otherwise: the recompute did not route as the forward, a bug; a rank
// that passed then waits in its first chunk's all-to-all until the
// communicator's timeout or a lost peer ends it), and its index vectors come
// from its recomputed routes as before. The kept counts are used once.
//
// Forward keeps only pointers to the caller's u and gates (expert_dispatch.h,
// Lifetimes), and the layer's routes and counts in the planning arrays.
// Backward replays chunk by chunk:
// re-dispatch, recompute the expert forward, backward, return the input
// gradients and the helpers' weight gradients. Hidden-state and gate
// gradients are not split; only the order in which expert-weight gradients
// are summed changes (chunk by chunk). At K = 1 the chunk is the whole
// layer and every output and gradient is bitwise LLEP's.
//
// Precision: fp32, or bf16 mixed (Create with kBf16MixedElements: the
// Bf16 overloads; the slots are PipelinedLlepBuffers' at the bf16 element
// sizes, rows, weights and gradients bf16, gates fp32: llep_chunk.h). One
// template body per call; the fp32 instantiation is the fp32 code. Under
// bf16 with K > 1 an own expert's weight gradient is summed over the
// chunks (its GEMMs and its helpers' gradients) in an fp32 accumulator and
// rounded to bf16 once at the layer's end: the bf16 gradient buffer taking
// each chunk's sum rounded K times, and a sum of K similar terms in bf16
// stalls (K = 256: 3.4e-2 relative error against 2.2e-3).
//
// Thread safety: not thread-safe; one per rank.
#ifndef PLATEAU_KERNELS_DISPATCH_PIPELINED_LLEP_H_
#define PLATEAU_KERNELS_DISPATCH_PIPELINED_LLEP_H_

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

class PipelinedLlep final : public ExpertDispatch {
 public:
  // The dispatch live set's bytes (llep_plan.h), here for the schedule's
  // users.
  static int64_t BoundBytes(const ModelConfig& model, int64_t ranks, int64_t max_tokens,
                            const PipelinedLlepOptions& options) {
    return PipelinedLlepBoundBytes(model, ranks, max_tokens, options);
  }

  // Validates the options (schedule.pipelined_llep.*) and the shape, and
  // allocates every buffer. `max_tokens` is the launch's tokens per rank:
  // Forward refuses more.
  static absl::StatusOr<std::unique_ptr<PipelinedLlep>> Create(
      const ModelConfig& model, const PipelinedLlepOptions& options, int64_t max_tokens,
      Backend& backend, ModelKernels& kernels, Communicator& experts, Stream& compute,
      Stream& comm, const ElementBytes& e = kFp32Elements);
  ~PipelinedLlep() override;

  absl::Status Forward(const float* u, const int32_t* chosen, const float* gates, int64_t tokens,
                       const ExpertWeights& w, float* out) override;
  // Plans the layer as Forward does (K, the per-chunk counts, every chunk's
  // plan and staged index words: the same collectives, or none when the
  // layer was named by SetLayer and its Forward kept the counts) and keeps u and
  // gates, but runs no chunk: Backward replays every chunk's forward anyway,
  // so its results are bitwise those after Forward.
  absl::Status ForwardForBackward(const float* u, const int32_t* chosen, const float* gates,
                                  int64_t tokens, const ExpertWeights& w, float* out) override;
  absl::Status Backward(const float* dout, const ExpertWeights& w, float* du, float* dgates,
                        const ExpertGrads& g) override;
  // The same in bf16 mixed precision (Create with kBf16MixedElements).
  absl::Status Forward(const Bf16* u, const int32_t* chosen, const float* gates, int64_t tokens,
                       const ExpertWeightsT<Bf16>& w, Bf16* out) override;
  absl::Status ForwardForBackward(const Bf16* u, const int32_t* chosen, const float* gates,
                                  int64_t tokens, const ExpertWeightsT<Bf16>& w, Bf16* out) override;
  absl::Status Backward(const Bf16* dout, const ExpertWeightsT<Bf16>& w, Bf16* du, float* dgates,
                        const ExpertGradsT<Bf16>& g) override;
  // Forgets the layer (the buffers are the schedule's for its lifetime).
  void Release() override;
  // The layer the next Forward keeps its counts for, or the next
  // ForwardForBackward takes them from (see above).
  void SetLayer(int64_t layer) override { layer_ = layer; }

  // The last Forward's chunk count and, over its chunks, the most rows this
  // rank received (<= P c k, Eq. 1) and experts it borrowed and lent; for
  // tests and for the benchmark's peak as a fraction of the bound.
  int64_t chunks() const { return chunks_; }
  const LlepChunkSizes& max_chunk_sizes() const { return max_sizes_; }
  const LlepChunkSizes& slot_sizes() const { return bf16_ ? mem_bf16_.sizes : mem_.sizes; }

 private:
  PipelinedLlep(const ModelConfig& model, const PipelinedLlepOptions& options,
                int64_t max_tokens, Backend& backend, ModelKernels& kernels,
                Communicator& experts, Stream& compute, Stream& comm, bool bf16);
  absl::Status Allocate();
  // The runner and the slots of the working type W.
  template <typename W>
  LlepChunkRunnerT<W>& Runner();
  template <typename W>
  const LlepChunkMemoryT<W>& Mem() const;
  // INTERNAL unless the slots were made for W.
  template <typename W>
  absl::Status CheckElement() const;
  template <typename W>
  absl::Status ForwardT(const W* u, const int32_t* chosen, const float* gates, int64_t tokens,
                        const ExpertWeightsT<W>& w, W* out);
  template <typename W>
  absl::Status ForwardForBackwardT(const W* u, const int32_t* chosen, const float* gates, int64_t tokens);
  template <typename W>
  absl::Status BackwardT(const W* dout, const ExpertWeightsT<W>& w, W* du, float* dgates,
                         const ExpertGradsT<W>& g);
  // `layer`: SetLayer's (-1: none). `for_backward`: ForwardForBackward's
  // plan, which takes the layer's counts when its Forward kept them.
  absl::Status Plan(const int32_t* chosen, int64_t tokens, int64_t layer, bool for_backward);
  absl::Status CheckGroupTokens(int64_t n) const;
  // Forgets the last layer, validates `tokens` and `layer` and plans
  // (Forward's and ForwardForBackward's common start).
  absl::Status Begin(const int32_t* chosen, int64_t tokens, int64_t layer, bool for_backward);
  // Layer l's kept words: K, then the counts as gathered ([P][K][E], int32)
  // in a region sized for K_max.
  int32_t* Kept(int64_t l);
  const int32_t* StagedIndex(int64_t chunk) const;
  // The planner's arrays in planning_ (PipelinedLlepPlanningBytes), for the
  // layer Plan last saw: `all` [P][K][E] counts as gathered (K = chunks_),
  // `mine` [K][E] this rank's, `chunk_counts` [P][E] and `loads` [E] one
  // chunk's, `chosen` [tokens_ k] this rank's routes.
  struct PlanningArrays {
    int64_t* all;
    int64_t* mine;
    int64_t* chunk_counts;
    int64_t* loads;
    int32_t* chosen;
  };
  PlanningArrays Planning() const;
  // Chunk j's plan from the planning arrays (AssignLlep over its loads,
  // then this rank's part): Plan's, with the index vectors it stages, and
  // Forward's and Backward's again, without them (the device has them).
  absl::StatusOr<LlepRankPlan> PlanChunk(int64_t chunk, bool index_vectors);

  const ModelConfig model_;
  const PipelinedLlepOptions options_;
  const int64_t max_tokens_;
  const int64_t max_chunks_;
  Backend& backend_;
  Communicator& comm_;
  Stream& compute_;
  Stream& comm_stream_;
  const bool bf16_;  // the slots hold bf16 rows (Create's e)
  LlepChunkRunner runner_;
  LlepChunkRunnerT<Bf16> runner_bf16_;

  std::vector<Buffer> buffers_;  // PipelinedLlepBuffers' list, in order
  LlepChunkMemory mem_;          // the chunk slots (fp32)
  LlepChunkMemoryT<Bf16> mem_bf16_;  // the chunk slots (bf16)
  Buffer host_index_;            // K_max slot layouts of index words
  Buffer kept_;                  // per layer: its K and gathered counts
  Buffer planning_;              // the planner's arrays (Planning())
  float* grad_accum_ = nullptr;  // "grad_accum" (bf16, K_max > 1), else null
  std::vector<bool> kept_valid_;  // [layers]: kept_ holds the layer's last Forward's
  int64_t layer_ = -1;           // SetLayer's, for the next call

  // The layer between Forward and Backward.
  bool forward_done_ = false;
  const void* u_ = nullptr;  // the working type's u
  const float* gates_ = nullptr;
  int64_t tokens_ = 0;  // N: the layer's tokens on this rank
  int64_t chunks_ = 0;
  LlepChunkSizes max_sizes_;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_DISPATCH_PIPELINED_LLEP_H_
