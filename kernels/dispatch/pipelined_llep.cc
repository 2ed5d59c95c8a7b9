#include "kernels/dispatch/pipelined_llep.h"

#include <algorithm>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/model/working_ops.h"
#include "kernels/status_macros.h"

namespace plateau {

absl::StatusOr<std::unique_ptr<PipelinedLlep>> PipelinedLlep::Create(
    const ModelConfig& model, const PipelinedLlepOptions& options, int64_t max_tokens,
    Backend& backend, ModelKernels& kernels, Communicator& experts, Stream& compute,
    Stream& comm, const ElementBytes& e) {
  PLATEAU_RETURN_IF_ERROR(ValidatePipelinedLlepOptions(options));
  PLATEAU_RETURN_IF_ERROR(ValidateLlepShape(model, experts.size()));
  if (max_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("PipelinedLlep: max_tokens (the launch's tokens per rank) must be >= 0, got ",
                     max_tokens));
  }
  std::unique_ptr<PipelinedLlep> p(new PipelinedLlep(model, options, max_tokens, backend, kernels,
                                                     experts, compute, comm, !e.working_is_master()));
  PLATEAU_RETURN_IF_ERROR(p->Allocate());
  return p;
}

PipelinedLlep::PipelinedLlep(const ModelConfig& model, const PipelinedLlepOptions& options,
                             int64_t max_tokens, Backend& backend, ModelKernels& kernels,
                             Communicator& experts, Stream& compute, Stream& comm, bool bf16)
    : model_(model),
      options_(options),
      max_tokens_(max_tokens),
      max_chunks_(PipelinedLlepChunks(max_tokens, options.chunk_tokens)),
      backend_(backend),
      comm_(experts),
      compute_(compute),
      comm_stream_(comm),
      bf16_(bf16),
      runner_(model, backend, kernels, experts, compute, comm),
      runner_bf16_(model, backend, kernels, experts, compute, comm) {}

PipelinedLlep::~PipelinedLlep() = default;

absl::Status PipelinedLlep::Allocate() {
  const int64_t P = comm_.size();
  const ElementBytes e = bf16_ ? kBf16MixedElements : kFp32Elements;
  PLATEAU_RETURN_IF_ERROR(AllocateDispatchBuffers(
      backend_, PipelinedLlepBuffers(model_, P, max_tokens_, options_, e), &buffers_));
  const LlepChunkSizes slots = PipelinedLlepSlotSizes(model_, P, max_tokens_, options_);
  if (bf16_) {
    PLATEAU_ASSIGN_OR_RETURN(mem_bf16_, CarveChunk<Bf16>(model_, slots, buffers_, 1));
    if (PipelinedLlepAccumulatesInFp32(max_tokens_, options_, e)) grad_accum_ = buffers_.back().as<float>();
  } else {
    PLATEAU_ASSIGN_OR_RETURN(mem_, CarveChunk(model_, slots, buffers_, 1));
  }
  PLATEAU_ASSIGN_OR_RETURN(
      host_index_,
      backend_.host().Allocate(
          LiveSet::kDispatch,
          PipelinedLlepHostIndexWords(model_, P, max_tokens_, options_) * sizeof(int32_t)));
  PLATEAU_ASSIGN_OR_RETURN(
      kept_, backend_.host().Allocate(
                 LiveSet::kDispatch,
                 PipelinedLlepKeptCountWords(model_, P, max_tokens_, options_) * sizeof(int32_t)));
  PLATEAU_ASSIGN_OR_RETURN(
      planning_,
      backend_.host().Allocate(LiveSet::kDispatch, PipelinedLlepPlanningBytes(model_, P, max_tokens_, options_)));
  kept_valid_.assign(std::max<int64_t>(0, model_.layers), false);
  return absl::OkStatus();
}

int32_t* PipelinedLlep::Kept(int64_t l) {
  return kept_.as<int32_t>() + l * (1 + comm_.size() * max_chunks_ * model_.experts);
}

void PipelinedLlep::Release() {
  forward_done_ = false;
  u_ = nullptr;
  gates_ = nullptr;
}

PipelinedLlep::PlanningArrays PipelinedLlep::Planning() const {
  // The int64 arrays first, then the int32 routes (the layout
  // PipelinedLlepPlanningBytes counts), each sized for the launch.
  const int64_t P = comm_.size(), E = model_.experts;
  PlanningArrays a;
  a.all = planning_.as<int64_t>();
  a.mine = a.all + P * max_chunks_ * E;
  a.chunk_counts = a.mine + max_chunks_ * E;
  a.loads = a.chunk_counts + P * E;
  a.chosen = reinterpret_cast<int32_t*>(a.loads + E);
  return a;
}

absl::StatusOr<LlepRankPlan> PipelinedLlep::PlanChunk(int64_t j, bool index_vectors) {
  const int64_t P = comm_.size(), E = model_.experts, K = model_.top_k;
  const PlanningArrays a = Planning();
  std::fill(a.loads, a.loads + E, 0);
  for (int64_t s = 0; s < P; ++s) {
    for (int64_t e = 0; e < E; ++e) {
      a.chunk_counts[s * E + e] = a.all[(s * chunks_ + j) * E + e];
      a.loads[e] += a.chunk_counts[s * E + e];
    }
  }
  const LlepAssignment assignment = AssignLlep(absl::MakeConstSpan(a.loads, E), P, options_.balance);
  return PlanLlepRank(assignment, absl::MakeConstSpan(a.chunk_counts, P * E), comm_.rank(), P, model_,
                      absl::MakeConstSpan(a.chosen, tokens_ * K), tokens_,
                      ChunkTokenRows(tokens_, chunks_, j, options_.membership), index_vectors);
}

const int32_t* PipelinedLlep::StagedIndex(int64_t chunk) const {
  const LlepIndexLayout& layout = bf16_ ? mem_bf16_.layout : mem_.layout;
  return host_index_.as<int32_t>() + chunk * layout.total;
}

template <>
LlepChunkRunnerT<float>& PipelinedLlep::Runner<float>() {
  return runner_;
}
template <>
LlepChunkRunnerT<Bf16>& PipelinedLlep::Runner<Bf16>() {
  return runner_bf16_;
}
template <>
const LlepChunkMemoryT<float>& PipelinedLlep::Mem<float>() const {
  return mem_;
}
template <>
const LlepChunkMemoryT<Bf16>& PipelinedLlep::Mem<Bf16>() const {
  return mem_bf16_;
}

template <typename W>
absl::Status PipelinedLlep::CheckElement() const {
  if (bf16_ == std::is_same_v<W, Bf16>) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("PipelinedLlep: its slots hold ", bf16_ ? "bf16" : "fp32",
                                          " rows, called with ", bf16_ ? "fp32" : "bf16", " ones"));
}

// A rank of the group has more tokens than the buffers were sized for.
absl::Status PipelinedLlep::CheckGroupTokens(int64_t n) const {
  if (n > max_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PipelinedLlep::Forward: a rank of the expert group has ", n,
        " tokens, more than the launch's ", max_tokens_, " the buffers were sized for"));
  }
  return absl::OkStatus();
}

// The host's part of a Forward: K, everyone's per-chunk counts, and every
// chunk's plan and index vectors. The only host waits of the layer.
absl::Status PipelinedLlep::Plan(const int32_t* chosen, int64_t N, int64_t layer, bool for_backward) {
  const int64_t P = comm_.size(), E = model_.experts, K = model_.top_k;
  int64_t* counts = buffers_[0].as<int64_t>();  // [1 | K_max E | P K_max E]
  // The named layer's Forward keeps what the collectives give; the
  // recompute's ForwardForBackward takes it back, once, so a stale plan is
  // never reused (a Forward that fails leaves none either).
  const bool reuse = for_backward && layer >= 0 && kept_valid_[layer];
  if (layer >= 0) kept_valid_[layer] = false;
  // When the launch allows one chunk at most (c >= max_tokens: what `auto`
  // picks wherever it fits), K is 1 on every rank that has tokens, so the
  // counts need no K first: one all-gather instead of an all-reduce and an
  // all-gather, each a host-blocking round trip. The group's largest N is
  // then read off the gathered counts (every token has top_k routes, all
  // checked to be experts below), so the refusal stays collective and the
  // plans are the same.
  const bool one_chunk = max_chunks_ == 1;
  if (reuse) {
    // K as the forward agreed it (>= 1: a layer without tokens anywhere
    // keeps nothing; its refusal of a rank over the launch was collective
    // there).
    chunks_ = Kept(layer)[0];
    max_sizes_ = LlepChunkSizes{};
  } else if (!one_chunk) {
    // K from the largest N of the group: every rank runs the same chunks.
    // Every rank sees the same maximum, so a refusal below is collective.
    int64_t n = N;
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(compute_, counts, &n, sizeof(n)));
    PLATEAU_RETURN_IF_ERROR(
        comm_.AllReduce(comm_stream_, counts, counts, 1, DataType::kInt64, ReduceOp::kMax));
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(comm_stream_, &n, counts, sizeof(n)));
    PLATEAU_RETURN_IF_ERROR(CheckGroupTokens(n));
    chunks_ = PipelinedLlepChunks(n, options_.chunk_tokens);
    max_sizes_ = LlepChunkSizes{};
    if (chunks_ == 0) return absl::OkStatus();
  }
  // This rank's chunks: one when one_chunk (ChunkTokenRows(N, 1, 0) is
  // every row, whatever the group's K turns out to be: 0 or 1).
  const int64_t local_chunks = one_chunk ? 1 : chunks_;

  // This rank's routes and its counts per chunk. The routes are copied into
  // the planning arrays (host memory of the backend, so the copy is
  // asynchronous: the compute stream is synchronised after it), which also
  // waits for the compute stream's earlier work: the staged index words of
  // the previous layer have been uploaded before they are overwritten
  // below. The routes stay there until the layer's Backward, which plans
  // each chunk again from them.
  //
  // More tokens than the launch's do not fit those arrays. With K_max > 1
  // the all-reduced N refused them above; a recompute refuses them here (it
  // exchanges nothing); with one chunk at most this rank counts them as
  // N k routes to expert 0, so that the all-gather shows every rank this N
  // and the refusal below stays collective (no plan is made from them).
  const PlanningArrays arrays = Planning();
  int64_t* mine = arrays.mine;
  std::fill(mine, mine + local_chunks * E, 0);
  const bool over = N > max_tokens_;
  if (over && reuse) return CheckGroupTokens(N);
  if (over) mine[0] = N * K;
  tokens_ = over ? 0 : N;
  int32_t* host_chosen = arrays.chosen;
  if (!over) {
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(compute_, host_chosen, chosen, N * K * sizeof(int32_t)));
    PLATEAU_RETURN_IF_ERROR(compute_.Synchronize());
  }
  for (int64_t j = 0; j < (over ? 0 : local_chunks); ++j) {
    for (int32_t t : ChunkTokenRows(N, local_chunks, j, options_.membership)) {
      for (int64_t i = 0; i < K; ++i) {
        const int32_t e = host_chosen[static_cast<int64_t>(t) * K + i];
        if (e < 0 || e >= E) {
          return absl::InternalError(absl::StrCat("router chose expert ", e, " of ", E));
        }
        ++mine[j * E + e];
      }
    }
  }
  int64_t* local = counts + 1;
  int64_t* gathered = counts + 1 + max_chunks_ * E;
  int64_t* all = arrays.all;  // [source][chunk][expert]
  const int64_t all_size = P * local_chunks * E;
  if (reuse) {
    // Everyone's counts as the forward gathered them. Each rank checks its
    // own block against its recomputed counts, so together the ranks check
    // every block: the plans below are the all-gather's.
    const int32_t* kept = Kept(layer) + 1;
    std::copy(kept, kept + all_size, all);
    const int64_t* own = all + comm_.rank() * local_chunks * E;
    if (!std::equal(mine, mine + local_chunks * E, own)) {
      return absl::InternalError(absl::StrCat(
          "PipelinedLlep: the recompute of layer ", layer,
          " routes differently from its forward (its per-expert counts on rank ", comm_.rank(),
          " differ from the kept ones); a recompute must be bitwise its forward"));
    }
  } else {
    // On the comm stream, so that the all-gather reads the counts after they
    // land (both ends are the backend's memory: the copies are
    // asynchronous, and the host waits for the gathered counts).
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(comm_stream_, local, mine, local_chunks * E * sizeof(int64_t)));
    PLATEAU_RETURN_IF_ERROR(
        comm_.AllGather(comm_stream_, local, gathered, local_chunks * E, DataType::kInt64));
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(comm_stream_, all, gathered, all_size * sizeof(int64_t)));
    PLATEAU_RETURN_IF_ERROR(comm_stream_.Synchronize());
  }
  if (one_chunk && !reuse) {
    int64_t n = 0;  // the group's largest N: a rank's routes over top_k
    for (int64_t s = 0; s < P; ++s) {
      int64_t routes = 0;
      for (int64_t e = 0; e < E; ++e) routes += all[s * E + e];
      n = std::max(n, routes / K);
    }
    PLATEAU_RETURN_IF_ERROR(CheckGroupTokens(n));
    chunks_ = PipelinedLlepChunks(n, options_.chunk_tokens);
    max_sizes_ = LlepChunkSizes{};
    if (chunks_ == 0) return absl::OkStatus();
  }

  // Every chunk's plan: its index words staged, its sizes checked against
  // the slots, then freed (Forward and Backward make it again).
  for (int64_t j = 0; j < chunks_; ++j) {
    PLATEAU_ASSIGN_OR_RETURN(const LlepRankPlan plan, PlanChunk(j, /*index_vectors=*/true));
    const LlepIndexLayout& layout = bf16_ ? mem_bf16_.layout : mem_.layout;
    PLATEAU_RETURN_IF_ERROR(bf16_ ? runner_bf16_.Fits(plan, mem_bf16_) : runner_.Fits(plan, mem_));
    WriteChunkIndex(plan, layout, host_index_.as<int32_t>() + j * layout.total);
    const LlepChunkSizes s = LlepChunkSizesOf(plan);
    max_sizes_.tokens = std::max(max_sizes_.tokens, s.tokens);
    max_sizes_.routes = std::max(max_sizes_.routes, s.routes);
    max_sizes_.rows = std::max(max_sizes_.rows, s.rows);
    max_sizes_.borrowed = std::max(max_sizes_.borrowed, s.borrowed);
    max_sizes_.lent = std::max(max_sizes_.lent, s.lent);
    max_sizes_.token_view = max_sizes_.token_view || s.token_view;
  }
  if (layer >= 0 && !for_backward) {
    // Kept for the layer's recompute. int32: a count is at most a chunk's
    // routes from one source, c_eff k (the index words are int32 too).
    int32_t* kept = Kept(layer);
    kept[0] = static_cast<int32_t>(chunks_);
    std::copy(all, all + all_size, kept + 1);
    kept_valid_[layer] = true;
  }
  return absl::OkStatus();
}

absl::Status PipelinedLlep::Begin(const int32_t* chosen, int64_t tokens, int64_t layer,
                                  bool for_backward) {
  Release();
  if (tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("PipelinedLlep::Forward: tokens = ", tokens));
  }
  if (layer >= static_cast<int64_t>(kept_valid_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("PipelinedLlep: layer ", layer, " of a ",
                                                   kept_valid_.size(), "-layer model"));
  }
  return Plan(chosen, tokens, layer, for_backward);
}

template <typename W>
absl::Status PipelinedLlep::ForwardForBackwardT(const W* u, const int32_t* chosen, const float* gates,
                                                int64_t tokens) {
  const int64_t layer = std::exchange(layer_, -1);  // SetLayer's, for this call only
  PLATEAU_RETURN_IF_ERROR(CheckElement<W>());
  PLATEAU_RETURN_IF_ERROR(Begin(chosen, tokens, layer, /*for_backward=*/true));
  u_ = u;
  gates_ = gates;
  forward_done_ = true;
  return absl::OkStatus();
}

template <typename W>
absl::Status PipelinedLlep::ForwardT(const W* u, const int32_t* chosen, const float* gates, int64_t tokens,
                                     const ExpertWeightsT<W>& w, W* out) {
  const int64_t layer = std::exchange(layer_, -1);  // SetLayer's, for this call only
  PLATEAU_RETURN_IF_ERROR(CheckElement<W>());
  PLATEAU_RETURN_IF_ERROR(Begin(chosen, tokens, layer, /*for_backward=*/false));
  LlepChunkRunnerT<W>& runner = Runner<W>();
  const LlepChunkMemoryT<W>& mem = Mem<W>();
  for (int64_t j = 0; j < chunks_; ++j) {
    PLATEAU_ASSIGN_OR_RETURN(const LlepRankPlan p, PlanChunk(j, /*index_vectors=*/false));
    PLATEAU_RETURN_IF_ERROR(runner.UploadIndex(StagedIndex(j), mem));
    PLATEAU_RETURN_IF_ERROR(runner.ShipWeights(p, mem, w));
    PLATEAU_RETURN_IF_ERROR(runner.DispatchRows(p, mem, u));
    PLATEAU_RETURN_IF_ERROR(runner.ExpertForward(p, mem, w));
    PLATEAU_RETURN_IF_ERROR(runner.ReturnOutputs(p, mem));
    PLATEAU_RETURN_IF_ERROR(runner.Combine(p, mem, gates, out));
  }
  u_ = u;
  gates_ = gates;
  forward_done_ = true;
  return absl::OkStatus();
}

// Each chunk recomputes its forward in the same slots (B.1's inner
// recompute), so Backward holds no more than Forward. The replay includes
// the down projection: the expert backward needs only x, gate, up and act,
// but the gate gradients are dgates[t, j] = <dout[t], y_{t,j}>, which need
// the outputs y. The one exact way around it, <act, dout Wd^T> from an
// unscaled dA GEMM with the gates sent to the receivers, saves one GEMM of
// twelve and changes the rounding of dA, so the K = 1 bits would no longer be
// LLEP's (DESIGN.md §1.1); not done.
template <typename W>
absl::Status PipelinedLlep::BackwardT(const W* dout, const ExpertWeightsT<W>& w, W* du, float* dgates,
                                      const ExpertGradsT<W>& g) {
  PLATEAU_RETURN_IF_ERROR(CheckElement<W>());
  if (!forward_done_) {
    return absl::FailedPreconditionError(
        "PipelinedLlep::Backward needs the layer's Forward first");
  }
  LlepChunkRunnerT<W>& runner = Runner<W>();
  const LlepChunkMemoryT<W>& mem = Mem<W>();
  const W* u = static_cast<const W*>(u_);
  // bf16 over K > 1 chunks: the own experts' gradients sum in fp32 from
  // what g holds (loaded exactly) and round to bf16 once, after the last
  // chunk (at K = 1 the chunk is LLEP's, bit for bit).
  const int64_t EpHF = model_.experts / comm_.size() * model_.hidden * model_.expert_ffn;
  ExpertGradAccum acc;
  const ExpertGradAccum* accum = nullptr;
  if (std::is_same_v<W, Bf16> && grad_accum_ != nullptr && chunks_ > 1) {
    acc = {grad_accum_, grad_accum_ + EpHF, grad_accum_ + 2 * EpHF, grad_accum_ + 3 * EpHF};  // scratch: H F
    accum = &acc;
    PLATEAU_RETURN_IF_ERROR(WorkingOps<W>::ToFloat(backend_, compute_, acc.w_gate, g.w_gate, EpHF));
    PLATEAU_RETURN_IF_ERROR(WorkingOps<W>::ToFloat(backend_, compute_, acc.w_up, g.w_up, EpHF));
    PLATEAU_RETURN_IF_ERROR(WorkingOps<W>::ToFloat(backend_, compute_, acc.w_down, g.w_down, EpHF));
  }
  for (int64_t j = 0; j < chunks_; ++j) {
    PLATEAU_ASSIGN_OR_RETURN(const LlepRankPlan p, PlanChunk(j, /*index_vectors=*/false));
    PLATEAU_RETURN_IF_ERROR(runner.UploadIndex(StagedIndex(j), mem));
    PLATEAU_RETURN_IF_ERROR(runner.ShipWeights(p, mem, w));
    PLATEAU_RETURN_IF_ERROR(runner.DispatchRows(p, mem, u));
    PLATEAU_RETURN_IF_ERROR(runner.ExpertForward(p, mem, w));
    PLATEAU_RETURN_IF_ERROR(runner.ReturnOutputs(p, mem));
    PLATEAU_RETURN_IF_ERROR(runner.GateGrads(p, mem, dout, dgates));
    PLATEAU_RETURN_IF_ERROR(runner.DispatchOutputGrads(p, mem, dout, gates_));
    PLATEAU_RETURN_IF_ERROR(runner.ExpertBackward(p, mem, w, g, accum));
    PLATEAU_RETURN_IF_ERROR(runner.ReturnInputGrads(p, mem, du));
    PLATEAU_RETURN_IF_ERROR(runner.ReturnWeightGrads(p, mem, g, accum));
  }
  if (accum != nullptr) {
    PLATEAU_RETURN_IF_ERROR(WorkingOps<W>::FromFloat(backend_, compute_, g.w_gate, acc.w_gate, EpHF));
    PLATEAU_RETURN_IF_ERROR(WorkingOps<W>::FromFloat(backend_, compute_, g.w_up, acc.w_up, EpHF));
    PLATEAU_RETURN_IF_ERROR(WorkingOps<W>::FromFloat(backend_, compute_, g.w_down, acc.w_down, EpHF));
  }
  Release();
  return absl::OkStatus();
}

absl::Status PipelinedLlep::ForwardForBackward(const float* u, const int32_t* chosen, const float* gates,
                                               int64_t tokens, const ExpertWeights&, float*) {
  return ForwardForBackwardT<float>(u, chosen, gates, tokens);
}

absl::Status PipelinedLlep::ForwardForBackward(const Bf16* u, const int32_t* chosen, const float* gates,
                                               int64_t tokens, const ExpertWeightsT<Bf16>&, Bf16*) {
  return ForwardForBackwardT<Bf16>(u, chosen, gates, tokens);
}

absl::Status PipelinedLlep::Forward(const float* u, const int32_t* chosen, const float* gates, int64_t tokens,
                                    const ExpertWeights& w, float* out) {
  return ForwardT<float>(u, chosen, gates, tokens, w, out);
}

absl::Status PipelinedLlep::Forward(const Bf16* u, const int32_t* chosen, const float* gates, int64_t tokens,
                                    const ExpertWeightsT<Bf16>& w, Bf16* out) {
  return ForwardT<Bf16>(u, chosen, gates, tokens, w, out);
}

absl::Status PipelinedLlep::Backward(const float* dout, const ExpertWeights& w, float* du, float* dgates,
                                     const ExpertGrads& g) {
  return BackwardT<float>(dout, w, du, dgates, g);
}

absl::Status PipelinedLlep::Backward(const Bf16* dout, const ExpertWeightsT<Bf16>& w, Bf16* du, float* dgates,
                                     const ExpertGradsT<Bf16>& g) {
  return BackwardT<Bf16>(dout, w, du, dgates, g);
}

}  // namespace plateau
