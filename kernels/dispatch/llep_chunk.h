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
// they were allocated for.
struct LlepChunkMemory {
  LlepChunkSizes sizes;
  LlepIndexLayout layout;
  int32_t* index = nullptr;
  float* gates_sent = nullptr;    // [S]
  float* chunk_gates = nullptr;   // [S] token view
  float* chunk_dgates = nullptr;  // [S] token view
  float *send = nullptr, *recv = nullptr, *x = nullptr, *t = nullptr;
  float *gate = nullptr, *up = nullptr, *act = nullptr, *dact = nullptr, *dup = nullptr;
  float* token_rows = nullptr;
  float *borrowed_weights = nullptr, *borrowed_grads = nullptr, *lent = nullptr;
};

// Allocates `specs` in order in the kDispatch live set, appending to `out`.
absl::Status AllocateDispatchBuffers(Backend& backend, const std::vector<DispatchBufferSpec>& specs,
                                     std::vector<Buffer>* out);
// Points into the chunk buffers that start at buffers[first] (allocated from
// LlepChunkBuffers(model, sizes)); INTERNAL if the names or sizes differ.
absl::StatusOr<LlepChunkMemory> CarveChunk(const ModelConfig& model, const LlepChunkSizes& sizes,
                                           const std::vector<Buffer>& buffers, size_t first);
// The plan's index vectors at `layout`'s offsets of `dst` (host memory).
void WriteChunkIndex(const LlepRankPlan& plan, const LlepIndexLayout& layout, int32_t* dst);

class LlepChunkRunner {
 public:
  LlepChunkRunner(const ModelConfig& model, Backend& backend, ModelKernels& kernels,
                  Communicator& experts, Stream& compute, Stream& comm);

  // INTERNAL when the plan does not fit the memory: a broken bound, never a
  // property of the routing.
  absl::Status Fits(const LlepRankPlan& plan, const LlepChunkMemory& mem) const;

  // mem.layout.total index words from `host` (host memory).
  absl::Status UploadIndex(const int32_t* host, const LlepChunkMemory& mem);
  // Owners pack the experts they lend and every helper receives its
  // borrowed experts' [gate | up | down] in borrowed_weights.
  absl::Status ShipWeights(const LlepRankPlan& plan, const LlepChunkMemory& mem,
                           const ExpertWeights& w);
  // x = this rank's received rows of u, expert-major.
  absl::Status DispatchRows(const LlepRankPlan& plan, const LlepChunkMemory& mem, const float* u);
  // gate, up, act from x; the expert outputs into recv (expert-major).
  absl::Status ExpertForward(const LlepRankPlan& plan, const LlepChunkMemory& mem,
                             const ExpertWeights& w);
  // The outputs back to their sources: send holds them in send order.
  absl::Status ReturnOutputs(const LlepRankPlan& plan, const LlepChunkMemory& mem);
  // out[t] += sum_j gates[t, j] y_{t,j} over the chunk's tokens.
  absl::Status Combine(const LlepRankPlan& plan, const LlepChunkMemory& mem, const float* gates,
                       float* out);
  // dgates[t, j] = <dout[t], y_{t,j}> over the chunk's routes (from send).
  absl::Status GateGrads(const LlepRankPlan& plan, const LlepChunkMemory& mem, const float* dout,
                         float* dgates);
  // t = dy = gates * dout rows, received and expert-major.
  absl::Status DispatchOutputGrads(const LlepRankPlan& plan, const LlepChunkMemory& mem,
                                   const float* dout, const float* gates);
  // dx into recv (expert-major); own experts' gradients accumulate into g,
  // borrowed experts' go to borrowed_grads.
  absl::Status ExpertBackward(const LlepRankPlan& plan, const LlepChunkMemory& mem,
                              const ExpertWeights& w, const ExpertGrads& g);
  // du[t] += sum_j dx_{t,j} over the chunk's tokens.
  absl::Status ReturnInputGrads(const LlepRankPlan& plan, const LlepChunkMemory& mem, float* du);
  // Helpers send borrowed_grads to the owners, which add them into g.
  absl::Status ReturnWeightGrads(const LlepRankPlan& plan, const LlepChunkMemory& mem,
                                 const ExpertGrads& g);

 private:
  // Rows of `width` floats; send_counts/recv_counts in rows.
  absl::Status Exchange(const float* send, absl::Span<const int64_t> send_rows, float* recv,
                        absl::Span<const int64_t> recv_rows, int64_t width);
  // Adds the chunk's per-route rows in `src` (send order) into rows of
  // `dst` (the caller's N x H), weighted by gates when given.
  absl::Status CombineInto(const LlepRankPlan& plan, const LlepChunkMemory& mem, const float* src,
                           const float* gates, float* dst);
  struct GroupWeights {
    const float *gate, *up, *down;
  };
  GroupWeights WeightsOf(const LlepGroup& group, const LlepChunkMemory& mem,
                         const ExpertWeights& w) const;
  // The plan's groups for expert_mlp.h; with `grads`, where each group's
  // weight gradients go.
  std::vector<ExpertGroup> Groups(const LlepRankPlan& plan, const LlepChunkMemory& mem,
                                  const ExpertWeights& w, const ExpertGrads* grads) const;

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

}  // namespace plateau

#endif  // PLATEAU_KERNELS_DISPATCH_LLEP_CHUNK_H_
