#include "kernels/dispatch/llep.h"

#include <numeric>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace plateau {

absl::StatusOr<std::unique_ptr<Llep>> Llep::Create(const ModelConfig& model,
                                                   const LlepOptions& options, Backend& backend,
                                                   ModelKernels& kernels, Communicator& experts,
                                                   Stream& compute, Stream& comm, const ElementBytes& e) {
  PLATEAU_RETURN_IF_ERROR(ValidateLlepOptions(options));
  PLATEAU_RETURN_IF_ERROR(ValidateLlepShape(model, experts.size()));
  return std::unique_ptr<Llep>(
      new Llep(model, options, backend, kernels, experts, compute, comm, !e.working_is_master()));
}

Llep::Llep(const ModelConfig& model, const LlepOptions& options, Backend& backend,
           ModelKernels& kernels, Communicator& experts, Stream& compute, Stream& comm, bool bf16)
    : model_(model),
      options_(options),
      backend_(backend),
      comm_(experts),
      compute_(compute),
      comm_stream_(comm),
      bf16_(bf16),
      runner_(model, backend, kernels, experts, compute, comm),
      runner_bf16_(model, backend, kernels, experts, compute, comm) {}

template <>
LlepChunkRunnerT<float>& Llep::Runner<float>() {
  return runner_;
}
template <>
LlepChunkRunnerT<Bf16>& Llep::Runner<Bf16>() {
  return runner_bf16_;
}
template <>
LlepChunkMemoryT<float>& Llep::Mem<float>() {
  return mem_;
}
template <>
LlepChunkMemoryT<Bf16>& Llep::Mem<Bf16>() {
  return mem_bf16_;
}

void Llep::Release() {
  forward_done_ = false;
  gates_ = nullptr;
  mem_ = LlepChunkMemory{};
  mem_bf16_ = LlepChunkMemoryT<Bf16>{};
  buffers_.clear();  // each goes back once queued work is done with it (memory.h)
}

template <typename W>
absl::Status Llep::ForwardT(const W* u, const int32_t* chosen, const float* gates, int64_t tokens,
                            const ExpertWeightsT<W>& w, W* out) {
  if (bf16_ != std::is_same_v<W, Bf16>) {
    return absl::InternalError(absl::StrCat("Llep: made for ", bf16_ ? "bf16" : "fp32", " rows, called with ",
                                            bf16_ ? "fp32" : "bf16", " ones"));
  }
  Release();
  const ElementBytes e = std::is_same_v<W, Bf16> ? kBf16MixedElements : kFp32Elements;
  LlepChunkRunnerT<W>& runner = Runner<W>();
  LlepChunkMemoryT<W>& mem = Mem<W>();
  const int64_t P = comm_.size(), E = model_.experts, K = model_.top_k, N = tokens;
  if (N < 0) return absl::InvalidArgumentError(absl::StrCat("Llep::Forward: tokens = ", N));
  std::vector<int32_t> host_chosen(N * K);
  // Into host memory: done when Copy returns (backend.h).
  PLATEAU_RETURN_IF_ERROR(
      backend_.Copy(compute_, host_chosen.data(), chosen, host_chosen.size() * sizeof(int32_t)));
  std::vector<int64_t> mine(E, 0);
  for (int32_t e : host_chosen) {
    if (e < 0 || e >= E) {
      return absl::InternalError(absl::StrCat("router chose expert ", e, " of ", E));
    }
    ++mine[e];
  }

  // Everyone's counts: the "counts" buffer, first in LlepBuffers' list (its
  // size does not depend on the routes).
  PLATEAU_RETURN_IF_ERROR(AllocateDispatchBuffers(
      backend_, {LlepBuffers(model_, P, LlepChunkSizes{}, e).front()}, &buffers_));
  int64_t* counts = buffers_[0].as<int64_t>();
  std::vector<int64_t> all(P * E);
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(compute_, counts, mine.data(), E * sizeof(int64_t)));
  PLATEAU_RETURN_IF_ERROR(
      comm_.AllGather(comm_stream_, counts, counts + E, E, DataType::kInt64));
  PLATEAU_RETURN_IF_ERROR(
      backend_.Copy(comm_stream_, all.data(), counts + E, all.size() * sizeof(int64_t)));

  std::vector<int64_t> loads(E, 0);
  for (int64_t s = 0; s < P; ++s) {
    for (int64_t e = 0; e < E; ++e) loads[e] += all[s * E + e];
  }
  assignment_ = AssignLlep(loads, P, options_);
  std::vector<int32_t> rows(N);
  std::iota(rows.begin(), rows.end(), 0);
  PLATEAU_ASSIGN_OR_RETURN(plan_, PlanLlepRank(assignment_, all, comm_.rank(), P, model_,
                                               host_chosen, N, rows));
  sizes_ = LlepChunkSizesOf(plan_);

  // The rest of the list at this layer's sizes.
  std::vector<DispatchBufferSpec> specs = LlepBuffers(model_, P, sizes_, e);
  specs.erase(specs.begin());
  PLATEAU_RETURN_IF_ERROR(AllocateDispatchBuffers(backend_, specs, &buffers_));
  PLATEAU_ASSIGN_OR_RETURN(mem, CarveChunk<W>(model_, sizes_, buffers_, 1));
  std::vector<int32_t> index(mem.layout.total);
  WriteChunkIndex(plan_, mem.layout, index.data());
  PLATEAU_RETURN_IF_ERROR(runner.UploadIndex(index.data(), mem));  // a host vector: done here

  PLATEAU_RETURN_IF_ERROR(runner.ShipWeights(plan_, mem, w));
  PLATEAU_RETURN_IF_ERROR(runner.DispatchRows(plan_, mem, u));
  PLATEAU_RETURN_IF_ERROR(runner.ExpertForward(plan_, mem, w));
  PLATEAU_RETURN_IF_ERROR(runner.ReturnOutputs(plan_, mem));
  PLATEAU_RETURN_IF_ERROR(runner.Combine(plan_, mem, gates, out));
  gates_ = gates;
  forward_done_ = true;
  return absl::OkStatus();
}

template <typename W>
absl::Status Llep::BackwardT(const W* dout, const ExpertWeightsT<W>& w, W* du, float* dgates,
                             const ExpertGradsT<W>& g) {
  if (bf16_ != std::is_same_v<W, Bf16>) {
    return absl::InternalError(absl::StrCat("Llep: made for ", bf16_ ? "bf16" : "fp32", " rows, called with ",
                                            bf16_ ? "fp32" : "bf16", " ones"));
  }
  if (!forward_done_) return absl::FailedPreconditionError("Llep::Backward needs the layer's Forward first");
  LlepChunkRunnerT<W>& runner = Runner<W>();
  const LlepChunkMemoryT<W>& mem = Mem<W>();
  // The forward's x, gate, up, act and returned outputs are still held.
  PLATEAU_RETURN_IF_ERROR(runner.GateGrads(plan_, mem, dout, dgates));
  PLATEAU_RETURN_IF_ERROR(runner.DispatchOutputGrads(plan_, mem, dout, gates_));
  PLATEAU_RETURN_IF_ERROR(runner.ExpertBackward(plan_, mem, w, g));
  PLATEAU_RETURN_IF_ERROR(runner.ReturnInputGrads(plan_, mem, du));
  PLATEAU_RETURN_IF_ERROR(runner.ReturnWeightGrads(plan_, mem, g));
  Release();
  return absl::OkStatus();
}

absl::Status Llep::Forward(const float* u, const int32_t* chosen, const float* gates, int64_t tokens,
                           const ExpertWeights& w, float* out) {
  return ForwardT<float>(u, chosen, gates, tokens, w, out);
}

absl::Status Llep::Forward(const Bf16* u, const int32_t* chosen, const float* gates, int64_t tokens,
                           const ExpertWeightsT<Bf16>& w, Bf16* out) {
  return ForwardT<Bf16>(u, chosen, gates, tokens, w, out);
}

absl::Status Llep::Backward(const float* dout, const ExpertWeights& w, float* du, float* dgates,
                            const ExpertGrads& g) {
  return BackwardT<float>(dout, w, du, dgates, g);
}

absl::Status Llep::Backward(const Bf16* dout, const ExpertWeightsT<Bf16>& w, Bf16* du, float* dgates,
                            const ExpertGradsT<Bf16>& g) {
  return BackwardT<Bf16>(dout, w, du, dgates, g);
}

}  // namespace plateau
