// The device work of one LLEP chunk, shared by Llep (one chunk: the whole
// layer, in buffers of its realized sizes) and PipelinedLlep (K chunks in
// launch-sized slots reused chunk to chunk). Each step enqueues on the
// compute and communication streams and returns without waiting, except
// where a host vector is copied (Backend::Copy completes those at once).
//
// The expert compute is expert_mlp.h: one grouped GEMM per step over every
// expert group of the chunk (own and borrowed experts).
//
// The steps of a chunk, given its LlepRankPlan (llep_plan.h):
//   forward   UploadIndex, ShipWeights, DispatchRows, ExpertForward,
//             ReturnOutputs, Combine
//   backward  GateGrads (needs ReturnOutputs' rows), DispatchOutputGrads,
//             ExpertBackward (needs ExpertForward's x, gate, up, act),
//             ReturnInputGrads, ReturnWeightGrads
// Buffer reuse within a chunk is in stream order: every communication is
// ordered after the compute enqueued before it (an event), and compute waits
// for it to land before going on, so a buffer's next writer is always queued
// behind its last reader. The same holds from one chunk to the next.
//
// Sums: an expert's weight gradient gets the rows its owner computes first
// (GEMMs accumulating into it, groups in ascending expert order), then each
// helper's gradient in ascending helper rank (ReturnWeightGrads): a fixed
// order, so the same routes give the same bits.
//
// Precision (W): float, or Bf16 under bf16 mixed (rows, weights and
// gradients bf16 through WorkingOps<W>, exchanged as kBfloat16; the gates
// and dgates fp32): LlepChunkRunner / LlepChunkMemory are the float
// instantiations. Under bf16 an expert's helpers' gradients add into its
// owner's in one fp32 sum rounded once (Backend::AddRowsBf16), or, when the
// caller passes fp32 accumulators (ExpertGradAccum: PipelinedLLEP over
// K > 1 chunks), into those (loaded exactly), with the owner's GEMMs.
//
// Thread safety: one per rank, not thread-safe.
#ifndef PLATEAU_KERNELS_DISPATCH_LLEP_CHUNK_H_
#define PLATEAU_KERNELS_DISPATCH_LLEP_CHUNK_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/dispatch/expert_dispatch.h"
#include "kernels/dispatch/expert_mlp.h"
#include "kernels/dispatch/llep_plan.h"
#include "kernels/memory.h"
#include "kernels/model/config.h"
#include "kernels/model/model_kernels.h"

namespace plateau {

// Pointers into one chunk's buffers (LlepChunkBuffers' list), and the sizes
// they were allocated for; the rows in the working type W.
template <typename W>
struct LlepChunkMemoryT {
  LlepChunkSizes sizes;
  LlepIndexLayout layout;
  int32_t* index = nullptr;
  float* gates_sent = nullptr;    // [S]
  float* chunk_gates = nullptr;   // [S] token view
  float* chunk_dgates = nullptr;  // [S] token view
  W *send = nullptr, *recv = nullptr, *x = nullptr, *t = nullptr;
  W *gate = nullptr, *up = nullptr, *act = nullptr, *dact = nullptr, *dup = nullptr;
  W* token_rows = nullptr;
  W *borrowed_weights = nullptr, *borrowed_grads = nullptr, *lent = nullptr;
};
using LlepChunkMemory = LlepChunkMemoryT<float>;

// fp32 accumulators of this rank's own experts' weight gradients, each
// [E_p, H F] in the layout of ExpertGradsT, and `scratch` [H F] into which
// each part of a helper's bf16 gradient is loaded before it is added (bf16
// only: in fp32 the gradients themselves are fp32).
struct ExpertGradAccum {
  float* w_gate = nullptr;
  float* w_up = nullptr;
  float* w_down = nullptr;
  float* scratch = nullptr;
};

// Allocates `specs` in order in the kDispatch live set, appending to `out`.
absl::Status AllocateDispatchBuffers(Backend& backend, const std::vector<DispatchBufferSpec>& specs,
                                     std::vector<Buffer>* out);
// Points into the chunk buffers that start at buffers[first] (allocated from
// LlepChunkBuffers(model, sizes, e) with e the element sizes of W);
// INTERNAL if the names or sizes differ.
template <typename W = float>
absl::StatusOr<LlepChunkMemoryT<W>> CarveChunk(const ModelConfig& model, const LlepChunkSizes& sizes,
                                               const std::vector<Buffer>& buffers, size_t first);
// The plan's index vectors at `layout`'s offsets of `dst` (host memory).
void WriteChunkIndex(const LlepRankPlan& plan, const LlepIndexLayout& layout, int32_t* dst);

template <typename W>
class LlepChunkRunnerT {
 public:
  LlepChunkRunnerT(const ModelConfig& model, Backend& backend, ModelKernels& kernels,
                  Communicator& experts, Stream& compute, Stream& comm);

  // INTERNAL when the plan does not fit the memory: a broken bound, never a
  // property of the routing.
  absl::Status Fits(const LlepRankPlan& plan, const LlepChunkMemoryT<W>& mem) const;

  // mem.layout.total index words from `host` (host memory).
  absl::Status UploadIndex(const int32_t* host, const LlepChunkMemoryT<W>& mem);
  // Owners pack the experts they lend and every helper receives its
  // borrowed experts' [gate | up | down] in borrowed_weights.
  absl::Status ShipWeights(const LlepRankPlan& plan, const LlepChunkMemoryT<W>& mem,
                           const ExpertWeightsT<W>& w);
  // x = this rank's received rows of u, expert-major.
  absl::Status DispatchRows(const LlepRankPlan& plan, const LlepChunkMemoryT<W>& mem, const W* u);
  // gate, up, act from x; the expert outputs into recv (expert-major).
  absl::Status ExpertForward(const LlepRankPlan& plan, const LlepChunkMemoryT<W>& mem,
                             const ExpertWeightsT<W>& w);
  // The outputs back to their sources: send holds them in send order.
  absl::Status ReturnOutputs(const LlepRankPlan& plan, const LlepChunkMemoryT<W>& mem);
  // out[t] += sum_j gates[t, j] y_{t,j} over the chunk's tokens.
  absl::Status Combine(const LlepRankPlan& plan, const LlepChunkMemoryT<W>& mem, const float* gates,
                       W* out);
  // dgates[t, j] = <dout[t], y_{t,j}> over the chunk's routes (from send).
  absl::Status GateGrads(const LlepRankPlan& plan, const LlepChunkMemoryT<W>& mem, const W* dout,
                         float* dgates);
  // t = dy = gates * dout rows, received and expert-major.
  absl::Status DispatchOutputGrads(const LlepRankPlan& plan, const LlepChunkMemoryT<W>& mem,
                                   const W* dout, const float* gates);
  // dx into recv (expert-major); own experts' gradients accumulate into g
  // (into `acc` when given), borrowed experts' go to borrowed_grads.
  absl::Status ExpertBackward(const LlepRankPlan& plan, const LlepChunkMemoryT<W>& mem, const ExpertWeightsT<W>& w,
                              const ExpertGradsT<W>& g, const ExpertGradAccum* acc = nullptr);
  // du[t] += sum_j dx_{t,j} over the chunk's tokens.
  absl::Status ReturnInputGrads(const LlepRankPlan& plan, const LlepChunkMemoryT<W>& mem, W* du);
  // Helpers send borrowed_grads to the owners, which add them into g (into
  // `acc` when given).
  absl::Status ReturnWeightGrads(const LlepRankPlan& plan, const LlepChunkMemoryT<W>& mem, const ExpertGradsT<W>& g,
                                 const ExpertGradAccum* acc = nullptr);

 private:
  // Rows of `width` floats; send_counts/recv_counts in rows.
  absl::Status Exchange(const W* send, absl::Span<const int64_t> send_rows, W* recv,
                        absl::Span<const int64_t> recv_rows, int64_t width);
  // Adds the chunk's per-route rows in `src` (send order) into rows of
  // `dst` (the caller's N x H), weighted by gates when given.
  absl::Status CombineInto(const LlepRankPlan& plan, const LlepChunkMemoryT<W>& mem, const W* src,
                           const float* gates, W* dst);
  struct GroupWeights {
    const W *gate, *up, *down;
  };
  GroupWeights WeightsOf(const LlepGroup& group, const LlepChunkMemoryT<W>& mem,
                         const ExpertWeightsT<W>& w) const;
  // The plan's groups for expert_mlp.h; with `grads`, where each group's
  // weight gradients go.
  std::vector<ExpertGroupT<W>> Groups(const LlepRankPlan& plan, const LlepChunkMemoryT<W>& mem,
                                      const ExpertWeightsT<W>& w, const ExpertGradsT<W>* grads,
                                      const ExpertGradAccum* acc = nullptr) const;

  const ModelConfig model_;
  Backend& backend_;
  ModelKernels& kernels_;
  Communicator& comm_;
  Stream& compute_;
  Stream& comm_stream_;
  const int64_t local_experts_;
  // Outlive every call: queued work refers to them.
  std::unique_ptr<Event> ready_, landed_;
};

using LlepChunkRunner = LlepChunkRunnerT<float>;

}  // namespace plateau

#endif  // PLATEAU_KERNELS_DISPATCH_LLEP_CHUNK_H_
