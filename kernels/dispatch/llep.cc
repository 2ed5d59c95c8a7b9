#include "kernels/dispatch/llep.h"

#include <numeric>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace plateau {

absl::StatusOr<std::unique_ptr<Llep>> Llep::Create(const ModelConfig& model,
                                                   const LlepOptions& options, Backend& backend,
                                                   ModelKernels& kernels, Communicator& experts,
                                                   Stream& compute, Stream& comm) {
  PLATEAU_RETURN_IF_ERROR(ValidateLlepOptions(options));
  PLATEAU_RETURN_IF_ERROR(ValidateLlepShape(model, experts.size()));
  return std::unique_ptr<Llep>(
      new Llep(model, options, backend, kernels, experts, compute, comm));
}

Llep::Llep(const ModelConfig& model, const LlepOptions& options, Backend& backend,
           ModelKernels& kernels, Communicator& experts, Stream& compute, Stream& comm)
    : model_(model),
      options_(options),
      backend_(backend),
      comm_(experts),
      compute_(compute),
      comm_stream_(comm),
      runner_(model, backend, kernels, experts, compute, comm) {}

void Llep::Release() {
  forward_done_ = false;
  gates_ = nullptr;
  mem_ = LlepChunkMemory{};
  buffers_.clear();  // each goes back once queued work is done with it (memory.h)
}

absl::Status Llep::Forward(const float* u, const int32_t* chosen, const float* gates,
                           int64_t tokens, const ExpertWeights& w, float* out) {
  Release();
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
      backend_, {LlepBuffers(model_, P, LlepChunkSizes{}).front()}, &buffers_));
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
  std::vector<DispatchBufferSpec> specs = LlepBuffers(model_, P, sizes_);
  specs.erase(specs.begin());
  PLATEAU_RETURN_IF_ERROR(AllocateDispatchBuffers(backend_, specs, &buffers_));
  PLATEAU_ASSIGN_OR_RETURN(mem_, CarveChunk(model_, sizes_, buffers_, 1));
  std::vector<int32_t> index(mem_.layout.total);
  WriteChunkIndex(plan_, mem_.layout, index.data());
  PLATEAU_RETURN_IF_ERROR(runner_.UploadIndex(index.data(), mem_));  // a host vector: done here

  PLATEAU_RETURN_IF_ERROR(runner_.ShipWeights(plan_, mem_, w));
  PLATEAU_RETURN_IF_ERROR(runner_.DispatchRows(plan_, mem_, u));
  PLATEAU_RETURN_IF_ERROR(runner_.ExpertForward(plan_, mem_, w));
  PLATEAU_RETURN_IF_ERROR(runner_.ReturnOutputs(plan_, mem_));
  PLATEAU_RETURN_IF_ERROR(runner_.Combine(plan_, mem_, gates, out));
  gates_ = gates;
  forward_done_ = true;
  return absl::OkStatus();
}

absl::Status Llep::Backward(const float* dout, const ExpertWeights& w, float* du, float* dgates,
                            const ExpertGrads& g) {
  if (!forward_done_) {
    return absl::FailedPreconditionError("Llep::Backward needs the layer's Forward first");
  }
  // The forward's x, gate, up, act and returned outputs are still held.
  PLATEAU_RETURN_IF_ERROR(runner_.GateGrads(plan_, mem_, dout, dgates));
  PLATEAU_RETURN_IF_ERROR(runner_.DispatchOutputGrads(plan_, mem_, dout, gates_));
  PLATEAU_RETURN_IF_ERROR(runner_.ExpertBackward(plan_, mem_, w, g));
  PLATEAU_RETURN_IF_ERROR(runner_.ReturnInputGrads(plan_, mem_, du));
  PLATEAU_RETURN_IF_ERROR(runner_.ReturnWeightGrads(plan_, mem_, g));
  Release();
  return absl::OkStatus();
}

}  // namespace plateau
