// PipelinedLLEP's host memory beside its launch-sized arrays
// (PipelinedLlepHostBytes, in the budget's host plan): what a layer takes
// from the plain heap, counted by replacing operator new
// (kernels/testing/heap_counter.h), does not grow with the layer's tokens.
// Plans are made a chunk at a time and freed; keeping one per chunk from
// Forward to Backward (K = N / c of them), and vectors of the layer's
// routes and counts, grew with N.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <utility>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/dispatch/dispatch_testing.h"
#include "kernels/dispatch/llep_plan.h"
#include "kernels/dispatch/pipelined_llep.h"
#include "kernels/dispatch/routing_profiles.h"
#include "kernels/memory.h"
#include "kernels/status_macros.h"
#include "kernels/testing/heap_counter.h"

namespace plateau {
namespace {

// The heap a layer takes, from before its Forward (the layer named, so
// that its counts are kept): what is held after it (the streams drained;
// every rank's, the heap being the process's), and the most one rank's
// recompute of the layer takes on top: its ForwardForBackward, which runs
// no chunk and no collective, only the host's planning (the routes copied
// back, every chunk's plan made and its index words staged). The ranks
// take turns there, so each rank's planning is measured alone: the same
// allocations every run, so the same bytes. `held` also has the CPU
// stream's queue and Gloo's maps of pending operations reaching a new
// high-water mark when the host ran further ahead of the chunks than
// before (timing: 0 to ~20 KB at K = 256 here, bounded by the K chunks the
// host can run ahead), so it is held only to a loose bound: 64 KB over the
// short layer's, where a plan kept per chunk from Forward to Backward took
// ~240 KB (both ranks, K = 256).
struct LayerHeap {
  int64_t held = -1;      // from Forward to Backward, every rank's
  int64_t planning = -1;  // the most one rank's recompute planning takes
};

class MeasuredLayer final : public WrappedDispatch {
 public:
  // `scratch`: rows for the first Forward's output (the caller's out
  // accumulates, and is checked against the reference after one Forward).
  MeasuredLayer(std::unique_ptr<ExpertDispatch> d, int rank, int ranks, Stream& compute, Stream& comm, Buffer scratch,
                HeapWindow* window, LayerHeap* heap)
      : WrappedDispatch(std::move(d)),
        rank_(rank),
        ranks_(ranks),
        compute_(compute),
        comm_(comm),
        scratch_(std::move(scratch)),
        window_(window),
        heap_(heap) {}
  absl::Status Forward(const float* u, const int32_t* chosen, const float* gates, int64_t tokens,
                       const ExpertWeights& w, float* out) override {
    // A first Forward, not measured, so that most of that growth is done.
    PLATEAU_RETURN_IF_ERROR(inner().Forward(u, chosen, gates, tokens, w, scratch_.as<float>()));
    PLATEAU_RETURN_IF_ERROR(compute_.Synchronize());
    PLATEAU_RETURN_IF_ERROR(comm_.Synchronize());
    inner().Release();
    window_->Begin();
    inner().SetLayer(0);
    PLATEAU_RETURN_IF_ERROR(inner().Forward(u, chosen, gates, tokens, w, out));
    PLATEAU_RETURN_IF_ERROR(compute_.Synchronize());
    PLATEAU_RETURN_IF_ERROR(comm_.Synchronize());
    const int64_t held = window_->Held();
    if (rank_ == 0) heap_->held = held;
    absl::Status s;
    int64_t most = 0;
    for (int turn = 0; turn < ranks_; ++turn) {
      const int64_t before = window_->Held();
      window_->RestartPeak();
      if (turn == rank_) {
        inner().SetLayer(0);
        s = inner().ForwardForBackward(u, chosen, gates, tokens, w, nullptr);
      }
      most = std::max(most, window_->End() - before);
    }
    if (rank_ == 0) heap_->planning = most;
    return s;
  }

 private:
  const int rank_, ranks_;
  Stream& compute_;
  Stream& comm_;
  Buffer scratch_;
  HeapWindow* const window_;
  LayerHeap* const heap_;
};

// The layer's heap at `tokens` per rank (P = 2, c = 4), with outputs and
// gradients checked against the reference so that the plans measured are
// the ones that run.
LayerHeap MeasureLayer(int64_t tokens) {
  ModelConfig m = DispatchTestModel();
  m.experts = 16;
  PipelinedLlepOptions o;
  o.chunk_tokens = 4;
  o.balance.alpha = 1.0;
  o.balance.min_piece = 2;
  o.balance.lambda = 1.0;
  const DispatchProblem pr = MakeProfileProblem(m, {tokens, tokens - 3}, HotRouting(80, 4), 7);
  HeapWindow window(pr.P);
  LayerHeap heap;
  const DispatchGot got =
      RunDispatch(pr,
                  [&](int p, const ModelConfig& mc, Backend& be, ModelKernels& k, Communicator& world, Stream& compute,
                      Stream& comm) -> absl::StatusOr<std::unique_ptr<ExpertDispatch>> {
                    absl::StatusOr<std::unique_ptr<PipelinedLlep>> d =
                        PipelinedLlep::Create(mc, o, tokens, be, k, world, compute, comm);
                    if (!d.ok()) return d.status();
                    absl::StatusOr<Buffer> scratch =
                        be.device().Allocate(LiveSet::kActivations, tokens * mc.hidden * sizeof(float));
                    if (!scratch.ok()) return scratch.status();
                    return std::unique_ptr<ExpertDispatch>(
                        new MeasuredLayer(std::move(*d), p, pr.P, compute, comm, std::move(*scratch), &window, &heap));
                  });
  EXPECT_FALSE(window.broken());
  ExpectMatchesReference(got, DispatchReference(pr));
  return heap;
}

TEST(PipelinedLlepHostTest, PlanningALayerTakesNoMoreHeapAtLongerContext) {
  if (!HeapIsCounted()) GTEST_SKIP() << "the heap is not counted in this build (AddressSanitizer's allocator)";
  const LayerHeap short_layer = MeasureLayer(16);   // K = 4 chunks
  const LayerHeap long_layer = MeasureLayer(1024);  // K = 256
  std::printf(
      "a layer's heap: held from Forward to Backward (both ranks) %lld bytes at N = 16 (K = 4), %lld at "
      "N = 1024 (K = 256); a rank's recompute planning %lld and %lld on top\n",
      static_cast<long long>(short_layer.held), static_cast<long long>(long_layer.held),
      static_cast<long long>(short_layer.planning), static_cast<long long>(long_layer.planning));
  // One chunk's planning at a time (c is the same): equal up to the
  // largest chunk's plan, a few hundred bytes here. The routes, the counts
  // and a plan per chunk on the heap took ~120 KB a rank at K = 256.
  EXPECT_LE(long_layer.planning, short_layer.planning + 1024);
  EXPECT_LE(long_layer.held, short_layer.held + 64 * 1024);
  // And less than half of one copy of the long layer's routes (N k int32).
  EXPECT_LT(long_layer.planning, int64_t{1024} * DispatchTestModel().top_k * 4 / 2);
}

}  // namespace
}  // namespace plateau
