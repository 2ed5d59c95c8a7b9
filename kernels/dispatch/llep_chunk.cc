#include "kernels/dispatch/llep_chunk.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/model/working_ops.h"
#include "kernels/status_macros.h"

namespace plateau {
absl::Status AllocateDispatchBuffers(Backend& backend, const std::vector<DispatchBufferSpec>& specs,
                                     std::vector<Buffer>* out) {
  for (const DispatchBufferSpec& s : specs) {
    PLATEAU_ASSIGN_OR_RETURN(Buffer b, backend.device().Allocate(LiveSet::kDispatch,
                                                                 static_cast<size_t>(s.bytes)));
    out->push_back(std::move(b));
  }
  return absl::OkStatus();
}

template <typename W>
absl::StatusOr<LlepChunkMemoryT<W>> CarveChunk(const ModelConfig& model, const LlepChunkSizes& sizes,
                                               const std::vector<Buffer>& buffers, size_t first) {
  const ElementBytes e = std::is_same_v<W, float> ? kFp32Elements : kBf16MixedElements;
  const std::vector<DispatchBufferSpec> specs = LlepChunkBuffers(model, sizes, e);
  if (buffers.size() < first + specs.size()) {
    return absl::InternalError("CarveChunk: fewer buffers than LlepChunkBuffers lists");
  }
  auto at = [&](size_t i) -> void* {
    return buffers[first + i].data();
  };
  for (size_t i = 0; i < specs.size(); ++i) {
    if (static_cast<int64_t>(buffers[first + i].bytes()) != specs[i].bytes ||
        buffers[first + i].live_set() != LiveSet::kDispatch) {
      return absl::InternalError(absl::StrCat("CarveChunk: buffer '", specs[i].name, "' has ",
                                              buffers[first + i].bytes(), " bytes, the plan ",
                                              specs[i].bytes));
    }
  }
  const int64_t S = sizes.routes, R = sizes.rows, F = model.expert_ffn;
  LlepChunkMemoryT<W> m;
  m.sizes = sizes;
  m.layout = LlepIndexLayoutOf(sizes);
  // The order of LlepChunkBuffers: index, scalars, send, recv, x, t, ffn,
  // token_rows, borrowed_weights, borrowed_grads, lent.
  m.index = static_cast<int32_t*>(at(0));
  float* scalars = static_cast<float*>(at(1));
  m.gates_sent = scalars;
  if (sizes.token_view) {
    m.chunk_gates = scalars + S;
    m.chunk_dgates = scalars + 2 * S;
  }
  m.send = static_cast<W*>(at(2));
  m.recv = static_cast<W*>(at(3));
  m.x = static_cast<W*>(at(4));
  m.t = static_cast<W*>(at(5));
  W* ffn = static_cast<W*>(at(6));
  if (ffn != nullptr) {
    m.gate = ffn;
    m.up = ffn + R * F;
    m.act = ffn + 2 * R * F;
    m.dact = ffn + 3 * R * F;
    m.dup = ffn + 4 * R * F;
  }
  m.token_rows = static_cast<W*>(at(7));
  m.borrowed_weights = static_cast<W*>(at(8));
  m.borrowed_grads = static_cast<W*>(at(9));
  m.lent = static_cast<W*>(at(10));
  return m;
}

template absl::StatusOr<LlepChunkMemoryT<float>> CarveChunk<float>(const ModelConfig&, const LlepChunkSizes&,
                                                                    const std::vector<Buffer>&, size_t);
template absl::StatusOr<LlepChunkMemoryT<Bf16>> CarveChunk<Bf16>(const ModelConfig&, const LlepChunkSizes&,
                                                                  const std::vector<Buffer>&, size_t);

void WriteChunkIndex(const LlepRankPlan& p, const LlepIndexLayout& l, int32_t* dst) {
  auto put = [&](const std::vector<int32_t>& v, int64_t off) {
    if (!v.empty()) std::memcpy(dst + off, v.data(), v.size() * sizeof(int32_t));
  };
  put(p.send_index, l.send_index);
  put(p.route_at_pos, l.route_at_pos);
  put(p.route_pos, l.route_pos);
  put(p.perm, l.perm);
  put(p.inv_perm, l.inv_perm);
  put(p.token_rows, l.token_rows);
  put(p.chunk_routes, l.chunk_routes);
}

template <typename W>
LlepChunkRunnerT<W>::LlepChunkRunnerT(const ModelConfig& model, Backend& backend, ModelKernels& kernels,
                                 Communicator& experts, Stream& compute, Stream& comm)
    : model_(model),
      backend_(backend),
      kernels_(kernels),
      comm_(experts),
      compute_(compute),
      comm_stream_(comm),
      local_experts_(model.experts / experts.size()) {}

template <typename W>
absl::Status LlepChunkRunnerT<W>::Fits(const LlepRankPlan& p, const LlepChunkMemoryT<W>& m) const {
  const LlepChunkSizes need = LlepChunkSizesOf(p), have = m.sizes;
  if (need.tokens > have.tokens || need.routes > have.routes || need.rows > have.rows ||
      need.borrowed > have.borrowed || need.lent > have.lent ||
      (need.token_view && !have.token_view)) {
    return absl::InternalError(absl::StrCat(
        "dispatch bound broken: the chunk needs (tokens ", need.tokens, ", routes ", need.routes,
        ", rows ", need.rows, ", borrowed ", need.borrowed, ", lent ", need.lent,
        need.token_view ? ", token view" : "", ") but its buffers hold (", have.tokens, ", ",
        have.routes, ", ", have.rows, ", ", have.borrowed, ", ", have.lent,
        have.token_view ? ", token view" : "", ")"));
  }
  return absl::OkStatus();
}

template <typename W>
absl::Status LlepChunkRunnerT<W>::Exchange(const W* send, absl::Span<const int64_t> send_rows,
                                       W* recv, absl::Span<const int64_t> recv_rows,
                                       int64_t width) {
  std::vector<int64_t> sc(send_rows.size()), rc(recv_rows.size());
  for (size_t i = 0; i < sc.size(); ++i) sc[i] = send_rows[i] * width;
  for (size_t i = 0; i < rc.size(); ++i) rc[i] = recv_rows[i] * width;
  if (ready_ == nullptr) {
    PLATEAU_ASSIGN_OR_RETURN(ready_, backend_.CreateEvent());
    PLATEAU_ASSIGN_OR_RETURN(landed_, backend_.CreateEvent());
  }
  PLATEAU_RETURN_IF_ERROR(compute_.Record(*ready_));
  PLATEAU_RETURN_IF_ERROR(comm_stream_.Wait(*ready_));
  PLATEAU_RETURN_IF_ERROR(comm_.AllToAllV(comm_stream_, send, sc, recv, rc, kWorkingDataType<W>));
  PLATEAU_RETURN_IF_ERROR(comm_stream_.Record(*landed_));
  return compute_.Wait(*landed_);
}

template <typename W>
absl::Status LlepChunkRunnerT<W>::UploadIndex(const int32_t* host, const LlepChunkMemoryT<W>& m) {
  return backend_.Copy(compute_, m.index, host, m.layout.total * sizeof(int32_t));
}

template <typename W>
absl::Status LlepChunkRunnerT<W>::ShipWeights(const LlepRankPlan& p, const LlepChunkMemoryT<W>& m,
                                          const ExpertWeightsT<W>& w) {
  if (!p.transfers) return absl::OkStatus();  // every rank skips it together
  const int64_t HF = model_.hidden * model_.expert_ffn, X = 3 * HF;
  const size_t bytes = HF * sizeof(W);
  const int64_t first = static_cast<int64_t>(comm_.rank()) * local_experts_;
  for (size_t i = 0; i < p.lent.size(); ++i) {
    const int64_t le = p.lent[i].second - first;
    W* dst = m.lent + i * X;
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(compute_, dst, w.w_gate + le * HF, bytes));
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(compute_, dst + HF, w.w_up + le * HF, bytes));
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(compute_, dst + 2 * HF, w.w_down + le * HF, bytes));
  }
  return Exchange(m.lent, p.lent_to, m.borrowed_weights, p.borrowed_from, X);
}

template <typename W>
absl::Status LlepChunkRunnerT<W>::DispatchRows(const LlepRankPlan& p, const LlepChunkMemoryT<W>& m,
                                           const W* u) {
  using Ops = WorkingOps<W>;
  const int64_t H = model_.hidden, S = p.routes(), R = p.rows();
  const int32_t* idx = m.index;
  PLATEAU_RETURN_IF_ERROR(Ops::GatherRows(kernels_, compute_, u, p.layer_tokens,
                                          idx + m.layout.send_index, nullptr, S, H, m.send));
  PLATEAU_RETURN_IF_ERROR(Exchange(m.send, p.send_rows, m.recv, p.recv_rows, H));
  return Ops::GatherRows(kernels_, compute_, m.recv, R, idx + m.layout.perm, nullptr, R, H, m.x);
}

template <typename W>
typename LlepChunkRunnerT<W>::GroupWeights LlepChunkRunnerT<W>::WeightsOf(const LlepGroup& g,
                                                         const LlepChunkMemoryT<W>& m,
                                                         const ExpertWeightsT<W>& w) const {
  const int64_t HF = model_.hidden * model_.expert_ffn;
  if (g.local >= 0) {
    return {w.w_gate + g.local * HF, w.w_up + g.local * HF, w.w_down + g.local * HF};
  }
  const W* b = m.borrowed_weights + g.borrowed * 3 * HF;
  return {b, b + HF, b + 2 * HF};
}

template <typename W>
std::vector<ExpertGroupT<W>> LlepChunkRunnerT<W>::Groups(const LlepRankPlan& p, const LlepChunkMemoryT<W>& m,
                                                         const ExpertWeightsT<W>& w, const ExpertGradsT<W>* grads,
                                                         const ExpertGradAccum* acc) const {
  const int64_t HF = model_.hidden * model_.expert_ffn;
  std::vector<ExpertGroupT<W>> out;
  out.reserve(p.groups.size());
  for (const LlepGroup& g : p.groups) {
    const GroupWeights gw = WeightsOf(g, m, w);
    ExpertGroupT<W> e;
    e.rows = g.rows;
    e.w_gate = gw.gate;
    e.w_up = gw.up;
    e.w_down = gw.down;
    if (grads != nullptr) {
      // Own experts accumulate into the caller's gradients; a borrowed
      // expert's gradient is this rank's alone, overwritten, then sent home.
      if (g.local >= 0) {
        e.dw_gate = grads->w_gate + g.local * HF;
        e.dw_up = grads->w_up + g.local * HF;
        e.dw_down = grads->w_down + g.local * HF;
        e.dw_beta = 1.0f;
        if (acc != nullptr) {
          e.dw_gate_fp32 = acc->w_gate + g.local * HF;
          e.dw_up_fp32 = acc->w_up + g.local * HF;
          e.dw_down_fp32 = acc->w_down + g.local * HF;
        }
      } else {
        e.dw_gate = m.borrowed_grads + g.borrowed * 3 * HF;
        e.dw_up = e.dw_gate + HF;
        e.dw_down = e.dw_gate + 2 * HF;
        e.dw_beta = 0.0f;
      }
    }
    out.push_back(e);
  }
  return out;
}

template <typename W>
absl::Status LlepChunkRunnerT<W>::ExpertForward(const LlepRankPlan& p, const LlepChunkMemoryT<W>& m,
                                            const ExpertWeightsT<W>& w) {
  return ExpertMlpForward(backend_, compute_, model_.hidden, model_.expert_ffn,
                          Groups(p, m, w, nullptr), m.x, m.gate, m.up, m.act, m.recv);
}

template <typename W>
absl::Status LlepChunkRunnerT<W>::ReturnOutputs(const LlepRankPlan& p, const LlepChunkMemoryT<W>& m) {
  const int64_t H = model_.hidden, R = p.rows();
  PLATEAU_RETURN_IF_ERROR(WorkingOps<W>::GatherRows(kernels_, compute_, m.recv, R, m.index + m.layout.inv_perm,
                                                    nullptr, R, H, m.t));
  return Exchange(m.t, p.recv_rows, m.send, p.send_rows, H);
}

// A contiguous chunk (LLEP, K = 1, contiguous membership) adds straight into
// the caller's rows, in CombineRows' order (out + w_0 y_0 + w_1 y_1 ...). A
// strided chunk gathers its token rows, combines the same way and scatters
// them back, so both give the same bits for the same expert outputs.
template <typename W>
absl::Status LlepChunkRunnerT<W>::CombineInto(const LlepRankPlan& p, const LlepChunkMemoryT<W>& m,
                                          const W* src, const float* gates, W* dst) {
  using Ops = WorkingOps<W>;
  const int64_t H = model_.hidden, K = model_.top_k, n = p.tokens, N = p.layer_tokens;
  const int64_t S = m.sizes.routes;  // src rows (send order)
  const int32_t* pos = m.index + m.layout.route_pos;
  if (n == 0) return absl::OkStatus();
  if (p.first_token >= 0) {
    const int64_t t0 = p.first_token;
    return Ops::CombineRows(kernels_, compute_, src, S, pos, gates == nullptr ? nullptr : gates + t0 * K, n,
                            K, H, dst + t0 * H);
  }
  const int32_t* tokens = m.index + m.layout.token_rows;
  const float* w = nullptr;
  if (gates != nullptr) {
    PLATEAU_RETURN_IF_ERROR(kernels_.GatherRows(compute_, gates, N * K,
                                                m.index + m.layout.chunk_routes, nullptr, n * K,
                                                1, m.chunk_gates));
    w = m.chunk_gates;
  }
  PLATEAU_RETURN_IF_ERROR(Ops::GatherRows(kernels_, compute_, dst, N, tokens, nullptr, n, H, m.token_rows));
  PLATEAU_RETURN_IF_ERROR(Ops::CombineRows(kernels_, compute_, src, S, pos, w, n, K, H, m.token_rows));
  return Ops::ScatterRows(kernels_, compute_, m.token_rows, n, tokens, H, dst, N);
}

template <typename W>
absl::Status LlepChunkRunnerT<W>::Combine(const LlepRankPlan& p, const LlepChunkMemoryT<W>& m,
                                      const float* gates, W* out) {
  return CombineInto(p, m, m.send, gates, out);
}

template <typename W>
absl::Status LlepChunkRunnerT<W>::GateGrads(const LlepRankPlan& p, const LlepChunkMemoryT<W>& m,
                                        const W* dout, float* dgates) {
  using Ops = WorkingOps<W>;
  const int64_t H = model_.hidden, K = model_.top_k, n = p.tokens, N = p.layer_tokens;
  const int64_t S = m.sizes.routes;  // rows of m.send
  const int32_t* pos = m.index + m.layout.route_pos;
  if (n == 0) return absl::OkStatus();
  if (p.first_token >= 0) {
    const int64_t t0 = p.first_token;
    return Ops::RowDots(kernels_, compute_, dout + t0 * H, m.send, S, pos, n, K, H, dgates + t0 * K);
  }
  PLATEAU_RETURN_IF_ERROR(Ops::GatherRows(kernels_, compute_, dout, N, m.index + m.layout.token_rows, nullptr, n,
                                          H, m.token_rows));
  PLATEAU_RETURN_IF_ERROR(Ops::RowDots(kernels_, compute_, m.token_rows, m.send, S, pos, n, K, H, m.chunk_dgates));
  return kernels_.ScatterRows(compute_, m.chunk_dgates, n * K, m.index + m.layout.chunk_routes, 1,
                              dgates, N * K);
}

template <typename W>
absl::Status LlepChunkRunnerT<W>::DispatchOutputGrads(const LlepRankPlan& p, const LlepChunkMemoryT<W>& m,
                                                  const W* dout, const float* gates) {
  using Ops = WorkingOps<W>;
  const int64_t H = model_.hidden, K = model_.top_k, S = p.routes(), R = p.rows();
  const int64_t N = p.layer_tokens;
  PLATEAU_RETURN_IF_ERROR(kernels_.GatherRows(compute_, gates, N * K,
                                              m.index + m.layout.route_at_pos, nullptr, S, 1,
                                              m.gates_sent));
  PLATEAU_RETURN_IF_ERROR(Ops::GatherRows(kernels_, compute_, dout, N, m.index + m.layout.send_index,
                                          m.gates_sent, S, H, m.send));
  PLATEAU_RETURN_IF_ERROR(Exchange(m.send, p.send_rows, m.recv, p.recv_rows, H));
  return Ops::GatherRows(kernels_, compute_, m.recv, R, m.index + m.layout.perm, nullptr, R, H, m.t);
}

template <typename W>
absl::Status LlepChunkRunnerT<W>::ExpertBackward(const LlepRankPlan& p, const LlepChunkMemoryT<W>& m,
                                                 const ExpertWeightsT<W>& w, const ExpertGradsT<W>& grads,
                                                 const ExpertGradAccum* acc) {
  // act is consumed: it carries d gate from SwiGLU's backward on; dx goes
  // to recv.
  return ExpertMlpBackward(backend_, compute_, model_.hidden, model_.expert_ffn, Groups(p, m, w, &grads, acc), m.x, m.t,
                           m.gate, m.up, m.act, m.dact, m.act, m.dup, m.recv);
}

template <typename W>
absl::Status LlepChunkRunnerT<W>::ReturnInputGrads(const LlepRankPlan& p, const LlepChunkMemoryT<W>& m,
                                               W* du) {
  const int64_t H = model_.hidden, R = p.rows();
  // x is consumed by ExpertBackward: it carries dx, source-major.
  PLATEAU_RETURN_IF_ERROR(WorkingOps<W>::GatherRows(kernels_, compute_, m.recv, R, m.index + m.layout.inv_perm,
                                                    nullptr, R, H, m.x));
  PLATEAU_RETURN_IF_ERROR(Exchange(m.x, p.recv_rows, m.send, p.send_rows, H));
  return CombineInto(p, m, m.send, nullptr, du);
}

template <typename W>
absl::Status LlepChunkRunnerT<W>::ReturnWeightGrads(const LlepRankPlan& p, const LlepChunkMemoryT<W>& m,
                                                    const ExpertGradsT<W>& g, const ExpertGradAccum* acc) {
  if (!p.transfers) return absl::OkStatus();
  const int64_t HF = model_.hidden * model_.expert_ffn, X = 3 * HF;
  PLATEAU_RETURN_IF_ERROR(Exchange(m.borrowed_grads, p.borrowed_from, m.lent, p.lent_to, X));
  const int64_t first = static_cast<int64_t>(comm_.rank()) * local_experts_;
  if constexpr (std::is_same_v<W, Bf16>) {
    if (acc == nullptr) {
      // One fp32 sum per expert, rounded once: the owner's gradient, then its
      // helpers' in ascending rank (lent is helper-major, so an expert's
      // slots are in that order). Added one at a time in bf16, P - 1 alike
      // terms lost a rounding each.
      std::vector<std::vector<int32_t>> slots(local_experts_);
      for (size_t i = 0; i < p.lent.size(); ++i) slots[p.lent[i].second - first].push_back(static_cast<int32_t>(i));
      Bf16* const parts[3] = {g.w_gate, g.w_up, g.w_down};  // [gate | up | down], as sent
      for (int64_t le = 0; le < local_experts_; ++le) {
        if (slots[le].empty()) continue;
        for (int j = 0; j < 3; ++j) {
          PLATEAU_RETURN_IF_ERROR(
              backend_.AddRowsBf16(compute_, parts[j] + le * HF, m.lent + j * HF, slots[le], X, HF));
        }
      }
      return absl::OkStatus();
    }
  }
  // fp32, or the fp32 accumulators: helper-major, an expert's helpers are
  // added in ascending rank (each add fp32: the same sum as one in order).
  for (size_t i = 0; i < p.lent.size(); ++i) {
    const int64_t le = p.lent[i].second - first;
    const W* src = m.lent + i * X;
    if (acc != nullptr) {                                             // each part loaded exactly, then added in fp32
      float* const parts[3] = {acc->w_gate, acc->w_up, acc->w_down};  // [gate | up | down], as sent
      for (int j = 0; j < 3; ++j) {
        float* dst = parts[j] + le * HF;
        PLATEAU_RETURN_IF_ERROR(WorkingOps<W>::ToFloat(backend_, compute_, acc->scratch, src + j * HF, HF));
        PLATEAU_RETURN_IF_ERROR(backend_.Add(compute_, dst, dst, acc->scratch, HF));
      }
      continue;
    }
    using Ops = WorkingOps<W>;
    PLATEAU_RETURN_IF_ERROR(Ops::Add(backend_, compute_, g.w_gate + le * HF, g.w_gate + le * HF, src, HF));
    PLATEAU_RETURN_IF_ERROR(Ops::Add(backend_, compute_, g.w_up + le * HF, g.w_up + le * HF, src + HF, HF));
    PLATEAU_RETURN_IF_ERROR(
        Ops::Add(backend_, compute_, g.w_down + le * HF, g.w_down + le * HF, src + 2 * HF, HF));
  }
  return absl::OkStatus();
}

template class LlepChunkRunnerT<float>;
template class LlepChunkRunnerT<Bf16>;

}  // namespace plateau
